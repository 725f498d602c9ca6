"""The video recipe at smoke size (recipes/ucf101_smoke.yaml) trains one epoch on real clips, and
``mmviews bench data --recipe`` times a video recipe's data path and step, with Farneback in the
workers and with RAFT in the step. Clips written with PyAV, laid out as UCF-101; tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_utils import own_accelerate_state, train_in_process
from video_clips import make_ucf101

from mmviews.cli import main

SMALL = ["--set", "data.options.num_frames=3", "--set", "data.options.size=32", "--set", "data.batch_size=2",
         "--set", "data.num_workers=0", "--set", "data.eval_batch_size=4"]


@pytest.fixture(scope="module")
def ucf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ucf101(tmp_path_factory.mktemp("ucf"), classes=2, train_per_class=3, test_per_class=1, n_frames=6,
                       size=(40, 48))


@pytest.mark.slow
def test_the_smoke_recipe_trains_one_epoch_of_the_ucf101_pipeline(ucf: Path, tmp_path: Path) -> None:
    r = train_in_process("ucf101_smoke", "--set", f"data.root={ucf}", *SMALL, "--set", "evaluation.random_baseline=false",
                         "--output", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["epochs"] == 1 and results["steps"] == 3  # 6 training clips, K = 2
    assert {"test/linear/class/acc", "test/knn/class/top1"} <= set(results["eval"])
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "flow: farneback" in config and "modality: audio" in config  # the ucf101 pipeline's flow and views


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["farneback", "raft"])
def test_bench_data_recipe_times_the_data_path_and_the_step(ucf: Path, tmp_path: Path, capsys, flow: str) -> None:
    extra = ["--set", "data.options.flow=raft", "--set", "data.options.raft_weights=random",
             "--set", "data.options.raft_iterations=2"] if flow == "raft" else []
    out = tmp_path / "b.json"
    with own_accelerate_state():
        assert main(["bench", "data", "--recipe", "ucf101_smoke", "--set", f"data.root={ucf}", *SMALL, *extra,
                     "--loader-workers", "0", "--batches", "2", "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["flow"] == flow and result["K"] == 2 and result["M"] == 5
    for kind in ("decode floor", "data path"):
        assert result[kind]["0"]["samples"] == 4 and result[kind]["0"]["clips_per_s"] > 0  # 2 batches of 2 after the first
    step, floor = result["step"], result["model floor"]
    assert set(step["phase_ms"]) == {"data", "flow", "forward", "objective", "backward", "optimiser"}
    assert floor["phase_ms"]["data"] < step["phase_ms"]["data"] or step["phase_ms"]["data"] < 50
    assert abs(sum(step["phase_share"].values()) - 1) < 0.01
    if flow == "raft":  # RAFT runs in the step: a real share of it
        assert step["phase_ms"]["flow"] > 0.05 * step["step_ms"]
    else:
        assert step["phase_ms"]["flow"] < 0.01 * step["step_ms"]
    assert "decode floor (0 workers)" in printed and "model floor" in printed
