"""The CPU-scale reproduction scripts of recipes/reproduce/ (view multiplicity, f-MICL similarity,
ER batch size, IPMC ablation): each ``--smoke`` run trains through the public trainer and
writes its tables and a PNG plot.

The scripts are run in this process (``main(argv)``) so that torch and the trainer are imported
once; each smoke run trains 2 to 4 tiny runs (32 samples, one epoch). The sweeps run in this
process too (``--jobs 1``: a worker process pays about 3 s of imports before its first run), except
the f-MICL one, which goes through ``run_sweep``'s pool of worker processes (``--jobs 2``).

Each smoke run but one is started from a temporary current folder without ``--out``: it writes
under ``runs/reproduce/<name>/`` there and leaves every file of the repository as it was."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from repo_state import repository_unchanged

REPRO = Path(__file__).resolve().parents[1] / "recipes" / "reproduce"


def _load(name: str):
    """The script as a module (each script puts its own folder on the path for ``_common``)."""
    spec = importlib.util.spec_from_file_location(f"reproduce_{name}", REPRO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, argv: list[str], folder: str,
              module=None) -> Path:
    """``script``'s ``main(argv)`` run from ``tmp_path`` with the default output folder, which
    it returns; the repository is unchanged after it."""
    monkeypatch.chdir(tmp_path)
    with repository_unchanged():
        assert (module or _load(script)).main(argv) == 0
    return tmp_path / "runs" / "reproduce" / folder


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _check_common(out: Path, png: str, n_runs: int) -> list[dict[str, str]]:
    rows = _rows(out / "results.csv")
    assert len(rows) == n_runs
    assert (out / png).is_file() and (out / png).stat().st_size > 1000
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(json.loads((out / "results.json").read_text())) == n_runs
    commands = (out / "commands.txt").read_text().strip().splitlines()
    assert len(commands) == n_runs and all(c.startswith("mmviews train ") for c in commands)
    for row in rows:
        assert row["status"] == "ok", row
        # the table's numbers are those of the run it names (its results.json), a real trainer run
        # whose resolved config holds the swept setting
        results = json.loads((Path(row["run_dir"]) / "results.json").read_text())
        # (the CSV rounds to 4 decimals)
        assert float(row["acc"]) == pytest.approx(results["eval"]["test/linear/class/acc"], abs=5.1e-5), row
        assert float(row["erank"]) == pytest.approx(results["eval"]["test/diag/erank/fused"], abs=5.1e-5), row
        assert float(row["erank"]) >= 1.0
        assert int(row["steps"]) == results["steps"] >= 1
        config = yaml.safe_load((Path(row["run_dir"]) / "config.yaml").read_text())
        row["_config"] = config  # type: ignore[assignment]
        # smoke runs report without PNGs (evaluation.plots: false, a second of CPU per run saved)
        report = Path(row["run_dir"]) / "eval"
        assert config["evaluation"]["plots"] is False
        assert not list(report.glob("*.png")) and "Plots not drawn" in (report / "summary.md").read_text()
    return rows


def test_er_batch_size_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _smoke_in(tmp_path, monkeypatch, "er_batch_size", ["--smoke", "--jobs", "1"], "er_batch_size")
    rows = _check_common(out, "er_batch_size.png", 3)
    assert {r["objective"] for r in rows} == {"simclr", "er", "er_ema"}
    for r in rows:
        objective = r["_config"]["objective"]
        assert objective["name"] == ("er" if r["objective"] == "er_ema" else r["objective"])
        # er_ema: the EMA teacher with the paper's coefficient; the others have none
        assert objective["ema_teacher"] == (r["objective"] == "er_ema")
        if r["objective"] == "er_ema":
            assert objective["teacher_momentum"] == 0.99
        assert r["_config"]["data"]["batch_size"] == int(r["batch_size"]) == 8
    summary = _rows(out / "summary.csv")
    assert {s["objective"] for s in summary} == {"simclr", "er", "er_ema"}


def test_er_batch_size_equal_teacher_horizon(tmp_path: Path) -> None:
    """--equal-horizon: K / (1 - m_K) samples, the teacher's horizon, is the same at every K."""
    out = tmp_path / "er"
    argv = ["--smoke", "--objectives", "er_ema", "--equal-horizon", "--batch-sizes", "8", "32", "--jobs", "1",
            "--out", str(out)]
    assert _load("er_batch_size").main(argv) == 0
    rows = _check_common(out, "er_batch_size.png", 2)
    momentum = {int(r["batch_size"]): r["_config"]["objective"]["teacher_momentum"] for r in rows}
    assert momentum[8] == pytest.approx(0.99)  # the smallest K keeps --momentum
    assert momentum[32] == pytest.approx(0.96)
    assert 8 / (1 - momentum[8]) == pytest.approx(32 / (1 - momentum[32]))


