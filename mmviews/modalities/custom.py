"""A backbone of one's own, without editing mmviews.

Two ways in, both through Python, because a recipe only names what Python code registered and
never names a module to import (so a recipe cannot make mmviews run code one did not install or
import): :func:`register_backbone` turns an image backbone factory (``[N, C, H, W]`` ->
``[N, F]``) into an adapter type with the built-in image preprocessing, head, fine-tuning modes,
saving and loading; :func:`~mmviews.modalities.base.register_adapter` takes a full
:class:`Adapter` subclass for other inputs. An installed package can offer either through the
entry-point group ``mmviews.adapters`` (:data:`ENTRY_POINT_GROUP`), loaded only when a config
names a type nothing registered, so installing a package never changes a built-in type. How to
write and register one, with a runnable example: ``docs/backbones.md`` ("Your own backbone").
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

import torch
from torch import nn

from .base import Adapter, adapter_registered, register_adapter, set_entry_point_loader
from .image_backbones import ImageInputAdapter, ImageInputConfig, plain_kwargs
from .vision import split_frames

ENTRY_POINT_GROUP = "mmviews.adapters"

Factory = TypeVar("Factory", bound=Callable[..., nn.Module])


@dataclass
class CustomBackboneConfig(ImageInputConfig):
    """``args``: keyword arguments of the registered factory. ``in_channels``: channels of the
    images (``mean``/``std`` need as many values; default 3). ``feature_dim``: the width of the
    backbone's output (None: the module's ``feature_dim`` attribute, else measured by one forward
    of two blank images)."""

    args: dict[str, Any] = field(default_factory=dict)
    in_channels: int = 3
    feature_dim: int | None = None


class CustomBackboneAdapter(ImageInputAdapter):
    """Base of the adapters made by :func:`register_backbone` (each has its own subclass)."""

    config: CustomBackboneConfig
    factory: ClassVar[Callable[..., nn.Module]]

    def __init__(self, config: CustomBackboneConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        where = f"{config.type} adapter"
        backbone = type(self).factory(**plain_kwargs(config.args, where, "args"))
        if not isinstance(backbone, nn.Module):
            raise ValueError(f"{where}: the registered factory returned {type(backbone).__name__}, not an nn.Module")
        self.backbone = backbone
        channels = int(config.in_channels)
        self._set_image_input(None, [0.5] * channels, [0.25] * channels, channels)
        self.feature_dim = int(config.feature_dim or getattr(backbone, "feature_dim", 0) or self._measure_width())
        self._finish_init()

    def _measure_width(self) -> int:
        side = self.config.image_size or 32
        was_training = self.backbone.training
        self.backbone.eval()  # BatchNorm statistics untouched
        with torch.no_grad():
            out = self.backbone(torch.zeros(2, self.config.in_channels, side, side))
        self.backbone.train(was_training)
        if not isinstance(out, torch.Tensor) or out.dim() != 2:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{self.config.type} adapter: the backbone must return features [N, F], got {shape} "
                             f"for images of shape (2, {self.config.in_channels}, {side}, {side})")
        return int(out.shape[1])

    def channels(self) -> int:
        return int(self.config.in_channels)

    def backbone_blocks(self) -> list[nn.Module]:
        """The module's ``blocks()`` when it defines one (for ``finetune.mode: last_n``)."""
        blocks = getattr(self.backbone, "blocks", None)
        if callable(blocks):
            return list(blocks())
        return super().backbone_blocks()


def register_backbone(name: str, description: str = "") -> Callable[[Factory], Factory]:
    """Decorator: make the factory (an ``nn.Module`` class or a function returning one; images
    ``[N, C, H, W]`` -> ``[N, F]``) the adapter type ``name`` (see docs/backbones.md). The
    description defaults to the first line of the factory's docstring; a name already taken
    raises ``ValueError``. Returns the factory unchanged."""

    def wrap(factory: Factory) -> Factory:
        if not callable(factory):
            raise ValueError(f"register_backbone({name!r}): {factory!r} is not callable")
        doc = description or (inspect.getdoc(factory) or "").strip().split("\n")[0] or f"backbone {name}"
        config_class = dataclasses.make_dataclass(
            f"{_class_name(name)}Config", [("type", ClassVar[str], name)], bases=(CustomBackboneConfig,))
        config_class.__doc__ = CustomBackboneConfig.__doc__
        adapter = type(f"{_class_name(name)}Adapter", (CustomBackboneAdapter,),
                       {"config_class": config_class, "factory": staticmethod(factory), "__doc__": doc,
                        "__module__": getattr(factory, "__module__", __name__)})
        register_adapter(adapter)
        return factory

    return wrap


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").split("_") if part) or "Custom"


def unloaded_entry_points() -> dict[str, str]:
    """``{adapter type: "module:object"}`` of the installed ``mmviews.adapters`` entry points whose
    type nothing has registered yet (listed without importing anything)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            if not adapter_registered(ep.name)}


def load_entry_point_adapter(type_name: str) -> bool:
    """Register adapter type ``type_name`` from the installed packages' ``mmviews.adapters``
    entry point of that name, if there is one: True when it did. The object must be an
    :class:`Adapter` subclass whose config type is ``type_name``, or a backbone factory."""
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == type_name]
    if not found:
        return False
    entry = found[0]
    try:
        obj = entry.load()
    except Exception as err:  # the package is broken: say which one
        raise ValueError(f"adapter type {type_name!r}: entry point {entry.value!r} ({ENTRY_POINT_GROUP}) "
                         f"failed to load: {err}") from err
    if adapter_registered(type_name):  # importing the package registered it (a decorator at import)
        return True
    if isinstance(obj, type) and issubclass(obj, Adapter):
        if obj.config_class.type != type_name:
            raise ValueError(f"adapter type {type_name!r}: entry point {entry.value!r} gives an adapter of type "
                             f"{obj.config_class.type!r}")
        register_adapter(obj)
    else:
        register_backbone(type_name)(obj)
    return True


set_entry_point_loader(load_entry_point_adapter)
