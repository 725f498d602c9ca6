"""``MultiViewEncoder``: a set of adapters (one per modality) applied to a ``ViewBatch``.

View order: ``z[:, i]`` is the embedding of ``batch.views[i]``, the batch's global view
order. All views of one modality are encoded by one backbone call on the modality's
stacked inputs (sample-major: item ``k * V_m + v``), reshaped to ``[K, V_m, d]`` and
scattered to the positions of that modality's views (by slot). Absent views
(``batch.mask`` False) come out as zero vectors; objectives ignore them via the mask.

Nothing here reads the device for a batch moved by ``ViewBatch.to`` (as the trainer's are):
which views are present comes from what the batch recorded in host memory
(``ViewBatch.present_items``), and the adapters' checks of input values are skipped for a
batch that :meth:`MultiViewEncoder.host_preparation` (or ``input_check``) already checked on
the host (``ViewBatch.inputs_checked``). The trainer's batches also come with their text
tokenised there (token ids, which the text adapter takes as it takes raw text).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from mmviews.data.batch import ViewBatch
from mmviews.fileio import atomic_write_text, is_folder_name, read_json_object
from mmviews.hub import is_repo_id, snapshot_folder, upload_folder

from .base import Adapter, build_adapter
from .collectives import plain_zeros_like
from .config import AdapterConfig
from .inputs import HostPreprocessor, InputCheck
from .cache import FeatureCache
from .dropout import dropout_rows, row_keys_for
from .device_flow import holds_frames

ENCODER_CONFIG = "encoder.json"


@dataclass(frozen=True)
class HostBatchPreparation:
    """What the trainer runs on each :class:`ViewBatch` where it is collated, in host memory:
    per modality, the adapter's check of input values (:meth:`Adapter.input_check`; reading
    values there costs no device synchronisation), then its host preprocessor, if any
    (:meth:`Adapter.host_preprocessor`: tokenising text, so that the step does not). It raises
    ``ValueError`` naming the modality, or returns the batch with the preprocessed inputs, marked
    ``inputs_checked`` (the encoder then skips the adapters' own checks). Holds no weights: it
    can be sent to DataLoader workers."""

    checks: dict[str, InputCheck]
    preprocessors: dict[str, HostPreprocessor] = field(default_factory=dict)

    def __call__(self, batch: ViewBatch) -> ViewBatch:
        for modality in dict.fromkeys(v.modality for v in batch.views):
            if modality not in batch.inputs:
                continue  # the encoder's forward names what is missing
            if holds_frames(batch.inputs[modality]):
                continue  # frames for flow on the device: their flow is RAFT's, made in the step
            check, preprocess = self.checks.get(modality), self.preprocessors.get(modality)
            try:
                if check is not None:
                    check(batch.inputs[modality], batch.modality_mask(modality))
                if preprocess is not None:
                    batch.inputs[modality] = preprocess(batch.inputs[modality])
            except ValueError as error:
                raise ValueError(f"modality {modality!r}: {error}") from None
        batch.inputs_checked = True
        return batch


def _objective_info(value: Any, path: Path) -> dict[str, Any] | None:
    """encoder.json's ``objective`` entry (the objective's name and learned values), checked:
    None, or a mapping with a string ``name`` and finite numbers for every other key."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError(f"{path}: 'objective' must be an object with a string 'name', got {value!r}")
    for key, number in value.items():
        if key != "name" and (isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)):
            raise ValueError(f"{path}: 'objective.{key}' must be a finite number, got {number!r}")
    return dict(value)


