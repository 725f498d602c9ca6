"""The ``mmviews`` command line.

Every sub-command is a module exposing ``add_arguments(parser) -> None`` and ``run(args) -> int``:
``train``, ``eval``, ``embed``, ``export`` and ``list`` live in this package; ``compare``,
``bench``, ``prepare`` and ``demo`` in the module that owns their feature. Only the module of the
command being run is imported, so ``mmviews --help`` stays fast. ``python -m mmviews.cli`` (what
``accelerate launch -m mmviews.cli`` runs) goes through :mod:`mmviews.cli.__main__`.

:func:`main` is the one place that turns an error into a message: a user error (``ValueError``
and its subclasses, ``KeyError``, ``OSError``, a refused pickle: a bad recipe, file, folder,
dataset, split or option) is one line naming what is at fault, exit status 2; any other exception
is a bug and keeps its traceback (``--debug`` shows every traceback and warning). Warnings, the
health checks' verdicts included, are one line each on stderr, ``mmviews COMMAND: warning: ...``;
W&B's own lines (``WANDB_SILENT``), MLflow's INFO lines on creating its store and torch's C++
warnings are off unless ``--debug``.
After a collective failed because another process hung or died, and after a stop on SIGINT or
SIGTERM (when a peer may be gone too), the command's own process ends without the interpreter's
teardown (:func:`leave_without_teardown`); called from a program of yours (``main([...])``), it
returns the status instead.
Which errors and warnings print how: ``docs/cli.md`` ("Errors and warnings").
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import pickle
import re
import sys
import traceback
from typing import Iterator, NoReturn, Sequence

from mmviews.notices import one_line_warnings
from mmviews.registry import did_you_mean

# Errors the user can fix (exit status 2). ConfigError and CorruptFileError are ValueErrors;
# UnsafePickleError is a pickle.UnpicklingError.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, KeyError, OSError, pickle.UnpicklingError)
# A run that diverged (non-finite loss, named with its step): reported, exit status 1.
RUN_FAILURES: tuple[type[BaseException], ...] = (FloatingPointError,)

__all__ = ["COMMANDS", "command_parser", "error_message", "leave_without_teardown", "main", "same_on_every_process",
           "worker_error"]

# command -> (module, one-line help). Sub-commands with their own sub-verbs (bench) are
# dispatched by their module.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mmviews.cli.train", "train an encoder from a YAML recipe (with --set overrides, --resume)"),
    "eval": ("mmviews.cli.eval", "evaluate a run or checkpoint and write its report"),
    "compare": ("mmviews.eval.compare", "put several runs side by side in one table and one set of plots"),
    "bench": ("mmviews.bench.cli", "benchmark objectives, adapters or data loading"),
    "embed": ("mmviews.cli.embed", "write the embeddings of every view of every sample to a Parquet file"),
    "export": ("mmviews.cli.export", "export a trained encoder as a Hugging Face Hub-ready folder or as ONNX graphs"),
    "prepare": ("mmviews.cli.prepare", "validate a dataset copy against its card and convert it to the fast store"),
    "list": ("mmviews.cli.list", "list objectives, recipes or datasets"),
    "demo": ("mmviews.demo", "train a toy encoder with a poly-view loss on synthetic views"),
}
# (Importing the submodules mmviews.cli.list and mmviews.cli.eval binds the names ``list`` and
# ``eval`` in this module's namespace, shadowing the builtins: code here must not call them.)


class CommandParser(argparse.ArgumentParser):
    """argparse's parser whose refusal of a value outside an argument's choices (a sub-verb, a
    ``--format``) names the closest choice, as the unknown-command error does."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        # argparse's own hook for the choices check: its message lists them without a suggestion
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(str(value), map(str, action.choices))}; "
                        f"choose from {choices}")


