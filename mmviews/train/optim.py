"""Optimisers and learning-rate schedules built from :class:`OptimisationConfig`.

AdamW and SGD come from ``torch.optim``; the schedules from ``transformers``. LARS (You et
al., 2017) is not in torch, so a small one is here: SGD with momentum whose per-tensor
step is scaled by the trust ratio ``eta * ||w|| / (||g|| + wd * ||w||)``. As in SimCLR and
BYOL, tensors of parameter groups without weight decay (biases, norm weights) skip both
the decay and the trust ratio.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable

import torch

from mmviews.config import OptimisationConfig


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling on top of SGD with momentum.

    Per parameter ``w`` with gradient ``g`` in a group with ``weight_decay > 0``:
    ``u = g + wd * w``; ``u *= eta * ||w|| / ||u||`` (when both norms are > 0);
    ``buf = momentum * buf + u``; ``w -= lr * (u + momentum * buf if nesterov else buf)``.
    Groups with ``weight_decay == 0`` take plain momentum-SGD steps.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        nesterov: bool = False,
    ) -> None:
        if lr <= 0 or eta <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"LARS: invalid lr={lr}, eta={eta}, momentum={momentum} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, eta, momentum = group["weight_decay"], group["eta"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if wd > 0:
                    update = update.add(p, alpha=wd)
                    w_norm = torch.linalg.vector_norm(p)
                    u_norm = torch.linalg.vector_norm(update)
                    # Both norms > 0, else ratio 1 (fresh zero-initialised tensors).
                    ratio = torch.where((w_norm > 0) & (u_norm > 0), eta * w_norm / u_norm, torch.ones_like(w_norm))
                    update = update.mul(ratio)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = update.clone()
                else:
                    state["momentum_buffer"].mul_(momentum).add_(update)
                buf = state["momentum_buffer"]
                step = update.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.add_(step, alpha=-group["lr"])
        return loss


def build_optimizer(param_groups: list[dict[str, Any]], config: OptimisationConfig) -> torch.optim.Optimizer:
    """The optimiser over ``param_groups`` (each with its own ``lr`` and ``weight_decay``)."""
    groups = [g for g in param_groups if g["params"]]
    if not groups:
        raise ValueError("the encoder has no trainable parameters (every backbone and head is frozen)")
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay)
    if config.optimizer == "lars":
        return LARS(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay,
                    eta=config.lars_eta, nesterov=config.nesterov)
    raise ValueError(f"optimisation.optimizer must be adamw, sgd or lars, got {config.optimizer!r}")


def warmup_then_decay(step: int, *, warmup: int, total: int, cosine: bool) -> float:
    """The learning-rate factor at optimiser step ``step``: ``step / warmup`` during the warm-up,
    then ``0.5 * (1 + cos(pi * progress))`` (``cosine``; progress runs from 0 after the warm-up to
    1 at ``total``) or 1. The schedules of ``transformers.get_cosine_schedule_with_warmup`` and
    ``get_constant_schedule_with_warmup``, step for step (tested against them)."""
    if step < warmup:
        return step / max(1, warmup)
    if not cosine:
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimisationConfig, total_steps: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up then cosine decay to 0 (or constant) over ``total_steps`` optimiser steps.

    A ``LambdaLR`` over :func:`warmup_then_decay`, as transformers builds its own schedules (same
    state dict: checkpoints of either load in the other); written here because importing
    ``transformers.optimization`` costs every training process about 2 s on a CPU (it pulls in
    peft and torchvision), for five lines of arithmetic."""
    warmup = config.warmup_steps + int(round(config.warmup_epochs * steps_per_epoch))
    warmup = min(warmup, max(total_steps - 1, 0))
    factor = functools.partial(warmup_then_decay, warmup=warmup, total=total_steps, cosine=config.schedule == "cosine")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
