"""`mmviews bench objectives` on tiny sizes: every objective in the JSON with finite numbers,
the reference loops it times agreeing with the library (values and gradients), and a wrong
reference stopping the benchmark."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmviews.bench import objectives as bench
from mmviews.cli import main
from mmviews.objectives import get_objective, list_objectives

TINY = ["--K", "8", "--M", "3", "--d", "8", "--repeats", "1", "--warmup", "0", "--no-progress", "--reference-K", "4"]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "objectives.json"
    assert main(["bench", "objectives", *TINY, "--device", "cpu", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_json_has_every_objective_with_finite_numbers(result):
    assert result["config"]["K"] == 8 and result["config"]["M"] == 3 and result["config"]["d"] == 8
    assert set(result["objectives"]) == set(list_objectives())
    for key, floor in result["floors"].items():
        assert _finite_positive(floor["time_ms"]) and _finite_positive(floor["peak_mb"]), key
    for name, row in result["objectives"].items():
        for field in ("time_ms", "peak_mb", "time_vs_floor", "memory_vs_floor"):
            assert _finite_positive(row[field]), (name, field, row[field])
        assert math.isfinite(row["loss"]), name
        assert row["floor"] in result["floors"]
        assert len(row["times_ms"]) == 1
        if name in bench.REFERENCE_LOSSES:
            assert row["reference"]["K"] == 4 == result["config"]["reference_K"]
            assert _finite_positive(row["reference"]["time_ms"]) and _finite_positive(row["speedup_vs_reference"]), name
            assert _finite_positive(row["library_at_reference_K"]["time_ms"]), name
            assert row["speedup_vs_reference"] == pytest.approx(
                row["reference"]["time_ms"] / row["library_at_reference_K"]["time_ms"]
            )
        else:
            assert row["reference"] is None and row["speedup_vs_reference"] is None, name
        # Each target of TARGETS is reported with the row's value and the verdict of its bound
        # (speedups must reach it, ratios to the floor must stay under it).
        assert [(t["metric"], t["bound"]) for t in row["targets"]] == list(bench.TARGETS.get(name, [])), name
        for target in row["targets"]:
            value, bound = row[target["metric"]], target["bound"]
            assert target["value"] == value, (name, target)
            if value is None:
                assert target["ok"] is None, (name, target)
            else:
                assert target["ok"] is (value >= bound if target["metric"] == "speedup_vs_reference" else value <= bound)
    # simclr needs two views: it runs on the first two, against a floor of that size
    assert result["objectives"]["simclr"]["M"] == 2 and "floor@M=2" in result["floors"]


def test_reference_loops_agree_with_the_library_in_the_bench(result):
    # every objective but ipmc (whose reference is too slow to time) has a reference loop
    assert set(bench.REFERENCE_LOSSES) == set(list_objectives()) - {"ipmc"}
    for name in bench.REFERENCE_LOSSES:
        check = result["objectives"][name]["reference_check"]
        assert check["reference_loss"] == pytest.approx(check["library_loss"], rel=1e-7, abs=1e-9), name


@pytest.mark.parametrize("name", sorted(bench.REFERENCE_LOSSES))
def test_reference_loss_matches_library_value_and_gradient(name):
    """The bench's reference for ``name``, called with the objective's constructor keywords,
    computes that objective's loss."""
    M = 2 if name == "simclr" else 4
    z = torch.randn(6, M, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    z_lib, z_ref = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    params = bench._objective_kwargs(name, 0.2)
    want = get_objective(name, **params)(z_lib)
    got = bench.REFERENCE_LOSSES[name](z_ref, params)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    want.backward()
    got.backward()
    torch.testing.assert_close(z_ref.grad, z_lib.grad, rtol=1e-8, atol=1e-10)


def test_floor_is_cross_entropy_over_the_full_score_matrix():
    z = torch.randn(4, 3, 5, dtype=torch.float64)
    u = torch.nn.functional.normalize(z, dim=-1).reshape(12, 5)
    scores = u @ u.T / 0.5
    # anchor (i, a) -> positive (i, a+1 mod M), written out by hand
    manual = torch.stack(
        [torch.logsumexp(scores[r], 0) - scores[r, (r // 3) * 3 + (r % 3 + 1) % 3] for r in range(12)]
    ).mean()
    torch.testing.assert_close(bench.floor_loss(z, 0.5), manual)


def test_a_wrong_reference_stops_the_benchmark(monkeypatch):
    right = bench.REFERENCE_LOSSES["mv_dhel"]
    monkeypatch.setitem(bench.REFERENCE_LOSSES, "mv_dhel", lambda z, params: right(z, params) + 1e-3)
    with pytest.raises(RuntimeError, match="reference mv_dhel"):
        bench.benchmark(K=8, M=3, d=8, repeats=1, warmup=0, objectives=["mv_dhel"], device="cpu", progress=False)


def test_reference_column_can_be_skipped():
    out = bench.benchmark(K=4, M=3, d=4, repeats=1, warmup=0, objectives=["mv_dhel"], device="cpu", progress=False,
                          memory=False, reference_K=0)
    row = out["objectives"]["mv_dhel"]
    assert row["reference"] is None and row["speedup_vs_reference"] is None and "reference_check" not in row


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="unknown objective"):
        bench.benchmark(K=8, M=3, d=8, objectives=["nope"], device="cpu", progress=False)
    with pytest.raises(ValueError, match="--K"):
        bench.benchmark(K=1, M=3, d=8, device="cpu", progress=False)
    with pytest.raises(ValueError, match="--reference-K"):
        bench.benchmark(K=8, M=3, d=8, device="cpu", progress=False, reference_K=1)
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])


def test_default_measures_like_the_readme_and_reports_the_noise(result):
    """On CPU the default is one thread's CPU time (how the README's figures were measured),
    and every ratio comes with the interquartile range of its per-round ratios."""
    config = result["config"]
    assert config["clock"] == "cpu" and config["threads"] == 1 and config["device"] == "cpu"
    for name, row in result["objectives"].items():
        low, high = row["time_vs_floor_iqr"]
        assert low <= row["time_vs_floor"] <= high, name
        for target in row["targets"]:
            assert target["verdict"] in ("ok", "MISS", "noisy"), (name, target)


def test_verdicts_follow_the_spread_of_the_rounds():
    assert bench.target_verdict(False, 1.5, [1.6, 1.9]) == "MISS"  # every middle round above the bound
    assert bench.target_verdict(False, 1.5, [1.2, 1.9]) == "noisy"  # the median misses, the spread straddles
    assert bench.target_verdict(True, 1.5, [1.2, 1.6]) == "noisy"
    assert bench.target_verdict(True, 1.5, [0.9, 1.1]) == "ok"
    assert bench.target_verdict(None, 1.5) == "?" and bench.target_verdict(True, 50.0) == "ok"
    assert bench._quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0) and bench._quartiles([7.0]) == (7.0, 7.0)


def test_no_cuda_message_on_a_cpu_only_machine(tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the message concerns CPU-only machines")
    out = subprocess.run([sys.executable, "-m", "mmviews.cli", "bench", "objectives", *TINY, "--objectives", "mv_dhel",
                          "--device", "cpu", "--out", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gpuGetDeviceCount" not in out.stderr + out.stdout
    assert json.loads((tmp_path / "b.json").read_text())["objectives"]["mv_dhel"]["peak_mb"] is not None
