"""Checkpoints you can kill, and that hold data only: the loop position, writing and loading.

A checkpoint folder holds:

- Accelerate's ``save_state``: ``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``
  (``scaler.pt`` with fp16) and ``random_states_<process>.pkl`` (Python, numpy, torch and CUDA
  RNG states of every process);
- ``objective.pt``: the objective's ``state_dict`` (memory banks, critics);
- ``teacher.safetensors``: the EMA teacher's weights, when the run has one;
- ``train_state.json``: the loop position (:class:`~mmviews.train.state.TrainState`) and the
  size and SHA-256 of every other file (:func:`mmviews.run.checkpoint_file_records`).

Everything is written into ``checkpoints/.tmp-checkpoint-N`` and the folder is renamed to
``checkpoint-N`` only when complete, so a kill mid-write leaves the previous checkpoint
intact; the last ``keep_last`` are kept (an older one is renamed to a temporary name before it
is deleted, so that no folder named ``checkpoint-N`` is ever incomplete), the one just written
always among them: a checkpoint of a later step (a damaged one a resume skipped) is kept aside
under a name training never reads (:func:`rotate_checkpoints`).

Loading (:func:`load_checkpoint`) runs no code from the folder. Nothing is registered with
``accelerator.register_for_checkpointing`` (Accelerate reads such objects back with full
unpickling); every file is checked against ``train_state.json`` and every pickle loaded with
``weights_only=True`` before Accelerate reads anything, and Accelerate's ``load_state`` is
given a folder of links to the model, optimiser and scheduler files only. The RNG states are
restored here rather than by Accelerate, which ignores an unreadable RNG file: a damaged one
stops the resume with its name, unless ``ignore_rng`` (``--resume-ignore-rng``) accepts that
the resumed run no longer reproduces an uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mmviews.data.safe_pickle import CorruptFileError
from mmviews.fileio import atomic_write_text, commit_folder, disk_full, folder_bytes
from mmviews.run import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    OBJECTIVE_FILE,
    TEACHER_FILE,
    TMP_PREFIX,
    TRAIN_STATE_FILE,
    check_safetensors,
    checkpoint_file_records,
    list_checkpoints,
    load_torch_file,
    read_train_state,
    record_run_outputs,
    verify_checkpoint_file,
)
from mmviews.train.state import TrainState
from mmviews.notices import MMViewsWarning

if TYPE_CHECKING:
    from mmviews.train.callbacks import TrainCallback
    from mmviews.train.teacher import EMATeacher

# Files of Accelerate's save_state that its load_state reads back (model, optimiser,
# scheduler, gradient scaler, sampler): the only ones it is shown.
_ACCELERATE_FILES = re.compile(r"(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin"
                               r"|scheduler(_\d+)?\.bin|sampler(_\d+)?\.bin|scaler\.pt)")
# What numpy's RNG state (a uint32 array) needs besides tensors and containers.
_NUMPY_RNG_GLOBALS: list[Any] = [np.ndarray, np.dtype,
                                 getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]
if hasattr(np, "dtypes"):
    _NUMPY_RNG_GLOBALS.append(np.dtypes.UInt32DType)
# Checkpoints written before teacher.safetensors kept the teacher in Accelerate's custom
# checkpoint of index 1 (index 0 was the loop position, now read from train_state.json).
_LEGACY_TEACHER_FILE = "custom_checkpoint_1.pkl"


class ReproducibilityWarning(MMViewsWarning):
    """A resumed run continues, but will not reproduce an uninterrupted one exactly."""


def rng_file(process_index: int) -> str:
    """Accelerate's RNG-state file of one process."""
    return f"random_states_{process_index}.pkl"


