"""Keys and masks of sample-keyed dropout: the hash, the step and row keys, the context
that carries them to the layers, and the keyed mask itself (:func:`keyed_dropout`).

Every element's keep/drop decision is an integer hash of (run seed, micro-batch number, sample
key, layer, element position), computed with int64 tensor ops on the tensor's device, so a row's
mask does not depend on how the batch is chunked, ordered, padded or split between processes.
The keys reach the layers through a context (:func:`dropout_step`, :func:`dropout_rows`); a keyed
layer in training mode without keys raises rather than fall back to global-RNG masks. The hash,
the positions and what a training loop does are in ``docs/dropout.md`` ("How the masks are made").

This module imports nothing of mmviews: the layers (:mod:`.layers`) and the transformers
attention (:mod:`.hf_attention`) sit on it, and the encoders on them.
"""

from __future__ import annotations

import contextlib
import zlib
from contextvars import ContextVar
from typing import Any, Iterator

import torch

__all__ = [
    "MASK32",
    "SALT_ATTR",
    "active_step_key",
    "checkpoint_context",
    "current_row_keys",
    "dropout_rows",
    "dropout_step",
    "keyed_dropout",
    "keyed_uniform_bits",
    "layer_salt",
    "mix32",
    "mix32_",
    "row_keys_for",
    "sample_row_keys",
    "step_key",
]

MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x21F0AAAD, 0x735A2D97  # hash-prospector's 2-round 32-bit finaliser; both < 2**31
_GOLDEN = 0x9E3779B9
# The attribute that holds a keyed attention module's salt (set by enable_sample_keyed_dropout,
# read by the attention code of .layers and .hf_attention; "_name" and "_layerdrop" suffixes too).
SALT_ATTR = "_mmviews_dropout_salt"


# --------------------------------------------------------------------------- hashing


