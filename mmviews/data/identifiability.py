"""The multimodal identifiability benchmark (Daunhawer, Bizeul, Palumbo, Marx, Vogt, "Identifiability
Results for Multimodal Contrastive Learning", ICLR 2023, numerical simulation), registered as
dataset ``identifiability`` (``recipes/identifiability.yaml``, ``data_cards/identifiability.md``).

Every sample has latent blocks drawn from Gaussians:

- content ``c`` (``content_dim``, default 5), shared unchanged by every modality;
- style ``s`` (``style_dim``, default 5); with ``content_dependent_style`` it is shifted by a
  fixed random affine map of the content, ``s = s0 + B c + a``;
- for each modality i, its own modality-specific block ``m_i`` (``specific_dim``, default 5),
  independent across modalities.

With ``statistical_dependence`` each block's covariance (and that of the style perturbation) is
a draw from a Wishart distribution (scale I, degrees of freedom = the block's size); without it,
the identity. Modality 1 sees the style ``s`` itself; every later modality i sees ``s_i``, a copy
of ``s`` in which each coordinate is perturbed, with probability ``style_change_prob`` (default
0.75), by Gaussian noise (its own draw per modality). Modality i observes
``x_i = f_i(c, s_i, m_i)``, where ``f_i`` is its own invertible MLP: ``mixing_layers`` (default 3)
square linear maps with leaky ReLUs (slope 0.2) between them, each weight matrix drawn with
entries uniform in [-1, 1] and unit-norm columns, and drawn again until its condition number is
among the lowest 2 % of such matrices.

The generative process (covariances, affine map, mixing functions) is a function of ``seed``
alone, the same in every split; the samples are a function of ``(seed, split, index)``, computed
from a counter-based hash, so that sample i costs the same whatever the split's size: the
training split's default of 2^24 samples acts as fresh samples for any CPU budget. A batch of
indices is generated at once (``__getitems__``, which PyTorch's loader calls).

Items: ``{"index", "modalities": {"x1": FloatTensor[1, D], ..., "xM": ...}, "labels": {"content":
[c], "style_x<i>": [s_i], "specific_x<i>": [m_i]}}`` with ``D = content_dim + style_dim +
specific_dim``: each modality is a one-step feature sequence (the ``mlp`` adapter reads it).
The evaluation task ``identifiability`` scores how well each block is predicted from each
modality's embedding (:mod:`mmviews.eval.identifiability`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from mmviews.data.registry import dataset_error, register_dataset

BLOCKS = ("content", "style", "specific")
LEAKY_SLOPE = 0.2
# Condition-number threshold of a mixing layer: the CONDITION_QUANTILE quantile of the condition
# numbers of CONDITION_POOL random candidates (drawn as the layers are).
CONDITION_POOL = 2048
CONDITION_QUANTILE = 0.02
_CANDIDATES = 512  # candidates drawn at once while looking for a well-conditioned layer
# Seed offsets so that the splits are disjoint draws of the same distribution.
_SPLIT_OFFSET = {"train": 0, "valid": 1, "test": 2}
IDENTIFIABILITY_DEFAULT_SIZES = {"train": 1 << 24, "valid": 4096, "test": 4096}

_MASK64 = (1 << 64) - 1


def modality_names(num_modalities: int) -> tuple[str, ...]:
    """``("x1", ..., "xM")``: the modality names of the dataset."""
    return tuple(f"x{i + 1}" for i in range(num_modalities))


def label_key(block: str, modality: str) -> str:
    """The label holding ``block`` (``content``, ``style``, ``specific``) as ``modality`` sees it."""
    if block not in BLOCKS:
        raise ValueError(f"unknown latent block {block!r}; blocks are {', '.join(BLOCKS)}")
    return "content" if block == "content" else f"{block}_{modality}"


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a counter-based hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hashed_uniform(key: int, index: np.ndarray, width: int) -> np.ndarray:
    """``[len(index), width]`` uniforms in (0, 1), a function of (key, index, column) only."""
    base = _mix64(np.full(1, key & _MASK64, dtype=np.uint64))
    rows = _mix64(base ^ np.asarray(index, dtype=np.uint64).reshape(-1, 1))
    bits = _mix64(rows ^ np.arange(width, dtype=np.uint64).reshape(1, -1))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def hashed_normal(key: int, index: np.ndarray, width: int) -> np.ndarray:
    """``[len(index), width]`` standard normals (Box-Muller on two hashed uniforms per value)."""
    u = hashed_uniform(key, index, 2 * width)
    return np.sqrt(-2.0 * np.log(u[:, :width])) * np.cos(2.0 * np.pi * u[:, width:])


def _wishart(rng: np.random.Generator, n: int) -> np.ndarray:
    """A draw of Wishart(scale I_n, n degrees of freedom): G G^T for G [n, n] standard normal."""
    g = rng.standard_normal((n, n))
    return g @ g.T


def _well_conditioned(rng: np.random.Generator, n: int, threshold: float) -> np.ndarray:
    """The first of the random unit-column matrices whose condition number is <= threshold."""
    while True:
        candidates = _unit_columns(rng.uniform(-1.0, 1.0, size=(_CANDIDATES, n, n)))
        ok = np.flatnonzero(np.linalg.cond(candidates) <= threshold)
        if ok.size:
            return candidates[ok[0]]


def _unit_columns(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=-2, keepdims=True)


@dataclass(frozen=True)
class GenerativeProcess:
    """The parts of the process that the seed fixes (float64 numpy arrays).

    chol: block name (``content``, ``style``, ``style_noise``, ``specific_x<i>``) -> the
    Cholesky factor of its covariance; shift: (B [style, content], a [style]) or None;
    mixing: per modality, the weight matrices of its MLP (applied in order)."""

    content_dim: int
    style_dim: int
    specific_dim: int
    num_modalities: int
    chol: dict[str, np.ndarray]
    shift: tuple[np.ndarray, np.ndarray] | None
    mixing: tuple[tuple[np.ndarray, ...], ...]

    @property
    def dim(self) -> int:
        return self.content_dim + self.style_dim + self.specific_dim

    def mix(self, i: int, z: np.ndarray) -> np.ndarray:
        """``f_i(z)`` for z ``[N, D]``: linear maps with leaky ReLUs between them."""
        weights = self.mixing[i]
        for n, w in enumerate(weights):
            z = z @ w.T
            if n < len(weights) - 1:
                z = np.where(z > 0, z, LEAKY_SLOPE * z)
        return z

    def unmix(self, i: int, x: np.ndarray) -> np.ndarray:
        """``f_i^{-1}(x)``: the latents ``[N, D]`` (c, s_i, m_i) of modality i's observations."""
        weights = self.mixing[i]
        for n in range(len(weights) - 1, -1, -1):
            if n < len(weights) - 1:
                x = np.where(x > 0, x, x / LEAKY_SLOPE)
            x = np.linalg.solve(weights[n], x.T).T
        return x


