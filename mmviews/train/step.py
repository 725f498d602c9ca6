"""One micro-batch's step, plain and cached: what the loop (:mod:`mmviews.train.trainer`) calls
for every batch, and the pieces both steps share.

**One batch through the plain step** (:func:`train_step`). The loop hands over a
:class:`~mmviews.data.batch.ViewBatch` of K/N samples (K = ``data.batch_size``, N processes),
already checked and tokenised on the host, and the :class:`Prepared` objects. Inside
``accelerator.accumulate(model)`` (which knows whether this micro-batch ends an optimiser step:
``sync_gradients``) and :func:`micro_batch_dropout` (sample-keyed dropout's key for this
micro-batch, when on):

1. the encoder embeds every view: ``z [K/N, M, d]`` and the presence ``mask [K/N, M]``;
   :func:`_present_mask` passes the mask only when the host-side batch says a view is absent;
2. the EMA teacher, when the run has one, embeds the same views without gradients;
3. the objective's ``critic_step`` sees the detached ``z``, then ``compute`` gives the loss
   (gathering across processes itself); :func:`record_nonfinite` folds "is it finite" into a
   device-side flag that the loop reads at log steps only;
4. ``accelerator.backward`` (fp16 scaling, the accumulation division, DDP's reduction when
   gradients sync) and :func:`optimizer_step` (clipping at the end of a window, optimiser,
   schedule, ``zero_grad``: no-ops inside a window);
5. after the context, ``objective.on_step_end`` with the detached ``z`` (memory banks).

The loop then counts the batch, and after an optimiser step updates the teacher and logs.

**The same batch through the cached step** (:func:`cached_train_step`, when
``optimisation.encode_chunk_size`` is set) cuts it into chunks of N samples; step 1 becomes
pass 1 below (no graph), step 4's backward stops at ``z`` and pass 2 carries ``dL/dz`` into the
encoder chunk by chunk; steps 2, 3 and 5 and :func:`optimizer_step` are the same calls.

**Cached-embedding steps**: global batches larger than the encoder's activations allow.

Recipe key ``optimisation.encode_chunk_size: N`` (samples per encoder chunk; ``null``, the
default, keeps the plain step). The method is GradCache (Gao, Zhang, Han and Callan 2021,
"Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"): a contrastive loss
couples all K samples of a batch, but its gradient reaches the encoder's weights only through
the embeddings, ``dL/dθ = sum_k (dL/dz_k) (dz_k/dθ)``, so the two factors can be computed
apart:

1. **Pass 1** encodes the process's K samples ``N`` at a time under ``no_grad`` (no activations
   kept) and concatenates the embeddings ``z [K, M, d]``. Before each chunk it records the
   random-number generators' states (CPU, and the current CUDA device's).
2. The objective sees all K samples exactly as in the plain step (gathered across processes,
   streamed when large, with its critic step, memory bank, teacher and mask), and its backward
   (``accelerator.backward``: the fp16 scaler's scale and the gradient-accumulation division
   apply) stops at ``z``, a leaf: ``g = dL/dz [K, M, d]``. The EMA teacher's embeddings are
   computed in chunks too.
3. **Pass 2** re-encodes each chunk with gradients, after restoring the RNG states it started
   with in pass 1, so that every random draw (dropout masks, stochastic depth...) repeats and
   the embeddings equal pass 1's; ``z_chunk.backward(g_chunk)`` accumulates that chunk's share
   of ``dL/dθ``. Only one chunk's activations live at a time. Afterwards the RNG states are
   put back to where pass 1 and the objective left them, so that the random stream continues
   as in the plain step.

Then clipping (``max_grad_norm``), the optimiser and schedule steps, ``zero_grad`` and the
device-side non-finite flag are those of :func:`train_step`, whose contract
this step has. Peak memory is about the weights and optimiser state, one chunk's activations,
and ``z`` with its gradient; the price is one more forward pass of the encoder (pass 1, without
gradients). ``mmviews bench train --encode-chunk-size N`` measures both.

**Several processes (DDP).** Gradients are reduced once per optimiser step, as in the plain
step: every chunk but the last runs under ``no_sync`` and the last one synchronises when
Accelerate says gradients sync (``sync_gradients``; with gradient accumulation, only at the
last micro-batch). Pass 1 calls the unwrapped encoder (no DDP forward, so no buffer broadcast),
pass 2 the DDP wrapper once per chunk; the chunk count depends only on the local batch size,
which is the same on every process (``drop_last`` global batches split evenly), so every
process issues the same collectives in the same order. As with the plain step, an encoder
parameter that gets no gradient in the synchronising backward (the last chunk holds no sample
with some modality) needs ``find_unused_parameters: true``.

**When it is exact.** The weights after any number of steps equal the plain step's up to float
rounding (summation order) when each sample's embedding does not depend on the other samples
of its chunk and random draws do not depend on how the batch is cut: LayerNorm backbones (the
transformers ones) and heads without BatchNorm, with dropout off or sample-keyed
(``optimisation.sample_keyed_dropout: true``, :mod:`mmviews.modalities.dropout`: masks hashed
from the micro-batch, the sample and the view, which this step keeps the same in both passes).
Ordinary dropout draws its masks call by call from the global RNG, so chunked draws differ from
the plain step's; the step is still a correct gradient step, since pass 2 repeats pass 1's
draws exactly. **BatchNorm** uses per-chunk batch statistics in both passes (as it
uses per-process statistics on CPU with several processes); its running statistics are updated
once per chunk, by pass 2 only (pass 1 runs BatchNorm with ``track_running_stats`` off, which
uses the batch statistics and leaves the running ones alone). :func:`warn_batch_norm` says so at
startup.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from mmviews.data.batch import ViewBatch
from mmviews.modalities.dropout import dropout_step
from mmviews.objectives import MultiViewObjective, ObjectiveOutput
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


def optimizer_step(p: Prepared, max_grad_norm: float | None) -> None:
    """The end of every micro-batch's step: clip (when the accumulation window ends and
    ``max_grad_norm`` is set), then the optimiser and the schedule (Accelerate makes both no-ops
    inside an accumulation window) and clear the gradients."""
    if p.accelerator.sync_gradients and max_grad_norm is not None:
        p.accelerator.clip_grad_norm_(p.model.parameters(), max_grad_norm)
    p.optimizer.step()
    p.scheduler.step()
    p.optimizer.zero_grad(set_to_none=True)


def train_step(p: Prepared, batch: ViewBatch, max_grad_norm: float | None) -> tuple[ObjectiveOutput, dict[str, Any]]:
    """One micro-batch: forward, loss, backward and (when gradients sync) the optimiser step.
    Returns the objective's output and the critic's metrics. With ``optimisation.encode_chunk_size``
    set, the cached-embedding step of :mod:`mmviews.train.step` instead (same contract)."""
    if p.encode_chunk_size is not None:
        return cached_train_step(p, batch, max_grad_norm, p.encode_chunk_size)
    objective = p.objective
    with p.accelerator.accumulate(p.model), micro_batch_dropout(p):
        z, mask = p.model(batch)  # z [K/N, M, d], mask [K/N, M]
        mask = _present_mask(objective, mask, batch.all_views_present())
        teacher = p.teacher(batch)[0] if p.teacher is not None else None
        critic_metrics = objective.critic_step(z.detach())
        out = objective.compute(z, mask, index=batch.index if objective.takes_index else None, teacher=teacher)
        record_nonfinite(p, out.loss)
        p.accelerator.backward(out.loss)
        optimizer_step(p, max_grad_norm)
    objective.on_step_end(z.detach(), batch.index)
    return out, critic_metrics




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


def cached_train_step(p: Prepared, batch: ViewBatch, max_grad_norm: float | None,
                      chunk_size: int) -> tuple[ObjectiveOutput, dict[str, Any]]:
    """:func:`train_step` as a cached-embedding step with encoder chunks
    of ``chunk_size`` samples (see the module docstring): same arguments, same calls to the
    objective, optimiser and schedule, same result (the objective's output and the critic's
    metrics); no host read of a device value."""
    objective = p.objective
    chunks = [batch.sample_range(start, stop) for start, stop in chunk_bounds(batch.num_samples, chunk_size)]
    # Sample-keyed dropout (when on) keys its masks by the micro-batch: the same in both passes.
    with p.accelerator.accumulate(p.model), micro_batch_dropout(p):
        z, mask, states = encode_without_graph(p, chunks)  # z [K/N, M, d], no graph
        mask = _present_mask(objective, mask, batch.all_views_present())
        teacher = teacher_in_chunks(p, chunks)
        critic_metrics = objective.critic_step(z.detach())
        z_leaf = z.detach().requires_grad_()  # the objective's backward stops here
        out = objective.compute(z_leaf, mask, index=batch.index if objective.takes_index else None, teacher=teacher)
        record_nonfinite(p, out.loss)
        p.accelerator.backward(out.loss)
        assert z_leaf.grad is not None
        replay_backward(p, chunks, states, z_leaf.grad)
        optimizer_step(p, max_grad_norm)
    objective.on_step_end(z.detach(), batch.index)
    return out, critic_metrics
