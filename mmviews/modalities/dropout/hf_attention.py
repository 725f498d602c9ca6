"""Sample-keyed attention-probability dropout for transformers models.

In transformers models attention-probability dropout is not a module: their attention
kernels take ``dropout=p`` (sdpa passes it to ``F.scaled_dot_product_attention``, which draws
its own mask from the global RNG). A transformers model with attention dropout is switched
(:func:`switch_to_keyed_attention`) to the attention implementation :data:`KEYED_ATTENTION`
registered here under a new name (no existing implementation changes): the sdpa kernel when
no dropout applies (eval, ``p == 0``), and in training the eager computation (softmax, keyed
dropout of the probabilities, product with the values), which keeps the ``[B, heads, L, L]``
probabilities in memory as the eager implementation does.

Each attention module's salt is the attribute :data:`~.keys.SALT_ATTR`, set to 0 here and
given its value, from the module's qualified name, by
:func:`~mmviews.modalities.dropout.salt_sample_keyed_dropout`; a module left unsalted is an
error in training rather than a silent shared mask. transformers is imported lazily, when a
model needs it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .keys import SALT_ATTR, keyed_dropout

__all__ = [
    "KEYED_ATTENTION",
    "attention_dropout",
    "is_transformers_model",
    "register_keyed_attention",
    "switch_to_keyed_attention",
]

KEYED_ATTENTION = "mmviews_keyed"  # the transformers attention implementation registered here


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
    salt = getattr(module, SALT_ATTR, None)
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
                            where=f"{KEYED_ATTENTION} attention {getattr(module, SALT_ATTR + '_name', '')!r}")
    out = torch.matmul(dropped, value).transpose(1, 2).contiguous()
    return out, probs


def register_keyed_attention() -> None:
    """Register :data:`KEYED_ATTENTION` with transformers (attention and mask interfaces; the
    masks are sdpa's). A new name: no existing implementation changes."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if KEYED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(KEYED_ATTENTION, _keyed_attention_forward)
    if KEYED_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(KEYED_ATTENTION, sdpa_mask)


def attention_dropout(config: Any) -> float:
    """A transformers config's attention-probability dropout (BERT and HuBERT spell it differently)."""
    rates = [getattr(config, name, 0.0) or 0.0 for name in ("attention_probs_dropout_prob", "attention_dropout")]
    return max(float(r) for r in rates)


def is_transformers_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def set_transformers_checkpointing(model: nn.Module, options: dict[str, Any]) -> None:
    """Turn on transformers' activation checkpointing of ``model`` with ``options`` (``torch.utils.checkpoint``'s)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def transformers_checkpointing_on(model: nn.Module) -> bool:
    """Whether transformers' activation checkpointing of ``model`` is on."""
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, flag, False))


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


def switch_to_keyed_attention(model: nn.Module) -> list[str]:
    """Switch the transformers ``model`` to :data:`KEYED_ATTENTION` (registering it first) and
    mark every submodule with an (unset, 0) salt for the attention modules among them to read.
    Returns the qualified names, relative to ``model``, of its attention modules."""
    register_keyed_attention()
    _set_attn_implementation(model, KEYED_ATTENTION)
    attention = []
    for sub_name, sub in model.named_modules():
        setattr(sub, SALT_ATTR, 0)  # the attention modules among them read it (salted later)
        if "attention" in type(sub).__name__.lower():
            attention.append(sub_name)
    return attention
