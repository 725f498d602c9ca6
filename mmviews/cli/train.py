"""``mmviews train RECIPE [--set KEY=VALUE ...] [--output DIR] [--resume DIR] [--check]``.

RECIPE is a YAML path or a bare recipe name (``quickstart``) looked up in ``recipes/``.
``--resume DIR`` continues the run in DIR (its latest complete checkpoint, or DIR itself
if it is a checkpoint folder) with the run's saved ``config.yaml``; ``--set`` may still
change it (e.g. more epochs). Several GPUs or nodes::

    accelerate launch -m mmviews.cli train quickstart
    accelerate launch --multi_gpu --num_processes 2 -m mmviews.cli train quickstart --set cpu=true   # CPU, gloo

``data.batch_size`` is the global batch (split between processes), so a recipe gives the
same negatives and the same results on any number of processes.

The run folder (``--output``, else ``output.dir``, else ``runs/<name>``) must be new or empty
(``--check`` checks everything else first, then notes what training there needs);
an existing mmviews run is replaced only with ``--overwrite``, which removes only what that
run wrote (its manifest, see :mod:`mmviews.run`); a folder holding anything else is refused.
A run that stopped before its first checkpoint (interrupted early, or a setup error such as a
wrong ``input_dim``) holds nothing to keep: the same command starts it again in place, and so
does ``--resume DIR`` (with the run's ``config.yaml``).
With ``output.auto_resume: true`` the same command continues a run from its newest intact
checkpoint (:mod:`mmviews.train.resume`; every fault and what it costs: ``docs/reliability.md``).
What the command does with its folder (start, continue from checkpoint N, replace, refuse) is
decided in one place, :mod:`mmviews.train.run_folder`, which ``--check`` asks too (it prints the
decision, or refuses as the run would): a recipe named with ``--resume`` must be the run's own
outside ``output`` (``--resume DIR --set KEY=VALUE`` changes it on purpose), and one command at a
time uses a folder (a held one is refused, naming the process and host that hold it).

Ctrl-C (SIGINT) or SIGTERM finishes the current optimiser step, writes a checkpoint, prints one
line with the command that resumes the run and exits with 130 (SIGINT) or 143 (SIGTERM); a
second signal aborts at once, leaving the last complete checkpoint as it was
(:mod:`mmviews.train.interrupt`). ``--resume`` of a finished run says so and does nothing;
``--resume DIR --reevaluate`` runs its final evaluation again.
A resumed checkpoint is checked file by file and never unpickled beyond tensors and numbers;
``--resume-ignore-rng`` continues past unreadable RNG states (losing exact reproducibility).
``--allow-remote-models`` allows open_clip ``hf-hub:``/``local-dir:`` model names.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Iterator

from mmviews.cli import SAID, SAME_ON_EVERY_PROCESS, USER_ERRORS, same_on_every_process, worker_error
from mmviews.config import ConfigError, TrainConfig, load_config, name_the_override, resolve_recipe
from mmviews.data.losses import DATA_LOSSES_KEY, DataLosses, absent_modalities, excluded_lines, loss_lines, run_datasets
from mmviews.modalities.remote import allow_remote_models
from mmviews.notices import print_warning
from mmviews.eval.report import format_metric
from mmviews.run import (
    CONFIG_FILE,
    RESULTS_FILE,
    RunExistsError,
    RunFolderRefused,
    has_checkpoint_or_results,
    is_checkpoint,
    is_run_dir,
    list_checkpoints,
    read_train_state,
)
from mmviews.train import RunParts, TrainCallback, build_run, train
from mmviews.train.compiled import COMPILE_NOTE, quiet_compiler_logs
from mmviews.train.distributed import CollectiveFailure, accelerate_launch, steps_on_cpu
from mmviews.train.host_memory import HOLD_NOTE, configure_host_memory
from mmviews.train.interrupt import TrainingInterrupted
from mmviews.eval.summary import RESULTS_LOGGER, data_left_out_lines, headline_lines
from mmviews.train.trackers import check_trackers_installed
from mmviews.train.memory import estimate_memory, processes_from_environment
from mmviews.train.resume import auto_resume_lines, restart_attempt, restart_setup_lines, restarts_left
from mmviews.eval.precision import resolve_precision, slow_bf16_line
from mmviews.train.preflight import run_checks
from mmviews.train.run_folder import HINTED, REFUSE, Decision, Intent, RunFolder, resume_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="recipe YAML path or name in recipes/ (optional with --resume)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set optimisation.lr=3e-4 (repeatable; VALUE is YAML)")
    parser.add_argument("--output", "-o", default=None, help="run folder (default: output.dir, else runs/<name>)")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue the run in DIR (run folder or checkpoint folder) from its last checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the mmviews run in the output folder (removes only what that run wrote; a folder "
                        "holding anything else is never written to)")
    parser.add_argument("--check", action="store_true",
                        help="validate the recipe (config, trackers, dataset, views, objective), print the estimated "
                        "peak memory per device, and exit without training")
    parser.add_argument("--memory-budget-gb", type=_budget_gb, default=None, metavar="G",
                        help="with --check: say whether the step fits G GiB (2^30 bytes) per device, and which "
                        "optimisation.encode_chunk_size would")
    parser.add_argument("--reevaluate", action="store_true",
                        help="with --resume of a finished run: run its final evaluation again (without it, resuming a "
                        "finished run does nothing)")
    parser.add_argument("--resume-ignore-rng", action="store_true",
                        help="with --resume: continue even if the checkpoint's random-number-generator states cannot be "
                        "read (the resumed run then no longer reproduces an uninterrupted one exactly)")
    parser.add_argument("--allow-remote-models", action="store_true",
                        help="allow adapters to build open_clip models named 'hf-hub:...' or 'local-dir:...' (their "
                        "configuration and weights come from outside the recipe)")


def _budget_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB per device, got {text!r}")
    return value


def _close_process_group(barrier: bool = True) -> None:
    """Under ``accelerate launch``, tear the process group down before exit: left to
    interpreter shutdown, gloo can abort ("terminate called without an active exception").
    No barrier after an abort: the other processes may be gone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def _is_first_process() -> bool:
    """Global rank 0 (or no launcher). Only it checks the run folder: under ``accelerate
    launch`` it may already have claimed the folder (manifest, config.yaml) by the time a slower
    process would look, which would then see "a run" and refuse. The launcher stops the other
    processes when rank 0 exits with an error."""
    return int(os.environ.get("RANK", "0")) == 0


