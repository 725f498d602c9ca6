"""Chance levels of every probe, zero-shot class prototypes across views, metric digits, the
comparison of seeds, and alignment judged on held-out data."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_eval_report import collate, encoder, loader

from mmviews.eval import evaluate_encoder, health
from mmviews.eval.health import chance_level, regression_chance
from mmviews.eval.probes import class_prototype_accuracy
from mmviews.eval.report import format_metric


def test_classification_chance_is_the_training_majority_class_scored_on_the_evaluated_labels():
    # unbalanced: class 2 is the training majority (5 of 9); 2 of the 8 evaluated labels are 2
    # (the evaluated labels' own majority, class 0, would give 4 / 8)
    train = torch.tensor([0, 2, 2, 1, 2, 2, 0, 2, 1])
    evaluated = torch.tensor([2, 0, 0, 1, 2, 1, 0, 0])
    assert health.classification_chance(train, evaluated) == 2 / 8
    # balanced 4 classes: 1 / 4 (a tie goes to the smallest class, 0: 2 of the 8 evaluated)
    assert health.classification_chance(torch.arange(8) % 4, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])) == 0.25


def test_regression_chance_predicts_the_training_mean():
    train, evaluated = torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([0.0, 4.0, 5.0])  # training mean 3
    chance = regression_chance(train, evaluated)
    assert chance["mae"] == pytest.approx((3 + 1 + 2) / 3)
    assert chance["mse"] == pytest.approx((9 + 1 + 4) / 3)
    variance = np.var([0.0, 4.0, 5.0])
    assert chance["r2"] == pytest.approx(1 - (14 / 3) / variance)


def test_every_probe_reports_its_chance_in_metrics_summary_and_headline(tmp_path: Path):
    from mmviews.eval.summary import headline_lines, headline_metrics

    metrics = evaluate_encoder(
        encoder, loader(150, 0), loader(60, 1), loader(90, 2),
        [{"kind": "linear", "weight_decays": [1e-2]}, {"kind": "knn", "k": 20}, "regression",
         {"kind": "prototype", "pairs": [["text_0", "audio_0"], ["text_0", "audio_1"]]},
         {"kind": "retrieval", "pairs": [["text_0", "audio_0"], ["text_0", "audio_1"]]}],
        out_dir=tmp_path / "eval",
    )
    train_y = torch.arange(150) % 3  # Clusters: class i % 3; test: 90 samples, 30 per class
    assert metrics["chance/test/linear/class/acc"] == pytest.approx(float(((torch.arange(90) % 3) == 0).double().mean()))
    assert metrics["chance/test/knn/class/top1"] == metrics["chance/test/linear/class/acc"] == pytest.approx(1 / 3)
    # the probe's validation accuracy (60 samples, 20 per class) has its own
    assert metrics["chance/val/linear/class/acc"] == pytest.approx(1 / 3)
    assert train_y.bincount().tolist() == [50, 50, 50]
    for leaf in ("mae", "mse", "r2"):
        assert chance_level(f"test/regression/sentiment/{leaf}", metrics) == metrics[f"chance/test/regression/sentiment/{leaf}"]
    assert -0.05 < metrics["chance/test/regression/sentiment/r2"] <= 0.0
    summary = (tmp_path / "eval" / "summary.md").read_text()
    assert "| test/linear/class/acc | " in summary and "| 0.3333 |" in summary
    assert "| chance/" not in summary  # a chance level is a column, not a metric row
    headline = headline_metrics(metrics, None)
    assert all(h["chance"] is not None for h in headline), headline
    names = [h["metric"] for h in headline]
    # several pairs: the headline gives the mean over pairs, not each pair
    assert "test/retrieval/mean/R@1" in names and "test/prototype/class/mean/acc" in names
    assert not any("->" in n for n in names)
    assert headline_lines(headline)[0] == "test metrics:"


def test_class_prototypes_classify_across_views_against_an_independent_reference():
    g = torch.Generator().manual_seed(0)
    classes = torch.arange(120) % 4
    centres = torch.randn(4, 16, generator=g)
    text = centres[classes] + 0.8 * torch.randn(120, 16, generator=g)
    audio = centres[classes] + 0.8 * torch.randn(120, 16, generator=g)
    accuracy = class_prototype_accuracy(text[:80], classes[:80], audio[80:], classes[80:])

    def reference(train_x, train_y, test_x, test_y) -> float:
        unit = train_x.numpy() / np.linalg.norm(train_x.numpy(), axis=1, keepdims=True)
        protos = {c: unit[train_y.numpy() == c].mean(0) for c in sorted(set(train_y.tolist()))}
        right = 0
        for x, y in zip(test_x.numpy(), test_y.tolist()):
            scores = {c: float(x @ p / (np.linalg.norm(x) * np.linalg.norm(p))) for c, p in protos.items()}
            right += max(scores, key=scores.get) == y
        return right / len(test_y)

    assert accuracy == pytest.approx(reference(text[:80], classes[:80], audio[80:], classes[80:]))
    assert accuracy > 0.9  # the views share one space
    rotated = audio @ torch.linalg.qr(torch.randn(16, 16, generator=g))[0]  # the same content, another space
    assert class_prototype_accuracy(text[:80], classes[:80], rotated[80:], classes[80:]) < 0.6


def test_prototype_task_names_query_and_prototype_views(tmp_path: Path):
    from mmviews.eval.summary import headline_metrics

    metrics = evaluate_encoder(encoder, loader(90, 0), None, loader(60, 1), ["prototype", "retrieval"])
    # Clusters: every view is its class centre plus noise, so prototypes of one view classify the other
    assert metrics["test/prototype/class/text_0->audio_0/acc"] > 0.9
    assert metrics["test/prototype/class/audio_0->text_0/acc"] > 0.9
    # one pair (the first view of each of the two modalities): each direction in the headline, no mean
    assert "test/prototype/class/mean/acc" not in metrics and "test/retrieval/mean/R@1" not in metrics
    assert {h["metric"] for h in headline_metrics(metrics, None)} == {
        "test/prototype/class/text_0->audio_0/acc", "test/prototype/class/audio_0->text_0/acc",
        "test/retrieval/text_0->audio_0/R@1", "test/retrieval/audio_0->text_0/R@1"}


@pytest.mark.parametrize("value, printed", [
    (0.25, "0.2500"), (0.00021, "0.000210"), (0.0036, "0.00360"), (0.0, "0.0000"), (1e-05, "1e-05"),
    (123456.0, "1.235e+05"), (-0.0021, "-0.00210"), (None, "n/a"), (math.nan, "n/a"),
])
def test_metrics_print_with_the_digits_their_size_needs(value, printed):
    assert format_metric(value) == printed


def make_seed_run(root: Path, name: str, seed: int, lr: float, acc: float, warnings: list[str] | None = None) -> Path:
    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "metrics.json").write_text(json.dumps({
        "metrics": {"test/linear/class/acc": acc, "linear/class/weight_decay": 1e-3,
                    "chance/test/linear/class/acc": 0.25},
        "meta": {"objective": "mv_dhel", "num_views": 2}}))
    (run / "config.yaml").write_text(yaml.safe_dump({
        "name": "toy", "seed": seed, "optimisation": {"lr": lr}, "output": {"dir": name}}))
    (run / "results.json").write_text(json.dumps({"steps": 4, "final_loss": 1.0, "wall_time_s": 2.0,
                                                  "warnings": warnings or []}))
    return run


def test_compare_gives_mean_and_std_over_seeds_and_says_what_is_within_noise(tmp_path: Path):
    from mmviews.eval.compare import compare_runs

    low = [0.70, 0.74, 0.72]
    high = [0.73, 0.77, 0.72]  # within noise of low
    far = [0.95, 0.96]  # not
    runs = ([make_seed_run(tmp_path, f"a{s}", s, 1e-3, v) for s, v in enumerate(low)]
            + [make_seed_run(tmp_path, f"b{s}", s, 1e-2, v) for s, v in enumerate(high)]
            + [make_seed_run(tmp_path, f"c{s}", s, 1e-1, v, ["collapse: the test embeddings' effective rank is 1.10"])
               for s, v in enumerate(far)])
    compare_runs(runs, tmp_path / "cmp")
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "weight_decay" not in table and "| chance/" not in table  # a probe's setting and a chance level: no metric rows
    assert "| seeds | 3 | 3 | 2 |" in table
    row = next(line for line in table.splitlines() if line.startswith("| test/linear/class/acc |") and "±" in line)
    for values in (low, high, far):
        assert f"{statistics.mean(values):.4f} ± {format_metric(statistics.stdev(values))} (n={len(values)})" in row
    band = 2 * math.sqrt(statistics.variance(low) / 3 + statistics.variance(high) / 3)
    assert abs(statistics.mean(low) - statistics.mean(high)) <= band
    notes = [line for line in table.splitlines() if line.startswith("- test/linear/class/acc:")]
    assert len(notes) == 1 and "toy - toy#1" in notes[0] and "within noise" in notes[0], notes
    # the collapsed runs' warnings are in the comparison, before the numbers
    assert table.count("collapse: the test embeddings' effective rank is 1.10") == 2
    assert table.index("collapse") < table.index("| test/linear/class/acc |")
    assert "| test/linear/class/acc | 0.7000 | 0.7400 | 0.7200 | 0.7300 | 0.7700 | 0.7200 | 0.9500 | 0.9600 | 0.2500 |" \
        in table  # chance in its own column


def test_held_out_data_judges_alignment_not_the_training_batches() -> None:
    aligned_log = [{"loss": 20.0, "pos_sim": 0.15, "neg_sim": 0.0}] * 8
    unaligned_log = [{"loss": 20.0, "pos_sim": 0.01, "neg_sim": 0.0}] * 8
    held_out_aligned = {"test/diag/sim_pos_mean": 0.20, "test/diag/sim_neg_mean": 0.01}
    held_out_not = {"test/diag/sim_pos_mean": 0.05, "test/diag/sim_neg_mean": 0.04}
    # memorised: aligned on the training batches, not on the test split
    found = health.run_warnings(aligned_log, held_out_not, None)
    assert len(found) == 1 and found[0].startswith("no alignment on the held-out test split"), found
    # the training batches' gap does not count when the test split shows alignment
    assert health.run_warnings(unaligned_log, held_out_aligned, None) == []
    # without a held-out measure, the log's check stands and says where it looked
    found = health.run_warnings(unaligned_log, {"test/linear/class/acc": 0.5}, None)
    assert len(found) == 1 and "on the training batches" in found[0]
    # the held-out gap's threshold, just inside and just outside
    from mmviews.eval.health import ALIGNMENT_GAP

    def flagged(gap: float) -> bool:
        return bool(health.run_warnings([], {"test/diag/sim_pos_mean": 0.3 + gap, "test/diag/sim_neg_mean": 0.3}, None))

    assert flagged(ALIGNMENT_GAP - 1e-6) and not flagged(ALIGNMENT_GAP + 1e-6)


@pytest.mark.parametrize("name, guard", [
    ("chance_from_evaluated_majority",
     test_classification_chance_is_the_training_majority_class_scored_on_the_evaluated_labels),
    ("training_log_judges_alignment", test_held_out_data_judges_alignment_not_the_training_batches),
])
def test_chance_and_alignment_guards_fail_when_broken(monkeypatch, name: str, guard) -> None:
    """Mutation tests: each break makes its guard fail."""
    from mutations import apply_break

    apply_break(name, monkeypatch.setattr)
    with pytest.raises(AssertionError):
        guard()


def test_seed_comparison_guard_fails_with_the_population_std(monkeypatch, tmp_path: Path) -> None:
    from mutations import apply_break

    apply_break("population_std_over_seeds", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_compare_gives_mean_and_std_over_seeds_and_says_what_is_within_noise(tmp_path)


# --- chance levels on splits with different class mixes and target means ----------------------
#
# Every figure below is counted by hand from the labels written here (not read from the code):
# the training majority is class 2 (12 of 24); the validation split holds 3 of 12 of it, the test
# split 6 of 16; the training targets average 1.0, the test targets -0.5. A break that scores a
# chance on another split, or takes another split's majority or mean, gives another number.

from mixed_splits import TEST_CLASSES, TEST_TARGETS, TRAIN_TARGETS, mixed_loader  # noqa: E402


def _by_hand_classification(labels: list[int], majority: int = 2) -> float:
    return sum(1 for y in labels if y == majority) / len(labels)


def evaluate_mixed(out: Path, tasks: list | None = None) -> tuple[dict, Path]:
    metrics = evaluate_encoder(
        encoder, mixed_loader("train"), mixed_loader("valid"), mixed_loader("test"),
        tasks or [{"kind": "linear", "weight_decays": [1e-2]}, {"kind": "knn", "k": 5}, "regression",
                  {"kind": "prototype", "pairs": [["text_0", "audio_0"], ["text_0", "audio_1"]]},
                  {"kind": "retrieval", "pairs": [["text_0", "audio_0"], ["text_0", "audio_1"]]}],
        out_dir=out, progress=False, plots=False)
    return metrics, out


@pytest.fixture(scope="module")
def mixed_metrics(tmp_path_factory) -> tuple[dict, Path]:
    return evaluate_mixed(tmp_path_factory.mktemp("mixed"))


def test_classifier_chance_is_the_training_majority_scored_on_each_evaluated_split(mixed_metrics):
    metrics, _ = mixed_metrics
    from mixed_splits import SPLITS

    assert _by_hand_classification(SPLITS["train"][0]) == 0.5  # the fixture: class 2 leads the training split
    assert metrics["chance/test/linear/class/acc"] == pytest.approx(6 / 16)
    assert metrics["chance/val/linear/class/acc"] == pytest.approx(3 / 12)
    assert metrics["chance/test/knn/class/top1"] == pytest.approx(6 / 16)
    assert _by_hand_classification(TEST_CLASSES) == pytest.approx(6 / 16)


def test_regression_chance_predicts_the_training_mean_on_the_evaluated_split(mixed_metrics):
    metrics, _ = mixed_metrics
    mean = statistics.fmean(TRAIN_TARGETS)
    assert mean == pytest.approx(1.0) and statistics.fmean(TEST_TARGETS) == pytest.approx(-0.5)
    mae = statistics.fmean(abs(t - mean) for t in TEST_TARGETS)
    mse = statistics.fmean((t - mean) ** 2 for t in TEST_TARGETS)
    variance = statistics.pvariance(TEST_TARGETS)
    assert metrics["chance/test/regression/sentiment/mae"] == pytest.approx(mae)
    assert metrics["chance/test/regression/sentiment/mse"] == pytest.approx(mse)
    assert metrics["chance/test/regression/sentiment/r2"] == pytest.approx(1 - mse / variance)


def test_prototype_chance_counts_only_the_queries_that_have_the_view(mixed_metrics):
    """audio_1 is absent for every fourth sample (the collator's dataset index % 4 == 0), which
    holds 4 of the test split's 6 class-2 samples: its queries hold 2 of 12."""
    metrics, _ = mixed_metrics
    present = [y for i, y in enumerate(TEST_CLASSES) if i % 4 != 0]
    assert len(present) == 12 and _by_hand_classification(present) == pytest.approx(2 / 12)
    assert metrics["chance/test/prototype/class/audio_1->text_0/acc"] == pytest.approx(2 / 12)
    assert metrics["chance/test/prototype/class/text_0->audio_1/acc"] == pytest.approx(6 / 16)
    assert metrics["chance/test/prototype/class/audio_0->text_0/acc"] == pytest.approx(6 / 16)
    assert metrics["chance/test/prototype/class/mean/acc"] == pytest.approx(6 / 16)
    # retrieval: R@1's chance 1 / n per direction, n the pairs present: 16 and 12
    assert metrics["chance/test/retrieval/mean/R@1"] == pytest.approx((2 / 16 + 2 / 12) / 4)
    assert metrics["test/retrieval/text_0->audio_1/n"] == 12 and metrics["test/retrieval/text_0->audio_0/n"] == 16


def test_the_reports_chance_column_holds_the_chance_not_the_metric(mixed_metrics):
    metrics, out = mixed_metrics
    rows = {}
    for line in (out / "summary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and "/" in cells[0]:
            rows[cells[0]] = cells[1:]
    assert rows["test/linear/class/acc"] == [format_metric(metrics["test/linear/class/acc"]), "0.3750"]
    assert rows["val/linear/class/acc"][1] == "0.2500"
    assert rows["test/prototype/class/audio_1->text_0/acc"][1] == "0.1667"
    assert rows["test/retrieval/text_0->audio_1/R@1"][1] == format_metric(1 / 12)
    assert rows["test/retrieval/text_0->audio_1/MeanR"][1] == format_metric(13 / 2)
    assert rows["test/linear/class/acc"][0] != rows["test/linear/class/acc"][1]
    assert not any(name.startswith("chance/") for name in rows)


def test_regression_chance_guard_fails_when_the_evaluated_mean_is_predicted(monkeypatch, tmp_path: Path) -> None:
    from mutations import apply_break

    apply_break("regression_chance_from_evaluated_mean", monkeypatch.setattr)
    broken = evaluate_mixed(tmp_path, ["regression"])
    with pytest.raises(AssertionError):
        test_regression_chance_predicts_the_training_mean_on_the_evaluated_split(broken)
