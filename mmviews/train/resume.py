"""The same command continues a run (``output.auto_resume: true``).

A scheduler that restarts a job, or torch's elastic agent that restarts the workers after one
died (``accelerate launch --max_restarts N``), runs the same command line again. With
``output.auto_resume`` that command continues the run in its folder instead of refusing it:

- it starts when the folder holds no complete checkpoint (new, empty, or a run that stopped
  before its first checkpoint);
- otherwise it continues from the newest checkpoint that is complete and intact: every file
  listed in its ``train_state.json`` is checked against the recorded size and SHA-256 before
  anything is loaded (:func:`checkpoint_fault`). A newer damaged checkpoint is skipped with one
  line naming it and what is wrong (it stays on the disk: the user decides);
- temporary folders of checkpoints cut short (``checkpoints/.tmp-checkpoint-N``) and temporary
  files of mmviews's atomic writes (``.results.json.<random>.tmp``) and of ``encoder/``
  (``.encoder.tmp-<random>``) are removed
  (:func:`remove_leftovers`): nothing else is, whatever its name;
- a finished run changes nothing and says so (exit status 0);
- a recipe that differs from the run's saved ``config.yaml`` in anything but the ``output``
  section (the folder, logging, checkpoint cadence) is refused, naming the keys
  (:func:`recipe_differences`): continuing a run with another recipe would silently mix two
  experiments (``--resume DIR --set ...`` changes a run on purpose, e.g. more epochs).

With several processes the main process checks the checkpoints and tells the others which one
to load (one broadcast), so that every process continues from the same step.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from mmviews.config import ConfigError, TrainConfig, dotted_keys, load_config
from mmviews.fileio import is_previous_folder_of, is_temporary_file_of, is_temporary_folder_of
from mmviews.run import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    ENCODER_DIR,
    LOG_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    RUN_MANIFEST,
    TMP_PREFIX,
    RunFolderError,
    list_checkpoints,
    read_train_state,
    verify_checkpoint_file,
)

# Files at the top of a run folder that mmviews writes atomically: a temporary file of one of
# them (".NAME.<random>.tmp") is a left-over of a write cut short.
_ATOMIC_FILES = (RUN_MANIFEST, CONFIG_FILE, LOG_FILE, RESULTS_FILE, REPORT_FILE)

#: The recipe section that may differ between the saved run and the command that continues it.
FREE_SECTIONS = ("output",)


def checkpoint_fault(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint folder (its ``train_state.json`` unreadable, a file
    missing, or not of the size and SHA-256 recorded), or None when it is intact."""
    try:
        records = read_train_state(checkpoint)["files"]
        for name in sorted(records or {}):
            verify_checkpoint_file(checkpoint, name, records)
    except (OSError, ValueError) as error:  # CorruptFileError is a ValueError
        return str(error).split("; ")[0]
    return None


def _say(line: str) -> None:
    print(line, flush=True)  # at once: the lines come before the run's own output, also under a launcher


def newest_intact_checkpoint(run_dir: Path, say: Callable[[str], None] = _say) -> Path | None:
    """The newest checkpoint of ``run_dir`` that :func:`checkpoint_fault` finds intact; each newer
    damaged one is named by one ``say`` line. None when the run has no checkpoint;
    :class:`~mmviews.run.RunFolderError` when it has some and none is intact."""
    found = list_checkpoints(run_dir)
    for checkpoint in reversed(found):
        fault = checkpoint_fault(checkpoint)
        if fault is None:
            return checkpoint
        say(f"mmviews train: skipping the damaged checkpoint {checkpoint}: {fault}")
    if found:
        raise RunFolderError(f"{run_dir}: none of its {len(found)} checkpoint(s) is intact (see above), nothing to "
                             "continue from; --overwrite starts the run again")
    return None


def recipe_differences(config: TrainConfig, saved: TrainConfig) -> list[str]:
    """The dotted recipe keys whose values differ between ``config`` and ``saved``, outside
    :data:`FREE_SECTIONS` (sorted)."""
    ours, theirs = dotted_keys(config.to_dict()), dotted_keys(saved.to_dict())
    return sorted(key for key in ours.keys() | theirs.keys()
                  if key.split(".")[0] not in FREE_SECTIONS and ours.get(key, _MISSING) != theirs.get(key, _MISSING))


_MISSING = object()