def run(args: argparse.Namespace, callback: TrainCallback | None = None) -> int:
    """The command; ``callback`` is handed to :func:`mmviews.train.train` (tests use it to
    slow a run down, see ``tests/slow_train.py``). Errors are raised; :func:`mmviews.cli.main`
    prints them as one line."""
    ended = False
    with allow_remote_models(args.allow_remote_models):
        try:
            status = _run(args, callback)
            ended = True
            return status
        finally:
            # Leave together only after a normal end. After an error or an interrupt outside train()
            # the other processes may be gone or waiting in another collective (e.g. one process's
            # loader failed mid-epoch): a barrier would hang until distributed.timeout_s, while
            # closing the group makes their collective fail at once.
            _close_process_group(barrier=ended)


def _recipe_and_folder(args: argparse.Namespace) -> tuple[Path, TrainConfig, Path]:
    """The recipe file (given, or with ``--resume DIR`` alone the run's ``config.yaml``), its
    config (``--set`` applied) and the run folder. What the command will do with the folder is
    decided later, once (:mod:`mmviews.train.run_folder`)."""
    if args.memory_budget_gb is not None and not args.check:
        raise ValueError("--memory-budget-gb applies with --check (mmviews train RECIPE --check --memory-budget-gb G)")
    for flag in ("resume_ignore_rng", "reevaluate"):
        if getattr(args, flag) and args.resume is None:
            raise ValueError(f"--{flag.replace('_', '-')} only applies with --resume DIR")
    if args.resume is not None:
        run_dir = resume_folder(args.resume)  # a run's checkpoints/ or encoder/ names the run folder above
        if args.recipe is None and not (run_dir / CONFIG_FILE).is_file():
            raise RunFolderRefused(f"{run_dir} is not an mmviews run folder (no {CONFIG_FILE}): nothing to resume")
        recipe = resolve_recipe(args.recipe) if args.recipe is not None else run_dir / CONFIG_FILE
        config = load_config(recipe, args.overrides)
        if args.output is not None and Path(args.output).resolve() != run_dir.resolve():
            raise ValueError(f"--output {args.output} differs from the resumed run folder {run_dir}")
    else:
        if args.recipe is None:
            raise ValueError("give a RECIPE (path or name in recipes/) or --resume DIR")
        recipe = resolve_recipe(args.recipe)
        config = load_config(recipe, args.overrides)
        run_dir = Path(args.output or config.output.dir or Path("runs") / config.name)
    # a tracker the recipe names but this environment lacks would otherwise surface only after
    # the datasets and models are built (train() resolves the trackers after build_run)
    check_trackers_installed(config, str(recipe))
    return recipe, config, run_dir


