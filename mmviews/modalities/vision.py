"""Vision: CLIP image towers through ``open_clip``, and a small CNN for CPU-sized images.

Inputs: ``{"values": FloatTensor[B, 3, H, W]}`` images in [0, 1], or
``{"values": FloatTensor[B, T, 3, H, W]}`` clips: every frame is encoded, projected and
normalised, then the frames are averaged and the mean re-normalised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .inputs import InputCheck, per_clip, require_tensor, to_device
from .remote import check_model_source
from .checkpointing import checkpointed

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def split_frames(x: torch.Tensor, channels: int, where: str) -> tuple[torch.Tensor, int | None]:
    """``[B, C, H, W]`` -> (same, None); ``[B, T, C, H, W]`` -> (``[B*T, C, H, W]``, T).
    Checks the channel count and the rank."""
    if x.dim() == 4:
        frames, t = x, None
    elif x.dim() == 5:
        if x.shape[1] == 0:
            raise ValueError(f"{where}: clip with T=0 frames (shape {tuple(x.shape)})")
        frames, t = x.reshape(-1, *x.shape[2:]), int(x.shape[1])
    else:
        raise ValueError(f"{where}: values must be [B, {channels}, H, W] or [B, T, {channels}, H, W], got shape {tuple(x.shape)}")
    if frames.shape[1] != channels:
        raise ValueError(f"{where}: expected {channels} channels, got {frames.shape[1]} (values shape {tuple(x.shape)})")
    if frames.shape[2] == 0 or frames.shape[3] == 0:
        raise ValueError(f"{where}: empty spatial size in shape {tuple(x.shape)}")
    return frames, t


@dataclass(frozen=True)
class UnitRangeInputCheck(InputCheck):
    """Finite values, and images ``values`` within [0, 1] (up to rounding)."""

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        super().__call__(inputs, present)
        x = inputs.get("values")
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            low, high = (float(v) for v in torch.aminmax(x))
            if low < -1e-3 or high > 1 + 1e-3:
                raise ValueError(f"{self.where}: images must be in [0, 1], got range [{low:.3g}, {high:.3g}] "
                                 f"in inputs['values'] of shape {tuple(x.shape)}")


def resize_shortest_center_crop(x: torch.Tensor, size: tuple[int, int], interpolation: str = "bicubic") -> torch.Tensor:
    """open_clip's eval transform on a tensor batch ``[N, C, H, W]``: resize the shorter
    side to the target, then centre-crop. Returns ``x`` unchanged when sizes match."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    if tuple(x.shape[-2:]) == tuple(size):
        return x
    mode = InterpolationMode.BICUBIC if interpolation == "bicubic" else InterpolationMode.BILINEAR
    short = max(size)
    x = TF.resize(x, [short], interpolation=mode, antialias=True)
    return TF.center_crop(x, list(size))


@dataclass
class OpenCLIPVisionConfig(AdapterConfig):
    """``model``: an open_clip model name (``open_clip.list_models()``; ``hf-hub:``/``local-dir:``
    names only with ``--allow-remote-models``). ``pretrained``: a tag
    (``open_clip.list_pretrained_tags_by_model(model)``, needs internet), a local checkpoint
    file (safetensors, or a torch file read weights-only), or None (random weights).
    ``model_overrides``: architecture keywords for ``open_clip.create_model`` (e.g. a small
    ``vision_cfg`` for tests): only the keys in :data:`OPEN_CLIP_OVERRIDE_KEYS`, so that a
    config cannot make open_clip load other files or unpickle anything."""

    type = "open_clip"
    model: str = "ViT-B-32"
    pretrained: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    image_size: int | None = None  # force_image_size


# model_overrides keys passed to open_clip.create_model: the architecture (CLIP's constructor
# arguments and create_model's force_* switches), nothing that loads files or weights
# (pretrained_image_path, pretrained_text_path, weights_only, cache_dir, pretrained_image,
# pretrained_hf, jit, device...).
OPEN_CLIP_OVERRIDE_KEYS = frozenset({
    "embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale", "init_logit_bias",
    "nonscalar_logit_scale", "force_quick_gelu", "force_custom_text", "force_patch_dropout",
    "force_preprocess_cfg", "force_context_length",
})
# Keys of vision_cfg / text_cfg that fetch weights or tokenizers (timm / HuggingFace hub).
_TOWER_KEYS_REFUSED = frozenset({"timm_model_pretrained", "hf_model_name", "hf_model_pretrained",
                                 "hf_tokenizer_name", "tokenizer_kwargs"})


