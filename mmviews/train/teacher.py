"""The EMA teacher: a stop-gradient copy of the encoder whose weights follow it slowly.

After every optimiser step, ``t <- momentum * t + (1 - momentum) * s`` for each parameter
(``s`` the encoder's), and buffers (BatchNorm statistics) are copied, each as one foreach
operation over all tensors (a few kernels, not two per tensor). Its embeddings of the same views
are given to objectives that take a teacher (``takes_teacher``) as ``teacher=``, computed under
the same mixed-precision autocast as the student's (``autocast``: the trainer passes
``accelerator.autocast``; the teacher is not ``accelerator.prepare``-d, so it would otherwise run
in float32) and returned in float32, as the prepared student's are.
Checkpoints keep its weights as ``teacher.safetensors`` (:meth:`EMATeacher.save`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from mmviews.modalities.dropout import salt_sample_keyed_dropout


class EMATeacher(nn.Module):
    """Exponential moving average of the encoder's weights (no gradients)."""

    def __init__(self, encoder: nn.Module, momentum: float,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        super().__init__()
        self.module = copy.deepcopy(encoder)
        # Sample-keyed dropout, if any: masks of its own, not the student's.
        salt_sample_keyed_dropout(self.module, namespace="ema_teacher")
        self.module.requires_grad_(False)
        self.momentum = momentum
        self.autocast = autocast

    @torch.no_grad()
    def update(self, encoder: nn.Module) -> None:
        teacher_params, params = list(self.module.parameters()), [p.detach() for p in encoder.parameters()]
        if len(teacher_params) != len(params):
            raise ValueError(f"EMA teacher: the encoder has {len(params)} parameters, "
                             f"the teacher {len(teacher_params)}")
        torch._foreach_lerp_(teacher_params, params, 1.0 - self.momentum)
        teacher_buffers, buffers = list(self.module.buffers()), list(encoder.buffers())
        if teacher_buffers:
            torch._foreach_copy_(teacher_buffers, buffers)

    @torch.no_grad()
    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z [K, M, d] float32, mask [K, M])`` of the teacher copy, under ``autocast``."""
        with self.autocast():
            z, mask = self.module(batch)
        return z.float(), mask

    def save(self, path: str | os.PathLike[str]) -> None:
        """The teacher's weights and buffers as safetensors (no pickle)."""
        from safetensors.torch import save_model

        save_model(self.module, str(path))  # save_model handles tied tensors

    def load(self, path: str | os.PathLike[str]) -> None:
        """Weights written by :meth:`save` (every key must match)."""
        from safetensors.torch import load_model

        load_model(self.module, str(path), strict=True)
