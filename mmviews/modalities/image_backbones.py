"""Image backbones from other libraries: ``transformers`` vision models (``hf_vision``: ViT,
DINOv2, SigLIP / CLIP vision towers...), torchvision classifiers (``torchvision``) and timm
models (``timm``), with their classifier removed. The open_clip towers and the small CNN are in
:mod:`mmviews.modalities.vision`.

Inputs are those of every image adapter: ``{"values": FloatTensor[B, 3, H, W]}`` in [0, 1], or
clips ``[B, T, 3, H, W]``. Each image is resized (shorter side) and centre-cropped to the
backbone's input size, then normalised by its mean and standard deviation.

Weights: ``hf_vision`` reads a local checkpoint directory or a hub name (``from_pretrained``).
``torchvision`` and ``timm`` read a local weights file (``weights``): safetensors, or a torch
file read with ``torch.load(weights_only=True)`` (tensors only: nothing in it is executed),
whose sha256 is checked against ``weights_sha256`` or, as torchvision names its files
(``mobilenet_v2-b0353104.pth``), against the hex digits at the end of the file name.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.error import URLError

import torch
from torch import nn

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .hf_backbone import transformers_backbone
from .inputs import InputCheck, per_clip, require_tensor, to_device
from .checkpointing import enable_transformers_checkpointing
from .vision import UnitRangeInputCheck, resize_shortest_center_crop, split_frames

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class ImageInputConfig(AdapterConfig):
    """The image preprocessing shared by the image backbones: ``image_size`` (square side the
    images are resized and centre-cropped to; None: the backbone's own, or the input's size when
    it has none), ``mean``/``std`` per channel (None: the backbone's own, else ImageNet's),
    ``interpolation`` (bicubic | bilinear)."""

    image_size: int | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    interpolation: str = "bilinear"


class ImageInputAdapter(Adapter):
    """An adapter whose backbone takes normalised ``pixels [N, 3, S, S]`` and gives ``[N, F]``;
    subclasses build ``self.backbone`` and call :meth:`_set_image_input` before ``_finish_init``."""

    config: ImageInputConfig

    def channels(self) -> int:
        """Channels of the input images."""
        return 3

    def _set_image_input(self, size: int | None, mean: Any, std: Any, channels: int = 3) -> None:
        """Record the preprocessing in the config (so that a saved adapter keeps it): the config's
        own values win over the backbone's defaults given here."""
        cfg = self.config
        where = f"{cfg.type} adapter"
        if cfg.interpolation not in ("bicubic", "bilinear"):
            raise ValueError(f"{where}: interpolation must be 'bicubic' or 'bilinear', got {cfg.interpolation!r}")
        cfg.image_size = int(cfg.image_size or size) if (cfg.image_size or size) else None
        cfg.mean = [float(v) for v in (cfg.mean or mean or IMAGENET_MEAN)]
        cfg.std = [float(v) for v in (cfg.std or std or IMAGENET_STD)]
        if len(cfg.mean) != channels or len(cfg.std) != channels or min(cfg.std) <= 0:
            raise ValueError(f"{where}: mean and std need {channels} values (std > 0), got {cfg.mean} / {cfg.std}")
        self.register_buffer("mean", torch.tensor(cfg.mean).view(1, channels, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg.std).view(1, channels, 1, 1), persistent=False)

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = f"{self.config.type} adapter"
        frames, t = split_frames(require_tensor(inputs, "values", where), self.channels(), where)
        if not frames.is_floating_point():
            raise ValueError(f"{where}: images must be float in [0, 1], got dtype {frames.dtype}")
        frames = to_device(frames, self.mean.device, torch.float32)
        size = self.config.image_size
        if size:
            frames = resize_shortest_center_crop(frames, (size, size), self.config.interpolation).clamp(0, 1)
        return {"pixels": (frames - self.mean) / self.std, "frames": t}

    def input_check(self) -> InputCheck:
        return UnitRangeInputCheck(f"{self.config.type} adapter")

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return per_clip(self.pooled(prepared["pixels"]), prepared["frames"])

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, F]`` features of normalised images."""
        return self.backbone(pixels)


# --------------------------------------------------------------------------- weights files

_NAME_HASH = re.compile(r"-([0-9a-f]{6,64})\.[A-Za-z0-9]+$")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_torch_file(file: Path) -> Any:
    """A torch file's tensors, read weights-only: torch refuses a file that holds other objects
    (unpickling them could run code)."""
    return torch.load(file, map_location="cpu", weights_only=True)


def read_weights_file(path: str, expected_sha256: str | None, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a local weights file: ``.safetensors``, or a torch file read weights-only
    (a file holding code is refused by torch). The file's sha256 must begin with
    ``expected_sha256`` or, when that is None, with the hex digits that end a torchvision-style
    file name (``name-<hex>.pth``); a file with neither is read unchecked. A state dict nested
    under ``state_dict`` / ``model`` is unwrapped."""
    file = Path(os.path.expanduser(path))
    if not file.is_file():
        raise FileNotFoundError(f"{key}: weights file {path!r} does not exist")
    expected = expected_sha256
    if expected is None:
        match = _NAME_HASH.search(file.name)
        expected = match.group(1) if match else None
    if expected is not None:
        expected = expected.lower()
        if not re.fullmatch(r"[0-9a-f]{1,64}", expected):
            raise ValueError(f"{key}: weights_sha256 must be hex digits, got {expected_sha256!r}")
        actual = file_sha256(file)
        if not actual.startswith(expected):
            raise ValueError(f"{file}: sha256 {actual[:16]}... does not begin with {expected!r} "
                             "(a damaged or different file)")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file), device="cpu")
        else:
            state = load_torch_file(file)
    except Exception as err:  # unpickling refused, truncated file...
        raise ValueError(f"{file}: not a readable weights file ({str(err).splitlines()[0][:200]})") from None
    for nested in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(nested), dict):
            state = state[nested]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file}: holds no state dict of tensors")
    return state


