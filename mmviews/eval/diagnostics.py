"""Representation diagnostics for multi-view embeddings ``[N, M, d]`` with a view mask ``[N, M]``.

- Alignment and uniformity (Wang & Isola, ICML 2020) on L2-normalised embeddings:
  ``align = E_pos ||u - v||^alpha`` (alpha = 2) over every pair of present views of a sample;
  ``unif = log E_{i != j} exp(-t ||u_i - u_j||^2)`` (t = 2) within each view, averaged
  over views. Lower is better for both.
- Effective rank (Roy & Vetterli, 2007; RankMe): ``exp(H(p))`` with ``p = s / sum(s)`` the
  normalised singular values of the (uncentred) embedding matrix; numerical rank: the
  number of singular values above ``s_max * max(N, d) * eps(dtype)``.
- ER entropy estimate (Rodriguez-Galvez et al., 2023, eq. 9): a von Mises-Fisher KDE over
  the embeddings of a view, ``log p(u_i) = LSE_j kappa <u_i, u_j> - log N + log C_d(kappa)``,
  ``H = -mean_i log p(u_i)``, with ``log C_d`` in log space (``scipy.special.iv``
  underflows for d >= 128).
- Positive / negative cosine similarities (same sample, different views / different samples).
- The poly-view MI lower bound ``log(K M - M + 1) - loss`` (nats).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mmviews.objectives import mi_lower_bound as objective_mi_lower_bound
from mmviews.objectives.er import log_vmf_normaliser as vmf_log_normaliser  # one implementation, shared with ER


def _check_views(views: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if views.ndim != 3:
        raise ValueError(f"views must be [N, M, d], got {tuple(views.shape)}")
    if mask is None:
        return torch.ones(views.shape[:2], dtype=torch.bool, device=views.device)
    if mask.shape != views.shape[:2]:
        raise ValueError(f"mask must be {tuple(views.shape[:2])}, got {tuple(mask.shape)}")
    return mask.to(device=views.device, dtype=torch.bool)


def _subsample(n: int, max_samples: int | None, seed: int) -> torch.Tensor | None:
    if max_samples is None or n <= max_samples:
        return None
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_samples]


@torch.no_grad()
def alignment(views: torch.Tensor, mask: torch.Tensor | None = None, alpha: float = 2.0) -> float:
    """Mean ``||u_a - u_b||^alpha`` over pairs a < b of present views of each sample. views: [N, M, d]."""
    mask = _check_views(views, mask)
    m = views.shape[1]
    if m < 2:
        raise ValueError("alignment needs at least 2 views")
    u = F.normalize(views.double(), dim=-1)
    sq = (2.0 - 2.0 * u @ u.transpose(1, 2)).clamp_min(0.0)  # [N, M, M]
    upper = torch.triu(torch.ones(m, m, dtype=torch.bool, device=u.device), diagonal=1)
    pairs = mask[:, :, None] & mask[:, None, :] & upper
    if not pairs.any():
        raise ValueError("no sample has two present views")
    return float(sq[pairs].pow(alpha / 2.0).mean())


@torch.no_grad()
def uniformity(
    views: torch.Tensor,
    mask: torch.Tensor | None = None,
    t: float = 2.0,
    max_samples: int | None = 4096,
    seed: int = 0,
) -> float:
    """``log mean_{i != j} exp(-t ||u_i - u_j||^2)`` within each view, averaged over views.

    views: [N, M, d]; at most ``max_samples`` present samples per view (fixed random subset)
    keep the [n, n] distance matrix small.
    """
    mask = _check_views(views, mask)
    values = []
    for a in range(views.shape[1]):  # M is small; each view has its own present subset
        u = F.normalize(views[mask[:, a], a].double(), dim=-1)
        sub = _subsample(u.shape[0], max_samples, seed)
        if sub is not None:
            u = u[sub.to(u.device)]
        n = u.shape[0]
        if n < 2:
            continue
        sq = (2.0 - 2.0 * u @ u.T).clamp_min(0.0)
        off = ~torch.eye(n, dtype=torch.bool, device=u.device)
        values.append(float(torch.logsumexp(-t * sq[off], 0) - math.log(n * (n - 1))))
    if not values:
        raise ValueError("uniformity needs a view with at least 2 present samples")
    return float(np.mean(values))


@torch.no_grad()
def singular_values(x: torch.Tensor) -> torch.Tensor:
    """Singular values (descending, float64) of an embedding matrix x: [N, d]."""
    if x.ndim != 2:
        raise ValueError(f"expected an [N, d] matrix, got {tuple(x.shape)}")
    return torch.linalg.svdvals(x.double()).cpu()


def effective_rank(x: torch.Tensor, *, is_spectrum: bool = False) -> float:
    """``exp(-sum p log p)``, ``p = s / sum(s)``; x: [N, d] matrix, or its singular values if ``is_spectrum``."""
    s = x.double().cpu() if is_spectrum else singular_values(x)
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def numerical_rank(x: torch.Tensor, rtol: float | None = None) -> int:
    """Singular values above ``rtol * s_max``; default rtol = max(N, d) * eps of x's dtype. x: [N, d]."""
    if rtol is None:
        dtype = x.dtype if x.dtype.is_floating_point else torch.float32
        rtol = max(x.shape) * torch.finfo(dtype).eps
    s = singular_values(x)
    if s.numel() == 0 or s[0] == 0:
        return 0
    return int((s > rtol * s[0]).sum())