def _intent(args: argparse.Namespace) -> Intent:
    return Intent(None if args.resume is None else Path(args.resume), args.overwrite, args.recipe is not None)


def _folder_decision(args: argparse.Namespace, config: TrainConfig, run_dir: Path) -> Decision:
    """``--check``: what the run would do with its folder, decided as the run decides it
    (:meth:`RunFolder.decide`) without acting on it."""
    return RunFolder(run_dir).decide(config, _intent(args), act=False)


def _run(args: argparse.Namespace, callback: TrainCallback | None) -> int:
    with same_on_every_process():  # the options and the recipe are every process's: their errors print once
        recipe, config, run_dir = _recipe_and_folder(args)
        # --check: what the run would do with its folder (looked at, nothing written), said after the checks
        decision = _folder_decision(args, config, run_dir) if args.check and _is_first_process() else None
    # before the run's memory is allocated, --check included: its estimate measures the allocator the run has
    host_memory = configure_host_memory(config.host_memory, owns_process=getattr(args, "owns_process", False),
                                        on_cpu=steps_on_cpu(config))
    if args.check:
        config, precision = resolve_precision(config)  # as the run would: its memory estimate under that autocast
        with _overrides_named(str(recipe), args.overrides):
            parts = build_run(config, source=str(recipe))
            run_checks(parts, str(recipe))  # one batch of each split, the adapters' forward, the evaluation labels
        if not _is_first_process():  # every process checks its share; the first one speaks
            return 0
        note = getattr(parts.datasets["train"], "source_note", None)  # e.g. which split lists a video folder read
        if isinstance(note, str):
            print(f"data: {note}")
        print(f"{recipe}: OK ({len(parts.view_spec)} views: {', '.join(v.name for v in parts.view_spec.views)}; "
              f"objective {config.objective.name}; {len(parts.datasets['train'])} training samples)")
        # encode_chunk_size: the cached-embedding step's recipe key (optimisation.encode_chunk_size)
        estimate = estimate_memory(parts, processes_from_environment(),
                                   getattr(config.optimisation, "encode_chunk_size", None))
        print("\n".join(estimate.lines(args.memory_budget_gb)))
        if precision.asked == "auto":
            print(precision.line())
        slow = slow_bf16_line(precision.used, precision.device)
        if slow is not None:
            print_warning("mmviews train", slow)
        if host_memory == "hold":
            print(f"note: {HOLD_NOTE}")
        sys.stdout.flush()  # the verdict above comes first on a terminal that shows both streams
        assert decision is not None
        for line in decision.notes:  # e.g. a damaged checkpoint the run would skip
            print_warning("mmviews train", line)
        # an output the run would refuse fails below: its disk's free space is beside the point
        refused = decision.action == REFUSE and not isinstance(decision.error, RunExistsError)
        space = None if refused else disk_space_line(parts, run_dir)
        if space:
            print_warning("mmviews train", space)
        for line in data_check_lines(parts) + auto_resume_lines(config):
            print_warning("mmviews train", line)
        if isinstance(decision.error, RunExistsError):
            print(f"note: {run_dir} already holds a run: training there needs --resume {shlex.quote(str(run_dir))} "
                  "(continue it) or --overwrite (replace what it wrote)")
            return 0
        decision.raise_if_refused()  # what the run would refuse, --check refuses the same way
        print(f"run folder: {decision.line()}")
        return 0
    quiet_results_logger()  # this command prints the headline metrics and warnings itself
    if _is_first_process():
        # torch's elastic agent asked to restart workers; a restart with too few checkpoints kept
        for line in restart_setup_lines(config) + auto_resume_lines(config):
            print_warning("mmviews train", line)
    if config.optimisation.compile:
        if not args.debug:
            quiet_compiler_logs()
        if _is_first_process():  # a first step that takes minutes would otherwise look like a hang
            print(f"note: {COMPILE_NOTE}", flush=True)
    try:
        with _overrides_named(str(recipe), args.overrides):
            summary = train(config, run_dir, resume=args.resume, source=str(recipe), callback=callback,
                            overwrite=args.overwrite, resume_ignore_rng=args.resume_ignore_rng,
                            reevaluate=args.reevaluate, recipe_given=args.recipe is not None)
    except KeyboardInterrupt as stopped:  # SIGINT/SIGTERM (mmviews.train.interrupt)
        if not (isinstance(stopped, TrainingInterrupted) and stopped.checkpoint is not None):
            _close_process_group(barrier=False)  # not a stop agreed by all processes: some may be gone
        if _is_first_process():
            print(f"mmviews train: {_interrupted_line(stopped, run_dir, args)}", file=sys.stderr, flush=True)
        setattr(stopped, SAID, True)  # mmviews.cli.main leaves with its status (128 + signal), no line of its own
        raise
    except CollectiveFailure as error:  # a peer hung or died: this process's one line, with what happens next
        error.add_note(after_collective_failure(config, run_dir, args.allow_remote_models))
        raise
    except RunFolderRefused as error:  # decided before anything in the folder changed: no hint about what it keeps
        if restart_attempt() and not config.output.auto_resume:
            error.add_note(f"the elastic agent restarted this process (restart {restart_attempt()}): with "
                           "--set output.auto_resume=true a restart continues from the newest checkpoint")
        setattr(error, SAME_ON_EVERY_PROCESS, True)  # every process got the main process's decision
        raise
    except Exception as error:
        if _stopped_before_first_checkpoint(run_dir):
            error.add_note(f"{run_dir} holds no checkpoint: once fixed, the same command starts it again there")
        elif (_is_first_process() and isinstance(worker_error(error), USER_ERRORS) and list_checkpoints(run_dir)
              and not getattr(error, HINTED, False)):
            # e.g. a file that cannot be read: nothing was deleted, the run continues from its last checkpoint
            how = ("run the same command again (output.auto_resume)" if config.output.auto_resume
                   else f"continue with mmviews train --resume {shlex.quote(str(run_dir))}")
            error.add_note(f"the latest checkpoint is kept ({list_checkpoints(run_dir)[-1]}); once fixed, {how}")
        raise
    if not _is_first_process():
        return 1 if summary.get("status") == "failed" else 0
    if summary.get("already_finished"):
        print(f"mmviews train: {run_dir} has already finished (step {summary['steps']}, {RESULTS_FILE} written): "
              f"nothing to do. {_finished_run_options(run_dir, config, resumed=args.resume is not None)}")
        return 0
    loss = format_metric(summary["final_loss"])
    print(f"run folder: {run_dir}  (steps {summary['steps']}, final loss {loss}, {summary['wall_time_s']:.1f} s"
          + (f"; FAILED: {summary['reason']}" if summary.get("status") == "failed" else "") + ")")
    lines = headline_lines(summary.get("headline") or [])
    if lines:
        print(*lines, sep="\n")
    sys.stdout.flush()
    for message in summary.get("warnings") or []:
        print_warning("mmviews train", message)
    for line in data_left_out_lines(summary.get("data_skipped") or {}):
        print(f"data left out (data.options.on_error: skip): {line}")
    for line in loss_lines(summary.get(DATA_LOSSES_KEY) or {}):
        print(f"data left out: {line}")
    if summary["eval"]:
        print(f"report: {run_dir / 'report.md'}")
    return 1 if summary.get("status") == "failed" else 0