def load_backbone_state(model: nn.Module, state: dict[str, torch.Tensor], dropped: set[str], file: str) -> None:
    """Load ``state`` into ``model`` strictly, except the keys of ``dropped`` (the removed
    classifier's) which the file may hold; a mismatch is one line naming ``file``."""
    state = {k: v for k, v in state.items() if k not in dropped}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        detail = " ".join(str(err).split())[:300]
        raise ValueError(f"{file}: does not fit the backbone ({detail})") from None


# --------------------------------------------------------------------------- transformers


@dataclass
class HFVisionConfig(ImageInputConfig):
    """``model``: hub name or local directory of a transformers vision checkpoint (AutoModel:
    ViT, DINOv2, SigLIP / CLIP vision towers, ...); ``pretrained=False`` keeps only its
    architecture. Without ``model``: ``backbone_config`` = ``{"model_type": "vit", ...}``
    keyword arguments for a random-weight config (``dinov2``, ``siglip_vision_model``,
    ``clip_vision_model``...). ``pooling``: ``pooler`` (the model's pooled output: SigLIP's
    attention pooling, CLIP's and DINOv2's normalised class token), ``cls`` (the first token of
    the last hidden state), ``mean`` (mean over tokens); None: ``pooler`` when the model has one,
    else ``cls``. Image size, mean and std default to the checkpoint's image processor (the size
    then to the model config's ``image_size``; a model configured for non-square images needs
    the recipe's ``image_size``: the adapter feeds square images)."""

    type = "hf_vision"
    model: str | None = None
    pretrained: bool = True
    backbone_config: dict[str, Any] | None = None
    pooling: str | None = None


def processor_side(processor: Any) -> int | None:
    """The square side a transformers image processor feeds its model: the centre crop's height
    when it crops, else the resize's height or shortest edge (None without a processor)."""
    fields = ("crop_size", "size") if getattr(processor, "do_center_crop", False) else ("size",)
    for name in fields:
        size = getattr(processor, name, None)
        if size is None:
            continue
        value = size.get if isinstance(size, Mapping) else (lambda key, size=size: getattr(size, key, None))
        side = value("height") or value("shortest_edge")
        if side:
            return int(side)
    return None


