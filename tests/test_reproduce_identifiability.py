"""recipes/reproduce/identifiability.py at --smoke size: the paper's table (part a) and the M sweep
(part b) train through the public trainer, the tables hold the numbers of the runs they name, the
runs hold the swept settings (M modalities, the objective, K * M fixed at equal steps), and the
plot is written."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

REPRO = Path(__file__).resolve().parents[1] / "recipes" / "reproduce"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_identifiability_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("reproduce_identifiability", REPRO / "identifiability.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "identifiability"
    assert module.main(["--smoke", "--jobs", "1", "--out", str(out)]) == 0

    table = _rows(out / "paper_table.csv")
    assert [(r["setting"], r["block"]) for r in table] == [("both", "content"), ("both", "style"), ("both", "specific")]
    run_a, random_run = _rows(out / "results_a.csv")
    assert (run_a["encoder"], random_run["encoder"]) == ("trained", "random init")
    results = json.loads((Path(run_a["run_dir"]) / "results.json").read_text())
    for row in table:
        for short, leaf in (("lin", "r2_linear"), ("nl", "r2_nonlinear")):
            assert float(row[f"r2_{short}"]) == pytest.approx(
                results["eval"][f"test/identifiability/x1/{row['block']}/{leaf}"], abs=5.1e-5)
    # beside each trained value, the encoder as initialised, of the same setting and seed
    assert Path(random_run["run_dir"]).name == "random_init_both_s0"
    random_a = json.loads((Path(random_run["run_dir"]) / "results.json").read_text())["eval_random"]
    for row in table:
        assert float(row["random_init_nl"]) == pytest.approx(
            random_a[f"test/identifiability/x1/{row['block']}/r2_nonlinear"], abs=5.1e-5)
        # one seed: its std is unknown (nan; printed "-"), not 0
        assert row["random_init_nl_std"] == "nan" and row["steps"] == "3" and row["K"] == "128"
    config_random = yaml.safe_load((Path(random_run["run_dir"]) / "config.yaml").read_text())
    assert config_random["data"]["options"]["seed"] == 0 and config_random["evaluation"]["random_baseline"]
    config_a = yaml.safe_load((Path(run_a["run_dir"]) / "config.yaml").read_text())
    assert config_a["objective"]["name"] == "simclr" and config_a["data"]["options"]["style_change_prob"] == 0.75

    runs = _rows(out / "results_b.csv")
    assert {(r["objective"], int(r["M"])) for r in runs} == {(o, M) for o in ("multi_crop", "mv_dhel") for M in (2, 3)}
    steps = set()
    for r in runs:
        assert r["status"] == "ok", r
        summary = json.loads((Path(r["run_dir"]) / "results.json").read_text())
        config = yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text())
        M = int(r["M"])
        assert [v["modality"] for v in config["views"]] == [f"x{i + 1}" for i in range(M)]
        assert config["data"]["options"]["num_modalities"] == M and config["objective"]["name"] == r["objective"]
        # equal compute: K * M at 2 K0 and the same optimiser steps
        assert config["data"]["batch_mode"] == "fixed" and config["data"]["reference_views"] == 2
        steps.add(summary["steps"])
        content = [v for k, v in summary["eval"].items() if k.endswith("/content/r2_nonlinear")]
        assert len(content) == M
        assert float(r["content_nl"]) == pytest.approx(sum(content) / M, abs=5.1e-5)
    assert steps == {3}
    summary = _rows(out / "summary.csv")
    assert {r["objective"] for r in summary} == {"multi_crop", "mv_dhel", "random-init encoder"}
    png = out / "identifiability.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