def _finished_run_options(run_dir: Path, config: TrainConfig, *, resumed: bool) -> str:
    """What can still be done with a finished run. The bound to raise is the one the recipe uses
    (``max_steps`` when set, else ``epochs``). Under ``output.auto_resume`` (no ``--resume``) the
    commands are spelled out: the same command refuses a changed recipe, ``--resume`` takes it."""
    o = config.optimisation
    bound = (f"optimisation.max_steps=N (more than {o.max_steps})" if o.max_steps is not None
             else f"optimisation.epochs=N (more than {o.epochs})")
    if resumed:
        return f"--reevaluate runs its evaluation again; --set {bound} trains it longer"
    resume = f"mmviews train --resume {shlex.quote(str(run_dir))}"
    return f"{resume} --reevaluate runs its evaluation again; {resume} --set {bound} trains it longer"


@contextlib.contextmanager
def _overrides_named(source: str, overrides: list[str]) -> Iterator[None]:
    """A recipe error (raised with ``source``) about a key a ``--set`` gave names that ``--set``."""
    try:
        yield
    except ConfigError as error:
        named = name_the_override(error, source, overrides)
        if named is error:
            raise
        raise named from error


def quiet_results_logger() -> None:
    """Silence the logger on which :func:`mmviews.train.train` repeats the end of the run for
    Python callers (the command prints it to stdout)."""
    logger = logging.getLogger(RESULTS_LOGGER)
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