def attention_lora_targets(model: nn.Module) -> list[str]:
    """The LoRA targets of a transformers model: its attention's query and value projections
    (``query``/``value`` as BERT and ViT name them, else ``q_proj``/``v_proj``), or its fused
    ``qkv`` projection (TimeSformer)."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if "query" in names:
        return ["query", "value"]
    if "q_proj" not in names and "qkv" in names:
        return ["qkv"]
    return ["q_proj", "v_proj"]


def _first_module_list(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module] | None:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in names and len(module):
            return list(module)
    return None


@register_adapter
class HFVisionAdapter(ImageInputAdapter):
    """transformers vision model (ViT, DINOv2, SigLIP / CLIP vision) on images, pooled output or class token."""

    config_class = HFVisionConfig
    config: HFVisionConfig

    def __init__(self, config: HFVisionConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        from transformers import AutoImageProcessor

        self.backbone = transformers_backbone(config, load_weights=load_weights, saved_dir=saved_dir, what="vision",
                                              default_type="vit")
        processor = None
        if saved_dir is None and config.model:
            try:
                processor = AutoImageProcessor.from_pretrained(config.model)
            except (OSError, ValueError):
                processor = None  # no preprocessor config: ImageNet statistics, the model's size
        bcfg = self.backbone.config
        if not hasattr(bcfg, "hidden_size") or not hasattr(bcfg, "image_size"):
            raise ValueError(f"hf_vision: {type(self.backbone).__name__} is not an image model "
                             "(for a dual-encoder checkpoint pick its vision model, e.g. model_type siglip_vision_model)")
        side = processor_side(processor) or bcfg.image_size
        if isinstance(side, (list, tuple)):  # (height, width): Hiera, InternVL, YOLOS...
            if len(set(side)) > 1 and not config.image_size:
                raise ValueError(f"hf_vision: {type(self.backbone).__name__} takes {side[0]}x{side[1]} images; set "
                                 "image_size (the side of the square images it is given)")
            side = side[0]
        self._set_image_input(side, getattr(processor, "image_mean", None), getattr(processor, "image_std", None))
        if config.pooling not in (None, "pooler", "cls", "mean"):
            raise ValueError(f"hf_vision: pooling must be 'pooler', 'cls' or 'mean', got {config.pooling!r}")
        self.feature_dim = int(bcfg.hidden_size)
        self.default_lora_targets = attention_lora_targets(self.backbone)
        self._finish_init()

    def _save_extra(self, directory: Path) -> None:
        self.backbone.config.save_pretrained(directory / "backbone")

    def enable_gradient_checkpointing(self) -> None:
        enable_transformers_checkpointing(self.backbone, "hf_vision adapter")

    def backbone_blocks(self) -> list[nn.Module]:
        # Hierarchical models (Hiera) hold a list of stages, each with its own list of layers:
        # the stages come first in named_modules(), so they are the blocks, not stage 0's layers.
        blocks = _first_module_list(self.backbone, ("layer", "layers", "stages"))
        if blocks is None:
            raise NotImplementedError(f"last_n: no layer list found in {type(self.backbone).__name__}")
        return blocks

    def backbone_tail(self) -> list[nn.Parameter]:
        params: list[nn.Parameter] = []
        for name, module in self.backbone.named_modules():
            if name.rsplit(".", 1)[-1] in ("layernorm", "post_layernorm", "pooler", "head"):
                params += list(module.parameters())
        return params

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.backbone(pixel_values=pixels)
        pooling = self.config.pooling
        pooler = getattr(out, "pooler_output", None)
        if pooling == "pooler" or (pooling is None and pooler is not None):
            if pooler is None:
                raise ValueError(f"hf_vision: {type(self.backbone).__name__} has no pooled output; use pooling 'cls' or 'mean'")
            return pooler
        tokens = out.last_hidden_state
        return tokens[:, 0] if pooling in (None, "cls") else tokens.mean(1)


# --------------------------------------------------------------------------- torchvision / timm


@dataclass
class ClassifierBackboneConfig(ImageInputConfig):
    """``model``: the library's model name. ``weights``: a local weights file of the whole
    classifier (safetensors, or a torch file read weights-only), None for random weights
    (torchvision also takes one of the model's weight tags, e.g. ``IMAGENET1K_V1``, which it
    downloads). ``weights_sha256``: the beginning of the file's sha256 (default: the hex digits
    that end a torchvision-style file name). ``model_kwargs``: keyword arguments of the model's
    constructor (numbers, strings and lists only)."""

    model: str = ""
    weights: str | None = None
    weights_sha256: str | None = None
    model_kwargs: dict[str, Any] | None = None


def plain_kwargs(kwargs: Mapping[str, Any] | None, where: str, key: str = "model_kwargs") -> dict[str, Any]:
    """``kwargs`` (a recipe's keyword arguments for a constructor), refused unless every value is
    a number, a string, None or a list of them: a recipe passes data, never objects."""
    def plain(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (bool, int, float, str))

    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(f"{where}: {key} must be a mapping, got {type(kwargs).__name__}")
    for name, value in (kwargs or {}).items():
        if not plain(value):
            raise ValueError(f"{where}: {key}.{name} must be a number, string or list, got {type(value).__name__}")
    return dict(kwargs or {})


def require_known_model(name: str, known: list[str], where: str, listing: str) -> None:
    """A ``ValueError`` naming ``name`` (with the closest known name) when it is not in ``known``."""
    if name not in known:
        from mmviews.registry import did_you_mean

        raise ValueError(f"{where}: unknown model {name!r}{did_you_mean(name, known)} ({listing})")


def drop_classifier(model: nn.Module, where: str) -> tuple[int, set[str]]:
    """Replace the last ``nn.Linear`` of a torchvision classifier (its classification layer)
    by ``nn.Identity``: ``(its input width, the state-dict keys it had)``."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None:
        raise ValueError(f"{where}: no Linear classification layer found in {type(model).__name__}")
    linear = model.get_submodule(last)
    parent_name, _, child = last.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, nn.Identity())
    return int(linear.in_features), {f"{last}.{k}" for k, _ in linear.named_parameters()}


