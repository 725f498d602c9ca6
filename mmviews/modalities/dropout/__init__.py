"""Sample-keyed dropout: masks that follow the samples, not the order of random draws.

Ordinary dropout draws its masks from the global RNG stream, so the mask a sample gets
depends on everything drawn before it: how the batch is cut into chunks (cached-embedding
steps), how it is split between processes, which rows came first. Here the keep/drop
decision of every element is a hash of (run seed, micro-batch number, sample key, layer,
element position), where the *sample key* of a row is (dataset index, modality, view slot).
Encoding the same rows whole, in chunks, in another order or on N processes gives the same
masks, hence the same embeddings and gradients up to float rounding.

What a training loop does: ``with dropout_step(seed, micro_batch):`` around each micro-batch
(after :func:`enable_sample_keyed_dropout` converted the model once);
``MultiViewEncoder.forward`` sets the row keys of each adapter call (:func:`row_keys_for`,
:func:`dropout_rows`), and every keyed layer reads them. In training mode without keys a
keyed layer raises rather than fall back to global-RNG masks.

The parts, lowest first (each imports only those before it, and none imports the encoders):

- :mod:`.keys`: the hash, the step and row keys, the context that carries them, the keyed
  mask (:func:`keyed_dropout`, :func:`keyed_uniform_bits`) and :func:`checkpoint_context`
  for activation checkpointing;
- :mod:`.hf_attention`: the transformers attention implementation :data:`KEYED_ATTENTION`
  (attention-probability dropout in transformers models is a kernel argument, not a module);
- :mod:`.layers`: :class:`SampleKeyedDropout`, :class:`SampleKeyedMultiheadAttention`, keyed
  HuBERT/wav2vec2 LayerDrop, :func:`enable_sample_keyed_dropout` (which converts a model and
  rejects, naming them, the random layers it cannot key) and :func:`salt_sample_keyed_dropout`
  (an EMA teacher's copy re-salted: masks independent of the student's).

The public names are re-exported here. Internals (``sample_row_keys``, ``layer_salt``,
``step_key``, ...) are looked up by their callers in the part that uses them: patch them there.
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
