"""The EMA teacher: a stop-gradient copy of the encoder whose weights follow it slowly.

After every optimiser step, ``t <- momentum * t + (1 - momentum) * s`` for each parameter
(``s`` the encoder's), and buffers (BatchNorm statistics) are copied. Its embeddings of the
same views are given to objectives that take a teacher (``takes_teacher``) as ``teacher=``.
Checkpoints keep its weights as ``teacher.safetensors`` (:meth:`EMATeacher.save`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from mmviews.modalities.dropout import salt_sample_keyed_dropout


class EMATeacher(nn.Module):
    """Exponential moving average of the encoder's weights (no gradients)."""

    def __init__(self, encoder: nn.Module, momentum: float) -> None:
        super().__init__()
        self.module = copy.deepcopy(encoder)
        # Sample-keyed dropout, if any: masks of its own, not the student's.
        salt_sample_keyed_dropout(self.module, namespace="ema_teacher")
        self.module.requires_grad_(False)
        self.momentum = momentum

    @torch.no_grad()
    def update(self, encoder: nn.Module) -> None:
        for t, s in zip(self.module.parameters(), encoder.parameters()):
            t.lerp_(s.detach(), 1.0 - self.momentum)
        for t, s in zip(self.module.buffers(), encoder.buffers()):
            t.copy_(s)

    @torch.no_grad()
    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z [K, M, d], mask [K, M])`` of the teacher copy."""
        return self.module(batch)

    def save(self, path: str | os.PathLike[str]) -> None:
        """The teacher's weights and buffers as safetensors (no pickle)."""
        from safetensors.torch import save_model

        save_model(self.module, str(path))  # save_model handles tied tensors

    def load(self, path: str | os.PathLike[str]) -> None:
        """Weights written by :meth:`save` (every key must match)."""
        from safetensors.torch import load_model

        load_model(self.module, str(path), strict=True)