def mix32(x: int) -> int:
    """The 32-bit finaliser on a Python int (the reference of :func:`mix32_`)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 15
    x = (x * _C2) & MASK32
    x ^= x >> 15
    return x


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` on an int64 tensor of values in ``[0, 2**32)``, in place (returns it).
    No product exceeds 2**63: the arithmetic is exact on every backend."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_C1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_C2).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    return x


def _fold(h: int, value: int) -> int:
    """Mix a (possibly 64-bit, possibly negative) int into the 32-bit state ``h``."""
    value &= (1 << 64) - 1
    h = mix32(h ^ (value & MASK32))
    return mix32(h ^ (value >> 32) ^ _GOLDEN)


def step_key(seed: int, micro_batch: int) -> int:
    """The 32-bit key of one micro-batch of one run."""
    return _fold(_fold(0x5EED, seed), micro_batch)


def layer_salt(name: str, namespace: str = "") -> int:
    """The salt of a layer: ``crc32`` of its qualified name (stable across runs and processes,
    unlike ``hash``), mixed so that neighbouring names are far apart."""
    return mix32(zlib.crc32(f"{namespace}/{name}".encode()))


# --------------------------------------------------------------------------- context


_STEP: ContextVar[int | None] = ContextVar("mmviews_dropout_step", default=None)  # step_key(seed, micro_batch)
_ROWS: ContextVar[torch.Tensor | None] = ContextVar("mmviews_dropout_rows", default=None)


@contextlib.contextmanager
def dropout_step(seed: int | None, micro_batch: int) -> Iterator[None]:
    """Key the sample-keyed dropout of the encoder calls inside with (``seed``, ``micro_batch``);
    ``seed=None`` does nothing (keyed dropout off). The trainer's micro-batch number must be the
    same however the micro-batch is chunked or distributed, and continue on resume."""
    if seed is None:
        yield
        return
    token = _STEP.set(step_key(seed, micro_batch))
    try:
        yield
    finally:
        _STEP.reset(token)


def active_step_key() -> int | None:
    """The key of the :func:`dropout_step` in effect, or None."""
    return _STEP.get()


@contextlib.contextmanager
def dropout_rows(keys: torch.Tensor | None) -> Iterator[None]:
    """Set the row keys (``[B]`` int64 in ``[0, 2**32)``, on the rows' device) of the encoder call
    inside; ``None`` leaves the current ones."""
    if keys is None:
        yield
        return
    token = _ROWS.set(keys)
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_row_keys() -> torch.Tensor | None:
    return _ROWS.get()


def checkpoint_context() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: activation
    checkpointing recomputes a block's forward during backward, after the encoder call's keys
    are gone; this runs the recomputation under the keys of the original forward, so that it
    drops what the forward dropped. transformers:
    ``model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": checkpoint_context})``."""
    step, rows = _STEP.get(), _ROWS.get()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        step_token, rows_token = _STEP.set(step), _ROWS.set(rows)
        try:
            yield
        finally:
            _ROWS.reset(rows_token)
            _STEP.reset(step_token)

    return contextlib.nullcontext(), replay()


def _modality_salt(modality: str) -> int:
    return mix32(zlib.crc32(f"modality/{modality}".encode()) ^ _GOLDEN)


def sample_row_keys(step: int, index: torch.Tensor, modality: str, num_views: int) -> torch.Tensor:
    """``[K * V]`` keys of the stacked items ``k * V + v`` of one modality (sample-major): a hash
    of the micro-batch key, the dataset index ``index[k]`` (``[K]``, any device), the modality
    and the view slot ``v``. Vectorised; reads nothing back."""
    idx = index.reshape(-1).long()
    lo, hi = idx & MASK32, (idx >> 32) & MASK32
    h = mix32_(lo ^ step)
    h = mix32_(h ^ hi ^ _GOLDEN)
    h = mix32_(h ^ _modality_salt(modality))
    slots = torch.arange(num_views, device=idx.device, dtype=torch.long)
    return mix32_((h.unsqueeze(1) + slots * _GOLDEN) & MASK32).reshape(-1)


def row_keys_for(batch: Any, modality: str) -> torch.Tensor | None:
    """The row keys of the adapter call that encodes ``modality`` of ``batch`` (a
    :class:`~mmviews.data.ViewBatch`): one per *present* item, in stacked order (the adapters
    encode only those), or None when no :func:`dropout_step` is in effect. A batch without
    ``index`` is an error: its rows have no key."""
    step = active_step_key()
    if step is None:
        return None
    if batch.index is None:
        raise ValueError("sample-keyed dropout needs the batch's dataset indices (ViewBatch.index) to key each "
                         f"row; modality {modality!r} has none")
    num_views = len(batch.views_of(modality))
    keys = sample_row_keys(step, batch.index, modality, num_views)
    items = batch.present_items(modality)  # known on the host
    if items.index is not None:  # some but not all items present: the adapter encodes those only
        keys = keys[items.index.to(keys.device, non_blocking=True)]
    return keys


# --------------------------------------------------------------------------- masks

_POSITIONS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
_POSITIONS_MAX = 32


def _position_hashes(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``shape``-shaped int64 hashes of element coordinates, built one dimension at a time so
    that a coordinate's hash does not depend on the sizes (a longer padding changes nothing at
    the positions both tensors have). Cached per (shape, device)."""
    cache_key = (shape, device)
    found = _POSITIONS.get(cache_key)
    if found is not None:
        return found
    h = torch.full((), 0x2545F491, dtype=torch.long, device=device)
    for dim, size in enumerate(shape):
        coords = torch.arange(size, dtype=torch.long, device=device) + ((dim + 1) * _GOLDEN & MASK32)
        h = mix32_((h.unsqueeze(-1) ^ (coords & MASK32)))
    if len(_POSITIONS) >= _POSITIONS_MAX:
        _POSITIONS.pop(next(iter(_POSITIONS)))
    _POSITIONS[cache_key] = h
    return h


def keyed_uniform_bits(rows: torch.Tensor, salt: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``[B, *shape]`` int64 hashes in ``[0, 2**32)``, uniform, of (row key, salt, coordinates)."""
    row_seeds = mix32_((rows.long() ^ mix32(salt ^ 0x51ED)) & MASK32)
    positions = _position_hashes(tuple(shape), rows.device)
    bits = row_seeds.reshape(-1, *([1] * len(shape))) ^ positions
    return mix32_(bits)


def _rows_of(x: torch.Tensor, rows: torch.Tensor, where: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The row keys of ``x``'s first dimension and the shape of one row's sub-tensor: ``[B, ...]``
    with B keys, or ``[B * r, ...]`` (r sub-rows per sample, sample-major) read as ``[B, r, ...]``."""
    b = rows.numel()
    n = x.shape[0]
    if n == b:
        return rows, tuple(x.shape[1:])
    if b > 0 and n % b == 0:
        return rows, (n // b, *x.shape[1:])
    raise RuntimeError(f"{where}: a tensor of shape {tuple(x.shape)} under {b} row keys: its first dimension must "
                       "be the rows (or rows x sub-items, sample-major)")


def keyed_dropout(x: torch.Tensor, p: float, salt: int, rows: torch.Tensor | None = None,
                  where: str = "sample-keyed dropout") -> torch.Tensor:
    """Dropout of ``x`` with the keyed mask (training semantics: call it only when dropping).
    ``rows``: the row keys (default: :func:`current_row_keys`)."""
    if p <= 0.0 or x.numel() == 0:
        return x
    if p >= 1.0:
        return x * 0.0
    rows = current_row_keys() if rows is None else rows
    if rows is None:
        raise RuntimeError(f"{where}: in training mode without row keys. Sample-keyed dropout keys each row by its "
                           "sample: run the encoder inside mmviews.modalities.dropout.dropout_step(seed, micro_batch) "
                           "on a ViewBatch with index (the trainer does), or put the model in eval mode")
    rows, row_shape = _rows_of(x, rows, where)
    bits = keyed_uniform_bits(rows.to(x.device), salt, row_shape)
    keep = (bits >= int(round(p * 2**32))).reshape(x.shape)
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)  # saves the bool mask for backward, as nn.Dropout