def torchvision_backbone(config: ClassifierBackboneConfig, module: Any, where: str, *, load_weights: bool,
                         drop: Callable[[nn.Module, str], tuple[int, set[str]]] = drop_classifier) -> tuple[nn.Module, int]:
    """``(model, feature width)``: torchvision's ``config.model`` (one of ``module``'s models:
    ``torchvision.models``, ``torchvision.models.video``) without its classifier (``drop``), with
    ``config.weights`` when ``load_weights``: a local file (:func:`read_weights_file`: checked by
    sha256, read weights-only) or one of the model's weight tags, which torchvision downloads
    (and checks by its own hash) into torch's cache."""
    import torchvision

    listing = "torchvision.models.list_models()" if module is torchvision.models else \
        f"torchvision.models.list_models(module={module.__name__})"
    require_known_model(config.model, torchvision.models.list_models(module=module), where, listing)
    kwargs = plain_kwargs(config.model_kwargs, where)
    weights = config.weights if load_weights else None
    tag = None
    if weights is not None and not os.path.isfile(os.path.expanduser(weights)):
        tags = [w.name for w in torchvision.models.get_model_weights(config.model)]
        if weights not in tags:
            raise FileNotFoundError(f"{where}: weights {weights!r} is neither a file nor a weight tag of "
                                    f"{config.model!r} ({', '.join(tags) or 'none'})")
        tag, weights = weights, None
    try:
        model = torchvision.models.get_model(config.model, weights=tag, **kwargs)
    except URLError as err:  # the tag's file is not in torch's cache and cannot be downloaded
        url = torchvision.models.get_model_weights(config.model)[tag].url
        raise FileNotFoundError(f"{where}: weights {tag!r} of {config.model!r} could not be downloaded from {url} "
                                f"({err.reason}); download the file elsewhere and give its path as weights, or set "
                                "weights: null for random weights") from None
    feature_dim, dropped = drop(model, where)
    if weights is not None:
        load_backbone_state(model, read_weights_file(weights, config.weights_sha256, "weights"), dropped, weights)
    return model, feature_dim


@dataclass
class TorchvisionConfig(ClassifierBackboneConfig):
    __doc__ = ClassifierBackboneConfig.__doc__
    type = "torchvision"
    model: str = "resnet18"


