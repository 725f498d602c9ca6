"""Modality adapters: one view -> one point on the shared unit sphere.

Every adapter runs ``preprocess -> backbone -> pool -> projection head -> L2 normalise``
and returns ``[B, embed_dim]`` unit vectors (no temperature: that is the objective's).

Entry points for the trainer and recipes
----------------------------------------

``build_adapter(dict) -> Adapter``: one adapter from a dict with a ``type`` key::

    build_adapter({"type": "text", "model": "sentence-transformers/all-MiniLM-L6-v2",
                   "embed_dim": 128, "pooling": "mean",
                   "head": {"kind": "mlp", "hidden_dim": 512, "num_layers": 2, "batch_norm": True},
                   "finetune": {"mode": "last_n", "last_n": 2, "lora": None}})

``MultiViewEncoder.from_config(dict)``: one adapter per modality (keys = the modality
names used in ``ViewBatch.inputs`` / ``ViewInfo.modality``)::

    MultiViewEncoder.from_config({"embed_dim": 128, "modalities": {
        "text":  {"type": "feature_sequence", "input_dim": 768},
        "audio": {"type": "audio_cnn"},
        "vision": {"type": "small_cnn", "channels": [32, 64]}}})

    z, mask = encoder(batch)                       # [K, M, d], [K, M] in batch.views order
    encoder.encode_modality("text", inputs)        # [B, d], for evaluation
    encoder.param_groups(backbone_lr, head_lr, weight_decay)   # for the optimizer
    encoder.save_pretrained(dir); MultiViewEncoder.from_pretrained(dir)
    encoder.enable_cache(dir, split="train"); ...; encoder.save_cache()   # frozen backbones

Adapter types (``type``) and their inputs (see :mod:`mmviews.data.batch`):

==================  ===========================================  =========================================
type                backbone                                     inputs
==================  ===========================================  =========================================
text                transformers AutoModel (hub/local) or a      ``text`` list[str] or ``input_ids`` +
                    random BertConfig + word-list tokenizer      ``attention_mask``
feature_sequence    small transformer encoder (3 layers)         ``values [B, L, D]``, ``lengths [B]``
open_clip           open_clip image tower (ViT / RN)             ``values [B, 3, H, W]`` or ``[B, T, 3, H, W]``
small_cnn           small 2-D CNN (CPU-sized images)             same (any ``in_channels``)
hf_audio            HuBERT / wav2vec2 via transformers           ``values [B, T]``, ``lengths``, ``sample_rate``
audio_cnn           log-mel + 1-D CNN                            same
flow_cnn            2-D CNN per flow (or 2T stacked channels)    ``values [B, T, 2, H, W]`` (pixels)
flow_clip           open_clip ViT, patch embedding adapted       same
                    from RGB to 2 flow channels
mlp                 Linear + GELU on the first step              ``values [B, L, D]``
==================  ===========================================  =========================================

The registry of types: ``list_adapters()`` (type -> description), ``adapter_class(type)``,
and ``@register_adapter`` on an :class:`Adapter` subclass to add one (its config class's
``type`` is the name; registering a type twice is an error).

Common config keys: ``embed_dim``, ``head`` (:class:`HeadConfig`), ``finetune``
(:class:`FinetuneConfig`: ``mode`` full | frozen | last_n, ``last_n``, ``lora``),
``gradient_checkpointing`` (recompute the backbone's activations in backward: text, hf_audio,
open_clip, flow_clip and the CNNs; :mod:`mmviews.modalities.checkpointing`).
Sample-keyed dropout (masks that follow the samples however a batch is chunked or split):
:func:`enable_sample_keyed_dropout`, :func:`dropout_step`, :class:`SampleKeyedDropout`
(:mod:`mmviews.modalities.dropout`).
Flow helpers: :func:`compute_flow`, :func:`encode_flow_uint8`, :func:`decode_flow_uint8`.
"""

from .audio import AudioCNNAdapter, AudioCNNConfig, HFAudioAdapter, HFAudioConfig
from .base import Adapter, adapter_class, build_adapter, list_adapters, register_adapter
from .cache import FeatureCache, backbone_fingerprint
from .config import AdapterConfig, FinetuneConfig, HeadConfig, LoRAConfig
from .custom import ENTRY_POINT_GROUP, register_backbone
from .dropout import SampleKeyedDropout, dropout_step, enable_sample_keyed_dropout
from .flow import (
    FlowCLIPAdapter,
    FlowCLIPConfig,
    FlowCNNAdapter,
    FlowCNNConfig,
    adapt_patch_embedding,
    clip_flow,
    compute_flow,
    decode_flow_uint8,
    encode_flow_uint8,
)
from .head import ProjectionHead
from .image_backbones import HFVisionAdapter, HFVisionConfig, TimmAdapter, TimmConfig, TorchvisionAdapter, TorchvisionConfig
from .mlp import MLPAdapter, MLPConfig
from .multiview import MultiViewEncoder
from .sequence import FeatureSequenceAdapter, FeatureSequenceConfig
from .text import TextAdapter, TextConfig, build_word_vocab
from .vision import OpenCLIPVisionAdapter, OpenCLIPVisionConfig, SmallCNNVisionAdapter, SmallCNNVisionConfig

__all__ = [
    "Adapter",
    "AdapterConfig",
    "AudioCNNAdapter",
    "AudioCNNConfig",
    "FeatureCache",
    "FeatureSequenceAdapter",
    "FeatureSequenceConfig",
    "FinetuneConfig",
    "FlowCLIPAdapter",
    "FlowCLIPConfig",
    "FlowCNNAdapter",
    "FlowCNNConfig",
    "HFAudioAdapter",
    "HFAudioConfig",
    "HeadConfig",
    "HFVisionConfig",
    "HFVisionAdapter",
    "LoRAConfig",
    "MLPAdapter",
    "MLPConfig",
    "MultiViewEncoder",
    "OpenCLIPVisionAdapter",
    "OpenCLIPVisionConfig",
    "ProjectionHead",
    "SampleKeyedDropout",
    "SmallCNNVisionAdapter",
    "SmallCNNVisionConfig",
    "TimmAdapter",
    "TimmConfig",
    "TorchvisionAdapter",
    "TorchvisionConfig",
    "TextAdapter",
    "TextConfig",
    "adapt_patch_embedding",
    "adapter_class",
    "backbone_fingerprint",
    "build_adapter",
    "build_word_vocab",
    "clip_flow",
    "compute_flow",
    "decode_flow_uint8",
    "dropout_step",
    "enable_sample_keyed_dropout",
    "encode_flow_uint8",
    "list_adapters",
    "register_adapter",
    "register_backbone",
    "ENTRY_POINT_GROUP",
]
