"""Experiment trackers (``output.trackers``) through Accelerate: TensorBoard, MLflow (file store)
and Weights & Biases (offline) receive the same per-step rows as ``metrics.csv`` and the final
evaluation (read back from their own files); MLflow and W&B also the recipe as parameters and the
report with its plots, and a resumed run goes on in the same tracker run; a
tracker that is not installed stops the run before it touches the run folder; the old
``output.tensorboard`` switch still loads, with a warning."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest
from test_train_utils import tiny_config

from mmviews.config import ConfigError, config_from_dict
from mmviews.train import train
from mmviews.train.callbacks import TrainCallback
from mmviews.train.trackers import (
    MLFLOW_STORE_DIR,
    TRACKER_RUNS_FILE,
    TRACKERS_DIR,
    resolve_trackers,
    tracker_installed,
)


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
    import mmviews.train.trackers as trackers_module

    monkeypatch.setattr(trackers_module, "tensorboard_available", lambda: True)
    with pytest.warns(FutureWarning, match="'output.tensorboard' is deprecated, use 'output.trackers: \\[tensorboard\\]'"):
        assert resolve_trackers(config, "old.yaml") == ["tensorboard"]
    # Its old meaning: TensorBoard when installed, otherwise a warning and metrics.csv only.
    monkeypatch.setattr(trackers_module, "tensorboard_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_trackers(config, "old.yaml") == []
    assert any("not installed" in str(w.message) for w in caught)


class CrashAfter(TrainCallback):
    """Stops the process's run with an error after optimiser step ``step`` (a crash to resume from)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, state) -> None:
        if state.step == self.step:
            raise RuntimeError(f"crash after step {state.step}")


def crash_and_resume(tmp_path, tracker: str) -> tuple[Path, dict]:
    """A tiny run with ``tracker`` that crashes after step 3 (checkpoint at step 2) and is resumed
    to its end (step 4): the run folder and the resumed run's summary."""
    raw = tiny_config(num_samples=32, batch_size=16, epochs=2, image=False, tasks=["linear:class"])
    raw["output"]["trackers"] = [tracker]
    config = config_from_dict(raw, "tiny.yaml")
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash after step 3"):
        train(config, run, source="tiny.yaml", callback=CrashAfter(3))
    return run, train(config, run, resume=run, source="tiny.yaml")


def logged_rows(run: Path) -> dict[int, dict[str, str]]:
    return {int(r["step"]): r for r in csv.DictReader((run / "metrics.csv").open())}


def report_files(run: Path) -> set[str]:
    """What the trackers keep of the report: report.md, results.json and the evaluation's plots."""
    plots = {p.relative_to(run).as_posix() for p in run.glob("eval*/**/*.png")}
    assert plots, "the evaluation drew no plot"
    return {"report.md", "results.json", *plots}


def test_mlflow_file_store_holds_the_rows_the_recipe_and_the_report_in_one_run_across_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # the mmviews[mlflow] extra, installed in CI
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run, summary = crash_and_resume(tmp_path, "mlflow")
    store = run / TRACKERS_DIR / MLFLOW_STORE_DIR
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])  # the resume reopened the crashed run
    assert json.loads((run / TRACKERS_DIR / TRACKER_RUNS_FILE).read_text()) == {"mlflow": mlflow_run.info.run_id}
    assert mlflow_run.info.status == "FINISHED"

    rows = logged_rows(run)
    assert sorted(rows) == [1, 2, 3, 4]
    for name in ("loss", "pos_sim", "lr_head"):
        history = client.get_metric_history(mlflow_run.info.run_id, name)
        # step 3 twice: before the crash and after the resume; the last value is the resumed run's
        last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
        assert sorted(last) == [1, 2, 3, 4], name
        assert [last[s] for s in sorted(last)] == pytest.approx([float(rows[s][name]) for s in sorted(rows)], rel=1e-5)
    metrics = mlflow_run.data.metrics
    key = "test/linear/class/acc"
    assert metrics[key] == pytest.approx(summary["eval"][key]) and metrics[f"random_init/{key}"] == pytest.approx(
        summary["eval_random"][key])
    params = mlflow_run.data.params  # the recipe, flattened
    assert params["optimisation.lr"] == "0.003" and params["objective.name"] == "mv_dhel" and params["name"] == "tiny"

    def artifacts(path: str | None = None) -> set[str]:
        out = set()
        for info in client.list_artifacts(mlflow_run.info.run_id, path):
            out |= artifacts(info.path) if info.is_dir else {info.path}
        return out

    assert artifacts() == report_files(run)


