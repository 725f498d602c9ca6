"""Activation checkpointing for the adapters' own backbones (the CNNs).

``adapters.<modality>.gradient_checkpointing: true`` trades compute for memory: instead of
keeping every intermediate activation of the backbone for backward, only each block's input is
kept, and the block's forward is run again during backward to rebuild what its gradient needs
(``torch.utils.checkpoint``, non-reentrant). The gradients are the same; the backbone's
forward runs twice per step.

The transformers and open_clip backbones have their own switch (``gradient_checkpointing_enable``,
``set_grad_checkpointing``); :func:`checkpointed` is for the blocks of the CNNs defined here.

Sample-keyed dropout (``optimisation.sample_keyed_dropout``): the recomputation in backward runs
after the forward's row keys are gone, so checkpointing passes ``checkpoint_context`` as
``torch.utils.checkpoint``'s ``context_fn`` to run it under the forward's keys.
:func:`~mmviews.modalities.dropout.enable_sample_keyed_dropout` switches that on for the
checkpointed transformers layers of the model it converts (the CNN stages given to
:func:`checkpointed` hold no random layer: nothing to replay there). Without
keyed dropout no ``context_fn`` is passed (torch replays its own random state), which is what
lets ``torch.compile`` (2.11) compile checkpointed layers: it rejects any ``context_fn``.

BatchNorm: a block's recomputation in backward runs its BatchNorm layers in training mode a
second time, which would update their running statistics twice per step. :func:`checkpointed`
lets the recomputation update throw-away copies (the batch statistics, which the output and the
gradients use, are the same both times), so the running statistics are those of the plain step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .dropout.hf_attention import set_transformers_checkpointing

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)


@contextlib.contextmanager
def running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Within the block, BatchNorm layers of ``module`` update stand-in copies of their running
    statistics (and batch counts), thrown away on exit: the originals are left as they were. The
    layers compute exactly what they do outside (same kernels, same tensors saved for backward,
    which checkpointing's recomputation requires)."""
    names = ("running_mean", "running_var", "num_batches_tracked")
    originals = [(m, {n: m._buffers[n] for n in names if m._buffers.get(n) is not None})
                 for m in module.modules() if isinstance(m, _BATCH_NORMS)]
    for m, buffers in originals:
        for name, buffer in buffers.items():
            m._buffers[name] = buffer.clone()
    try:
        yield
    finally:
        for m, buffers in originals:
            m._buffers.update(buffers)


class _ForwardThenRecompute:
    """``block(*args)``; calls after the first (the recomputations in backward) leave the
    running statistics of its BatchNorm layers alone."""

    def __init__(self, block: nn.Module) -> None:
        self.block, self.calls = block, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.block(*args)
        with running_stats_frozen(self.block):
            return self.block(*args)


def checkpointed(block: nn.Module, *args: Any) -> Any:
    """``block(*args)``, keeping only ``args`` for backward and recomputing the rest then
    (non-reentrant ``torch.utils.checkpoint``; dropout masks are replayed from the saved RNG
    state; no ``context_fn``: the blocks given here hold no random layer, see the module
    docstring). Without gradients (``no_grad``, evaluation) it is a plain call."""
    if not torch.is_grad_enabled():
        return block(*args)
    return checkpoint(_ForwardThenRecompute(block), *args, use_reentrant=False)


def enable_transformers_checkpointing(model: nn.Module, where: str) -> None:
    """transformers' own activation checkpointing of ``model``'s layers (non-reentrant, so that
    it works with frozen inputs and LoRA); a ``ValueError`` naming ``where`` when the model's
    class has none. No ``context_fn`` (see the module docstring)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{where}: {type(model).__name__} does not support gradient checkpointing")
    options: dict[str, Any] = {"use_reentrant": False}
    if getattr(model.config, "use_cache", None):  # encoders keep no cache; transformers would say so at every run
        model.config.use_cache = False
    set_transformers_checkpointing(model, options)

