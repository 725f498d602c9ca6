"""Experiment trackers (:mod:`mmviews.train.trackers`, ``output.trackers``) through Accelerate.

On tiny inputs: which trackers a recipe turns on and the message naming what to install when one is
missing, the old ``output.tensorboard`` switch (added once, with a warning), the recipe as flat
hyper-parameters, the trackers' init arguments and the ids a resumed run reopens. End to end:
TensorBoard, MLflow (file store) and Weights & Biases (offline) receive the same per-step rows as
``metrics.csv`` and the final evaluation (read back from their own files); MLflow and W&B also the
recipe as parameters and the report with its plots, and a resumed run goes on in the same tracker
run; a tracker that is not installed stops the run before it touches the run folder."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest
from test_train_utils import tiny_config

import mmviews.train.trackers as trackers_module
from mmviews.config import ConfigError, config_from_dict
from mmviews.notices import MMViewsWarning
from mmviews.train import train
from mmviews.train.callbacks import TrainCallback
from mmviews.train.trackers import (
    MLFLOW_STORE_DIR,
    TRACKER_RUNS_FILE,
    TRACKERS_DIR,
    check_trackers_installed,
    flat_hparams,
    record_tracker_runs,
    resolve_trackers,
    tensorboard_available,
    tracker_init_kwargs,
    tracker_installed,
)


# --------------------------------------------------------------------------- which trackers


def test_a_tracker_package_counts_as_installed_when_any_of_its_modules_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(trackers_module._TRACKER_MODULES, "aim", ("no_such_module_mmviews", "json"))
    assert tracker_installed("aim")
    monkeypatch.setitem(trackers_module._TRACKER_MODULES, "aim", ("no_such_module_mmviews",))
    assert not tracker_installed("aim")


@pytest.mark.parametrize("present, available", [({"tensorboardX"}, True), ({"tensorboard"}, True), (set(), False)])
def test_tensorboard_or_tensorboardx_makes_tensorboard_available(monkeypatch: pytest.MonkeyPatch, present: set[str],
                                                                  available: bool) -> None:
    find_spec = trackers_module.importlib.util.find_spec
    monkeypatch.setattr(trackers_module.importlib.util, "find_spec",
                        lambda name: find_spec("json") if name in present else None)
    assert tensorboard_available() is available


def test_tensorboard_available_finds_tensorboard() -> None:
    pytest.importorskip("tensorboard")  # the mmviews[tensorboard] extra, installed in CI
    assert tensorboard_available() and tracker_installed("tensorboard")


@pytest.mark.parametrize("name, install", [("tensorboard", "pip install 'mmviews[tensorboard]'"),
                                           ("mlflow", "pip install 'mmviews[mlflow]'"),
                                           ("wandb", "pip install 'mmviews[wandb]'"),
                                           ("comet_ml", "pip install comet_ml")])
def test_a_missing_tracker_is_named_with_what_to_install(monkeypatch: pytest.MonkeyPatch, name: str,
                                                         install: str) -> None:
    monkeypatch.setitem(trackers_module._TRACKER_MODULES, name, ("no_such_module_mmviews",))
    raw = tiny_config()
    raw["output"]["trackers"] = [name]
    config = config_from_dict(raw)
    expected = (f"key 'output.trackers': tracker '{name}' is not installed ({install}); metrics.csv is always "
                "written, remove the tracker to train without it")
    with pytest.raises(ConfigError) as raised:
        check_trackers_installed(config)
    assert str(raised.value) == f"recipe: {expected}"
    with pytest.raises(ConfigError) as raised:
        resolve_trackers(config, "r.yaml")
    assert str(raised.value) == f"r.yaml: {expected}"


def test_trackers_keep_the_recipes_order_without_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mlflow", "tensorboard", "wandb"):
        monkeypatch.setitem(trackers_module._TRACKER_MODULES, name, ("json",))
    raw = tiny_config()
    raw["output"]["trackers"] = ["wandb", "tensorboard", "wandb", "mlflow"]
    assert resolve_trackers(config_from_dict(raw)) == ["wandb", "tensorboard", "mlflow"]


def test_the_old_tensorboard_switch_adds_it_once_and_warns_for_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(trackers_module._TRACKER_MODULES, "tensorboard", ("json",))
    monkeypatch.setattr(trackers_module, "tensorboard_available", lambda: True)
    raw = tiny_config()
    raw["output"].update(trackers=["tensorboard"], tensorboard=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_trackers(config_from_dict(raw), "old.yaml") == ["tensorboard"]
    (warned,) = caught
    # attributed to the caller, not to mmviews's own line
    assert warned.category is FutureWarning and warned.filename != trackers_module.__file__
    assert str(warned.message) == "old.yaml: key 'output.tensorboard' is deprecated, use 'output.trackers: [tensorboard]'"


def test_the_old_tensorboard_switch_without_tensorboard_warns_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trackers_module, "tensorboard_available", lambda: False)
    raw = tiny_config()
    raw["output"]["tensorboard"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_trackers(config_from_dict(raw)) == []
    assert [(w.category, str(w.message)) for w in caught] == [
        (MMViewsWarning, "recipe: output.tensorboard is true but TensorBoard is not installed; logging to metrics.csv "
                         "only"),
        (FutureWarning, "recipe: key 'output.tensorboard' is deprecated, use 'output.trackers: [tensorboard]'")]
    assert trackers_module.__file__ not in {w.filename for w in caught}


def test_flat_hparams_are_the_recipes_scalars_under_dotted_keys() -> None:
    raw = tiny_config(num_samples=48)
    raw["output"]["dir"] = None
    flat = flat_hparams(config_from_dict(raw))
    assert flat["name"] == "tiny" and flat["seed"] == 0  # top level: no leading dot
    assert flat["optimisation.lr"] == 3e-3 and flat["data.options.num_samples"] == 48
    assert flat["output.progress_bar"] is False and flat["objective.params.temperature"] == 0.2
    assert "views" not in flat and "data.options.modalities" not in flat  # lists are not scalars
    assert "output.dir" not in flat  # nor is None
    assert not any(key.startswith(".") or key.endswith(".") for key in flat)


# --------------------------------------------------------------------------- tracker init and resume


def test_init_kwargs_without_mlflow_or_wandb_are_empty_and_write_nothing(tmp_path: Path) -> None:
    assert tracker_init_kwargs(["tensorboard"], tmp_path, resumed=False) == {}
    assert not (tmp_path / "logs").exists()


def test_wandb_writes_under_the_runs_logs_and_a_resume_reopens_its_run(tmp_path: Path) -> None:
    fresh = tmp_path / "not" / "yet"  # the run folder itself may not exist yet
    assert tracker_init_kwargs(["wandb"], fresh, resumed=False) == {"wandb": {"dir": str(fresh / "logs")}}
    assert (fresh / "logs").is_dir()
    logs = tmp_path / "logs"
    assert tracker_init_kwargs(["wandb"], tmp_path, resumed=False) == {"wandb": {"dir": str(logs)}}
    (logs / "tracker_runs.json").write_text(json.dumps({"wandb": "run-7"}))
    assert tracker_init_kwargs(["wandb"], tmp_path, resumed=True) == {
        "wandb": {"dir": str(logs), "id": "run-7", "resume": "allow"}}
    # a new run in a folder that holds ids from before does not reopen them
    assert tracker_init_kwargs(["wandb"], tmp_path, resumed=False) == {"wandb": {"dir": str(logs)}}


@pytest.fixture
def mlflow_uri_restored(monkeypatch: pytest.MonkeyPatch):
    mlflow = pytest.importorskip("mlflow")  # the mmviews[mlflow] extra, installed in CI
    before = mlflow.get_tracking_uri()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    yield mlflow
    mlflow.set_tracking_uri(before)


@pytest.mark.parametrize("level,shown", [(None, False), ("INFO", True)])
def test_mlflows_lines_on_creating_its_store_are_off_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capfd: pytest.CaptureFixture[str], mlflow_uri_restored,
                                                                  level: str | None, shown: bool) -> None:
    """"INFO mlflow.store.db.utils: Creating initial MLflow database tables..." on
    stderr when a run's store is made; MLFLOW_LOGGING_LEVEL (mmviews --debug sets INFO) shows it."""
    import logging

    for name in trackers_module.MLFLOW_STORE_LOGGERS:  # as a fresh process has them
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    if level is None:
        monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", level)
    mlflow = mlflow_uri_restored
    tracker_init_kwargs(["mlflow"], tmp_path, resumed=False)
    capfd.readouterr()
    mlflow.tracking.MlflowClient().search_experiments()  # the store (the SQLite tables) is made here
    err = capfd.readouterr().err
    assert ("Creating initial MLflow database tables" in err) == shown, err
    assert (tmp_path / "logs" / "mlflow.db").is_file()


