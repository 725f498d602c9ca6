"""What :func:`mmviews.cli.main` does around a command, in this process: the top-level help and
version, each command's own help and ``--debug``, the environment it sets before the command,
how an error, a divergence, a bug, a stop (Ctrl-C, SIGTERM) and a collective failure end the
command (the line, the exit status, which process leaves without the interpreter's teardown),
the error a DataLoader worker raised told as the worker's own one line
(:func:`mmviews.cli.worker_error`), and the one-line message of an error
(:func:`mmviews.cli.error_message`).

The commands are small modules of this file registered under a name of their own (the real
commands' handling is the same code); the end-to-end checks with real processes are
``test_cli_signal_exit.py``, ``test_cli_collective_failure.py`` and ``test_break_audit.py``."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import types
import warnings
from pathlib import Path

import pytest
from torch._utils import ExceptionWrapper

import mmviews
import mmviews.cli as cli
from mmviews.cli import COMMANDS, error_message, worker_error
from mmviews.notices import MMViewsWarning
from mmviews.train.distributed import CollectiveFailure
from mmviews.train.interrupt import TrainingInterrupted

HELP = "a command of this test"
# what main sets in the environment before the command (a user's own value wins)
QUIETING = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "TORCH_CPP_LOG_LEVEL", "WANDB_SILENT", "MLFLOW_LOGGING_LEVEL")


class Left(BaseException):
    """Raised by the stand-in for :func:`mmviews.cli.leave_without_teardown` (which never returns)."""


@pytest.fixture
def left(monkeypatch):
    """The process leaving without its teardown becomes ``Left(status)``: the test goes on."""

    def leave(status):
        raise Left(status)

    monkeypatch.setattr(cli, "leave_without_teardown", leave)


@pytest.fixture
def environment():
    """The variables main sets, unset for the test and restored after it."""
    saved = {name: os.environ.pop(name) for name in QUIETING if name in os.environ}
    yield
    for name in QUIETING:
        os.environ.pop(name, None)
    os.environ.update(saved)


def command(monkeypatch, run, name="fake"):
    """Register a command ``name`` whose ``run`` is the given one; it takes ``--level N``."""

    def add_arguments(parser):
        parser.add_argument("--level", type=int, default=0)

    module = types.ModuleType(f"{name}_test_command")
    module.add_arguments, module.run = add_arguments, run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(COMMANDS, name, (module.__name__, HELP))


def raising(error):
    def run(args):
        raise error

    return run


def as_own_process(monkeypatch, *argv):
    """``main()`` as the ``mmviews`` program calls it: the arguments from ``sys.argv``."""
    monkeypatch.setattr(sys, "argv", ["mmviews", *argv])
    return cli.main()


# --------------------------------------------------------------------------- help and version


def test_top_level_help_shows_usage_description_every_command_and_where_to_look_next(capsys):
    for argv in ([], ["-h"], ["--help"]):
        assert cli.main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "usage: mmviews [-h] [--version] [COMMAND]"
        assert "Multimodal, multi-view representation learning." in lines
        assert any(line.split() == ["--version", "print", "the", "version", "and", "exit"] for line in lines)
        # the command list as written: one line per command, its name then its help
        listed = lines[lines.index("commands:") + 1:]
        assert [line.split()[0] for line in listed[:len(COMMANDS)]] == list(COMMANDS)
        for line, (name, (_, help_text)) in zip(listed, COMMANDS.items()):
            assert line.split() == [name, *help_text.split()], line
        assert listed[len(COMMANDS):] == ["", "Run 'mmviews COMMAND --help' for the options of one command."]


def test_version_is_the_packages(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"{mmviews.__version__}\n"


def test_an_unknown_command_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["zzzz"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mmviews [-h] [--version] [COMMAND]\n")
    assert err.splitlines()[-1] == f"mmviews: error: unknown command 'zzzz'; choose from {', '.join(sorted(COMMANDS))}"


def test_a_commands_help_names_it_and_offers_debug(monkeypatch, capsys):
    command(monkeypatch, raising(AssertionError("not run")))
    with pytest.raises(SystemExit) as shown:
        cli.main(["fake", "--help"])
    assert shown.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: mmviews fake [-h] [--level LEVEL] [--debug]"
    assert HELP in lines
    assert any(line.split() == ["--debug", "show", "the", "full", "traceback", "of", "an", "error"] for line in lines)


# --------------------------------------------------------------------------- the command's run


def test_the_command_gets_its_options_and_its_status_is_mains(monkeypatch, capsys):
    seen = []

    def run(args):
        seen.append((args.level, args.debug, args.owns_process))
        return args.level or None

    command(monkeypatch, run)
    assert cli.main(["fake", "--level", "3"]) == 3
    assert cli.main(["fake", "--debug"]) == 0  # None from run: success
    assert as_own_process(monkeypatch, "fake", "--level", "4") == 4
    # process-wide settings are the command's only when it runs as the program
    assert seen == [(3, False, False), (0, True, False), (4, False, True)]
    assert capsys.readouterr().err == ""


def test_third_party_chatter_is_off_unless_debug_and_a_users_setting_wins(monkeypatch, environment):
    seen = []
    command(monkeypatch, lambda args: seen.append({name: os.environ.get(name) for name in QUIETING}))
    assert cli.main(["fake"]) == 0
    assert seen.pop() == {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
                          "WANDB_SILENT": "true", "MLFLOW_LOGGING_LEVEL": None}
    for name in QUIETING:
        os.environ.pop(name, None)
    assert cli.main(["fake", "--debug"]) == 0  # torch's and W&B's own lines shown, MLflow's INFO lines too
    assert seen.pop() == {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TORCH_CPP_LOG_LEVEL": None,
                          "WANDB_SILENT": None, "MLFLOW_LOGGING_LEVEL": "INFO"}
    # the documented ways to bring them back
    for name in QUIETING:
        os.environ.pop(name, None)
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "0")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("WANDB_SILENT", "false")
    assert cli.main(["fake"]) == 0
    assert seen.pop() == {"HF_DATASETS_DISABLE_PROGRESS_BARS": "0", "TORCH_CPP_LOG_LEVEL": "WARNING",
                          "WANDB_SILENT": "false", "MLFLOW_LOGGING_LEVEL": None}


def test_mmviews_warnings_are_one_line_unless_debug(monkeypatch, capsys):
    def run(args):
        warnings.warn("image 7 of /data/a.parquet is damaged: marked absent", MMViewsWarning, stacklevel=1)

    command(monkeypatch, run)
    # shown as Python shows a warning (pytest's recorder would keep it from stderr)
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main(["fake"]) == 0
        assert capsys.readouterr().err == "mmviews fake: warning: image 7 of /data/a.parquet is damaged: marked absent\n"
        assert cli.main(["fake", "--debug"]) == 0
        err = capsys.readouterr().err
    assert "MMViewsWarning: image 7 of /data/a.parquet is damaged: marked absent" in err
    assert "mmviews fake: warning:" not in err


# --------------------------------------------------------------------------- errors


def test_a_user_error_is_one_line_with_status_2(monkeypatch, capsys, left):
    command(monkeypatch, raising(ValueError("recipe r.yaml: optimisation.lr must be > 0, got -1")))
    line = "mmviews fake: error: recipe r.yaml: optimisation.lr must be > 0, got -1\n"
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == line
    import mmviews.train.distributed  # noqa: F401  (a run's process has it: only a real collective failure leaves)

    assert as_own_process(monkeypatch, "fake") == 2  # returned, not left without the teardown
    assert capsys.readouterr().err == line
    with pytest.raises(ValueError, match="must be > 0"):  # --debug: the traceback
        cli.main(["fake", "--debug"])


def test_a_divergence_is_one_line_with_status_1(monkeypatch, capsys):
    command(monkeypatch, raising(FloatingPointError("non-finite loss (nan) at step 12")))
    assert cli.main(["fake"]) == 1
    assert capsys.readouterr().err == "mmviews fake: error: non-finite loss (nan) at step 12\n"


def test_a_bug_keeps_its_traceback(monkeypatch, capsys, left):
    command(monkeypatch, raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fake"])
    with pytest.raises(RuntimeError, match="a bug"):  # the program's own process too: no collective failed
        as_own_process(monkeypatch, "fake")
    assert capsys.readouterr().err == ""


def test_a_collective_failure_leaves_the_commands_own_process_with_its_status(monkeypatch, capsys, left):
    line = ("process 0 of 2 stopped after step 2: it waited more than distributed.timeout_s = 1 s for the other "
            "processes in a collective; no checkpoint yet")
    command(monkeypatch, raising(CollectiveFailure(line)))
    assert cli.main(["fake"]) == 2  # a program of yours goes on
    assert capsys.readouterr().err == f"mmviews fake: error: {line}\n"
    with pytest.raises(Left) as leaving:
        as_own_process(monkeypatch, "fake")
    assert leaving.value.args == (2,)
    assert capsys.readouterr().err == f"mmviews fake: error: {line}\n"
    # --debug: Python's traceback, then the status of an uncaught error, still without the teardown
    with pytest.raises(Left) as leaving:
        as_own_process(monkeypatch, "fake", "--debug")
    assert leaving.value.args == (1,)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and f"CollectiveFailure: {line}" in err
    with pytest.raises(CollectiveFailure):  # called from a program: raised as any error under --debug
        cli.main(["fake", "--debug"])


@pytest.mark.parametrize("rank, marked, printed", [
    (None, True, True), ("0", True, True), ("1", True, False), ("1", False, True), ("3", False, True),
])
def test_an_error_every_process_raises_alike_is_printed_by_the_first_only(monkeypatch, capsys, rank, marked, printed):
    def run(args):
        if marked:
            with cli.same_on_every_process():
                raise ValueError("no such recipe 'r.yaml'")
        raise ValueError("no such recipe 'r.yaml'")

    command(monkeypatch, run)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert cli.main(["fake"]) == 2  # every process fails
    assert capsys.readouterr().err == ("mmviews fake: error: no such recipe 'r.yaml'\n" if printed else "")


def test_an_error_raised_in_a_loader_worker_is_the_workers_own_line(monkeypatch, capsys):
    command(monkeypatch, raising(reraised(ValueError("cannot decode /data/Run/v_bad.avi"))))
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == "mmviews fake: error: cannot decode /data/Run/v_bad.avi\n"


# --------------------------------------------------------------------------- stops


def test_a_stop_says_interrupted_once_with_its_status(monkeypatch, capsys, left):
    command(monkeypatch, raising(KeyboardInterrupt()))
    try:
        status = cli.main(["fake"])
    except KeyboardInterrupt:  # caught here: left to pytest it would end the session as a Ctrl-C
        pytest.fail("without --debug the stop is the command's status, not a KeyboardInterrupt")
    assert status == 130
    assert capsys.readouterr().err == "mmviews fake: interrupted\n"
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback
        cli.main(["fake", "--debug"])
    with pytest.raises(Left) as leaving:  # the program's own process: a peer may be gone, no teardown
        as_own_process(monkeypatch, "fake")
    assert leaving.value.args == (130,)
    assert capsys.readouterr().err == "mmviews fake: interrupted\n"


def test_a_stop_the_command_told_of_adds_nothing_and_keeps_its_status(monkeypatch, capsys, left):
    stopped = TrainingInterrupted(signal.SIGTERM, step=3, checkpoint=Path("run/checkpoints/checkpoint-00000003"))
    setattr(stopped, cli.SAID, True)
    command(monkeypatch, raising(stopped))
    for argv in (["fake"], ["fake", "--debug"]):  # it said what happened: no traceback either
        assert cli.main(argv) == 143
    with pytest.raises(Left) as leaving:
        as_own_process(monkeypatch, "fake")
    assert leaving.value.args == (143,)
    assert capsys.readouterr().err == ""


def test_leaving_without_teardown_runs_the_exit_handlers_flushes_both_streams_and_exits(monkeypatch):
    events = []

    class Stream:
        def __init__(self, name, broken):
            self.name, self.broken = name, broken

        def flush(self):
            events.append(f"{self.name} flushed")
            if self.broken:  # stdout into a pipe whose reader is gone (`mmviews train ... | head`)
                raise BrokenPipeError(32, "Broken pipe")

    class Exited(BaseException):
        pass

    def exit_now(status):
        events.append(("exit", status))
        raise Exited

    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: events.append("exit handlers"))
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(sys, "stdout", Stream("stdout", broken=True))
    monkeypatch.setattr(sys, "stderr", Stream("stderr", broken=False))
    with pytest.raises(Exited):
        cli.leave_without_teardown(143)
    assert events == ["exit handlers", "stdout flushed", "stderr flushed", ("exit", 143)]


# --------------------------------------------------------------------------- a DataLoader worker's error

# an error type of a module the worker imported, in a package as PyAV's are (av.error.InvalidDataError),
# built from (code, message, filename) as PyAV's are, which torch cannot rebuild from its one message
DECODER = types.ModuleType("clip_decoder.errors")
exec(
    "class DecodeError(OSError):\n"
    "    def __init__(self, code, path):\n"
    "        super().__init__(code, 'cannot decode', path)\n"
    "class DecoderBug(Exception):\n"
    "    def __init__(self, code, path):\n"
    "        super().__init__(code, path)\n"
    "def decode(error):\n"
    "    raise error\n",
    DECODER.__dict__,
)


def read_clip(error):
    raise error


def reraised(error, raise_in=read_clip, worker=0):
    """What the main process gets when a DataLoader worker raised ``error`` in ``raise_in``:
    torch's re-raise of it (the worker wraps it in an ``ExceptionWrapper``, the loader re-raises it)."""
    try:
        raise_in(error)
    except BaseException:
        wrapped = ExceptionWrapper(where=f"in DataLoader worker process {worker}")
    try:
        wrapped.reraise()
    except Exception as caught:
        return caught
    raise AssertionError("not re-raised")


