"""Experiment trackers (``output.trackers``) through Accelerate: TensorBoard receives the same
per-step rows as ``metrics.csv`` and the final evaluation (read back from the event file); a
tracker that is not installed stops the run before it touches the run folder; the old
``output.tensorboard`` switch still loads, with a warning."""

from __future__ import annotations

import csv
import json
import warnings

import pytest
from test_train_utils import tiny_config

from mmviews.config import ConfigError, config_from_dict
from mmviews.train import train
from mmviews.train.logging import TRACKERS_DIR, resolve_trackers, tracker_installed


def test_tensorboard_events_hold_the_logged_rows_and_the_evaluation(tmp_path):
    pytest.importorskip("tensorboard")  # the mmviews[tensorboard] extra, installed in CI
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    raw = tiny_config(num_samples=32, batch_size=16, epochs=2, image=False, tasks=["linear:class"])
    raw["output"]["trackers"] = ["tensorboard"]
    config = config_from_dict(raw, "tiny.yaml")
    run = tmp_path / "run"
    summary = train(config, run, source="tiny.yaml")

    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    logdir = run / TRACKERS_DIR / "tiny"  # <run>/logs/<recipe name>
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "epoch", "lr_head", "pos_sim", "samples_per_s"} <= tags, tags
    for name in ("loss", "pos_sim", "lr_head"):
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        expected = [(int(r["step"]), float(r[name])) for r in rows]
        assert [s for s, _ in logged] == [s for s, _ in expected], name
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-5), name

    # The final evaluation, trained and at random initialisation, at the last step.
    results = json.loads((run / "results.json").read_text())
    key = "test/linear/class/acc"
    for tag, value in ((key, results["eval"][key]), (f"random_init/{key}", results["eval_random"][key])):
        (event,) = events.Scalars(tag)
        assert event.step == summary["steps"] == 4 and event.value == pytest.approx(value, rel=1e-6), tag


def test_a_tracker_that_is_not_installed_stops_the_run_before_any_work(tmp_path):
    missing = next((n for n in ("aim", "clearml", "swanlab", "dvclive") if not tracker_installed(n)), None)
    if missing is None:
        pytest.skip("every candidate tracker is installed here")
    raw = tiny_config(num_samples=32, batch_size=16, epochs=1, image=False)
    raw["output"]["trackers"] = [missing]
    with pytest.raises(ConfigError, match=rf"tiny\.yaml: key 'output\.trackers': tracker '{missing}' is not installed"):
        train(config_from_dict(raw, "tiny.yaml"), tmp_path / "run", source="tiny.yaml")
    assert not (tmp_path / "run").exists()


def test_unknown_tracker_names_the_key():
    raw = tiny_config()
    raw["output"]["trackers"] = ["tensorbord"]
    with pytest.raises(ConfigError, match=r"tiny\.yaml: key 'output\.trackers\.0': expected one of 'tensorboard'"):
        config_from_dict(raw, "tiny.yaml")


def test_default_is_csv_only_and_the_old_switch_still_loads(monkeypatch):
    assert resolve_trackers(config_from_dict(tiny_config())) == []
    raw = tiny_config()
    raw["output"]["tensorboard"] = False  # what older run folders and scripts hold
    assert resolve_trackers(config_from_dict(raw)) == []
    raw["output"]["tensorboard"] = True
    config = config_from_dict(raw, "old.yaml")
    import mmviews.train.logging as logging_module

    monkeypatch.setattr(logging_module, "tensorboard_available", lambda: True)
    with pytest.warns(FutureWarning, match="'output.tensorboard' is deprecated, use 'output.trackers: \\[tensorboard\\]'"):
        assert resolve_trackers(config, "old.yaml") == ["tensorboard"]
    # Its old meaning: TensorBoard when installed, otherwise a warning and metrics.csv only.
    monkeypatch.setattr(logging_module, "tensorboard_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_trackers(config, "old.yaml") == []
    assert any("not installed" in str(w.message) for w in caught)
