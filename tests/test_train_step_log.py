"""The per-step log (:mod:`mmviews.train.step_log`), in this process on tiny inputs: the
``metrics.csv`` writer (a fresh run removes a stale file, a resumed one keeps the rows up to its
checkpoint, a full disk leaves no half row and names the folder and the bytes), the per-step row
(its columns, its values and rates, which steps are logged, the line printed without a progress bar
and flushed at once, the progress bar of a resumed run), and what the trackers receive (the recipe,
the run folder and the run id to reopen, each row but its step, the evaluation, the report and plots
where they keep files)."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.tracking import GeneralTracker
from test_train_utils import own_accelerate_state, tiny_config

import mmviews.train.step_log as step_log_module
from mmviews.config import config_from_dict
from mmviews.eval.summary import read_training_log
from mmviews.fileio import DiskFullError
from mmviews.notices import MMViewsWarning
from mmviews.objectives import ObjectiveOutput
from mmviews.run import read_manifest
from mmviews.train.run_folder import claim_run_dir
from mmviews.train.state import TrainState
from mmviews.train.step_log import CSVLogger, StepLogger
from mmviews.train.trackers import flat_hparams


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


def test_a_resume_keeps_a_line_break_inside_a_quoted_field(tmp_path: Path) -> None:
    """The kept rows are rewritten as the file holds them (read with ``newline=""``, as the csv
    module asks: a line break inside a quoted field stays ``\\r\\n``)."""
    path = tmp_path / "metrics.csv"
    path.write_bytes(b'step,loss,note\r\n1,2.0,"two\r\nlines"\r\n2,1.5,x\r\n')
    CSVLogger(path, resume_step=1)
    assert path.read_bytes() == b'step,loss,note\r\n1,2.0,"two\r\nlines"\r\n'


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


class FullAfter:
    """``metrics.csv``'s appends after the first ``rows_fit`` fail as on a full disk: half the
    text reaches the file, then ENOSPC (what a real device does when it fills mid-write)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rows_fit: int) -> None:
        self.rows_fit, self.appends, real_open = rows_fit, 0, Path.open

        def open_filling(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(path, mode, *args, **kwargs)
            if path.name == "metrics.csv" and "a" in mode:
                self.appends += 1
                if self.appends > self.rows_fit:
                    return HalfWriter(f)
            return f

        monkeypatch.setattr(Path, "open", open_filling)


class HalfWriter:
    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> "HalfWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()

    def write(self, text: str) -> int:
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_disk_message(folder: Path, needed: int) -> str:
    """The error's words as a pattern (the free bytes move with the machine's other writers)."""
    return (re.escape(f"{folder}: no space left while writing metrics.csv: it needs about {needed} bytes, ")
            + r"\d+ bytes are free; nothing partial was left there")


def test_a_full_disk_cuts_the_half_row_off_and_names_the_folder_and_the_bytes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.csv"
    FullAfter(monkeypatch, rows_fit=2)
    logger = CSVLogger(path)
    logger.log({"step": 1, "loss": 2.0})
    logger.log({"step": 2, "loss": 1.5})
    kept = path.read_bytes()
    assert kept == b"step,loss\r\n1,2\r\n2,1.5\r\n"  # the csv module ends its rows with \r\n
    with pytest.raises(DiskFullError) as caught:
        logger.log({"step": 3, "loss": "é" * 4})  # 2 bytes a character in UTF-8: 3,éééé\r\n is 12 bytes
    assert re.fullmatch(full_disk_message(tmp_path, 12), str(caught.value)) and caught.value.errno == errno.ENOSPC
    assert path.read_bytes() == kept  # the rows before it, whole; no part of row 3


def test_a_full_disk_at_the_first_row_leaves_an_empty_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.csv"
    FullAfter(monkeypatch, rows_fit=0)
    with pytest.raises(DiskFullError) as caught:
        CSVLogger(path).log({"step": 1, "loss": 2.0})
    assert re.fullmatch(full_disk_message(tmp_path, len("step,loss\r\n1,2\r\n")), str(caught.value))  # the header too
    # empty, not a half header: a resume finds no columns and starts the log again
    assert path.read_bytes() == b""
    assert CSVLogger(path, resume_step=0).fields is None


# --------------------------------------------------------------------------- the per-step row


class RecordingTracker(GeneralTracker):
    """An Accelerate tracker (its documented extension point) that keeps what it is given."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, name: str = "recording", run_id: str = "run-1") -> None:
        super().__init__()
        self.name = name
        self.run_id = run_id
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
        self.id = tracker.run_id  # W&B's run id (MLflow's is .info.run_id)

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


def step_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, trackers: list[GeneralTracker | str] = (),
                progress_bar: bool = False, log_every: int = 1, total_steps: int = 8, state: TrainState | None = None,
                resumed: bool = False, grad_accum: int = 1, poly_view_bound: bool = True,
                name: str = "tiny") -> tuple[StepLogger, Clock]:
    from accelerate import Accelerator

    config = logger_config(name, progress_bar=progress_bar, log_every=log_every, grad_accum=grad_accum)
    clock = Clock(1000.0)
    monkeypatch.setattr(step_log_module.time, "perf_counter", clock)
    accelerator = Accelerator(cpu=True, log_with=list(trackers) or None)
    names = [t if isinstance(t, str) else t.name for t in trackers]  # a name: Accelerate builds the tracker
    logger = StepLogger(accelerator, config, tmp_path, trackers=names, total_steps=total_steps,
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


def test_each_line_reaches_an_output_redirected_to_a_file_when_it_is_printed(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            accelerate_state) -> None:
    """Without a progress bar (logs to a file), each step's line is in the file at once, not when
    the buffer fills or the run ends (``tail -f`` follows the run)."""
    logger, clock = step_logger(tmp_path, monkeypatch)
    log_file = tmp_path / "train.log"
    with log_file.open("w") as redirected:  # block-buffered, as a redirected standard output is
        monkeypatch.setattr(sys, "stdout", redirected)
        clock.now = 1001.0
        logger.log(TrainState(step=1), output(0.5), {}, OPTIMIZER, num_samples=4, num_views=2)
        assert log_file.read_text() == "step 1/8  epoch 0.00  loss 0.5000  4 samples/s  11 s\n"


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
    with pytest.warns(MMViewsWarning) as caught:  # the command line shows it as one line on stderr
        for step in range(1, 7):
            logger.log(TrainState(step=step), output(2.0 ** step), {}, OPTIMIZER, num_samples=4, num_views=2)
    warned = [str(w.message) for w in caught if issubclass(w.category, MMViewsWarning)]
    assert len(warned) == 1 and warned[0].startswith("divergence at step ")
    assert "warning" not in capsys.readouterr().out
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


def test_the_progress_bar_follows_the_terminals_width(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      accelerate_state) -> None:
    """On a terminal (a pseudo-terminal here) resized between two steps, the bar is redrawn to
    the new width (one column less than the terminal's, tqdm's margin)."""
    import fcntl
    import pty
    import struct
    import termios

    master, follower = pty.openpty()

    def resize(columns: int) -> None:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))

    def drain() -> str:
        """Everything written so far: a pseudo-terminal passes writes to its master side
        asynchronously, so one read right after the flush can return part of them on a loaded
        machine; read until nothing more comes for a while."""
        import select

        chunks = []
        while select.select([master], [], [], 0.3)[0]:
            chunks.append(os.read(master, 1 << 16))
        return b"".join(chunks).decode()

    resize(60)
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)  # where tqdm draws
        logger, _ = step_logger(tmp_path, monkeypatch, progress_bar=True, total_steps=4)
        logger.log(TrainState(step=1), output(0.5), {}, OPTIMIZER, num_samples=4, num_views=2)
        terminal.flush()
        before = drain()
        resize(100)
        logger.log(TrainState(step=2), output(0.5), {}, OPTIMIZER, num_samples=4, num_views=2)
        terminal.flush()
        after = drain()
        logger.close()
    os.close(master)
    widths = lambda text: {len(line) for line in text.split("\r") if "train" in line}  # noqa: E731
    assert widths(before) == {59} and widths(after) == {99}, (before, after)


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


def test_wandb_is_started_in_the_runs_logs_and_a_resume_reopens_its_run(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         accelerate_state) -> None:
    """What Accelerate gives the W&B tracker it builds from the name ``wandb`` (a recording class
    in its place in Accelerate's table of trackers), and the run id kept for a resume."""
    if importlib.util.find_spec("wandb") is None:  # Accelerate builds a tracker by name only when installed
        pytest.skip("wandb is not installed (the mmviews[wandb] extra, installed in CI)")
    import accelerate.tracking

    built: list[RecordingTracker] = []

    class BuiltByName(RecordingTracker):
        requires_logging_directory = False

        def __init__(self, run_name: str, **init_kwargs: Any) -> None:
            super().__init__("wandb", run_id=f"w{len(built) + 1}")
            self.run_name, self.init_kwargs = run_name, init_kwargs
            built.append(self)

    monkeypatch.setitem(accelerate.tracking.LOGGER_TYPE_TO_CLASS, "wandb", BuiltByName)
    runs_file = tmp_path / "logs" / "tracker_runs.json"
    step_logger(tmp_path, monkeypatch, trackers=["wandb"], name="my-recipe")
    assert (built[0].run_name, built[0].init_kwargs) == ("my-recipe", {"dir": str(tmp_path / "logs")})
    assert built[0].config == flat_hparams(logger_config(name="my-recipe"))
    assert json.loads(runs_file.read_text()) == {"wandb": "w1"}
    # resumed: the same W&B run again (W&B gives it its id back)
    step_logger(tmp_path, monkeypatch, trackers=["wandb"], state=TrainState(step=2), resumed=True)
    assert built[1].init_kwargs == {"dir": str(tmp_path / "logs"), "id": "w1", "resume": "allow"}
    assert json.loads(runs_file.read_text()) == {"wandb": "w2"}


def test_each_tracker_gets_the_names_it_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                accelerate_state) -> None:
    plain, strict = RecordingTracker("plain"), RecordingTracker("mlflow")
    logger, _ = step_logger(tmp_path, monkeypatch, trackers=[plain])
    logger.trackers = ["plain", "mlflow"]  # the spelling depends on the tracker's name only
    logger.accelerator.trackers.append(strict)
    logger.to_trackers({"test/retrieval/a->b/R@1": 0.5}, step=2)
    assert plain.logged == [({"test/retrieval/a->b/R@1": 0.5}, 2)]
    assert strict.logged == [({"test/retrieval/a_to_b/R_at_1": 0.5}, 2)]


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
