"""Gathering embeddings across processes with gradient.

Follows open_clip's ``loss.py`` pattern: each rank keeps its local anchors and scores them
against the candidates of every rank. The gather is a small autograd Function of our own
because, with torch 2.11 and gloo, ``torch.distributed.nn.functional.all_gather`` returns
wrong gradients (silently) when the incoming gradient is non-contiguous (shared/STACK.md).

Backward sums the gradient of the gathered tensor over ranks (every rank's loss depends on
every rank's embeddings) and returns this rank's slice. With that, the mean of the ranks'
losses equals the single-process loss on the concatenated batch, and DDP's gradient
averaging reproduces the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
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
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = ctx.rank * ctx.local_size
        return grad[start : start + ctx.local_size]


def check_equal_local_sizes(local_size: int, device: torch.device) -> None:
    """All ranks must hold the same number of samples (Accelerate's even_batches does this)."""
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([local_size], dtype=torch.long, device=device))
    values = [int(s.item()) for s in sizes]
    if len(set(values)) != 1:
        raise ValueError(
            f"distributed objective: every rank must hold the same number of samples K, got {values} "
            "(use even batches, e.g. drop_last=True or Accelerate's even_batches)"
        )


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` ([K, ...]) of every rank along dim 0, keeping gradients."""
    if world_size() == 1:
        return local
    return _GatherWithGrad.apply(local)


def gather_no_grad(local: torch.Tensor) -> torch.Tensor:
    if world_size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=0)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a (non-differentiable) tensor over ranks; returns a new tensor."""
    if world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
