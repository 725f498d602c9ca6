"""``mlp``: a one-hidden-layer MLP on the first step of a feature sequence.

The network of the poly-view synthetic 1-D Gaussian setting (Shidani et al., ICLR 2024,
section 3.1; ``recipes/polyview_gaussian.yaml``): ``D -> 32 -> GELU -> 32``, split as the
backbone ``Linear(input_dim, hidden_dim) + activation`` and the projection head
``hidden_dim -> embed_dim`` every adapter has. Its dataset is ``gaussian_latents``
(:mod:`mmviews.data.gaussian`).

Inputs: ``{"values": FloatTensor[B, L, input_dim]}`` (``"lengths"`` optional); only step 0 is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .inputs import InputCheck, SequenceInputCheck, require_tensor, to_device


@dataclass
class MLPConfig(AdapterConfig):
    """``input_dim`` -> ``hidden_dim`` -> activation (``gelu`` | ``relu``) (the backbone), then the head."""

    type = "mlp"
    input_dim: int = 1
    hidden_dim: int = 32
    activation: str = "gelu"


@register_adapter
class MLPAdapter(Adapter):
    """One-hidden-layer MLP on the first step of a feature sequence ``values [B, L, D]``."""

    config_class = MLPConfig
    config: MLPConfig

    def __init__(self, config: MLPConfig, **_: Any) -> None:
        super().__init__(config)
        acts = {"gelu": nn.GELU, "relu": nn.ReLU}
        if config.activation not in acts:
            raise ValueError(f"mlp adapter: activation must be one of {sorted(acts)}, got {config.activation!r}")
        if config.input_dim < 1 or config.hidden_dim < 1:
            raise ValueError(f"mlp adapter: input_dim and hidden_dim must be >= 1, got {config.input_dim}, {config.hidden_dim}")
        self.backbone = nn.Sequential(nn.Linear(config.input_dim, config.hidden_dim), acts[config.activation]())
        self.feature_dim = config.hidden_dim
        self._finish_init()

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        values = require_tensor(inputs, "values", "mlp adapter")
        if values.ndim != 3 or values.shape[-1] != self.config.input_dim:
            raise ValueError(f"mlp adapter: values must be [B, L, {self.config.input_dim}], got {tuple(values.shape)}")
        weight = self.backbone[0].weight
        return {"x": to_device(values[:, 0, :], weight.device, weight.dtype)}

    def input_check(self) -> InputCheck:
        # Finite values, and a first step to read in every present item (lengths > 0).
        return SequenceInputCheck("mlp adapter")

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return self.backbone(prepared["x"])
