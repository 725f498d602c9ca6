"""Sample-keyed torch layers, and the conversion of a model to them.

:class:`SampleKeyedDropout` is ``nn.Dropout`` with the keyed mask of :mod:`.keys`, and
:class:`SampleKeyedMultiheadAttention` keys the attention-probability dropout of
``nn.MultiheadAttention``; both follow ``nn.Dropout``'s rules (identity in eval mode or at
``p == 0``) and raise in training mode without row keys. :func:`enable_sample_keyed_dropout`
converts a model in place (dropout modules, transformers attention, multi-head attention,
HuBERT/wav2vec2 LayerDrop) and refuses by name every random layer it cannot key, so that no
unkeyed draw is left silently. Which layers it converts and which it refuses: ``docs/dropout.md``
("Which layers are keyed").
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf_attention import (attention_dropout, is_transformers_model, set_transformers_checkpointing,
                           switch_to_keyed_attention, transformers_checkpointing_on)
from .keys import SALT_ATTR, active_step_key, checkpoint_context, keyed_dropout, layer_salt, mix32

__all__ = [
    "KeyedDropoutReport",
    "SampleKeyedDropout",
    "SampleKeyedMultiheadAttention",
    "enable_sample_keyed_dropout",
    "has_sample_keyed_dropout",
    "salt_sample_keyed_dropout",
]


# --------------------------------------------------------------------------- modules


class SampleKeyedDropout(nn.Module):
    """``nn.Dropout(p)`` whose mask is a function of the rows' sample keys and of ``salt`` (this
    layer), see :mod:`.keys`. Identity in eval mode or with ``p == 0``."""

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
        where = f"SampleKeyedMultiheadAttention {getattr(self, SALT_ATTR + '_name', '')!r}"
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
        dropped = keyed_dropout(probs, self.dropout, int(getattr(self, SALT_ATTR)), where=where)
        out = (dropped @ v).transpose(1, 2).reshape(b, lq, e)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, probs.mean(1) if average_attn_weights else probs


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
        setattr(layer, SALT_ATTR + "_layerdrop", layer_salt(f"{salt_base}.layers.{i}", "layerdrop"))


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
            salt = getattr(self, SALT_ATTR + "_layerdrop")
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


def _frozen_backbones(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of the frozen backbones of a
    :class:`~mmviews.modalities.MultiViewEncoder` (``adapters``: a ``ModuleDict`` of adapters
    with ``backbone_frozen``), else none. Read by attribute, not by class, so that this module
    does not import the encoders that import it."""
    adapters = getattr(model, "adapters", None)
    if not isinstance(adapters, nn.ModuleDict):
        return ()
    return tuple(f"adapters.{name}.backbone" for name, adapter in adapters.items()
                 if getattr(adapter, "backbone_frozen", False))


def enable_sample_keyed_dropout(model: nn.Module, *, skip: tuple[str, ...] = (), namespace: str = "") -> KeyedDropoutReport:
    """Make every dropout of ``model`` sample-keyed (see docs/dropout.md), in place.

    ``skip``: qualified-name prefixes of submodules that never run in training mode (frozen
    backbones): converted where possible, but nothing there is an error. A
    :class:`~mmviews.modalities.MultiViewEncoder` skips its frozen backbones by itself.
    Raises ``ValueError`` listing every module whose randomness cannot be keyed."""
    skip = skip + _frozen_backbones(model)

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skip)

    report = KeyedDropoutReport()
    problems: list[str] = []
    named = list(model.named_modules(remove_duplicate=False))
    for name, module in named:
        # transformers models: attention-probability dropout is passed to the kernel as a float.
        if is_transformers_model(module):
            config = module.config
            if attention_dropout(config) > 0.0:
                report.backbones.append(name)
                report.attention += [f"{name}.{sub_name}" if name else sub_name
                                     for sub_name in switch_to_keyed_attention(module)]  # salted below
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
            setattr(module, SALT_ATTR, 0)  # salted below
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
    _replay_keys_when_recomputing(model)
    return report


def _replay_keys_when_recomputing(model: nn.Module) -> None:
    """The transformers models of ``model`` whose activation checkpointing is on recompute their
    layers in backward under the forward's sample keys (``checkpoint_context``), so that the
    recomputation drops what the forward dropped. (Checkpointing passes no such context without
    keyed dropout: torch.compile rejects one. The CNN stages that mmviews checkpoints hold no
    random layer.)"""
    for module in model.modules():
        if is_transformers_model(module) and transformers_checkpointing_on(module):
            set_transformers_checkpointing(module, {"use_reentrant": False, "context_fn": checkpoint_context})


def salt_sample_keyed_dropout(model: nn.Module, namespace: str = "") -> None:
    """(Re)set the salt of every keyed layer of ``model`` from ``namespace`` and its qualified
    name: a copy of a model (an EMA teacher) given another namespace draws other masks."""
    for name, module in model.named_modules(remove_duplicate=False):
        salt = layer_salt(name, namespace)
        if isinstance(module, SampleKeyedDropout):
            module.salt, module.name = salt, name
        elif hasattr(module, SALT_ATTR):  # keyed attention
            setattr(module, SALT_ATTR, salt)
            setattr(module, SALT_ATTR + "_name", name)
        if hasattr(module, SALT_ATTR + "_layerdrop"):
            setattr(module, SALT_ATTR + "_layerdrop", layer_salt(name, namespace + "/layerdrop"))


def has_sample_keyed_dropout(model: nn.Module) -> bool:
    """Whether :func:`enable_sample_keyed_dropout` converted something in ``model``."""
    return any(isinstance(m, (SampleKeyedDropout, SampleKeyedMultiheadAttention, _KeyedLayerDropLayer))
               for m in model.modules())
