"""The poly-view synthetic 1-D Gaussian setting (Shidani et al., ICLR 2024, section 3.1) as
trainer parts, for ``recipes/polyview_gaussian.yaml``.

- Dataset ``gaussian_latents`` (registered with :func:`mmviews.data.build_dataset`): sample
  i holds a latent ``c_i ~ N(0, sigma0^2)`` as a one-step feature sequence ``x: [1, 1]``
  (label ``latent``). The M views ``x_{i,a} ~ N(c_i, sigma^2)`` are M copies of ``x`` with the
  ``seq_noise`` augmentation (additive Gaussian noise of std ``sigma`` for a one-step
  sequence), fresh every epoch.
- Adapter ``mlp`` (registered with :func:`mmviews.modalities.build_adapter`): the paper's
  network ``D -> 32 -> GELU -> 32`` as backbone ``Linear(D, hidden) + GELU`` and a linear
  head ``hidden -> embed_dim``, applied to the first step of a feature sequence.

These live here because no other layer provides them yet; they belong in ``mmviews.data``
and ``mmviews.modalities``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from mmviews.data.registry import _BUILDERS, register_dataset
from mmviews.modalities.base import ADAPTERS, Adapter, AdapterConfig, register_adapter, require_tensor

_SPLIT_OFFSET = {"train": 0, "valid": 1, "test": 2}


class GaussianLatents(Dataset):
    """``num_samples`` latents ``c ~ N(0, sigma0^2)`` (deterministic in ``seed``); item i is
    ``{"index": i, "modalities": {"x": FloatTensor[1, 1]}, "labels": {"latent": c_i}}``."""

    def __init__(self, num_samples: int = 65536, sigma0: float = 1.0, seed: int = 0) -> None:
        if num_samples < 1 or not sigma0 > 0:
            raise ValueError(f"gaussian_latents: need num_samples >= 1 and sigma0 > 0, got {num_samples}, {sigma0}")
        rng = np.random.default_rng([seed, 0xC0FFEE])
        self.latents = torch.as_tensor(rng.normal(0.0, sigma0, size=num_samples), dtype=torch.float32)

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    def modality_info(self) -> dict[str, dict[str, Any]]:
        return {"x": {"kind": "sequence", "shape": (1, 1)}}

    def __getitem__(self, index: int) -> dict[str, Any]:
        c = self.latents[index]
        return {"index": int(index), "modalities": {"x": c.reshape(1, 1)}, "labels": {"latent": float(c)}}


if "gaussian_latents" not in _BUILDERS:

    @register_dataset("gaussian_latents", "1-D Gaussian latents for the poly-view synthetic setting (views: seq_noise copies)")
    def _gaussian(root: Any = None, split: str = "train", num_samples: int | None = None, sigma0: float = 1.0,
                  seed: int = 0) -> Dataset:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"gaussian_latents: unknown split {split!r}; choose from {sorted(_SPLIT_OFFSET)}")
        n = num_samples if num_samples is not None else (65536 if split == "train" else 4096)
        return GaussianLatents(n, sigma0, seed * 1000 + _SPLIT_OFFSET[split])


@dataclass
class MLPConfig(AdapterConfig):
    """``input_dim`` -> ``hidden_dim`` -> activation (the backbone), then the head."""

    type = "mlp"
    input_dim: int = 1
    hidden_dim: int = 32
    activation: str = "gelu"


class MLPAdapter(Adapter):
    """A one-hidden-layer MLP on the first step of a feature sequence ``values [B, L, D]``."""

    config_class = MLPConfig

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
        return {"x": values[:, 0, :]}

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return self.backbone(prepared["x"].to(self.backbone[0].weight.dtype))


if "mlp" not in ADAPTERS:
    register_adapter(MLPAdapter)
