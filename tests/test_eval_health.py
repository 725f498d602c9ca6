"""Runs that failed to learn say so (:mod:`mmviews.eval.health`): collapse, MI bound <= 0, retrieval
at chance and a probe below the random initialisation are flagged in the log, on the command line
and in report.md, one line each with a hint. The whole one-line warnings and hints, the split each
check judges, the settings a recipe gives the hints and the live check's schedule are pinned too,
each expected message written from the documented wording and the input's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmviews.cli import main
from mmviews.config import load_config, resolve_recipe
from mmviews.eval import health
from mmviews.eval.health import (
    HealthSettings,
    LiveHealth,
    chance_level,
    evaluation_warnings,
    run_warnings,
    training_findings,
    training_warnings,
)
from mmviews.notices import MMViewsWarning


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
        with pytest.warns(MMViewsWarning) as caught:  # during training (the command: one line on stderr each)
            assert main(["train", str(recipe), "--output", str(tmp_path / "run")]) == 0
    finally:
        results_logger.removeHandler(caplog.handler)
    out, err = capsys.readouterr()
    summary = json.loads((tmp_path / "run" / "results.json").read_text())  # train()'s return value, as written
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert summary["warnings"] and logged == [f"warning: {w}" for w in summary["warnings"]]
    assert [h["metric"] for h in summary["headline"]] == ["test/linear/class/acc"]
    assert any("trained vs random init" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "test metrics, trained vs random init:" in out and "  test/linear/class/acc  trained " in out
    live = [str(w.message) for w in caught if str(w.message).startswith("collapse at step")]
    assert len(live) == 1, live  # during training, once
    assert "pos_sim 0." in live[0] and "hint: lower optimisation.lr" in live[0]
    # the verdicts at the end: on stderr, in the form of mmviews's warnings, not among the metrics
    assert "mmviews train: warning: collapse at the end of training" in err
    assert any(str(w.message).startswith("MI lower bound <= 0") for w in caught) or "warning: MI lower bound <= 0" in err
    assert "warning" not in out
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
    """A diverged run (a reported lr 1.0 run: loss 13.8 -> 21.1, views no longer aligned, MI
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


# ---------------------------------------------------------------------------------------------
# The whole warnings and hints, the split each check judges, the live check's schedule
# ---------------------------------------------------------------------------------------------
END_OF_8 = " at the end of training (mean of the last 2 logged steps)"  # 8 rows: the last quarter is 2


def rows_of(n: int, loss: float = 10.0, **values: float) -> list[dict[str, float]]:
    """``n`` log rows with a constant loss and the given constant values."""
    return [{"step": s, "loss": loss, **values} for s in range(1, n + 1)]


# ---------------------------------------------------------------------------------------------
# HealthSettings.from_config: the recipe's values reach the hints
# ---------------------------------------------------------------------------------------------
def test_settings_from_the_quickstart_recipe() -> None:
    config = load_config(resolve_recipe("quickstart"))  # lr 2e-3, mv_dhel at temperature 0.2, max_grad_norm 5
    assert HealthSettings.from_config(config) == HealthSettings(lr=0.002, objective="mv_dhel", temperature=0.2,
                                                                max_grad_norm=5.0)


def test_settings_without_temperature_or_clipping_are_none() -> None:
    config = load_config(resolve_recipe("quickstart"), ["objective.params={}", "optimisation.max_grad_norm=null",
                                                        "objective.name=geometric_pvc", "optimisation.lr=0.3"])
    settings = HealthSettings.from_config(config)
    assert settings == HealthSettings(lr=0.3, objective="geometric_pvc", temperature=None, max_grad_norm=None)
    # ... and the hints then name the keys without a value
    assert health.hint(health.COLLAPSE, settings) == (
        "hint: lower optimisation.lr (now 0.3), or the objective's temperature (objective.params.temperature); an "
        "objective with a uniformity term (mv_dhel) resists collapse")


# ---------------------------------------------------------------------------------------------
# The hints, whole, with and without the run's settings
# ---------------------------------------------------------------------------------------------
def test_hints_without_settings_name_the_keys_only() -> None:
    empty = HealthSettings()
    assert health.hint(health.DIVERGENCE, empty) == \
        "hint: lower optimisation.lr, or clip the gradients (optimisation.max_grad_norm)"
    assert health.hint(health.COLLAPSE, empty) == (
        "hint: lower optimisation.lr, or the objective's temperature (objective.params.temperature); an objective "
        "with a uniformity term (mv_dhel) resists collapse")
    assert health.hint(health.NO_ALIGNMENT, empty) == (
        "hint: check that the views share information (natural views of one sample, or augmented copies that keep "
        "what you want to learn); train longer, or raise optimisation.lr")
    assert health.hint(health.BELOW_RANDOM, empty) == (
        "hint: choose views that share the information this task needs (training made it worse for this task)")


def test_hints_with_settings_give_the_values() -> None:
    settings = HealthSettings(lr=0.5, objective="mv_dhel", temperature=0.1, max_grad_norm=2.0)
    assert health.hint(health.DIVERGENCE, settings) == \
        "hint: lower optimisation.lr (now 0.5), e.g. 0.05, or clip the gradients harder (optimisation.max_grad_norm, now 2)"
    # an MV-DHEL run is not told to switch to MV-DHEL
    assert health.hint(health.COLLAPSE, settings) == \
        "hint: lower optimisation.lr (now 0.5), or the objective's temperature (objective.params.temperature, now 0.1)"
    assert health.hint(health.NO_ALIGNMENT, settings).endswith("; train longer, or raise optimisation.lr (now 0.5)")


def test_evaluation_warnings_use_the_runs_settings() -> None:
    (warning,) = evaluation_warnings({"test/diag/erank/fused": 1.5}, None, HealthSettings(lr=0.04))
    assert warning == ("collapse: the test embeddings' effective rank is 1.50 (near 1: one direction); hint: lower "
                       "optimisation.lr (now 0.04), or the objective's temperature (objective.params.temperature); an "
                       "objective with a uniformity term (mv_dhel) resists collapse")


# ---------------------------------------------------------------------------------------------
# The training log's findings, whole
# ---------------------------------------------------------------------------------------------
def test_log_findings_whole_messages() -> None:
    assert training_findings(rows_of(8, pos_sim=0.96, neg_sim=0.95, mi_lower_bound=-0.25)) == [
        (health.COLLAPSE, f"collapse{END_OF_8}: positive and negative similarity are both high and close (pos_sim "
                          "0.96, neg_sim 0.95)"),
        (health.NO_ALIGNMENT, f"MI lower bound <= 0{END_OF_8} (-0.25 nats): the loss is at chance"),
    ]
    assert training_findings(rows_of(8, pos_sim=0.11, neg_sim=0.1)) == [
        (health.NO_ALIGNMENT, f"no alignment{END_OF_8}: on the training batches, the views of a sample are no closer "
                              "than different samples (pos_sim 0.110, neg_sim 0.100: gap 0.010, chance 0)")]


def test_divergence_compares_the_first_tenth_with_the_last_quarter() -> None:
    # 20 rows: the head is rows 1-2 (mean 11), the tail rows 16-20 (mean 20); row 3 and row 15
    # are far off, so a head or a tail one row longer gives other numbers
    losses = [10.0, 12.0] + [30.0] * 13 + [20.0] * 5
    rows = [{"step": s, "loss": loss, "pos_sim": 0.5, "neg_sim": 0.1} for s, loss in enumerate(losses, 1)]
    assert training_findings(rows) == [(health.DIVERGENCE, "divergence at the end of training (mean of the last 5 "
                                        "logged steps): the training loss rose from 11 (mean of the first 2 logged "
                                        "steps) to 20")]


def test_divergence_is_relative_to_the_heads_magnitude_for_a_negative_loss() -> None:
    def diverged(head: float, tail: float) -> bool:
        rows = [{"step": s, "loss": head if s == 1 else tail} for s in range(1, 9)]
        return [d for d, _ in training_findings(rows)] == [health.DIVERGENCE]

    assert not diverged(-10.0, -10.2)  # the loss fell
    assert not diverged(-10.0, -9.6)  # rose by 0.4, within 5 % of 10
    assert diverged(-10.0, -9.4)  # rose by 0.6


def test_rows_without_values_are_not_judged() -> None:
    """Missing, None and non-finite values are left out of the means: a log without the
    similarity columns says nothing about alignment."""
    rows = [{"step": s, "loss": 10.0 - s, "pos_sim": None, "neg_sim": float("nan"), "mi_lower_bound": "n/a"}
            for s in range(1, 9)]
    assert training_findings(rows) == []
    # a finite value among the missing ones is the mean (rows 7-8: pos 0.3 only in row 8)
    rows[-1].update(pos_sim=0.3, neg_sim=0.3)
    assert [d for d, _ in training_findings(rows)] == [health.NO_ALIGNMENT]


def test_log_checks_at_their_exact_thresholds() -> None:
    def flagged(rows: list[dict[str, float]]) -> list[str]:
        return [d for d, _ in training_findings(rows)]

    # a gap of exactly 0.02 (0.02 - 0.0 is exact in binary floating point): no alignment
    assert flagged(rows_of(8, pos_sim=0.02, neg_sim=0.0)) == [health.NO_ALIGNMENT]
    # neg_sim exactly 0.8 with a gap of 0.05: collapse
    assert flagged(rows_of(8, pos_sim=0.85, neg_sim=0.8)) == [health.COLLAPSE]
    # an MI bound of exactly 0 nats: at chance
    assert flagged(rows_of(8, pos_sim=0.5, neg_sim=0.1, mi_lower_bound=0.0)) == [health.NO_ALIGNMENT]
    # the loss rose by exactly 5 % (10 -> 10.5; 10.5 - 10 and 0.05 * 10 are both 0.5): not yet a divergence
    assert flagged([{"step": s, "loss": 10.0 if s == 1 else 10.5} for s in range(1, 9)]) == []


def test_one_similarity_alone_is_not_judged() -> None:
    assert training_findings(rows_of(8, pos_sim=0.3)) == training_findings(rows_of(8, neg_sim=0.95)) == []


# ---------------------------------------------------------------------------------------------
# The final evaluation's findings, whole, and the split they judge
# ---------------------------------------------------------------------------------------------
def findings(trained: dict[str, float], random_init: dict[str, float] | None = None) -> list[tuple[str, str]]:
    return health.evaluation_findings(trained, random_init)


def test_collapse_messages_and_the_view_mean_rank() -> None:
    assert findings({"test/diag/unif": -0.2}) == [
        (health.COLLAPSE, "collapse: the test uniformity loss is -0.20 (> -0.5: the embeddings crowd together)")]
    # without a fused embedding, the mean of the views' effective ranks is judged
    assert findings({"val/diag/erank/view_mean": 1.25}) == [
        (health.COLLAPSE, "collapse: the val embeddings' effective rank is 1.25 (near 1: one direction)")]
    # the fused embedding's rank wins over the views' mean
    assert findings({"test/diag/erank/fused": 8.0, "test/diag/erank/view_mean": 1.25}) == []
    # exactly at the thresholds: not flagged (an effective rank below 2, a uniformity loss above -0.5)
    assert findings({"test/diag/erank/fused": 2.0, "test/diag/unif": -0.5}) == []


@pytest.mark.parametrize("test_split", [{"test/diag/erank/fused": 12.0}, {"test/diag/unif": -3.5}])
def test_one_collapse_figure_of_the_test_split_makes_it_the_judged_split(test_split: dict[str, float]) -> None:
    # the validation split collapsed, but the test split (with its rank or its uniformity alone) is judged
    assert findings({**test_split, "val/diag/erank/fused": 1.1, "val/diag/unif": -0.2}) == []


def test_retrieval_at_chance_needs_two_pairs_and_a_recorded_n() -> None:
    # 2 pairs: chance mean rank 1.5
    assert findings({"test/retrieval/a->b/MeanR": 1.5, "test/retrieval/a->b/n": 2.0}) == [
        (health.NO_ALIGNMENT, "retrieval at chance in 1 of 1 directions: a->b mean rank 1.5 of 2 (chance 1.5)")]
    # 9 pairs: chance 5, flagged from 0.8 of it, 4.0 exactly
    assert findings({"test/retrieval/a->b/MeanR": 4.0, "test/retrieval/a->b/n": 9.0})
    assert not findings({"test/retrieval/a->b/MeanR": 3.99, "test/retrieval/a->b/n": 9.0})
    # only retrieval's mean rank is judged
    assert findings({"test/ranking/a->b/MeanR": 9.0, "test/ranking/a->b/n": 9.0}) == []
    assert findings({"test/retrieval/a->b/MeanR": 1.0, "test/retrieval/a->b/n": 1.0}) == []  # one pair: always rank 1
    assert findings({"test/retrieval/a->b/MeanR": 50.0}) == []  # no n: no chance level
    # a direction without n (here the first in order) is not counted, and the others still are
    assert findings({"test/retrieval/a->b/MeanR": 60.0, "test/retrieval/b->a/MeanR": 60.0,
                     "test/retrieval/b->a/n": 100.0})[0][1].startswith("retrieval at chance in 1 of 1 directions: b->a ")


def test_a_view_name_with_a_slash_is_named_whole() -> None:
    # a modality is named by the recipe (a column map's key), and nothing forbids a '/' in it
    assert findings({"test/retrieval/ecg/lead1_0->text_0/MeanR": 8.0, "test/retrieval/ecg/lead1_0->text_0/n": 9.0}) == [
        (health.NO_ALIGNMENT, "retrieval at chance in 1 of 1 directions: ecg/lead1_0->text_0 mean rank 8.0 of 9 "
                              "(chance 5.0)")]


@pytest.mark.parametrize("count,tail", [(3, ""), (4, ", and 1 more")])
def test_retrieval_names_three_directions_and_counts_the_rest(count: int, tail: str) -> None:
    pairs = [f"v{i}->w{i}" for i in range(count)]
    trained = {**{f"test/retrieval/{p}/MeanR": 5.0 for p in pairs}, **{f"test/retrieval/{p}/n": 9.0 for p in pairs}}
    named = ", ".join(f"v{i}->w{i} mean rank 5.0 of 9 (chance 5.0)" for i in range(3))
    assert findings(trained) == [
        (health.NO_ALIGNMENT, f"retrieval at chance in {count} of {count} directions: {named}{tail}")]


def test_held_out_alignment_message_and_split() -> None:
    unaligned = {"diag/sim_pos_mean": 0.31, "diag/sim_neg_mean": 0.3}
    aligned = {"diag/sim_pos_mean": 0.5, "diag/sim_neg_mean": 0.3}

    def on(split: str, values: dict[str, float]) -> dict[str, float]:
        return {f"{split}/{k}": v for k, v in values.items()}

    message = ("no alignment on the held-out {} split: the views of a sample are no closer than different samples "
               "(sim_pos_mean 0.310, sim_neg_mean 0.300: gap 0.010, chance 0)")
    assert findings(on("test", unaligned)) == [(health.NO_ALIGNMENT, message.format("test"))]
    assert findings(on("val", unaligned)) == [(health.NO_ALIGNMENT, message.format("val"))]
    assert findings({**on("val", unaligned), **on("test", aligned)}) == []  # the test split is judged
    assert findings({**on("val", aligned), **on("test", unaligned)}) == [(health.NO_ALIGNMENT, message.format("test"))]
    # a gap of 0.019 is flagged, 0.021 is not
    assert findings(on("test", {"diag/sim_pos_mean": 0.519, "diag/sim_neg_mean": 0.5}))
    assert not findings(on("test", {"diag/sim_pos_mean": 0.521, "diag/sim_neg_mean": 0.5}))
    # exactly 0.02 (0.02 - 0.0 is exact in binary floating point): flagged
    assert findings(on("test", {"diag/sim_pos_mean": 0.02, "diag/sim_neg_mean": 0.0}))
    # one of the two similarities alone: nothing to compare
    assert findings({"test/diag/sim_pos_mean": 0.3}) == findings({"test/diag/sim_neg_mean": 0.3}) == []
    # a collapse (negative similarity 0.8 and above) is the rank's and uniformity's to flag
    assert findings(on("test", {"diag/sim_pos_mean": 0.8, "diag/sim_neg_mean": 0.8})) == []
    assert findings(on("test", {"diag/sim_pos_mean": 0.79, "diag/sim_neg_mean": 0.79}))


def test_probe_message_and_what_is_not_judged() -> None:
    assert findings({"test/linear/class/acc": 0.4}, {"test/linear/class/acc": 0.5}) == [
        (health.BELOW_RANDOM, "probe below random init: test/linear/class/acc is 0.4000 trained, 0.5000 for the "
                              "encoder as initialised")]
    assert findings({"test/regression/s/mae": 0.7}, {"test/regression/s/mae": 0.5}) == [
        (health.BELOW_RANDOM, "probe below random init: test/regression/s/mae is 0.7000 trained, 0.5000 for the "
                              "encoder as initialised")]
    assert findings({"test/linear/class/acc": 0.4}, None) == []  # no baseline: nothing to compare
    assert findings({"test/linear/class/acc": 0.4}, {"test/linear/class/acc": None}) == []
    assert findings({"train/linear/class/acc": 0.4}, {"train/linear/class/acc": 0.5}) == []  # training split
    assert findings({"test/linear/class/loss": 0.9}, {"test/linear/class/loss": 0.1}) == []  # not a probe score
    # exactly at the margin (0.5 - 0.01 and 0.5 + 1 % of 0.5 are exact here): not flagged
    assert findings({"test/linear/class/acc": 0.49, "test/regression/s/mae": 0.505},
                    {"test/linear/class/acc": 0.5, "test/regression/s/mae": 0.5}) == []
    # MAE: 1 % of the baseline's value
    assert findings({"test/regression/s/mae": 0.5 * 1.011}, {"test/regression/s/mae": 0.5})
    assert not findings({"test/regression/s/mae": 0.5 * 1.009}, {"test/regression/s/mae": 0.5})


def test_the_probes_among_all_of_a_runs_metrics() -> None:
    """A run's metrics hold chance levels, diagnostics, probes without a baseline and MAEs
    judged by their R^2, in sorted order before the probes that are judged: each is passed
    over, and the ones after it are still judged."""
    trained = {"chance/test/linear/class/acc": 0.25, "test/diag/unif": -3.0, "test/knn/class/top1": 0.3,
               "test/linear/class/acc": 0.4, "test/regression/latent/mae": 0.9, "test/regression/latent/r2": 0.5}
    random_init = {"test/linear/class/acc": 0.5, "test/regression/latent/mae": 0.1, "test/regression/latent/r2": 0.9}
    assert [m.split(" is ")[0] for _, m in findings(trained, random_init)] == [
        "probe below random init: test/linear/class/acc", "probe below random init: test/regression/latent/r2"]


# ---------------------------------------------------------------------------------------------
# run_warnings: the log's then the evaluation's, one hint, alignment judged on held-out data
# ---------------------------------------------------------------------------------------------
def test_run_warnings_order_hint_and_held_out_alignment() -> None:
    diverging_unaligned = [{"step": s, "loss": 10.0 if s == 1 else 20.0, "pos_sim": 0.3, "neg_sim": 0.3,
                            "mi_lower_bound": -1.0} for s in range(1, 9)]
    probe = ({"test/linear/class/acc": 0.4}, {"test/linear/class/acc": 0.5})
    settings = HealthSettings(lr=0.1)
    found = run_warnings(diverging_unaligned, *probe, settings)
    assert [w.split(" ")[0] for w in found] == ["divergence", "no", "MI", "probe"]
    assert found[0].endswith("; hint: lower optimisation.lr (now 0.1), e.g. 0.01, or clip the gradients "
                             "(optimisation.max_grad_norm)")
    assert all(w.endswith("; likely a consequence of the divergence (see that warning and its hint)") for w in found[1:])
    # held-out retrieval measured: the log's alignment findings (the gap, the MI bound) are left out, not the divergence
    held_out = {**probe[0], "test/retrieval/a->b/MeanR": 2.0, "test/retrieval/a->b/n": 100.0}
    assert [w.split(" ")[0] for w in run_warnings(diverging_unaligned, held_out, probe[1], settings)] == \
        ["divergence", "probe"]


@pytest.mark.parametrize("key,held_out", [
    ("test/retrieval/a->b/MeanR", True), ("val/retrieval/a->b/MeanR", True), ("val/diag/sim_pos_mean", True),
    ("test/diag/sim_pos_mean", True), ("train/retrieval/a->b/MeanR", False), ("test/retrieval/a->b/R@1", False),
    ("test/diag/sim_neg_mean", False), ("test/linear/class/acc", False), ("test/mean_rank", False),
])
def test_which_metrics_measure_held_out_alignment(key: str, held_out: bool) -> None:
    assert health.measures_held_out_alignment({key: 1.0}) is held_out


def test_no_metrics_measure_no_alignment() -> None:
    assert health.measures_held_out_alignment(None) is False and health.measures_held_out_alignment({}) is False


# ---------------------------------------------------------------------------------------------
# The live check: when it looks, and the one hint across the run
# ---------------------------------------------------------------------------------------------
def test_live_check_looks_every_other_step_and_at_the_last() -> None:
    # 102 steps: first look at step 51, then every (102 - 51 + 1) // 20 = 2 steps (51, 53, ...,
    # 101) and at the last step, 102, which is off that grid
    live = LiveHealth(total_steps=102)
    healthy = [{"step": s, "loss": 20.0 - 0.1 * s} for s in range(1, 102)]
    assert [w for r in healthy for w in live.check(r)] == []
    (warning,) = live.check({"step": 102, "loss": 9.0, "pos_sim": 0.3, "neg_sim": 0.3})
    assert warning.startswith("no alignment at step 102 (mean of the last 25 logged steps): on the training batches")

    live = LiveHealth(total_steps=102)
    for row in healthy[:51]:
        live.check(row)
    assert live.check({"step": 52, "loss": 14.8, "pos_sim": 0.3, "neg_sim": 0.3}) == []  # off the grid
    (warning,) = live.check({"step": 53, "loss": 14.7})  # on it: the row of step 52 is in the tail
    assert warning.startswith("no alignment at step 53 (mean of the last 13 logged steps)")


def test_live_check_every_third_step_counts_from_the_first_look() -> None:
    # 122 steps: first look at step 61, then every (122 - 61 + 1) // 20 = 3 steps: 64, not 62
    live = LiveHealth(total_steps=122)
    for step in range(1, 62):
        assert live.check({"step": step, "loss": 30.0 - 0.1 * step}) == []
    assert live.check({"step": 62, "loss": 23.0, "pos_sim": 0.3, "neg_sim": 0.3}) == []
    assert live.check({"step": 63, "loss": 23.0}) == []
    (warning,) = live.check({"step": 64, "loss": 23.0})
    assert warning.startswith("no alignment at step 64 (mean of the last 16 logged steps)")


@pytest.mark.parametrize("total_steps,every", [(76, 1), (78, 2)])
def test_live_check_spacing_at_the_step_count_where_it_changes(total_steps: int, every: int) -> None:
    # 76 steps: first look at 38, (76 - 38 + 1) // 20 = 1; 78 steps: first look at 39, 40 // 20 = 2
    live = LiveHealth(total_steps=total_steps)
    assert (live.first_step, live.every) == (total_steps // 2, every)


def test_live_check_of_a_one_step_run() -> None:
    live = LiveHealth(total_steps=0)  # no steps known: treated as one, checked from step 1
    assert (live.total_steps, live.first_step, live.every) == (1, 1, 1)
    assert LiveHealth(total_steps=40, start_fraction=0.25).first_step == 10
    assert LiveHealth(total_steps=1, start_fraction=1.0).first_step == 1  # the one step is checked


def test_a_row_without_a_step_is_kept_but_not_judged() -> None:
    live = LiveHealth(total_steps=1)
    assert [w for _ in range(3) for w in live.check({"loss": 10.0, "pos_sim": 0.3, "neg_sim": 0.3})] == []
    assert len(live.rows) == 3
    (warning,) = live.check({"step": 1, "loss": 10.0, "pos_sim": 0.3, "neg_sim": 0.3})
    assert warning.startswith("no alignment at step 1 (mean of the last 1 logged steps)")


def test_live_hint_stays_with_the_first_diagnosis_until_a_more_basic_one() -> None:
    live = LiveHealth(total_steps=12, settings=HealthSettings(lr=0.01))
    unaligned = [{"step": s, "loss": 10.0, "pos_sim": 0.3, "neg_sim": 0.3} for s in range(1, 7)]
    first = [w for r in unaligned for w in live.check(r)]
    assert len(first) == 1 and first[0].endswith("train longer, or raise optimisation.lr (now 0.01)")
    # the loss then rises: the divergence is the more basic problem and brings its own hint
    (diverged,) = live.check({"step": 7, "loss": 30.0, "pos_sim": 0.3, "neg_sim": 0.3})
    assert diverged.startswith("divergence at step 7 (mean of the last 1 logged steps): the training loss rose from "
                               "10 (mean of the first 1 logged steps) to 30; hint: lower optimisation.lr (now 0.01)")
    # a collapse after it refers to the divergence
    # (at step 8 the tail, rows 7-8, still averages to 0.625; rows 8-9 are collapsed)
    collapsed = [w for s in (8, 9) for w in live.check({"step": s, "loss": 30.0, "pos_sim": 0.95, "neg_sim": 0.95})]
    assert len(collapsed) == 1 and collapsed[0].startswith("collapse at step 9")
    assert collapsed[0].endswith("; likely a consequence of the divergence (see that warning and its hint)")


def test_with_hints_keeps_an_earlier_primary_over_a_less_basic_finding() -> None:
    found = [(health.BELOW_RANDOM, "probe below random init: x")]
    assert health.with_hints(found, None, health.COLLAPSE) == [
        "probe below random init: x; likely a consequence of the collapse (see that warning and its hint)"]
    assert health.with_hints(found) == [f"probe below random init: x; {health.hint(health.BELOW_RANDOM, HealthSettings())}"]
    # each diagnosis reads as a cause ("a consequence of the no alignment")
    assert health.with_hints(found, None, health.NO_ALIGNMENT) == [
        "probe below random init: x; likely a consequence of the views' lack of alignment (see that warning and its "
        "hint)"]
    assert health.with_hints([(health.COLLAPSE, "c"), (health.BELOW_RANDOM, "p"), (health.BELOW_RANDOM, "q")],
                             None, health.DIVERGENCE)[1:] == [
        f"{m}; likely a consequence of the divergence (see that warning and its hint)" for m in ("p", "q")]
    assert set(health.AS_CAUSE) == set(health.DIAGNOSES)


# ---------------------------------------------------------------------------------------------
# Chance levels
# ---------------------------------------------------------------------------------------------
def test_chance_level_recorded_capped_and_unknown() -> None:
    metrics = {"test/retrieval/a->b/n": 4.0, "chance/test/linear/class/acc": 0.25, "test/retrieval/z->y/n": 0.0}
    assert health.chance_level("test/linear/class/acc", metrics) == 0.25  # recorded by the evaluation
    assert health.chance_level("test/retrieval/a->b/R@10", metrics) == 1.0  # 10 of 4 pairs: capped at 1
    assert health.chance_level("test/retrieval/a->b/R@x", metrics) is None
    assert health.chance_level("test/retrieval/a->b/mAP", metrics) is None
    assert health.chance_level("test/retrieval/z->y/R@1", metrics) is None  # no pairs
    one_pair = {"test/retrieval/a->b/n": 1.0}  # one pair: found at rank 1 by any embedding
    assert health.chance_level("test/retrieval/a->b/R@1", one_pair) == health.chance_level(
        "test/retrieval/a->b/MeanR", one_pair) == 1.0
    assert health.chance_level("test/diag/sim_pos_mean", metrics) is None  # no negative similarity recorded
    assert health.is_chance_key("chance/test/linear/class/acc") and not health.is_chance_key("test/chance/acc")


def test_alignment_chance_reads_the_negative_similarity_beside_its_own_key() -> None:
    """The figures of ``<prefix>/diag/sim_pos_mean`` and ``.../align`` are matched with
    ``<prefix>/diag/sim_neg_mean``, the prefix being everything before the key's last ``/diag/``."""
    metrics = {"run/diag/x/diag/sim_neg_mean": 0.25, "run/diag/sim_neg_mean": 0.5}
    assert health.chance_level("run/diag/x/diag/sim_pos_mean", metrics) == 0.25
    assert health.chance_level("run/diag/x/diag/align", metrics) == 1.5
    assert health.chance_level("run/diag/align", metrics) == 1.0


def test_chance_of_integer_labels_and_targets() -> None:
    # integer targets are regressed as floats: training mean 2, evaluated [1, 5]
    assert health.regression_chance([1, 2, 3], [1, 5]) == {"mae": 2.0, "mse": 5.0, "r2": 1.0 - 5.0 / 4.0}
    # one evaluated target has no variance: no R^2
    assert health.regression_chance([1.0, 3.0], [5.0]) == {"mae": 3.0, "mse": 9.0}
    assert health.regression_chance([2.0], [1.0, 3.0]) == {"mae": 1.0, "mse": 1.0, "r2": 0.0}
    assert health.classification_chance([3], [3, 1]) == 0.5


@pytest.mark.parametrize("train,evaluated", [([], [1.0]), ([1.0], []), ([], [])])
def test_chance_without_labels_is_an_error(train: list, evaluated: list) -> None:
    with pytest.raises(ValueError, match=r"^regression_chance needs training and evaluated targets$"):
        health.regression_chance(train, evaluated)
    with pytest.raises(ValueError, match=r"^classification_chance needs training and evaluated labels$"):
        health.classification_chance(train, evaluated)
