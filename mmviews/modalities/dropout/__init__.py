"""Sample-keyed dropout: masks that follow the samples, not the order of random draws.

Ordinary dropout draws its masks from the global RNG stream, so the mask a sample gets depends on
how the batch is cut into chunks (cached-embedding steps), split between processes or ordered.
Here every element's keep/drop decision is a hash of (run seed, micro-batch number, sample key,
layer, element position): encoding the same rows whole, in chunks, in another order or on N
processes gives the same masks, hence the same embeddings and gradients up to float rounding.
The parts, lowest first: :mod:`.keys` (the hash, the keys and their context), :mod:`.hf_attention`
(keyed attention for transformers models) and :mod:`.layers` (the keyed layers and
:func:`enable_sample_keyed_dropout`); the public names are re-exported here, and internals are
patched in the part that uses them. How to use it and how the masks are made: ``docs/dropout.md``.
"""

from __future__ import annotations

from .hf_attention import KEYED_ATTENTION
from .keys import (
    checkpoint_context,
    current_row_keys,
    dropout_rows,
    dropout_step,
    keyed_dropout,
    keyed_uniform_bits,
    row_keys_for,
    step_key,
)
from .layers import (
    KeyedDropoutReport,
    SampleKeyedDropout,
    SampleKeyedMultiheadAttention,
    enable_sample_keyed_dropout,
    has_sample_keyed_dropout,
    salt_sample_keyed_dropout,
)

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
