"""The run folder: its layout, its checkpoints, and loading a trained run back.

Two promises live here. Never delete what mmviews did not write: what a command does with a run
folder is decided in one place (:mod:`mmviews.train.run_folder`, which takes only a new, empty or
mmviews folder and, replacing one, removes only the entries its manifest lists, see
:func:`record_run_outputs`), and one command at a time holds a folder (:class:`RunFolderLock`).
Checkpoints are data, not code: every
checkpoint file is checked against the size and SHA-256 that ``train_state.json`` records
(:func:`verify_checkpoint_file`) before it is read, and pickles load weights-only
(:func:`load_torch_file`). Both the trainer and ``mmviews eval`` use this module, so evaluation
never depends on the training code. The folder's layout is in ``docs/cli.md`` ("Run folders").
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import socket
import zipfile
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

try:
    import fcntl
except ImportError:  # not a POSIX system: run folders are not locked (RunFolderLock.unsupported says so)
    fcntl = None  # type: ignore[assignment]

from mmviews.config import ConfigError, TrainConfig, load_config
from mmviews.data.loaders import build_eval_loaders
from mmviews.data.safe_pickle import CorruptFileError, UnsafePickleError
from mmviews.fileio import atomic_write_text, read_json_object
from mmviews.modalities.multiview import ENCODER_CONFIG, MultiViewEncoder

CONFIG_FILE = "config.yaml"
LOG_FILE = "metrics.csv"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
TRAIN_STATE_FILE = "train_state.json"
OBJECTIVE_FILE = "objective.pt"
TEACHER_FILE = "teacher.safetensors"
ENCODER_DIR = "encoder"
EVAL_METRICS_FILE = "metrics.json"  # inside each evaluation folder
RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
RUN_MANIFEST = ".mmviews-run.json"
# The file on which the command that uses a run folder holds its lock (RunFolderLock).
LOCK_FILE = ".mmviews-lock"
MANIFEST_FORMAT = "mmviews-run"
MANIFEST_VERSION = 1
# What runs written before the manifest existed put in their folder (removed by --overwrite
# of such a run; nothing else is).
LEGACY_OUTPUTS = (CONFIG_FILE, LOG_FILE, CHECKPOINTS_DIR, ENCODER_DIR, "eval", "eval_random", RESULTS_FILE,
                  REPORT_FILE, "tensorboard")
LEGACY_OUTPUT_PREFIXES = ("eval_epoch_",)


class RunFolderError(ValueError):
    """A folder cannot be used as (or is not) a run folder; the message names it."""


class RunFolderRefused(RunFolderError):
    """What a command asked of a run folder is refused, before anything in it changed (one line:
    what is wrong and the command that does what was meant). Raised by
    :mod:`mmviews.train.run_folder`; no "the latest checkpoint is kept" hint applies to it."""


class RunExistsError(RunFolderRefused):
    """A new run was asked for in a folder that holds a run worth keeping: training there needs
    ``--resume`` or ``--overwrite`` (``mmviews train --check`` only notes it)."""


class FolderInUseError(RunFolderRefused):
    """Another command (another process) holds the run folder's lock (:class:`RunFolderLock`)."""


# ----------------------------------------------------------------------- one command per run folder


