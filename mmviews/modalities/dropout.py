"""Sample-keyed dropout: masks that follow the samples, not the order of random draws.

Ordinary dropout draws its masks from the global RNG stream, so the mask a sample gets
depends on everything drawn before it: how the batch is cut into chunks (cached-embedding
steps), how it is split between processes, which rows came first. Here the keep/drop
decision of every element is a hash of

    (run seed, micro-batch number, sample key, layer, element position)

where the *sample key* of a row is (dataset index, modality, view slot) and the *layer* is
a salt made from the dropout module's qualified name (``zlib.crc32``). Encoding the same
rows whole, in chunks, in another order or on N processes gives the same masks, hence the
same embeddings and gradients up to float rounding.

The hash is a 32-bit integer finaliser (two xor-shift-multiply rounds; constants from
Wellons' hash-prospector, both below 2**31 so that every product of a 32-bit value fits in
an int64 without overflow), computed with int64 tensor ops on the tensor's device: no
Python loop over rows, no host read. An element is kept when its hash is >= ``p * 2**32``,
and kept elements are scaled by ``1 / (1 - p)`` (``nn.Dropout``'s rule).

Which positions? The first dimension of the dropped tensor is the row dimension: ``[B, ...]``
with one key per row, or ``[B * r, ...]`` sample-major (the frames of B clips, ``b * r + t``),
read as ``[B, r, ...]``. The other coordinates are hashed one dimension at a time, so an
element's mask does not depend on the tensor's size either: text padded to the longest row
of a chunk gets, at each real token, the mask it gets padded to the longest row of the batch
(padding on the right, as BERT's tokenizers do; left padding shifts the positions).

How the keys get there (what a training loop does):

1. around each micro-batch, ``with dropout_step(seed, micro_batch):`` (the trainer's
   micro-batch number is ``epoch * batches_per_epoch + batch_in_epoch``, from ``TrainState``:
   the same however the batch is chunked or split, and continued by a resumed run);
2. ``MultiViewEncoder.forward`` sets, for each adapter call, the keys of the rows that call
   encodes (:func:`row_keys_for`: the present items of one modality, from ``batch.index``);
3. each :class:`SampleKeyedDropout` reads them (:func:`current_row_keys`).

Rules: in eval mode, or with ``p == 0``, a layer is the identity (as ``nn.Dropout``). In
training mode *without* row keys (a direct call outside ``dropout_step``, or a batch without
``index``) it raises ``RuntimeError`` rather than fall back to global-RNG masks: a loop that
forgot the keys would otherwise lose the guarantee silently.

:func:`enable_sample_keyed_dropout` converts a model:

- every ``nn.Dropout`` (the heads', peft's LoRA dropout, transformers' and open_clip's
  modules) becomes a :class:`SampleKeyedDropout` with the same ``p``;
- attention-probability dropout in transformers models is not a module: their attention
  kernels take ``dropout=p`` (sdpa passes it to ``F.scaled_dot_product_attention``, which draws
  its own mask). A transformers model with attention dropout is switched to the attention
  implementation :data:`KEYED_ATTENTION` registered here: the sdpa kernel when no dropout
  applies (eval, ``p == 0``), and in training the eager computation (softmax, keyed dropout of
  the probabilities, product with the values), which keeps the ``[B, heads, L, L]``
  probabilities in memory as the eager implementation does;
- ``nn.MultiheadAttention`` with ``dropout > 0`` (``nn.TransformerEncoderLayer``, the
  ``feature_sequence`` adapter) becomes :class:`SampleKeyedMultiheadAttention` (same
  parameters and state dict), which computes attention explicitly when it drops;
- HuBERT/wav2vec2 LayerDrop (``config.layerdrop``: whole layers skipped for the whole
  batch, drawn with ``torch.rand``) is keyed by (seed, micro-batch, layer): the same
  decision for every chunk and process;
- what cannot be keyed is an error naming the module (``ValueError``): other dropout
  kinds (``Dropout1d/2d/3d``, ``AlphaDropout``), open_clip's ``PatchDropout`` and its custom
  ``Attention`` with ``attn_drop``, HuBERT's SpecAugment (``spec_augment: true``), and any
  other module whose class name says it drops (``DropPath``, ``StochasticDepth``) with a
  positive rate. Modules of frozen backbones (always in eval mode) are passed over.

Activation checkpointing recomputes forwards in backward, outside these contexts: pass
:func:`checkpoint_context` as ``torch.utils.checkpoint``'s ``context_fn`` (non-reentrant).

An EMA teacher copy is re-salted (:func:`salt_sample_keyed_dropout` with another namespace)
so that its masks are independent of the student's, as two global-RNG draws would be.
"""