@torch.no_grad()
def vmf_kde_entropy(
    views: torch.Tensor,
    mask: torch.Tensor | None = None,
    kappa: float = 10.0,
    max_samples: int | None = 4096,
    seed: int = 0,
) -> dict[str, Any]:
    """ER's entropy estimate per view (vMF KDE, self-pair included, as eq. 9).

    views: [N, M, d]. Returns ``{"mean": float, "per_view": list[float]}`` in nats.
    """
    mask = _check_views(views, mask)
    if kappa <= 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    log_c = vmf_log_normaliser(views.shape[2], kappa)
    per_view = []
    for a in range(views.shape[1]):
        u = F.normalize(views[mask[:, a], a].double(), dim=-1)
        sub = _subsample(u.shape[0], max_samples, seed)
        if sub is not None:
            u = u[sub.to(u.device)]
        if u.shape[0] == 0:
            continue
        log_p = torch.logsumexp(kappa * (u @ u.T), dim=1) - math.log(u.shape[0]) + log_c
        per_view.append(float(-log_p.mean()))
    if not per_view:
        raise ValueError("vmf_kde_entropy: no present embeddings")
    return {"mean": float(np.mean(per_view)), "per_view": per_view}


@torch.no_grad()
def similarity_samples(
    views: torch.Tensor,
    mask: torch.Tensor | None = None,
    max_pairs: int = 200_000,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarities of positive pairs (two present views of one sample, a < b) and of
    negative pairs (present views of two different samples, any views), for histograms.

    views: [N, M, d]. Returns (positive [P], negative [Q]) float32 CPU tensors, each at
    most ``max_pairs`` long (uniform random subsets, fixed seed; every negative pair when
    there are at most ``max_pairs`` of them).
    """
    mask = _check_views(views, mask)
    g = torch.Generator().manual_seed(seed)
    u = F.normalize(views.float(), dim=-1)
    m = mask.shape[1]
    upper = torch.triu(torch.ones(m, m, dtype=torch.bool, device=u.device), diagonal=1)
    pairs = (mask[:, :, None] & mask[:, None, :] & upper).nonzero()  # [P, 3] = (i, a, b)
    if pairs.shape[0] > max_pairs:
        pairs = pairs[torch.randperm(pairs.shape[0], generator=g)[:max_pairs].to(pairs.device)]
    pos = (u[pairs[:, 0], pairs[:, 1]] * u[pairs[:, 0], pairs[:, 2]]).sum(-1)

    present = mask.nonzero()  # [E, 2] = (i, a)
    e = present.shape[0]
    if e * e <= max_pairs:
        # few enough: every ordered pair of present views of different samples, exactly once
        flat = u[present[:, 0], present[:, 1]]
        other = present[:, None, 0] != present[None, :, 0]
        neg = (flat @ flat.T)[other]
    else:
        r1 = torch.randint(e, (max_pairs,), generator=g).to(present.device)
        r2 = torch.randint(e, (max_pairs,), generator=g).to(present.device)
        e1, e2 = present[r1], present[r2]
        keep = e1[:, 0] != e2[:, 0]
        e1, e2 = e1[keep], e2[keep]
        neg = (u[e1[:, 0], e1[:, 1]] * u[e2[:, 0], e2[:, 1]]).sum(-1)
    return pos.float().cpu(), neg.float().cpu()


def mi_lower_bound(loss: float | torch.Tensor, K: int, M: int) -> float:
    """Poly-view lower bound ``log(K M - M + 1) - loss`` on the one-vs-rest MI, in nats, as a
    float: :func:`mmviews.objectives.mi_lower_bound`, so that training logs and evaluation
    reports give the same quantity."""
    return float(objective_mi_lower_bound(loss, K, M))


@torch.no_grad()
def representation_diagnostics(
    views: torch.Tensor,
    mask: torch.Tensor | None = None,
    fused: torch.Tensor | None = None,
    *,
    kappa: float = 10.0,
    max_samples: int | None = 4096,
    seed: int = 0,
) -> tuple[dict[str, float], dict[str, Any]]:
    """All diagnostics at once.

    views: [N, M, d]; mask: [N, M]; fused: optional [N, D] fused embeddings.
    Returns (metrics, data): scalar metrics (``align``, ``unif``, ``erank/view_mean``,
    ``nrank/view_mean``, ``erank/fused``, ``nrank/fused``, ``entropy_vmf``, ``sim_pos_mean``,
    ``sim_neg_mean``) and arrays for plots (``spectrum/<name>`` singular values,
    ``sim_pos`` and ``sim_neg`` similarity samples).
    """
    mask = _check_views(views, mask)
    metrics: dict[str, float] = {}
    data: dict[str, Any] = {}
    if views.shape[1] >= 2 and (mask.sum(1) >= 2).any():
        metrics["align"] = alignment(views, mask)
    metrics["unif"] = uniformity(views, mask, max_samples=max_samples, seed=seed)
    eranks, nranks = [], []
    for a in range(views.shape[1]):
        x = views[mask[:, a], a]
        if x.shape[0] == 0:
            continue
        s = singular_values(x)
        data[f"spectrum/view{a}"] = s.numpy()
        eranks.append(effective_rank(s, is_spectrum=True))
        nranks.append(numerical_rank(x))
    metrics["erank/view_mean"] = float(np.mean(eranks))
    metrics["nrank/view_mean"] = float(np.mean(nranks))
    if fused is not None:
        s = singular_values(fused)
        data["spectrum/fused"] = s.numpy()
        metrics["erank/fused"] = effective_rank(s, is_spectrum=True)
        metrics["nrank/fused"] = float(numerical_rank(fused))
    metrics["entropy_vmf"] = vmf_kde_entropy(views, mask, kappa=kappa, max_samples=max_samples, seed=seed)["mean"]
    pos, neg = similarity_samples(views, mask, seed=seed)
    data["sim_pos"], data["sim_neg"] = pos.numpy(), neg.numpy()
    if pos.numel():
        metrics["sim_pos_mean"] = float(pos.mean())
    if neg.numel():
        metrics["sim_neg_mean"] = float(neg.mean())
    return metrics, data
