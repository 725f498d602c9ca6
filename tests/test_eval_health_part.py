"""Runs that failed to learn say so: collapse, MI bound <= 0, retrieval at chance and a probe
below the random initialisation are flagged in the log, on the command line and in report.md,
one line each with a hint (mmviews.eval.health)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmviews.cli import main
from mmviews.eval.health import HealthSettings, LiveHealth, chance_level, evaluation_warnings, training_warnings

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


def test_a_collapsing_run_is_flagged_in_the_log_and_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import logging

    recipe = tmp_path / "collapse.yaml"
    recipe.write_text(COLLAPSE)
    # what train() logs for Python callers (the command silences this logger and prints instead)
    results_logger = logging.getLogger("mmviews.train.results")
    caplog.set_level(logging.INFO, logger="mmviews.train.results")
    results_logger.addHandler(caplog.handler)
    try:
        assert main(["train", str(recipe), "--output", str(tmp_path / "run")]) == 0
    finally:
        results_logger.removeHandler(caplog.handler)
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "results.json").read_text())  # train()'s return value, as written
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert summary["warnings"] and logged == [f"warning: {w}" for w in summary["warnings"]]
    assert [h["metric"] for h in summary["headline"]] == ["test/linear/class/acc"]
    assert any("trained vs random init" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "test metrics, trained vs random init:" in out and "  test/linear/class/acc  trained " in out
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


def rows_with(n: int = 8, **values: float) -> list[dict[str, float]]:
    """``n`` log rows with constant values (a healthy loss, falling, unless given)."""
    return [{"step": s, "loss": values.get("loss", 10.0 - 0.1 * s),
             **{k: v for k, v in values.items() if k != "loss"}} for s in range(1, n + 1)]


def kinds(warnings: list[str]) -> list[str]:
    return [w.split(":")[0].split(" at ")[0] for w in warnings]


def test_a_healthy_log_gives_no_warning() -> None:
    rows = [{"step": s, "loss": 20 - s, "pos_sim": 0.3 + 0.05 * s, "neg_sim": 0.1, "mi_lower_bound": 0.2 * s}
            for s in range(1, 11)]
    assert training_warnings(rows) == []
    live = LiveHealth(total_steps=10)
    assert all(live.check(r) == [] for r in rows)
    assert evaluation_warnings({"test/diag/erank/fused": 20.0, "test/diag/unif": -3.2, "test/linear/class/acc": 0.8},
                               {"test/linear/class/acc": 0.5}) == []


def test_the_quickstart_false_alarm_is_gone() -> None:
    """The healthy quickstart's log around step 20 of 96 (gap 0.01 to 0.03, growing to 0.12):
    one row at 20 % of the steps used to be flagged 'no alignment'."""
    gaps = [0.0] * 10 + [0.013] * 11 + [0.03] * 10 + [0.05] * 17 + [0.09] * 24 + [0.12] * 24
    rows = [{"step": s, "loss": 26 - 0.09 * s, "pos_sim": 0.01 + g, "neg_sim": 0.01} for s, g in enumerate(gaps, 1)]
    live = LiveHealth(total_steps=96)
    assert [w for r in rows for w in live.check(r)] == []
    assert training_warnings(rows) == []


# The calibrated thresholds, written out here (not read from mmviews.eval.health), so that a
# change of one in the code fails these tests.
ALIGNMENT_GAP, COLLAPSE_NEG_SIM, COLLAPSE_GAP, DIVERGENCE_RISE = 0.02, 0.8, 0.1, 0.05
MIN_ERANK, MAX_UNIFORMITY, CHANCE_RANK_FRACTION, PROBE_MARGIN = 2.0, -0.5, 0.8, 0.01


@pytest.mark.parametrize("inside", [True, False])
def test_thresholds_of_the_log_checks_just_inside_and_outside(inside: bool) -> None:
    d = 1e-3 if inside else -1e-3  # inside the boundary: flagged; outside: not

    def flags(kind: str, rows: list[dict[str, float]]) -> bool:
        return kind in kinds(training_warnings(rows))

    assert flags("no alignment", rows_with(pos_sim=0.3 + ALIGNMENT_GAP - d, neg_sim=0.3)) is inside
    assert flags("collapse", rows_with(pos_sim=COLLAPSE_NEG_SIM + d + 0.05, neg_sim=COLLAPSE_NEG_SIM + d)) is inside
    assert flags("collapse", rows_with(pos_sim=0.9 + COLLAPSE_GAP - d, neg_sim=0.9)) is inside
    assert flags("MI lower bound <= 0", rows_with(pos_sim=0.9, neg_sim=0.1, mi_lower_bound=-d)) is inside
    # the mean of the last quarter (rows 16-20) against that of the first tenth (rows 1-2)
    rows = [{"step": s, "loss": 10.0 if s <= 2 else 10.0 * (1 + DIVERGENCE_RISE + d), "pos_sim": 0.5, "neg_sim": 0.1}
            for s in range(1, 21)]
    assert flags("divergence", rows) is inside


@pytest.mark.parametrize("inside", [True, False])
def test_thresholds_of_the_evaluation_checks_just_inside_and_outside(inside: bool) -> None:
    d = 1e-3 if inside else -1e-3

    def flags(trained: dict[str, float], random_init: dict[str, float] | None = None) -> bool:
        return bool(evaluation_warnings(trained, random_init))

    assert flags({"test/diag/erank/fused": MIN_ERANK - d}) is inside
    assert flags({"test/diag/unif": MAX_UNIFORMITY + d}) is inside
    # 511 pairs: chance mean rank 256
    assert flags({"test/retrieval/a->b/MeanR": CHANCE_RANK_FRACTION * 256 + d, "test/retrieval/a->b/n": 511.0}) is inside
    assert flags({"test/linear/class/acc": 0.5 - PROBE_MARGIN - d}, {"test/linear/class/acc": 0.5}) is inside
    assert flags({"test/knn/class/top1": 0.5 - PROBE_MARGIN - d}, {"test/knn/class/top1": 0.5}) is inside
    assert flags({"test/regression/sentiment/r2": 0.5 - PROBE_MARGIN - d}, {"test/regression/sentiment/r2": 0.5}) is inside
    assert flags({"test/regression/sentiment/mae": 0.5 * (1 + PROBE_MARGIN) + d},
                 {"test/regression/sentiment/mae": 0.5}) is inside
    # where the task has an R^2, the MAE is not judged on its own (polyview_gaussian's latent)
    assert not flags({"test/regression/latent/mae": 0.0347, "test/regression/latent/r2": 0.9984},
                     {"test/regression/latent/mae": 0.0033, "test/regression/latent/r2": 1.0})


@pytest.mark.parametrize("inside", [True, False])
def test_the_live_check_starts_at_half_of_the_steps(inside: bool) -> None:
    live = LiveHealth(total_steps=10)  # first check at step 5
    rows = rows_with(10, pos_sim=0.3, neg_sim=0.3)
    stop = 5 if inside else 4
    warned = [(r["step"], w) for r in rows[:stop] for w in live.check(r)]
    assert bool(warned) is inside and all(step == 5 for step, _ in warned)


def test_log_checks_collapse_alignment_and_mi_bound() -> None:
    collapsed = rows_with(8, pos_sim=0.96, neg_sim=0.95, mi_lower_bound=-0.1)
    found = training_warnings(collapsed)
    assert kinds(found) == ["collapse", "MI lower bound <= 0"]
    assert training_warnings(rows_with(3, pos_sim=0.11, neg_sim=0.1))[0].startswith("no alignment")
    # a health warning is not judged on one or two logged steps (a tiny run's log)
    assert training_warnings(rows_with(2, pos_sim=0.11, neg_sim=0.1)) == []
    assert [w for r in rows_with(2, pos_sim=0.11, neg_sim=0.1) for w in LiveHealth(total_steps=2).check(r)] == []
    live = LiveHealth(total_steps=10)
    new = [live.check(r) for r in collapsed]
    assert [len(n) for n in new] == [0, 0, 0, 0, 2, 0, 0, 0]  # from step 5 on, each kind once


def test_one_consistent_hint_that_fits_the_runs_settings() -> None:
    """A diverged run (the issue's lr 1.0 run: loss 13.8 -> 21.1, views no longer aligned, MI
    bound <= 0) gets one hint, to lower its learning rate; never 'higher' beside 'lower'."""
    rows = [{"step": s, "loss": 13.8 + 7.3 * s / 40, "pos_sim": 0.30, "neg_sim": 0.30, "mi_lower_bound": -0.5}
            for s in range(1, 41)]
    settings = HealthSettings(lr=1.0, objective="mv_dhel", temperature=0.2)
    found = training_warnings(rows, settings)
    assert kinds(found) == ["divergence", "no alignment", "MI lower bound <= 0"]
    text = " ".join(found)
    assert "lower optimisation.lr (now 1), e.g. 0.1" in found[0] and "higher" not in text and "raise" not in text
    assert "clip the gradients (optimisation.max_grad_norm)" in found[0]  # not set: set it
    clipped = training_warnings(rows, HealthSettings(lr=1.0, max_grad_norm=5.0))
    assert "clip the gradients harder (optimisation.max_grad_norm, now 5)" in clipped[0]  # set: lower it
    assert text.count("hint:") == 1 and all("consequence of the divergence" in w for w in found[1:])
    # the collapse hint never recommends the objective the run already uses
    collapsed = rows_with(8, pos_sim=0.96, neg_sim=0.95)
    dhel = training_warnings(collapsed, HealthSettings(lr=0.5, objective="mv_dhel", temperature=0.2))
    assert "(mv_dhel)" not in dhel[0] and "(now 0.5)" in dhel[0] and "temperature, now 0.2)" in dhel[0]
    pvc = training_warnings(collapsed, HealthSettings(lr=0.5, objective="geometric_pvc"))
    assert "(mv_dhel) resists collapse" in pvc[0]
    # no alignment on its own: the hint to train longer or raise the learning rate
    slow = training_warnings(rows_with(8, pos_sim=0.1, neg_sim=0.1), HealthSettings(lr=1e-7))
    assert len(slow) == 1 and "raise optimisation.lr (now 1e-07)" in slow[0]
    # collapse found in the evaluation and retrieval at chance: one hint, the collapse's
    both = evaluation_warnings({"test/diag/erank/fused": 1.1, "test/retrieval/a->b/MeanR": 250.0,
                                "test/retrieval/a->b/n": 512.0}, None, settings)
    assert kinds(both)[0] == "collapse" and " ".join(both).count("hint:") == 1


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
    assert chance[0].startswith("retrieval at chance in 1 of 2 directions: ") and "audio_0->text_0" not in chance[0]
    # every direction at chance: still one warning (one hint), three named, the rest counted
    pairs = [f"v{i}->w{i}" for i in range(5)]
    all_at_chance = {**{f"test/retrieval/{p}/MeanR": 60.0 for p in pairs}, **{f"test/retrieval/{p}/n": 128.0 for p in pairs}}
    (line,) = [w for w in evaluation_warnings(all_at_chance, None) if w.startswith("retrieval at chance")]
    assert line.startswith("retrieval at chance in 5 of 5 directions: v0->w0 mean rank 60.0 of 128 (chance 64.5)")
    assert "v2->w2" in line and "v3->w3" not in line and ", and 2 more" in line
    below = [w for w in found if w.startswith("probe below random init")]
    assert len(below) == 2 and any("linear/class/acc is 0.4000" in w for w in below) and any("mae" in w for w in below)


def test_chance_levels_of_retrieval_and_alignment() -> None:
    metrics = {"test/retrieval/a->b/n": 64.0, "test/diag/sim_neg_mean": 0.25}
    assert chance_level("test/retrieval/a->b/R@1", metrics) == 1 / 64
    assert chance_level("test/retrieval/a->b/R@10", metrics) == 10 / 64
    assert chance_level("test/retrieval/a->b/MeanR", metrics) == chance_level("test/retrieval/a->b/MedR", metrics) == 32.5
    assert chance_level("test/diag/sim_pos_mean", metrics) == 0.25
    assert chance_level("test/diag/align", metrics) == 1.5  # ||u - v||^2 = 2 - 2 cos for unit vectors
    assert chance_level("test/linear/class/acc", metrics) is None
    assert chance_level("test/retrieval/c->d/R@1", metrics) is None  # no n recorded


def test_boundary_check_fails_when_a_threshold_moves(monkeypatch) -> None:
    """Mutation test: the alignment threshold moved from 0.02 to 0.03 (the quickstart's step-20
    false alarm came from a gap of 0.013): the boundary test fails."""
    from mutations import apply_break

    apply_break("move_alignment_threshold", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_thresholds_of_the_log_checks_just_inside_and_outside(False)



# ---------------------------------------------------------------------------------------------
# Which split is judged: the test split when the run evaluated one, else the validation split;
# never both (a run with a collapsed validation split and a healthy test split is judged by its
# test split, as its report and headline are).
# ---------------------------------------------------------------------------------------------
COLLAPSED = {"diag/erank/fused": 1.1, "diag/unif": -0.2}
HEALTHY = {"diag/erank/fused": 12.0, "diag/unif": -3.5}


def _on(split: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{split}/{key}": value for key, value in metrics.items()}


@pytest.mark.parametrize("val,test,flagged", [
    (HEALTHY, COLLAPSED, ["test", "test"]),  # the test split is judged
    (COLLAPSED, HEALTHY, []),  # a collapsed validation split beside a test split: not judged
    (COLLAPSED, None, ["val", "val"]),  # no test split: the validation split is judged
    (None, COLLAPSED, ["test", "test"]),
])
def test_collapse_is_judged_on_the_test_split_else_the_validation_split(val, test, flagged) -> None:
    trained = {**(_on("val", val) if val else {}), **(_on("test", test) if test else {})}
    warnings = evaluation_warnings(trained, None)
    assert [w.split(" ")[2] for w in warnings] == flagged, warnings  # "collapse: the <split> ..."
    assert all(w.startswith("collapse: the ") for w in warnings), warnings


@pytest.mark.parametrize("splits,judged", [(("val", "test"), "test"), (("val",), "val"), (("test",), "test")])
def test_probes_are_judged_on_the_test_split_else_the_validation_split(splits, judged) -> None:
    """The probe of the judged split below random init is flagged; the same probe of the other
    split below random init is not."""
    trained = {f"{s}/linear/class/acc": 0.40 for s in splits}
    random_init = {f"{s}/linear/class/acc": 0.50 for s in splits}
    warnings = evaluation_warnings(trained, random_init)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"probe below random init: {judged}/linear/class/acc "), warnings
    # only the other split below random init: nothing to say
    if len(splits) == 2:
        healthy_test = {**trained, "test/linear/class/acc": 0.60}
        assert evaluation_warnings(healthy_test, random_init) == []


@pytest.mark.parametrize("splits,headline", [
    (("val", "test"), ["test/linear/class/acc", "test/retrieval/a->b/R@1"]),
    (("val",), ["val/linear/class/acc", "val/retrieval/a->b/R@1"]),
])
def test_headline_is_the_test_split_else_the_validation_split(splits, headline) -> None:
    from mmviews.eval.summary import headline_metrics

    trained, random_init = {}, {}
    for s in splits:
        trained.update({f"{s}/linear/class/acc": 0.7, f"{s}/retrieval/a->b/R@1": 0.2, f"{s}/retrieval/a->b/n": 10.0,
                        f"{s}/diag/unif": -3.0})
        random_init.update({f"{s}/linear/class/acc": 0.5})
    rows = headline_metrics(trained, random_init)
    assert [r["metric"] for r in rows] == headline
    assert rows[0]["random_init"] == 0.5 and rows[1]["chance"] == 1 / 10
    # a run that evaluated diagnostics only: its diagnostics, of the same split
    diagnostics = {k: v for k, v in trained.items() if "/diag/" in k}
    assert [r["metric"] for r in headline_metrics(diagnostics, None)] == [f"{splits[-1]}/diag/unif"]


def test_a_run_without_a_test_split_heads_with_its_validation_split(tmp_path: Path) -> None:
    """``mmviews train`` of a recipe with no test split: the terminal's headline and results.json
    name the validation split's probe, measured on it."""
    from test_train_utils import tiny_config, train_in_process, write_recipe

    raw = tiny_config(text=False, num_samples=24, batch_size=8, epochs=1, tasks=["linear:class"])
    raw["views"], raw["data"]["options"]["modalities"] = [{"modality": "image", "copies": 2}], ["image"]
    del raw["adapters"]["audio"]
    raw["data"].update(val_split="valid", test_split=None)
    raw["data"]["split_options"] = {"valid": {"num_samples": 16}}
    raw["evaluation"]["plots"] = False
    raw["output"]["checkpoint_every"] = 0
    r = train_in_process(str(write_recipe(tmp_path / "r.yaml", raw)), "--output", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [h["metric"] for h in results["headline"]] == ["val/linear/class/acc"]
    assert "val metrics, trained vs random init:" in r.stdout and "  val/linear/class/acc  trained " in r.stdout
