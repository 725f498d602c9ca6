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

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmviews.data.batch import PresentItems
from mmviews.data.safe_pickle import CorruptFileError
from mmviews.fileio import atomic_save, atomic_write_text, read_json_object
from mmviews.registry import Registry

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# config type name -> Adapter subclass, filled by @register_adapter where each adapter is
# defined; private: use register_adapter / adapter_class / build_adapter / list_adapters.
_ADAPTERS: Registry[type["Adapter"]] = Registry("adapter type")


# --------------------------------------------------------------------------- model sources

# Model names whose architecture and weights come from outside the recipe (open_clip's
# "hf-hub:ORG/NAME" and "local-dir:PATH"): refused unless the user allowed them for this
# process (``--allow-remote-models``), since a saved encoder's or a recipe's config must not
# be able to pull them in on its own.
EXTERNAL_MODEL_PREFIXES = ("hf-hub:", "local-dir:")
_external_models_allowed = False


@contextlib.contextmanager
def allow_remote_models(allowed: bool = True) -> Iterator[None]:
    """Within the block, adapters may build models named ``hf-hub:...`` / ``local-dir:...``
    (the command line's ``--allow-remote-models``)."""
    global _external_models_allowed
    previous, _external_models_allowed = _external_models_allowed, bool(allowed)
    try:
        yield
    finally:
        _external_models_allowed = previous


def check_model_source(name: str, key: str) -> None:
    """Raise ``ValueError`` naming ``key`` when ``name`` is an external model name and
    :func:`allow_remote_models` is not in effect."""
    if name.startswith(EXTERNAL_MODEL_PREFIXES) and not _external_models_allowed:
        raise ValueError(f"{key}={name!r} loads a model configuration and weights from outside the recipe; "
                         "refused unless asked for on the command line (--allow-remote-models)")


# --------------------------------------------------------------------------- configs


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


# --------------------------------------------------------------------------- head


