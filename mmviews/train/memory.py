"""Estimated peak memory of a training step per device, from a recipe (``mmviews train RECIPE
--check``), and the ``optimisation.encode_chunk_size`` that fits a budget (``--memory-budget-gb``).

The estimate adds, per device (N processes, each encoding K/N of the K samples of a batch):

- **parameters**: every tensor of the encoder (and of the objective, e.g. IPMC's critic), in
  their own dtype;
- **gradients**: one per trainable parameter;
- **optimiser state**: AdamW two moments per trainable parameter, SGD and LARS one momentum
  buffer (none for SGD without momentum);
- **EMA teacher**: a copy of the encoder's tensors when the objective keeps one;
- **encoder activations**, measured: one forward and backward of the recipe's encoder on 2 and
  on 4 samples of the training split (as the trainer prepares them, under the recipe's mixed
  precision), counting the bytes autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded, each storage once). The
  difference is the cost per sample, the rest a fixed cost. The plain step keeps those of K/N
  samples; with ``encode_chunk_size`` C (the cached-embedding step) one chunk's, min(C, K/N),
  plus the ``[K/N, M, d]`` embeddings and their gradient;
- **objective**: the gathered ``[K, M, d]`` embeddings and their gradient, and its score blocks:
  ``(K M)^2`` float32 scores, or one block within the objective's ``score_budget_mb`` when
  larger (see :mod:`mmviews.objectives._streaming`), counted twice (forward and backward).

What it leaves out: the allocator's slack and fragmentation, the framework's workspace (cuDNN,
cuBLAS), and transient buffers of a forward without gradients. Activations are measured on the
host (CPU kernels); an accelerator's kernels may keep slightly different tensors. Treat it as a
guide within a factor of about 1.5 (``tests/test_train_memory.py`` checks the activation part
against a real step's saved tensors).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from mmviews.data.streaming import first_samples
from mmviews.train.build import RunParts, uses_teacher

GB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per device of the parts of a training step's peak (see the module docstring)."""

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
    def activations(self) -> int:
        return int(self.activation_fixed + self.activation_per_sample * self.encoded_at_once) + self.cached_embeddings

    @property
    def static(self) -> int:
        """What does not depend on the batch: weights, gradients, optimiser state, teacher."""
        return self.parameters + self.gradients + self.optimizer_state + self.teacher

    @property
    def total(self) -> int:
        return self.static + self.activations + self.objective

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
        out = [
            f"estimated peak memory per device ({step}; K = {K} samples, M = {M} views, N = {N} "
            f"process{'es' if N > 1 else ''}, {self.samples_per_device} samples per device): {_gb(self.total)}",
            f"  parameters        {_gb(self.parameters)}",
            f"  gradients         {_gb(self.gradients)}",
            f"  optimiser state   {_gb(self.optimizer_state)} ({self.optimizer})",
        ]
        if self.teacher:
            out.append(f"  EMA teacher       {_gb(self.teacher)}")
        per_sample = f"{self.activation_per_sample / 2**20:.2f} MB per sample (measured) x {self.encoded_at_once}"
        if self.chunk_size is not None:
            per_sample += f" + [K/N, M, d] embeddings and gradient {_gb(self.cached_embeddings)}"
        out += [f"  activations       {_gb(self.activations)} ({per_sample})",
                f"  objective         {_gb(self.objective)} (gathered embeddings and score blocks)"]
        if budget_gb is not None:
            out.append(self.advice(budget_gb))
        return out

    def advice(self, budget_gb: float) -> str:
        """Whether the step fits ``budget_gb`` per device, and the encode_chunk_size that would."""
        budget = budget_gb * GB
        if self.total <= budget:
            return f"fits the budget of {budget_gb:g} GB per device ({_gb(self.total)} estimated)"
        plain = self.with_chunk(None)
        chunk = self.largest_chunk_within(budget)
        if chunk is None:
            floor = self.with_chunk(1)
            return (f"does not fit the budget of {budget_gb:g} GB per device: even with "
                    f"optimisation.encode_chunk_size 1 the estimate is {_gb(floor.total)} (weights, gradients and "
                    f"optimiser state alone take {_gb(self.static)}); fine-tune fewer parameters (finetune.mode, "
                    "LoRA), use more devices, or a smaller K")
        chosen = self.with_chunk(chunk)
        return (f"does not fit the budget of {budget_gb:g} GB per device ({_gb(self.total)} estimated; the plain step "
                f"{_gb(plain.total)}): set optimisation.encode_chunk_size: {chunk} (estimated {_gb(chosen.total)}; "
                "the same K negatives, encoders run twice per step; adapters' gradient_checkpointing: true lowers the "
                "activations per sample further)")


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 2**20:.1f} MB"


