"""f-MICL (Lu et al., TMLR 2024), extended to M views: the variational f-mutual-information
bound with an f-Gaussian (or cosine) critic.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]`` (True = view present).

With ``u = z / ||z||`` and, for a pair of unit vectors, ``D = ||u - v||^2 = 2 - 2 <u, v>``:

- ``similarity="gaussian"`` (the paper's f-Gaussian similarity, eq. 9):
  ``G = mu * exp(-D / (2 sigma^2))``, critic ``s = f'(G)``, negative term ``f*(f'(G))``
  (Table 1, as functions of ``G``). Everything is written in ``log G = log mu - D / (2 sigma^2)``
  so no ``exp``/``log`` round trip is made:

  ======== ============================== =========================
  f        s = f'(G)                      f*(f'(G))
  ======== ============================== =========================
  kl       log G + 1                      G
  js       log 2 - softplus(-log G)       softplus(log G) - log 2
  pearson  2 (G - 1)                      G^2 - 1
  sh       1 - G^(-1/2)                   G^(1/2) - 1
  tsallis  q/(q-1) G^(q-1)                G^q
  vlc      1 - 4/(G+1)^2                  (G-1)(3G+1)/(G+1)^2
  ======== ============================== =========================

  VLC (``f(u) = (u-1)^2/(u+1)``, ``f'(u) = 1 - 4/(u+1)^2``): we depart from
  the paper's Table 1, which prints ``f*(f'(u)) = 3 - 4/(u+1)``. For a convex differentiable f
  the supremum in ``f*(t) = sup_x (x t - f(x))`` at ``t = f'(u)`` is reached at ``x = u``, so

      f*(f'(u)) = u f'(u) - f(u) = [u (u+1)^2 - 4u - (u-1)^2 (u+1)] / (u+1)^2
                = (3u^2 - 2u - 1) / (u+1)^2 = (u-1)(3u+1) / (u+1)^2.

  The table's own conjugate column agrees with this: with ``t = f'(u)``, ``sqrt(1 - t) =
  2/(u+1)`` and ``4 - t - 4 sqrt(1 - t) = 3 + 4/(u+1)^2 - 8/(u+1)``, the same fraction. The
  printed entry does not (at u = 1 it gives 1, where ``f*(f'(1)) = f*(0) = 0``). We use the
  composition, so that the cosine and Gaussian critics share one conjugate and the objective
  stays the variational bound. With ``inv = 1/(1+G) = sigmoid(-log G)`` it is
  ``(1 - 2 inv)(3 - 2 inv)``.

  ``temperature`` is not used by this critic (``sigma`` plays its role).

- ``similarity="cosine"`` (the paper's Table 4 baseline): ``s = <u, v> / temperature`` is the
  critic itself and the negative term is the conjugate ``f*(s)``, the *monotone* conjugate
  ``sup_{x >= 0} (x s - f(x))`` (the paper's footnote 1): kl ``exp(s - 1)``; js
  ``-log(2 - e^s)``; pearson ``s^2/4 + s`` for ``s >= -2``, else ``-1``; sh ``s / (1 - s)``;
  tsallis ``((q-1)/q s)^(q/(q-1))`` for ``s >= 0``, else ``0``; vlc ``4 - s - 4 sqrt(1 - s)``
  for ``s >= -3``, else ``-1``. Domain guard: the conjugates of js, sh and vlc are finite (with
  finite gradient) only for ``s < log 2``, ``s < 1``, ``s < 1``. Since ``s`` ranges over
  ``[-1/temperature, 1/temperature]``, such a combination is refused at construction with a
  ValueError stating the smallest admissible temperature (``1/log 2`` for js, ``1`` for sh and
  vlc) rather than clamping scores or returning NaN. (The paper reports that cosine VLC
  fails to train, Table 4.)

Loss (eq. 11 with the weight alpha of Algorithm 1):

    L = -( mean_{pos} s - alpha * mean_{neg} f*(s) )

positives: every ordered pair of views of one sample ``((i, a), (i, b))``, ``a != b``
(``[K, M, M]`` within-sample block); negatives: every pair ``((i, a), (j, b))`` with ``j != i``
and any ``a, b`` (the ``[K, M, N, M]`` block). Mask: absent views are in neither set (a
sample's single present view still meets the other samples' views as a negative).
Metrics: ``positive_term`` (mean s), ``negative_term`` (mean f*(s)), and the
f-MI bound estimate ``fmi_bound = positive_term - negative_term`` (alpha = 1).

Defaults and where they come from: ``divergence="pearson"`` with ``similarity="gaussian"``:
the best Gaussian-critic divergence in ``recipes/reproduce/fmicl_similarity.py`` (linear probe
0.803 +- 0.039 over 2 seeds, against 0.647 for KL and 0.59-0.77 for the others; the cosine
critic's best, KL at temperature 0.2, reached 0.799). The paper's best is KL (Table 4):
``divergence="kl"``. ``alpha`` 40 (the paper's best weight on its image datasets, Table 7),
``sigma`` 0.7071 = 1/sqrt(2) and ``mu`` 1: the paper's Gaussian kernel, kept as they are (not
tuned here). ``temperature`` 0.1 (cosine critic only): the contrastive objectives' default.
``q`` 3 (Tsallis order): not measured.

Memory: the negatives' ``[K, M, N, M]`` block is only summed, so when it (with the
temporaries of the critic, about 4 block-sized buffers) exceeds ``score_budget_mb``, or when
``chunk_size`` is given, it is streamed over blocks of anchor samples and recomputed block by
block in backward (see the memory model in ``docs/objectives.md``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from . import _distributed as distributed
from ._base import (
    DEFAULT_SCORE_BUDGET_MB,
    MultiViewObjective,
    ObjectiveOutput,
    ViewSet,
    check_temperature,
    register_objective,
    similarity_metrics,
)

DIVERGENCES = ("kl", "js", "pearson", "sh", "tsallis", "vlc")
SIMILARITIES = ("gaussian", "cosine")
LOG2 = math.log(2.0)
# smallest temperature for which every cosine score s in [-1/t, 1/t] is inside the conjugate's domain
_COSINE_MIN_TEMPERATURE = {"js": 1.0 / LOG2, "sh": 1.0, "vlc": 1.0}


def gaussian_terms(log_g: torch.Tensor, divergence: str, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f'(G), f*(f'(G)))`` elementwise from ``log G`` (Table 1 of the paper)."""
    if divergence == "kl":
        return log_g + 1.0, torch.exp(log_g)
    if divergence == "js":
        return LOG2 - F.softplus(-log_g), F.softplus(log_g) - LOG2
    if divergence == "pearson":
        return 2.0 * torch.expm1(log_g), torch.expm1(2.0 * log_g)
    if divergence == "sh":
        return -torch.expm1(-0.5 * log_g), torch.expm1(0.5 * log_g)
    if divergence == "tsallis":
        return q / (q - 1.0) * torch.exp((q - 1.0) * log_g), torch.exp(q * log_g)
    if divergence == "vlc":
        inv = torch.sigmoid(-log_g)  # 1 / (1 + G)
        return 1.0 - 4.0 * inv * inv, (1.0 - 2.0 * inv) * (3.0 - 2.0 * inv)
    raise ValueError(f"unknown divergence {divergence!r}")


