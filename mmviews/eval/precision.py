"""Which autocast precision a run uses: ``optimisation.mixed_precision``, with ``auto`` resolved for
the device that trains.

``auto`` (the default) is bf16 where the hardware computes in bf16 natively and float32 (``no``)
everywhere else:

- a CUDA GPU that supports bf16 (``torch.cuda.is_bf16_supported()``: Ampere and later) -> ``bf16``;
- a CPU with native bf16 instructions (AVX512-BF16 or AMX, which oneDNN uses; torch says so
  with ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) -> ``bf16``;
- any other device, a CPU with AVX2 only among them -> ``no``. There torch emulates bf16 by
  converting to and from float32 around each kernel: a convolution stack under bf16 autocast
  measured 5.4x slower than in float32 on an AVX2-only CPU, a whole ucf101 step 3.2x.

fp16 is never chosen by ``auto``: it needs a gradient scaler and overflows where bf16 does not;
ask for it by name. A run resolves ``auto`` once, at its start (:func:`resolve_precision`): the
run folder's ``config.yaml`` holds the precision used, and ``results.json`` records what was
asked, what was used and why (``mixed_precision_choice``). An explicit ``bf16`` on a CPU without
native bf16 trains as asked, with one warning line (:func:`slow_bf16_line`), also from
``mmviews train --check``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from mmviews.config import TrainConfig
from mmviews.notices import MMViewsWarning

#: The values of ``optimisation.mixed_precision``.
PRECISIONS = ("auto", "no", "bf16", "fp16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), as oneDNN reports it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 path either
        return False


def has_native_bf16(device_type: str) -> bool:
    """Whether the device of type ``device_type`` (``"cuda"``, ``"cpu"``...) computes bf16 natively."""
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        return cpu_has_native_bf16()
    return False


def training_device_type(config: TrainConfig) -> str:
    """The type of device a run of ``config`` trains on, as Accelerate picks it: the CPU with
    ``cpu: true`` or without a CUDA GPU, else CUDA."""
    return "cpu" if config.cpu or not torch.cuda.is_available() else "cuda"


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``optimisation.mixed_precision`` asked, what the run uses, and why."""

    asked: str
    used: str
    device: str
    reason: str

    def line(self) -> str:
        """The line a run prints once at its start when the choice was ``auto``."""
        name = "float32" if self.used == "no" else self.used
        return f"mixed precision: auto -> {self.used} ({name}): {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choose_precision(asked: str, device_type: str) -> PrecisionChoice:
    """Resolve ``asked`` (a value of :data:`PRECISIONS`) for a device of type ``device_type``."""
    if asked not in PRECISIONS:
        raise ValueError(f"optimisation.mixed_precision must be one of {', '.join(PRECISIONS)}, got {asked!r}")
    if asked != "auto":
        return PrecisionChoice(asked, asked, device_type, "asked for by optimisation.mixed_precision")
    if has_native_bf16(device_type):
        return PrecisionChoice(asked, "bf16", device_type, f"this {device_type.upper()} computes bf16 natively")
    if device_type == "cpu":
        why = "this CPU has no native bf16 (AVX512-BF16/AMX), where bf16 autocast runs several times slower than float32"
    elif device_type == "cuda":
        why = "this GPU has no bf16 support"
    else:
        why = f"bf16 is not known to be native on {device_type!r}"
    return PrecisionChoice(asked, "no", device_type, why)


def slow_bf16_line(used: str, device_type: str) -> str | None:
    """The one-line warning for bf16 on a CPU without native bf16 (None elsewhere)."""
    if used != "bf16" or device_type != "cpu" or cpu_has_native_bf16():
        return None
    return ("optimisation.mixed_precision: bf16 on a CPU without native bf16 (AVX512-BF16/AMX): torch emulates it, "
            "several times slower than float32 here (a ucf101 step measured 3.2x); train in float32 with "
            "--set optimisation.mixed_precision=auto (or =no)")


def resolve_precision(config: TrainConfig, device_type: str | None = None) -> tuple[TrainConfig, PrecisionChoice]:
    """``config`` with ``optimisation.mixed_precision`` resolved for ``device_type`` (default: the
    device it trains on, :func:`training_device_type`), and the choice. ``config`` is not changed."""
    device_type = device_type or training_device_type(config)
    choice = choose_precision(config.optimisation.mixed_precision, device_type)
    if choice.used == config.optimisation.mixed_precision:
        return config, choice
    optimisation = dataclasses.replace(config.optimisation, mixed_precision=choice.used)
    resolved = dataclasses.replace(config, optimisation=optimisation)
    fields = {f.name for f in dataclasses.fields(config)}
    # the sections already resolved when the recipe loaded (view_spec...): the same objects
    resolved.__dict__.update({k: v for k, v in vars(config).items() if k not in fields})
    return resolved, choice


def autocast_dtype(config: TrainConfig) -> torch.dtype | None:
    """The autocast dtype of ``config``'s steps (None: float32), its precision as the run uses it:
    ``auto`` resolved for the device it trains on, so that a config no run has resolved yet (a
    benchmark's, a memory estimate's) measures what the run computes rather than float32. An
    explicit precision is read as asked, without asking which device trains."""
    asked = config.optimisation.mixed_precision
    used = choose_precision(asked, training_device_type(config)).used if asked == "auto" else asked
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(used)


def announce_precision(choice: PrecisionChoice) -> None:
    """Say once, at a run's start, what ``auto`` chose (a line on standard output), or warn that an
    explicit bf16 is slow on this CPU (:func:`slow_bf16_line`, an :class:`MMViewsWarning`)."""
    if choice.asked == "auto":
        print(choice.line(), flush=True)
    slow = slow_bf16_line(choice.used, choice.device)
    if slow is not None:
        warnings.warn(slow, MMViewsWarning, stacklevel=3)