@pytest.mark.parametrize("message", [
    "cannot decode /data/Run/v_bad.avi",
    "clip 3 of /data/videos/v_X",  # ends with the letter a slip could strip
    "no such file: /data/a b.parquet (a row group is damaged: 2 of 5)",
])
def test_a_workers_error_is_its_own_type_and_message(message):
    caught = reraised(ValueError(message), worker=3)
    assert str(caught).startswith("Caught ValueError in DataLoader worker process 3.\nOriginal Traceback")
    error = worker_error(caught)
    assert type(error) is ValueError and error_message(error) == message


def test_a_worker_error_raised_where_the_traceback_has_one_frame(monkeypatch):
    try:
        raise ValueError("/data/a.parquet: no 'class' column")
    except ValueError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(ValueError) as caught:
        wrapped.reraise()
    text = str(caught.value).split("\n")
    assert text[2].startswith('  File "') and not text[3].startswith('  File "')  # one frame
    assert text[3].strip().startswith("raise ValueError(")  # its source line, which holds ': ' too
    assert error_message(worker_error(caught.value)) == "/data/a.parquet: no 'class' column"


def test_a_workers_message_over_several_lines_is_one_line():
    caught = reraised(ValueError("cannot decode /data/Run/v_bad.avi\n  (truncated: 3 of 40 packets)"))
    assert error_message(worker_error(caught)) == "cannot decode /data/Run/v_bad.avi (truncated: 3 of 40 packets)"


