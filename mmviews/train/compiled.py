"""Compiled steps (``optimisation.compile: true``): ``torch.compile`` of every adapter's backbone
and projection head.

Each module is compiled in place (:meth:`torch.nn.Module.compile`), so parameter names, and with
them checkpoints, ``save_pretrained`` folders and the optimiser's groups, are those of the eager
run, and a run resumes with compilation switched on or off. Only the adapters are compiled: the
objectives' score matrices are already single kernels in eager mode, and the host-side
preprocessing and the optimiser gain nothing. Text batches change length from step to step;
``torch.compile``'s automatic dynamic shapes recompile once and no more, which
:func:`compiled_graphs` lets a run check. Results equal eager ones to float rounding. Shapes,
tolerances, what combinations are refused and whether it pays: ``docs/performance.md``
("Compiled steps").
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

__all__ = ["COMPILE_NOTE", "COMPILE_OPTIONS", "compile_encoder", "compiled_graphs", "quiet_compiler_logs"]

#: What ``mmviews train`` says before a compiled run's first step.
COMPILE_NOTE = ("optimisation.compile: the first step compiles the adapters' backbones and heads (minutes on a CPU, "
                "where the system's C++ compiler builds the kernels); later steps reuse the compiled code")

# The loggers of torch's compiler stack: their warnings are about its own machinery (e.g. where
# it looks for CUDA on a machine without one), not about the run.
COMPILER_LOGGERS = ("torch._dynamo", "torch._inductor", "torch.fx", "torch._functorch", "torch.utils.cpp_extension")

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


def quiet_compiler_logs() -> None:
    """Show only the errors of torch's compiler loggers (:data:`COMPILER_LOGGERS`) in this process;
    ``mmviews train --debug`` leaves them as torch set them."""
    for name in COMPILER_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def compiled_graphs() -> int:
    """How many graphs ``torch.compile`` has made in this process so far (dynamo's count of
    unique graphs): a step that leaves it unchanged compiled nothing, a recompilation adds one."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def reset_compiled() -> None:
    """Forget every compiled graph and the counts (:func:`torch._dynamo.reset`), e.g. between
    the cases of one benchmark process."""
    torch._dynamo.reset()
