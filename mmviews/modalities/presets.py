"""Ready-made adapter configs with example inputs: ``tiny`` (random weights, a few
thousand parameters, for tests and CPU smoke runs) and ``realistic`` (full-size
architectures with random weights, for benchmarks). Nothing here downloads weights."""

from __future__ import annotations

import copy
from typing import Any

import torch

TINY_WORDS = (
    "the a an cat dog bird sat ran flew on under over mat tree sky red blue green car bus "
    "train road fast slow man woman child plays eats reads book ball food music sings loud"
).split()

# open_clip keyword overrides for a 2-layer ViT on 32x32 images (text tower kept minimal:
# create_model always builds it, the adapter keeps only the image tower).
TINY_CLIP_OVERRIDES: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 1, "layers": 1},
}

TINY_HUBERT: dict[str, Any] = {
    "model_type": "hubert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "conv_dim": [32, 32],
    "conv_stride": [5, 4],
    "conv_kernel": [10, 8],
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}

# A 2-layer ViT on 32x32 images (transformers), 8x8 patches.
TINY_VIT: dict[str, Any] = {
    "model_type": "vit",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
}

# A 2-layer VideoMAE on clips of 4 frames of 32x32 (transformers), 2x8x8 tubelets.
TINY_VIDEOMAE: dict[str, Any] = {**TINY_VIT, "model_type": "videomae", "num_frames": 4, "tubelet_size": 2}

TINY_BERT: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}

_TINY: dict[str, dict[str, Any]] = {
    "text": {"type": "text", "bert_config": TINY_BERT, "vocab": TINY_WORDS, "max_length": 16},
    "feature_sequence": {"type": "feature_sequence", "input_dim": 6, "width": 32, "num_layers": 2, "num_heads": 2},
    "open_clip": {"type": "open_clip", "model": "ViT-B-32", "model_overrides": TINY_CLIP_OVERRIDES},
    "small_cnn": {"type": "small_cnn", "channels": [8, 16]},
    "hf_vision": {"type": "hf_vision", "backbone_config": TINY_VIT},
    # MobileNetV2 at a quarter of its width (about 0.2 M parameters)
    "torchvision": {"type": "torchvision", "model": "mobilenet_v2", "model_kwargs": {"width_mult": 0.25},
                    "image_size": 32},
    "timm": {"type": "timm", "model": "test_resnet", "image_size": 32},
    # torchvision's smallest video model (MC3-18, 11.7 M parameters; none is smaller) on 16 px frames
    "torchvision_video": {"type": "torchvision_video", "model": "mc3_18", "image_size": 16},
    "hf_video": {"type": "hf_video", "backbone_config": TINY_VIDEOMAE},
    "hf_audio": {"type": "hf_audio", "backbone_config": TINY_HUBERT},
    "audio_cnn": {"type": "audio_cnn", "n_mels": 16, "channels": [16, 16]},
    "flow_cnn": {"type": "flow_cnn", "channels": [8, 16]},
    "flow_clip": {"type": "flow_clip", "model": "ViT-B-32", "model_overrides": TINY_CLIP_OVERRIDES},
}

_REALISTIC: dict[str, dict[str, Any]] = {
    # bert-base sized (110 M parameters), random weights.
    "text": {"type": "text", "bert_config": {}, "vocab": TINY_WORDS, "max_length": 128},
    "feature_sequence": {"type": "feature_sequence", "input_dim": 768, "width": 128, "num_layers": 3, "num_heads": 4},
    "open_clip": {"type": "open_clip", "model": "ViT-B-32"},  # 224 px
    "small_cnn": {"type": "small_cnn", "channels": [64, 128, 256]},
    # ViT-B/16 at 224 px (86 M parameters), random weights.
    "hf_vision": {"type": "hf_vision", "backbone_config": {"model_type": "vit"}},
    "torchvision": {"type": "torchvision", "model": "resnet50", "image_size": 224},
    "timm": {"type": "timm", "model": "vit_small_patch16_224"},
    # R(2+1)D-18 on 8 frames of 112 px (31 M parameters); VideoMAE-base on 16 frames of 224 px (86 M)
    "torchvision_video": {"type": "torchvision_video", "model": "r2plus1d_18"},
    "hf_video": {"type": "hf_video", "backbone_config": {"model_type": "videomae"}},
    # HuBERT-base sized (95 M parameters), random weights.
    "hf_audio": {"type": "hf_audio", "backbone_config": {"model_type": "hubert"}},
    "audio_cnn": {"type": "audio_cnn", "n_mels": 64, "channels": [128, 256, 256]},
    "flow_cnn": {"type": "flow_cnn", "channels": [32, 64, 128]},
    "flow_clip": {"type": "flow_clip", "model": "ViT-B-32"},
}


def tiny_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """A tiny random-weight config of adapter type ``kind`` (embed_dim 16 unless overridden)."""
    cfg = copy.deepcopy(_TINY[kind])
    cfg.setdefault("embed_dim", 16)
    cfg.update(overrides)
    return cfg


def realistic_config(kind: str, **overrides: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(_REALISTIC[kind])
    cfg.setdefault("embed_dim", 128)
    cfg.update(overrides)
    return cfg


def example_inputs(kind: str, batch: int, realistic: bool = False, seed: int = 0) -> dict[str, Any]:
    """Random inputs of the right layout for adapter type ``kind``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "text":
        n_words = 60 if realistic else 8
        idx = torch.randint(len(TINY_WORDS), (batch, n_words), generator=g).tolist()
        return {"text": [" ".join(TINY_WORDS[i] for i in row) for row in idx]}
    if kind == "feature_sequence":
        d, length = (768, 50) if realistic else (6, 12)
        lengths = torch.randint(1, length + 1, (batch,), generator=g)
        return {"values": torch.randn(batch, length, d, generator=g), "lengths": lengths}
    if kind in ("open_clip", "small_cnn", "hf_vision", "torchvision", "timm"):
        size = 224 if (realistic and kind != "small_cnn") else 32
        return {"values": torch.rand(batch, 3, size, size, generator=g)}
    if kind in ("torchvision_video", "hf_video"):
        if kind == "torchvision_video":
            t, size = (8, 112) if realistic else (2, 16)
        else:
            t, size = (16, 224) if realistic else (4, 32)
        return {"values": torch.rand(batch, t, 3, size, size, generator=g)}
    if kind in ("hf_audio", "audio_cnn"):
        n = 16000 if realistic else 4000
        lengths = torch.randint(n // 2, n + 1, (batch,), generator=g)
        lengths[0] = n
        return {"values": torch.randn(batch, n, generator=g) * 0.1, "lengths": lengths, "sample_rate": 16000}
    if kind in ("flow_cnn", "flow_clip"):
        size = 224 if (realistic and kind == "flow_clip") else 32
        t = 4 if realistic else 2
        return {"values": torch.randn(batch, t, 2, size, size, generator=g) * 3}
    raise KeyError(f"no example inputs for adapter type {kind!r}")


ADAPTER_TYPES = tuple(_TINY)
