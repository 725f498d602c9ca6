"""The adapters' configuration dataclasses: the fields every adapter has (:class:`AdapterConfig`:
``embed_dim``, the projection head, how much of the backbone trains, gradient checkpointing); each
adapter type subclasses it with its backbone's fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping


@dataclass
class HeadConfig:
    """Projection head. ``kind="linear"``: one Linear. ``kind="mlp"`` (SimCLR-style):
    ``num_layers`` Linear layers (>= 2) with BatchNorm (optional) and an activation
    between them; the last layer has no norm and no activation."""

    kind: str = "mlp"
    hidden_dim: int | None = None  # None: max(feature_dim, embed_dim)
    num_layers: int = 2
    batch_norm: bool = True
    activation: str = "relu"  # relu | gelu
    dropout: float = 0.0


@dataclass
class LoRAConfig:
    """LoRA through ``peft`` on the backbone's linear layers. ``target_modules`` None
    uses the adapter's default (e.g. BERT ``query``/``value``)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | None = None


@dataclass
class FinetuneConfig:
    """How much of the backbone trains.

    ``mode``: ``"full"`` (everything), ``"frozen"`` (nothing; the backbone runs in eval
    mode and without autograd, and its outputs can be cached), or ``"last_n"`` (the last
    ``last_n`` blocks plus whatever follows them, e.g. a final LayerNorm). ``lora`` adds
    LoRA matrices (trainable) on top of any mode; with ``"frozen"`` only they train.
    """

    mode: str = "full"
    last_n: int = 0
    lora: LoRAConfig | None = None


@dataclass
class AdapterConfig:
    """Fields common to every adapter. Subclasses add their backbone's fields."""

    type: ClassVar[str] = ""
    embed_dim: int = 128
    head: HeadConfig = field(default_factory=HeadConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    # Recompute the backbone's activations in backward instead of keeping them (less memory,
    # one more backbone forward per step; same gradients): see Adapter.enable_gradient_checkpointing.
    gradient_checkpointing: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.type}
        out.update(dataclasses.asdict(self))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AdapterConfig":
        data = dict(data)
        given_type = data.pop("type", cls.type)
        if given_type != cls.type:
            raise ValueError(f"config of type {given_type!r} given to {cls.__name__} (type {cls.type!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in {cls.type!r} adapter config; allowed: {sorted(names)}"
            )
        if isinstance(data.get("head"), Mapping):
            data["head"] = _dataclass_from_dict(HeadConfig, data["head"], "head")
        if isinstance(data.get("finetune"), Mapping):
            ft = dict(data["finetune"])
            if isinstance(ft.get("lora"), Mapping):
                ft["lora"] = _dataclass_from_dict(LoRAConfig, ft["lora"], "finetune.lora")
            data["finetune"] = _dataclass_from_dict(FinetuneConfig, ft, "finetune")
        return cls(**data)


def _dataclass_from_dict(cls: type, data: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where!r}; allowed: {sorted(names)}")
    return cls(**data)
