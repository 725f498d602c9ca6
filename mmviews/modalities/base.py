"""The adapter contract shared by every modality.

An adapter maps one view to one point on the unit sphere of the shared space:

    inputs (dict) -> preprocess -> backbone -> pool -> projection head -> L2 normalise -> [B, d]

``features(inputs)`` runs the first three steps and returns the pooled backbone features,
``[B, F]`` (or ``[B, T, F]`` for inputs made of several frames, pooled over time after the
head). ``project(features)`` runs the head and the normalisation. The split is what the
feature cache (:mod:`mmviews.modalities.cache`) uses to skip a frozen backbone.

No temperature is applied here: it belongs to the objective.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mmviews.data.batch import PresentItems
from mmviews.data.safe_pickle import CorruptFileError
from mmviews.fileio import atomic_save, atomic_write_text, read_json_object
from mmviews.registry import Registry

from .collectives import plain_zeros_like, runs_collectives, syncs_batch_norm
from .config import AdapterConfig, LoRAConfig
from .head import ProjectionHead
from .inputs import HostPreprocessor, InputCheck, subset_inputs, to_device

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# config type name -> Adapter subclass, filled by @register_adapter where each adapter is
# defined; private: use register_adapter / adapter_class / build_adapter / list_adapters.
_ADAPTERS: Registry[type["Adapter"]] = Registry("adapter type")


# --------------------------------------------------------------------------- adapter


def register_adapter(cls: type["Adapter"]) -> type["Adapter"]:
    """Class decorator: make ``cls`` buildable from a config dict whose ``type`` is
    ``cls.config_class.type``. The first line of the class docstring is its description in
    :func:`list_adapters`. A type registered twice raises ``ValueError``."""
    return _ADAPTERS.add(cls.config_class.type, cls)


def adapter_class(type_name: str) -> type["Adapter"]:
    """The :class:`Adapter` subclass registered for config ``type`` ``type_name``; a type nothing
    registered is looked up among the installed packages' ``mmviews.adapters`` entry points
    (:func:`mmviews.modalities.custom.load_entry_point_adapter`), and one not found there either
    raises ``ValueError`` listing the known ones."""
    if isinstance(type_name, str) and type_name not in _ADAPTERS and _entry_point_loader is not None:
        _entry_point_loader(type_name)
    return _ADAPTERS.get(type_name)


# Set by mmviews.modalities.custom when it is imported (the package's __init__ imports it), so
# that this module, which custom builds on, need not import it back.
_entry_point_loader: Callable[[str], bool] | None = None


def set_entry_point_loader(loader: Callable[[str], bool]) -> None:
    """Install the function that registers an adapter type from the installed packages' entry
    points (:func:`mmviews.modalities.custom.load_entry_point_adapter`)."""
    global _entry_point_loader
    _entry_point_loader = loader


def adapter_registered(type_name: str) -> bool:
    """Whether adapter type ``type_name`` is registered (entry points are not looked up)."""
    return type_name in _ADAPTERS


def list_adapters() -> dict[str, str]:
    """``{type: one-line description}`` of every registered adapter, sorted by type."""
    return _ADAPTERS.descriptions()


class Adapter(nn.Module):
    """Base class: one modality's view -> unit vector ``[B, embed_dim]``.

    Subclasses set ``config_class``, build ``self.backbone`` and ``self.feature_dim`` in
    ``__init__`` and then call ``self._finish_init()``; they implement ``preprocess`` and
    ``encode`` (backbone + pooling), and list their blocks for ``last_n`` fine-tuning.
    """

    config_class: ClassVar[type[AdapterConfig]] = AdapterConfig
    # peft target module names used when ``finetune.lora.target_modules`` is None.
    default_lora_targets: ClassVar[list[str] | None] = None
    # Whether features()/forward() check the input values (input_check()); each check reads
    # values back, a device synchronisation for inputs on an accelerator. A call may override it
    # (check_inputs=...): MultiViewEncoder turns the checks off for batches already checked on
    # the host (ViewBatch.inputs_checked), as the trainer's are.
    check_inputs: bool = True

    backbone: nn.Module
    feature_dim: int

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__()
        self.config = config

    # ---- construction -----------------------------------------------------------

    @classmethod
    def from_config(cls, config: AdapterConfig | Mapping[str, Any]) -> "Adapter":
        """Build from a config object or dict (``{"type": ..., ...}``). On the base class
        the ``type`` key picks the subclass."""
        if isinstance(config, Mapping):
            if cls is Adapter:
                return build_adapter(config)
            config = cls.config_class.from_dict(config)
        if cls is Adapter:
            return adapter_class(config.type)(config)
        return cls(config)  # type: ignore[call-arg]

    def _finish_init(self) -> None:
        self.head = ProjectionHead(self.feature_dim, self.config.embed_dim, self.config.head)
        self._apply_finetune()
        checkpointing = self.config.gradient_checkpointing
        if not isinstance(checkpointing, bool):
            raise ValueError(f"{self.config.type!r} adapter: gradient_checkpointing must be true or false, "
                             f"got {checkpointing!r}")
        if checkpointing:
            self.enable_gradient_checkpointing()

    @classmethod
    def supports_gradient_checkpointing(cls) -> bool:
        """Whether this adapter type implements :meth:`enable_gradient_checkpointing`."""
        return cls.enable_gradient_checkpointing is not Adapter.enable_gradient_checkpointing

    def enable_gradient_checkpointing(self) -> None:
        """Make the backbone recompute its activations in backward instead of keeping them
        (``gradient_checkpointing: true`` in the adapter's config calls it): the same gradients,
        about one block's input per block kept instead of every intermediate, and one more
        backbone forward per step. Adapters that support it override this; here it raises a
        ``ValueError`` naming the types that do."""
        supported = sorted(name for name in _ADAPTERS.names() if adapter_class(name).supports_gradient_checkpointing())
        raise ValueError(f"{self.config.type!r} adapter does not support gradient_checkpointing (adapter types "
                         f"that do: {', '.join(supported)}); remove the key or set it to false")

    def backbone_blocks(self) -> list[nn.Module]:
        """The backbone's repeated blocks, input to output (for ``last_n``)."""
        raise NotImplementedError(f"{type(self).__name__} does not support finetune.mode='last_n'")

    def backbone_tail(self) -> list[nn.Parameter]:
        """Backbone parameters after the last block (final norm, pooler); they train
        whenever ``last_n > 0``."""
        return []

    def _apply_finetune(self) -> None:
        ft = self.config.finetune
        if ft.mode not in ("full", "frozen", "last_n"):
            raise ValueError(f"finetune.mode must be 'full', 'frozen' or 'last_n', got {ft.mode!r}")
        if ft.lora is not None:
            self._inject_lora(ft.lora)
        for p in self.backbone.parameters():
            p.requires_grad_(ft.mode == "full")
        if ft.mode == "last_n":
            blocks = self.backbone_blocks()
            if not 0 <= ft.last_n <= len(blocks):
                raise ValueError(f"finetune.last_n must be in [0, {len(blocks)}] for this backbone, got {ft.last_n}")
            if ft.last_n > 0:
                for block in blocks[len(blocks) - ft.last_n :]:
                    block.requires_grad_(True)
                for p in self.backbone_tail():
                    p.requires_grad_(True)
        if ft.lora is not None:
            for name, p in self.backbone.named_parameters():
                if "lora_" in name:
                    p.requires_grad_(True)

    def _inject_lora(self, lora: LoRAConfig) -> None:
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError as e:  # optional extra
            raise ImportError("finetune.lora needs peft: pip install 'mmviews[lora]'") from e
        targets = lora.target_modules or self.default_lora_targets
        if not targets:
            raise ValueError(
                f"{type(self).__name__} has no default LoRA targets; set finetune.lora.target_modules"
            )
        cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(targets))
        self.backbone = inject_adapter_in_model(cfg, self.backbone)

    @property
    def backbone_frozen(self) -> bool:
        """True when no backbone parameter trains (its outputs may be cached)."""
        return not any(p.requires_grad for p in self.backbone.parameters())

    def train(self, mode: bool = True) -> "Adapter":
        super().train(mode)
        if self.backbone_frozen:
            # A frozen backbone keeps dropout off and BatchNorm statistics fixed.
            self.backbone.eval()
        return self

    # ---- forward ----------------------------------------------------------------

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        """Check the structure of the batch's input dict (keys, shapes, dtypes: no value is read)
        and turn it into backbone inputs. ``present`` [B] bool marks real items (absent ones are
        zero-filled slots); the built-in adapters use it in their value checks only
        (:meth:`input_check`)."""
        raise NotImplementedError

    def input_check(self) -> InputCheck:
        """The checks of this adapter's input values (see :class:`InputCheck`): finite floating
        inputs here; adapters with lengths, token ids or value ranges return their own."""
        return InputCheck(f"{self.config.type} adapter")

    def host_preprocessor(self) -> HostPreprocessor | None:
        """The part of :meth:`preprocess` that needs no weights and is worth doing before the
        step (tokenising text), as a picklable callable ``inputs -> inputs``: forward takes its
        output and gives bit for bit what it gives for the raw inputs. The trainer runs it where
        batches are collated (in the loader's workers when there are any), after the
        :meth:`input_check` of the raw inputs. None (the default): nothing to move."""
        return None

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        """Backbone + pooling: ``[B, F]`` or ``[B, T, F]``."""
        raise NotImplementedError

    def features(
        self, inputs: Mapping[str, Any], present: torch.Tensor | None = None, *, check_inputs: bool | None = None
    ) -> torch.Tensor:
        """Pooled backbone features ``[B, F]`` (or ``[B, T, F]`` per frame). The input values are
        checked (:meth:`input_check`) unless ``check_inputs`` (default: the attribute) is off."""
        prepared = self.preprocess(inputs, present)
        if self.check_inputs if check_inputs is None else check_inputs:
            self.input_check()(inputs, present)
        if self.backbone_frozen:
            with torch.no_grad():
                return self.encode(prepared)
        return self.encode(prepared)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Head + L2 normalisation: ``[B, F] -> [B, d]``. For ``[B, T, F]`` every frame is
        projected and normalised, averaged over T and normalised again. With the config's
        ``l2_normalize`` False, no normalisation: the head's output (the mean over T of the
        frames' outputs)."""
        unit = self.config.l2_normalize
        if features.dim() == 3:
            b, t, f = features.shape
            z = self._head(features.reshape(b * t, f))
            z = F.normalize(z, dim=-1) if unit else z
            z = z.reshape(b, t, z.shape[-1]).mean(1)  # b may be 0: no -1
            return F.normalize(z, dim=-1) if unit else z
        z = self._head(features)
        return F.normalize(z, dim=-1) if unit else z

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.head.training and not syncs_batch_norm(self.head):
            # BatchNorm has no batch statistics for one row (e.g. the only present view
            # of a modality in a batch): use its running statistics for this call. Dropout
            # stays on (a chunk of one row drops as the whole batch does). A SyncBatchNorm
            # across processes keeps training mode (syncs_batch_norm above): its statistics are
            # those of every process's rows, and in eval mode this process would skip its collective.
            norms = [m for m in self.head.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            for m in norms:
                m.eval()
            try:
                return self.head(x)
            finally:
                for m in norms:
                    m.train()
        return self.head(x)

    def forward(
        self, inputs: Mapping[str, Any], present: torch.Tensor | None = None, *, check_inputs: bool | None = None
    ) -> torch.Tensor:
        """``inputs`` (see :mod:`mmviews.data.batch`) -> unit vectors ``[B, embed_dim]``.

        ``present [B]`` bool (optional): absent items (zero-filled slots of missing views)
        are skipped by the backbone and the head (so they cannot shift BatchNorm
        statistics) and come back as zero vectors. Finding them reads ``present`` (a
        synchronisation for a device mask); :meth:`embed_present` takes them known on the host.
        ``check_inputs``: see :meth:`features`."""
        if present is None:
            return self.project(self.features(inputs, None, check_inputs=check_inputs))
        return self.embed_present(inputs, PresentItems.from_mask(present.bool()), check_inputs=check_inputs)

    def embed_present(
        self, inputs: Mapping[str, Any], items: PresentItems, *, check_inputs: bool | None = None
    ) -> torch.Tensor:
        """:meth:`forward` with the present items given as ``items`` (known on the host, e.g.
        ``ViewBatch.present_items``): ``[items.total, embed_dim]``, zero rows at absent items,
        which never reach the backbone or the head. Reads nothing from the device.

        With no present item the backbone and head are skipped, except the parts that take part in
        collectives (:func:`runs_collectives`: SyncBatchNorm on several processes): they run on
        zero rows (:meth:`join_collectives`), so that this process joins every collective the
        others issue, forward and backward (their output is part of the returned tensor's graph)."""
        like = next(self.head.parameters())
        if items.all:
            return self.project(self.features(inputs, None, check_inputs=check_inputs))
        out = plain_zeros_like(like, items.total, self.config.embed_dim)
        if items.none:
            if not runs_collectives(self):
                return out
            empty = torch.zeros(0, dtype=torch.long, device=like.device)
            return out.index_put((empty,), self.join_collectives(inputs, items.total).to(out.dtype))
        assert items.index is not None  # set whenever some but not all items are present
        rows = to_device(items.index, like.device)
        present_inputs = subset_inputs(inputs, rows, items.total, items.positions)
        z = self.project(self.features(present_inputs, None, check_inputs=check_inputs))
        return out.index_put((rows,), z.to(out.dtype))

    def join_collectives(self, inputs: Mapping[str, Any], batch_size: int) -> torch.Tensor:
        """A forward that yields zero rows, ``[0, embed_dim]``, through the parts of the adapter
        that take part in collectives, connected to the graph so that their backward runs too.

        - The backbone takes part (SyncBatchNorm, or sharded): a backbone with BatchNorm (the
          CNNs) runs on zero rows of ``inputs``, which its BatchNorm layers accept without
          touching their statistics; any other (transformers, which do not all accept an empty
          batch) runs on the first row of ``inputs`` (an absent item's zero-filled slot, which
          the collator always writes) and its features are cut to zero rows before the head:
          its gradients are zeros, but its parameters' gathers and gradient reductions run.
        - Else the head alone on zero features."""
        like = next(self.head.parameters())
        if not runs_collectives(self.backbone):
            return self.project(plain_zeros_like(like, 0, self.feature_dim))
        norms = [m for m in self.backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            rows, host_rows = torch.zeros(0, dtype=torch.long, device=like.device), ()
        else:
            rows, host_rows = torch.zeros(1, dtype=torch.long, device=like.device), (0,)
        # A plain BatchNorm joins no collective: in eval mode for this pass, so that zero rows do
        # not count as a batch (num_batches_tracked) on this process only.
        local_norms = [m for m in norms if m.training and not isinstance(m, nn.SyncBatchNorm)]
        for m in local_norms:
            m.eval()
        try:
            features = self.features(subset_inputs(inputs, rows, batch_size, host_rows), None, check_inputs=False)
        finally:
            for m in local_norms:
                m.train()
        # cut before the head: a SyncBatchNorm in the head must not count the placeholder row
        return self.project(features[:0])

    def preprocessing_signature(self) -> dict[str, Any]:
        """JSON-able description of everything besides the backbone weights that decides
        ``features()`` (config fields other than the head's); part of the cache key."""
        cfg = self.config.to_dict()
        for k in ("head", "embed_dim", "l2_normalize", "finetune", "gradient_checkpointing"):
            cfg.pop(k, None)
        return cfg

    # ---- optimisation -----------------------------------------------------------

    def param_groups(
        self, backbone_lr: float, head_lr: float, weight_decay: float = 0.0
    ) -> list[dict[str, Any]]:
        """Optimizer parameter groups: backbone and head at their own learning rates;
        biases and norm weights (1-D tensors) without weight decay. Frozen parameters
        are left out; empty groups are dropped."""
        backbone_ids = {id(p) for p in self.backbone.parameters()}
        buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
        for p in self.parameters():
            if not p.requires_grad:
                continue
            part = "backbone" if id(p) in backbone_ids else "head"
            buckets.setdefault((part, p.ndim >= 2), []).append(p)
        groups = []
        for (part, decay), params in sorted(buckets.items()):
            groups.append(
                {
                    "name": f"{part}{'' if decay else '_no_decay'}",
                    "params": params,
                    "lr": backbone_lr if part == "backbone" else head_lr,
                    "weight_decay": weight_decay if decay else 0.0,
                }
            )
        return groups

    # ---- persistence ------------------------------------------------------------

    def _save_extra(self, directory: Path) -> None:
        """Save what rebuilding the architecture needs besides config.json (HF configs,
        tokenizers, feature extractors)."""

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (whole adapter) to ``directory``."""
        from safetensors.torch import save_model

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._save_extra(d)
        atomic_save(d / WEIGHTS_NAME, lambda tmp: save_model(self, tmp))  # save_model handles tied tensors
        atomic_write_text(d / CONFIG_NAME, json.dumps(self.config.to_dict(), indent=2))
        return d

    @classmethod
    def _build_for_load(cls, config: AdapterConfig, directory: Path) -> "Adapter":
        """The architecture of a saved adapter, without fetching pretrained weights
        (subclasses with HF backbones read the configs saved by ``_save_extra``)."""
        return cls(config, load_weights=False, saved_dir=directory)  # type: ignore[call-arg]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> "Adapter":
        """Load an adapter saved by :meth:`save_pretrained`."""
        from safetensors import SafetensorError
        from safetensors.torch import load_model

        d = Path(directory)
        cfg_path, weights = d / CONFIG_NAME, d / WEIGHTS_NAME
        for p in (cfg_path, weights):
            if not p.is_file():
                raise FileNotFoundError(f"no saved adapter at {d}: missing {p.name}")
        data = read_json_object(cfg_path)
        kind = data.get("type")
        try:
            target = adapter_class(kind)
        except ValueError as err:
            raise ValueError(f"{cfg_path}: {err}") from None
        if cls is not Adapter and not issubclass(target, cls):
            raise ValueError(f"{cfg_path} holds a {kind!r} adapter, not a {cls.__name__}")
        try:  # a config that does not build (unknown or refused keys) is named with its file
            config = target.config_class.from_dict(data)
            adapter = target._build_for_load(config, d)
        except (ValueError, TypeError, KeyError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise ValueError(f"{cfg_path}: {message}") from None
        try:
            load_model(adapter, str(weights), strict=True)
        except RuntimeError as err:  # missing/unexpected keys or shapes
            raise ValueError(f"{weights}: does not fit the adapter of {cfg_path} ({str(err).splitlines()[0]})") from None
        except SafetensorError as err:  # a truncated or damaged file
            raise CorruptFileError(f"{weights}: not a readable safetensors file ({err}): truncated or corrupt") from None
        return adapter

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def extra_repr(self) -> str:
        return f"type={self.config.type!r}, embed_dim={self.config.embed_dim}, finetune={self.config.finetune.mode!r}"


def build_adapter(config: Mapping[str, Any] | AdapterConfig) -> Adapter:
    """Build an adapter from a dict such as ``{"type": "text", "embed_dim": 128, ...}``."""
    if isinstance(config, AdapterConfig):
        return adapter_class(config.type)(config)
    if not isinstance(config, Mapping) or "type" not in config:
        raise ValueError(
            f"adapter config must be a dict with a 'type' key (one of {_ADAPTERS.names()}), got {config!r}"
        )
    cls = adapter_class(config["type"])
    return cls(cls.config_class.from_dict(config))