# Folders this process holds (resolved paths): a POSIX lock does not conflict with its own
# process, and closing any other descriptor of the lock file would release it.
_HELD: dict[Path, "RunFolderLock"] = {}
# flock/fcntl errors of a file system that does not lock (e.g. NFS mounted with nolock on some
# kernels, Lustre without its flock option): the run goes on unlocked, with one warning.
_NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunFolderLock:
    """An advisory lock (``fcntl`` record lock, ``lockf``) on ``RUN/.mmviews-lock``, held by the
    one process of a command that writes the folder (the main process of a launch) for as long as
    the command uses it. The kernel releases it when the process ends, however it ends (a SIGKILL
    included), so a killed run's folder can be resumed at once; the lock is not inherited by
    forked children (data-loading workers). The file holds the holder's process id, host and
    command, for the refusal of the next command. It is removed when the lock is released (a
    killed holder's file stays and is taken over). On a network file system the lock is as good
    as the file system's record locks (``docs/reliability.md``)."""

    def __init__(self, run_dir: str | os.PathLike[str], command: str = "mmviews train") -> None:
        self.run_dir, self.command = Path(run_dir), command
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.unsupported: str | None = None  # why the file system gave no lock (the run goes on)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (the folder must exist), or raise :class:`FolderInUseError` naming the
        process and host that hold it. A file system without record locks leaves the folder
        unlocked and says why in :attr:`unsupported`."""
        key = self.run_dir.resolve()
        if key in _HELD:
            raise FolderInUseError(in_use_message(self.run_dir, _held_by_this_process(_HELD[key])))
        if fcntl is None:
            self.unsupported = "this platform has no fcntl record locks"
            return
        while True:
            try:  # a link planted in the folder is never followed (nor the file it names truncated)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise RunFolderRefused(f"{self.path} is a symbolic link, not mmviews's lock file: remove it "
                                           "(mmviews never writes through a link in a run folder)") from None
                raise
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EACCES, errno.EAGAIN):
                    raise FolderInUseError(in_use_message(self.run_dir, read_lock_holder(self.path))) from None
                if error.errno in _NO_LOCKING:
                    self.unsupported = f"{self.path}: this file system gives no lock ({os.strerror(error.errno)})"
                    return
                raise
            # The holder before us may have removed the file after we opened it: lock the file
            # that is there now, not an unlinked one (another command could lock the new file).
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        host = socket.gethostname()
        record = f"{json.dumps({'pid': os.getpid(), 'host': host, 'command': self.command})}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        _HELD[key] = self

    def release(self) -> None:
        """Remove the lock file and release the lock (nothing when not held)."""
        if self._fd is None:
            return
        _HELD.pop(self.run_dir.resolve(), None)
        try:
            self.path.unlink()  # while still holding it: the next command creates a new one
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor releases the record lock
        self._fd = None

    def __enter__(self) -> "RunFolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_holder(run_dir: str | os.PathLike[str]) -> str | None:
    """Who holds the lock of ``run_dir`` now (``"process 123 on host h (mmviews train)"``), or
    None when nobody does. Looks without taking it for longer than the look, and creates nothing."""
    run_dir = Path(run_dir)
    key = run_dir.resolve() if run_dir.exists() else None
    if key is not None and key in _HELD:
        return _held_by_this_process(_HELD[key])
    path = run_dir / LOCK_FILE
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # no lock file (nobody holds it), a link (not a lock), or not ours to open
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            return read_lock_holder(path)
        return None
    finally:
        os.close(fd)  # releases the look's lock
    return None


def read_lock_holder(path: Path) -> str:
    """The holder a lock file names, in words."""
    try:
        data = json.loads(path.read_text())
        return f"process {int(data['pid'])} on host {data['host']} ({data['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its process id yet)"


def _held_by_this_process(lock: RunFolderLock) -> str:
    return f"process {os.getpid()} on host {socket.gethostname()} ({lock.command}, this process)"


def in_use_message(run_dir: Path, holder: str) -> str:
    """The refusal of a command on a folder another process holds."""
    return (f"{run_dir} is in use by {holder}: one command at a time uses a run folder; wait for it to end "
            "(or stop it), or choose another --output")


# --------------------------------------------------------------------------- run folders


def read_manifest(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's manifest ``{"format", "version", "created": [names], "foreign": [names]}``,
    or None when the folder has none. A manifest that is not one is a :class:`CorruptFileError`."""
    path = Path(run_dir) / RUN_MANIFEST
    if not path.is_file():
        return None
    data = read_json_object(path, CorruptFileError, "; the run manifest is corrupt")
    ok = (data.get("format") == MANIFEST_FORMAT
          and all(isinstance(data.get(k), list) and all(isinstance(n, str) for n in data[k]) for k in ("created", "foreign")))
    if not ok:
        raise CorruptFileError(f"{path}: not an mmviews run manifest (expected format {MANIFEST_FORMAT!r} with "
                               "lists 'created' and 'foreign')")
    return data


def _is_legacy_run(run_dir: Path) -> bool:
    """A run written before manifests: a ``config.yaml`` next to a log, checkpoints or an encoder."""
    return (run_dir / CONFIG_FILE).is_file() and (
        (run_dir / LOG_FILE).is_file() or bool(list_checkpoints(run_dir)) or (run_dir / ENCODER_DIR).is_dir())


