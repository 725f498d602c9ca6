"""The adapters' configuration dataclasses: the fields every adapter has (:class:`AdapterConfig`:
``embed_dim``, the projection head, how much of the backbone trains, gradient checkpointing); each
adapter type subclasses it with its backbone's fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from mmviews.schema import ConfigError, build_section, where


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
    # True: the head's output is L2-normalised (a point on the unit sphere, what the cosine
    # critics of the objectives score). False: the head's output as it is, for an objective that
    # scores unnormalised embeddings (``simclr`` / ``geometric_pvc`` with ``critic: squared_l2``).
    l2_normalize: bool = True

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.type}
        out.update(dataclasses.asdict(self))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], key: str = "", source: str | None = None) -> "AdapterConfig":
        """The config held by ``data`` (a recipe's ``adapters.<modality>`` mapping, a saved
        ``config.json``): every key must be a field and every value of its field's type, checked by
        the recipe's validator (:func:`mmviews.schema.build_section`); a wrong one is a
        :class:`~mmviews.schema.ConfigError` naming ``source`` (default: the adapter type) and the
        key path under ``key`` (e.g. ``adapters.text``)."""
        data = dict(data)
        given_type = data.pop("type", cls.type)
        if given_type != cls.type:
            raise ValueError(f"config of type {given_type!r} given to {cls.__name__} (type {cls.type!r})")
        source = f"{cls.type!r} adapter config" if source is None else source
        config = build_section(cls, data, key, source)
        if config.embed_dim < 1:  # a zero-width projection builds, and fails only in the first evaluation or step
            raise ConfigError(f"{where(source, f'{key}.embed_dim' if key else 'embed_dim')}: must be >= 1 (the size "
                              f"of the shared embedding), got {config.embed_dim}")
        return config