class ProjectionHead(nn.Module):
    """Linear or MLP projection ``[N, in_dim] -> [N, out_dim]`` (not normalised)."""

    def __init__(self, in_dim: int, out_dim: int, config: HeadConfig) -> None:
        super().__init__()
        if config.kind == "linear":
            self.net: nn.Module = nn.Linear(in_dim, out_dim)
        elif config.kind == "mlp":
            if config.num_layers < 2:
                raise ValueError(f"head.num_layers must be >= 2 for an MLP head, got {config.num_layers}")
            hidden = config.hidden_dim or max(in_dim, out_dim)
            acts = {"relu": nn.ReLU, "gelu": nn.GELU}
            if config.activation not in acts:
                raise ValueError(f"head.activation must be one of {sorted(acts)}, got {config.activation!r}")
            layers: list[nn.Module] = []
            dim = in_dim
            for _ in range(config.num_layers - 1):
                # BatchNorm's shift makes the Linear bias redundant.
                layers.append(nn.Linear(dim, hidden, bias=not config.batch_norm))
                if config.batch_norm:
                    layers.append(nn.BatchNorm1d(hidden))
                layers.append(acts[config.activation]())
                if config.dropout > 0:
                    layers.append(nn.Dropout(config.dropout))
                dim = hidden
            layers.append(nn.Linear(dim, out_dim))
            self.net = nn.Sequential(*layers)
        else:
            raise ValueError(f"head.kind must be 'linear' or 'mlp', got {config.kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


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


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [B, L, D]`` over the positions where ``mask [B, L]`` is True.
    Rows with no True position give zeros (not NaN)."""
    m = mask.to(x.dtype).unsqueeze(-1)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


def lengths_to_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B]`` lengths -> ``[B, max_len]`` bool, True at valid positions."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def require_tensor(inputs: Mapping[str, Any], key: str, where: str) -> torch.Tensor:
    if key not in inputs:
        raise ValueError(f"{where}: input dict has no key {key!r} (keys: {sorted(inputs)})")
    x = inputs[key]
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: inputs[{key!r}] must be a torch.Tensor, got {type(x).__name__}")
    return x


def to_device(x: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` on ``device`` (and ``dtype``). A copy from host memory does not wait for the work
    queued on the device (``non_blocking``: the data is staged before the call returns); a copy
    to the host does, since its values are read next."""
    return x.to(device, dtype, non_blocking=x.device.type == "cpu")


def input_lengths(inputs: Mapping[str, Any], x: torch.Tensor, where: str) -> torch.Tensor:
    """The ``[B]`` real lengths of ``x`` ``[B, T, ...]`` (all T when ``inputs`` has none), long, on
    ``x``'s device. Only their shape is checked here (free); :func:`check_lengths` checks values."""
    lengths = inputs.get("lengths")
    if lengths is None:  # made on x's device: no copy from the host
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    lengths = torch.as_tensor(lengths)
    if lengths.shape != (x.shape[0],):
        raise ValueError(f"{where}: lengths must be [B] in [0, {x.shape[1]}], got {lengths.tolist()[:10]}")
    return to_device(lengths, x.device, torch.long)


def check_lengths(
    lengths: torch.Tensor, max_len: int, present: torch.Tensor | None, where: str, what: str = "sequence"
) -> None:
    """``lengths [B]`` within ``[0, max_len]``, and non-zero for every present item (``present
    [B]`` bool; absent views have length 0). Reads the values: run it on host tensors."""
    if bool((lengths < 0).any()) or bool((lengths > max_len).any()):
        raise ValueError(f"{where}: lengths must be [B] in [0, {max_len}], got {lengths.tolist()[:10]}")
    need = torch.ones_like(lengths, dtype=torch.bool) if present is None else present.to(lengths.device).bool()
    empty = (lengths == 0) & need
    if bool(empty.any()):
        idx = torch.nonzero(empty).flatten().tolist()
        raise ValueError(f"{where}: zero-length {what} at batch position(s) {idx[:10]} of present views")


def per_clip(features: torch.Tensor, frames: int | None) -> torch.Tensor:
    """Backbone output of a flattened clip batch ``[B * T, F]`` -> ``[B, T, F]`` (pooled over
    time by :meth:`Adapter.project`); single images (``frames`` None) stay ``[B, F]``."""
    return features if frames is None else features.reshape(-1, frames, features.shape[-1])


def check_finite(x: torch.Tensor, where: str, key: str = "values") -> None:
    """``ValueError`` naming ``where`` and ``inputs[key]`` when the floating tensor ``x`` holds
    NaN or inf. Reads the values: run it on host tensors."""
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{where}: {bad} non-finite value(s) (NaN/inf) in inputs[{key!r}] of shape {tuple(x.shape)}")


@dataclass(frozen=True)
class InputCheck:
    """The checks of an adapter's input *values*, called as ``check(inputs, present)``.

    An adapter's ``preprocess`` checks the structure of its inputs (keys, shapes, dtypes), which
    costs nothing; checking values (finite numbers, lengths, token ids, value ranges) reads them,
    which for inputs on an accelerator is a device synchronisation. So the value checks are this
    separate object, free of weights (picklable): :meth:`Adapter.features` runs it when
    ``check_inputs`` is on, and the trainer runs every adapter's on each batch while it is still in
    host memory (:meth:`~mmviews.modalities.MultiViewEncoder.input_check`, in the loader's
    workers when there are any). Inputs of the wrong structure are passed over: ``preprocess``
    reports them.

    This base class checks that every floating tensor of the inputs is finite; adapters add
    theirs in subclasses. ``present [B]`` bool (None: all) marks the items of present views
    (absent ones are zero-filled slots: length 0, empty text)."""

    where: str

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor):
                check_finite(value, self.where, key)


@dataclass(frozen=True)
class SequenceInputCheck(InputCheck):
    """Finite values, and ``lengths`` (when given) in ``[0, T]`` and non-zero for the present items
    of ``values [B, T, ...]``."""

    what: str = "sequence"

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        super().__call__(inputs, present)
        x, lengths = inputs.get("values"), inputs.get("lengths")
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or lengths is None:
            return  # no lengths: every item has all T > 0 steps (preprocess refuses T = 0)
        lengths = torch.as_tensor(lengths)
        if lengths.shape == (x.shape[0],):
            check_lengths(lengths, x.shape[1], present, self.where, self.what)


# An adapter's preprocessing that needs no weights (e.g. tokenising text), as a picklable
# callable ``inputs -> inputs`` whose output the adapter takes with the same result: see
# :meth:`Adapter.host_preprocessor`.
HostPreprocessor = Callable[[Mapping[str, Any]], dict[str, Any]]


def plain_zeros_like(parameter: torch.Tensor, *shape: int) -> torch.Tensor:
    """Zeros of ``shape`` with ``parameter``'s dtype and device, as a plain tensor: outside a
    forward, a sharded (FSDP2) parameter is a DTensor, and its ``new_zeros`` would be one too,
    which plain tensors cannot be mixed with."""
    return torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)


