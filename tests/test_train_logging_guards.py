"""Unit guards of :mod:`mmviews.train.trackers`, :mod:`mmviews.train.step_log` and :mod:`mmviews.eval.summary`, in this process and on tiny inputs: the
``metrics.csv`` writer (a fresh run, a resumed one), which trackers a recipe turns on and the
message when one is missing, the recipe as flat hyper-parameters, the trackers' init arguments
and the ids a resumed run reopens, the per-step row (its columns, its values, which steps are
logged, the line printed without a progress bar), what the trackers receive, and the run's
summary files (``results.json``, ``report.md``) with the headline and data-left-out lines."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.tracking import GeneralTracker
from test_train_utils import own_accelerate_state, tiny_config

import mmviews.eval.summary as summary_module
import mmviews.train.step_log as step_log_module
import mmviews.train.trackers as trackers_module
from mmviews.config import ConfigError, config_from_dict
from mmviews.eval.health import HealthSettings
from mmviews.notices import MMViewsWarning
from mmviews.objectives import ObjectiveOutput
from mmviews.run import claim_run_dir, read_manifest
from mmviews.eval.summary import (data_left_out_lines, data_report_lines, finalise_summary, headline_lines,
                                  headline_metrics, read_eval_metrics, read_training_log, write_results)
from mmviews.train.step_log import CSVLogger, StepLogger
from mmviews.train.trackers import (
    check_trackers_installed,
    flat_hparams,
    record_tracker_runs,
    resolve_trackers,
    tracker_init_kwargs,
    tracker_installed,
    tensorboard_available,
)
from mmviews.train.state import TrainState

HEADER = "step,epoch,loss\n"


def write_log(path: Path, rows: list[tuple[Any, ...]], header: str = HEADER) -> None:
    path.write_text(header + "".join(",".join(str(v) for v in row) + "\n" for row in rows))


# --------------------------------------------------------------------------- metrics.csv


def test_a_fresh_log_removes_a_stale_file_and_writes_the_first_rows_columns(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    write_log(path, [(1, 0.5, 9.0)])
    logger = CSVLogger(path)
    assert not path.exists() and logger.fields is None and logger.last_loss is None
    logger.log({"step": 1, "epoch": 0.25, "loss": 2.0 / 3.0})
    # a later row: its extra column is ignored, its missing one left empty; floats in 6 significant digits
    logger.log({"step": 2, "loss": 1234567.0, "new": 1.0})
    assert path.read_text().splitlines() == ["step,epoch,loss", "1,0.25,0.666667", "2,,1.23457e+06"]
    logger.log({"step": 1234567, "epoch": "late", "loss": 0.5})  # ints and text as they are
    assert path.read_text().splitlines()[-1] == "1234567,late,0.5"


def test_the_first_row_enters_the_run_manifest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    claim_run_dir(run)
    logger = CSVLogger(run / "metrics.csv")
    logger.log({"step": 1, "loss": 1.0})
    assert "metrics.csv" in read_manifest(run)["created"]


def test_a_resume_keeps_the_rows_up_to_the_checkpoint_step_and_its_columns(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    write_log(path, [(1, 0.25, 4.0), (2, 0.5, 3.0), (3.0, 0.75, 2.5), (4, 1.0, 2.0)])
    logger = CSVLogger(path, resume_step=3)  # a step written as 3.0 still counts as step 3
    assert path.read_text().splitlines() == ["step,epoch,loss", "1,0.25,4.0", "2,0.5,3.0", "3.0,0.75,2.5"]
    assert logger.fields == ["step", "epoch", "loss"] and logger.last_loss == 2.5
    logger.log({"loss": 1.5, "step": 4, "epoch": 1.0})  # the file's column order, no second header
    assert path.read_text().splitlines()[1:] == ["1,0.25,4.0", "2,0.5,3.0", "3.0,0.75,2.5", "4,1,1.5"]  # 6 significant digits: 1.0 is 1


def test_a_resume_at_step_zero_keeps_the_header_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    write_log(path, [(1, 0.25, 4.0)])
    logger = CSVLogger(path, resume_step=0)
    assert path.read_text() == HEADER and logger.fields == ["step", "epoch", "loss"] and logger.last_loss is None


def test_a_resume_whose_last_row_has_no_loss_has_no_last_loss(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    write_log(path, [(1, 0.25, 4.0), (2, 0.5, "")])
    assert CSVLogger(path, resume_step=2).last_loss is None
    write_log(path, [(1, 0.25, 4.0), (2, 0.5, ""), (3, 0.75, 2.5)])  # only the last kept row counts
    assert CSVLogger(path, resume_step=3).last_loss == 2.5


def test_a_resume_without_a_log_or_with_an_empty_one_starts_a_new_one(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    assert CSVLogger(path, resume_step=3).fields is None and not path.exists()
    path.write_text("")
    logger = CSVLogger(path, resume_step=3)
    assert logger.fields is None and path.read_text() == ""
    logger.log({"step": 4, "loss": 1.0})
    assert path.read_text().splitlines() == ["step,loss", "4,1"]


def test_read_training_log_reads_rows_and_gives_nothing_for_a_missing_or_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    assert read_training_log(path) == []
    write_log(path, [(1, 0.5, 2.0)])
    assert read_training_log(path) == [{"step": "1", "epoch": "0.5", "loss": "2.0"}]
    path.write_bytes(b"step,loss\n1,\xff\xfe\n")
    assert read_training_log(path) == []
    path.unlink()
    path.mkdir()
    assert read_training_log(path) == []


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


def test_mlflow_gets_a_file_store_in_the_run_unless_a_server_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     mlflow_uri_restored) -> None:
    import os

    mlflow = mlflow_uri_restored
    assert tracker_init_kwargs(["mlflow"], tmp_path, resumed=False) == {"mlflow": {}}
    assert mlflow.get_tracking_uri() == (tmp_path / "logs" / "mlruns").resolve().as_uri()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "tracker_runs.json").write_text(json.dumps({"mlflow": "abc", "wandb": ""}))
    assert tracker_init_kwargs(["mlflow", "wandb"], tmp_path, resumed=True) == {
        "mlflow": {"run_id": "abc"}, "wandb": {"dir": str(tmp_path / "logs")}}  # an empty id reopens nothing
    # a tracking server named by the environment is left as it is, and so is the user's switch
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other.as_uri())
    mlflow.set_tracking_uri(other.as_uri())
    tracker_init_kwargs(["mlflow"], tmp_path / "run2", resumed=False)
    assert mlflow.get_tracking_uri() == other.as_uri() and os.environ["MLFLOW_ALLOW_FILE_STORE"] == "false"


# --------------------------------------------------------------------------- the per-step row


class RecordingTracker(GeneralTracker):
    """An Accelerate tracker (its documented extension point) that keeps what it is given."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, name: str = "recording") -> None:
        super().__init__()
        self.name = name
        self.config: dict[str, Any] | None = None
        self.logged: list[tuple[dict[str, Any], int | None]] = []
        self.ended = False

    @property
    def tracker(self) -> "TrackerRun":
        return TrackerRun(self)  # what get_tracker(name, unwrap=True) gives: the tracker's own run object

    def store_init_configuration(self, values: dict) -> None:
        self.config = dict(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((dict(values), step))

    def finish(self) -> None:
        self.ended = True

    # what log_report calls on MLflow's tracker and on W&B's run
    def log_artifact(self, path: str, folder: str | None) -> None:
        self.logged.append(({"artifact": path, "folder": folder}, None))



class TrackerRun:
    """The run object behind a :class:`RecordingTracker` (W&B's ``wandb.Run``: ``save``)."""

    def __init__(self, tracker: RecordingTracker) -> None:
        self.logged = tracker.logged

    def save(self, path: str, base_path: str, policy: str) -> None:
        self.logged.append(({"save": path, "base_path": base_path, "policy": policy}, None))


class Clock:
    """``time.perf_counter`` under the test's control (the rate and the times in the row)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def logger_config(name: str = "tiny", *, progress_bar: bool = False, log_every: int = 1, grad_accum: int = 1):
    raw = tiny_config()
    raw["name"] = name
    raw["output"].update(progress_bar=progress_bar, log_every=log_every)
    raw["optimisation"]["grad_accum_steps"] = grad_accum
    return config_from_dict(raw)


def step_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, trackers: list[GeneralTracker] = (),
                progress_bar: bool = False, log_every: int = 1, total_steps: int = 8, state: TrainState | None = None,
                resumed: bool = False, grad_accum: int = 1, poly_view_bound: bool = True,
                name: str = "tiny") -> tuple[StepLogger, Clock]:
    from accelerate import Accelerator

    config = logger_config(name, progress_bar=progress_bar, log_every=log_every, grad_accum=grad_accum)
    clock = Clock(1000.0)
    monkeypatch.setattr(step_log_module.time, "perf_counter", clock)
    accelerator = Accelerator(cpu=True, log_with=list(trackers) or None)
    logger = StepLogger(accelerator, config, tmp_path, trackers=[t.name for t in trackers], total_steps=total_steps,
                        batches_per_epoch=4, poly_view_bound=poly_view_bound, state=state or TrainState(),
                        resumed=resumed, started=990.0)
    return logger, clock


class Groups:
    """An optimiser's ``param_groups`` as the trainer names them (``<modality>.<part>[_no_decay]``)."""

    def __init__(self, *groups: dict[str, Any]) -> None:
        self.param_groups = list(groups)


OPTIMIZER = Groups({"name": "text.backbone", "lr": 1e-4}, {"name": "text.backbone_no_decay", "lr": 5e-5},
                   {"name": "image.head", "lr": 2e-3}, {"lr": 7e-3})


def output(loss: float, **metrics: float) -> ObjectiveOutput:
    return ObjectiveOutput(torch.tensor(loss), {k: torch.tensor(v) for k, v in metrics.items()})


@pytest.fixture
def accelerate_state():
    with own_accelerate_state():
        yield


def test_a_logged_row_holds_the_step_its_values_and_the_rates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              accelerate_state, capsys) -> None:
    logger, clock = step_logger(tmp_path, monkeypatch, grad_accum=2)
    clock.now = 1002.0  # 2 s after the logger started, 12 s after the run did
    state = TrainState(epoch=1, batch_in_epoch=3, step=1)
    logger.log(state, output(2.5, pos_sim=0.75, a_first=0.5), {"ipmc": 0.25}, OPTIMIZER, num_samples=8, num_views=3)
    (row,) = read_training_log(tmp_path / "metrics.csv")
    # columns: step, epoch, loss, the metrics in name order, the bound, one lr per part, the rates
    assert list(row) == ["step", "epoch", "loss", "a_first", "ipmc", "pos_sim", "mi_lower_bound", "lr_backbone",
                         "lr_head", "lr_group", "samples_per_s", "time_s"]
    assert float(row["epoch"]) == 1.75 and float(row["loss"]) == 2.5 and row["step"] == "1"
    assert (float(row["a_first"]), float(row["ipmc"]), float(row["pos_sim"])) == (0.5, 0.25, 0.75)
    assert float(row["mi_lower_bound"]) == pytest.approx(math.log(8 * 3 - 3 + 1) - 2.5, rel=1e-5)
    # the first group of a part gives its lr (the no-decay copy of the backbone does not)
    assert (float(row["lr_backbone"]), float(row["lr_head"]), float(row["lr_group"])) == (1e-4, 2e-3, 7e-3)
    assert float(row["samples_per_s"]) == 8 * 2 / 2.0 and float(row["time_s"]) == 12.0
    assert logger.last_loss == 2.5
    assert capsys.readouterr().out == "step 1/8  epoch 1.75  loss 2.5000  8 samples/s  12 s\n"