def check_same_recipe(config: TrainConfig, run_dir: Path) -> None:
    """A :class:`~mmviews.config.ConfigError` naming the keys when ``config`` is not the recipe
    the run in ``run_dir`` was started with (its ``config.yaml``; outside the ``output``
    section). A run without a ``config.yaml`` is not checked."""
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        return
    differ = recipe_differences(config, load_config(saved_path))
    if differ:
        shown = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
        raise ConfigError(f"output.auto_resume: the recipe differs from the one {run_dir} was started with "
                          f"({saved_path}) in {shown}; use that recipe to continue the run, --resume {run_dir} "
                          "--set KEY=VALUE to change it on purpose, or another --output to start a new run")


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Remove what a run cut short left in ``run_dir``: temporary checkpoint folders
    (``checkpoints/.tmp-checkpoint-N``, complete ones being removed included), temporary files
    of mmviews's atomic writes of its top-level files and ``encoder/``'s temporary folders, by
    their exact names only (a user's ``.encoder-backup/`` or ``.tmp-checkpoint-mine/`` stays). An
    ``encoder/`` moved aside while its replacement was renamed in
    (:func:`mmviews.fileio.replace_folder`) is put back when the replacement never came. Returns
    what was removed."""
    removed = []
    folder = run_dir / CHECKPOINTS_DIR
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if _TEMPORARY_CHECKPOINT.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if run_dir.is_dir():
        for path in sorted(run_dir.iterdir()):
            if path.is_symlink():
                continue
            if path.is_file() and any(is_temporary_file_of(path, name) for name in _ATOMIC_FILES):
                path.unlink()
                removed.append(path)
            elif path.is_dir() and is_previous_folder_of(path, ENCODER_DIR) and not (run_dir / ENCODER_DIR).exists() \
                    and (path / ENCODER_DIR).is_dir():
                os.replace(path / ENCODER_DIR, run_dir / ENCODER_DIR)  # the replacement was cut short: the old one back
                path.rmdir()
                _say(f"mmviews train: put {ENCODER_DIR}/ back from {path.name}/ (its replacement was cut short)")
            elif path.is_dir() and (is_temporary_folder_of(path, ENCODER_DIR) or is_previous_folder_of(path, ENCODER_DIR)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# Checkpoint folders of mmviews.train.checkpoint being written or deleted (TMP_PREFIX + step, or + "removed-" + name)
_TEMPORARY_CHECKPOINT = re.compile(re.escape(TMP_PREFIX) + r"(removed-checkpoint-)?\d+")


def auto_resume_checkpoint(config: TrainConfig, run_dir: Path, is_main: bool, num_processes: int) -> Path | None:
    """The checkpoint ``output.auto_resume`` continues from (None: the run starts), the same on
    every process: the recipe is checked by every process (:func:`check_same_recipe`), the
    checkpoints by the main process only, which tells the others (every process calls this)."""
    if list_checkpoints(run_dir):
        check_same_recipe(config, run_dir)
    choice: list[Any] = [(None, None)]  # (checkpoint, error message), from the main process
    if is_main:
        try:
            found = newest_intact_checkpoint(run_dir)
            choice = [(str(found) if found is not None else None, None)]
        except RunFolderError as error:
            choice = [(None, str(error))]
    if num_processes > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(choice, src=0)  # plain strings: nothing but data is unpickled
    found, error = choice[0]
    if error is not None:
        raise RunFolderError(error)
    return Path(found) if found is not None else None


def restart_attempt() -> int:
    """How many times torch's elastic agent (``accelerate launch --max_restarts N``,
    ``torchrun --max-restarts``) has restarted this process's workers (0 without the agent)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def restart_setup_lines(config: TrainConfig) -> list[str]:
    """Under torch's elastic agent asked for restarts (``accelerate launch --max_restarts N``,
    ``torchrun --max-restarts N``), what would keep a restart from continuing the run, one line
    each: the launcher's shared rendezvous store (torch's default), on which restarted workers
    fail to connect, and a recipe without ``output.auto_resume``, whose folder a restart refuses."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not (restarts.isdigit() and int(restarts) > 0):
        return []
    lines = []
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        lines.append(f"--max_restarts {restarts}: restarted workers cannot rejoin through the launcher's shared store; "
                     "launch with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment "
                     "(docs/reliability.md)")
    if not config.output.auto_resume:
        lines.append(f"--max_restarts {restarts}: a restart would refuse this run's folder; add --set "
                     "output.auto_resume=true so that it continues from the newest checkpoint")
    return lines