def test_temperature_siglip_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed and learned temperatures of the softmax objectives and siglip, M = 3 views: each
    row's run holds its variant's objective (learned or not), and the learned ones report the
    value they ended at (moved from where they started), the fixed ones none."""
    module = _load("temperature_siglip")
    out = _smoke_in(tmp_path, monkeypatch, "temperature_siglip", ["--smoke", "--jobs", "1"], "temperature_siglip",
                    module=module)
    rows = _check_common(out, "temperature_siglip.png", len(module.DEFAULT_VARIANTS))
    assert [r["variant"] for r in rows] == list(module.DEFAULT_VARIANTS)
    for r in rows:
        config = r["_config"]
        name, params = module.VARIANTS[r["variant"]]
        objective = config["objective"]
        assert objective["name"] == name and objective["params"] == params
        assert [v["modality"] for v in config["views"]] == ["audio", "image", "flow"] and int(r["M"]) == 3
        assert config["data"]["batch_size"] == int(r["batch_size"]) == 8
        learned = json.loads((Path(r["run_dir"]) / "results.json").read_text())["objective_learned"]
        if r["variant"] in ("geometric_pvc", "mv_dhel"):
            assert learned == {} and math.isnan(float(r["final_temperature"]))
        else:  # the learned temperature (and siglip's bias) moved from its start, and is the row's
            start = params["temperature"]
            assert float(r["final_temperature"]) == pytest.approx(learned["temperature"], abs=5.1e-5)
            assert learned["temperature"] != start
            if name == "siglip":
                assert learned["bias"] != params["bias"]
                assert float(r["final_bias"]) == pytest.approx(learned["bias"], abs=5.1e-5)
    summary = _rows(out / "summary.csv")
    assert [s["variant"] for s in summary] == list(module.DEFAULT_VARIANTS)
    # A second call reuses every finished run (its config.yaml, with the precision ``auto``
    # resolved to, equals the recipe's): nothing is retrained and the table is the same.
    written = {r["run_dir"]: (Path(r["run_dir"]) / "results.json").stat().st_mtime_ns for r in rows}
    assert module.main(["--smoke", "--jobs", "1"]) == 0
    assert {d: (Path(d) / "results.json").stat().st_mtime_ns for d in written} == written
    again = _rows(out / "results.csv")
    assert [(r["run_dir"], r["acc"]) for r in again] == [(r["run_dir"], r["acc"]) for r in rows]
    # --finished-only trains nothing: a variant that never ran (siglip_fixed) gets no row, no run
    # folder and no summary line; the finished run is tabled as it is, unchanged on disk
    assert module.main(["--smoke", "--jobs", "1", "--finished-only", "--variants", "mv_dhel", "siglip_fixed"]) == 0
    only = _rows(out / "results.csv")
    assert [(r["run_dir"], r["acc"]) for r in only] == [(r["run_dir"], r["acc"]) for r in rows if r["variant"] == "mv_dhel"]
    assert not (out / "runs" / "M3_siglip_fixed_K8_s0").exists()
    assert [(s["variant"], s["seeds"]) for s in _rows(out / "summary.csv")] == [("mv_dhel", "1")]
    assert {d: (Path(d) / "results.json").stat().st_mtime_ns for d in written} == written
    with pytest.raises(SystemExit) as stop:  # no chosen run has a result: a one-line error, nothing written
        module.main(["--smoke", "--jobs", "1", "--finished-only", "--variants", "siglip_fixed"])
    assert stop.value.code == 2 and not (out / "runs" / "M3_siglip_fixed_K8_s0").exists()


def test_fmicl_similarity_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load("fmicl_similarity")
    # the cosine temperature of VLC must be above the admissible bound 1 of its conjugate
    assert module.cosine_temperature("vlc", 0.2, 1.05) > 1.0
    assert module.cosine_temperature("js", 0.2, 1.05) > 1 / math.log(2)
    assert module.cosine_temperature("kl", 0.2, 1.05) == 0.2
    # --jobs 2: the one sweep of these tests run by the worker processes (one run each)
    out = _smoke_in(tmp_path, monkeypatch, "fmicl_similarity", ["--smoke", "--jobs", "2"], "fmicl_similarity", module)
    rows = _check_common(out, "fmicl_similarity.png", 2)
    sims = {r["similarity"]: r["_config"]["objective"]["params"] for r in rows}
    assert sims["cosine"]["similarity"] == "cosine" and sims["cosine"]["temperature"] > 1.0
    assert sims["gaussian"]["similarity"] == "gaussian" and sims["gaussian"]["divergence"] == "vlc"


def test_view_multiplicity_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load("view_multiplicity")
    natural = ("text", "audio", "image", "flow")
    for M in (4, 5, 6, 8, 9):
        views = module.views_for(M, natural)
        assert sum(v.get("copies", 1) for v in views) == M
        assert [v["modality"] for v in views[:4]] == list(natural) and not any("augment" in v for v in views[:4])
        assert all("augment" in v for v in views[4:])
    # augmented copies go round the modalities: M = 8 adds one of each
    assert sorted(v["modality"] for v in module.views_for(8, natural)[4:]) == sorted(natural)
    assert [v["modality"] for v in module.views_for(3, ("image", "flow"))] == ["image", "flow", "image"]
    with pytest.raises(ValueError, match="M must be >= 4"):
        module.views_for(3, natural)
    # no flips of images or flow: a flip changes the synthetic class (45 <-> 135 degrees)
    for v in module.views_for(8, natural)[4:]:
        if v["modality"] in ("image", "flow"):
            assert v["params"]["flip_p"] == 0.0
    (image_views,) = module.image_views_for(4)
    assert image_views["copies"] == 4 and image_views["augment"] == "simclr" and image_views["params"]["flip_p"] == 0.0
    out = _smoke_in(tmp_path, monkeypatch, "view_multiplicity", ["--smoke", "--modes", "fixed", "fixed_steps", "--jobs", "1"],
                    "view_multiplicity", module)
    rows = _check_common(out, "view_multiplicity.png", 4)
    for r in rows:
        config = r["_config"]
        M = int(r["M"])
        assert sum(v.get("copies", 1) for v in config["views"]) == M
        assert config["data"]["batch_mode"] == "fixed"
    # smoke: 32 samples, K = 8 at M = 2 -> 4 steps; at M = 3, K = 5: 6 steps per epoch, unless
    # fixed_steps holds them at the reference's 4
    steps = {(r["mode"], int(r["M"])): int(r["steps"]) for r in rows}
    assert steps == {("fixed", 2): 4, ("fixed", 3): 6, ("fixed_steps", 2): 4, ("fixed_steps", 3): 4}
    assert _rows(out / "trend.csv")


@pytest.mark.parametrize("views", ["natural", "colour", "augmented"])
def test_ipmc_ablation_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, views: str) -> None:
    out = _smoke_in(tmp_path, monkeypatch, "ipmc_ablation", ["--smoke", "--views", views, "--jobs", "1"],
                    "ipmc_ablation" if views == "natural" else f"ipmc_ablation_{views}")
    rows = _check_common(out, "ipmc_ablation.png", 2)
    params = {r["variant"]: r["_config"]["objective"]["params"] for r in rows}
    assert params["Fp"]["beta"] == 0.0 and "view_filter_k" not in params["Fp"]
    # the paper's attenuated weights and the gamma / pools found best here, written out in the recipe
    assert all(p["phi_dec"] == 6.0 and p["tau_dec"] == 1.0 and p["gamma"] == 4.0 and p["pools"] == "direction"
               for p in params.values())
    assert params["Sap+DA"]["beta"] > 0 and params["Sap+DA"]["view_filter_k"] == 1
    config_views = rows[0]["_config"]["views"]
    if views == "colour":  # the paper's colour views, each with its own CMC crop
        assert [v["augment"] for v in config_views] == ["rgb", "lab_l", "lab_ab"]
        assert all(v["params"]["crop_scale"] == [0.3, 1.0] for v in config_views)
    elif views == "augmented":  # three un-flipped SimCLR copies of the image
        assert len(config_views) == 1 and config_views[0]["copies"] == 3
        assert config_views[0]["augment"] == "simclr" and config_views[0]["params"]["flip_p"] == 0.0
    else:
        assert [v["modality"] for v in config_views] == ["image", "flow"] and not any(v.get("augment") for v in config_views)


@pytest.mark.parametrize("script", ["er_batch_size", "fmicl_similarity", "view_multiplicity", "ipmc_ablation",
                                    "temperature_siglip"])
def test_scripts_have_full_and_smoke_flags(script: str) -> None:
    import subprocess

    help_text = subprocess.run([sys.executable, str(REPRO / f"{script}.py"), "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--full" in help_text and "--smoke" in help_text