from __future__ import annotations

import contextlib
import types
import zlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "KEYED_ATTENTION",
    "SampleKeyedDropout",
    "SampleKeyedMultiheadAttention",
    "checkpoint_context",
    "KeyedDropoutReport",
    "current_row_keys",
    "dropout_rows",
    "dropout_step",
    "enable_sample_keyed_dropout",
    "has_sample_keyed_dropout",
    "keyed_dropout",
    "keyed_uniform_bits",
    "row_keys_for",
    "salt_sample_keyed_dropout",
    "step_key",
]

MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x21F0AAAD, 0x735A2D97  # hash-prospector's 2-round 32-bit finaliser; both < 2**31
_GOLDEN = 0x9E3779B9
KEYED_ATTENTION = "mmviews_keyed"  # the transformers attention implementation registered here
_SALT_ATTR = "_mmviews_dropout_salt"


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


# --------------------------------------------------------------------------- modules


class SampleKeyedDropout(nn.Module):
    """``nn.Dropout(p)`` whose mask is a function of the rows' sample keys and of ``salt`` (this
    layer), see the module docstring. Identity in eval mode or with ``p == 0``."""

    def __init__(self, p: float = 0.5, salt: int = 0, name: str = "") -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.salt, self.name = float(p), int(salt), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return keyed_dropout(x, self.p, self.salt, where=f"SampleKeyedDropout {self.name!r}")

    def extra_repr(self) -> str:
        return f"p={self.p}, salt={self.salt:#010x}"


class SampleKeyedMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose attention-probability dropout is sample-keyed. Set by
    :func:`enable_sample_keyed_dropout` by changing the class of an existing module (same
    parameters, same state dict). When it does not drop (eval, ``dropout == 0``) it is the parent
    class; when it does, attention is computed explicitly: ``softmax(q k^T / sqrt(d) + masks)``,
    keyed dropout of the probabilities, times ``v``. Supports packed in-projections without
    ``bias_k``/``add_zero_attn`` (what ``nn.TransformerEncoderLayer`` builds); batched inputs."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.training or self.dropout == 0.0:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        where = f"SampleKeyedMultiheadAttention {getattr(self, _SALT_ATTR + '_name', '')!r}"
        if query.dim() != 3:
            raise RuntimeError(f"{where}: unbatched inputs are not supported, got query {tuple(query.shape)}")
        if self.batch_first:
            q_in, k_in, v_in = query, key, value
        else:  # [L, B, E] -> [B, L, E]
            q_in, k_in, v_in = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, lq, e = q_in.shape
        ls, h = k_in.shape[1], self.num_heads
        dh = e // h
        if query is key and key is value:  # self-attention: one packed projection
            q, k, v = F.linear(q_in, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
            b_q = b_k = b_v = None
            if self.in_proj_bias is not None:
                b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            q, k, v = F.linear(q_in, w_q, b_q), F.linear(k_in, w_k, b_k), F.linear(v_in, w_v, b_v)
        q = q.reshape(b, lq, h, dh).transpose(1, 2)
        k = k.reshape(b, ls, h, dh).transpose(1, 2)
        v = v.reshape(b, ls, h, dh).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (dh ** -0.5)  # [B, H, Lq, Ls]
        if attn_mask is not None:
            mask = attn_mask if attn_mask.dim() == 2 else attn_mask.reshape(b, h, lq, ls)
            scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        elif is_causal:
            causal = torch.ones(lq, ls, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        if key_padding_mask is not None:
            pad = key_padding_mask[:, None, None, :]
            scores = scores.masked_fill(pad, float("-inf")) if pad.dtype == torch.bool else scores + pad
        probs = torch.softmax(scores, dim=-1)
        dropped = keyed_dropout(probs, self.dropout, int(getattr(self, _SALT_ATTR)), where=where)
        out = (dropped @ v).transpose(1, 2).reshape(b, lq, e)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, probs.mean(1) if average_attn_weights else probs


def _keyed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transformers attention function of :data:`KEYED_ATTENTION`: sdpa when nothing drops;
    in training with ``dropout > 0``, eager attention with the probabilities' dropout keyed by
    the rows (``query [B, heads, Lq, d]``) and the module's salt. Masks are sdpa's (boolean, True
    where a key may be attended to) or additive."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dropout == 0.0 or not module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)
    salt = getattr(module, _SALT_ATTR, None)
    if salt is None:
        raise RuntimeError(f"{type(module).__name__}: attention implementation {KEYED_ATTENTION!r} on a module that "
                           "enable_sample_keyed_dropout did not salt")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:  # as eager's additive mask: the most negative value, not -inf
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    elif kwargs.get("is_causal", getattr(module, "is_causal", False)) and query.shape[2] > 1:
        # sdpa's mask function leaves a causal mask out (the kernel's is_causal flag does it)
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=scores.device)
        scores = scores.masked_fill(causal.triu(key.shape[2] - query.shape[2] + 1), torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1)
    dropped = keyed_dropout(probs, float(dropout), int(salt),
                            where=f"{KEYED_ATTENTION} attention {getattr(module, _SALT_ATTR + '_name', '')!r}")
    out = torch.matmul(dropped, value).transpose(1, 2).contiguous()
    return out, probs


def _register_keyed_attention() -> None:
    """Register :data:`KEYED_ATTENTION` with transformers (attention and mask interfaces; the
    masks are sdpa's). A new name: no existing implementation changes."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if KEYED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(KEYED_ATTENTION, _keyed_attention_forward)
    if KEYED_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(KEYED_ATTENTION, sdpa_mask)


# --------------------------------------------------------------------------- LayerDrop


def _keyed_layerdrop_encoder(encoder: nn.Module, salt_base: str) -> None:
    """Key HuBERT/wav2vec2 LayerDrop: the encoder's own draw (``torch.rand`` per layer, per
    forward) is turned off for the call (``config.layerdrop`` set to 0 while it runs, restored
    after, so the saved config keeps its value) and each layer skips itself when
    ``hash(step, layer) < layerdrop``: one decision per micro-batch and layer, the same for every
    chunk and process. Changes the classes of the encoder and its layers (no new parameters)."""
    encoder.__class__ = _subclass(type(encoder), _KeyedLayerDropEncoder)
    for i, layer in enumerate(encoder.layers):
        layer.__class__ = _subclass(type(layer), _KeyedLayerDropLayer)
        setattr(layer, _SALT_ATTR + "_layerdrop", layer_salt(f"{salt_base}.layers.{i}", "layerdrop"))


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _subclass(base: type, mixin: type) -> type:
    if issubclass(base, mixin):
        return base
    found = _SUBCLASSES.get((base, mixin))
    if found is None:
        found = types.new_class(f"{mixin.__name__.strip('_')}{base.__name__}", (mixin, base))
        found.__module__ = __name__
        _SUBCLASSES[(base, mixin)] = found
    return found


class _KeyedLayerDropEncoder(nn.Module):
    _mmviews_layerdrop: float = 0.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        config = self.config  # type: ignore[attr-defined]
        rate = float(getattr(config, "layerdrop", 0.0))
        if not self.training or rate <= 0.0:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        for layer in self.layers:  # type: ignore[attr-defined]
            layer._mmviews_layerdrop = rate
        config.layerdrop = 0.0
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            config.layerdrop = rate
            for layer in self.layers:  # type: ignore[attr-defined]
                layer._mmviews_layerdrop = 0.0


class _KeyedLayerDropLayer(nn.Module):
    _mmviews_layerdrop: float = 0.0

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rate = self._mmviews_layerdrop
        if self.training and rate > 0.0:
            step = active_step_key()
            if step is None:
                raise RuntimeError(f"{type(self).__name__}: keyed LayerDrop in training mode outside dropout_step(); "
                                   "run the encoder inside mmviews.modalities.dropout.dropout_step or in eval mode")
            salt = getattr(self, _SALT_ATTR + "_layerdrop")
            if mix32(step ^ salt) < int(round(rate * 2**32)):
                return hidden_states
        return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]


# --------------------------------------------------------------------------- enabling


@dataclass
class KeyedDropoutReport:
    """What :func:`enable_sample_keyed_dropout` did: the converted modules by qualified name."""

    dropout: list[str] = field(default_factory=list)  # nn.Dropout -> SampleKeyedDropout
    attention: list[str] = field(default_factory=list)  # MultiheadAttention or transformers attention keyed
    layerdrop: list[str] = field(default_factory=list)  # HuBERT/wav2vec2 encoders with keyed LayerDrop
    backbones: list[str] = field(default_factory=list)  # transformers models switched to KEYED_ATTENTION

    def __str__(self) -> str:
        return (f"{len(self.dropout)} dropout layer(s), {len(self.attention)} attention module(s), "
                f"{len(self.layerdrop)} LayerDrop encoder(s) keyed")


_UNKEYABLE_DROPOUT = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RATE_ATTRS = ("p", "prob", "drop_prob", "drop_rate", "rate")


def _rate(module: nn.Module) -> float:
    for attr in _RATE_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _attention_dropout(config: Any) -> float:
    """A transformers config's attention-probability dropout (BERT and HuBERT spell it differently)."""
    rates = [getattr(config, name, 0.0) or 0.0 for name in ("attention_probs_dropout_prob", "attention_dropout")]
    return max(float(r) for r in rates)