def test_the_rate_counts_from_the_previous_step_and_survives_a_zero_interval(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            accelerate_state) -> None:
    logger, clock = step_logger(tmp_path, monkeypatch, poly_view_bound=False)
    for step, now in ((1, 1004.0), (2, 1005.0), (3, 1005.0)):
        clock.now = now
        logger.log(TrainState(step=step), output(1.0), {}, OPTIMIZER, num_samples=10, num_views=2)
    rows = read_training_log(tmp_path / "metrics.csv")
    assert "mi_lower_bound" not in rows[0]  # an objective without the poly-view bound
    assert [float(r["samples_per_s"]) for r in rows] == [2.5, 10.0, 10 / 1e-9]
    assert [float(r["time_s"]) for r in rows] == [14.0, 15.0, 15.0]


def test_rows_are_logged_every_log_every_steps_and_at_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               accelerate_state, capsys) -> None:
    logger, _ = step_logger(tmp_path, monkeypatch, log_every=3, total_steps=7)
    for step in range(1, 8):
        logger.log(TrainState(step=step), output(1.0), {}, OPTIMIZER, num_samples=4, num_views=2)
    assert [r["step"] for r in read_training_log(tmp_path / "metrics.csv")] == ["3", "6", "7"]
    assert [line.split("  ")[0] for line in capsys.readouterr().out.splitlines()] == ["step 3/7", "step 6/7", "step 7/7"]