def test_a_worker_error_of_a_class_defined_inside_a_function_keeps_its_type():
    """Its qualified name (``...<locals>.BadClip``) names no module attribute; torch rebuilt it
    (one message), so the type is the re-raised error's own."""

    class BadClip(ValueError):
        pass

    caught = reraised(BadClip("/data/Run/v_bad.avi: 0 frames"))
    assert type(caught) is BadClip
    error = worker_error(caught)
    assert type(error) is BadClip and error_message(error) == "/data/Run/v_bad.avi: 0 frames"


def test_a_worker_error_raised_in_code_without_source_lines():
    """A frame with no source line (code built at run time, a module without its .py): the
    error's line follows the frame's line at once."""
    caught = reraised(ValueError("cannot decode /data/Run/v_bad.avi"), raise_in=DECODER.decode)
    frames = [line for line in str(caught).split("\n") if line.startswith('  File "')]
    assert frames[-1].startswith('  File "<string>"')
    assert error_message(worker_error(caught)) == "cannot decode /data/Run/v_bad.avi"


def test_a_worker_error_torch_cannot_rebuild_becomes_its_user_error_base(monkeypatch):
    monkeypatch.setitem(sys.modules, "clip_decoder.errors", DECODER)
    caught = reraised(DECODER.DecodeError(5, "/data/Run/v_bad.avi"))
    assert type(caught) is RuntimeError  # torch could not build a DecodeError from one message
    caught.add_note("the latest checkpoint is kept: runs/r/checkpoints/checkpoint-00000004")
    error = worker_error(caught)
    assert type(error) is OSError  # a user error: one line, status 2
    assert error_message(error) == ("DecodeError: [Errno 5] cannot decode: '/data/Run/v_bad.avi'; "
                                    "the latest checkpoint is kept: runs/r/checkpoints/checkpoint-00000004")