def save_checkpoint(accelerator: Any, run_dir: Path, state: TrainState, keep_last: int, objective: nn.Module,
                    callback: TrainCallback, teacher: EMATeacher | None = None,
                    sharded: tuple[nn.Module, torch.optim.Optimizer] | None = None) -> Path:
    """``save_state`` into a temporary folder, then a durable rename
    (:func:`mmviews.fileio.commit_folder`: files flushed, renamed, parent flushed): a kill or a
    power cut mid-write never replaces a complete checkpoint. Every process calls this (each
    saves its RNG state). A full disk (:class:`mmviews.fileio.DiskFullError`) removes the
    temporary folder and leaves the previous checkpoints as they were.

    ``sharded``: the (model, optimiser) of a sharded run (:mod:`mmviews.train.sharding`): their
    shards are gathered and rank 0 writes the full tensors under Accelerate's file names, in the
    layout an unsharded run writes (the checkpoint resumes on any process count)."""
    folder = run_dir / CHECKPOINTS_DIR
    final = folder / f"{CHECKPOINT_PREFIX}{state.step:08d}"
    tmp = folder / f"{TMP_PREFIX}{state.step:08d}"
    with disk_full(folder, f"the checkpoint of step {state.step}", 
                   lambda: checkpoint_bytes(run_dir, tmp, accelerator, objective, teacher), cleanup=tmp):
        if accelerator.is_main_process:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        accelerator.wait_for_everyone()
        if sharded is None:
            accelerator.save_state(str(tmp))
        else:
            _save_sharded_state(accelerator, tmp, *sharded, teacher)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            torch.save(objective.state_dict(), tmp / OBJECTIVE_FILE)
            if teacher is not None and sharded is None:
                teacher.save(tmp / TEACHER_FILE)
            # Written last: its presence marks a complete checkpoint, and it records every file.
            record = {**state.state_dict(), "files": checkpoint_file_records(tmp)}
            atomic_write_text(tmp / TRAIN_STATE_FILE, json.dumps(record, indent=1))
            callback.on_checkpoint_written(state, tmp)
            if final.exists():  # same step saved twice (e.g. resumed and re-saved): replace it
                _remove_checkpoint(final)
            commit_folder(tmp, final)  # the flushes may be where a full disk shows (delayed allocation)
    if accelerator.is_main_process:
        rotate_checkpoints(run_dir, final, state.step, keep_last)
        record_run_outputs(run_dir)
    accelerator.wait_for_everyone()
    return final


#: The name a checkpoint beyond the step a run continued from is kept under (:func:`rotate_checkpoints`):
#: not ``checkpoint-N``, so that neither loading nor rotation ever takes it for one of the run's own.
SET_ASIDE_PREFIX = "set-aside-"


def rotate_checkpoints(run_dir: Path, committed: Path, step: int, keep_last: int) -> list[Path]:
    """After the checkpoint ``committed`` of ``step`` is written: keep the newest ``keep_last``
    checkpoints up to it, ``committed`` always among them; returns those removed.

    A checkpoint of a later step is not this run's any more (a damaged one that the resume skipped,
    or the rest of a run continued from an earlier checkpoint): ranked by step, it would push the
    checkpoint just written out. It is first kept aside, renamed ``set-aside-checkpoint-N`` (one
    warning line each), a name training never reads; the user decides what becomes of it."""
    for later in [c for c in list_checkpoints(run_dir) if _step_of(c) > step]:
        aside = _free_name(later.with_name(SET_ASIDE_PREFIX + later.name))
        os.replace(later, aside)
        warnings.warn(f"{later} is of a later step than the checkpoint of step {step} just written, so not of this "
                      f"run's course since it was resumed: kept aside as {aside.name} (training never reads it; delete "
                      "it once you no longer need it)", MMViewsWarning, stacklevel=3)
    ours = [c for c in list_checkpoints(run_dir) if c != committed]
    removed = ours[:max(len(ours) - (keep_last - 1), 0)]
    for old in removed:
        _remove_checkpoint(old)
    return removed


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name[len(CHECKPOINT_PREFIX):])


