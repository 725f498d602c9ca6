"""Estimated peak memory of a training run per device, from a recipe (``mmviews train RECIPE
--check``), and the ``optimisation.encode_chunk_size`` that fits a budget (``--memory-budget-gb``).

The estimate adds, per device (N processes, each encoding K/N of the K samples of a batch),
every part as a measured or counted figure:

- **process baseline** (measured; host memory, counted in the total on CPU only): the resident
  set of the process that built the run (``/proc/self/statm`` after ``malloc_trim``): the
  interpreter, torch and the other libraries, the datasets' objects, the encoder's weights;
- **framework state** (measured; host memory, counted on CPU only): what the process keeps once
  its first steps have run, with none of their tensors alive (``malloc_trim``, then the resident
  set less the baseline, after the trial steps below): kernels made on first use (oneDNN's, per
  shape and dtype, under the recipe's precision), their caches, modules loaded on first call. A
  run's process holds it from its first step (``mmviews bench train`` prints what the first step
  left beside it);
- **parameters**: every tensor of the encoder (and of the objective, e.g. IPMC's critic), in
  their own dtype (on CPU part of the baseline; shown apart);
- **gradients**: one per trainable parameter that one backward reaches (counted after a
  backward on 2 samples: a parameter the forward leaves unused gets none);
- **optimiser state**: AdamW two moments per parameter with a gradient, SGD and LARS one
  momentum buffer (none for SGD without momentum), in the parameters' dtype;
- **EMA teacher**: a copy of the encoder's tensors when the objective keeps one;
- **sample cache** (``data.cache``; host memory): the tensors of a few samples of each split the
  run reads (the training split, and those its evaluation embeds) (measured) times the split's
  size; in-memory sample caches fill during the run;
- **sampler order** (host memory): the training sampler's shuffled order of the epoch, one int64
  per training sample (128 MiB for the 2^24 of ``identifiability``; none for a streamed split);
- **batch**: the collated inputs of K/N samples (measured on a few samples), which the step
  holds throughout, and ``prefetch_factor`` batches per loader worker (``data.num_workers``);
- **encoder activations** and **backward working memory**, measured: one forward and backward
  of the recipe's encoder on 2 and on 4 samples of the training split (as the trainer prepares
  them, under the recipe's mixed precision). Activations are the bytes autograd saves for
  backward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded, each storage
  once); the working memory is what the step holds at its peak beyond them (the gradients of
  activations in backward, an operation's outputs before the saved ones are freed), from a
  count of every tensor the step's operations allocate and free (:class:`LiveTensorBytes`).
  The difference between 2 and 4 samples is the cost per sample, the rest a fixed cost. The
  plain step holds those of K/N samples; with ``encode_chunk_size`` C (the cached-embedding
  step) one chunk's, min(C, K/N), plus the ``[K/N, M, d]`` embeddings and their gradient;
- **objective**, measured: the peak of live tensors while the objective's loss and backward run
  on random ``[K, M, d]`` embeddings (the gathered embeddings, their gradient, the score blocks;
  at K itself up to 512 samples, beyond that extrapolated from two smaller K);
- **evaluation** (with ``evaluation.tasks``): the embeddings extracted from each split the tasks
  embed (``[n, M, d]`` float32; :func:`mmviews.eval.tasks.extracted_splits`: the training split
  only for a task that fits on it, so not for ``identifiability``), held with the weights and
  optimiser state, and one evaluation batch
  (``data.eval_batch_size`` samples with the evaluation's views) encoded as the evaluation does
  it (eval mode, no gradients), measured: the collated batch, the forward's live tensors at
  their peak and the resident set's growth beyond them. The peak is the larger of the step's
  and the evaluation's: at small K the evaluation's batch (256 samples in the quickstart,
  twice its K) is the run's peak;
- **evaluation heap** (measured; host, when an evaluation runs before training steps:
  ``evaluation.random_baseline`` or ``every_epochs``): what the resident set keeps once that
  evaluation batch and its outputs are freed, beyond what it held before (glibc keeps the freed
  blocks in its heap; ``host_memory: heap`` keeps them on purpose). The training steps after the
  random-init evaluation run beside it: it counts in the step's peak, not in the evaluation's.
  Measured on the quickstart (K = 128): one evaluation batch left 132-159 MiB; the whole
  random-init evaluation 182 MiB beyond the sample cache it filled.

Sizes print in binary units, GiB (2^30 bytes) and MiB, as the resident set is counted.

What it leaves out: the allocator's fragmentation (on CPU, glibc keeps freed small blocks; the
figures in docs/memory.md put the estimate within 15 % of the measured peak RSS), the framework's
device workspace (cuDNN, cuBLAS, the CUDA context: on CUDA compare with
``torch.cuda.max_memory_reserved``), and on CUDA the host side. Activations are measured on the
host (CPU kernels); an accelerator's kernels may keep slightly different tensors.
``mmviews bench train`` prints the estimate beside the measured peak.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmviews.data.streaming import first_samples
from mmviews.eval.precision import autocast_dtype
from mmviews.eval.tasks import extracted_splits
from mmviews.process_memory import reset_resident_peak, resident_bytes, resident_peak_bytes, trim_host_memory
from mmviews.train.build import RunParts, uses_teacher
from mmviews.train.distributed import steps_on_cpu
from mmviews.train.sharding import run_sharding, unit_parameter_bytes

GB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per device of the parts of a run's peak (see the module docstring)."""

    samples_per_device: int  # K/N
    num_views: int  # M
    embed_dim: int  # d
    num_processes: int  # N
    chunk_size: int | None  # optimisation.encode_chunk_size
    parameters: int
    gradients: int
    optimizer_state: int
    teacher: int
    activation_fixed: float
    activation_per_sample: float
    objective: int
    optimizer: str
    # measured working memory of the encoder's forward and backward beyond the saved activations
    working_fixed: float = 0.0
    working_per_sample: float = 0.0
    batch_per_sample: float = 0.0  # collated (and host-prepared) inputs, bytes per sample
    prefetched_batches: int = 0  # batches waiting from the loader's workers
    baseline: int = 0  # measured resident set of the process without the parameters (host)
    sample_cache: int = 0  # data.cache: the samples of the splits the run reads, once each is read (host)
    sampler: int = 0  # the training sampler's shuffled order of the epoch, int64 per sample (host)
    evaluation: int = 0  # embeddings extracted by the evaluation (the splits its tasks embed)
    evaluation_tasks: int = 0  # the largest working memory of a task on them (identifiability's kernels)
    # measured: one evaluation batch (data.eval_batch_size samples, the evaluation's views) collated and
    # encoded without gradients, its live tensors at the peak and the resident set's growth beyond them
    evaluation_batch: int = 0
    evaluation_forward: int = 0
    evaluation_slack: int = 0
    # measured: the resident set the evaluation batch leaves once freed (host; 0 when no evaluation
    # runs before the training steps)
    evaluation_kept: int = 0
    on_host: bool = True  # the device is the host (CPU): baseline and cache count in the total
    allocator_slack: int = 0  # measured: resident-set growth over consecutive reference steps beyond their live tensors
    framework: int = 0  # measured: what the process keeps once it has run a step, no tensor alive (host)
    # distributed.sharding: fsdp on N > 1 processes: parameters, gradients, optimiser state and
    # teacher above are this process's shares (1/N); gathered: the largest sharding unit's
    # parameters, held in full while it computes, twice (the next unit is gathered ahead).
    sharded: bool = False
    gathered: int = 0

    @property
    def encoded_at_once(self) -> int:
        """Samples whose activations are kept at once: K/N, or one chunk."""
        if self.chunk_size is None:
            return self.samples_per_device
        return min(self.chunk_size, self.samples_per_device)

    @property
    def cached_embeddings(self) -> int:
        """The cached step's ``[K/N, M, d]`` float32 embeddings and their gradient (0 for the plain step)."""
        return 0 if self.chunk_size is None else 2 * 4 * self.samples_per_device * self.num_views * self.embed_dim

    @property
    def saved_activations(self) -> int:
        """Bytes autograd saves for backward while one plain step or one chunk is encoded."""
        return int(self.activation_fixed + self.activation_per_sample * self.encoded_at_once)

    @property
    def working(self) -> int:
        """The encoder's working memory at its peak beyond the saved activations."""
        return int(self.working_fixed + self.working_per_sample * self.encoded_at_once)

    @property
    def activations(self) -> int:
        return self.saved_activations + self.cached_embeddings

    @property
    def batches(self) -> int:
        """The batch the step holds, and those prefetched by loader workers."""
        return int(self.batch_per_sample * self.samples_per_device * (1 + self.prefetched_batches))

    @property
    def static(self) -> int:
        """What does not depend on the batch: weights, gradients, optimiser state, teacher (and,
        sharded, the parameters gathered for the units computing)."""
        return self.parameters + self.gradients + self.optimizer_state + self.teacher + self.gathered

    @property
    def host(self) -> int:
        """The process's host memory that is not a tensor of the step (counted on CPU only)."""
        return self.baseline + self.framework + self.sample_cache + self.sampler if self.on_host else 0

    @property
    def step_alone(self) -> int:
        """The training step's peak in a process that has run no evaluation (what ``mmviews bench
        train`` measures). The plain step computes the objective while the encoder's activations
        are held; the cached step between its two encoder passes (its peak is the larger of the
        two phases, each with the cached embeddings)."""
        encoder = self.saved_activations + self.working + self.allocator_slack
        if self.chunk_size is None:
            phases = encoder + self.objective
        else:
            phases = self.cached_embeddings + max(encoder, self.objective)
        return self.host + self.static + self.batches + phases

    @property
    def step(self) -> int:
        """The training step's peak in the run: beside the heap an evaluation before it left."""
        return self.step_alone + (self.evaluation_kept if self.on_host else 0)

    @property
    def evaluating(self) -> int:
        """The evaluation's peak: weights and optimiser state, the extracted embeddings, and one
        evaluation batch encoded without gradients (at small K larger than the training step)."""
        return (self.host + self.static - self.gradients + self.evaluation + self.evaluation_batch
                + self.evaluation_forward + self.evaluation_slack + self.evaluation_tasks)

    @property
    def total(self) -> int:
        return max(self.step, self.evaluating)

    def with_chunk(self, chunk_size: int | None) -> "MemoryEstimate":
        """The same recipe with ``encode_chunk_size`` = ``chunk_size``."""
        return dataclasses.replace(self, chunk_size=chunk_size)

    def largest_chunk_within(self, budget: float) -> int | None:
        """The largest power of two C <= K/N whose estimate fits ``budget`` bytes; None if not even C = 1."""
        best = None
        c = 1
        while c <= self.samples_per_device:
            if self.with_chunk(c).total <= budget:
                best = c
            c *= 2
        return best

    def lines(self, budget_gb: float | None = None) -> list[str]:
        """The report printed by ``mmviews train --check``."""
        K, N, M = self.samples_per_device * self.num_processes, self.num_processes, self.num_views
        step = "plain step" if self.chunk_size is None else f"cached step, encode_chunk_size {self.chunk_size}"
        where = "resident set of the process" if self.on_host else "device memory"
        out = [
            f"estimated peak memory per device ({step}; K = {K} samples, M = {M} views, N = {N} "
            f"process{'es' if N > 1 else ''}, {self.samples_per_device} samples per device; {where}): {_gb(self.total)}",
        ]
        host = "" if self.on_host else " (host memory, not in the total)"
        out += [f"  process baseline  {_gb(self.baseline)} (measured: interpreter, libraries, datasets){host}"]
        if self.framework:
            out.append(f"  framework state   {_gb(self.framework)} (measured: what the process keeps once it has run "
                       f"a step: kernels, their caches){host}")
        if self.sample_cache:
            out.append(f"  sample cache      {_gb(self.sample_cache)} (data.cache: the samples of the splits the run "
                       f"reads){host}")
        if self.sampler:
            out.append(f"  sampler order     {_gb(self.sampler)} (the epoch's shuffled order of the training samples, "
                       f"8 bytes each){host}")
        out += [
            f"  parameters        {_gb(self.parameters)}",
            f"  gradients         {_gb(self.gradients)}",
            f"  optimiser state   {_gb(self.optimizer_state)} ({self.optimizer})",
        ]
        if self.sharded:
            out.append(f"  gathered units    {_gb(self.gathered)} (distributed.sharding: fsdp: the parameters, "
                       f"gradients and optimiser state above are 1/{N} each; the largest unit held whole, twice)")
        if self.teacher:
            out.append(f"  EMA teacher       {_gb(self.teacher)}")
        prefetch = f", and {self.prefetched_batches} prefetched by the loader's workers" if self.prefetched_batches else ""
        out.append(f"  batch             {_gb(self.batches)} ({self.batch_per_sample / 2**20:.3f} MiB per sample "
                   f"x {self.samples_per_device}{prefetch})")
        per_sample = f"{self.activation_per_sample / 2**20:.2f} MiB per sample (measured) x {self.encoded_at_once}"
        if self.chunk_size is not None:
            per_sample += f" + [K/N, M, d] embeddings and gradient {_gb(self.cached_embeddings)}"
        out += [f"  activations       {_gb(self.activations)} ({per_sample})",
                f"  backward working  {_gb(self.working)} ({self.working_per_sample / 2**20:.2f} MiB per sample "
                f"(measured) x {self.encoded_at_once})",
                f"  objective         {_gb(self.objective)} (measured: loss and backward on [K, M, d] embeddings)"]
        if self.allocator_slack:
            out.append(f"  allocator slack   {_gb(self.allocator_slack)} (measured: the resident set's growth over "
                       f"{SLACK_REFERENCE_STEPS} reference steps in a row beyond their tensors)")
        if self.evaluation_kept and self.on_host:
            out.append(f"  evaluation heap   {_gb(self.evaluation_kept)} (measured: what an evaluation batch leaves in "
                       "the process once freed; the steps after the random-init evaluation run beside it)")
        if self.evaluation:
            encoded = self.evaluation_batch + self.evaluation_forward + self.evaluation_slack
            tasks = f" + {_gb(self.evaluation_tasks)} for its tasks' kernels" if self.evaluation_tasks else ""
            out.append(f"  evaluation        {_gb(self.evaluation)} extracted embeddings + {_gb(encoded)} for one "
                       f"evaluation batch encoded (measured){tasks}; evaluation peak {_gb(self.evaluating)}, the "
                       f"training step's {_gb(self.step)}: the estimate is the larger")
        if budget_gb is not None:
            out.append(self.advice(budget_gb))
        return out

    def advice(self, budget_gb: float) -> str:
        """Whether the step fits ``budget_gb`` per device, and the encode_chunk_size that would."""
        budget = budget_gb * GB
        if self.total <= budget:
            return f"fits the budget of {budget_gb:g} GiB per device ({_gb(self.total)} estimated)"
        plain = self.with_chunk(None)
        chunk = self.largest_chunk_within(budget)
        if chunk is None:
            floor = self.with_chunk(1)
            fixed = self.static + self.host
            return (f"does not fit the budget of {budget_gb:g} GiB per device: even with "
                    f"optimisation.encode_chunk_size 1 the estimate is {_gb(floor.total)} (the process, weights, "
                    f"gradients and optimiser state alone take {_gb(fixed)}); fine-tune fewer parameters "
                    "(finetune.mode, LoRA), use more devices, or a smaller K")
        chosen = self.with_chunk(chunk)
        return (f"does not fit the budget of {budget_gb:g} GiB per device ({_gb(self.total)} estimated; the plain step "
                f"{_gb(plain.total)}): set optimisation.encode_chunk_size: {chunk} (estimated {_gb(chosen.total)}; "
                "the same K negatives, encoders run twice per step; adapters' gradient_checkpointing: true lowers the "
                "activations per sample further)")


