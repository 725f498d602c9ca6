"""Every collective call of the objectives: gathering embeddings across processes (with or
without gradient), summing and averaging over ranks. Objectives never call
``torch.distributed`` directly; each function here is the identity on one process.

Follows open_clip's ``loss.py`` pattern: each rank keeps its local anchors and scores them
against the candidates of every rank. The gather with gradient is a small autograd Function
of our own rather than ``torch.distributed.nn.functional.all_gather``: with torch 2.11 and
the gloo backend, that function returns wrong gradients, without any error, when the
gradient flowing back into the gathered tensor is not contiguous in memory -- which is the
ordinary case here, since the objectives index and transpose the gathered ``[N, M, d]``
tensor. (The functional-collectives variant refuses such a gradient with an error instead.)
Our backward makes the gradient contiguous before reducing it, and the distributed tests
compare it with single-process gradients using two real processes.

Backward sums the gradient of the gathered tensor over ranks (every rank's loss depends on
every rank's embeddings) and returns this rank's slice. With that, the mean of the ranks'
losses equals the single-process loss on the concatenated batch, and DDP's gradient
averaging reproduces the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def world_size() -> int:
    """Number of processes of the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        local = local.contiguous()
        ctx.rank, ctx.local_size = dist.get_rank(), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=0)

    @staticmethod
    @once_differentiable  # a second derivative through these hand-written passes would be wrong
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = ctx.rank * ctx.local_size
        return grad[start : start + ctx.local_size]


# Local sizes K this process has seen checked with a host read (see check_equal_local_sizes).
_checked_local_sizes: set[int] = set()


def check_equal_local_sizes(local_size: int, device: torch.device, host_check: bool = True) -> None:
    """All ranks must hold the same number of samples (Accelerate's even_batches does this):
    ``ValueError`` listing every rank's K otherwise.

    The sizes are gathered at every call (a collective every rank issues, so that the ranks'
    collectives stay in step whatever each has seen before). Reading them on the host is a
    device synchronisation, so with ``host_check=False`` (the objective's ``check_inputs`` off,
    as in training) they are read only the first time this process sees ``local_size``; later
    calls check them with a device-side assertion (``torch._assert_async``: on CPU it raises at
    once, on CUDA at the next synchronisation, and the rank that sees a new size raises the
    ``ValueError``)."""
    local = torch.full((1,), local_size, dtype=torch.long, device=device)  # a fill: no host-to-device copy
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local)
    sizes = torch.cat(parts)
    if not host_check and local_size in _checked_local_sizes:
        torch._assert_async((sizes == local_size).all(), "distributed objective: every rank must hold the same "
                            f"number of samples K (this rank: {local_size})")
        return
    values = sizes.tolist()
    if len(set(values)) != 1:
        raise ValueError(
            f"distributed objective: every rank must hold the same number of samples K, got {values} "
            "(use even batches, e.g. drop_last=True or Accelerate's even_batches)"
        )
    _checked_local_sizes.add(local_size)


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` ([K, ...]) of every rank along dim 0, keeping gradients."""
    if world_size() == 1:
        return local
    return _GatherWithGrad.apply(local)


def gather_no_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` ([K, ...]) of every rank along dim 0, without gradient."""
    if world_size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=0)


def average_(tensor: torch.Tensor) -> torch.Tensor:
    """Replace ``tensor`` in place by its mean over ranks (sum, then divide by the world
    size); returns it. Used to keep replicated auxiliary models (IPMC's critic) identical."""
    world = world_size()
    if world > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= world
    return tensor


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a (non-differentiable) tensor over ranks; returns a new tensor."""
    if world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