def is_run_dir(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir`` is a folder written by ``mmviews train`` (manifest, or the layout of
    a run from before manifests)."""
    run_dir = Path(run_dir)
    return run_dir.is_dir() and ((run_dir / RUN_MANIFEST).is_file() or _is_legacy_run(run_dir))


def entries(run_dir: Path) -> set[str]:
    """Top-level names of a run folder, its manifest and lock file left out (mmviews's bookkeeping)."""
    return {p.name for p in run_dir.iterdir()} - {RUN_MANIFEST, LOCK_FILE} if run_dir.is_dir() else set()


def run_outputs(run_dir: Path) -> list[str]:
    """Top-level entries of a run folder that the run wrote."""
    manifest = read_manifest(run_dir)
    present = entries(run_dir)
    if manifest is not None:
        return sorted(present & set(manifest["created"]))
    return sorted(n for n in present if n in LEGACY_OUTPUTS or n.startswith(LEGACY_OUTPUT_PREFIXES))


def has_checkpoint_or_results(run_dir: str | os.PathLike[str]) -> bool:
    """Whether a run folder holds anything a run produced that is worth keeping: a complete
    checkpoint, the trained ``encoder/`` or ``results.json``. A run without any (it stopped
    before its first checkpoint, or failed while setting up) can be started again in place."""
    run_dir = Path(run_dir)
    return bool(list_checkpoints(run_dir)) or (run_dir / ENCODER_DIR).is_dir() or (run_dir / RESULTS_FILE).is_file()


def write_manifest(run_dir: Path, created: Iterable[str], foreign: Iterable[str]) -> None:
    data = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
            "note": "written by mmviews train: 'created' lists what --overwrite may remove",
            "created": sorted(created), "foreign": sorted(foreign)}
    atomic_write_text(run_dir / RUN_MANIFEST, json.dumps(data, indent=1))


def record_run_outputs(run_dir: str | os.PathLike[str]) -> None:
    """Main process: add the folder's new top-level entries to the manifest's ``created``
    (a run folder without a manifest is left alone)."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    if manifest is None:
        return
    foreign = set(manifest["foreign"])
    created = set(manifest["created"]) | (entries(run_dir) - foreign)
    if created != set(manifest["created"]):
        write_manifest(run_dir, created, foreign)


# --------------------------------------------------------------------------- checkpoint files


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS_DIR
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete checkpoint folder (it has its ``train_state.json``)."""
    return (Path(path) / TRAIN_STATE_FILE).is_file()


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a checkpoint folder, else the latest checkpoint of the run
    folder ``path``."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {path} "
                                f"(expected {path}/{CHECKPOINTS_DIR}/{CHECKPOINT_PREFIX}N)")
    return found[-1]


def read_finished_run(run_dir: Path, checkpoint: Path, total_steps: int, reevaluate: bool = False) -> dict[str, Any] | None:
    """The summary (``results.json``) of a finished run being resumed from ``checkpoint``, or
    None when the checkpoint is before ``total_steps`` (the recipe's length, which ``--set``
    may have changed) or the run has no ``encoder/`` or results yet (stopped before its end). ``reevaluate`` (evaluate the finished
    run again): a run that is not finished is a :class:`RunFolderError`."""
    step = read_train_state(checkpoint)["step"]
    results = run_dir / RESULTS_FILE
    if step >= total_steps and results.is_file() and (run_dir / ENCODER_DIR).is_dir():
        return read_json_object(results, CorruptFileError, "; delete it to evaluate the run again with --resume")
    if reevaluate:
        raise RunFolderError(f"--reevaluate evaluates a finished run again, but {run_dir} has not finished (checkpoint "
                             f"at step {step} of {total_steps}"
                             + ("" if step < total_steps else f", no {RESULTS_FILE}") + f"): --resume {run_dir} "
                             "without --reevaluate continues it and evaluates at the end")
    return None


def run_dir_of(checkpoint: Path) -> Path:
    """The run folder of a checkpoint folder (``RUN/checkpoints/checkpoint-N``)."""
    return checkpoint.parent.parent