def disk_space_line(parts: RunParts, run_dir: Path) -> str | None:
    """``--check``'s line when the run folder's disk has less free space than ``output.keep_last
    + 1`` checkpoints (the ``keep_last`` kept ones, and a new one written before the oldest is
    deleted), each estimated from the parameter, optimiser and objective sizes
    (:func:`mmviews.train.checkpoint.estimate_checkpoint_bytes`)."""
    from mmviews.fileio import free_bytes
    from mmviews.train.build import uses_teacher
    from mmviews.train.checkpoint import estimate_checkpoint_bytes

    o = parts.config.optimisation
    one = estimate_checkpoint_bytes(parts.encoder, parts.objective, o.optimizer, o.momentum,
                                    uses_teacher(parts.config, parts.objective), processes_from_environment())
    free, needed = free_bytes(run_dir), parts.config.output.keep_last + 1
    if free >= needed * one:
        return None
    return (f"{run_dir}: {free} bytes free, less than {needed} checkpoints (output.keep_last = {needed - 1} kept and "
            f"the next one, written before the oldest is deleted; about {one} bytes each, from the parameter and "
            f"optimiser sizes): the run would stop on a full disk at its checkpoint {needed} or before; free some "
            "space or choose another --output")


def data_check_lines(parts: RunParts) -> list[str]:
    """``--check``'s lines about the data: known-bad samples each split leaves out, and the
    modalities of the views that no training sample has (:mod:`mmviews.data.losses`)."""
    losses = DataLosses(run_datasets(parts))
    absent = absent_modalities(parts.datasets["train"], parts.view_spec, parts.config.data.train_split)
    return excluded_lines(losses.splits) + list(absent.values())


def _stopped_before_first_checkpoint(path: Path) -> bool:
    """An mmviews run folder with no checkpoint and no results: nothing to resume or lose."""
    return is_run_dir(path) and not is_checkpoint(path) and not has_checkpoint_or_results(path)


def after_collective_failure(config: TrainConfig, run_dir: Path, allow_remote_models: bool = False) -> str:
    """What follows a collective failure, for its line: under torch's elastic agent with restarts
    left and ``output.auto_resume``, the agent's restart, which continues the run by itself (the
    command to resume would mislead); else the command that resumes the run."""
    left = restarts_left()
    if left and config.output.auto_resume:
        done = restart_attempt()
        return (f"the elastic agent restarts the processes (restart {done + 1} of {done + left}), which continue from "
                "the newest complete checkpoint (output.auto_resume)")
    return f"resume with: {resume_command(run_dir, allow_remote_models)}"


def resume_command(run_dir: Path, allow_remote_models: bool = False) -> str:
    """The command that resumes ``run_dir``, to paste: under ``accelerate launch`` the same launch
    (its options read back from the launcher's command line), under another launcher of several
    processes the working ``accelerate launch`` line for as many, else ``mmviews train``."""
    args = ["train", "--resume", str(run_dir), *(["--allow-remote-models"] if allow_remote_models else [])]
    launch = accelerate_launch()
    if launch is not None:
        return launch.mmviews_command(*args)
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        return shlex.join(["accelerate", "launch", "--multi_gpu", "--num_processes", world, "-m", "mmviews.cli", *args])
    return shlex.join(["mmviews", *args])


def _interrupted_line(stopped: KeyboardInterrupt, run_dir: Path, args: argparse.Namespace) -> str:
    """What happened, and the exact command that continues the run (or starts it again)."""
    name = signal.Signals(stopped.signum if isinstance(stopped, TrainingInterrupted) else signal.SIGINT).name
    if isinstance(stopped, TrainingInterrupted) and stopped.checkpoint is not None:
        what = f"stopped by {name} after step {stopped.step}, checkpoint saved"
    elif isinstance(stopped, TrainingInterrupted) and stopped.aborted:
        what = f"aborted at once by a second {name}"
    else:
        what = f"interrupted by {name}"
    resume = resume_command(run_dir, args.allow_remote_models)
    if not (run_dir / CONFIG_FILE).is_file():  # stopped before the run folder was written
        return f"{what} before the run folder was written; run the same command again"
    found = list_checkpoints(run_dir)
    if isinstance(stopped, TrainingInterrupted) and stopped.checkpoint is not None:
        return f"{what}; resume with: {resume}"
    if not found:
        return f"{what}; {run_dir} has no checkpoint yet, start it again with: {resume}"
    return f"{what}; resume from its last complete checkpoint (step {read_train_state(found[-1])['step']}) with: {resume}"