def test_a_diverging_loss_is_warned_about_once_with_the_recipes_lr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   accelerate_state, capsys) -> None:
    logger, _ = step_logger(tmp_path, monkeypatch, total_steps=6, poly_view_bound=False)
    for step in range(1, 7):
        logger.log(TrainState(step=step), output(2.0 ** step), {}, OPTIMIZER, num_samples=4, num_views=2)
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith("warning: divergence at step ")
    assert "lower optimisation.lr (now 0.003), e.g. 0.0003" in warned[0]  # the recipe's lr, not a default


def test_the_progress_bar_counts_from_the_resumed_step_and_replaces_the_lines(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            accelerate_state, capsys) -> None:
    logger, _ = step_logger(tmp_path, monkeypatch, progress_bar=True, total_steps=9, state=TrainState(step=4))
    assert (logger.bar.total, logger.bar.n, logger.bar.desc, logger.bar.disable) == (9, 4, "train", False)
    logger.log(TrainState(step=5), output(0.125), {}, OPTIMIZER, num_samples=4, num_views=2)  # logged
    logger.log(TrainState(step=6), output(0.125), {}, OPTIMIZER, num_samples=4, num_views=2)
    assert logger.bar.n == 6 and logger.bar.postfix == "loss=0.1250"
    logger.close()
    assert capsys.readouterr().out == ""  # no step lines beside a bar
    quiet, _ = step_logger(tmp_path / "quiet", monkeypatch, progress_bar=False)
    assert quiet.bar.disable and quiet.print_lines