def file_record(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of a file."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def checkpoint_file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """The :func:`file_record` of every file of a checkpoint folder (``train_state.json``
    excepted: it holds these records)."""
    return {p.name: file_record(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != TRAIN_STATE_FILE}


_STATE_KEYS = ("epoch", "batch_in_epoch", "step", "samples")


def read_train_state(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's ``train_state.json``: ``{"epoch", "batch_in_epoch", "step", "samples"}``
    (non-negative ints), ``"wall_time_s"`` (the run's wall time up to it, every leg; 0.0 in
    checkpoints from before it was kept) and ``"files"`` (the :func:`checkpoint_file_records` written with it,
    or None for checkpoints from before they were recorded). Anything else is a
    :class:`CorruptFileError` naming the file."""
    path = Path(checkpoint) / TRAIN_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {checkpoint} is not a complete checkpoint")
    data = read_json_object(path, CorruptFileError, "; the checkpoint is corrupt, resume from an earlier one "
                            "(checkpoints/checkpoint-N)")
    for key in _STATE_KEYS:
        value = data.get(key, 0 if key == "samples" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CorruptFileError(f"{path}: key {key!r} must be a non-negative integer, got {value!r}")
    files = data.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values())):
        raise CorruptFileError(f"{path}: key 'files' must map file names to {{'bytes', 'sha256'}}")
    wall_time = data.get("wall_time_s", 0.0)  # the run's wall time up to the checkpoint (absent in older ones)
    if isinstance(wall_time, bool) or not isinstance(wall_time, (int, float)) or not 0 <= wall_time < float("inf"):
        raise CorruptFileError(f"{path}: key 'wall_time_s' must be a non-negative number of seconds, got {wall_time!r}")
    stream = data.get("stream")  # a streamed run's loader position (mmviews.data.streaming), JSON data
    if stream is not None and not isinstance(stream, dict):
        raise CorruptFileError(f"{path}: key 'stream' must be an object, got {type(stream).__name__}")
    return {**{k: int(data.get(k, 0)) for k in _STATE_KEYS}, "wall_time_s": float(wall_time), "files": files,
            "stream": stream}


def verify_checkpoint_file(checkpoint: Path, name: str, records: dict[str, dict[str, Any]] | None) -> Path:
    """``checkpoint/name``, after checking it exists and, when ``records`` (from
    ``train_state.json``) list it, that its size and SHA-256 are those recorded when the
    checkpoint was written. A mismatch is a :class:`CorruptFileError` naming the file."""
    path = checkpoint / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete")
    expected = None if records is None else records.get(name)
    if records is not None and expected is None:
        raise CorruptFileError(f"{path} is not listed in {checkpoint / TRAIN_STATE_FILE}: it was not written "
                               "with this checkpoint")
    if expected is not None:
        if path.stat().st_size != expected["bytes"]:
            raise CorruptFileError(f"{path} has {path.stat().st_size} bytes, {expected['bytes']} when the checkpoint "
                                   "was written: truncated or replaced; resume from an earlier checkpoint")
        if file_record(path)["sha256"] != expected["sha256"]:
            raise CorruptFileError(f"{path} does not match the SHA-256 recorded when the checkpoint was written: "
                                   "modified or replaced; resume from an earlier checkpoint")
    return path


