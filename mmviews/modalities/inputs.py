"""The adapters' input helpers: the structure checks ``preprocess`` runs (free), the value checks
(:class:`InputCheck`, which read the values), lengths and masks, moving and subsetting input dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [B, L, D]`` over the positions where ``mask [B, L]`` is True.
    Rows with no True position give zeros (not NaN)."""
    m = mask.to(x.dtype).unsqueeze(-1)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


def lengths_to_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B]`` lengths -> ``[B, max_len]`` bool, True at valid positions."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def require_tensor(inputs: Mapping[str, Any], key: str, where: str) -> torch.Tensor:
    if key not in inputs:
        raise ValueError(f"{where}: input dict has no key {key!r} (keys: {sorted(inputs)})")
    x = inputs[key]
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: inputs[{key!r}] must be a torch.Tensor, got {type(x).__name__}")
    return x


def to_device(x: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` on ``device`` (and ``dtype``). A copy from host memory does not wait for the work
    queued on the device (``non_blocking``: the data is staged before the call returns); a copy
    to the host does, since its values are read next."""
    return x.to(device, dtype, non_blocking=x.device.type == "cpu")


def input_lengths(inputs: Mapping[str, Any], x: torch.Tensor, where: str) -> torch.Tensor:
    """The ``[B]`` real lengths of ``x`` ``[B, T, ...]`` (all T when ``inputs`` has none), long, on
    ``x``'s device. Only their shape is checked here (free); :func:`check_lengths` checks values."""
    lengths = inputs.get("lengths")
    if lengths is None:  # made on x's device: no copy from the host
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    lengths = torch.as_tensor(lengths)
    if lengths.shape != (x.shape[0],):
        raise ValueError(f"{where}: lengths must be [B] in [0, {x.shape[1]}], got {lengths.tolist()[:10]}")
    return to_device(lengths, x.device, torch.long)


def check_lengths(
    lengths: torch.Tensor, max_len: int, present: torch.Tensor | None, where: str, what: str = "sequence"
) -> None:
    """``lengths [B]`` within ``[0, max_len]``, and non-zero for every present item (``present
    [B]`` bool; absent views have length 0). Reads the values: run it on host tensors."""
    if bool((lengths < 0).any()) or bool((lengths > max_len).any()):
        raise ValueError(f"{where}: lengths must be [B] in [0, {max_len}], got {lengths.tolist()[:10]}")
    need = torch.ones_like(lengths, dtype=torch.bool) if present is None else present.to(lengths.device).bool()
    empty = (lengths == 0) & need
    if bool(empty.any()):
        idx = torch.nonzero(empty).flatten().tolist()
        raise ValueError(f"{where}: zero-length {what} at batch position(s) {idx[:10]} of present views")


def per_clip(features: torch.Tensor, frames: int | None) -> torch.Tensor:
    """Backbone output of a flattened clip batch ``[B * T, F]`` -> ``[B, T, F]`` (pooled over
    time by :meth:`Adapter.project`); single images (``frames`` None) stay ``[B, F]``."""
    return features if frames is None else features.reshape(-1, frames, features.shape[-1])


def check_finite(x: torch.Tensor, where: str, key: str = "values") -> None:
    """``ValueError`` naming ``where`` and ``inputs[key]`` when the floating tensor ``x`` holds
    NaN or inf. Reads the values: run it on host tensors."""
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{where}: {bad} non-finite value(s) (NaN/inf) in inputs[{key!r}] of shape {tuple(x.shape)}")


@dataclass(frozen=True)
class InputCheck:
    """The checks of an adapter's input *values*, called as ``check(inputs, present)``.

    An adapter's ``preprocess`` checks the structure of its inputs (keys, shapes, dtypes), which
    costs nothing; checking values (finite numbers, lengths, token ids, value ranges) reads them,
    which for inputs on an accelerator is a device synchronisation. So the value checks are this
    separate object, free of weights (picklable): :meth:`Adapter.features` runs it when
    ``check_inputs`` is on, and the trainer runs every adapter's on each batch while it is still in
    host memory (:meth:`~mmviews.modalities.MultiViewEncoder.input_check`, in the loader's
    workers when there are any). Inputs of the wrong structure are passed over: ``preprocess``
    reports them.

    This base class checks that every floating tensor of the inputs is finite; adapters add
    theirs in subclasses. ``present [B]`` bool (None: all) marks the items of present views
    (absent ones are zero-filled slots: length 0, empty text)."""

    where: str

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor):
                check_finite(value, self.where, key)


@dataclass(frozen=True)
class SequenceInputCheck(InputCheck):
    """Finite values, and ``lengths`` (when given) in ``[0, T]`` and non-zero for the present items
    of ``values [B, T, ...]``."""

    what: str = "sequence"

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        super().__call__(inputs, present)
        x, lengths = inputs.get("values"), inputs.get("lengths")
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or lengths is None:
            return  # no lengths: every item has all T > 0 steps (preprocess refuses T = 0)
        lengths = torch.as_tensor(lengths)
        if lengths.shape == (x.shape[0],):
            check_lengths(lengths, x.shape[1], present, self.where, self.what)


# An adapter's preprocessing that needs no weights (e.g. tokenising text), as a picklable
# callable ``inputs -> inputs`` whose output the adapter takes with the same result: see
# :meth:`Adapter.host_preprocessor`.
HostPreprocessor = Callable[[Mapping[str, Any]], dict[str, Any]]


def subset_inputs(
    inputs: Mapping[str, Any], rows: torch.Tensor, batch_size: int, host_rows: Sequence[int] | None = None
) -> dict[str, Any]:
    """The items ``rows`` (LongTensor) of an input dict: tensors and lists whose first dimension
    is ``batch_size`` are indexed, everything else (e.g. ``sample_rate``) is kept. ``host_rows``:
    the same positions as Python ints, for list inputs (else read from ``rows``)."""
    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch_size:
            out[k] = v[to_device(rows, v.device)]
        elif isinstance(v, (list, tuple)) and len(v) == batch_size:
            if host_rows is None:
                host_rows = rows.tolist()
            out[k] = [v[i] for i in host_rows]
        else:
            out[k] = v
    return out