def test_a_resumed_logger_keeps_the_rows_to_the_checkpoint_and_their_last_loss(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             accelerate_state) -> None:
    write_log(tmp_path / "metrics.csv", [(1, 0.25, 4.0), (2, 0.5, 3.0), (3, 0.75, 2.0)])
    logger, _ = step_logger(tmp_path, monkeypatch, state=TrainState(step=2), resumed=True)
    assert logger.last_loss == 3.0
    assert [r["step"] for r in read_training_log(tmp_path / "metrics.csv")] == ["1", "2"]
    fresh, _ = step_logger(tmp_path, monkeypatch, state=TrainState(step=2), resumed=False)
    assert math.isnan(fresh.last_loss) and not (tmp_path / "metrics.csv").exists()


def test_trackers_get_the_recipe_each_row_but_its_step_and_the_evaluation(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         accelerate_state) -> None:
    tracker = RecordingTracker()
    logger, clock = step_logger(tmp_path, monkeypatch, trackers=[tracker], name="my-recipe")
    assert tracker.config == flat_hparams(logger_config(name="my-recipe"))
    clock.now = 1001.0
    logger.log(TrainState(step=1), output(2.0, pos_sim=0.5), {}, OPTIMIZER, num_samples=4, num_views=2)
    ((values, step),) = tracker.logged
    assert step == 1 and "step" not in values
    (row,) = read_training_log(tmp_path / "metrics.csv")
    assert set(values) == set(row) - {"step"} and values["loss"] == 2.0 and values["pos_sim"] == 0.5
    tracker.logged.clear()
    logger.log_evaluation({"test/linear/class/acc": 1}, {"test/linear/class/acc": 0.5}, step=8)
    assert tracker.logged == [({"test/linear/class/acc": 1.0, "random_init/test/linear/class/acc": 0.5}, 8)]
    assert isinstance(tracker.logged[0][0]["test/linear/class/acc"], float)
    tracker.logged.clear()
    logger.log_evaluation({"val/knn/class/acc": 0.75}, None, step=3)
    logger.log_evaluation({}, None, step=4)  # nothing evaluated: nothing logged
    assert tracker.logged == [({"val/knn/class/acc": 0.75}, 3)]
    assert not (tmp_path / "logs" / "tracker_runs.json").exists()  # no MLflow or W&B run id to keep