def test_a_workers_builtin_error_torch_cannot_rebuild_becomes_its_user_error_base():
    """A text file read with the wrong encoding: UnicodeDecodeError takes five arguments, so torch
    re-raises a RuntimeError; the worker's error is a ValueError naming its type (status 2)."""
    caught = reraised(ValueError("unused"), raise_in=lambda error: b"\xff labels".decode("utf-8"))
    assert type(caught) is RuntimeError
    error = worker_error(caught)
    assert type(error) is ValueError
    assert error_message(error) == ("UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: "
                                    "invalid start byte")


def test_a_worker_error_that_is_no_user_error_or_of_a_module_not_imported_is_left_as_it_is(monkeypatch):
    monkeypatch.setitem(sys.modules, "clip_decoder.errors", DECODER)
    bug = reraised(DECODER.DecoderBug(5, "/data/Run/v_bad.avi"))
    assert worker_error(bug) is bug  # a bug: torch's error, traceback and all
    caught = reraised(DECODER.DecodeError(5, "/data/Run/v_bad.avi"))
    monkeypatch.delitem(sys.modules, "clip_decoder.errors")  # imported by the worker only: never imported here
    assert worker_error(caught) is caught


def test_an_error_of_no_worker_is_itself():
    for error in (ValueError("not from a worker"), RuntimeError(), OSError(2, "No such file or directory"),
                  RuntimeError("Caught ValueError somewhere else.\nOriginal Traceback (most recent call last):\n")):
        assert worker_error(error) is error


