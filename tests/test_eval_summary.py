"""The run's summary (:mod:`mmviews.eval.summary`), on tiny inputs: reading ``metrics.csv`` and the
evaluation's ``metrics.json``, the headline (the probes and the mean retrieval of the test split,
beside random init and chance), the data-left-out and data-report lines, and ``results.json`` and
``report.md`` of a run with and without evaluation, failed or warned, with or without a baseline
(non-finite values become null and fail the run naming their keys)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_step_log import write_log

import mmviews.eval.summary as summary_module
from mmviews.eval.health import HealthSettings
from mmviews.eval.summary import (
    data_left_out_lines,
    data_report_lines,
    finalise_summary,
    headline_lines,
    headline_metrics,
    read_eval_metrics,
    read_training_log,
    write_results,
)


def test_read_training_log_reads_rows_and_gives_nothing_for_a_missing_or_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    assert read_training_log(path) == []
    write_log(path, [(1, 0.5, 2.0)])
    assert read_training_log(path) == [{"step": "1", "epoch": "0.5", "loss": "2.0"}]
    path.write_bytes(b'step,loss,note\r\n1,2.0,"two\r\nlines"\r\n')  # read as the csv module asks (newline="")
    assert read_training_log(path) == [{"step": "1", "loss": "2.0", "note": "two\r\nlines"}]
    path.write_bytes(b"step,loss\n1,\xff\xfe\n")
    assert read_training_log(path) == []
    path.unlink()
    path.mkdir()
    assert read_training_log(path) == []


def test_read_eval_metrics(tmp_path: Path) -> None:
    assert read_eval_metrics(tmp_path) is None
    (tmp_path / "metrics.json").write_text(json.dumps({"metrics": {"test/x": 0.5}, "meta": {}}))
    assert read_eval_metrics(tmp_path) == {"test/x": 0.5}


def test_a_non_finite_value_becomes_null_and_fails_the_run_naming_its_keys() -> None:
    summary = {"final_loss": math.nan, "eval": {"test/a": math.inf, "test/b": 1.0}, "curve": [1.0, -math.inf],
               "pairs": ({"x": math.nan},), "name": "r"}
    clean = finalise_summary(summary)
    assert clean["final_loss"] is None and clean["eval"] == {"test/a": None, "test/b": 1.0}
    assert clean["curve"] == [1.0, None] and clean["pairs"] == [{"x": None}]
    assert clean["status"] == "failed"
    assert clean["reason"] == "non-finite values (written as null): final_loss, eval.test/a, curve.1, pairs.0.x"
    assert summary["final_loss"] is not None  # the caller's dict is left as it was
    assert finalise_summary({"loss": 1.0}) == {"loss": 1.0, "status": "ok"}
    assert finalise_summary({"loss": 1.0, "status": "stopped"})["status"] == "stopped"


def test_headline_takes_the_probes_and_the_mean_retrieval_of_the_test_split() -> None:
    trained = {"test/linear/class/acc": 0.8, "test/knn/class/acc": 0.7, "test/retrieval/a->b/R@1": 0.4,
               "test/retrieval/mean/R@1": 0.5, "test/retrieval/mean/R@5": 0.9, "test/retrieval/mean/n": 10,
               "test/diag/align": 0.3, "val/linear/class/acc": 0.6, "test/regression/y/mae": 0.1,
               "test/msa/acc2": 0.65, "test/prototype/class/acc": 0.55, "chance/test/linear/class/acc": 0.25}
    rows = headline_metrics(trained, {"test/linear/class/acc": 0.3})
    assert [r["metric"] for r in rows] == ["test/knn/class/acc", "test/linear/class/acc", "test/msa/acc2",
                                           "test/prototype/class/acc", "test/regression/y/mae",
                                           "test/retrieval/mean/R@1"]
    assert rows[1] == {"metric": "test/linear/class/acc", "trained": 0.8, "random_init": 0.3, "chance": 0.25}
    assert rows[-1] == {"metric": "test/retrieval/mean/R@1", "trained": 0.5, "random_init": None, "chance": 0.1}
    # without a test split: val; a pair's R@1 heads when no mean is beside it
    val = headline_metrics({"val/retrieval/a->b/R@1": 0.4, "val/retrieval/a->b/R@5": 0.8}, None)
    assert [r["metric"] for r in val] == ["val/retrieval/a->b/R@1"]


def test_headline_takes_the_identifiability_of_the_content_and_specific_blocks() -> None:
    trained = {"test/identifiability/x1/content/r2_nonlinear": 0.9, "test/identifiability/x2/specific/r2_linear": 0.1,
               "test/identifiability/x1/style/r2_nonlinear": 0.5,  # another block: not a headline
               "test/diag/content/align": 0.3, "test/diag/specific/unif": 0.2}  # not identifiability
    assert [r["metric"] for r in headline_metrics(trained, None)] == [
        "test/identifiability/x1/content/r2_nonlinear", "test/identifiability/x2/specific/r2_linear"]


def test_headline_falls_back_to_the_diagnostics() -> None:
    trained = {"test/diag/align": 0.3, "test/diag/unif": -2.0, "test/diag/erank/fused": 5.0, "test/diag/erank/a": 2.0,
               "test/diag/sim_pos_mean": 0.5, "val/diag/align": 0.1}
    assert [r["metric"] for r in headline_metrics(trained, None)] == [
        "test/diag/align", "test/diag/erank/fused", "test/diag/unif"]
    assert headline_metrics(None, None) == []


def test_headline_lines_align_the_metrics_beside_random_init_and_chance() -> None:
    headline = [{"metric": "test/linear/class/acc", "trained": 0.8, "random_init": 0.5, "chance": 0.25},
                {"metric": "test/knn/class/acc", "trained": 0.75, "random_init": None, "chance": None},
                {"metric": "test/msa/acc2", "trained": math.nan, "random_init": 0.5, "chance": 1}]
    assert headline_lines(headline) == [
        "test metrics, trained vs random init:",
        "  test/linear/class/acc  trained 0.8000  random init 0.5000  (+0.3000)  chance 0.2500",
        "  test/knn/class/acc     trained 0.7500",
        "  test/msa/acc2          trained n/a  random init 0.5000  chance 1.0000"]
    assert headline_lines([{"metric": "val/x", "trained": 1, "random_init": None, "chance": None}]) == [
        "val metrics:", "  val/x  trained 1.0000"]
    assert headline_lines([]) == []


def test_data_left_out_lines_name_shards_row_groups_values_and_the_rest() -> None:
    skipped = {"train": {"shards": ["a.parquet", "b.parquet"], "row_groups": ["c.parquet#2", "e.parquet#0"],
                         "rows_in_skipped_row_groups": 7, "values_marked_absent": 3, "late": 2, "none": 0},
               "test": {"row_groups": ["d.parquet#0"]}, "val": {}}
    assert data_left_out_lines(skipped) == [
        "split 'train': 2 unreadable shard(s) (a.parquet, b.parquet); 2 damaged row group(s), 7 rows "
        "(c.parquet#2, e.parquet#0); 3 value(s) that could not be decoded, marked absent; late: 2",
        "split 'test': 1 damaged row group(s), 0 rows (d.parquet#0)",
        "split 'val': "]


def test_data_report_lines_list_losses_skips_absent_modalities_and_examples() -> None:
    assert data_report_lines({}) == []
    summary = {"data_losses": {"train": {"split": "train", "excluded": 2, "excluded_list": "bad.txt",
                                         "examples": ["s1: unreadable", "s2: unreadable"]}},
               "data_skipped": {"val": {"shards": ["x.parquet"]}},
               "absent_modalities": {"audio": "no training sample has modality 'audio'"}}
    assert data_report_lines(summary) == [
        "## Data left out", "",
        "- split 'train' (train): 2 left out before training (known unreadable, listed in bad.txt)",
        "- split 'val': 1 unreadable shard(s) (x.parquet)",
        "- no training sample has modality 'audio'", "",
        "Examples:", "", "- `s1: unreadable`", "- `s2: unreadable`", ""]
    no_examples = data_report_lines({"data_skipped": {"val": {"shards": ["x.parquet"]}}})
    assert no_examples == ["## Data left out", "", "- split 'val': 1 unreadable shard(s) (x.parquet)", ""]


def summary_of(**changes: Any) -> dict[str, Any]:
    summary = {"name": "tiny", "objective": "mv_dhel", "steps": 4, "epochs": 2, "samples_seen": 64,
               "final_loss": 1.23456, "wall_time_s": 12.345, "num_processes": 2, "device": "cpu",
               "eval": None, "eval_random": None}
    summary.update(changes)
    return summary


def test_results_and_report_of_a_run_without_evaluation(tmp_path: Path) -> None:
    summary = summary_of(device=torch.device("cpu"), encoder=tmp_path / "run" / "encoder")
    write_results(tmp_path, summary)
    assert summary["warnings"] == []  # added to the caller's dict
    text = (tmp_path / "results.json").read_text()
    results = json.loads(text)
    assert results["status"] == "ok" and results["steps"] == 4 and results["warnings"] == []
    # values JSON has no type for are written as their text; indented for a person to read
    assert results["device"] == "cpu" and results["encoder"] == str(tmp_path / "run" / "encoder")
    assert text == json.dumps(results, indent=2)
    assert (tmp_path / "report.md").read_text() == "\n".join([
        "# Run report: tiny", "", "- objective: mv_dhel", "- optimiser steps: 4 (2 epochs, 64 samples)",
        "- final training loss: 1.2346", "- wall time: 12.3 s on 2 process(es), cpu", ""])


def test_the_reports_steps_line_gives_the_global_batch_and_its_micro_batches(tmp_path: Path) -> None:
    write_results(tmp_path, summary_of(global_batch_size=32))
    # a results summary without grad_accum_steps (written before it existed): one micro-batch
    assert (tmp_path / "report.md").read_text().split("\n")[3] == (
        "- optimiser steps: 4 (2 epochs, 64 samples; global batch 32 x 1 micro-batch(es))")
    write_results(tmp_path, summary_of(global_batch_size=16, grad_accum_steps=4, epochs_trained=1.5))
    assert (tmp_path / "report.md").read_text().split("\n")[3] == (
        "- optimiser steps: 4 (1.5 epochs, 64 samples; global batch 16 x 4 micro-batch(es))")


def test_results_and_report_of_a_failed_run_with_warnings_and_evaluation(tmp_path: Path) -> None:
    trained = {"test/linear/class/acc": 0.8, "test/regression/y/mae": 0.25, "test/diag/erank/fused": 1.01,
               "test/linear/weight_decay": 0.1, "test/retrieval/mean/n": 10, "test/retrieval/mean/R@1": 0.3,
               "chance/test/linear/class/acc": 0.5, "train/linear/class/acc": 1.0, "val/loss": None}
    random_init = {"test/linear/class/acc": 0.6, "test/regression/y/mae": 0.5}
    summary = summary_of(final_loss=math.nan, eval=trained, eval_random=random_init)
    write_results(tmp_path, summary, HealthSettings(lr=0.5, objective="mv_dhel", temperature=0.07))
    (collapse,) = summary["warnings"]
    assert collapse.startswith("collapse: the test embeddings' effective rank is 1.01")
    assert "optimisation.lr (now 0.5)" in collapse and "temperature, now 0.07" in collapse  # the run's settings
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["final_loss"] is None and results["status"] == "failed" and results["warnings"] == [collapse]
    report = (tmp_path / "report.md").read_text().split("\n")
    assert report == [
        "# Run report: tiny", "", "- objective: mv_dhel", "- optimiser steps: 4 (2 epochs, 64 samples)",
        "- final training loss: n/a", "- wall time: 12.3 s on 2 process(es), cpu",
        "- status: **failed**: non-finite values (written as null): final_loss", "",
        "## Warnings: did it learn?", "", f"- {collapse}", "",
        "| metric | trained | random init | trained - random | chance |", "|---|---|---|---|---|",
        "| test/diag/erank/fused | 1.0100 |  |  |  |",
        "| test/linear/class/acc | 0.8000 | 0.6000 | +0.2000 | 0.5000 |",
        "| test/regression/y/mae | 0.2500 | 0.5000 | -0.2500 (lower is better) |  |",
        "| test/retrieval/mean/R@1 | 0.3000 |  |  | 0.1000 |",
        "| val/loss | n/a |  |  |  |",
        "", "Full evaluation report: [eval/summary.md](eval/summary.md); random-initialisation baseline: "
            "[eval_random/summary.md](eval_random/summary.md)", ""]


def test_the_report_says_whether_the_run_shows_the_identifiability_finding(tmp_path: Path) -> None:
    """The finding's lines come from the trained metrics, beside the random initialisation's."""
    trained = {"test/identifiability/x1/content/r2_nonlinear": 0.9, "test/identifiability/x1/specific/r2_nonlinear": 0.1}
    random_init = {"test/identifiability/x1/content/r2_nonlinear": 0.3,
                   "test/identifiability/x1/specific/r2_nonlinear": 0.25}
    write_results(tmp_path, summary_of(eval=trained, eval_random=random_init))
    report = (tmp_path / "report.md").read_text()
    assert "## Identifiability" in report
    assert ("This run shows it. Nonlinear (kernel ridge) R^2, mean over modalities: content 0.900, +0.600 over the "
            "encoder as initialised (0.300); specific 0.250 at random init -> 0.100 trained (-0.150).") in report


def test_a_probe_below_its_random_init_is_warned_about(tmp_path: Path) -> None:
    summary = summary_of(eval={"test/linear/class/acc": 0.3}, eval_random={"test/linear/class/acc": 0.6})
    write_results(tmp_path, summary)
    (warning,) = summary["warnings"]
    assert warning.startswith("probe below random init: test/linear/class/acc is 0.3000 trained, 0.6000 for the "
                              "encoder as initialised")


def test_the_report_without_a_baseline_links_the_evaluation_only(tmp_path: Path) -> None:
    write_log(tmp_path / "metrics.csv", [(1, 0.25, 4.0)])
    write_results(tmp_path, summary_of(eval={"val/knn/class/acc": 0.5, "val/loss_mse": 2.0}))
    report = (tmp_path / "report.md").read_text().split("\n")
    assert report[-5:] == ["| val/knn/class/acc | 0.5000 |  |  |  |", "| val/loss_mse | 2.0000 |  |  |  |", "",
                           "Full evaluation report: [eval/summary.md](eval/summary.md)", ""]


@pytest.mark.parametrize("metric, lower", [("test/regression/y/mae", True), ("test/regression/y/MSE", True),
                                           ("test/regression/y/rmse", True), ("val/loss", True),
                                           ("test/msa/mae_7", True), ("test/linear/class/acc", False),
                                           ("test/regression/y/r2", False), ("test/mae/acc", False)])
def test_the_report_marks_the_metrics_where_lower_is_better(tmp_path: Path, metric: str, lower: bool) -> None:
    write_results(tmp_path, summary_of(eval={metric: 0.5}, eval_random={metric: 0.25}))
    (row,) = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith(f"| {metric} |")]
    assert row.split(" | ")[3] == "+0.2500" + (" (lower is better)" if lower else "")


@pytest.mark.parametrize("name, lower", [("loss", True), ("mae", True), ("RMSE", True), ("acc", False),
                                         ("regression/y/mae", True), ("linear/class/acc", False)])
def test_lower_is_better_judges_the_last_part_of_any_name(name: str, lower: bool) -> None:
    """The model card passes names without their split (``linear/class/acc``), some of one part."""
    assert summary_module._lower_is_better(name) is lower
