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

Results equal eager ones to float rounding: inductor reorders and fuses float32 arithmetic,
so embeddings differ by a few float32 ulps (measured below 1e-5 absolute on unit vectors) and
the loss and gradients by about 1e-5 relative; nothing else changes.
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