def _process_group_of_several() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def syncs_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` holds a :class:`torch.nn.SyncBatchNorm` in training mode whose process
    group has more than one process: its training forward shares batch statistics across them."""
    import torch.distributed as dist

    if not _process_group_of_several():
        return False
    return any(isinstance(m, nn.SyncBatchNorm) and m.training
               and dist.get_world_size(m.process_group or dist.group.WORLD) > 1 for m in module.modules())


def runs_collectives(module: nn.Module) -> bool:
    """Whether a forward of ``module`` (in its current modes) takes part in collectives on a
    process group of more than one process: it holds a SyncBatchNorm in training mode
    (:func:`syncs_batch_norm`), or a module sharded by FSDP2 (``distributed.sharding: fsdp``:
    every forward gathers its parameters, every backward reduce-scatters their gradients). Every
    process must then run that forward (and its backward) as often as the others, even with no
    rows of its own: a process that skips it leaves the others waiting in the collective (a hang
    under NCCL)."""
    if not _process_group_of_several():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or syncs_batch_norm(module)


def subset_inputs(
    inputs: Mapping[str, Any], rows: torch.Tensor, batch_size: int, host_rows: Sequence[int] | None = None
) -> dict[str, Any]:
    """The items ``rows`` (LongTensor) of an input dict: tensors and lists whose first dimension
    is ``batch_size`` are indexed, everything else (e.g. ``sample_rate``) is kept. ``host_rows``:
    the same positions as Python ints, for list inputs (else read from ``rows``)."""
    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch_size:
            out[k] = v[to_device(rows, v.device)]
        elif isinstance(v, (list, tuple)) and len(v) == batch_size:
            if host_rows is None:
                host_rows = rows.tolist()
            out[k] = [v[i] for i in host_rows]
        else:
            out[k] = v
    return out


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
        projected and normalised, averaged over T and normalised again."""
        if features.dim() == 3:
            b, t, f = features.shape
            z = F.normalize(self._head(features.reshape(b * t, f)), dim=-1)
            return F.normalize(z.reshape(b, t, z.shape[-1]).mean(1), dim=-1)  # b may be 0: no -1
        return F.normalize(self._head(features), dim=-1)

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
        for k in ("head", "embed_dim", "finetune", "gradient_checkpointing"):
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


def check_local_or_hub(name: str, what: str) -> None:
    """Raise FileNotFoundError when ``name`` looks like a filesystem path that does not
    exist (absolute, ``./``, ``../``, ``~``, or more than one ``/``, which no hub id has).
    Other strings are hub ids (``org/name``)."""
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(f"{what}: local path {name!r} does not exist")


def transformers_backbone(config: Any, *, load_weights: bool, saved_dir: Path | None, what: str,
                          default_type: str) -> nn.Module:
    """The ``transformers.AutoModel`` of an adapter config with ``model`` (hub name or local
    checkpoint folder; ``pretrained=False`` or ``load_weights=False``: its architecture only) or
    ``backbone_config`` (``{"model_type": ..., **config keywords}``, random weights); from a saved
    adapter folder (``saved_dir``), the architecture saved in its ``backbone/`` sub-folder. ``what``
    names the model in errors (``"audio"``: "audio model ..."); ``default_type`` is the model type
    of a ``backbone_config`` without one."""
    from huggingface_hub.errors import HFValidationError
    from transformers import AutoConfig, AutoModel

    if saved_dir is not None:
        return AutoModel.from_config(AutoConfig.from_pretrained(saved_dir / "backbone"))
    if config.model:
        check_local_or_hub(config.model, f"{what} model")
        try:
            if config.pretrained and load_weights:
                return AutoModel.from_pretrained(config.model)
            return AutoModel.from_config(AutoConfig.from_pretrained(config.model))
        except (OSError, HFValidationError) as e:
            raise FileNotFoundError(
                f"{what} model {config.model!r}: neither a local checkpoint directory nor a reachable hub model ({e})"
            ) from e
    if config.backbone_config is not None:
        keywords = dict(config.backbone_config)
        model_type = keywords.pop("model_type", default_type)
        return AutoModel.from_config(AutoConfig.for_model(model_type, **keywords))
    raise ValueError(f"{config.type} adapter needs 'model' (hub name or local dir) or 'backbone_config'")
