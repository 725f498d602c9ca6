"""What an adapter's forward needs to know about several processes: whether a module takes part
in collectives (SyncBatchNorm, FSDP2 sharding), so that a process with no rows still joins them,
and zeros that mix with sharded parameters."""

from __future__ import annotations

import torch
from torch import nn


def plain_zeros_like(parameter: torch.Tensor, *shape: int) -> torch.Tensor:
    """Zeros of ``shape`` with ``parameter``'s dtype and device, as a plain tensor: outside a
    forward, a sharded (FSDP2) parameter is a DTensor, and its ``new_zeros`` would be one too,
    which plain tensors cannot be mixed with."""
    return torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)


def _process_group_of_several() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def syncs_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` holds a :class:`torch.nn.SyncBatchNorm` in training mode whose process
    group has more than one process: its training forward shares batch statistics across them."""
    import torch.distributed as dist

    if not _process_group_of_several():
        return False
    return any(isinstance(m, nn.SyncBatchNorm) and m.training
               and dist.get_world_size(m.process_group or dist.group.WORLD) > 1 for m in module.modules())


def runs_collectives(module: nn.Module) -> bool:
    """Whether a forward of ``module`` (in its current modes) takes part in collectives on a
    process group of more than one process: it holds a SyncBatchNorm in training mode
    (:func:`syncs_batch_norm`), or a module sharded by FSDP2 (``distributed.sharding: fsdp``:
    every forward gathers its parameters, every backward reduce-scatters their gradients). Every
    process must then run that forward (and its backward) as often as the others, even with no
    rows of its own: a process that skips it leaves the others waiting in the collective (a hang
    under NCCL)."""
    if not _process_group_of_several():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or syncs_batch_norm(module)