def conjugate(s: torch.Tensor, divergence: str, q: float) -> torch.Tensor:
    """Monotone convex conjugate ``f*(s) = sup_{x >= 0} (x s - f(x))`` elementwise.

    The caller guarantees ``s`` lies in the domain (js: s < log 2; sh, vlc: s < 1)."""
    if divergence == "kl":
        return torch.exp(s - 1.0)
    if divergence == "js":
        return -torch.log(-torch.expm1(s - LOG2)) - LOG2  # -log(2 - e^s)
    if divergence == "pearson":
        return torch.where(s >= -2.0, s * s / 4.0 + s, torch.full_like(s, -1.0))
    if divergence == "sh":
        return s / (1.0 - s)
    if divergence == "tsallis":
        # clamp before the power so the unused branch has a finite gradient
        return torch.pow(((q - 1.0) / q * s).clamp_min(0.0), q / (q - 1.0))
    if divergence == "vlc":
        inside = s >= -3.0
        safe = torch.where(inside, s, torch.zeros_like(s))
        return torch.where(inside, 4.0 - safe - 4.0 * torch.sqrt(1.0 - safe), torch.full_like(s, -1.0))
    raise ValueError(f"unknown divergence {divergence!r}")


@register_objective(
    "fmicl", "f-MICL: variational f-mutual-information bound, f-Gaussian or cosine critic (Lu et al., 2024)"
)
class FMICL(MultiViewObjective):
    supports_mask = True
    # block-sized buffers the critic and its gradient hold at once (scores, log G, f*, where)
    WORKING_COPIES: ClassVar[int] = 4

    def __init__(
        self,
        divergence: str = "pearson",
        similarity: str = "gaussian",
        alpha: float = 40.0,
        sigma: float = 0.7071,
        mu: float = 1.0,
        temperature: float = 0.1,
        q: float = 3.0,
        chunk_size: int | None = None,
        score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB,
    ) -> None:
        super().__init__()
        self.set_streaming(chunk_size, score_budget_mb)
        if divergence not in DIVERGENCES:
            raise ValueError(f"fmicl: unknown divergence {divergence!r}; known: {', '.join(DIVERGENCES)}")
        if similarity not in SIMILARITIES:
            raise ValueError(f"fmicl: unknown similarity {similarity!r}; known: {', '.join(SIMILARITIES)}")
        for name, value in (("alpha", alpha), ("sigma", sigma), ("mu", mu)):
            if not (math.isfinite(float(value)) and float(value) > 0):
                raise ValueError(f"fmicl: {name} must be a finite number > 0, got {value}")
        if not (math.isfinite(float(q)) and float(q) > 1):
            raise ValueError(f"fmicl: the Tsallis order q must be a finite number > 1, got {q}")
        self.divergence, self.similarity = divergence, similarity
        self.alpha, self.sigma, self.mu, self.q = float(alpha), float(sigma), float(mu), float(q)
        self.temperature = check_temperature(temperature)
        if similarity == "cosine" and divergence in _COSINE_MIN_TEMPERATURE:
            bound = _COSINE_MIN_TEMPERATURE[divergence]
            if not self.temperature > bound:
                domain = "s < log 2" if divergence == "js" else "s < 1"
                raise ValueError(
                    f"fmicl: with similarity='cosine' the {divergence} conjugate needs every score "
                    f"s = <u, v>/temperature to satisfy {domain}, i.e. temperature > {bound:.4f}; got "
                    f"temperature = {self.temperature} (use similarity='gaussian', or a larger temperature)"
                )
        if similarity == "gaussian":
            self._check_gaussian_range()

    def _check_gaussian_range(self) -> None:
        """Refuse sigma/mu for which s or f*(s) overflows float32 somewhere on the sphere (D in [0, 4])."""
        log_g = torch.tensor([math.log(self.mu), math.log(self.mu) - 4.0 / (2 * self.sigma**2)], dtype=torch.float64)
        s, conj = gaussian_terms(log_g, self.divergence, self.q)
        if not bool((torch.isfinite(s) & torch.isfinite(conj) & (s.abs() < 1e37) & (conj.abs() < 1e37)).all()):
            raise ValueError(
                f"fmicl: sigma = {self.sigma}, mu = {self.mu} make the {self.divergence} critic overflow float32 "
                f"(s ranges over {s.tolist()}, f*(s) over {conj.tolist()}); use a larger sigma or a smaller mu"
            )

    def _scores(self, dots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, f*(s))`` from cosine similarities ``dots``."""
        if self.similarity == "cosine":
            s = dots / self.temperature
            return s, conjugate(s, self.divergence, self.q)
        # log G = log mu - ||u - v||^2 / (2 sigma^2) = log mu + (<u, v> - 1) / sigma^2 for unit
        # vectors; the in-place scalar ops keep this one pass over the [K, M, N, M] block
        log_g = (dots - 1.0).mul_(1.0 / self.sigma**2).add_(math.log(self.mu))
        return gaussian_terms(log_g, self.divergence, self.q)

    def _streamed_negative_term(self, views: ViewSet) -> torch.Tensor:
        """``mean_{neg} f*(s)`` (scaled as :meth:`ViewSet.mean`), with the ``[K, M, N, M]``
        block streamed: per block of anchor samples, the sum of f*(s) over its valid negatives."""

        def block_sums(dots: torch.Tensor, start: int, stop: int) -> torch.Tensor:  # [k, M, N, M] -> [k]
            _, conj = self._scores(dots)
            if views.masked:
                keep = views.other_sample_rows(start, stop)[:, None, :, None]
                keep = keep & views.present[start:stop, :, None, None] & views.present_all[None, None]
                return torch.where(keep, conj, torch.zeros((), dtype=conj.dtype, device=conj.device)).sum(dim=(1, 2, 3))
            # all pairs minus those with the own sample (a diagonal of the sample axes)
            own = torch.diagonal(conj.narrow(2, views.offset + start, stop - start), dim1=0, dim2=2)  # [M, M, k]
            return conj.sum(dim=(1, 2, 3)) - own.sum(dim=(0, 1))

        total = views.pairs_reduce(block_sums, working_copies=self.WORKING_COPIES).sum()
        # valid negatives of sample i: its c_i present views times the present views of the
        # other samples, T - c_i (T: present views of all ranks)
        counts = views.present.sum(dim=1).to(total.dtype)
        count = distributed.all_reduce_sum((counts * (views.present_all.sum().to(total.dtype) - counts)).sum())
        return total * views.world / count.clamp_min(1)

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        positive_s, _ = self._scores(views.within_sample(1.0))  # [K, M, M]
        positive_term = views.mean(positive_s, views.pair_valid)
        if views.block_size(views.M * views.N * views.M * self.WORKING_COPIES, views.M) is not None:
            negative_term = self._streamed_negative_term(views)
        else:
            negative_term = self._unchunked_negative_term(views)
        loss = -(positive_term - self.alpha * negative_term)
        metrics = similarity_metrics(views)
        metrics.update(
            positive_term=positive_term.detach(),
            negative_term=negative_term.detach(),
            fmi_bound=(positive_term - negative_term).detach(),
        )
        return ObjectiveOutput(loss, metrics)

    def _unchunked_negative_term(self, views: ViewSet) -> torch.Tensor:
        """``mean_{neg} f*(s)`` from the whole ``[K, M, N, M]`` block."""
        _, negative_conj = self._scores(views.all_pairs(1.0))  # [K, M, N, M]
        if views.masked:
            negative_valid = views.present[:, :, None, None] & views.negative_keep  # [K, M, N, M]
            negative_term = views.mean(negative_conj, negative_valid.expand_as(negative_conj))
        else:
            # every pair except the own-sample ones (j == i: the diagonal of the sample axes)
            own = torch.diagonal(negative_conj, offset=views.offset, dim1=0, dim2=2)  # [M, M, K]
            total = negative_conj.sum() - own.sum()
            count = views.N * views.M * (views.N - 1) * views.M  # over all ranks' anchors
            negative_term = total * views.world / count
        return negative_term