def _top_level_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mmviews",
        description="Multimodal, multi-view representation learning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items())
        + "\n\nRun 'mmviews COMMAND --help' for the options of one command.",
    )
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``mmviews`` command. With ``argv`` None (the ``mmviews`` program, ``python -m
    mmviews.cli``) the process is the command's own: process-wide settings such as
    ``host_memory: auto`` apply (``args.owns_process``); a call with an argument list, from a
    program of yours, leaves them to you."""
    owns_process = argv is None
    argv = [*(sys.argv[1:] if argv is None else argv)]
    top = _top_level_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] == "--version":
        from mmviews import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}{did_you_mean(name, COMMANDS)}; choose from {', '.join(sorted(COMMANDS))}")
    # datasets' own bars ("Generating train split", "Saving the dataset") describe its internal
    # steps, not the user's work: off unless the user asks for them (read when datasets is
    # imported, and inherited by loader workers). mmviews's own progress bars stay.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "--debug" not in argv:
        # torch's C++ warnings bypass Python's warnings filters (e.g. DDP's note, once per process,
        # that find_unused_parameters, mmviews's default for views that may be absent, found
        # none unused). Read when torch is imported, which happens below: errors still print.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # W&B's own lines (its version, where it syncs, the sync hint) describe its machinery: the
        # run folder's logs/ and the tracker's own files say where the run went
        os.environ.setdefault("WANDB_SILENT", "true")
    else:  # MLflow's INFO lines on its store (mmviews.train.trackers.quiet_mlflow_store_logs) shown
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO")
    module, parser = command_parser(name)
    args = parser.parse_args(argv[1:])
    args.owns_process = owns_process
    try:
        with contextlib.nullcontext() if args.debug else one_line_warnings(f"mmviews {name}"):
            return int(module.run(args) or 0)
    except KeyboardInterrupt as stopped:
        # SIGINT or SIGTERM (mmviews train's stop after a step, a second signal, one outside its loop:
        # the command said what happened itself, with the status 128 + signal)
        said = bool(getattr(stopped, SAID, False))
        if args.debug and not said:
            raise
        if not said:
            print(f"mmviews {name}: interrupted", file=sys.stderr)
        status = int(getattr(stopped, "exit_status", 130))  # 130: the shell's status for a process stopped by SIGINT
        if owns_process:  # a peer may be gone or stopped with operations to it in flight: as after a collective failure
            leave_without_teardown(status)
        return status
    except Exception as caught:
        # An error raised in a DataLoader worker reaches here rebuilt by torch around the
        # worker's whole traceback (or as a RuntimeError when its type cannot be rebuilt): it is
        # judged, and printed, as the worker's own error.
        error = worker_error(caught)
        peer_failed = owns_process and _collective_failed(error)
        if args.debug or not isinstance(error, USER_ERRORS + RUN_FAILURES):
            if not peer_failed:
                raise
            traceback.print_exception(caught)  # what Python prints for an uncaught error, then its status
            leave_without_teardown(1)
        if not (_same_on_every_process(error) and os.environ.get("RANK", "0") != "0"):
            print(f"mmviews {name}: error: {error_message(error)}", file=sys.stderr)
        status = 1 if isinstance(error, RUN_FAILURES) else 2
        if peer_failed:
            leave_without_teardown(status)
        return status


#: Set on a ``KeyboardInterrupt`` whose command has printed its own line about it (:func:`main` then adds none).
SAID = "mmviews_said"


def _collective_failed(error: BaseException) -> bool:
    """A collective failed because a peer hung or died (:class:`mmviews.train.distributed.CollectiveFailure`;
    looked up without importing torch: only a process that imported it can have raised one)."""
    distributed = sys.modules.get("mmviews.train.distributed")
    return distributed is not None and isinstance(error, distributed.CollectiveFailure)


def leave_without_teardown(status: int) -> NoReturn:
    """End this process with ``status`` after its exit handlers (trackers, log files, loader
    workers) but without the interpreter's teardown.

    After a peer hung or died, the process group's worker threads may still hold operations to
    it: gloo cannot cancel them, each ends only at its timeout, and the first to end after the
    interpreter has begun its teardown releases its tensors there, which needs the interpreter:
    the thread is stopped inside C++ code and the process aborts (SIGABRT, "terminate called
    without an active exception") instead of exiting with its status. Waiting for them could
    take ``distributed.timeout_s`` again per operation queued."""
    atexit._run_exitfuncs()  # what a normal exit runs first, while the interpreter is whole
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to say there
            stream.flush()
    os._exit(status)


def _same_on_every_process(error: BaseException) -> bool:
    """An error every process of a launch raises alike (marked by :func:`same_on_every_process`,
    e.g. a recipe that cannot be loaded): only the first process prints it."""
    return bool(getattr(error, SAME_ON_EVERY_PROCESS, False))


SAME_ON_EVERY_PROCESS = "mmviews_same_on_every_process"


@contextlib.contextmanager
def same_on_every_process() -> Iterator[None]:
    """Mark the user error raised inside (reading the recipe, the options) as one that every
    process of a launch raises alike, so that :func:`main` prints it once, not once per process."""
    try:
        yield
    except USER_ERRORS as error:
        setattr(error, SAME_ON_EVERY_PROCESS, True)
        raise


def command_parser(name: str) -> tuple[object, argparse.ArgumentParser]:
    """``(module, parser)`` of the command ``name`` (imports only that command's module)."""
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = CommandParser(prog=f"mmviews {name}", description=help_text)
    module.add_arguments(parser)  # type: ignore[attr-defined]
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return module, parser


# torch's message for an error re-raised from a DataLoader worker (torch.utils.data._utils.ExceptionWrapper)
_WORKER_ERROR = re.compile(r"\ACaught (\w+) in DataLoader worker process \d+\.\nOriginal Traceback[^\n]*\n(.*)\Z", re.S)


def worker_error(error: BaseException) -> BaseException:
    """The error a DataLoader worker raised, rebuilt with the worker's own type and one-line
    message, when ``error`` is torch's re-raise of it (``Caught X in DataLoader worker process
    N`` followed by the worker's traceback); else ``error`` itself. When torch could not rebuild
    the type (it then raises a RuntimeError), the worker's type is looked up among the modules
    already imported (never imported); a type that cannot be built from one message (PyAV's
    errors take a code) becomes its closest user-error base class, its name in the message.
    The notes of ``error`` are kept."""
    match = _WORKER_ERROR.match(str(error.args[0]) if error.args else "")
    if match is None:
        return error
    type_name, traceback_text = match.groups()
    # The exception's own lines follow the last frame of the traceback: its '  File ...' line
    # and that frame's source lines (indented further).
    lines = traceback_text.rstrip("\n").split("\n")
    start = max((i for i, line in enumerate(lines) if line.startswith('  File "')), default=-1) + 1
    while 0 < start < len(lines) and lines[start].startswith("    "):
        start += 1
    qualified, _, message = "\n".join(lines[start:]).strip().partition(": ")
    cls: type = type(error)
    if cls.__name__ != type_name:
        module_name, _, attr = qualified.rpartition(".")
        found = getattr(sys.modules.get(module_name or "builtins"), attr, None)
        if not (isinstance(found, type) and issubclass(found, BaseException)):
            return error
        cls = found
    unwrapped = _rebuild(cls, message)
    if unwrapped is None:
        return error
    for note in getattr(error, "__notes__", []):
        unwrapped.add_note(note)
    return unwrapped


def _rebuild(cls: type, message: str) -> BaseException | None:
    try:
        return cls(message)
    except Exception:  # e.g. av.error.FFmpegError(code, message)
        for base in USER_ERRORS + RUN_FAILURES:
            if issubclass(cls, base):
                return base(f"{cls.__name__}: {message}")
        return None


def error_message(error: BaseException) -> str:
    """The error as one line: its message (a KeyError's without the quotes ``str`` adds) and
    its notes (``add_note``), whitespace runs and line breaks folded into single spaces."""
    text = error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else str(error)
    text = "; ".join(t for t in [str(text), *getattr(error, "__notes__", [])] if t)
    text = " ".join(str(text).split())
    return text or type(error).__name__