def _free_name(path: Path) -> Path:
    """``path``, or ``path.2``, ``path.3``... : the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def checkpoint_bytes(run_dir: Path, partial: Path, accelerator: Any, objective: nn.Module,
                     teacher: EMATeacher | None) -> int:
    """About the bytes a new checkpoint of the run needs (told when the disk is full): the most of
    its latest complete checkpoint's, the tensors of the prepared models, optimisers, objective
    and teacher, and what ``partial`` (the checkpoint being written) already held."""
    from mmviews.train.memory import tensor_bytes, tensors_in

    found = list_checkpoints(run_dir)
    state: list[Any] = [objective.state_dict(), teacher.state_dict() if teacher is not None else {}]
    state += [m.state_dict() for m in getattr(accelerator, "_models", [])]
    state += [o.state_dict() for o in getattr(accelerator, "_optimizers", [])]
    in_memory = tensor_bytes([t for t in tensors_in(state) if t.device.type != "meta"])
    return max(folder_bytes(found[-1]) if found else 0, in_memory, folder_bytes(partial))


# What a checkpoint holds beyond the tensors' bytes: the files' own records per tensor (zip entries
# of torch.save, safetensors' header), each process's RNG states (Python's, numpy's and torch's
# generators, ~15 KB) and the scheduler and loop-position files.
_BYTES_PER_TENSOR = 300
_RNG_BYTES_PER_PROCESS = 16 * 1024
_SMALL_FILES_BYTES = 4 * 1024


def estimate_checkpoint_bytes(encoder: nn.Module, objective: nn.Module, optimizer: str, momentum: float,
                              teacher: bool, num_processes: int = 1) -> int:
    """About the bytes of one checkpoint of a run, before it runs: the encoder's parameters and
    buffers, the optimiser's state of its trainable parameters (float32, as
    :func:`mmviews.train.memory.optimizer_state_bytes` counts it), the objective's state, the EMA
    teacher's copy (``teacher``), and the files' fixed costs (RNG states of ``num_processes``)."""
    from mmviews.train.memory import optimizer_state_bytes, tensor_bytes

    weights = tensor_bytes([*encoder.parameters(), *encoder.buffers()])
    trainable = [p for p in encoder.parameters() if p.requires_grad]
    optimizer_bytes = optimizer_state_bytes(optimizer, tensor_bytes(trainable), momentum)
    objective_state = [t for t in objective.state_dict().values() if isinstance(t, torch.Tensor)]
    # tensors written: the encoder's state (twice with a teacher), its optimiser's (up to 3 per parameter), the objective's
    tensors = len(encoder.state_dict()) * (2 if teacher else 1) + 3 * len(trainable) + len(objective_state)
    return (weights * (2 if teacher else 1) + optimizer_bytes + tensor_bytes(objective_state)
            + _BYTES_PER_TENSOR * tensors + _RNG_BYTES_PER_PROCESS * num_processes + _SMALL_FILES_BYTES)


def _save_sharded_state(accelerator: Any, folder: Path, model: nn.Module, optimizer: Any,
                        teacher: EMATeacher | None) -> None:
    """A sharded run's part of :func:`save_checkpoint`: the model's, the optimiser's and the
    teacher's full tensors gathered (collectives: every process), written by rank 0 as an
    unsharded run writes them; the rest (scheduler, RNG states) by Accelerate."""
    from safetensors.torch import save_file

    from mmviews.train.sharding import (
        accelerate_state_without,
        full_model_state,
        full_optimizer_state,
        optimizer_state_by_index,
    )

    weights = full_model_state(model)
    optimizer_state = full_optimizer_state(model, getattr(optimizer, "optimizer", optimizer))
    teacher_weights = full_model_state(teacher.module) if teacher is not None else None
    with accelerate_state_without(accelerator, model):
        accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        torch.save(optimizer_state_by_index(optimizer_state), folder / "optimizer.bin")
        if teacher_weights is not None:
            save_file({k: v.contiguous() for k, v in teacher_weights.items()}, str(folder / TEACHER_FILE))


def _load_sharded_state(checkpoint: Path, model: nn.Module, optimizer: Any, teacher: EMATeacher | None,
                        records: dict[str, Any] | None) -> None:
    """Full tensors of a checkpoint (written sharded or not) into a sharded run's model,
    optimiser and teacher shards; every process reads the files (checked, weights only)."""
    from safetensors.torch import load_file

    from mmviews.train.sharding import load_full_model_state, load_full_optimizer_state, optimizer_state_by_name

    weights = load_file(str(check_safetensors(verify_checkpoint_file(checkpoint, "model.safetensors", records))))
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)
    optimizer_state = load_torch_file(verify_checkpoint_file(checkpoint, "optimizer.bin", records))
    try:
        load_full_model_state(model, weights)
        load_full_optimizer_state(model, raw_optimizer, optimizer_state_by_name(optimizer_state, model, raw_optimizer))
        if teacher is not None:
            load_full_model_state(teacher.module, load_file(str(checkpoint / TEACHER_FILE)))
    except (KeyError, RuntimeError, ValueError) as error:
        raise CorruptFileError(f"{checkpoint}: cannot restore the sharded model/optimiser state "
                               f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                               "was it written by this recipe?") from None


def _remove_checkpoint(checkpoint: Path) -> None:
    """Delete a complete checkpoint without ever leaving half of one under its name: it is
    first renamed to a temporary name (atomic), which loading ignores and the next start
    removes if the deletion is cut short (a second Ctrl-C, a kill)."""
    doomed = checkpoint.with_name(f"{TMP_PREFIX}removed-{checkpoint.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _read_rng_states(path: Path, records: dict[str, Any] | None, on_cuda: bool) -> dict[str, Any]:
    """The RNG states of one process, checked: a bad file is a :class:`CorruptFileError`."""
    states = load_torch_file(verify_checkpoint_file(path.parent, path.name, records), _NUMPY_RNG_GLOBALS)
    try:
        # Apply to throw-away generators first: a malformed state fails here, before the
        # training generators are touched.
        random.Random().setstate(states["random_state"])
        np.random.RandomState().set_state(states["numpy_random_seed"])
        torch_state = states["torch_manual_seed"]
        if not (isinstance(torch_state, torch.Tensor) and torch_state.dtype == torch.uint8
                and torch_state.shape == torch.get_rng_state().shape):
            raise ValueError(f"torch_manual_seed is not a torch RNG state ({type(torch_state).__name__})")
        if on_cuda and "torch_cuda_manual_seed" not in states:
            raise KeyError("torch_cuda_manual_seed (the checkpoint was not written on a GPU)")
        if "torch_cuda_manual_seed" in states:
            _check_cuda_rng_states(states["torch_cuda_manual_seed"])
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptFileError(f"{path}: not Accelerate's RNG states ({type(error).__name__}: {error})") from None
    return states


def _check_cuda_rng_states(cuda_states: Any) -> None:
    """``torch_cuda_manual_seed``: a non-empty list of CUDA RNG states (1-D uint8 tensors of one
    size), one per device visible to the process that saved it; ``ValueError`` otherwise."""
    if not isinstance(cuda_states, (list, tuple)) or not cuda_states:
        raise ValueError(f"torch_cuda_manual_seed is not a list of CUDA RNG states ({type(cuda_states).__name__})")
    for i, state in enumerate(cuda_states):
        if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1
                and state.shape == cuda_states[0].shape and state.numel() > 0):
            what = f"{state.dtype} {tuple(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"torch_cuda_manual_seed[{i}] is not a CUDA RNG state like the others ({what})")


def cuda_rng_state_for_device(cuda_states: list[torch.Tensor], visible_devices: int, current_device: int,
                              local_process_index: int) -> torch.Tensor | None:
    """The saved CUDA RNG state that this process's device (``current_device``) continues with:
    a process draws only on its own device, so only that generator is restored. Accelerate saves
    one state per device visible to the saving process: with as many visible now, the state of
    the same device index; with a single state, that one; else (e.g. saved with 8 devices
    visible to each process, resumed with one each) the state of the device the process with
    this local index used, index ``local_process_index``. None: no CUDA device here, or no saved
    state for this process."""
    if visible_devices == 0:
        return None
    if len(cuda_states) == visible_devices:
        return cuda_states[current_device]
    if len(cuda_states) == 1:
        return cuda_states[0]
    return cuda_states[local_process_index] if local_process_index < len(cuda_states) else None


def _restore_rng(states: dict[str, Any], accelerator: Any) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        saved = states["torch_cuda_manual_seed"]
        state = cuda_rng_state_for_device(saved, torch.cuda.device_count(), torch.cuda.current_device(),
                                          accelerator.local_process_index)
        if state is None:
            warnings.warn(f"the checkpoint holds {len(saved)} CUDA RNG state(s), none for local process "
                          f"{accelerator.local_process_index}: its CUDA generator starts afresh; the resumed run "
                          "will not reproduce an uninterrupted run exactly", ReproducibilityWarning, stacklevel=2)
        else:
            torch.cuda.set_rng_state(state)  # the current device's generator
    if isinstance(states.get("step"), int):
        accelerator.step = states["step"]  # Accelerate's own save counter, as its load_state sets it


def load_checkpoint(checkpoint: Path, accelerator: Any, state: TrainState, objective: nn.Module,
                    teacher: EMATeacher | None = None, ignore_rng: bool = False,
                    sharded: tuple[nn.Module, torch.optim.Optimizer] | None = None) -> None:
    """Restore a checkpoint into the prepared objects (every process). Every file read is
    first checked (:func:`mmviews.run.verify_checkpoint_file`, weights-only loading); a bad
    one is an error naming it. ``ignore_rng``: a damaged RNG file is a
    :class:`ReproducibilityWarning` instead of an error. ``sharded``: the (model, optimiser) of a
    sharded run, given the checkpoint's full tensors (:func:`_load_sharded_state`)."""
    info = read_train_state(checkpoint)
    records = info["files"]
    names = sorted(p.name for p in checkpoint.iterdir() if p.is_file() and _ACCELERATE_FILES.fullmatch(p.name))
    for name in names:
        path = verify_checkpoint_file(checkpoint, name, records)
        check_safetensors(path) if name.endswith(".safetensors") else load_torch_file(path)
    objective_state = load_torch_file(verify_checkpoint_file(checkpoint, OBJECTIVE_FILE, records))
    teacher_state: dict[str, torch.Tensor] | None = None
    if teacher is not None:
        if (checkpoint / TEACHER_FILE).is_file() or records is not None:
            check_safetensors(verify_checkpoint_file(checkpoint, TEACHER_FILE, records))
        else:  # a checkpoint from before teacher.safetensors
            teacher_state = load_torch_file(verify_checkpoint_file(checkpoint, _LEGACY_TEACHER_FILE, records))
    rng_path = checkpoint / rng_file(accelerator.process_index)
    rng_states: dict[str, Any] | None = None
    try:
        rng_states = _read_rng_states(rng_path, records, accelerator.device.type == "cuda")
    except (CorruptFileError, FileNotFoundError) as error:
        saved = len(list(checkpoint.glob("random_states_*.pkl")))
        if isinstance(error, FileNotFoundError) and saved and saved != accelerator.num_processes:
            error = FileNotFoundError(f"{rng_path} is missing: the checkpoint was written by {saved} process(es), this "
                                      f"run has {accelerator.num_processes}")
        if not ignore_rng:
            raise type(error)(f"{error}. Resume from an earlier checkpoint, or pass --resume-ignore-rng to continue "
                              "without the saved random states (the run then no longer reproduces an "
                              "uninterrupted one exactly)") from None
        warnings.warn(f"{error}; continuing without the saved random states (--resume-ignore-rng): the resumed "
                      "run will not reproduce an uninterrupted run exactly", ReproducibilityWarning, stacklevel=2)

    # The objective first: loading may build lazily created parts (IPMC's critic), which
    # draws random numbers; the RNG states are restored last.
    objective.load_state_dict(_to_device(objective_state, accelerator.device))
    with tempfile.TemporaryDirectory(prefix="mmviews-load-") as staged:
        for name in names:
            try:
                os.symlink((checkpoint / name).absolute(), Path(staged) / name)
            except OSError:  # no symbolic links (e.g. Windows without the privilege): a copy
                shutil.copy2(checkpoint / name, Path(staged) / name)
        try:
            if sharded is None:
                accelerator.load_state(staged)
            else:
                from mmviews.train.sharding import accelerate_state_without

                with accelerate_state_without(accelerator, sharded[0]):
                    accelerator.load_state(staged)
        except Exception as error:  # files were checked: a mismatch with this run's model/optimiser
            raise CorruptFileError(f"{checkpoint}: cannot restore the model/optimiser/scheduler state "
                                   f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                                   "was it written by this recipe?") from None
    if sharded is not None:
        _load_sharded_state(checkpoint, *sharded, teacher, records)
    elif teacher is not None:
        if teacher_state is None:
            teacher.load(checkpoint / TEACHER_FILE)
        else:
            teacher.load_state_dict(teacher_state)
    if rng_states is not None:
        _restore_rng(rng_states, accelerator)
    state.load_state_dict(info)


def _to_device(value: Any, device: torch.device, key: Any = None) -> Any:
    """Tensors of a nested state (loaded on CPU, memory-mapped) copied to ``device``, except the
    step counters of optimiser states (0-dim ``"step"`` entries, e.g. IPMC's critic optimiser),
    copied on the CPU: torch.optim keeps them there (unless ``capturable``/``fused``, which
    its ``load_state_dict`` moves itself) and reads them with ``.item()`` at every step, a
    device synchronisation per parameter if they lived on the accelerator."""
    if isinstance(value, torch.Tensor):
        return value.to("cpu" if key == "step" and value.dim() == 0 else device, copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device, k)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