@lru_cache(maxsize=16)
def generative_process(seed: int, content_dim: int = 5, style_dim: int = 5, specific_dim: int = 5,
                       num_modalities: int = 2, statistical_dependence: bool = True,
                       content_dependent_style: bool = True, mixing_layers: int = 3) -> GenerativeProcess:
    """The covariances, the content-to-style map and the mixing functions of ``seed`` (cached:
    every split of a run shares them)."""
    def stream(*key: int) -> np.random.Generator:
        # one stream per part, so that a part does not move when another is added: modalities x1
        # and x2 are the same with M = 2 as with M = 4, the shift the same whatever the covariances
        return np.random.default_rng([seed, 0x1DE7, *key])

    names = ["content", "style", "style_noise", *(f"specific_{m}" for m in modality_names(num_modalities))]
    sizes = {"content": content_dim, "style": style_dim, "style_noise": style_dim}
    chol = {}
    for k, name in enumerate(names):
        n = sizes.get(name, specific_dim)
        cov = _wishart(stream(1, k), n) if n else np.zeros((0, 0))
        chol[name] = np.linalg.cholesky(cov) if statistical_dependence and n else np.eye(n)
    rng = stream(2)
    b, a = rng.standard_normal((style_dim, content_dim)), rng.standard_normal(style_dim)
    shift = (b, a) if content_dependent_style else None
    dim = content_dim + style_dim + specific_dim
    pool = np.linalg.cond(_unit_columns(stream(3).uniform(-1.0, 1.0, size=(CONDITION_POOL, dim, dim))))
    threshold = float(np.quantile(pool, CONDITION_QUANTILE))
    mixing = []
    for i in range(num_modalities):
        rng = stream(4, i)
        mixing.append(tuple(_well_conditioned(rng, dim, threshold) for _ in range(mixing_layers)))
    return GenerativeProcess(content_dim, style_dim, specific_dim, num_modalities, chol, shift, tuple(mixing))


