"""Worker of the two-process open_clip comparisons (tests/test_objectives_open_clip.py).

Each rank joins a gloo group, takes its slice of one fixed float64 two-view batch and records,
for ``siglip`` and for each ``dist_impl`` of ``open_clip.loss.SigLipLoss`` (gather, bidir,
shift, reduce), the loss and the gradients w.r.t. this rank's embeddings, the learned log-scale
and the bias; and the same for ``mv_cl1`` with a learned temperature against
``open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True)``. Results go to
``<out_dir>/rank<r>.pt``; the test compares them with each other and with one process.
"""

from __future__ import annotations

import datetime
import math
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

WORLD = 2
K_LOCAL = 5
D = 6
SCALE, BIAS = 7.0, -4.0  # SigLIP's t and b (the test's; the paper starts at 10 and -10)
CLIP_TEMPERATURE = 0.07
SIGLIP_IMPLS = ("gather", "bidir", "shift", "reduce")


def full_batch() -> torch.Tensor:
    """[WORLD * K_LOCAL, 2, D] float64: the concatenation of the ranks' batches."""
    return torch.randn(WORLD * K_LOCAL, 2, D, generator=torch.Generator().manual_seed(52), dtype=torch.float64)


def local_slice(rank: int) -> slice:
    return slice(rank * K_LOCAL, (rank + 1) * K_LOCAL)


def mmviews_siglip(z: torch.Tensor, **params: Any) -> dict[str, torch.Tensor]:
    """siglip's loss and gradients (embeddings, logit_scale, logit_bias) on ``z``."""
    from mmviews.objectives import get_objective

    objective = get_objective("siglip", temperature=1 / SCALE, bias=BIAS, **params)
    z = z.clone().requires_grad_(True)
    loss = objective(z)
    loss.backward()
    return {"loss": loss.detach(), "grad": z.grad, "scale": objective.logit_scale.grad, "bias": objective.logit_bias.grad}


def open_clip_siglip(z: torch.Tensor, rank: int = 0, world: int = 1, dist_impl: str | None = None) -> dict[str, torch.Tensor]:
    """open_clip's SigLipLoss on the unit vectors of ``z`` (images view 0, texts view 1), with
    its own learned log-scale and bias leaves, as open_clip's models pass them."""
    from open_clip.loss import SigLipLoss

    z = z.clone().requires_grad_(True)
    logit_scale = torch.tensor(math.log(SCALE), dtype=torch.float64, requires_grad=True)
    logit_bias = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    u = F.normalize(z, dim=-1)
    # contiguous, as a model's outputs are (open_clip's neighbour exchange sends them as they are)
    images, texts = u[:, 0].contiguous(), u[:, 1].contiguous()
    loss = SigLipLoss(rank=rank, world_size=world, dist_impl=dist_impl)(images, texts, logit_scale.exp(), logit_bias)
    loss.backward()
    return {"loss": loss.detach(), "grad": z.grad, "scale": logit_scale.grad, "bias": logit_bias.grad}


def mmviews_mv_cl1(z: torch.Tensor) -> dict[str, torch.Tensor]:
    from mmviews.objectives import get_objective

    objective = get_objective("mv_cl1", temperature=CLIP_TEMPERATURE, learn_temperature=True)
    z = z.clone().requires_grad_(True)
    loss = objective(z)
    loss.backward()
    return {"loss": loss.detach(), "grad": z.grad, "scale": objective.logit_scale.grad}


def open_clip_clip(z: torch.Tensor, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """open_clip's ClipLoss as its distributed training runs it (local loss, gather with grad)."""
    from open_clip.loss import ClipLoss

    z = z.clone().requires_grad_(True)
    logit_scale = torch.tensor(math.log(1 / CLIP_TEMPERATURE), dtype=torch.float64, requires_grad=True)
    u = F.normalize(z, dim=-1)
    images, texts = u[:, 0].contiguous(), u[:, 1].contiguous()
    loss = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)(images, texts, logit_scale.exp())
    loss.backward()
    return {"loss": loss.detach(), "grad": z.grad, "scale": logit_scale.grad}


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    z = full_batch()[local_slice(rank)]
    cases = {
        "siglip": lambda: mmviews_siglip(z),
        "siglip[chunk_size=2]": lambda: mmviews_siglip(z, chunk_size=2),
        **{f"open_clip[{impl}]": (lambda impl=impl: open_clip_siglip(z, rank, world, impl)) for impl in SIGLIP_IMPLS},
        "mv_cl1": lambda: mmviews_mv_cl1(z),
        "open_clip_clip": lambda: open_clip_clip(z, rank, world),
    }
    results: dict[str, Any] = {}
    for key, run in cases.items():
        try:
            results[key] = run()
        except Exception:  # reported per case by the test
            results[f"{key}|error"] = traceback.format_exc()
    path = Path(out_dir) / f"rank{rank}.pt"
    torch.save(results, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()
