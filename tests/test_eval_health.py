"""Runs that failed to learn say so: collapse, MI bound <= 0, retrieval at chance and a probe
below the random initialisation are flagged in the log, on the command line and in report.md,
one line each with a hint (mmviews.eval.health)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmviews.cli import main
from mmviews.eval.health import LiveHealth, evaluation_warnings, training_warnings

# A tiny run made to collapse: SGD at lr 0.5 with momentum drives every embedding of the
# small CNN to one direction within a few steps (pos_sim and neg_sim both reach 0.97).
COLLAPSE = """name: collapse
seed: 0
data:
  name: synthetic
  options: {num_classes: 4, modalities: [image]}
  split_options: {train: {num_samples: 128}, valid: {num_samples: 32}, test: {num_samples: 64}}
  batch_size: 16
  cache: true
views: [{modality: image, copies: 2, augment: simclr, params: {blur_p: 0.0}}]
encoder: {embed_dim: 16}
adapters:
  image: {type: small_cnn, channels: [8], head: {kind: mlp, hidden_dim: 16}}
objective: {name: geometric_pvc, params: {temperature: 0.2}}
optimisation: {optimizer: sgd, lr: 0.5, momentum: 0.9, epochs: 1}
evaluation:
  tasks: [linear:class, {kind: diagnostics}]
  fuse: mean
  random_baseline: true
output: {log_every: 1, progress_bar: false}
"""


def test_a_collapsing_run_is_flagged_in_the_log_and_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "collapse.yaml"
    recipe.write_text(COLLAPSE)
    assert main(["train", str(recipe), "--output", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    live = [line for line in out.splitlines() if line.startswith("warning: collapse at step")]
    assert len(live) == 1, out  # during training, once
    assert "pos_sim 0." in live[0] and "hint: lower optimisation.lr" in live[0]
    assert "warning: collapse at the end of training" in out
    assert "warning: MI lower bound <= 0" in out
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Warnings: did it learn?" in report and "- collapse at the end of training" in report
    assert "uniformity loss" in report
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert any(w.startswith("collapse") for w in results["warnings"])


def test_a_healthy_log_gives_no_warning() -> None:
    rows = [{"step": s, "pos_sim": 0.3 + 0.05 * s, "neg_sim": 0.1, "mi_lower_bound": 0.2 * s} for s in range(1, 11)]
    assert training_warnings(rows) == []
    live = LiveHealth(total_steps=10)
    assert all(live.check(r) == [] for r in rows)
    assert evaluation_warnings({"test/diag/erank/fused": 20.0, "test/diag/unif": -3.2, "test/linear/class/acc": 0.8},
                               {"test/linear/class/acc": 0.5}) == []


def test_log_checks_collapse_alignment_and_mi_bound() -> None:
    collapsed = [{"step": s, "pos_sim": 0.96, "neg_sim": 0.95, "mi_lower_bound": -0.1} for s in range(1, 9)]
    found = training_warnings(collapsed)
    assert [w.split(" ")[0] for w in found] == ["collapse", "MI"]
    unaligned = [{"step": 1, "pos_sim": 0.11, "neg_sim": 0.1}]
    assert training_warnings(unaligned)[0].startswith("no alignment")
    # the live check waits for 20 % of the steps (an untrained encoder often starts collapsed), then reports once
    live = LiveHealth(total_steps=10)
    assert live.check(collapsed[0]) == []
    assert len(live.check(collapsed[2])) == 2 and live.check(collapsed[3]) == []


def test_evaluation_checks_rank_retrieval_and_probe() -> None:
    trained = {"test/diag/erank/fused": 1.1, "test/diag/unif": -3.0,
               "test/retrieval/text_0->audio_0/MeanR": 250.0, "test/retrieval/text_0->audio_0/n": 512.0,
               "test/retrieval/audio_0->text_0/MeanR": 20.0, "test/retrieval/audio_0->text_0/n": 512.0,
               "test/linear/class/acc": 0.40, "test/regression/sentiment/mae": 0.50, "test/knn/class/top1": 0.7}
    random_init = {"test/linear/class/acc": 0.45, "test/regression/sentiment/mae": 0.40, "test/knn/class/top1": 0.5}
    found = evaluation_warnings(trained, random_init)
    assert any("effective rank is 1.10" in w for w in found)
    chance = [w for w in found if w.startswith("retrieval at chance")]
    assert len(chance) == 1 and "text_0->audio_0" in chance[0] and "chance 256.5" in chance[0]
    below = [w for w in found if w.startswith("probe below random init")]
    assert len(below) == 2 and any("linear/class/acc is 0.4000" in w for w in below) and any("mae" in w for w in below)
