"""Activation checkpointing for the adapters' own backbones (the CNNs).

``adapters.<modality>.gradient_checkpointing: true`` trades compute for memory: only each block's
input is kept for backward and the block runs again to rebuild what its gradient needs
(``torch.utils.checkpoint``, non-reentrant); the gradients are the same. The transformers and
open_clip backbones have their own switch; :func:`checkpointed` is for the CNNs' blocks. Two
details keep the plain step's results: the recomputation updates throw-away copies of BatchNorm's
running statistics, so they are updated once per step, not twice; and no ``context_fn`` is passed
(torch replays its own random state; the CNN stages hold no random layer), which is what lets
``torch.compile`` compile checkpointed layers. The checkpointed transformers layers under
sample-keyed dropout replay the forward's keys instead (:mod:`mmviews.modalities.dropout`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

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
    """``block(*args)`` (or ``call(*args)``, a function of ``block``); calls after the first (the
    recomputations in backward) leave the running statistics of its BatchNorm layers alone."""

    def __init__(self, block: nn.Module, call: Callable[..., Any] | None = None) -> None:
        self.block, self.call, self.calls = block, call or block, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.call(*args)
        with running_stats_frozen(self.block):
            return self.call(*args)


def checkpointed(block: nn.Module, *args: Any) -> Any:
    """``block(*args)``, keeping only ``args`` for backward and recomputing the rest then
    (non-reentrant ``torch.utils.checkpoint``; dropout masks are replayed from the saved RNG
    state; no ``context_fn``: the blocks given here hold no random layer, see the module
    docstring). Without gradients (``no_grad``, evaluation) it is a plain call."""
    if not torch.is_grad_enabled():
        return block(*args)
    return checkpoint(_ForwardThenRecompute(block), *args, use_reentrant=False)


class _RecomputedForward:
    """What :func:`checkpoint_blocks` puts in a block's ``forward``: its class's own forward, run
    under :func:`checkpointed`'s rules. An instance attribute, so that the block keeps its place
    and its parameters' names in the model (a wrapping module would rename them)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args: Any) -> Any:
        forward = functools.partial(type(self.block).forward, self.block)
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(_ForwardThenRecompute(self.block, forward), *args, use_reentrant=False)


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> None:
    """Make each of ``blocks`` (modules of a library's model, called by its own forward) run as
    :func:`checkpointed` runs a block: only its inputs kept for backward, its BatchNorm running
    statistics updated once. Tensors and plain values (an MViT block's ``(T, H, W)``) may be
    its arguments."""
    for block in blocks:
        block.forward = _RecomputedForward(block)  # type: ignore[method-assign]


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