def check_open_clip_overrides(overrides: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first ``model_overrides`` key outside
    :data:`OPEN_CLIP_OVERRIDE_KEYS`, or a tower key that loads weights."""
    for key, value in overrides.items():
        if key not in OPEN_CLIP_OVERRIDE_KEYS:
            raise ValueError(f"model_overrides key {key!r} is not allowed (only architecture keys: "
                             f"{', '.join(sorted(OPEN_CLIP_OVERRIDE_KEYS))}); weights come from 'pretrained'")
        if key in ("vision_cfg", "text_cfg"):
            if not isinstance(value, Mapping):
                raise ValueError(f"model_overrides.{key} must be a mapping, got {type(value).__name__}")
            refused = sorted(set(value) & _TOWER_KEYS_REFUSED)
            if refused:
                raise ValueError(f"model_overrides.{key}.{refused[0]} is not allowed: it makes open_clip fetch weights "
                                 "or a tokenizer; weights come from 'pretrained'")


def create_open_clip_visual(config: OpenCLIPVisionConfig, load_weights: bool) -> nn.Module:
    """The image tower of ``open_clip.create_model`` (the text tower is dropped).

    Weights: ``config.pretrained`` only (open_clip reads safetensors, or torch files with
    ``weights_only=True``); overrides are checked by :func:`check_open_clip_overrides` and
    external model names by :func:`~mmviews.modalities.remote.check_model_source` first."""
    import open_clip

    check_open_clip_overrides(config.model_overrides)
    check_model_source(config.model, "model")
    pretrained = config.pretrained if load_weights else None
    if pretrained:
        tags = open_clip.list_pretrained_tags_by_model(config.model)
        if pretrained not in tags:
            if not os.path.isfile(os.path.expanduser(pretrained)):
                raise FileNotFoundError(
                    f"open_clip pretrained={pretrained!r} is neither a tag of {config.model!r} ({tags[:5]}...) "
                    "nor an existing checkpoint file"
                )
            pretrained = os.path.expanduser(pretrained)  # open_clip takes the path as it is ('~/...' unexpanded)
    if config.model not in open_clip.list_models() and not config.model.startswith(("hf-hub:", "local-dir:")):
        raise ValueError(f"unknown open_clip model {config.model!r}; see open_clip.list_models()")
    kwargs = dict(config.model_overrides)
    if config.image_size:
        kwargs["force_image_size"] = config.image_size
    model = open_clip.create_model(config.model, pretrained=pretrained, weights_only=True, **kwargs)
    visual = model.visual
    if pretrained:
        # The checkpoint's learned logit_scale (and SigLIP's logit_bias), kept for an objective's
        # ``temperature: pretrained`` (mmviews.train.build) after the text tower and they are dropped.
        visual.pretrained_logit_scale = float(model.logit_scale.detach().reshape(-1)[0])
        bias = getattr(model, "logit_bias", None)
        visual.pretrained_logit_bias = None if bias is None else float(bias.detach().reshape(-1)[0])
    return visual


def _clip_blocks(visual: nn.Module) -> list[nn.Module]:
    if hasattr(visual, "transformer") and hasattr(visual.transformer, "resblocks"):
        return list(visual.transformer.resblocks)
    if all(hasattr(visual, f"layer{i}") for i in range(1, 5)):  # ModifiedResNet
        return [getattr(visual, f"layer{i}") for i in range(1, 5)]
    raise NotImplementedError(f"last_n: unknown block layout of {type(visual).__name__}")


def _clip_tail(visual: nn.Module) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    for name in ("ln_post", "attnpool", "head"):
        mod = getattr(visual, name, None)
        if isinstance(mod, nn.Module):
            params += list(mod.parameters())
    if isinstance(getattr(visual, "proj", None), nn.Parameter):
        params.append(visual.proj)
    return params


class OpenCLIPTower:
    """Shared by the adapters whose backbone is an open_clip visual tower (images, flow):
    its input size, feature width, fine-tuning blocks and per-clip encoding."""

    backbone: nn.Module

    def _read_tower(self) -> None:
        size = self.backbone.image_size
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.feature_dim = int(self.backbone.output_dim)

    @property
    def pretrained_logit_scale(self) -> float | None:
        """The pretrained checkpoint's learned ``logit_scale`` (log of the inverse temperature),
        or None when the tower was not loaded from one."""
        return getattr(self.backbone, "pretrained_logit_scale", None)

    @property
    def pretrained_logit_bias(self) -> float | None:
        """The pretrained checkpoint's ``logit_bias`` (SigLIP models), else None."""
        return getattr(self.backbone, "pretrained_logit_bias", None)

    def backbone_blocks(self) -> list[nn.Module]:
        return _clip_blocks(self.backbone)

    def backbone_tail(self) -> list[nn.Parameter]:
        return _clip_tail(self.backbone)

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return per_clip(self.backbone(prepared["pixels"]), prepared["frames"])

    def enable_gradient_checkpointing(self) -> None:
        """open_clip's own switch (``set_grad_checkpointing``: each transformer block is
        recomputed in backward, non-reentrant). open_clip's ResNet towers ignore the switch: they
        are refused here rather than silently left as they are."""
        self.backbone.set_grad_checkpointing(True)
        transformer = getattr(self.backbone, "transformer", None)
        if not getattr(transformer, "grad_checkpointing", False):
            raise ValueError(f"{self.config.type} adapter: the image tower of open_clip model {self.config.model!r} "
                             f"({type(self.backbone).__name__}) does not support gradient checkpointing (ViT towers do)")


@register_adapter
class OpenCLIPVisionAdapter(OpenCLIPTower, Adapter):
    """open_clip image tower (ViT / ResNet) on images ``[B, 3, H, W]`` or clips ``[B, T, 3, H, W]``."""

    config_class = OpenCLIPVisionConfig
    default_lora_targets = ["c_fc", "c_proj"]
    config: OpenCLIPVisionConfig

    def __init__(
        self, config: OpenCLIPVisionConfig, *, load_weights: bool = True, saved_dir: Path | None = None
    ) -> None:
        super().__init__(config)
        self.backbone = create_open_clip_visual(config, load_weights)
        pcfg = getattr(self.backbone, "preprocess_cfg", {}) or {}
        self._read_tower()
        self.interpolation = pcfg.get("interpolation", "bicubic")
        self.register_buffer("mean", torch.tensor(pcfg.get("mean", OPENAI_MEAN)).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(pcfg.get("std", OPENAI_STD)).view(1, 3, 1, 1), persistent=False)
        self._finish_init()

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = f"{self.config.type} adapter"
        x = require_tensor(inputs, "values", where)
        frames, t = split_frames(x, 3, where)
        if not frames.is_floating_point():
            raise ValueError(f"{where}: images must be float in [0, 1], got dtype {frames.dtype}")
        frames = to_device(frames, self.mean.device, torch.float32)
        frames = resize_shortest_center_crop(frames, self.image_size, self.interpolation).clamp(0, 1)
        return {"pixels": (frames - self.mean) / self.std, "frames": t}

    def input_check(self) -> InputCheck:
        return UnitRangeInputCheck(f"{self.config.type} adapter")


@dataclass
class SmallCNNVisionConfig(AdapterConfig):
    """A small CNN trained from scratch for CPU-sized images (e.g. 32x32): stages of two
    3x3 conv-BN-ReLU (the first of each stage after the first with stride 2), then
    global average pooling. ``in_channels`` may differ from 3 (e.g. IPMC's L or ab
    views); ``mean``/``std`` normalise each channel."""

    type = "small_cnn"
    in_channels: int = 3
    channels: list[int] = field(default_factory=lambda: [32, 64, 128])
    mean: list[float] | None = None  # default 0.5 per channel
    std: list[float] | None = None  # default 0.25 per channel


def conv_stage(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int, channels: list[int]) -> None:
        super().__init__()
        if not channels:
            raise ValueError("small_cnn needs at least one stage in 'channels'")
        stages, c = [], in_channels
        for i, width in enumerate(channels):
            stages.append(conv_stage(c, width, 1 if i == 0 else 2))
            c = width
        self.stages = nn.Sequential(*stages)
        self.checkpoint_stages = False  # gradient_checkpointing: recompute each stage in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_stages:
            for stage in self.stages:
                x = checkpointed(stage, x)
            return x.mean(dim=(2, 3))
        return self.stages(x).mean(dim=(2, 3))


@register_adapter
class SmallCNNVisionAdapter(Adapter):
    """Small 2-D CNN (CPU-sized images, any number of channels)."""

    config_class = SmallCNNVisionConfig
    config: SmallCNNVisionConfig

    def __init__(
        self, config: SmallCNNVisionConfig, *, load_weights: bool = True, saved_dir: Path | None = None
    ) -> None:
        super().__init__(config)
        c = config.in_channels
        mean = config.mean or [0.5] * c
        std = config.std or [0.25] * c
        if len(mean) != c or len(std) != c:
            raise ValueError(f"small_cnn mean/std need {c} values (in_channels), got {len(mean)}/{len(std)}")
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1), persistent=False)
        self.backbone = SmallCNN(c, list(config.channels))
        self.feature_dim = int(config.channels[-1])
        self._finish_init()

    def backbone_blocks(self) -> list[nn.Module]:
        return list(self.backbone.stages)

    def enable_gradient_checkpointing(self) -> None:
        self.backbone.checkpoint_stages = True

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = "small_cnn adapter"
        x = require_tensor(inputs, "values", where)
        frames, t = split_frames(x, self.config.in_channels, where)
        if not frames.is_floating_point():
            raise ValueError(f"{where}: images must be float, got dtype {frames.dtype}")
        frames = to_device(frames, self.mean.device, torch.float32)
        return {"pixels": (frames - self.mean) / self.std, "frames": t}

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return per_clip(self.backbone(prepared["pixels"]), prepared["frames"])
