"""Entropy-Reconstruction bound (Rodriguez-Galvez et al., ICML 2023), for M views.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]`` (True = view present), optional
``teacher`` ``[K, M, d]`` (e.g. EMA-encoder embeddings of the same views).

With ``u = z / ||z||``, ``kappa = 1 / temperature`` and the von Mises-Fisher normaliser
``log C_d(kappa) = (d/2 - 1) log kappa - (d/2) log(2 pi) - log I_{d/2-1}(kappa)``:

    log p_hat(u[i,a]) = LSE_j kappa <u[i,a], u[j,a]> - log K_a + log C_d(kappa)   (eq. 9, self-pair included)
    Joe:     H_a = -mean_i log p_hat(u[i,a])                                        (eq. 7)
    plug-in: H_a = -sum_i w_ia log p_hat(u[i,a]),  w_.a = softmax_i(log p_hat(u[., a]))
    Rec      = mean over i and ordered (a, b), a != b, of kappa <u[i,a], t[i,b]> + log C_d(kappa)
    L        = -(mean_a H_a + Rec)

``t = u`` without a teacher; with one, ``t`` is the L2-normalised teacher, detached (the
distillation variant: the b-side of Rec gets no gradient). The plug-in weights are the
density normalised over the view's samples (the paper's eq. 8 uses the raw density; the
normalised form is what makes the weights sum to 1). ``log C_d`` is a constant: it appears in
both H and Rec so that the reported metrics are the paper's estimates in nats, and it cancels in
the loss (the weights sum to 1). ``log I_nu(kappa)`` is ``log ive(nu, kappa) + kappa`` with
scipy's exponentially scaled Bessel function, falling back to a log-space power series where
that underflows (large d): the authors' ``scipy.special.iv`` underflows for d >= 128.

Cost: the KDE uses the within-view blocks ``[M, K, N]`` and Rec the within-sample blocks
``[K, M, M]``, so the cost grows as M K^2 + K M^2; the ``[K M, K M]`` matrix is never built.
Memory: the within-view block is streamed over blocks of anchor samples when it exceeds
``score_budget_mb`` (or when ``chunk_size`` is given; see the memory model in
``docs/objectives.md``), keeping ``O(block M N + K M d)``.

Mask: an absent view is not a KDE centre, not an entropy term and not in a reconstruction pair;
``K_a`` is the number of present samples of view a; views with no present sample are left out
of the mean over a. A sample with a single present view still counts in its view's entropy
(it is a sample of that view's marginal) and adds no reconstruction pair.

Defaults: ``temperature`` 0.1, the paper's kernel bandwidth h = 0.1 (chosen there to match
SimCLR's and CMC's temperature); ``estimator="joe"``, the paper's eq. 7 estimator.

Distributed: the KDE runs over every rank's samples (``views.U``) for the local anchors; the
plug-in weights use the global normaliser, from the local log-densities gathered with gradient.
Metrics: ``entropy`` (mean_a H_a) and ``reconstruction`` (Rec).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from . import _distributed as distributed
from ._base import (
    DEFAULT_SCORE_BUDGET_MB,
    MultiViewObjective,
    ObjectiveOutput,
    ViewSet,
    check_temperature,
    masked_logsumexp,
    register_objective,
)
from ._streaming import keep_exclusion

ESTIMATORS = ("joe", "plugin")


def _log_bessel_i_series(nu: float, x: float) -> float:
    """log I_nu(x) from the power series sum_k (x^2/4)^k / (k! Gamma(nu + k + 1)), in log space."""
    from scipy.special import gammaln, logsumexp

    # the terms peak near k* with k* (nu + k*) = x^2 / 4 and then fall faster than geometrically
    peak = 0.5 * (-nu + math.sqrt(nu * nu + x * x))
    k = np.arange(int(2 * peak + 20 * math.sqrt(peak + 1) + 50), dtype=np.float64)
    log_terms = k * math.log(x * x / 4.0) - gammaln(k + 1.0) - gammaln(nu + k + 1.0)
    return float(nu * math.log(x / 2.0) + logsumexp(log_terms))


@lru_cache(maxsize=256)
def log_bessel_i(nu: float, x: float) -> float:
    """log I_nu(x) for nu >= 0, x > 0, finite for any d (no underflow)."""
    from scipy.special import ive

    scaled = float(ive(nu, x))
    if scaled > 1e-280 and math.isfinite(scaled):
        return math.log(scaled) + x
    return _log_bessel_i_series(nu, x)


def log_vmf_normaliser(d: int, kappa: float) -> float:
    """log C_d(kappa) of the von Mises-Fisher density on the sphere S^{d-1} (d >= 2)."""
    if d < 2:
        raise ValueError(f"the von Mises-Fisher density needs d >= 2 dimensions, got d = {d}")
    nu = d / 2.0 - 1.0
    return nu * math.log(kappa) - (d / 2.0) * math.log(2.0 * math.pi) - log_bessel_i(nu, kappa)


@register_objective(
    "er", "Entropy-Reconstruction bound with a von Mises-Fisher kernel density (Rodriguez-Galvez et al., 2023)"
)
class EntropyReconstruction(MultiViewObjective):
    supports_mask = True
    takes_teacher = True  # optional: without a teacher the reconstruction targets are z's own views

    def __init__(
        self,
        temperature: float = 0.1,
        estimator: str = "joe",
        chunk_size: int | None = None,
        score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB,
    ) -> None:
        super().__init__()
        self.temperature = check_temperature(temperature)
        self.set_streaming(chunk_size, score_budget_mb)
        self.kappa = 1.0 / self.temperature
        if estimator not in ESTIMATORS:
            raise ValueError(f"er: unknown estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
        self.estimator = estimator

    def _teacher_units(self, teacher: torch.Tensor, views: ViewSet) -> torch.Tensor:
        if not isinstance(teacher, torch.Tensor) or tuple(teacher.shape) != tuple(views.u.shape):
            shape = tuple(teacher.shape) if isinstance(teacher, torch.Tensor) else type(teacher).__name__
            raise ValueError(f"objective 'er': teacher must have the shape of z {tuple(views.u.shape)}, got {shape}")
        if not teacher.is_floating_point() or (self.check_inputs and not torch.isfinite(teacher).all()):
            raise ValueError("objective 'er': teacher must be a finite floating-point tensor")
        return F.normalize(teacher.detach().to(device=views.u.device, dtype=views.u.dtype), dim=-1, eps=1e-12)

    def loss(self, views: ViewSet, teacher: torch.Tensor | None = None) -> ObjectiveOutput:
        d = views.u.shape[-1]
        log_c = log_vmf_normaliser(d, self.kappa)
        dtype = views.u.dtype

        # ---- entropy: vMF KDE per view over every rank's present samples, self-pair included
        present_all_by_view = views.present_all.T  # [M, N]
        n_view = present_all_by_view.sum(dim=1).to(dtype)  # [M] K_a, global
        present = keep_exclusion(present_all_by_view[:, None, :] if views.masked else None, 1, views.K)
        kernel = views.within_view_logsumexp(self.temperature, present)  # [M, K]
        log_density = (kernel - n_view.clamp_min(1).log()[:, None] + log_c).T  # [K, M]
        view_has_samples = n_view > 0  # [M]
        n_views_used = view_has_samples.sum().clamp_min(1).to(dtype)
        if self.estimator == "joe":
            weights = views.present.to(dtype) / n_view.clamp_min(1)[None, :]  # [K, M]
        else:
            all_log_density = distributed.gather_with_grad(log_density)  # [N, M]
            normaliser = masked_logsumexp(all_log_density, views.present_all, dim=0)  # [M]
            weights = torch.exp(log_density - normaliser[None, :])
        # sum over local anchors of -w log p, then mean over views; x world so that the mean of the
        # ranks' values is the global value (the same convention as ViewSet.mean)
        per_anchor = torch.where(views.present, -weights * log_density, torch.zeros((), dtype=dtype, device=views.u.device))
        entropy = (per_anchor.sum(dim=0) / n_views_used).sum() * views.world

        # ---- reconstruction: vMF log-density of view b given view a, within each sample
        targets = views.u if teacher is None else self._teacher_units(teacher, views)
        rec_scores = torch.bmm(views.u * self.kappa, targets.transpose(1, 2)) + log_c  # [K, M, M]
        reconstruction = views.mean(rec_scores, views.pair_valid)

        loss = -(entropy + reconstruction)
        return ObjectiveOutput(loss, {"entropy": entropy.detach(), "reconstruction": reconstruction.detach()})