def test_each_tracker_gets_the_names_it_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                accelerate_state) -> None:
    plain, strict = RecordingTracker("plain"), RecordingTracker("mlflow")
    logger, _ = step_logger(tmp_path, monkeypatch, trackers=[plain])
    logger.trackers = ["plain", "mlflow"]  # the spelling depends on the tracker's name only
    logger.accelerator.trackers.append(strict)
    logger.to_trackers({"test/retrieval/a->b/R@1": 0.5}, step=2)
    assert plain.logged == [({"test/retrieval/a->b/R@1": 0.5}, 2)]
    assert strict.logged == [({"test/retrieval/a-_b/R_at_1": 0.5}, 2)]


def test_the_report_and_the_evaluations_plots_go_to_the_trackers_that_keep_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerate_state) -> None:
    run = tmp_path / "run"
    for name in ("report.md", "results.json", "eval/plots/b.png", "eval/plots/a.png", "eval_random/c.png",
                 "eval/summary.md", "other/d.png"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    mlflow, wandb, plain = RecordingTracker("mlflow"), RecordingTracker("wandb"), RecordingTracker("plain")
    logger, _ = step_logger(run, monkeypatch, trackers=[plain])
    logger.accelerator.trackers += [mlflow, wandb]
    logger.trackers = ["plain", "mlflow"]
    logger.log_report()
    shown = ["report.md", "results.json", "eval/plots/a.png", "eval/plots/b.png", "eval_random/c.png"]
    assert [values for values, _ in mlflow.logged] == [
        {"artifact": str(run / name), "folder": None if "/" not in name else name.rsplit("/", 1)[0]} for name in shown]
    assert plain.logged == [] and wandb.logged == []
    mlflow.logged.clear()
    (run / "report.md").unlink()  # a file the run did not write is left out
    logger.trackers = ["wandb"]
    logger.log_report()
    assert [values for values, _ in wandb.logged] == [
        {"save": str(run / name), "base_path": str(run), "policy": "now"} for name in shown[1:]]
    assert mlflow.logged == []


def test_without_trackers_the_evaluation_goes_nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      accelerate_state) -> None:
    logger, _ = step_logger(tmp_path, monkeypatch)
    assert logger.trackers == []
    logger.log_evaluation({"test/x": 1.0}, None, step=1)  # would fail on a tracker Accelerate does not have
    logger.log_report()


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


# --------------------------------------------------------------------------- summary and report


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


def test_tensorboard_writes_under_the_recipes_name(tmp_path: Path, accelerate_state) -> None:
    """``<run>/logs/<recipe name>/``: the project is the recipe's name (TensorBoard, a real tracker)."""
    pytest.importorskip("tensorboard")  # the mmviews[tensorboard] extra, installed in CI
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, log_with=["tensorboard"], project_config=ProjectConfiguration(
        project_dir=str(tmp_path), logging_dir=str(tmp_path / "logs")))
    logger = StepLogger(accelerator, logger_config("my-recipe"), tmp_path, trackers=["tensorboard"], total_steps=2,
                        batches_per_epoch=2, poly_view_bound=False, state=TrainState(), resumed=False, started=0.0)
    accelerator.end_training()
    logger.close()
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["my-recipe"]
    assert list((tmp_path / "logs" / "my-recipe").rglob("events.out.tfevents.*"))
