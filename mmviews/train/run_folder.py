"""What a command does with its run folder: one decision, in one place.

:meth:`RunFolder.decide` takes what the command asks (:class:`Intent`: ``--resume DIR``,
``--overwrite``, whether the config came from a recipe or from the run's own ``config.yaml``,
and the recipe's ``output.auto_resume``) and what the folder holds, and returns a
:class:`Decision`: **start** (a new or empty folder, or a run that stopped before its first
checkpoint, started again in place), **continue** from one checkpoint, **replace** the run there
(``--overwrite``: only what that run wrote is removed), or **refuse** with one line that names
what is wrong and the command that does what was meant. ``mmviews train --check`` prints the same
decision without acting on it (:meth:`Decision.line`).

The rules:

- a folder holding anything but an mmviews run is never written to (``--overwrite`` or not);
- one command at a time: the main process holds the folder's lock
  (:class:`~mmviews.run.RunFolderLock`) from the decision to the end of the command, and a folder
  held by another process is refused, naming it;
- ``--overwrite`` with ``--resume`` or with ``output.auto_resume`` is refused (one replaces the
  run, the other continues it);
- continuing (``--resume DIR``, or the same command under ``output.auto_resume``) with a recipe
  given on the command line needs that recipe to be the run's own outside the ``output`` section
  (:func:`~mmviews.train.resume.recipe_differences`): a changed one is refused naming the keys.
  ``--resume DIR --set KEY=VALUE`` (the run's ``config.yaml``, changed) changes a run on purpose;
- ``--resume DIR`` continues from DIR's newest checkpoint (or DIR itself, a checkpoint folder);
  one whose ``train_state.json`` cannot be read is refused, naming the newest intact checkpoint
  before it to pass instead. ``output.auto_resume`` continues from the newest intact checkpoint
  (:func:`newest_intact_checkpoint`: each newer damaged one is skipped with one warning line);
- nothing in the folder changes before the run really goes on: :meth:`RunFolder.claim` (the
  main process, once the run is built) removes what a replaced run wrote and mmviews's own
  temporary left-overs (:func:`remove_leftovers`) and writes the manifest and ``config.yaml`` of a
  run that starts; a run that continues changes its folder only once its checkpoint is loaded
  (:meth:`RunFolder.continued`). This module is the only code that writes ``config.yaml`` or
  removes what is in a run folder before training (the checkpoint writer rotates its own
  checkpoints, :mod:`mmviews.train.checkpoint`).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mmviews.config import TrainConfig, load_config, save_config
from mmviews.fileio import check_writable, is_previous_folder_of, is_temporary_file_of, is_temporary_folder_of
from mmviews.modalities.multiview import ENCODER_CONFIG
from mmviews.notices import print_warning
from mmviews.run import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    ENCODER_DIR,
    LOG_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    RUN_MANIFEST,
    TMP_PREFIX,
    FolderInUseError,
    RunExistsError,
    RunFolderLock,
    RunFolderRefused,
    entries,
    has_checkpoint_or_results,
    in_use_message,
    is_checkpoint,
    is_run_dir,
    list_checkpoints,
    lock_holder,
    read_manifest,
    read_train_state,
    record_run_outputs,
    run_dir_of,
    run_outputs,
    write_manifest,
)
from mmviews.train.resume import checkpoint_fault, recipe_differences

START, CONTINUE, REPLACE, REFUSE = "start", "continue", "replace", "refuse"
PREFIX = "mmviews train"

# Files at the top of a run folder that mmviews writes atomically: a temporary file of one of
# them (".NAME.<random>.tmp") is a left-over of a write cut short.
_ATOMIC_FILES = (RUN_MANIFEST, CONFIG_FILE, LOG_FILE, RESULTS_FILE, REPORT_FILE)
_STARTED_AGAIN = "{run_dir} has no checkpoint (the run stopped before its first one): starting it again from step 0"


@dataclass(frozen=True)
class Intent:
    """What the command asks of the folder. ``resume``: ``--resume DIR`` (a run folder or one of
    its checkpoint folders); ``recipe_given``: the config comes from a recipe named on the command
    line (with ``--resume``: compared with the run's own), not from the run's ``config.yaml``."""

    resume: Path | None = None
    overwrite: bool = False
    recipe_given: bool = True


@dataclass
class Decision:
    """What will happen to the folder. ``notes``: the warning lines the decision gives (a
    damaged checkpoint skipped, a run started again); ``error``: the refusal (``action`` refuse)."""

    action: str
    run_dir: Path
    checkpoint: Path | None = None
    step: int | None = None
    again: bool = False  # start: a run that stopped before its first checkpoint, started again in place
    notes: list[str] = field(default_factory=list)
    error: RunFolderRefused | None = None

    def line(self) -> str:
        """The decision in one line (``mmviews train --check``)."""
        if self.action == CONTINUE:
            return f"{self.run_dir}: the run continues from {self.checkpoint} (step {self.step})"
        if self.action == REPLACE:
            return f"{self.run_dir}: --overwrite replaces the run there (only what it wrote is removed)"
        if self.action == START:
            return (f"{self.run_dir}: the run there stopped before its first checkpoint; it starts again from step 0"
                    if self.again else f"{self.run_dir}: a new run starts there")
        return str(self.error)

    def raise_if_refused(self) -> None:
        if self.error is not None:
            raise self.error

    def to_data(self) -> tuple[Any, ...]:
        """Plain data (for the other processes of a launch)."""
        error = None if self.error is None else (type(self.error).__name__, str(self.error))
        return (self.action, str(self.run_dir), None if self.checkpoint is None else str(self.checkpoint), self.step,
                self.again, list(self.notes), error)

    @classmethod
    def from_data(cls, data: tuple[Any, ...]) -> Decision:
        action, run_dir, checkpoint, step, again, notes, error = data
        kinds = {c.__name__: c for c in (RunFolderRefused, RunExistsError, FolderInUseError)}
        refused = None if error is None else kinds.get(error[0], RunFolderRefused)(error[1])
        return cls(action, Path(run_dir), None if checkpoint is None else Path(checkpoint), step, again, notes, refused)


def _refuse(run_dir: Path, message: str, kind: type[RunFolderRefused] = RunFolderRefused) -> Decision:
    return Decision(REFUSE, run_dir, error=kind(message))


class RunFolder:
    """A command's run folder: the decision (:meth:`decide`), the lock it is taken under, and
    the only changes made to the folder before training (:meth:`claim`, :meth:`continued`)."""

    def __init__(self, run_dir: str | Path, command: str = PREFIX) -> None:
        self.run_dir = Path(run_dir)
        self.lock = RunFolderLock(self.run_dir, command)
        self._created: list[Path] = []  # the folders decide() made, deepest first

    def release(self) -> None:
        """Let the folder go: the lock released, and the folders :meth:`decide` made for it removed
        again while they are empty (a run refused before it wrote anything leaves no folder)."""
        self.lock.release()
        for folder in self._created:
            try:
                folder.rmdir()  # only while empty: anything written there stays
            except OSError:
                break
        self._created = []

    def decide(self, config: TrainConfig, intent: Intent, *, act: bool = True) -> Decision:
        """What the command will do with the folder. ``act``: take the folder's lock first (the
        main process of a run; it stays held until :meth:`release`), which creates the folder
        when it is new; without it (``--check``) only look: nothing is created or written."""
        run_dir, auto = self.run_dir, config.output.auto_resume
        if intent.overwrite and intent.resume is not None:
            return _refuse(run_dir, "--overwrite replaces the run, --resume continues it: choose one")
        if intent.overwrite and auto:
            return _refuse(run_dir, "--overwrite replaces the run, output.auto_resume continues it: choose one")
        if run_dir.exists() and not run_dir.is_dir():
            return _refuse(run_dir, f"{run_dir} is a file, not a run folder: choose another --output")
        is_run = is_run_dir(run_dir)
        if intent.resume is not None and not is_run:
            return _refuse(run_dir, f"{run_dir} is not an mmviews run folder (no {RUN_MANIFEST} or {CONFIG_FILE}): "
                                    "nothing to resume")
        if not is_run and entries(run_dir):
            found = sorted(entries(run_dir))
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            return _refuse(run_dir, f"{run_dir} is not empty and not an mmviews run folder (it holds {shown}); mmviews "
                                    "writes only into a new or empty folder or one of its own runs: choose another "
                                    "--output")
        try:
            check_writable(run_dir)
        except PermissionError as error:
            return _refuse(run_dir, str(error))
        if act:
            missing = [folder for folder in (run_dir, *run_dir.parents) if not folder.exists()]
            run_dir.mkdir(parents=True, exist_ok=True)
            self._created = missing
            try:
                self.lock.acquire()
            except FolderInUseError as error:
                return Decision(REFUSE, run_dir, error=error)
            if self.lock.unsupported:
                print_warning(PREFIX, f"{self.lock.unsupported}: another command on {run_dir} would not be refused")
        else:
            holder = lock_holder(run_dir)
            if holder is not None:
                return _refuse(run_dir, in_use_message(run_dir, holder), FolderInUseError)
        return self._decide_held(config, intent, is_run)

    def _decide_held(self, config: TrainConfig, intent: Intent, is_run: bool) -> Decision:
        """The rules, once no other command can change the folder."""
        run_dir = self.run_dir
        if intent.resume is not None:
            if not has_checkpoint_or_results(run_dir):
                return Decision(START, run_dir, again=True, notes=[_STARTED_AGAIN.format(run_dir=run_dir)])
            if intent.recipe_given:
                refused = _recipe_refusal(config, run_dir, "--resume")
                if refused is not None:
                    return refused
            return _resume_checkpoint(Path(intent.resume), run_dir)
        if config.output.auto_resume and list_checkpoints(run_dir):
            refused = _recipe_refusal(config, run_dir, "output.auto_resume")
            if refused is not None:
                return refused
            notes: list[str] = []
            found = newest_intact_checkpoint(run_dir, notes.append)
            if found is None:  # every checkpoint damaged: the notes above name each
                refused = _refuse(run_dir, f"{run_dir}: none of its {len(list_checkpoints(run_dir))} checkpoint(s) is "
                                           "intact (see above), nothing to continue from; --overwrite starts the run "
                                           "again")
                refused.notes = notes
                return refused
            return Decision(CONTINUE, run_dir, found, read_train_state(found)["step"], notes=notes)
        if is_run and has_checkpoint_or_results(run_dir):
            if intent.overwrite:
                return Decision(REPLACE, run_dir)
            return _refuse(run_dir, f"{run_dir} already holds a run; continue it with --resume {run_dir}, or choose "
                                    "another --output (or --overwrite to replace what that run wrote)", RunExistsError)
        if is_run:
            return Decision(START, run_dir, again=True, notes=[_STARTED_AGAIN.format(run_dir=run_dir)])
        return Decision(START, run_dir)

    def claim(self, decision: Decision, config: TrainConfig) -> None:
        """The main process, once the run is built and before it writes anything. A run that
        starts: what a replaced (or started again) run wrote removed (only the entries its
        manifest lists), mmviews's temporary left-overs removed (one warning line), the manifest
        and ``config.yaml`` written. A run that continues: nothing yet (:meth:`continued`, once its
        checkpoint is loaded)."""
        decision.raise_if_refused()
        if decision.action != CONTINUE:
            claim_run_dir(self.run_dir)
            self._remove_leftovers()
            save_config(config, self.run_dir / CONFIG_FILE)
            record_run_outputs(self.run_dir)

    def continued(self, config: TrainConfig) -> None:
        """The main process, once a continued run's checkpoint is loaded (the run really goes
        on): the manifest brought up to date, mmviews's temporary left-overs removed (one warning
        line) and ``config.yaml`` rewritten with the recipe it continues with (``--set``)."""
        claim_run_dir(self.run_dir, resume=True)
        self._remove_leftovers()
        save_config(config, self.run_dir / CONFIG_FILE)
        record_run_outputs(self.run_dir)

    def _remove_leftovers(self) -> None:
        removed = remove_leftovers(self.run_dir)  # mmviews's own temporary names only
        if removed:
            print_warning(PREFIX, f"removed {len(removed)} temporary left-over(s) of a write cut short: "
                                  f"{', '.join(str(p.relative_to(self.run_dir)) for p in removed)}")


def decide_on_every_process(folder: RunFolder, config: TrainConfig, intent: Intent, is_main: bool,
                            num_processes: int) -> Decision:
    """The decision of the main process (which takes the lock), the same on every process
    (one broadcast of plain data), its notes said by the main process."""
    data: list[Any] = [None]
    if is_main:
        data = [folder.decide(config, intent).to_data()]
    if num_processes > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(data, src=0)  # plain strings and numbers: nothing but data is unpickled
    decision = Decision.from_data(data[0])
    if is_main:
        for note in decision.notes:
            print_warning(PREFIX, note)
    return decision


def resume_folder(path: str | Path) -> Path:
    """The run folder that ``--resume PATH`` continues: PATH itself, or the run of a checkpoint
    folder. A run's ``checkpoints/`` or ``encoder/`` folder is a :class:`RunFolderRefused`
    naming the run folder above it."""
    path = Path(path)
    if is_checkpoint(path):
        return run_dir_of(path)
    hint = run_folder_above(path)
    if hint is not None:
        raise RunFolderRefused(hint)
    return path


def run_folder_above(path: Path) -> str | None:
    """When ``path`` is a run's ``checkpoints/`` or ``encoder/`` folder rather than a run or
    checkpoint folder, what to give instead (the run folder above it); else None."""
    parent = path.parent
    if not is_run_dir(parent) or is_run_dir(path):
        return None
    if path.name == CHECKPOINTS_DIR:
        return (f"{path} is the checkpoints folder of the run {parent}: give the run folder (--resume {parent} "
                f"continues from its newest checkpoint) or one checkpoint in it ({path}/checkpoint-N)")
    if path.name == ENCODER_DIR or (path / ENCODER_CONFIG).is_file():
        return (f"{path} is the trained encoder of the run {parent}, not a run folder: give the run folder "
                f"(--resume {parent})")
    return None


def _recipe_refusal(config: TrainConfig, run_dir: Path, how: str) -> Decision | None:
    """The refusal of a recipe that is not the run's own outside ``output`` (None when it is,
    or when the run has no ``config.yaml`` to compare with)."""
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        return None
    differ = recipe_differences(config, load_config(saved_path))
    if not differ:
        return None
    shown = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
    keep = ("use that recipe to continue the run" if how == "output.auto_resume"
            else f"leave the recipe out to continue with the run's own (--resume {run_dir})")
    return _refuse(run_dir, f"{how}: the recipe differs from the one {run_dir} was started with ({saved_path}) in "
                            f"{shown}; {keep}, --resume {run_dir} --set KEY=VALUE to change it on purpose, or another "
                            "--output to start a new run")


def _resume_checkpoint(path: Path, run_dir: Path) -> Decision:
    """``--resume PATH``: its checkpoint (PATH itself, or the run's newest) when its
    ``train_state.json`` can be read; else a refusal naming the newest intact checkpoint before it.
    (The files it lists are checked as they are loaded: a damaged one names itself.)"""
    found = list_checkpoints(run_dir)
    checkpoint = path if is_checkpoint(path) else (found[-1] if found else None)
    if checkpoint is None:
        return _refuse(run_dir, f"no complete checkpoint in {run_dir} (expected {run_dir}/{CHECKPOINTS_DIR}/"
                                "checkpoint-N): nothing to continue from; --overwrite starts the run again")
    try:
        step = read_train_state(checkpoint)["step"]
    except (OSError, ValueError) as error:  # CorruptFileError is a ValueError
        return _refuse(run_dir, f"{str(error).split('; ')[0]}; {earlier_intact_hint(checkpoint, run_dir)}")
    return Decision(CONTINUE, run_dir, checkpoint, step)


#: Set on an error whose notes already say what to do with the run's checkpoints (the command
#: line adds no "the latest checkpoint is kept" hint to it).
HINTED = "mmviews_checkpoint_hint"


def earlier_intact_hint(checkpoint: Path, run_dir: Path) -> str:
    """What to pass instead of a damaged ``checkpoint``: the newest intact checkpoint before it
    (checked file by file), or, when there is none, that only ``--overwrite`` starts the run again."""
    earlier = [c for c in list_checkpoints(run_dir) if _step_of(c) < _step_of(checkpoint)]
    intact = next((c for c in reversed(earlier) if checkpoint_fault(c) is None), None)
    if intact is None:
        return f"no earlier checkpoint of {run_dir} is intact, nothing to continue from: --overwrite starts the run again"
    return (f"the newest intact checkpoint before it is {intact} (step {read_train_state(intact)['step']}): continue "
            f"from it with mmviews train --resume {intact}")


def add_damaged_checkpoint_hint(error: BaseException, checkpoint: Path) -> None:
    """Note on an error raised while ``checkpoint`` was loaded which checkpoint to continue from
    (:func:`earlier_intact_hint`), and mark it :data:`HINTED`."""
    error.add_note(earlier_intact_hint(checkpoint, run_dir_of(checkpoint)))
    setattr(error, HINTED, True)


def _step_of(checkpoint: Path) -> int:
    digits = checkpoint.name.rpartition("-")[2]
    return int(digits) if digits.isdigit() else -1


def newest_intact_checkpoint(run_dir: Path, say: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of ``run_dir`` that :func:`~mmviews.train.resume.checkpoint_fault`
    finds intact; each newer damaged one is named by one ``say`` line. None when there is none."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        fault = checkpoint_fault(checkpoint)
        if fault is None:
            return checkpoint
        say(f"skipping the damaged checkpoint {checkpoint}: {fault}")
    return None


def claim_run_dir(run_dir: str | Path, *, resume: bool = False) -> None:
    """Make ``run_dir`` a run folder (the decision taken: :meth:`RunFolder.decide`): for a run
    that starts, what a previous run there wrote is removed (only the entries its manifest
    lists, or for a run from before manifests its known outputs); the folder is created and its
    manifest written. ``resume``: entries found now that the manifest does not list as the
    user's are the run's (written after its last manifest update, before a kill)."""
    run_dir = Path(run_dir)
    old = read_manifest(run_dir) if run_dir.is_dir() else None
    if resume:
        foreign = set(old["foreign"]) if old is not None else entries(run_dir) - set(run_outputs(run_dir))
        created = set(old["created"]) if old is not None else set(run_outputs(run_dir))
    else:
        if run_dir.is_dir():
            for name in run_outputs(run_dir):  # empty unless replacing a run (or starting one again)
                target = run_dir / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        foreign, created = entries(run_dir), set()
    write_manifest(run_dir, created | (entries(run_dir) - foreign), foreign)


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
                print_warning(PREFIX, f"put {ENCODER_DIR}/ back from {path.name}/ (its replacement was cut short)")
            elif path.is_dir() and (is_temporary_folder_of(path, ENCODER_DIR) or is_previous_folder_of(path, ENCODER_DIR)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


# Checkpoint folders of mmviews.train.checkpoint being written or deleted (TMP_PREFIX + step, or + "removed-" + name)
_TEMPORARY_CHECKPOINT = re.compile(re.escape(TMP_PREFIX) + r"(removed-checkpoint-)?\d+")
