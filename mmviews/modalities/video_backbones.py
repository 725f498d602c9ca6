"""Spatiotemporal video backbones: torchvision's video classifiers (``torchvision_video``: R3D-18,
MC3-18, R(2+1)D-18, S3D, MViT v1/v2, Video Swin T/S/B) and transformers' video encoders
(``hf_video``: VideoMAE, TimeSformer, ViViT, X-CLIP's video tower), without their classifier.

The image adapters encode a clip frame by frame and average the frames' unit vectors; these see
the whole clip at once, so that the backbone can learn motion. Inputs: ``{"values":
FloatTensor[B, T, 3, H, W]}`` in [0, 1], as the video views deliver them. Every frame is resized
(shorter side) and centre-cropped to the backbone's input size and normalised by the backbone's
own statistics (torchvision's weights' transforms, the checkpoint's processor); T must be what
the model takes, else one line names the model, the frames it takes and the frames given.

Weights: ``torchvision_video`` as the image ``torchvision`` adapter (a weight tag such as
``KINETICS400_V1``, which torchvision downloads, or a local file checked by sha256 and read
weights-only; :func:`~mmviews.modalities.image_backbones.torchvision_backbone`); ``hf_video`` a
local checkpoint folder or hub name, or a ``backbone_config`` for random weights
(:func:`~mmviews.modalities.hf_backbone.transformers_backbone`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .base import register_adapter
from .checkpointing import checkpoint_blocks, enable_transformers_checkpointing
from .hf_backbone import transformers_backbone
from .image_backbones import (
    ClassifierBackboneConfig,
    ImageInputAdapter,
    ImageInputConfig,
    _first_module_list,
    attention_lora_targets,
    drop_classifier,
    torchvision_backbone,
)
from .inputs import require_tensor, to_device
from .vision import resize_shortest_center_crop


class ClipInputAdapter(ImageInputAdapter):
    """An adapter whose backbone takes whole clips: ``pixels [B, T, 3, S, S]`` normalised, ``T``
    checked against :attr:`min_frames` / :attr:`exact_frames` (set by :meth:`_set_frames`)."""

    min_frames: int
    exact_frames: int | None
    frames_reason: str
    model_label: str

    def _set_frames(self, label: str, minimum: int, exact: int | None, reason: str) -> None:
        self.model_label, self.min_frames, self.exact_frames, self.frames_reason = label, int(minimum), exact, reason

    def check_frames(self, frames: int, shape: tuple[int, ...]) -> None:
        """A one-line ``ValueError`` naming the model, the frames it takes and ``frames``."""
        where = f"{self.config.type} adapter"
        if self.exact_frames is not None and frames != self.exact_frames:
            raise ValueError(f"{where}: {self.model_label} takes clips of {self.exact_frames} frames "
                             f"({self.frames_reason}), got {frames} (values shape {shape})")
        if frames < self.min_frames:
            raise ValueError(f"{where}: {self.model_label} takes clips of at least {self.min_frames} frames "
                             f"({self.frames_reason}), got {frames} (values shape {shape})")

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = f"{self.config.type} adapter"
        x = require_tensor(inputs, "values", where)
        shape = tuple(x.shape)
        if x.dim() != 5 or shape[2] != 3:
            raise ValueError(f"{where}: values must be clips [B, T, 3, H, W], got shape {shape}")
        if shape[3] == 0 or shape[4] == 0:
            raise ValueError(f"{where}: empty spatial size in shape {shape}")
        self.check_frames(shape[1], shape)
        if not x.is_floating_point():
            raise ValueError(f"{where}: clips must be float in [0, 1], got dtype {x.dtype}")
        x = to_device(x, self.mean.device, torch.float32)
        size = int(self.config.image_size)  # type: ignore[arg-type]
        if tuple(shape[-2:]) != (size, size):
            b, t = shape[:2]
            x = resize_shortest_center_crop(x.reshape(b * t, *shape[2:]), (size, size), self.config.interpolation)
            x = x.clamp(0, 1).reshape(b, t, 3, size, size)
        return {"pixels": (x - self.mean) / self.std}

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return self.pooled(prepared["pixels"])


# --------------------------------------------------------------------------- torchvision


@dataclass
class TorchvisionVideoConfig(ClassifierBackboneConfig):
    """``model``: one of ``torchvision.models.list_models(module=torchvision.models.video)``.
    ``weights``: a weight tag (``KINETICS400_V1``; ``swin3d_b`` also ``KINETICS400_IMAGENET22K_V1``),
    which torchvision downloads, or a local weights file of the whole classifier (safetensors, or
    a torch file read weights-only) checked against ``weights_sha256`` (default: the hex digits
    that end a torchvision file name, ``r2plus1d_18-91a641e6.pth``); None: random weights.
    ``image_size``: default the weights' crop (112 px for the ResNets, 224 for the others), which
    MViT requires; ``mean``/``std``: default the weights' own. ``model_kwargs``: keyword
    arguments of the model's constructor (numbers, strings and lists only)."""

    type = "torchvision_video"
    model: str = "r2plus1d_18"


