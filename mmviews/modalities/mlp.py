"""``mlp``: an MLP on the first step of a feature sequence.

The network of the poly-view synthetic 1-D Gaussian setting (Shidani et al., ICLR 2024,
section 3.1; ``recipes/polyview_gaussian.yaml``): ``D -> 32 -> GELU -> 32``, split as the
backbone ``Linear(input_dim, hidden_dim) + activation`` and the projection head
``hidden_dim -> embed_dim`` every adapter has. Its dataset is ``gaussian_latents``
(:mod:`mmviews.data.gaussian`). With ``num_layers`` > 1 the backbone repeats
``Linear(hidden_dim, hidden_dim) + activation`` (the encoders of the identifiability benchmark,
``recipes/identifiability.yaml``, whose inputs are invertible mixings of latent blocks).

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
    """``input_dim`` -> ``hidden_dim`` -> activation (``gelu`` | ``relu`` | ``leaky_relu``), ``num_layers``
    such layers (the backbone), then the head."""

    type = "mlp"
    input_dim: int = 1
    hidden_dim: int = 32
    activation: str = "gelu"
    num_layers: int = 1


@register_adapter
class MLPAdapter(Adapter):
    """MLP (``num_layers`` hidden layers) on the first step of a feature sequence ``values [B, L, D]``."""

    config_class = MLPConfig
    config: MLPConfig

    def __init__(self, config: MLPConfig, **_: Any) -> None:
        super().__init__(config)
        acts = {"gelu": nn.GELU, "relu": nn.ReLU, "leaky_relu": nn.LeakyReLU}
        if config.activation not in acts:
            raise ValueError(f"mlp adapter: activation must be one of {sorted(acts)}, got {config.activation!r}")
        if config.input_dim < 1 or config.hidden_dim < 1:
            raise ValueError(f"mlp adapter: input_dim and hidden_dim must be >= 1, got {config.input_dim}, {config.hidden_dim}")
        if config.num_layers < 1:
            raise ValueError(f"mlp adapter: num_layers must be >= 1, got {config.num_layers}")
        layers: list[nn.Module] = []
        for n in range(config.num_layers):
            layers += [nn.Linear(config.input_dim if n == 0 else config.hidden_dim, config.hidden_dim),
                       acts[config.activation]()]
        self.backbone = nn.Sequential(*layers)
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
