"""Process-level settings of a run: the process group's timeout and deterministic algorithms.

**Timeout** (``distributed.timeout_s``, default 3600 s). With several processes, a process
that reaches a collective waits there for the others; past the process group's timeout the run
fails. mmviews evaluates on the main process while the others wait (a broadcast), which can
outlast NCCL's default of 10 minutes. The timeout is given to the process group when it is
created, both by the first :class:`accelerate.PartialState` (:func:`process_state`) and by the
``Accelerator`` (:func:`process_group_kwargs`, an ``InitProcessGroupKwargs`` handler).

**Determinism** (``deterministic: true``). By default a run is repeatable on CPU (same seed,
same data order, same augmentations, same weights), and a resumed run equals an uninterrupted
one there; on CUDA both hold up to the nondeterminism of some kernels (atomic adds in
scatter/index backward passes, cuBLAS's split-K reductions, cuDNN's autotuned algorithms), so
two runs of one recipe drift apart in the last bits and then further. ``deterministic: true``
sets ``torch.use_deterministic_algorithms(True)`` (an operation without a deterministic
implementation then raises, naming itself), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (which cuBLAS
reads when CUDA starts, so it is set before: :func:`configure_determinism` runs first in
:func:`mmviews.train.train`) and turns off cuDNN's autotuning: runs are bitwise repeatable on
CUDA too, at some cost in speed.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch

from mmviews.config import ConfigError, TrainConfig
from mmviews.notices import MMViewsRuntimeWarning

#: The cuBLAS workspace setting that makes its results deterministic (see the CUDA docs on
#: cuBLAS reproducibility); ":16:8" would also do, using less memory and more time.
CUBLAS_WORKSPACE = ":4096:8"


def timeout_of(config: TrainConfig) -> datetime.timedelta:
    """``distributed.timeout_s`` as a timedelta; ``ConfigError`` unless positive."""
    seconds = config.distributed.timeout_s
    if not seconds > 0:
        raise ConfigError(f"distributed.timeout_s must be > 0 seconds, got {seconds!r}")
    return datetime.timedelta(seconds=seconds)


def process_group_kwargs(config: TrainConfig) -> Any:
    """The ``Accelerator``'s ``kwargs_handlers`` entry that sets the process group's timeout."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=timeout_of(config))


def process_state(config: TrainConfig) -> Any:
    """Accelerate's :class:`~accelerate.PartialState`, creating the process group (when launched
    with several processes) with the recipe's timeout; the first call in a process decides."""
    from accelerate import PartialState

    return PartialState(cpu=config.cpu, **process_group_kwargs(config).to_kwargs())


def configure_determinism(enabled: bool) -> None:
    """With ``enabled``, deterministic algorithms for the rest of the process (see the module
    docstring); nothing otherwise (the process's own settings are left as they are). Warns when
    CUDA has already started without ``CUBLAS_WORKSPACE_CONFIG``, which it then ignores."""
    if not enabled:
        return
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and torch.cuda.is_initialized():
        warnings.warn("deterministic: CUDA started before CUBLAS_WORKSPACE_CONFIG could be set; cuBLAS may stay "
                      f"nondeterministic (set CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} in the environment)",
                      MMViewsRuntimeWarning, stacklevel=2)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