def test_mlflow_gets_a_sqlite_store_in_the_run_unless_a_server_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       mlflow_uri_restored) -> None:
    import os

    mlflow = mlflow_uri_restored
    artifacts = (tmp_path / "logs" / "mlartifacts").resolve().as_uri()
    assert tracker_init_kwargs(["mlflow"], tmp_path, resumed=False) == {"mlflow": {"logging_dir": artifacts}}
    assert mlflow.get_tracking_uri() == f"sqlite:///{(tmp_path / 'logs' / 'mlflow.db').resolve()}"
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # no file store
    fresh = tmp_path / "not" / "yet"  # the run folder itself may not exist yet
    tracker_init_kwargs(["mlflow"], fresh, resumed=False)
    assert mlflow.get_tracking_uri() == f"sqlite:///{(fresh / 'logs' / 'mlflow.db').resolve()}"
    assert (fresh / "logs").is_dir()
    (tmp_path / "logs" / "tracker_runs.json").write_text(json.dumps({"mlflow": "abc", "wandb": ""}))
    assert tracker_init_kwargs(["mlflow", "wandb"], tmp_path, resumed=True) == {
        "mlflow": {"run_id": "abc", "logging_dir": artifacts},
        "wandb": {"dir": str(tmp_path / "logs")}}  # an empty id reopens nothing
    # a run started with the file store (before the SQLite one) goes on in it when resumed
    old = tmp_path / "old"
    (old / "logs" / "mlruns").mkdir(parents=True)
    assert tracker_init_kwargs(["mlflow"], old, resumed=True) == {"mlflow": {}}
    assert mlflow.get_tracking_uri() == (old / "logs" / "mlruns").resolve().as_uri()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    # a tracking server named by the environment is left as it is, and so is the user's switch
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other.as_uri())
    mlflow.set_tracking_uri(other.as_uri())
    tracker_init_kwargs(["mlflow"], tmp_path / "run2", resumed=False)
    assert mlflow.get_tracking_uri() == other.as_uri() and os.environ["MLFLOW_ALLOW_FILE_STORE"] == "false"