class MultiViewEncoder(nn.Module):
    def __init__(self, adapters: Mapping[str, Adapter]) -> None:
        super().__init__()
        if not adapters:
            raise ValueError("MultiViewEncoder needs at least one adapter")
        dims = {name: a.config.embed_dim for name, a in adapters.items()}
        if len(set(dims.values())) != 1:
            raise ValueError(f"all adapters must share embed_dim; got {dims}")
        self.adapters = nn.ModuleDict(dict(adapters))
        self.embed_dim = next(iter(dims.values()))
        self.caches: dict[str, FeatureCache] = {}
        # Device index tensors that put the modalities' embeddings in view order, by (order, device).
        self._view_orders: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        # Flow computed on the device from the frames a batch carries (data.options.flow: raft;
        # mmviews.modalities.device_flow): a frozen RAFTFlow, not a submodule (no parameters, not saved).
        self.device_flow: Any = None
        # The training objective's learned values (``{"name": "siglip", "temperature": ..., "bias": ...}``),
        # written into encoder.json by save_pretrained and read back by from_pretrained; None: none learned.
        self.objective_info: dict[str, Any] | None = None

    # ---- construction / persistence --------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "MultiViewEncoder":
        """``{"embed_dim": 128, "modalities": {"text": {"type": "text", ...}, ...}}``, or
        directly ``{"text": {...}, "vision": {...}}``. A top-level ``embed_dim`` fills the
        adapters given as mappings that do not set their own; an adapter may also be given as
        its :class:`AdapterConfig`, built as it is."""
        config = dict(config)
        embed_dim = config.pop("embed_dim", None)
        modalities = config.pop("modalities", None)
        if modalities is None:
            modalities = config
        elif config:
            raise ValueError(f"unknown encoder config key(s) {sorted(config)}; allowed: embed_dim, modalities")
        if not isinstance(modalities, Mapping) or not modalities:
            raise ValueError("encoder config needs a non-empty mapping modality -> adapter config")
        adapters = {}
        for name, cfg in modalities.items():
            if isinstance(cfg, AdapterConfig):  # resolved already (a loaded recipe's adapter_configs)
                adapters[name] = build_adapter(cfg)
                continue
            if not isinstance(cfg, Mapping):
                raise ValueError(f"encoder config for modality {name!r} must be a dict, got {cfg!r}")
            cfg = dict(cfg)
            if embed_dim is not None:
                cfg.setdefault("embed_dim", embed_dim)
            adapters[name] = build_adapter(cfg)
        return cls(adapters)

    def config_dict(self) -> dict[str, Any]:
        return {
            "embed_dim": self.embed_dim,
            "modalities": {name: a.config.to_dict() for name, a in self.adapters.items()},
        }

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """``encoder.json`` plus one ``save_pretrained`` sub-directory per modality."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name, adapter in self.adapters.items():
            adapter.save_pretrained(d / name)
        data: dict[str, Any] = {"modalities": list(self.adapters)}
        if self.objective_info is not None:
            data["objective"] = self.objective_info
        atomic_write_text(d / ENCODER_CONFIG, json.dumps(data, indent=2))
        return d

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike[str], *, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None) -> "MultiViewEncoder":
        """Load an encoder saved by :meth:`save_pretrained` (or ``mmviews export --format hf``)
        from a local folder or a Hugging Face Hub repository id (``owner/name``, at ``revision``),
        fetched through ``huggingface_hub``'s cache (``cache_dir``, else ``HF_HUB_CACHE``;
        ``HF_HUB_OFFLINE=1`` loads from the cache alone; see :mod:`mmviews.hub`: only configs,
        safetensors weights and tokenizer files are fetched, and no code runs). A missing or
        malformed ``encoder.json`` is reported with its full path."""
        d = Path(name_or_path)
        if not d.exists() and is_repo_id(str(name_or_path)):
            d = snapshot_folder(str(name_or_path), revision, cache_dir)
        path = d / ENCODER_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"no saved MultiViewEncoder at {d}: missing {path}")
        data = read_json_object(path, hint=" (expected an object with key 'modalities')")
        if "modalities" not in data:
            raise ValueError(f"{path}: missing key 'modalities' (the list of saved modality names); has {sorted(data)}")
        names = data["modalities"]
        # each name is a sub-folder: one path component, so that loading never leaves the folder
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and is_folder_name(n) for n in names):
            raise ValueError(f"{path}: 'modalities' must be a non-empty list of modality names, each a single "
                             f"sub-folder name (no '/', '\\' or '..'), got {names!r}")
        encoder = cls({name: Adapter.from_pretrained(d / name) for name in names})
        encoder.objective_info = _objective_info(data.get("objective"), path)
        return encoder

    def push_to_hub(self, repo_id: str, *, model_card: str | None = None, commit_message: str = "Upload mmviews encoder",
                    private: bool | None = None, token: str | None = None, revision: str | None = None) -> Any:
        """Upload this encoder to the Hub repository ``repo_id`` (created if needed) as one commit:
        the folder :meth:`save_pretrained` writes, with ``model_card`` as its ``README.md`` when
        given (``mmviews export RUN --format hf`` writes the card of a run). The upload is
        ``huggingface_hub``'s (``HfApi.upload_folder``); returns its commit information."""
        import tempfile

        from mmviews.hub import MODEL_CARD_FILE

        with tempfile.TemporaryDirectory(prefix="mmviews-push-") as tmp:
            self.save_pretrained(tmp)
            if model_card is not None:
                atomic_write_text(Path(tmp) / MODEL_CARD_FILE, model_card)
            return upload_folder(tmp, repo_id, commit_message=commit_message, private=private, token=token,
                                 revision=revision)

    # ---- feature cache ----------------------------------------------------------

    def enable_cache(
        self, directory: str | os.PathLike[str], split: str = "train", modalities: list[str] | None = None
    ) -> dict[str, FeatureCache]:
        """Cache the features of frozen backbones for ``split`` (one cache per modality,
        loaded from ``directory`` when a file with the same key exists). Only natural,
        non-augmented views of batches with ``index`` are cached. Call
        :meth:`save_cache` to persist."""
        names = modalities or [n for n, a in self.adapters.items() if a.backbone_frozen]
        self.caches = {}
        for name in names:
            adapter = self.adapters[name]
            if not adapter.backbone_frozen:
                raise ValueError(f"feature cache for {name!r}: its backbone is not frozen (finetune.mode)")
            self.caches[name] = FeatureCache(directory, adapter, split=split, name=name)
        return self.caches

    def disable_cache(self) -> None:
        self.caches = {}

    def fill_cache(self, batches: Iterable[ViewBatch], progress: bool = True) -> dict[str, int]:
        """Run once over a split (e.g. its loader, unshuffled) so that every natural view's
        features are cached, then save the files. Returns the cached rows per modality.
        Cache ids are ``batch.index * V_m + slot``: ``index`` must be the dataset indices."""
        from tqdm.auto import tqdm

        if not self.caches:
            raise ValueError("fill_cache: call enable_cache(directory, split) first")
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                for batch in tqdm(batches, desc="caching backbone features", disable=not progress):
                    if batch.index is None:
                        raise ValueError("fill_cache: batches need 'index' (dataset indices) to key the cache")
                    self(batch)
        finally:
            self.train(was_training)
        self.save_cache()
        return {name: len(cache) for name, cache in self.caches.items()}

    def save_cache(self) -> list[Path]:
        return [p for c in self.caches.values() if (p := c.save()) is not None]

    # ---- forward ----------------------------------------------------------------

    def input_check(self) -> HostBatchPreparation:
        """The adapters' checks of input values alone, to run on batches in host memory (see
        :class:`HostBatchPreparation`); raw text stays raw."""
        return HostBatchPreparation({name: adapter.input_check() for name, adapter in self.adapters.items()})

    def host_preparation(self) -> HostBatchPreparation:
        """The adapters' checks of input values and their host preprocessing (tokenising text),
        to run where batches are collated (see :class:`HostBatchPreparation`); the trainer's."""
        preprocessors = {name: p for name, adapter in self.adapters.items()
                         if (p := adapter.host_preprocessor()) is not None}
        return HostBatchPreparation(self.input_check().checks, preprocessors)

    def encode_modality(
        self, name: str, inputs: Mapping[str, Any], present: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Embed one modality's inputs: ``[B, embed_dim]`` unit vectors (evaluation)."""
        if name not in self.adapters:
            raise KeyError(f"no adapter for modality {name!r}; have {sorted(self.adapters)}")
        return self.adapters[name](inputs, present)

    def flow_from_frames(self, batch: ViewBatch) -> ViewBatch:
        """``batch`` with the flow of every modality that carries frames for flow on the device
        (``data.options.flow: raft``) computed by :attr:`device_flow`; the same batch when none does."""
        if not any(holds_frames(inputs) for inputs in batch.inputs.values()):
            return batch
        if self.device_flow is None:
            names = sorted(m for m, inputs in batch.inputs.items() if holds_frames(inputs))
            raise ValueError(f"modalities {names} carry frames for flow computed on the device (data.options.flow: "
                             "raft) but the encoder has no device_flow: set encoder.device_flow = "
                             "mmviews.modalities.device_flow.device_flow_for(data options)")
        return self.device_flow.convert(batch)

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` -> ``z [K, M, d]`` (unit rows; zero rows where absent), ``mask [K, M]``."""
        batch = self.flow_from_frames(batch)
        k, m = batch.num_samples, batch.num_views
        if tuple(batch.mask.shape) != (k, m) or m == 0:
            raise ValueError(f"batch.mask has shape {tuple(batch.mask.shape)}, expected [K, M] with M={m} views")
        mask = batch.mask.bool()
        # A batch checked on the host (HostBatchPreparation) is not checked again on the device.
        check_inputs = False if batch.inputs_checked else None
        order: list[int] = []  # view position of each column of the concatenated embeddings
        pieces: list[torch.Tensor] = []
        for modality in dict.fromkeys(v.modality for v in batch.views):
            if modality not in self.adapters:
                raise KeyError(f"batch has views of modality {modality!r} but the encoder has no adapter for it "
                               f"(adapters: {sorted(self.adapters)})")
            if modality not in batch.inputs:
                raise KeyError(f"batch.inputs has no entry for modality {modality!r}")
            positions = batch.views_of(modality)
            nv = len(positions)
            try:
                # Sample-keyed dropout (when a dropout_step is in effect): the keys of the rows encoded.
                with dropout_rows(row_keys_for(batch, modality)):
                    zm = self._encode_stacked(batch, modality, positions, check_inputs)
            except ValueError as error:  # an adapter's input check: say which modality
                raise ValueError(f"modality {modality!r}: {error}") from error
            if zm.shape[0] != k * nv:
                raise ValueError(f"modality {modality!r}: {zm.shape[0]} embeddings for K={k} samples x {nv} views; "
                                 "inputs must be stacked sample-major")
            order += positions
            pieces.append(zm.reshape(k, nv, -1))
        stacked = torch.cat([zm.to(pieces[0].dtype) for zm in pieces], dim=1)
        if order == list(range(m)):
            z = stacked
        else:  # views of different modalities interleaved, or listed out of slot order
            z = stacked.new_zeros(k, m, self.embed_dim)
            z[:, self._view_order(order, z.device)] = stacked
        z = z * mask.unsqueeze(-1).to(z.dtype)
        return z, mask

    def _view_order(self, order: list[int], device: torch.device) -> torch.Tensor:
        """``order`` as a LongTensor on ``device``, made once: indexing a device tensor with a
        host list would copy it to the device and wait for the copy at every step."""
        key = (tuple(order), device)
        if key not in self._view_orders:
            self._view_orders[key] = torch.tensor(order, dtype=torch.long, device=device)
        return self._view_orders[key]

    def _encode_stacked(
        self, batch: ViewBatch, modality: str, positions: list[int], check_inputs: bool | None
    ) -> torch.Tensor:
        adapter = self.adapters[modality]
        inputs = batch.inputs[modality]
        items = batch.present_items(modality)  # known on the host: free for a moved batch
        cache = self.caches.get(modality)
        if items.none or cache is None or batch.index is None or not adapter.backbone_frozen:
            # With no present view, zeros; or, where the adapter takes part in collectives
            # (SyncBatchNorm on several processes), a forward on zero rows that joins them.
            return adapter.embed_present(inputs, items, check_inputs=check_inputs)
        # The feature cache lives in host memory: its ids are read there.
        nv = len(positions)
        slots = torch.arange(nv)
        ids = batch.index.to("cpu").long().unsqueeze(1) * nv + slots  # [K, V]
        cacheable = torch.tensor(
            [batch.views[p].natural and batch.views[p].augmentation is None for p in positions], dtype=torch.bool
        )
        ids = torch.where(cacheable.unsqueeze(0), ids, torch.full_like(ids, -1)).reshape(-1)
        present = torch.zeros(items.total, dtype=torch.bool)
        present[list(items.positions)] = True
        ids = torch.where(present, ids, torch.full_like(ids, -1))  # absent slots are never stored
        feats = cache.features(
            ids,
            inputs,
            lambda sub, rows: adapter.features(sub, present if rows is None else present[rows],
                                               check_inputs=check_inputs),
            ids.numel(),
            needed=present,
        )
        param = next(adapter.head.parameters())
        # Only present rows reach the head (absent ones would shift its BatchNorm statistics).
        rows = torch.tensor(items.positions, dtype=torch.long)
        z = adapter.project(feats[rows.to(feats.device)].to(param.device, param.dtype))
        out = plain_zeros_like(param, items.total, adapter.config.embed_dim)
        return out.index_put((rows.to(out.device),), z.to(out.dtype))

    def param_groups(self, backbone_lr: float, head_lr: float, weight_decay: float = 0.0) -> list[dict[str, Any]]:
        """Every adapter's groups (see :meth:`Adapter.param_groups`), names prefixed by modality."""
        groups = []
        for name, adapter in self.adapters.items():
            for g in adapter.param_groups(backbone_lr, head_lr, weight_decay):
                g["name"] = f"{name}.{g['name']}"
                groups.append(g)
        return groups
