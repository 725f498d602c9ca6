"""Compiled steps (``optimisation.compile: true``): ``torch.compile`` of every adapter's backbone
and projection head.

Each module is compiled in place (:meth:`torch.nn.Module.compile`): its parameters keep their
names, so checkpoints, ``save_pretrained`` and the optimiser's parameter groups are those of the
eager run, and a run can be resumed with compilation switched on or off. The first step of a
shape traces and compiles (seconds to minutes on CPU, where inductor builds C++ kernels with the
system compiler); later steps of the same shapes reuse the compiled graphs without recompiling.

Shapes that vary between steps: a text batch is padded to its longest text, so its length
changes from batch to batch. ``torch.compile``'s automatic dynamic shapes handle that: the
first step at a second length recompiles once, into a graph whose length is symbolic, and no
later length recompiles (:func:`compiled_graphs` counts the graphs made, so a run can check it).
The same holds for the last, shorter batch of an epoch when ``drop_last`` is off.

What is not compiled: the objectives (their score matrices are one or two matrix products
and a log-sum-exp, already single kernels in eager mode), the host-side preprocessing
(tokenising, cropping) and the optimiser.

Results equal eager ones to float rounding, not bit for bit: inductor reorders and fuses
float32 arithmetic, so the first step's unit-vector embeddings differ by a few float32 ulps
(4.2e-7 measured on a tiny BERT) and training carries that rounding into the weights (after 7
SGD steps: embeddings 3.1e-5, weights 1.1e-5 of the largest change; tests/test_train_compiled.py
holds them to 1e-6, 1e-4 and 1e-4). Compiled dropout draws its masks from inductor's own random
stream: with dropout on, compiled and eager runs drop different units.

Activation checkpointing (an adapter's ``gradient_checkpointing``) compiles: the checkpointed
layers are traced with their recomputation (tests/test_train_compiled.py). Refused at load
(:mod:`mmviews.config`): ``compile`` with ``gradient_checkpointing`` under
``optimisation.sample_keyed_dropout``, whose checkpointing replays the sample keys through a
``context_fn`` that torch 2.11's compiler rejects.

Not covered: sample-keyed dropout (``optimisation.sample_keyed_dropout``) reads its keys from a
context the compiled graph does not see as an input, so it is not known to stay free of
recompilations; measure with ``mmviews bench train --compile`` before relying on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["COMPILE_OPTIONS", "compile_encoder", "compiled_graphs"]

#: What :func:`torch.compile` is given by default: its automatic dynamic shapes (``dynamic``
#: unset: static graphs first, a symbolic size once a size changes).
COMPILE_OPTIONS: dict[str, Any] = {}


def compile_encoder(encoder: nn.Module, **options: Any) -> list[str]:
    """Compile, in place, the backbone and the head of every adapter of ``encoder`` (a
    :class:`~mmviews.modalities.MultiViewEncoder`); ``options`` go to :func:`torch.compile`
    (default :data:`COMPILE_OPTIONS`).
    Returns the names of the modules compiled (``"text.backbone"``, ``"text.head"``...)."""
    adapters = getattr(encoder, "adapters", None)
    if adapters is None:
        raise TypeError(f"optimisation.compile: expected a MultiViewEncoder with adapters, got {type(encoder).__name__}")
    options = options or dict(COMPILE_OPTIONS)
    compiled = []
    for name, adapter in adapters.items():
        for part in ("backbone", "head"):
            module = getattr(adapter, part, None)
            if isinstance(module, nn.Module):
                module.compile(**options)
                compiled.append(f"{name}.{part}")
    return compiled


def compiled_graphs() -> int:
    """How many graphs ``torch.compile`` has made in this process so far (dynamo's count of
    unique graphs): a step that leaves it unchanged compiled nothing, a recompilation adds one."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def reset_compiled() -> None:
    """Forget every compiled graph and the counts (:func:`torch._dynamo.reset`), e.g. between
    the cases of one benchmark process."""
    torch._dynamo.reset()