def _gb(n: float) -> str:
    """Bytes in binary units, named as such (GiB = 2^30 bytes, MiB = 2^20)."""
    return f"{n / GB:.2f} GiB" if n >= 0.1 * GB else f"{n / 2**20:.1f} MiB"


def tensor_bytes(tensors: Any) -> int:
    """Bytes of ``tensors``, each storage counted once (tied weights are one tensor)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def leaves_in(obj: Any, kind: type) -> Iterator[Any]:
    """Every value of type ``kind`` inside ``obj`` (mappings, sequences, dataclasses such as a
    ViewBatch)."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from leaves_in(value, kind)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from leaves_in(value, kind)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves_in(getattr(obj, f.name), kind)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (mappings, sequences, dataclasses such as a ViewBatch)."""
    return leaves_in(obj, torch.Tensor)


def optimizer_state_bytes(optimizer: str, trainable_bytes: int, momentum: float) -> int:
    """Optimiser state of ``trainable_bytes`` of trainable parameters (float32 state)."""
    if optimizer == "adamw":
        return 2 * trainable_bytes
    if optimizer == "lars" or (optimizer == "sgd" and momentum > 0):
        return trainable_bytes
    return 0


def saved_activation_bytes(step: Callable[[], Any], exclude: set[int]) -> int:
    """Bytes autograd saves for backward while ``step()`` runs: distinct storages, those in
    ``exclude`` (storage data pointers of the parameters) left out."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(saved.values())


class LiveTensorBytes(TorchDispatchMode):
    """While active, counts the bytes of the tensors that torch operations allocate and that are
    still alive (each storage once, released when its last tensor goes), and their peak
    :attr:`peak`: the working memory of a forward and backward, without the allocator's slack
    or an operation's internal scratch buffers. Tensors made before it started are not counted,
    nor views of them or results written into them in place (a weight's transpose, a gradient
    accumulated into ``.grad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, Any] = {}

    def _release(self, key: int, nbytes: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place result) allocated nothing: without
        # this, a parameter's transposed view or a gradient accumulated in place would count.
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key in self._alive or key in inputs:
                    continue
                nbytes = storage.nbytes()
                self._alive[key] = weakref.finalize(storage, self._release, key, nbytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return out


@dataclass
class EncoderStepMeasurement:
    """Bytes of one encoder forward and backward on ``samples`` samples (see :func:`measure_encoder_step`)."""

    samples: int
    saved: int  # saved for backward (parameters excluded)
    peak: int  # live tensors at the step's peak (gradients of parameters excluded)
    batch: int  # the collated, host-prepared batch
    resident_growth: int | None = None  # growth of the resident set's high-water mark in the step (Linux; else None)
    batch_growth: int | None = None  # the same while the batch is collated and prepared


def measure_encoder_step(parts: RunParts, sizes: tuple[int, ...] = (2, 4),
                         consecutive: bool = False) -> list[EncoderStepMeasurement]:
    """One forward and backward of the recipe's encoder on each of ``sizes`` samples of the
    training split (as the trainer prepares them, under the recipe's mixed precision): the bytes
    saved for backward, the peak of live tensors, the batch, and how much the process's resident
    set grew at its peak (after ``malloc_trim``; the allocator's slack is that growth beyond the
    live tensors). Parameter gradients exist (zeros) before each pass, so that the peak leaves
    them out (the estimate counts them apart). The weights are left as they were (gradients
    cleared, BatchNorm running statistics restored).

    ``consecutive``: the passes run one after another as a run's steps do, each on the next
    samples of the split (texts of other lengths, batches of other shapes), trimmed and reset once
    before the first only: each pass's ``resident_growth`` and ``batch_growth`` are the growth of
    the high-water mark since then, what the allocator's heap has grown to by that pass."""
    encoder, dataset = parts.encoder, parts.datasets["train"]
    params = {p.untyped_storage().data_ptr() for p in encoder.parameters()}
    prepare = encoder.host_preparation()
    buffers = {name: b.clone() for name, b in encoder.named_buffers()}
    autocast = autocast_dtype(parts.config)
    was_training = encoder.training
    encoder.train()
    measured = []
    try:
        for n in sizes:
            if len(dataset) < n:
                raise ValueError(f"the training split has {len(dataset)} samples; measuring activations needs {n}")
        # read first (through the stream when streamed): a sample cache filling is not the batch's
        windows = _sample_windows(dataset, sizes) if consecutive else None
        first_start = _reset_resident_peak() if consecutive else None
        for i, n in enumerate(sizes):
            for p in encoder.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            samples = windows[i] if windows is not None else first_samples(dataset, n)
            before_batch = first_start if consecutive else _reset_resident_peak()
            batch = prepare(parts.collator(samples))
            del samples
            batch_growth = None if before_batch is None else max(resident_peak_bytes() - before_batch, 0)

            def step() -> None:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    z, _ = encoder(batch)
                z.float().square().sum().backward()

            live = LiveTensorBytes()
            start = first_start if consecutive else _reset_resident_peak()
            with live:
                saved = saved_activation_bytes(step, params)
            growth = None if start is None else max(resident_peak_bytes() - start, 0)
            measured.append(EncoderStepMeasurement(n, saved, live.peak, tensor_bytes(tensors_in(batch)), growth,
                                                   batch_growth))
            encoder.zero_grad(set_to_none=True)
    finally:
        encoder.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in encoder.named_buffers():
                b.copy_(buffers[name])
        encoder.train(was_training)
    return measured


def _sample_windows(dataset: Any, sizes: tuple[int, ...]) -> list[list[dict[str, Any]]]:
    """The samples of consecutive passes of ``sizes`` samples: the split's first samples in
    order, one window after the other (from the start again where the split runs out)."""
    rows = first_samples(dataset, min(sum(sizes), len(dataset)))
    windows, offset = [], 0
    for n in sizes:
        windows.append([rows[(offset + j) % len(rows)] for j in range(n)])
        offset += n
    return windows


@dataclass
class EvaluationForwardMeasurement:
    """Bytes of one evaluation batch encoded without gradients (:func:`measure_evaluation_forward`)."""

    samples: int
    batch: int  # the collated, host-prepared batch
    peak: int  # live tensors at the forward's peak
    resident_growth: int | None  # growth of the resident set's high-water mark beyond the batch (Linux; else None)
    # the resident set once the batch and the outputs are freed (nothing trimmed), beyond where it
    # started: the allocator's heap that the evaluation leaves (Linux; else None)
    kept: int | None = None


def measure_evaluation_forward(parts: RunParts, samples: int | None = None) -> EvaluationForwardMeasurement | None:
    """One batch of the evaluation (``data.eval_batch_size`` samples of the training split,
    collated with the evaluation loaders' views) encoded as the evaluation encodes it: eval mode,
    no gradients, under the recipe's mixed precision. None without an evaluation loader."""
    loader = next((lo for lo in (parts.eval_loaders or {}).values() if lo is not None), None)
    if loader is None:
        return None
    encoder, dataset = parts.encoder, parts.datasets["train"]
    n = min(samples or parts.config.data.eval_batch_size or parts.config.data.batch_size, len(dataset))
    if n < 1:
        return None
    autocast = autocast_dtype(parts.config)
    was_training = encoder.training
    encoder.eval()
    try:
        rows = first_samples(dataset, n)
        trim_host_memory()
        start = _reset_resident_peak()
        batch = encoder.host_preparation()(loader.collate_fn(rows))
        del rows
        batch_bytes = tensor_bytes(tensors_in(batch))
        live = LiveTensorBytes()
        with live, torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            encoder(batch)
        growth = None if start is None else max(resident_peak_bytes() - start - batch_bytes, 0)
        del batch
        kept = None if start is None else max(resident_bytes() - start, 0)
    finally:
        encoder.train(was_training)
    return EvaluationForwardMeasurement(n, batch_bytes, live.peak, growth, kept)


def gradient_bytes(parts: RunParts, samples: int = 2) -> int:
    """Bytes of the parameter gradients one backward of the encoder produces (on ``samples``
    samples of the training split): trainable parameters that the forward does not use (a BERT
    pooler under mean pooling) get none, and the optimiser keeps no state for them. Weights and
    BatchNorm statistics are left as they were."""
    encoder, dataset = parts.encoder, parts.datasets["train"]
    prepare = encoder.host_preparation()
    buffers = {name: b.clone() for name, b in encoder.named_buffers()}
    was_training = encoder.training
    encoder.train()
    try:
        encoder.zero_grad(set_to_none=True)
        batch = prepare(parts.collator(first_samples(dataset, samples)))
        z, _ = encoder(batch)
        z.float().square().sum().backward()
        return tensor_bytes([p.grad for p in encoder.parameters() if p.grad is not None])
    finally:
        encoder.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in encoder.named_buffers():
                b.copy_(buffers[name])
        encoder.train(was_training)


def _linear(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed, per_sample)`` of the line through the first and last of ``(samples, bytes)``."""
    (n1, b1), (n2, b2) = points[0], points[-1]
    per_sample = max((b2 - b1) / (n2 - n1), 0.0)
    return max(b1 - per_sample * n1, 0.0), per_sample


def measure_activations(parts: RunParts, sizes: tuple[int, int] = (2, 4)) -> tuple[float, float]:
    """``(fixed, per_sample)`` bytes of encoder activations saved for backward, from
    :func:`measure_encoder_step` on ``sizes[0]`` and on ``sizes[1]`` samples."""
    return _linear([(m.samples, m.saved) for m in measure_encoder_step(parts, sizes)])


def objective_bytes(objective: nn.Module, K: int, M: int, d: int) -> int:
    """The objective's gathered embeddings (and gradient) and two score blocks: ``(K M)^2``
    float32 scores, or one block of its ``score_budget_mb`` when that is less."""
    scores = 4 * (K * M) ** 2
    budget = getattr(objective, "score_budget_mb", None)
    if budget is not None and math.isfinite(budget):
        scores = min(scores, int(budget * 2**20))
    return 2 * 4 * K * M * d + 2 * scores


#: Largest K at which the objective is measured; beyond it, extrapolated from two smaller sizes
#: (see :func:`measure_objective_bytes`).
OBJECTIVE_MEASURED_K = 512


def _objective_peak(objective: nn.Module, K: int, M: int, d: int) -> int:
    """Peak of live tensors of the objective's loss and backward on random unit embeddings
    ``[K, M, d]`` (float32, all views present), the embeddings and their gradient included. The
    objective's own state (memory banks, critic) is saved and put back."""
    state = copy.deepcopy(objective.state_dict())
    generator = torch.Generator().manual_seed(0)
    live = LiveTensorBytes()
    try:
        with live:
            z = torch.nn.functional.normalize(torch.randn(K, M, d, generator=generator), dim=-1).requires_grad_()
            index = torch.arange(K) if getattr(objective, "takes_index", False) else None
            teacher = z.detach().clone() if getattr(objective, "takes_teacher", False) else None
            out = objective.compute(z, None, index=index, teacher=teacher)
            out.loss.backward()
            del out, z, teacher
    finally:
        objective.load_state_dict(state)
        objective.zero_grad(set_to_none=True)
    return live.peak


def measure_objective_bytes(objective: nn.Module, K: int, M: int, d: int) -> int:
    """The objective's peak bytes at K samples (gathered from every process) of M views of
    dimension d, measured (:func:`_objective_peak`): at K itself up to
    :data:`OBJECTIVE_MEASURED_K`, beyond it extrapolated from K/2^j and K/2^(j-1) below it as
    ``b K + c K^2`` (embeddings grow with K, score blocks with K^2 until the objective's
    ``score_budget_mb`` caps them, so the extrapolation errs high). Falls back to
    :func:`objective_bytes` (counted from shapes) when the objective cannot run on random inputs."""
    try:
        if K <= OBJECTIVE_MEASURED_K:
            return _objective_peak(objective, K, M, d)
        k2 = K
        while k2 > OBJECTIVE_MEASURED_K:
            k2 //= 2
        k1 = k2 // 2
        p1, p2 = _objective_peak(objective, k1, M, d), _objective_peak(objective, k2, M, d)
    except Exception:  # an objective that needs real inputs (or a lazily built state): count instead
        return objective_bytes(objective, K, M, d)
    # p = b k + c k^2 through both points
    c = max((p2 / k2 - p1 / k1) / (k2 - k1), 0.0)
    b = max(p1 / k1 - c * k1, 0.0)
    return int(b * K + c * K * K)


def _reset_resident_peak() -> int | None:
    """Trim the allocator, reset the high-water mark to the resident set now and return it; None
    where that cannot be done."""
    trim_host_memory()
    if not reset_resident_peak():
        return None
    return resident_peak_bytes() or None


#: Samples of the reference step whose resident-set growth gives the allocator's slack (fewer
#: when their activations would pass :data:`SLACK_REFERENCE_BYTES`).
SLACK_REFERENCE_SAMPLES = 128
SLACK_REFERENCE_BYTES = 1 * GB
#: Reference steps run one after another on different samples for the slack: the heap a run's
#: steps fragment grows over its first steps, beyond what one step leaves.
SLACK_REFERENCE_STEPS = 3


def sample_bytes(dataset: Any, count: int = 4) -> float:
    """Mean bytes of the tensors (and text) of the first ``count`` samples of ``dataset``."""
    n = min(count, len(dataset))
    if n == 0:
        return 0.0
    total = 0
    for i in range(n):
        sample = dataset[i]
        total += tensor_bytes(tensors_in(sample))
        total += sum(len(v.encode()) for v in leaves_in(sample, str))
    return total / n


def evaluated_loaders(parts: RunParts) -> dict[str, Any]:
    """The evaluation loaders whose splits the recipe's tasks embed
    (:func:`mmviews.eval.tasks.extracted_splits`: e.g. not the training split for
    ``identifiability``, which fits on valid and scores on test); empty without tasks or without
    a split to evaluate on."""
    loaders = {role: loader for role, loader in (parts.eval_loaders or {}).items() if loader is not None}
    if not parts.config.evaluation.tasks or not ({"val", "test"} & set(loaders)):
        return {}
    roles = extracted_splits(parts.config.eval_tasks, "val" in loaders, "test" in loaders)
    return {role: loaders[role] for role in roles if role in loaders}


def task_working_bytes(tasks: list[Any], evaluated: dict[str, Any]) -> int:
    """The largest working memory of an evaluation task on the splits ``evaluated`` (role ->
    loader): ``identifiability``'s float64 kernels (fitted on valid and scored on test, else on
    the two halves of the evaluated split; :func:`mmviews.eval.identifiability.identifiability_peak_bytes`).
    The probes' is left out: on the embeddings of a split (``[n, d]`` float32) it is of their size."""
    from mmviews.eval.identifiability import DEFAULT_FIT_SAMPLES, identifiability_peak_bytes

    sizes = {role: len(loader.dataset) for role, loader in evaluated.items() if hasattr(loader.dataset, "__len__")}
    scored = sizes.get("test", sizes.get("val"))
    if scored is None:
        return 0
    fit, score = (sizes["val"], scored) if "val" in sizes and "test" in sizes else (scored // 2, scored - scored // 2)
    return max((identifiability_peak_bytes(fit, score, task.params.get("fit_samples", DEFAULT_FIT_SAMPLES))
                for task in tasks if task.kind == "identifiability"), default=0)


def reference_slack(parts: RunParts, samples: int, steps: int = SLACK_REFERENCE_STEPS) -> tuple[int, float | None]:
    """The allocator's slack and the collated batch's growth per sample, from ``steps``
    reference steps of ``samples`` samples run one after another on different samples
    (:func:`measure_encoder_step` with ``consecutive``), as a run's steps follow each other
    without a trim: how far the resident set's high-water mark grew over them, beyond the
    largest step's live tensors and its batch (the batch is counted apart). ``(0, None)`` where
    the resident set cannot be read."""
    refs = measure_encoder_step(parts, (samples,) * steps, consecutive=True)
    first, last = refs[0], refs[-1]
    if last.resident_growth is None:
        return 0, None
    batch = max(first.batch, first.batch_growth or 0)
    slack = max(last.resident_growth - max(r.peak for r in refs) - batch, 0)
    per_sample = None if first.batch_growth is None else first.batch_growth / first.samples
    return slack, per_sample


def _split_datasets(parts: RunParts) -> list[Any]:
    """The distinct datasets the run reads: the training split and the splits its evaluation embeds."""
    found: dict[int, Any] = {id(parts.datasets["train"]): parts.datasets["train"]}
    for loader in evaluated_loaders(parts).values():
        dataset = getattr(loader, "dataset", None)
        if dataset is not None:
            found.setdefault(id(dataset), dataset)
    return list(found.values())


def _prefetched_batches(config: Any) -> int:
    """Batches a DataLoader with ``data.num_workers`` workers keeps waiting (prefetch_factor 2 each)."""
    return 2 * config.data.num_workers


def estimate_memory(parts: RunParts, num_processes: int = 1, chunk_size: int | None = None,
                    activations: tuple[float, float] | None = None, on_host: bool | None = None,
                    measure_slack: bool = True) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of ``parts`` (a built run) on ``num_processes`` devices.
    ``chunk_size``: the recipe's ``optimisation.encode_chunk_size`` (None: the plain step).
    ``activations``: ``(fixed, per_sample)`` saved bytes already measured (the working memory is
    then not measured). ``on_host``: whether the device is the host (default: ``cpu: true`` or
    no CUDA device). ``measure_slack``: run the reference step that measures the allocator's
    slack (on the host). Call it before the run's sample cache fills: the baseline is measured now."""
    config, encoder, objective = parts.config, parts.encoder, parts.objective
    o = config.optimisation
    if on_host is None:
        on_host = steps_on_cpu(config)
    K, M = parts.sampler.batch_size, len(parts.view_spec)
    d = int(encoder.embed_dim)  # a MultiViewEncoder's: every adapter's embed_dim
    objective_params = list(objective.parameters())
    parameters = tensor_bytes([*encoder.parameters(), *encoder.buffers(), *objective_params])
    teacher = tensor_bytes([*encoder.parameters(), *encoder.buffers()]) if uses_teacher(config, objective) else 0
    trim_host_memory()
    built = resident_bytes()  # the process before its first step
    baseline = max(built - parameters, 0)
    trainable_bytes = gradient_bytes(parts)  # the parameters that get a gradient (and optimiser state)
    slack = 0
    if activations is not None:
        (fixed, per_sample), (working_fixed, working_per_sample), batch_per_sample = activations, (0.0, 0.0), 0.0
    else:
        steps = measure_encoder_step(parts)
        fixed, per_sample = _linear([(m.samples, m.saved) for m in steps])
        working_fixed, working_per_sample = _linear([(m.samples, max(m.peak - m.saved, 0)) for m in steps])
        batch_per_sample = _linear([(m.samples, m.batch) for m in steps])[1]
    # what the trial steps left with none of their tensors alive: the kernels (oneDNN's per shape and
    # dtype), their caches, libraries loaded on first use; a run's process keeps the same from its first step
    trim_host_memory()
    framework = max(resident_bytes() - built, 0)
    datasets = _split_datasets(parts)
    cache = int(sum(sample_bytes(ds) * len(ds) for ds in datasets)) if config.data.cache else 0
    # a map-style training split is drawn from a shuffled order of all its indices (ViewSetBatchSampler)
    train = parts.datasets["train"]
    sampler = 0 if getattr(train, "streamed", False) else 8 * len(train)
    # a DataLoader has no view spec: the evaluation's views (evaluation.views) are its collator's
    eval_views = max((len(getattr(loader.collate_fn, "view_spec", ())) or M for loader in parts.eval_loaders.values()
                      if loader is not None), default=M)
    evaluation = evaluation_batch = evaluation_forward = evaluation_slack = evaluation_kept = 0
    evaluation_tasks = 0
    if config.evaluation.tasks:  # the embeddings of the splits the tasks extract, [n, M, d] float32 each
        evaluated = evaluated_loaders(parts)
        evaluation = sum(4 * len(loader.dataset) * eval_views * d for loader in evaluated.values()
                         if hasattr(loader, "dataset"))
        evaluation_tasks = task_working_bytes(config.eval_tasks, evaluated)
        forward = measure_evaluation_forward(parts) if activations is None else None
        if forward is not None:
            evaluation_batch, evaluation_forward = forward.batch, forward.peak
            if on_host and forward.resident_growth is not None:
                evaluation_slack = max(forward.resident_growth - forward.peak, 0)
            evaluates_first = config.evaluation.random_baseline or config.evaluation.every_epochs
            if on_host and evaluates_first and forward.kept is not None:
                evaluation_kept = forward.kept
    # after the evaluation batch: its measurement then starts from the heap the trial steps left
    if activations is None:
        encoded = K // num_processes if chunk_size is None else min(chunk_size, K // num_processes)
        cost = per_sample + working_per_sample
        reference = min(encoded, SLACK_REFERENCE_SAMPLES, len(parts.datasets["train"]),
                        int(SLACK_REFERENCE_BYTES // cost) if cost > 0 else SLACK_REFERENCE_SAMPLES)
        if on_host and measure_slack and reference > steps[-1].samples:
            slack, ref_batch = reference_slack(parts, reference)
            if ref_batch is not None:  # collating copies each sample's tensors before stacking them
                batch_per_sample = max(batch_per_sample, ref_batch)
    objective_peak = measure_objective_bytes(objective, K, M, d)
    trim_host_memory()  # what the measurements freed goes back: the process is as it was for the run
    sharded, gathered = run_sharding(config, num_processes) == "fsdp", 0
    if sharded:  # each process keeps 1/N of the encoder's parameters (buffers and the objective's stay whole)
        whole = tensor_bytes([*encoder.buffers(), *objective_params])
        parameters = whole + -(-(parameters - whole) // num_processes)
        trainable_bytes, teacher = -(-trainable_bytes // num_processes), -(-teacher // num_processes)
        gathered = 2 * max(unit_parameter_bytes(encoder, config.distributed.fsdp_units), default=0)
    return MemoryEstimate(
        samples_per_device=K // num_processes, num_views=M, embed_dim=d, num_processes=num_processes,
        chunk_size=chunk_size, parameters=parameters, gradients=trainable_bytes,
        optimizer_state=optimizer_state_bytes(o.optimizer, trainable_bytes, o.momentum), teacher=teacher,
        activation_fixed=fixed, activation_per_sample=per_sample, objective=objective_peak,
        optimizer=o.optimizer, working_fixed=working_fixed, working_per_sample=working_per_sample,
        batch_per_sample=batch_per_sample, prefetched_batches=_prefetched_batches(config), baseline=baseline,
        sample_cache=cache, sampler=sampler, evaluation=evaluation, evaluation_tasks=evaluation_tasks,
        on_host=on_host, allocator_slack=slack, framework=framework,
        evaluation_batch=evaluation_batch, evaluation_forward=evaluation_forward, evaluation_slack=evaluation_slack,
        evaluation_kept=evaluation_kept, sharded=sharded, gathered=gathered)


def processes_from_environment() -> int:
    """N under ``accelerate launch`` / ``torchrun`` (``WORLD_SIZE``), else 1."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1
