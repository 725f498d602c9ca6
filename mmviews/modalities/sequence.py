"""Precomputed feature sequences (e.g. the MOSI/MOSEI/SIMS pickles' audio, vision and
BERT text features): a small transformer encoder trained from scratch, masked pooling.

Input: ``{"values": FloatTensor[B, L, D], "lengths": LongTensor[B]}`` (``lengths``
optional: all L positions valid). Positions at or after ``lengths`` are padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .inputs import (
    InputCheck,
    SequenceInputCheck,
    input_lengths,
    lengths_to_mask,
    masked_mean,
    require_tensor,
    to_device,
)


@dataclass
class FeatureSequenceConfig(AdapterConfig):
    """``input_dim``: D of the stored features. A Linear to ``width``, sinusoidal
    positions, ``num_layers`` pre-norm transformer layers (the MV-DHEL paper uses 3),
    then ``pooling`` = ``mean`` (masked) or ``max`` (masked) or ``last`` (last valid)."""

    type = "feature_sequence"
    input_dim: int = 0
    width: int = 64
    num_layers: int = 3
    num_heads: int = 4
    ff_mult: int = 2
    dropout: float = 0.1
    pooling: str = "mean"


def sinusoidal_positions(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[length, dim]`` fixed sine/cosine position codes (no maximum length)."""
    pos = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim, device=device)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return pe.to(dtype)


class SequenceEncoder(nn.Module):
    def __init__(self, cfg: FeatureSequenceConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(cfg.input_dim, cfg.width)
        layer = nn.TransformerEncoderLayer(
            cfg.width,
            cfg.num_heads,
            dim_feedforward=cfg.ff_mult * cfg.width,
            dropout=cfg.dropout,
            batch_first=True,
            norm_first=True,
            activation="gelu",
        )
        # Nested tensors are off: they change numerics between train/eval and need no mask checks.
        self.encoder = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x) + sinusoidal_positions(x.shape[1], self.input_proj.out_features, x.device, x.dtype)
        # A row with no valid position would make attention softmax over nothing (NaN):
        # let such rows (absent views) attend to position 0; pooling still ignores them.
        # (built out of place: the ONNX exporter has no in-place `|=` on a slice)
        attend = torch.cat([mask[:, :1] | ~mask.any(1, keepdim=True), mask[:, 1:]], dim=1)
        h = self.encoder(h, src_key_padding_mask=~attend)
        return self.norm(h)


@register_adapter
class FeatureSequenceAdapter(Adapter):
    """Small transformer encoder on a feature sequence ``values [B, L, D]`` with ``lengths [B]``."""

    config_class = FeatureSequenceConfig
    default_lora_targets = ["linear1", "linear2"]
    config: FeatureSequenceConfig

    def __init__(
        self, config: FeatureSequenceConfig, *, load_weights: bool = True, saved_dir: Path | None = None
    ) -> None:
        super().__init__(config)
        if config.input_dim <= 0:
            raise ValueError(f"feature_sequence adapter needs input_dim > 0, got {config.input_dim}")
        if config.width % config.num_heads:
            raise ValueError(f"feature_sequence width {config.width} not divisible by num_heads {config.num_heads}")
        if config.pooling not in ("mean", "max", "last"):
            raise ValueError(f"feature_sequence pooling must be mean, max or last, got {config.pooling!r}")
        self.backbone = SequenceEncoder(config)
        self.feature_dim = config.width
        self._finish_init()

    def backbone_blocks(self) -> list[nn.Module]:
        return list(self.backbone.encoder.layers)

    def backbone_tail(self) -> list[nn.Parameter]:
        return list(self.backbone.norm.parameters())

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = "feature_sequence adapter"
        x = require_tensor(inputs, "values", where)
        if x.dim() != 3:
            raise ValueError(f"{where}: values must be [B, L, D], got shape {tuple(x.shape)}")
        if x.shape[2] != self.config.input_dim:
            raise ValueError(f"{where}: values have D={x.shape[2]} features, config input_dim={self.config.input_dim}")
        if x.shape[1] == 0:
            raise ValueError(f"{where}: zero-length sequences (values shape {tuple(x.shape)})")
        lengths = input_lengths(inputs, x, where)
        device = next(self.backbone.parameters()).device
        return {"values": to_device(x, device, torch.float32),
                "mask": lengths_to_mask(to_device(lengths, device), x.shape[1])}

    def input_check(self) -> InputCheck:
        return SequenceInputCheck("feature_sequence adapter")

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        mask = prepared["mask"]
        h = self.backbone(prepared["values"], mask)
        if self.config.pooling == "mean":
            return masked_mean(h, mask)
        if self.config.pooling == "max":
            pooled = h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
            return torch.where(mask.any(1, keepdim=True), pooled, torch.zeros_like(pooled))
        last = (mask.sum(1) - 1).clamp_min(0)
        return h[torch.arange(h.shape[0], device=h.device), last]
