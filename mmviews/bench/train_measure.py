"""The timing loop of ``mmviews bench train``: one case's run, prepared as ``mmviews train``
prepares it, timed phase by phase (:func:`measure`).

Timing. ``--warmup`` untimed steps, then ``--steps`` timed ones (defaults 2 and 10; 1 and 3
for the realistic case on CPU, where a step takes about a minute at K = 8 on 2 cores), each
phase timed with ``time.perf_counter``; the table's step time is the median step, its phase
shares those of the timed steps' total. On CUDA the benchmark (never the trainer) calls
``torch.cuda.synchronize`` between phases so that each phase's kernels are charged to it; that
removes the overlap of data copies with compute, so on CUDA the throughput (samples/s,
views/s) is measured in a second loop of ``--steps`` calls of the trainer's own ``train_step``
with a single synchronisation at the end. On CPU there is nothing to synchronise: the phase
loop's total is the throughput. A view is one (sample, view) pair: views/s = samples/s * M.

Synchronisation checks (the training loop reads nothing back from the device between log
steps): ``--sync-debug warn|error`` (CUDA) runs the throughput loop under
``torch.cuda.set_sync_debug_mode``: ``warn`` counts the synchronising calls by the source line
that made them, ``error`` stops at the first and reports it (exit status 1); each source is
printed with its known cause (:data:`KNOWN_SYNCHRONISATIONS`: fp16's GradScaler, SyncBatchNorm,
optimiser step counters on the device...) or "not a known source". torch's sync debug mode
only reports on CUDA.
``--count-host-reads N`` (any device) runs N further untimed steps under
:class:`HostReadRecorder`, which records every read of a tensor's value by Python
(``item``, ``bool``, ``int``, ``float``, ``tolist``...) and every operation whose output size
depends on values (``nonzero``, boolean-mask indexing...), outside the loader's ``next``: on an
accelerator each is a synchronisation.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from mmviews.bench.common import cuda_peak_mib, middle, reset_cuda_peak, seconds_of, synchroniser
from mmviews.bench.host_reads import HostReadRecorder
from mmviews.process_memory import resident_bytes, resident_high_water_bytes, trim_host_memory
from mmviews.train.build import RunParts
from mmviews.train.memory import tensor_bytes, tensors_in
from mmviews.train.setup import batches_forever, make_accelerator, prepare_run
from mmviews.train.step import PHASES as STEP_PHASES
from mmviews.train.step import Prepared, train_step, update_teacher

PHASES = ("data", *STEP_PHASES)  # the batch's wait, then the trainer's step's own phases


class PhaseClock:
    """The phase-end callback of :func:`mmviews.train.train_step`: at each phase's end it waits
    for the device (``sync``) and charges the seconds since the previous end to that phase.
    :meth:`start` opens a step; a phase that ends twice in a step (the optimiser phase, then the
    loop's teacher update) is charged both times."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now


def step_phases(p: Prepared, batch_iter: Iterator[Any], max_grad_norm: float | None,
                sync: Callable[[], None]) -> dict[str, float]:
    """One step of the trainer's loop, phase by phase: the batch drawn (**data**), the trainer's
    own :func:`mmviews.train.train_step` (its cached-embedding step when
    ``optimisation.encode_chunk_size`` is set) timed through its ``phase_end`` callback, and the
    loop's teacher update (charged to **optimiser**). Seconds per phase of :data:`PHASES`."""
    clock = PhaseClock(sync)
    clock.start()
    batch = next(batch_iter)
    clock("data")
    train_step(p, batch, max_grad_norm, clock)
    update_teacher(p)
    clock("optimiser")
    return clock.seconds


def loop_step(p: Prepared, batch: Any, max_grad_norm: float | None) -> None:
    """What the trainer's loop does with a batch between log steps: :func:`train_step`, then
    the EMA teacher's update after an optimiser step."""
    train_step(p, batch, max_grad_norm)
    update_teacher(p)


def _peak_memory_mb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return cuda_peak_mib(device), "torch.cuda.max_memory_allocated over the timed steps"
    return resident_high_water_bytes() / 2**20, "process RSS high-water mark (VmHWM, else resource.getrusage; main process, since start)"


#: The synchronisations known to remain in a training step, by where torch reports them (a
#: fragment of the reporting frame's ``path``, "/" separated), with their cause: what
#: ``--sync-debug`` prints next to each source line it finds. The step is free of all of them
#: with ``mixed_precision`` bf16 or no, no SyncBatchNorm (one process, or heads without
#: BatchNorm), away from log steps, and after the first step of each batch size.
KNOWN_SYNCHRONISATIONS: tuple[tuple[str, str], ...] = (
    ("torch/amp/grad_scaler.py", "fp16's GradScaler reads whether the gradients overflowed, once per optimiser step "
                                 "(bf16 needs no scaler)"),
    ("torch/nn/modules/_functions.py", "SyncBatchNorm (N > 1 GPUs) drops empty processes' statistics with a boolean "
                                       "mask, once per BatchNorm layer and step"),
    ("torch/nn/modules/batchnorm.py", "SyncBatchNorm (N > 1 GPUs), once per BatchNorm layer and step"),
    ("torch/optim/optimizer.py", "optimiser step counters on the device (capturable=False): one read per parameter "
                                 "and step"),
    ("mmviews/train/trainer.py", "the non-finite-loss check, at log steps and checkpoints only "
                                 "(output.log_every)"),
    ("mmviews/objectives/_distributed.py", "the ranks' batch sizes, read the first time each size is seen"),
    ("mmviews/objectives/ipmc/", "IPMC's lazy build (first step) and its epoch-end reads (view filter epoch, "
                                 "bank fullness)"),
)


def explain_synchronisation(where: str) -> str | None:
    """The known cause (:data:`KNOWN_SYNCHRONISATIONS`) of a synchronisation reported at
    ``where`` (``path:line``), or None: a new one, worth a look."""
    path = where.replace(os.sep, "/")
    return next((cause for fragment, cause in KNOWN_SYNCHRONISATIONS if fragment in path), None)


def _sync_debug_loop(p: Prepared, batch_iter: Iterator[Any], max_grad_norm: float | None, steps: int,
                     mode: str) -> dict[str, Any]:
    """``steps`` calls of :func:`loop_step` (with the loader's ``next``) under
    ``torch.cuda.set_sync_debug_mode(mode)``: the synchronisations by source line (``warn``),
    or the first one (``error``)."""
    found: Counter[str] = Counter()
    first: str | None = None
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            for _ in range(steps):
                batch = next(batch_iter)
                loop_step(p, batch, max_grad_norm)
        except RuntimeError as error:
            if "synchroniz" not in str(error).lower():
                raise
            tb = traceback.extract_tb(error.__traceback__)
            frames = [f for f in tb if "mmviews" in f.filename] or list(tb)
            first = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name}): {error}"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            found[f"{w.filename}:{w.lineno}"] += 1
    causes = {where: explain_synchronisation(where) or "not a known source" for where in [*found, first or ""] if where}
    return {"mode": mode, "steps": steps, "synchronisations": dict(found.most_common()), "first_error": first,
            "causes": causes}