def read_wandb_file(file: Path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``, the LevelDB-style log
    that ``wandb sync`` uploads: 32 KiB blocks of records, each with a 7-byte header)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    raw, position, pending, records = file.read_bytes(), header, b"", []
    while position + header <= len(raw):
        left = block - position % block
        if left < header:  # a block's tail too short for a record header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + header])
        data = raw[position + header:position + header + length]
        position += header + length
        if kind in (1, 2):  # full, first
            pending = data
        elif kind in (3, 4):  # middle, last
            pending += data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_records(run: Path) -> list[tuple[str, list[dict]]]:
    """(run id, history / config / files records) of each offline W&B run folder under the run's
    logs. W&B's service process writes the file: it is read once it holds the run's exit record."""
    import time

    out = []
    for file in sorted((run / TRACKERS_DIR / "wandb").glob("offline-run-*/run-*.wandb")):
        deadline = time.monotonic() + 60
        while True:
            records = read_wandb_file(file)
            kinds = [r.WhichOneof("record_type") for r in records]
            if "exit" in kinds or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "exit" in kinds, f"{file}: no exit record ({kinds})"
        run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
        def key(item) -> str:  # a name with "/" may come as a nested key
            return item.key or "/".join(item.nested_key)

        parsed = []
        for r in records:
            kind = r.WhichOneof("record_type")
            if kind == "history":
                parsed.append({"history": {key(i): json.loads(i.value_json) for i in r.history.item}})
            elif kind == "config":
                parsed.append({"config": {key(i): json.loads(i.value_json) for i in r.config.update}})
            elif kind == "files":
                parsed.append({"files": [f.path for f in r.files.files]})
        out.append((run_id, parsed))
    return out


def test_wandb_offline_run_holds_the_rows_the_recipe_and_the_report_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # the mmviews[wandb] extra, installed in CI
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run, summary = crash_and_resume(tmp_path, "wandb")
    recorded = wandb_records(run)
    assert len(recorded) == 2, "one offline folder per process: the crashed one and the resumed one"
    (run_id,) = {run_id for run_id, _ in recorded}  # the same W&B run, continued
    assert json.loads((run / TRACKERS_DIR / TRACKER_RUNS_FILE).read_text()) == {"wandb": run_id}

    history: dict[int, dict] = {}
    for _, records in recorded:  # later records win: the resumed run's step 3
        for r in records:
            if "history" in r:
                history.setdefault(r["history"]["_step"], {}).update(r["history"])
    rows = logged_rows(run)
    assert sorted(history) == [1, 2, 3, 4]
    for name in ("loss", "pos_sim", "lr_head"):
        assert [history[s][name] for s in sorted(rows)] == pytest.approx([float(rows[s][name]) for s in sorted(rows)],
                                                                          rel=1e-5), name
    key = "test/linear/class/acc"
    assert history[4][key] == pytest.approx(summary["eval"][key])
    assert history[4][f"random_init/{key}"] == pytest.approx(summary["eval_random"][key])
    config = {k: v for _, records in recorded for r in records for k, v in r.get("config", {}).items()}
    assert config["optimisation.lr"] == 0.003 and config["objective.name"] == "mv_dhel" and config["name"] == "tiny"
    _, resumed = recorded[-1]
    saved = {path for r in resumed for path in r.get("files", [])}
    assert report_files(run) <= saved
    (folder,) = [f for f in (run / TRACKERS_DIR / "wandb").glob(f"offline-run-*-{run_id}") if (f / "files" / "report.md").is_file()]
    assert (folder / "files" / "report.md").read_text() == (run / "report.md").read_text()


def test_metric_names_are_spelled_as_each_tracker_accepts_them():
    """MLflow refuses ``@`` and ``>`` (retrieval's ``text->image/R@1``): checked by MLflow's own
    validator; the other trackers get the names as they are."""
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric_name

    from mmviews.train.trackers import tracker_metric_name

    name = "test/retrieval/text->image/R@1"
    with pytest.raises(MlflowException):
        _validate_metric_name(name)
    spelled = tracker_metric_name("mlflow", name)
    _validate_metric_name(spelled)
    assert spelled == "test/retrieval/text-_image/R_at_1"
    assert tracker_metric_name("wandb", name) == tracker_metric_name("tensorboard", name) == name