def drop_video_classifier(model: nn.Module, where: str) -> tuple[int, set[str]]:
    """:func:`drop_classifier` for torchvision's video models: the classification head replaced
    by ``nn.Identity``, its dropout with it (S3D classifies with a 1x1x1 convolution after a
    dropout, MViT with a dropout and a Linear): ``(its input width, the state-dict keys it had)``."""
    for name in ("classifier", "head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Sequential) and all(isinstance(m, (nn.Dropout, nn.Linear, nn.Conv3d)) for m in head):
            layer = head[-1]
            width = int(layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels)
            setattr(model, name, nn.Identity())
            return width, {f"{name}.{k}" for k in head.state_dict()}
    return drop_classifier(model, where)


@register_adapter
class TorchvisionVideoAdapter(ClipInputAdapter):
    """torchvision video model (R3D, MC3, R(2+1)D, S3D, MViT, Video Swin) on whole clips, without its classifier."""

    config_class = TorchvisionVideoConfig
    config: TorchvisionVideoConfig

    def __init__(self, config: TorchvisionVideoConfig, *, load_weights: bool = True,
                 saved_dir: Path | None = None) -> None:
        super().__init__(config)
        import torchvision
        from torchvision.models import video

        where = "torchvision_video adapter"
        self.backbone, self.feature_dim = torchvision_backbone(config, video, where, drop=drop_video_classifier,
                                                               load_weights=load_weights and saved_dir is None)
        for module in self.backbone.modules():
            # R3D's and MC3's Conv3DSimple / Conv3DNoTemporal are nn.Conv3d with a constructor of
            # their own (no other method): peft builds a LoRA layer as type(conv)(..., bias=False),
            # which that constructor refuses. As plain nn.Conv3d they hold and compute the same.
            if isinstance(module, nn.Conv3d) and type(module).forward is nn.Conv3d.forward:
                module.__class__ = nn.Conv3d
        weights = torchvision.models.get_model_weights(config.model).DEFAULT
        transforms = weights.transforms()
        self._set_image_input(int(transforms.crop_size[0]), transforms.mean, transforms.std)
        # torchvision's weights state the smallest clip each model takes; MViT's positional
        # embeddings are made for exactly that clip (16 frames of 224 px)
        side, frames = int(weights.meta["min_size"][0]), int(weights.meta.get("min_temporal_size", 1))
        fixed = isinstance(self.backbone, video.MViT)
        size = int(config.image_size)  # type: ignore[arg-type]
        if (fixed and size != side) or size < side:
            takes = f"{side}x{side}" if fixed else f"at least {side}x{side}"
            raise ValueError(f"{where}: {config.model} takes frames of {takes} px, got image_size {size}")
        reason = "its positional embeddings' size" if fixed else "torchvision's smallest clip for it"
        self._set_frames(config.model, frames, frames if fixed else None, reason)
        # traced ONNX graphs of these take any number of frames (the others fix the traced T)
        self.any_frames_in_onnx = isinstance(self.backbone, (video.VideoResNet, video.S3D))
        if isinstance(self.backbone, (video.MViT, video.SwinTransformer3d)):
            self.default_lora_targets = ["qkv"]
        else:  # the convolutions of the blocks that last_n counts (peft's LoRA takes Conv3d)
            self.default_lora_targets = [f"{prefix}.{name}" for prefix, block in self._named_blocks()
                                         for name, m in block.named_modules() if isinstance(m, nn.Conv3d)]
        self._finish_init()

    def _named_blocks(self) -> list[tuple[str, nn.Module]]:
        model = self.backbone
        if all(hasattr(model, f"layer{i}") for i in range(1, 5)):  # R3D, MC3, R(2+1)D
            return [(f"layer{i}", getattr(model, f"layer{i}")) for i in range(1, 5)]
        if isinstance(getattr(model, "blocks", None), nn.ModuleList):  # MViT
            return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
        if isinstance(getattr(model, "features", None), nn.Sequential):  # S3D, Video Swin (stages, patch merging)
            return [(f"features.{i}", b) for i, b in enumerate(model.features)]
        raise NotImplementedError(f"last_n: unknown block layout of torchvision {type(model).__name__}")

    def backbone_blocks(self) -> list[nn.Module]:
        return [block for _, block in self._named_blocks()]

    def backbone_tail(self) -> list[nn.Parameter]:
        norm = getattr(self.backbone, "norm", None)  # MViT's and Video Swin's final LayerNorm
        return list(norm.parameters()) if isinstance(norm, nn.Module) else []

    def enable_gradient_checkpointing(self) -> None:
        """Each block of :meth:`backbone_blocks` recomputed in backward (its BatchNorm running
        statistics updated once per step; MViT's and Swin's stochastic depth replayed)."""
        checkpoint_blocks(self.backbone_blocks())

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.backbone(pixels.transpose(1, 2))  # torchvision's video models take [B, 3, T, H, W]


# --------------------------------------------------------------------------- transformers


@dataclass
class HFVideoConfig(ImageInputConfig):
    """``model``: hub name or local directory of a transformers video checkpoint (AutoModel:
    VideoMAE, TimeSformer, ViViT, X-CLIP); ``pretrained=False`` keeps only its architecture.
    Without ``model``: ``backbone_config`` = ``{"model_type": "videomae", ...}`` keyword
    arguments for a random-weight config (``timesformer``, ``vivit``, ``xclip``). ``pooling``:
    ``cls`` (the class token of the last hidden state: TimeSformer, ViViT), ``mean`` (mean over
    tokens: VideoMAE, which has no class token), ``pooler`` (the model's pooled output); None:
    ``cls`` when the model has a class token, else ``mean``. X-CLIP pools with its own
    multi-frame integration transformer (``pooling`` stays None; its text tower is dropped).
    The frames are cropped to the model config's ``image_size`` (which its position embeddings
    fix) and normalised by the checkpoint's processor's mean and std (else ImageNet's); the clips
    take the model config's ``num_frames``."""

    type = "hf_video"
    model: str | None = None
    pretrained: bool = True
    backbone_config: dict[str, Any] | None = None
    pooling: str | None = None


# X-CLIP's parts that only its text side and its video-text prompts use: dropped.
_XCLIP_TEXT_PARTS = ("text_model", "text_projection", "prompts_generator", "prompts_visual_layernorm",
                     "prompts_visual_projection", "logit_scale")


def video_processor(model: str) -> Any:
    """The video processor of a transformers checkpoint (transformers makes one from a video
    model's image processor config too); None without one."""
    from transformers import AutoVideoProcessor

    try:
        return AutoVideoProcessor.from_pretrained(model)
    except (OSError, ValueError, TypeError):  # no (or another kind of) preprocessor config
        return None


@register_adapter
class HFVideoAdapter(ClipInputAdapter):
    """transformers video model (VideoMAE, TimeSformer, ViViT, X-CLIP video tower) on whole clips."""

    config_class = HFVideoConfig
    config: HFVideoConfig

    def __init__(self, config: HFVideoConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        where = "hf_video adapter"
        self.backbone = transformers_backbone(config, load_weights=load_weights, saved_dir=saved_dir, what="video",
                                              default_type="videomae")
        name = type(self.backbone).__name__
        self.xclip = self.backbone.config.model_type == "xclip"
        if self.xclip:
            for part in _XCLIP_TEXT_PARTS:
                delattr(self.backbone, part)
        bcfg = self.backbone.config.vision_config if self.xclip else self.backbone.config
        if not all(hasattr(bcfg, key) for key in ("hidden_size", "image_size", "num_frames")):
            raise ValueError(f"{where}: {name} is not a video model (it has no num_frames, image_size and "
                             "hidden_size; image models take the hf_vision adapter)")
        processor = video_processor(config.model) if saved_dir is None and config.model else None
        # the frames are cropped to the size the position embeddings were made for
        self._set_image_input(int(bcfg.image_size), getattr(processor, "image_mean", None),
                              getattr(processor, "image_std", None))
        if config.image_size != int(bcfg.image_size):
            raise ValueError(f"{where}: {name} takes frames of {bcfg.image_size}x{bcfg.image_size} px (its config's "
                             f"image_size, which its position embeddings fix), got image_size {config.image_size}")
        self._set_frames(name, int(bcfg.num_frames), int(bcfg.num_frames), "its config's num_frames")
        has_cls = getattr(getattr(self.backbone, "embeddings", None), "cls_token", None) is not None
        if self.xclip:
            if config.pooling is not None:
                raise ValueError(f"{where}: X-CLIP pools its frames with its own multi-frame transformer; "
                                 f"remove pooling ({config.pooling!r})")
        elif config.pooling is None:
            config.pooling = "cls" if has_cls else "mean"
        elif config.pooling not in ("cls", "mean", "pooler"):
            raise ValueError(f"{where}: pooling must be 'cls', 'mean' or 'pooler', got {config.pooling!r}")
        elif config.pooling == "cls" and not has_cls:
            raise ValueError(f"{where}: {name} has no class token; use pooling 'mean'")
        self.feature_dim = int(self.backbone.config.projection_dim if self.xclip else bcfg.hidden_size)
        self.default_lora_targets = attention_lora_targets(self.backbone)
        self._finish_init()

    def _save_extra(self, directory: Path) -> None:
        self.backbone.config.save_pretrained(directory / "backbone")

    def enable_gradient_checkpointing(self) -> None:
        enable_transformers_checkpointing(self.backbone, "hf_video adapter")

    def backbone_blocks(self) -> list[nn.Module]:
        blocks = _first_module_list(self.backbone, ("layer", "layers"))  # X-CLIP: its vision layers come first
        if blocks is None:
            raise NotImplementedError(f"last_n: no layer list found in {type(self.backbone).__name__}")
        return blocks

    def backbone_tail(self) -> list[nn.Parameter]:
        model = self.backbone
        parts = [getattr(model, "layernorm", None), getattr(model, "pooler", None)]  # TimeSformer, ViViT
        if self.xclip:  # after the vision layers: their final norm, the projection, the multi-frame transformer
            parts += [model.vision_model.post_layernorm, model.visual_projection, model.mit]
        return [p for part in parts if isinstance(part, nn.Module) for p in part.parameters()]

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.xclip:
            return self.backbone.get_video_features(pixel_values=pixels).pooler_output
        out = self.backbone(pixel_values=pixels)
        if self.config.pooling == "pooler":
            if getattr(out, "pooler_output", None) is None:
                raise ValueError(f"hf_video adapter: {type(self.backbone).__name__} has no pooled output; use pooling "
                                 "'cls' or 'mean'")
            return out.pooler_output
        tokens = out.last_hidden_state
        return tokens[:, 0] if self.config.pooling == "cls" else tokens.mean(1)