@register_adapter
class TorchvisionAdapter(ImageInputAdapter):
    """torchvision classification model (ResNet, MobileNet, EfficientNet, ConvNeXt, ViT...) without its classifier."""

    config_class = TorchvisionConfig
    config: TorchvisionConfig

    def __init__(self, config: TorchvisionConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        import torchvision

        self.backbone, self.feature_dim = torchvision_backbone(config, torchvision.models, "torchvision adapter",
                                                               load_weights=load_weights and saved_dir is None)
        size = None
        if config.model.startswith(("vit_", "swin_", "maxvit")):  # fixed input size
            size = int(getattr(self.backbone, "image_size", 224))
        self._set_image_input(size, IMAGENET_MEAN, IMAGENET_STD)
        self._finish_init()

    def backbone_blocks(self) -> list[nn.Module]:
        model = self.backbone
        if all(hasattr(model, f"layer{i}") for i in range(1, 5)):  # ResNet / ResNeXt
            return [getattr(model, f"layer{i}") for i in range(1, 5)]
        if isinstance(getattr(model, "features", None), nn.Sequential):  # MobileNet, EfficientNet, ConvNeXt, VGG
            return list(model.features)
        layers = getattr(getattr(model, "encoder", None), "layers", None)  # ViT
        if isinstance(layers, nn.Sequential):
            return list(layers)
        raise NotImplementedError(f"last_n: unknown block layout of torchvision {type(model).__name__}")

    def backbone_tail(self) -> list[nn.Parameter]:
        tail = [getattr(self.backbone, "classifier", None), getattr(getattr(self.backbone, "encoder", None), "ln", None)]
        return [p for module in tail if isinstance(module, nn.Module) for p in module.parameters()]


@dataclass
class TimmConfig(ClassifierBackboneConfig):
    __doc__ = ClassifierBackboneConfig.__doc__
    type = "timm"
    model: str = "resnet18"


@register_adapter
class TimmAdapter(ImageInputAdapter):
    """timm model (``timm.create_model``, no classifier: pooled features) on images."""

    config_class = TimmConfig
    config: TimmConfig

    def __init__(self, config: TimmConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        import timm

        where = "timm adapter"
        if not timm.is_model(config.model):
            require_known_model(config.model, timm.list_models(), where, "timm.list_models()")
        # pretrained=False: weights come from the local file only (timm would fetch them)
        self.backbone = timm.create_model(config.model, pretrained=False, num_classes=0,
                                          **plain_kwargs(config.model_kwargs, where))
        weights = config.weights if load_weights and saved_dir is None else None
        if weights is not None:
            state = read_weights_file(weights, config.weights_sha256, "weights")
            classifier = self.backbone.pretrained_cfg.get("classifier") or ""
            names = [classifier] if isinstance(classifier, str) else list(classifier)
            dropped = {k for k in state for name in names if name and k.startswith(f"{name}.")}
            load_backbone_state(self.backbone, state, dropped, weights)
        data = timm.data.resolve_data_config({}, model=self.backbone)
        self._set_image_input(int(data["input_size"][-1]), data.get("mean"), data.get("std"))
        self.feature_dim = int(self.backbone.num_features)
        self._finish_init()

    def enable_gradient_checkpointing(self) -> None:
        """timm's own switch. Its recomputation runs BatchNorm layers a second time in training
        mode (their running statistics would move twice per step): models with BatchNorm are
        refused (transformers such as ViT have none)."""
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.backbone.modules()):
            raise ValueError(f"timm adapter: gradient_checkpointing is not supported for {self.config.model!r} "
                             "(a BatchNorm model: its running statistics would be updated twice per step)")
        self.backbone.set_grad_checkpointing(True)

    def backbone_blocks(self) -> list[nn.Module]:
        for name in ("blocks", "stages", "layers"):
            blocks = getattr(self.backbone, name, None)
            if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
                return list(blocks)
        if all(hasattr(self.backbone, f"layer{i}") for i in range(1, 5)):
            return [getattr(self.backbone, f"layer{i}") for i in range(1, 5)]
        raise NotImplementedError(f"last_n: unknown block layout of timm {type(self.backbone).__name__}")

    def backbone_tail(self) -> list[nn.Parameter]:
        tail = [getattr(self.backbone, name, None) for name in ("norm", "fc_norm", "head_drop", "conv_head", "bn2")]
        return [p for module in tail if isinstance(module, nn.Module) for p in module.parameters()]
