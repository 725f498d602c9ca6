"""The same command continues a run (``output.auto_resume: true``): what a checkpoint's files
and a recipe are checked with, and what torch's elastic agent asked for.

A scheduler that restarts a job, or torch's elastic agent that restarts the workers after one
died (``accelerate launch --max_restarts N``), runs the same command line again. With
``output.auto_resume`` that command continues the run in its folder instead of refusing it
(the decision and its rules: :mod:`mmviews.train.run_folder`):

- it starts when the folder holds no complete checkpoint (new, empty, or a run that stopped
  before its first checkpoint);
- otherwise it continues from the newest checkpoint that is complete and intact: every file
  listed in its ``train_state.json`` is checked against the recorded size and SHA-256 before
  anything is loaded (:func:`checkpoint_fault`). A newer damaged checkpoint is skipped with one
  warning line naming it and what is wrong (it stays on the disk: the user decides);
- mmviews's own temporary left-overs of writes cut short are removed, nothing else;
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
from pathlib import Path

from mmviews.config import TrainConfig, dotted_keys
from mmviews.run import read_train_state, verify_checkpoint_file

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


def recipe_differences(config: TrainConfig, saved: TrainConfig) -> list[str]:
    """The dotted recipe keys whose values differ between ``config`` and ``saved``, outside
    :data:`FREE_SECTIONS` (sorted)."""
    ours, theirs = dotted_keys(config.to_dict()), dotted_keys(saved.to_dict())
    return sorted(key for key in ours.keys() | theirs.keys()
                  if key.split(".")[0] not in FREE_SECTIONS and ours.get(key, _MISSING) != theirs.get(key, _MISSING))


_MISSING = object()


def restart_attempt() -> int:
    """How many times torch's elastic agent (``accelerate launch --max_restarts N``,
    ``torchrun --max-restarts``) has restarted this process's workers (0 without the agent)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def max_restarts() -> int:
    """The restarts torch's elastic agent allows this launch (``--max_restarts``; 0 without the
    agent or when its value is not a count)."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    return int(restarts) if restarts.isdigit() else 0


def restarts_left() -> int:
    """How many more times torch's elastic agent restarts this process's workers when one of
    them fails (``--max_restarts`` less the restarts so far; 0 without the agent)."""
    return max(0, max_restarts() - restart_attempt())


# Checkpoints output.auto_resume should keep: with one, a damaged newest checkpoint (a disk fault,
# a file cut short outside mmviews) leaves none intact, and the same command refuses the folder.
AUTO_RESUME_KEEP_LAST = 2


def auto_resume_lines(config: TrainConfig) -> list[str]:
    """Under ``output.auto_resume``, a warning line when ``output.keep_last`` is below
    :data:`AUTO_RESUME_KEEP_LAST` (``mmviews train`` prints it at the start of the run and with
    ``--check``). A warning, not a refusal: keeping one checkpoint is a choice for a disk too
    small for two, whose cost the line states."""
    keep = config.output.keep_last
    if not config.output.auto_resume or keep >= AUTO_RESUME_KEEP_LAST:
        return []
    return [f"output.keep_last = {keep} with output.auto_resume: if the newest checkpoint is damaged there is no "
            f"other to continue from and the same command refuses the folder; set output.keep_last="
            f"{AUTO_RESUME_KEEP_LAST} (one more checkpoint on the disk)"]


def restart_setup_lines(config: TrainConfig) -> list[str]:
    """Under torch's elastic agent asked for restarts (``accelerate launch --max_restarts N``,
    ``torchrun --max-restarts N``), what would keep a restart from continuing the run, one line
    each: the launcher's shared rendezvous store (torch's default), on which restarted workers
    fail to connect, and a recipe without ``output.auto_resume``, whose folder a restart refuses."""
    restarts = max_restarts()
    if restarts == 0:
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
