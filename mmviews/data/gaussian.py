"""The 1-D Gaussian latents of the poly-view synthetic setting (Shidani et al., ICLR 2024,
section 3.1), registered as dataset ``gaussian_latents`` (``recipes/polyview_gaussian.yaml``).

Sample i holds a latent ``c_i ~ N(0, sigma0^2)`` as a one-step feature sequence ``x: [1, 1]``
(label ``latent``). The recipe makes the M views ``x_{i,a} ~ N(c_i, sigma^2)`` as M copies of
``x`` with the ``seq_noise`` augmentation (additive Gaussian noise of std ``sigma`` for a
one-step sequence), drawn afresh every epoch. The network of that setting is the ``mlp``
adapter (:mod:`mmviews.modalities.mlp`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmviews.data.registry import dataset_error, register_dataset

# Seed offsets so that the splits are disjoint draws of the same distribution.
_SPLIT_OFFSET = {"train": 0, "valid": 1, "test": 2}


class GaussianLatents(Dataset):
    """``num_samples`` latents ``c ~ N(0, sigma0^2)`` (deterministic in ``seed``); item i is
    ``{"index": i, "modalities": {"x": FloatTensor[1, 1]}, "labels": {"latent": c_i}}``."""

    def __init__(self, num_samples: int = 65536, sigma0: float = 1.0, seed: int = 0) -> None:
        if num_samples < 1 or not sigma0 > 0:
            raise dataset_error(ValueError, f"gaussian_latents: need num_samples >= 1 and sigma0 > 0, got {num_samples}, {sigma0}",
                                "num_samples" if num_samples < 1 else "sigma0")
        rng = np.random.default_rng([seed, 0xC0FFEE])
        self.latents = torch.as_tensor(rng.normal(0.0, sigma0, size=num_samples), dtype=torch.float32)

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    def modality_info(self) -> dict[str, dict[str, Any]]:
        return {"x": {"kind": "sequence", "shape": (1, 1)}}

    def __getitem__(self, index: int) -> dict[str, Any]:
        c = self.latents[index]
        return {"index": int(index), "modalities": {"x": c.reshape(1, 1)}, "labels": {"latent": float(c)}}


@register_dataset("gaussian_latents", "1-D Gaussian latents for the poly-view synthetic setting (views: seq_noise copies)")
def _build_gaussian(root: Any = None, split: str = "train", num_samples: int | None = None, sigma0: float = 1.0,
                    seed: int = 0) -> Dataset:
    if split not in _SPLIT_OFFSET:
        raise dataset_error(ValueError, f"gaussian_latents: unknown split {split!r}; choose from {sorted(_SPLIT_OFFSET)}",
                            "split")
    n = num_samples if num_samples is not None else (65536 if split == "train" else 4096)
    return GaussianLatents(n, sigma0, seed * 1000 + _SPLIT_OFFSET[split])