def _trimmed_resident() -> int:
    """The resident set after ``malloc_trim`` (what the process holds, not what glibc keeps free)."""
    trim_host_memory()
    return resident_bytes()


def _optimiser_bytes(p: Prepared) -> int:
    """The parameters' gradients and the optimiser's state: the tensors a step leaves alive."""
    model = p.accelerator.unwrap_model(p.model)
    optimizer = getattr(p.optimizer, "optimizer", p.optimizer)
    return tensor_bytes([q.grad for q in model.parameters() if q.grad is not None]
                        + list(tensors_in(list(optimizer.state.values()))))


def measure(parts: RunParts, *, case: str, device: str, steps: int, warmup: int, sync_debug: str | None = None,
            count_host_reads: int = 0) -> dict[str, Any]:
    """Prepare ``parts`` as :func:`mmviews.train.train` does and time ``steps`` steps after
    ``warmup``; see the module docstring (and :mod:`mmviews.bench.train`'s for the memory
    figures) for what is measured."""
    config = parts.config
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-train-") as run_dir:
        accelerator = make_accelerator(config, Path(run_dir))
        p = prepare_run(accelerator, parts)
        dev = accelerator.device
        if dev.type != device:
            raise RuntimeError(f"bench train: asked for --device {device} but Accelerate chose {dev}")
        cuda = dev.type == "cuda"
        sync = synchroniser(dev)

        max_grad_norm = config.optimisation.max_grad_norm
        p.model.train()
        batch_iter = batches_forever(p, parts)
        before_first = _trimmed_resident()
        warmup_s = []  # a compiled run's first steps include compiling
        for i in range(warmup):
            warmup_s.append(sum(step_phases(p, batch_iter, max_grad_norm, sync).values()))
            if i == 0:
                first_step_residue = _trimmed_resident() - before_first - _optimiser_bytes(p)
        sync()
        reset_cuda_peak(dev)
        phases = {name: [] for name in PHASES}
        for _ in range(steps):
            for name, seconds in step_phases(p, batch_iter, max_grad_norm, sync).items():
                phases[name].append(seconds)
        step_times = [sum(values) for values in zip(*phases.values())]
        peak_mb, memory_method = _peak_memory_mb(dev)
        # what the process holds on the device (the allocator's cache too): the estimate's match on CUDA
        reserved_mb = cuda_peak_mib(dev, reserved=True) if cuda else None
        throughput_s = sum(step_times)
        throughput_method = "phase loop (no synchronisation to remove on CPU)"
        if cuda:  # the trainer's own step, no synchronisation between phases
            def loop() -> None:
                for _ in range(steps):
                    loop_step(p, next(batch_iter), max_grad_norm)

            sync()
            throughput_s = seconds_of(loop, sync)
            throughput_method = "train_step (+ teacher update) loop, one torch.cuda.synchronize at the end"
        result_sync = _sync_debug_loop(p, batch_iter, max_grad_norm, steps, sync_debug) if sync_debug else None
        host_reads = None
        if count_host_reads:
            recorder = HostReadRecorder()
            with recorder:
                for i in range(count_host_reads):
                    recorder.step = i
                    with recorder.paused():
                        batch = next(batch_iter)
                    loop_step(p, batch, max_grad_norm)
            host_reads = {"steps": count_host_reads, "per_step": len(recorder.reads) / count_host_reads,
                          "by_origin": recorder.summary()}
        if p.nonfinite is not None and bool(p.nonfinite):
            raise FloatingPointError(f"bench train ({case}): a non-finite loss during the benchmark")

    K, M = parts.sampler.batch_size, len(parts.view_spec)
    chunk = getattr(config.optimisation, "encode_chunk_size", None)
    checkpointed = sorted(m for m, a in config.adapters.items() if a.get("gradient_checkpointing"))
    total = sum(sum(v) for v in phases.values())
    samples_per_s = K * steps / throughput_s
    return {
        "case": case, "recipe": config.name, "K": K, "M": M, "objective": config.objective.name,
        "step": step_label(chunk, checkpointed) + ("+compiled" if config.optimisation.compile else ""),
        "compiled": config.optimisation.compile, "warmup_s": warmup_s, "encode_chunk_size": chunk, "gradient_checkpointing": checkpointed,
        "adapters": {m: a.get("type") for m, a in config.adapters.items()},
        "num_workers": config.data.num_workers, "pin_memory": bool(parts.train_loader.pin_memory),
        "mixed_precision": accelerator.mixed_precision, "mixed_precision_asked": config.optimisation.mixed_precision,
        "device": str(dev), "steps": steps, "warmup": warmup,
        "samples_per_s": samples_per_s, "views_per_s": samples_per_s * M, "throughput_method": throughput_method,
        "step_ms": 1000 * middle(step_times),
        "phase_ms": {name: 1000 * sum(v) / steps for name, v in phases.items()},
        "phase_share": {name: sum(v) / total for name, v in phases.items()},
        "peak_memory_mb": peak_mb, "memory_method": memory_method, "peak_reserved_mb": reserved_mb,
        # the host memory the first step leaves with only the gradients and optimiser state alive (the
        # estimate's framework state; None without a warm-up step)
        "first_step_residue_mb": None if warmup == 0 or cuda else first_step_residue / 2**20,
        "params_M": sum(q.numel() for q in accelerator.unwrap_model(p.model).parameters()) / 1e6,
        "sync_debug": result_sync, "host_reads": host_reads,
    }

def step_label(chunk: int | None, checkpointed: Sequence[str]) -> str:
    """``plain``, ``cached/N`` (encoder chunks of N samples), with ``+ckpt`` when adapters checkpoint."""
    label = "plain" if chunk is None else f"cached/{chunk}"
    return label + ("+ckpt" if checkpointed else "")
