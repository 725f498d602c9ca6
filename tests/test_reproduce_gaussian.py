"""Tests of recipes/reproduce/polyview_gaussian.py (poly-view paper section 3.1, Figure 2)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from repo_state import repository_unchanged

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "reproduce" / "polyview_gaussian.py"


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("polyview_gaussian_recipe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


def gaussian_mi_from_covariance(cov: np.ndarray, a: int = 0) -> float:
    """I(x_a; x_rest) = 1/2 [log det C_aa + log det C_rest - log det C] for a jointly Gaussian vector."""
    rest = [i for i in range(cov.shape[0]) if i != a]
    _, logdet_all = np.linalg.slogdet(cov)
    _, logdet_rest = np.linalg.slogdet(cov[np.ix_(rest, rest)])
    return 0.5 * (math.log(cov[a, a]) + logdet_rest - logdet_all)


@pytest.mark.parametrize("M", [2, 3, 4, 8, 10])
@pytest.mark.parametrize("sigma0, sigma", [(1.0, 0.03), (1.0, 0.5), (2.0, 1.5)])
def test_closed_form_matches_gaussian_entropies(recipe, M, sigma0, sigma):
    cov = sigma**2 * np.eye(M) + sigma0**2 * np.ones((M, M))
    expected = gaussian_mi_from_covariance(cov)
    assert recipe.one_vs_rest_mi(M, sigma0, sigma) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_closed_form_matches_sampled_views(recipe):
    """Monte-Carlo: the generator's empirical covariance gives the same MI (checks data and formula)."""
    M, sigma0, sigma = 4, 1.0, 0.3
    gen = torch.Generator().manual_seed(0)
    x = recipe.sample_views(gen, 1, 200_000, M, sigma0, sigma)[0, :, :, 0].double().numpy()  # [n, M]
    empirical = gaussian_mi_from_covariance(np.cov(x, rowvar=False))
    # Third route: x_{-a} acts through its mean, so I = -1/2 log(1 - corr(x_a, mean of the rest)^2).
    rho = np.corrcoef(x[:, 0], x[:, 1:].mean(axis=1))[0, 1]
    via_mean = -0.5 * math.log(1 - rho**2)
    truth = recipe.one_vs_rest_mi(M, sigma0, sigma)
    assert empirical == pytest.approx(truth, abs=0.02)
    assert via_mean == pytest.approx(truth, abs=0.02)
    # The MI grows with M and tends to I(x_a; c) = 1/2 log(1 + sigma0^2 / sigma^2) (paper eq. 27).
    values = [recipe.one_vs_rest_mi(m, sigma0, sigma) for m in (2, 4, 8, 1000)]
    assert all(b > a for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.5 * math.log(1 + sigma0**2 / sigma**2), abs=1e-3)


def test_bound_constants(recipe):
    assert recipe.bound_constant("multi_crop", 16, 8) == pytest.approx(math.log(31))
    for name in ("arithmetic_pvc", "geometric_pvc", "sufficient_statistics"):
        assert recipe.bound_constant(name, 16, 8) == pytest.approx(math.log(15 * 8 + 1))
    with pytest.raises(ValueError):
        recipe.one_vs_rest_mi(1, 1.0, 0.1)


def test_grouped_training_equals_separate_training(recipe):
    """Summing the groups' losses and stepping AdamW once trains each network as if alone."""
    torch.manual_seed(0)
    from mmviews.objectives import get_objective

    x = torch.randn(3, 6, 3, 1)
    objectives = [get_objective("geometric_pvc", temperature=0.1), get_objective("multi_crop", temperature=0.1)]
    grouped = recipe.GroupedMLP([5, 5])
    alone = recipe.GroupedMLP([5])
    assert torch.equal(grouped.w2[1], alone.w2[0])  # same seed, same init
    opt_g = torch.optim.AdamW(grouped.parameters(), lr=1e-2, weight_decay=5e-3)
    opt_a = torch.optim.AdamW(alone.parameters(), lr=1e-2, weight_decay=5e-3)
    for step in range(3):
        batch = x[step : step + 1].expand(2, -1, -1, -1)
        z = grouped(batch)
        opt_g.zero_grad()
        (objectives[0](z[0]) + objectives[1](z[1])).backward()
        opt_g.step()
        opt_a.zero_grad()
        objectives[1](alone(x[step : step + 1])[0]).backward()
        opt_a.step()
    for name in ("w1", "b1", "w2", "b2"):
        torch.testing.assert_close(getattr(grouped, name)[1], getattr(alone, name)[0])
    assert not torch.allclose(grouped.w2[0], grouped.w2[1])  # the two objectives did train differently


def test_smoke_run_writes_tables_and_plot(recipe, tmp_path, monkeypatch):
    # from a temporary current folder, without --out: the default folder there, nothing in the repository
    monkeypatch.chdir(tmp_path)
    with repository_unchanged():
        assert recipe.main(["--smoke", "--no-progress"]) == 0
    tmp_path = tmp_path / "runs" / "reproduce" / "polyview_gaussian"
    with open(tmp_path / "runs.csv") as handle:
        rows = list(csv.DictReader(handle))
    smoke = recipe.regimes_for("smoke")
    expected = sum(len(r.Ms) * r.seeds for r in smoke.values()) * len(recipe.OBJECTIVES)
    assert len(rows) == expected
    for row in rows:
        K, M = int(row["K"]), int(row["M"])
        bound, loss, true_mi = float(row["bound"]), float(row["loss"]), float(row["true_mi"])
        assert math.isfinite(bound) and loss > 0
        assert true_mi == pytest.approx(recipe.one_vs_rest_mi(M, 1.0, 0.03), rel=1e-4)
        cap = math.log(2 * K - 1) if row["objective"] == "multi_crop" else math.log((K - 1) * M + 1)
        assert bound == pytest.approx(cap - loss, abs=1e-4)
        # What the bound promises: it stays below the true mutual information (the poly-view
        # bound is a lower bound; it is evaluated on held-out samples) and below its cap.
        assert bound < true_mi and bound <= cap, row
        assert float(row["gap"]) == pytest.approx(true_mi - bound, abs=1e-4)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["summary"]) == expected // 2  # two seeds per setting
    png = (tmp_path / "mi_gap.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    # A second run reuses the finished pieces from OUT/cache and writes the same table.
    first = (tmp_path / "runs.csv").read_text()
    (tmp_path / "runs.csv").unlink()
    assert len(list((tmp_path / "cache").glob("*.json"))) == sum(len(r.Ms) for r in smoke.values())
    assert recipe.main(["--smoke", "--out", str(tmp_path), "--no-progress"]) == 0
    assert (tmp_path / "runs.csv").read_text() == first


def test_bad_arguments_are_rejected(recipe, tmp_path):
    with pytest.raises(ValueError, match="--regimes"):
        recipe.main(["--smoke", "--regimes", "nope", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--Ms"):
        recipe.main(["--smoke", "--Ms", "1,2", "--out", str(tmp_path)])