def _is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


def enable_sample_keyed_dropout(model: nn.Module, *, skip: tuple[str, ...] = (), namespace: str = "") -> KeyedDropoutReport:
    """Make every dropout of ``model`` sample-keyed (see the module docstring), in place.

    ``skip``: qualified-name prefixes of submodules that never run in training mode (frozen
    backbones): converted where possible, but nothing there is an error. A
    :class:`~mmviews.modalities.MultiViewEncoder` skips its frozen backbones by itself.
    Raises ``ValueError`` listing every module whose randomness cannot be keyed."""
    from .multiview import MultiViewEncoder

    if isinstance(model, MultiViewEncoder):
        skip = skip + tuple(f"adapters.{name}.backbone" for name, adapter in model.adapters.items()
                            if adapter.backbone_frozen)

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skip)

    report = KeyedDropoutReport()
    problems: list[str] = []
    named = list(model.named_modules(remove_duplicate=False))
    for name, module in named:
        # transformers models: attention-probability dropout is passed to the kernel as a float.
        if _is_hf_model(module):
            config = module.config
            if _attention_dropout(config) > 0.0:
                _register_keyed_attention()
                _set_attn_implementation(module, KEYED_ATTENTION)
                report.backbones.append(name)
                for sub_name, sub in module.named_modules():
                    setattr(sub, _SALT_ATTR, 0)  # the attention modules among them read it (salted below)
                    if "attention" in type(sub).__name__.lower():
                        report.attention.append(f"{name}.{sub_name}" if name else sub_name)
            if float(getattr(config, "layerdrop", 0.0) or 0.0) > 0.0:
                encoder = getattr(module, "encoder", None)
                if encoder is not None and hasattr(encoder, "layers") and hasattr(encoder, "config"):
                    _keyed_layerdrop_encoder(encoder, f"{name}.encoder" if name else "encoder")
                    report.layerdrop.append(f"{name}.encoder" if name else "encoder")
                elif not skipped(name):
                    problems.append(f"{name or type(module).__name__}: layerdrop={config.layerdrop} in a model whose "
                                    "encoder layers cannot be found")
            spec = (getattr(config, "apply_spec_augment", False)
                    and (getattr(config, "mask_time_prob", 0.0) > 0 or getattr(config, "mask_feature_prob", 0.0) > 0))
            if spec and not skipped(name):
                problems.append(f"{name or type(module).__name__}: SpecAugment masking (mask_time_prob="
                                f"{getattr(config, 'mask_time_prob', 0.0)}) draws from numpy's global RNG "
                                "(turn it off: the hf_audio adapter's spec_augment: false)")
    for name, module in named:
        parent_name, _, attr = name.rpartition(".")
        if type(module) is nn.Dropout and name:
            keyed = SampleKeyedDropout(module.p, name=name)
            keyed.train(module.training)
            parent = model.get_submodule(parent_name) if parent_name else model
            parent._modules[attr] = keyed
            report.dropout.append(name)
        elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0.0:
            if module.bias_k is not None or module.add_zero_attn or not module._qkv_same_embed_dim:
                if not skipped(name):
                    problems.append(f"{name}: nn.MultiheadAttention with bias_k/add_zero_attn/separate kdim-vdim "
                                    f"and dropout={module.dropout} (not supported by SampleKeyedMultiheadAttention)")
                continue
            module.__class__ = SampleKeyedMultiheadAttention
            setattr(module, _SALT_ATTR, 0)  # salted below
            report.attention.append(name)
        elif isinstance(module, _UNKEYABLE_DROPOUT) and module.p > 0 and not skipped(name):
            problems.append(f"{name}: {type(module).__name__}(p={module.p}) has no sample-keyed version")
        elif not isinstance(module, (nn.Dropout, SampleKeyedDropout, _UNKEYABLE_DROPOUT)) and not skipped(name):
            cls = type(module).__name__
            lowered = cls.lower()
            if type(module).__module__.startswith("open_clip") and cls == "Attention":
                drop = getattr(module, "attn_drop", None)
                if drop is not None and getattr(drop, "p", 0.0) > 0:
                    problems.append(f"{name}: open_clip Attention passes attn_drop p={drop.p} to "
                                    "F.scaled_dot_product_attention (global RNG)")
            elif any(word in lowered for word in ("dropout", "droppath", "stochasticdepth")) and _rate(module) > 0:
                problems.append(f"{name}: {cls} (rate {_rate(module)}) draws from the global RNG and has no "
                                "sample-keyed version")
    if problems:
        raise ValueError("sample-keyed dropout cannot key every random layer of this model:\n  - "
                         + "\n  - ".join(problems)
                         + "\nturn these off in the adapter's config, or leave sample-keyed dropout off")
    salt_sample_keyed_dropout(model, namespace)
    return report


def salt_sample_keyed_dropout(model: nn.Module, namespace: str = "") -> None:
    """(Re)set the salt of every keyed layer of ``model`` from ``namespace`` and its qualified
    name: a copy of a model (an EMA teacher) given another namespace draws other masks."""
    for name, module in model.named_modules(remove_duplicate=False):
        salt = layer_salt(name, namespace)
        if isinstance(module, SampleKeyedDropout):
            module.salt, module.name = salt, name
        elif hasattr(module, _SALT_ATTR):  # keyed attention
            setattr(module, _SALT_ATTR, salt)
            setattr(module, _SALT_ATTR + "_name", name)
        if hasattr(module, _SALT_ATTR + "_layerdrop"):
            setattr(module, _SALT_ATTR + "_layerdrop", layer_salt(name, namespace + "/layerdrop"))


def has_sample_keyed_dropout(model: nn.Module) -> bool:
    """Whether :func:`enable_sample_keyed_dropout` converted something in ``model``."""
    return any(isinstance(m, (SampleKeyedDropout, SampleKeyedMultiheadAttention, _KeyedLayerDropLayer))
               for m in model.modules())