def load_torch_file(path: Path, safe_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU: tensors, containers and numbers only
    (plus ``safe_globals``, e.g. numpy's array rebuild for RNG states). A file that names any
    other global is an :class:`UnsafePickleError` and one that cannot be read a
    :class:`CorruptFileError`; both name the file, and nothing from the file has run."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    if path.stat().st_size == 0:
        raise CorruptFileError(f"{path} is empty (truncated)")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            # mmap: a zip checkpoint's tensors are mapped, not read, so checking a big file is cheap.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        # torch's message suggests allow-listing the global: not advice to follow for a
        # checkpoint, so only the global (or the refused instruction) is quoted.
        text = str(error)
        if "Weights only load failed" in text or "GLOBAL" in text:
            found = re.search(r"GLOBAL ([\w.]+)", text)
            what = f"refused to load global '{found.group(1)}'" if found else "refused: not a weights-only torch file"
            raise UnsafePickleError(f"{path}: {what}; a checkpoint file holds only tensors and numbers, so this one "
                                    "is corrupt or was replaced (it may be malicious)") from None
        raise CorruptFileError(f"{path}: not a readable torch file ({_first_sentence(text)}): truncated or corrupt") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as error:
        raise CorruptFileError(f"{path}: not a readable torch file ({_first_sentence(str(error)) or type(error).__name__}): "
                               "truncated or corrupt") from None


def _first_sentence(text: str) -> str:
    return text.strip().splitlines()[0].split(". ")[0].rstrip(".") if text.strip() else ""


def check_safetensors(path: Path) -> Path:
    """Open a safetensors file's header and tensors; a damaged file is a :class:`CorruptFileError`
    naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key)
    except Exception as error:  # safetensors raises its own SafetensorError (not an OSError)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CorruptFileError(f"{path}: not a readable safetensors file ({first}): truncated or corrupt") from None
    return path


# --------------------------------------------------------------------------- loading a run


def build_encoder(config: TrainConfig, source: str = "recipe") -> nn.Module:
    """The recipe's :class:`MultiViewEncoder` (``adapters`` and ``encoder`` sections), freshly
    initialised; an invalid section is a :class:`ConfigError` naming ``source``."""
    try:
        encoder = MultiViewEncoder.from_config(config.encoder_config())
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{source}: keys 'adapters'/'encoder': {error}") from error
    attach_device_flow(encoder, config, source)
    return encoder


def attach_device_flow(encoder: nn.Module, config: TrainConfig, source: str = "recipe") -> None:
    """Give ``encoder`` the flow computed on the device that ``data.options`` asks for (``flow:
    raft``, :mod:`mmviews.modalities.device_flow`); a bad RAFT option is a :class:`ConfigError`."""
    from mmviews.modalities.device_flow import device_flow_for

    try:
        encoder.device_flow = device_flow_for(config.data.options or {})
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from error


def eval_loaders(config: TrainConfig, train_dataset: Dataset | None = None) -> dict[str, DataLoader | None]:
    """The recipe's evaluation loaders (see :func:`mmviews.data.loaders.build_eval_loaders`):
    ``evaluation.views``, else one natural view per modality of the training ``views``."""
    return build_eval_loaders(config.data, config.eval_view_spec, config.seed, train_dataset)


def load_checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The encoder weights of a checkpoint (``model.safetensors``, or ``pytorch_model.bin`` when
    Accelerate saved without safetensors), checked against ``train_state.json``."""
    from safetensors.torch import load_file

    records = read_train_state(checkpoint)["files"]
    if (checkpoint / "model.safetensors").is_file():
        path = check_safetensors(verify_checkpoint_file(checkpoint, "model.safetensors", records))
        return load_file(str(path))
    return load_torch_file(verify_checkpoint_file(checkpoint, "pytorch_model.bin", records))


def load_run(path: str | os.PathLike[str]) -> tuple[nn.Module, TrainConfig, dict[str, DataLoader | None]]:
    """Load a trained run for evaluation: ``(encoder, config, loaders)``.

    ``path``: a run folder (uses its ``encoder/`` if training finished, else its latest
    checkpoint) or a checkpoint folder. ``encoder(batch) -> (z [K, M, d], mask [K, M])`` is on
    CPU in eval mode; ``config`` is the run's resolved :class:`TrainConfig`; ``loaders`` maps
    ``"train"``, ``"val"``, ``"test"`` to unshuffled, un-augmented loaders of the recipe's
    splits (None for a split the recipe lacks), with the evaluation views. A damaged file is
    an error naming it (:class:`CorruptFileError`).
    """
    encoder, config = load_trained_encoder(path)
    return encoder, config, eval_loaders(config)


def load_trained_encoder(path: str | os.PathLike[str]) -> tuple[nn.Module, TrainConfig]:
    """The encoder and resolved recipe of :func:`load_run`, without building any data."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run or checkpoint at {path}")
    if not path.is_dir():
        raise RunFolderError(f"{path} is a file: give a run folder or a checkpoint folder")
    checkpoint_given = is_checkpoint(path)
    run_dir = run_dir_of(path) if checkpoint_given else path
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file() and (path / ENCODER_CONFIG).is_file():
        raise RunFolderError(f"{path} is an encoder folder (mmviews export --format hf, or a run's {ENCODER_DIR}/), not a "
                             f"run: it holds the weights without the recipe and data; give the run it came from, or "
                             "load it in Python with MultiViewEncoder.from_pretrained")
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not an mmviews run: missing {config_path}")
    config = load_config(config_path)
    if not checkpoint_given and (run_dir / ENCODER_DIR).is_dir():
        encoder = MultiViewEncoder.from_pretrained(run_dir / ENCODER_DIR)
        attach_device_flow(encoder, config, str(config_path))
    else:
        checkpoint = find_checkpoint(path)
        encoder = build_encoder(config, str(config_path))
        state = load_checkpoint_weights(checkpoint)
        try:
            encoder.load_state_dict(state, strict=True)
        except RuntimeError as error:  # missing/unexpected keys or shapes: not this recipe's encoder
            raise CorruptFileError(f"{checkpoint}: its weights do not fit the encoder of {config_path} "
                                   f"({str(error).splitlines()[0]})") from None
    encoder.eval()
    return encoder, config