def tensor_bytes(tensors: Any) -> int:
    """Bytes of ``tensors``, each storage counted once (tied weights are one tensor)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


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


def measure_activations(parts: RunParts, sizes: tuple[int, int] = (2, 4)) -> tuple[float, float]:
    """``(fixed, per_sample)`` bytes of encoder activations saved for backward, from one forward
    and backward on ``sizes[0]`` and on ``sizes[1]`` samples of the training split (as the trainer
    prepares them, under the recipe's mixed precision). The weights are left as they were
    (gradients cleared, BatchNorm running statistics restored)."""
    encoder, dataset = parts.encoder, parts.datasets["train"]
    params = {p.untyped_storage().data_ptr() for p in encoder.parameters()}
    prepare = encoder.host_preparation()
    buffers = {name: b.clone() for name, b in encoder.named_buffers()}
    precision = parts.config.optimisation.mixed_precision
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    was_training = encoder.training
    encoder.train()
    measured = []
    try:
        for n in sizes:
            if len(dataset) < n:
                raise ValueError(f"the training split has {len(dataset)} samples; measuring activations needs {n}")
            batch = prepare(parts.collator(first_samples(dataset, n)))  # read through the stream when streamed

            def step() -> None:
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    z, _ = encoder(batch)
                z.float().square().sum().backward()

            measured.append(saved_activation_bytes(step, params))
            encoder.zero_grad(set_to_none=True)
    finally:
        with torch.no_grad():
            for name, b in encoder.named_buffers():
                b.copy_(buffers[name])
        encoder.train(was_training)
    (n1, n2), (b1, b2) = sizes, measured
    per_sample = max((b2 - b1) / (n2 - n1), 0.0)
    return max(b1 - per_sample * n1, 0.0), per_sample


def objective_bytes(objective: nn.Module, K: int, M: int, d: int) -> int:
    """The objective's gathered embeddings (and gradient) and two score blocks: ``(K M)^2``
    float32 scores, or one block of its ``score_budget_mb`` when that is less."""
    scores = 4 * (K * M) ** 2
    budget = getattr(objective, "score_budget_mb", None)
    if budget is not None and math.isfinite(budget):
        scores = min(scores, int(budget * 2**20))
    return 2 * 4 * K * M * d + 2 * scores


def estimate_memory(parts: RunParts, num_processes: int = 1, chunk_size: int | None = None,
                    activations: tuple[float, float] | None = None) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of ``parts`` (a built run) on ``num_processes`` devices.
    ``chunk_size``: the recipe's ``optimisation.encode_chunk_size`` (None: the plain step).
    ``activations``: ``(fixed, per_sample)`` already measured (else :func:`measure_activations`)."""
    config, encoder, objective = parts.config, parts.encoder, parts.objective
    o = config.optimisation
    K, M = parts.sampler.batch_size, len(parts.view_spec)
    d = int(getattr(encoder, "embed_dim", 0)) or int(config.encoder.get("embed_dim", 128))
    trainable = [p for p in encoder.parameters() if p.requires_grad]
    objective_params = list(objective.parameters())
    parameters = tensor_bytes([*encoder.parameters(), *encoder.buffers(), *objective_params])
    trainable_bytes = tensor_bytes(trainable)
    teacher = tensor_bytes([*encoder.parameters(), *encoder.buffers()]) if uses_teacher(config, objective) else 0
    fixed, per_sample = activations if activations is not None else measure_activations(parts)
    return MemoryEstimate(
        samples_per_device=K // num_processes, num_views=M, embed_dim=d, num_processes=num_processes,
        chunk_size=chunk_size, parameters=parameters, gradients=trainable_bytes,
        optimizer_state=optimizer_state_bytes(o.optimizer, trainable_bytes, o.momentum), teacher=teacher,
        activation_fixed=fixed, activation_per_sample=per_sample, objective=objective_bytes(objective, K, M, d),
        optimizer=o.optimizer)


def processes_from_environment() -> int:
    """N under ``accelerate launch`` / ``torchrun`` (``WORLD_SIZE``), else 1."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1