class Run:
    def __init__(self, run_id: str) -> None:
        self.id = run_id
        self.info = self
        self.run_id = run_id


class IdAccelerator:
    """Accelerate's ``get_tracker(name, unwrap=True)``: the tracker's own run object."""

    def __init__(self, **runs: str) -> None:
        self.runs = {name: Run(run_id) for name, run_id in runs.items()}

    def get_tracker(self, name: str, unwrap: bool = False) -> Run:
        assert unwrap
        return self.runs[name]


def test_the_ids_of_the_mlflow_and_wandb_runs_are_kept_for_a_resume(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    record_tracker_runs(IdAccelerator(mlflow="m1", wandb="w2"), ["tensorboard", "mlflow", "wandb"], tmp_path)
    # JSON a person reads too (indented), not one long line
    assert (tmp_path / "logs" / "tracker_runs.json").read_text() == '{\n  "mlflow": "m1",\n  "wandb": "w2"\n}'
    record_tracker_runs(IdAccelerator(), ["tensorboard"], tmp_path / "other")
    assert not (tmp_path / "other").exists()  # nothing to keep: no file


# --------------------------------------------------------------------------- real trackers, end to end


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


def test_mlflow_sqlite_store_holds_the_rows_the_recipe_and_the_report_in_one_run_across_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # the mmviews[mlflow] extra, installed in CI
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the current folder (MLflow's default artifact root)
    run, summary = crash_and_resume(tmp_path, "mlflow")
    assert not (tmp_path / "mlruns").exists() and not (run / TRACKERS_DIR / MLFLOW_STORE_DIR).exists()
    # read back by MLflow's own client, through the URI the docs give to `mlflow ui`
    client = MlflowClient(tracking_uri=f"sqlite:///{(run / TRACKERS_DIR / 'mlflow.db').resolve()}")
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
    assert spelled == "test/retrieval/text_to_image/R_at_1"  # readable: the arrow spelled out
    assert tracker_metric_name("wandb", name) == tracker_metric_name("tensorboard", name) == name
    other = "test/linear/class/f1(macro)=x"  # any other refused character: one underscore each
    assert tracker_metric_name("mlflow", other) == "test/linear/class/f1_macro__x"
    _validate_metric_name(tracker_metric_name("mlflow", other))
