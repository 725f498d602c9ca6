"""One micro-batch's step, plain and cached: what the loop (:mod:`mmviews.train.trainer`) calls
for every batch, and the pieces both steps share.

:func:`train_step` embeds the views, runs the objective and its backward and steps the optimiser
at the end of an accumulation window. :func:`cached_train_step` (``optimisation.encode_chunk_size``)
computes the same gradient for global batches larger than the encoder's activations allow: it
encodes the batch chunk by chunk without gradients, stops the objective's backward at the
embeddings, then re-encodes each chunk with gradients, replaying its random draws (GradCache; Gao,
Zhang, Han and Callan 2021). Both share the teacher, the non-finite flag and
:func:`optimizer_step`, so they keep one contract. How each step runs, what several processes
change, and when the cached step equals the plain one are in ``docs/step.md``.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from mmviews.data.batch import ViewBatch
from mmviews.modalities.dropout import dropout_step
from mmviews.objectives import MultiViewObjective, ObjectiveOutput
from mmviews.objectives import _distributed as distributed
from mmviews.train.state import TrainState
from mmviews.train.teacher import EMATeacher
from mmviews.notices import MMViewsWarning

RNGState = tuple[torch.Tensor, torch.Tensor | None]  # (CPU state, CUDA state of the current device or None)


@dataclass
class Prepared:
    """The prepared training objects (``accelerator.prepare``) and the loop position."""

    accelerator: Any
    model: nn.Module
    objective: MultiViewObjective
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    teacher: EMATeacher | None
    state: TrainState
    total_steps: int
    batches_per_epoch: int
    # Device-side "a loss since the last check was non-finite" flag (0-dim bool; None: no step
    # since), read by the loop's _check_losses (mmviews.train.trainer) at log steps and before
    # checkpoints only: a host read of the loss at every step would wait for the device.
    nonfinite: torch.Tensor | None = None
    checked_step: int = 0  # optimiser step at the last _check_losses
    encode_chunk_size: int | None = None  # optimisation.encode_chunk_size: cached-embedding steps
    # The run's seed when its dropout is sample-keyed (optimisation.sample_keyed_dropout), else None.
    dropout_seed: int | None = None
    sharded: bool = False  # distributed.sharding: fsdp on several processes (mmviews.train.sharding)
    # Flow computed on the device from the batch's frames (data.options.flow: raft): the encoder's
    # device_flow (mmviews.modalities.device_flow), or None.
    device_flow: Any = None


def _present_mask(objective: MultiViewObjective, mask: torch.Tensor, all_present: bool) -> torch.Tensor | None:
    """The mask to pass: None when every view is present (``all_present``, known on the host:
    see ``ViewBatch.all_views_present``); an error when views are missing and the objective
    cannot take a mask."""
    if all_present:
        return None
    if not objective.supports_mask:
        raise ValueError(f"objective {objective.name!r} does not support missing views, but this batch has absent "
                         "modalities; choose an objective that takes a mask (e.g. mv_dhel, geometric_pvc) or a "
                         "dataset without missing modalities")
    return mask


def micro_batch_dropout(p: Prepared) -> contextlib.AbstractContextManager[None]:
    """The context of one micro-batch's encoder calls for sample-keyed dropout
    (:func:`mmviews.modalities.dropout.dropout_step`; nothing when it is off): keyed by the run's
    seed and the micro-batch's number in the run, ``epoch * batches_per_epoch + batch_in_epoch``
    of the TrainState, which is the same however the micro-batch is chunked or split between
    processes, and which a resumed run continues."""
    return dropout_step(p.dropout_seed, p.state.epoch * p.batches_per_epoch + p.state.batch_in_epoch)


def record_nonfinite(p: Prepared, loss: torch.Tensor) -> None:
    """Fold "this loss is NaN or inf" into the device-side flag that the loop's
    :func:`~mmviews.train.trainer._check_losses` reads at the next log step: no host
    synchronisation in the step."""
    bad = ~torch.isfinite(loss.detach())
    p.nonfinite = bad if p.nonfinite is None else p.nonfinite | bad


def average_objective_gradients(objective: MultiViewObjective) -> None:
    """The gradients of the objective's learned parameters (a learned temperature, siglip's
    bias) averaged over processes, as DDP and FSDP do for the encoder's: each process's loss
    scores its own anchors, so each holds its share of the gradient, and their mean is one
    process's on the whole batch. One small all-reduce per optimiser step; none on one process."""
    grads = [q.grad for q in objective.trained_parameters() if q.grad is not None]
    if grads and distributed.world_size() > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        distributed.average_(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def clip_gradients(p: Prepared, max_grad_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of everything the optimiser trains: the encoder's
    parameters and the objective's learned ones (a learned temperature, siglip's bias), as
    open_clip clips all of its model's parameters, logit_scale included; a large gradient of
    the scale is then bounded like the encoder's, and both share one coefficient. Under FSDP2
    Accelerate's ``clip_grad_norm_`` reduces the encoder's sharded gradients' norm over the mesh
    and adds the replicated objective parameters' norm once. Returns the norm before clipping."""
    parameters = [*p.model.parameters(), *p.objective.trained_parameters()]
    return p.accelerator.clip_grad_norm_(parameters, max_grad_norm)


def optimizer_step(p: Prepared, max_grad_norm: float | None) -> None:
    """The end of every micro-batch's step: when the accumulation window ends, the objective's
    learned parameters' gradients averaged over processes and all trained parameters' global
    gradient norm clipped (when ``max_grad_norm`` is set, :func:`clip_gradients`); then the
    optimiser and the schedule (Accelerate makes both no-ops inside an accumulation window),
    the objective's clamp of its learned parameters after a real step, and the gradients
    cleared."""
    if p.accelerator.sync_gradients:
        average_objective_gradients(p.objective)
        if max_grad_norm is not None:
            clip_gradients(p, max_grad_norm)
    p.optimizer.step()
    if p.accelerator.sync_gradients:
        p.objective.on_optimizer_step()
    p.scheduler.step()
    p.optimizer.zero_grad(set_to_none=True)


#: A step's phases, in order: ``phase_end(name)`` is called as each ends (see :func:`train_step`).
PHASES = ("flow", "forward", "objective", "backward", "optimiser")
PhaseEnd = Callable[[str], None]


def _no_phase_end(name: str) -> None:
    """No one times the step."""


def train_step(p: Prepared, batch: ViewBatch, max_grad_norm: float | None,
               phase_end: PhaseEnd | None = None) -> tuple[ObjectiveOutput, dict[str, Any]]:
    """One micro-batch: forward, loss, backward and (when gradients sync) the optimiser step.
    Returns the objective's output and the critic's metrics. With ``optimisation.encode_chunk_size``
    set, the cached-embedding step of :mod:`mmviews.train.step` instead (same contract).

    ``phase_end``: called with each name of :data:`PHASES` as that phase ends (**flow**: the flow
    computed on the device from the batch's frames, ``data.options.flow: raft``, once for the whole
    batch, before the step's plain or cached path; nothing otherwise; **forward**: the
    encoder and the EMA teacher; **objective**: ``critic_step`` and the loss; **backward**;
    **optimiser**: clipping, optimiser and schedule steps, ``on_step_end``), so that ``mmviews
    bench train`` times this very step; the step computes the same with or without it."""
    phase_end = phase_end or _no_phase_end
    if p.device_flow is not None:  # frozen RAFT, no gradient: the chunks and the teacher reuse its flow
        batch = p.device_flow.convert(batch)
    phase_end("flow")
    if p.encode_chunk_size is not None:
        return cached_train_step(p, batch, max_grad_norm, p.encode_chunk_size, phase_end)
    objective = p.objective
    with p.accelerator.accumulate(p.model), micro_batch_dropout(p):
        z, mask = p.model(batch)  # z [K/N, M, d], mask [K/N, M]
        mask = _present_mask(objective, mask, batch.all_views_present())
        teacher = p.teacher(batch)[0] if p.teacher is not None else None
        phase_end("forward")
        critic_metrics = objective.critic_step(z.detach())
        out = objective.compute(z, mask, index=batch.index if objective.takes_index else None, teacher=teacher)
        record_nonfinite(p, out.loss)
        phase_end("objective")
        p.accelerator.backward(out.loss)
        phase_end("backward")
        optimizer_step(p, max_grad_norm)
    objective.on_step_end(z.detach(), batch.index)
    phase_end("optimiser")
    return out, critic_metrics


def update_teacher(p: Prepared) -> None:
    """After an optimiser step (``sync_gradients``), the EMA teacher (when the run has one)
    follows the encoder's new weights; nothing inside an accumulation window."""
    if p.teacher is not None and p.accelerator.sync_gradients:
        p.teacher.update(p.accelerator.unwrap_model(p.model))


def chunk_bounds(num_samples: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(num_samples)`` in chunks of ``chunk_size``
    (the last one shorter when it does not divide)."""
    if chunk_size < 1:
        raise ValueError(f"encode_chunk_size must be >= 1, got {chunk_size}")
    return [(start, min(start + chunk_size, num_samples)) for start in range(0, num_samples, chunk_size)]


def _rng_state(device: torch.device) -> RNGState:
    # The CUDA generator's state (seed and offset) lives on the host: reading it does not wait.
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: RNGState, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def warn_batch_norm(encoder: nn.Module, chunk_size: int | None) -> None:
    """A warning (once, at startup) when cached steps meet BatchNorm: its batch statistics are
    per chunk of ``chunk_size`` samples, not per batch, so the step is not the plain step's."""
    if chunk_size is None:
        return
    names = [name for name, m in encoder.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not names:
        return
    where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        f"optimisation.encode_chunk_size = {chunk_size} with BatchNorm in the encoder ({where}): batch statistics "
        f"are computed per chunk of {chunk_size} samples (running statistics are updated once per chunk), so the "
        "step differs from the plain step's; for the plain step's result use encoders without BatchNorm (e.g. "
        "head.batch_norm: false, LayerNorm backbones)", MMViewsWarning, stacklevel=2)


@contextlib.contextmanager
def _batch_norm_statistics_frozen(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers use their batch's statistics (as in training) without updating their
    running statistics or ``num_batches_tracked``: pass 1, which pass 2 repeats."""
    layers = [m for m in _batch_norms(module) if m.track_running_stats]
    for m in layers:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in layers:
            m.track_running_stats = True


@torch.no_grad()
def encode_without_graph(p: Prepared, chunks: list[ViewBatch]) -> tuple[torch.Tensor, torch.Tensor, list[RNGState]]:
    """Pass 1: ``z [K, M, d]`` and ``mask [K, M]`` of the chunks, encoded one after the other
    without keeping activations, and the RNG states each chunk started with."""
    encoder = p.accelerator.unwrap_model(p.model)  # keeps Accelerate's autocast wrapper
    device = p.accelerator.device
    states, zs, masks = [], [], []
    with _batch_norm_statistics_frozen(encoder):
        for chunk in chunks:
            states.append(_rng_state(device))
            z, mask = encoder(chunk)
            zs.append(z)
            masks.append(mask)
    return torch.cat(zs), torch.cat(masks), states


def teacher_in_chunks(p: Prepared, chunks: list[ViewBatch]) -> torch.Tensor | None:
    """The EMA teacher's embeddings ``[K, M, d]``, chunk by chunk (no gradients), or None."""
    if p.teacher is None:
        return None
    return torch.cat([p.teacher(chunk)[0] for chunk in chunks])


def replay_backward(p: Prepared, chunks: list[ViewBatch], states: list[RNGState], z_grad: torch.Tensor) -> None:
    """Pass 2: each chunk re-encoded with gradients under the RNG states it had in pass 1, and
    its slice of ``z_grad`` (``dL/dz``, already scaled and divided as ``accelerator.backward``
    does) backpropagated into the encoder's ``.grad``. DDP reduces the gradients once, in the
    last chunk's backward, and only when this micro-batch ends an optimiser step."""
    accelerator, device = p.accelerator, p.accelerator.device
    after_pass_1 = _rng_state(device)
    start = 0
    for i, (chunk, state) in enumerate(zip(chunks, states)):
        last = i == len(chunks) - 1
        sync = contextlib.nullcontext() if last and accelerator.sync_gradients else accelerator.no_sync(p.model)
        _set_rng_state(state, device)
        with sync:
            z, _ = p.model(chunk)
            stop = start + z.shape[0]
            z.backward(z_grad[start:stop].to(z.dtype))
        start = stop
    _set_rng_state(after_pass_1, device)


def cached_train_step(p: Prepared, batch: ViewBatch, max_grad_norm: float | None, chunk_size: int,
                      phase_end: PhaseEnd | None = None) -> tuple[ObjectiveOutput, dict[str, Any]]:
    """:func:`train_step` as a cached-embedding step with encoder chunks
    of ``chunk_size`` samples (see ``docs/step.md``): same arguments, same calls to the
    objective, optimiser and schedule, same result (the objective's output and the critic's
    metrics); no host read of a device value. Its **forward** phase is pass 1 (and the teacher's
    chunks), its **backward** the objective's backward and pass 2."""
    objective, phase_end = p.objective, phase_end or _no_phase_end
    chunks = [batch.sample_range(start, stop) for start, stop in chunk_bounds(batch.num_samples, chunk_size)]
    # Sample-keyed dropout (when on) keys its masks by the micro-batch: the same in both passes.
    with p.accelerator.accumulate(p.model), micro_batch_dropout(p):
        z, mask, states = encode_without_graph(p, chunks)  # z [K/N, M, d], no graph
        mask = _present_mask(objective, mask, batch.all_views_present())
        teacher = teacher_in_chunks(p, chunks)
        phase_end("forward")
        critic_metrics = objective.critic_step(z.detach())
        z_leaf = z.detach().requires_grad_()  # the objective's backward stops here
        out = objective.compute(z_leaf, mask, index=batch.index if objective.takes_index else None, teacher=teacher)
        record_nonfinite(p, out.loss)
        phase_end("objective")
        p.accelerator.backward(out.loss)
        assert z_leaf.grad is not None
        replay_backward(p, chunks, states, z_leaf.grad)
        phase_end("backward")
        optimizer_step(p, max_grad_norm)
    objective.on_step_end(z.detach(), batch.index)
    phase_end("optimiser")
    return out, critic_metrics