def test_a_re_raise_whose_traceback_lists_no_frame_still_gives_the_errors_line():
    """Text in torch's shape without a frame line (e.g. written by a library that re-raises as
    torch does): the whole remainder is the error's line."""
    text = "Caught ValueError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
    error = worker_error(ValueError(text + "ValueError: cannot decode /data/Run/v_bad.avi\n"))
    assert type(error) is ValueError and error_message(error) == "cannot decode /data/Run/v_bad.avi"
    indented = worker_error(ValueError(text + "    ValueError: cannot decode /data/Run/v_bad.avi"))
    assert error_message(indented) == "cannot decode /data/Run/v_bad.avi"
    lines = worker_error(ValueError(text + "ValueError: cannot decode /data/Run/v_bad.avi\n  (truncated)\n"))
    assert error_message(lines) == "cannot decode /data/Run/v_bad.avi (truncated)"


# --------------------------------------------------------------------------- the one line


class _Custom(ValueError):
    def __str__(self) -> str:
        return f"dataset card {self.args[0]}: its own words"


def test_error_message_is_one_line_of_the_message_and_its_notes():
    assert error_message(KeyError("text")) == "text"  # not "'text'"
    assert error_message(KeyError("text", "audio")) == "('text', 'audio')"
    assert error_message(_Custom("mosi.yaml")) == "dataset card mosi.yaml: its own words"
    assert error_message(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"
    noted = ValueError("bad   recipe\n  key: lr")
    noted.add_note("see docs/recipes.md")
    noted.add_note("")
    assert error_message(noted) == "bad recipe key: lr; see docs/recipes.md"
    assert error_message(ValueError()) == "ValueError"
    assert error_message(KeyError("")) == "KeyError"
