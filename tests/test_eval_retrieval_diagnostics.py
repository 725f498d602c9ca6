"""Retrieval with known matchings and representation diagnostics on matrices with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import vonmises_fisher

from mmviews.eval import (
    alignment,
    cross_view_retrieval,
    effective_rank,
    mi_lower_bound,
    numerical_rank,
    representation_diagnostics,
    retrieval_metrics,
    retrieval_ranks,
    similarity_samples,
    uniformity,
    vmf_kde_entropy,
    vmf_log_normaliser,
)


def test_retrieval_perfect_and_known_ranks():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(50, 8, generator=g)
    m = retrieval_metrics(q, 3.0 * q)  # cosine ignores scale: every match is rank 1
    assert m["R@1"] == m["R@5"] == m["R@10"] == 1.0 and m["MedR"] == 1.0

    # Gallery rows shifted by s positions: query i's match i lies at a known rank. Build a
    # 1-D ordering on the circle so the ranks are known in closed form.
    n = 20
    angles = torch.linspace(0, math.pi / 2, n)  # quarter circle: cosine decreases with angle gap
    pts = torch.stack([angles.cos(), angles.sin()], 1)
    query = pts[torch.zeros(n, dtype=torch.long)].clone()  # every query at angle 0
    gallery = pts.clone()
    # query i has similarity cos(angle_i) to its match; items j < i are closer, so the rank is i + 1
    ranks = retrieval_ranks(query, gallery, chunk_size=6)
    assert ranks.tolist() == list(range(1, n + 1))
    m = retrieval_metrics(query, gallery)
    assert m["R@1"] == pytest.approx(1 / n)
    assert m["R@5"] == pytest.approx(5 / n)
    assert m["R@10"] == pytest.approx(10 / n)
    assert m["MedR"] == pytest.approx(float(np.median(np.arange(1, n + 1))))
    assert m["MeanR"] == pytest.approx((n + 1) / 2)


def test_retrieval_matches_argsort_reference():
    g = torch.Generator().manual_seed(1)
    q, gal = torch.randn(64, 5, generator=g), torch.randn(64, 5, generator=g)
    sim = torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(gal, dim=1).T
    ref = [int((torch.argsort(sim[i], descending=True) == i).nonzero()) + 1 for i in range(64)]
    assert retrieval_ranks(q, gal, chunk_size=10).tolist() == ref


def test_collapsed_embeddings_get_worst_rank():
    q = torch.ones(30, 4)
    m = retrieval_metrics(q, q)
    assert m["R@1"] == 0.0 and m["MedR"] == 30.0


def test_cross_view_retrieval_uses_present_pairs_only():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(40, 6, generator=g)
    views = torch.stack([base, base + 0.01 * torch.randn(40, 6, generator=g), torch.randn(40, 6, generator=g)], 1)
    mask = torch.ones(40, 3, dtype=torch.bool)
    mask[:10, 1] = False
    out = cross_view_retrieval(views, mask, 0, 1)
    assert out["n"] == 30
    assert out["a2b/R@1"] == 1.0 and out["b2a/R@1"] == 1.0
    rnd = cross_view_retrieval(views, mask, 0, 2)
    assert rnd["a2b/R@1"] < 0.3
    with pytest.raises(ValueError, match="two different indices"):
        cross_view_retrieval(views, mask, 1, 1)


def test_effective_and_numerical_rank_of_known_matrices():
    assert effective_rank(torch.eye(16)) == pytest.approx(16.0)
    assert numerical_rank(torch.eye(16)) == 16
    u, v = torch.randn(100, 1), torch.randn(1, 32)
    rank1 = u @ v
    assert effective_rank(rank1) == pytest.approx(1.0, abs=1e-4)
    assert numerical_rank(rank1) == 1
    rank3 = torch.randn(200, 3) @ torch.randn(3, 64)
    assert numerical_rank(rank3) == 3
    s = torch.tensor([4.0, 2.0, 1.0, 1.0])
    p = s / s.sum()
    assert effective_rank(torch.diag(s)) == pytest.approx(float(torch.exp(-(p * p.log()).sum())))
    assert effective_rank(s, is_spectrum=True) == pytest.approx(effective_rank(torch.diag(s)))


def test_alignment_and_uniformity():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    assert alignment(torch.stack([x, 2 * x], 1)) == pytest.approx(0.0, abs=1e-12)
    assert alignment(torch.stack([x, -x], 1)) == pytest.approx(4.0)
    assert alignment(torch.stack([x, -x], 1), alpha=1.0) == pytest.approx(2.0)
    # absent views are ignored
    mask = torch.ones(64, 3, dtype=torch.bool)
    mask[:, 2] = False
    assert alignment(torch.stack([x, x, -x], 1), mask) == pytest.approx(0.0, abs=1e-12)

    views = torch.stack([x, torch.randn(64, 8, generator=g)], 1)
    ref = []
    for a in range(2):
        u = torch.nn.functional.normalize(views[:, a].double(), dim=1)
        ref.append(float(torch.pdist(u).pow(2).mul(-2).exp().mean().log()))  # Wang & Isola's code
    assert uniformity(views) == pytest.approx(float(np.mean(ref)), rel=1e-9)
    collapsed = torch.ones(32, 2, 8)
    assert uniformity(collapsed) == pytest.approx(0.0, abs=1e-12)  # the worst value


@pytest.mark.parametrize("d,kappa", [(3, 5.0), (16, 10.0), (128, 14.0)])
def test_vmf_log_normaliser_matches_scipy(d: int, kappa: float):
    mu = np.zeros(d)
    mu[0] = 1.0
    ref = vonmises_fisher(mu, kappa).logpdf(mu) - kappa  # log C_d(kappa)
    assert vmf_log_normaliser(d, kappa) == pytest.approx(ref, rel=1e-10)
    if d == 3:  # closed form kappa / (4 pi sinh kappa)
        assert vmf_log_normaliser(3, kappa) == pytest.approx(math.log(kappa / (4 * math.pi * math.sinh(kappa))))


@pytest.mark.parametrize("d,kappa", [(512, 10.0), (2048, 50.0)])
def test_vmf_log_normaliser_where_scipy_underflows(d: int, kappa: float):
    import mpmath  # ships with sympy, a torch dependency
    mpmath.mp.dps = 50
    nu = d / 2 - 1
    ref = nu * math.log(kappa) - d / 2 * math.log(2 * math.pi) - float(mpmath.log(mpmath.besseli(nu, kappa)))
    assert vmf_log_normaliser(d, kappa) == pytest.approx(ref, rel=1e-10)


def test_vmf_kde_entropy_known_cases():
    d, kappa = 8, 10.0
    same = torch.ones(20, 1, d)  # all embeddings equal: log p = kappa + log C
    h = vmf_kde_entropy(same, kappa=kappa)
    assert h["mean"] == pytest.approx(-(kappa + vmf_log_normaliser(d, kappa)))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 2, d, generator=g)
    u = torch.nn.functional.normalize(x[:, 1].double(), dim=1)
    ref = -np.mean([
        math.log(sum(math.exp(kappa * float(u[i] @ u[j])) for j in range(50)) / 50) + vmf_log_normaliser(d, kappa)
        for i in range(50)
    ])
    assert vmf_kde_entropy(x, kappa=kappa)["per_view"][1] == pytest.approx(ref, rel=1e-9)
    spread = vmf_kde_entropy(x, kappa=kappa)
    assert spread["mean"] == pytest.approx(float(np.mean(spread["per_view"])), rel=1e-12)  # mean over views
    # Each point's own kernel bounds its density from below (p(x_i) >= e^kappa C / n), so the
    # estimate can exceed the collapsed one by at most log n.
    assert all(h["mean"] < e <= h["mean"] + math.log(50) for e in spread["per_view"]), spread["per_view"]
    assert vmf_kde_entropy(x, kappa=kappa)["per_view"][1] > h["mean"]  # spread > collapsed


def test_similarity_samples_and_diagnostics_bundle():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, generator=g)
    views = torch.stack([x, x, x], 1)
    mask = torch.ones(40, 3, dtype=torch.bool)
    mask[0, 1:] = False
    pos, neg = similarity_samples(views, mask, max_pairs=1000)
    assert pos.numel() == 39 * 3  # pairs (0,1), (0,2), (1,2) for the 39 complete samples
    torch.testing.assert_close(pos, torch.ones_like(pos))
    assert neg.numel() > 500 and neg.abs().mean() < 0.5  # different random samples
    # small case: every negative pair exactly once (118 present entries, minus same-sample pairs)
    pos_all, neg_all = similarity_samples(views, mask, max_pairs=118 * 118)
    assert neg_all.numel() == 118 * 118 - (39 * 9 + 1)
    entries = [(i, a) for i in range(40) for a in range(3) if mask[i, a]]
    u = torch.nn.functional.normalize(views, dim=-1)
    ref = sorted(float(u[i, a] @ u[j, b]) for i, a in entries for j, b in entries if i != j)
    torch.testing.assert_close(neg_all.sort().values, torch.tensor(ref), atol=1e-5, rtol=0)

    metrics, data = representation_diagnostics(views, mask, fused=views.flatten(1))
    assert metrics["align"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["sim_pos_mean"] == pytest.approx(1.0)
    assert metrics["nrank/fused"] == 16  # three copies of a rank-16 matrix
    assert {"spectrum/view0", "spectrum/fused", "sim_pos", "sim_neg"} <= set(data)
    assert all(math.isfinite(v) for v in metrics.values())


def test_mi_lower_bound():
    assert mi_lower_bound(1.0, 4, 3) == pytest.approx(math.log(4 * 3 - 3 + 1) - 1.0)
    assert mi_lower_bound(torch.tensor(0.5), 256, 2) == pytest.approx(math.log(511) - 0.5)