class IdentifiabilityData(Dataset):
    """``num_samples`` samples of the process of ``seed`` (module docstring), split ``split_key``.

    Args:
        num_samples: the split's size.
        seed: fixes the generative process (the same for every split).
        split_key: which stream of samples (the builder passes the split's offset).
        num_modalities: M >= 2.
        content_dim, style_dim, specific_dim: block sizes (content >= 1).
        style_change_prob: p, the probability that a style coordinate of modality i >= 2 is perturbed.
        statistical_dependence: Wishart covariances (else identity).
        content_dependent_style: style shifted by a fixed affine map of the content.
        mixing_layers: linear maps of each mixing MLP (>= 1).
    """

    def __init__(self, num_samples: int, seed: int = 0, split_key: int = 0, *, num_modalities: int = 2,
                 content_dim: int = 5, style_dim: int = 5, specific_dim: int = 5, style_change_prob: float = 0.75,
                 statistical_dependence: bool = True, content_dependent_style: bool = True,
                 mixing_layers: int = 3) -> None:
        for name, value, low in (("num_samples", num_samples, 0), ("num_modalities", num_modalities, 2),
                                 ("content_dim", content_dim, 1), ("style_dim", style_dim, 0),
                                 ("specific_dim", specific_dim, 0), ("mixing_layers", mixing_layers, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise dataset_error(ValueError, f"identifiability: {name} must be an integer >= {low}, got {value!r}",
                                    name)
        if not 0.0 <= float(style_change_prob) <= 1.0:
            raise dataset_error(ValueError, f"identifiability: style_change_prob must be in [0, 1], got "
                                f"{style_change_prob!r}", "style_change_prob")
        self.num_samples, self.seed, self.split_key = int(num_samples), int(seed), int(split_key)
        self.style_change_prob = float(style_change_prob)
        self.modalities = modality_names(int(num_modalities))
        self.process = generative_process(self.seed, int(content_dim), int(style_dim), int(specific_dim),
                                          int(num_modalities), bool(statistical_dependence),
                                          bool(content_dependent_style), int(mixing_layers))

    def __len__(self) -> int:
        return self.num_samples

    def modality_info(self) -> dict[str, dict[str, Any]]:
        return {m: {"kind": "sequence", "shape": (1, self.process.dim)} for m in self.modalities}

    def _key(self, stream: int) -> int:
        # one hash key per (seed, split, stream of draws)
        return int(_mix64(np.array([((self.seed * 1_000_003 + self.split_key) * 64 + stream) & _MASK64], dtype=np.uint64))[0])

    def latents(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The latent blocks of the samples ``indices``: ``content`` [N, c], and per modality
        ``style_x<i>`` [N, s] and ``specific_x<i>`` [N, m] (float64)."""
        idx = np.asarray(indices)
        if idx.size and not np.issubdtype(idx.dtype, np.integer):  # a float index would be truncated silently
            raise TypeError(f"identifiability: sample indices must be integers, got {idx.dtype} ({idx.flat[0]!r})")
        idx = idx.astype(np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"identifiability: index out of range for {self.num_samples} samples")
        p = self.process
        c = hashed_normal(self._key(0), idx, p.content_dim) @ p.chol["content"].T
        s = hashed_normal(self._key(1), idx, p.style_dim) @ p.chol["style"].T
        if p.shift is not None:
            s = s + c @ p.shift[0].T + p.shift[1]
        out = {"content": c}
        for i, m in enumerate(self.modalities):
            style = s
            if i > 0:
                changed = hashed_uniform(self._key(8 + 4 * i), idx, p.style_dim) < self.style_change_prob
                noise = hashed_normal(self._key(9 + 4 * i), idx, p.style_dim) @ p.chol["style_noise"].T
                style = s + changed * noise
            out[f"style_{m}"] = style
            out[f"specific_{m}"] = hashed_normal(self._key(10 + 4 * i), idx, p.specific_dim) @ p.chol[f"specific_{m}"].T
        return out

    def observations(self, latents: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``x_i = f_i(c, s_i, m_i)`` [N, D] per modality, from :meth:`latents`' output."""
        return {m: self.process.mix(i, np.concatenate([latents["content"], latents[f"style_{m}"],
                                                        latents[f"specific_{m}"]], axis=1))
                for i, m in enumerate(self.modalities)}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        idx = [int(i) + self.num_samples if int(i) < 0 else int(i) for i in indices]
        z = self.latents(idx)
        x = {m: torch.from_numpy(v.astype(np.float32)) for m, v in self.observations(z).items()}
        labels = {k: v.astype(np.float32) for k, v in z.items()}
        return [{"index": i,
                 "modalities": {m: x[m][k : k + 1] for m in self.modalities},
                 "labels": {name: v[k].tolist() for name, v in labels.items()}}
                for k, i in enumerate(idx)]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        return self.__getitems__([index])[0]


@register_dataset("identifiability", "latent content / style / modality-specific blocks mixed by one invertible MLP "
                                     "per modality (Daunhawer et al. 2023; ground truth for identifiability)",
                  options_from=[IdentifiabilityData])
def _build_identifiability(root: Any = None, split: str = "train", num_samples: int | None = None, seed: int = 0,
                           **options: Any) -> Dataset:
    if split not in _SPLIT_OFFSET:
        raise dataset_error(ValueError, f"identifiability: unknown split {split!r}; choose from {sorted(_SPLIT_OFFSET)}",
                            "split")
    n = IDENTIFIABILITY_DEFAULT_SIZES[split] if num_samples is None else num_samples
    return IdentifiabilityData(n, seed, _SPLIT_OFFSET[split], **options)
