"""Modality adapters: one view -> one point on the shared unit sphere.

Every adapter runs ``preprocess -> backbone -> pool -> projection head -> L2 normalise`` and
returns ``[B, embed_dim]`` unit vectors (no temperature: that is the objective's), so that any
objective can compare any two views. :func:`build_adapter` builds one from a recipe's dict,
:class:`MultiViewEncoder` holds one per modality and embeds a whole
:class:`~mmviews.data.batch.ViewBatch`; the registry (:func:`register_adapter`) lets a package add
its own types. The types, their inputs and the Python API are in ``docs/modalities.md``.
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
from .video_backbones import HFVideoAdapter, HFVideoConfig, TorchvisionVideoAdapter, TorchvisionVideoConfig
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
    "HFVideoAdapter",
    "HFVideoConfig",
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
    "TorchvisionVideoAdapter",
    "TorchvisionVideoConfig",
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
