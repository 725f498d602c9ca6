"""View specifications, the view-set collator and the batch-size policy.

A dataset item is a *sample dict* (every source in :mod:`mmviews.data` yields this form)::

    {
        "index": int,                               # position in the dataset
        "modalities": {name: value_or_None, ...},   # None = this sample lacks the modality
        "labels": {"class": int, "sentiment": float, ...},
        "id": str,                                  # optional
    }

Modality values by kind (see :data:`KINDS`):

- ``"text"``: ``str`` (raw sentence)
- ``"tokens"``: ``{"input_ids": LongTensor[L], "attention_mask": LongTensor[L]}``
- ``"waveform"``: ``FloatTensor[T]`` mono audio at the dataset's sample rate
- ``"sequence"``: ``FloatTensor[L, D]`` (feature sequence, only the valid rows)
- ``"image"``: ``FloatTensor[3, H, W]`` in [0, 1]
- ``"video"``: ``FloatTensor[T, 3, H, W]`` in [0, 1]
- ``"flow"``: ``FloatTensor[T, 2, H, W]`` in pixels (u, v)
- ``"flow_frames"``: ``FloatTensor[T, 3, H, W]`` in [0, 1]: the frames of a flow view whose flow
  is computed on the device in the step (``data.options.flow: raft``,
  :mod:`mmviews.modalities.device_flow`); stacked as ``{"frames": [B, T, 3, H, W]}``

The :class:`ViewSetCollator` turns a list of sample dicts into a :class:`ViewBatch`
(see :mod:`mmviews.data.batch` for the layout of its inputs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Sampler

from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.schema import ConfigError, build_section, where

KINDS = ("text", "tokens", "waveform", "sequence", "image", "video", "flow", "flow_frames")

# Kind of each modality name used by the built-in sources; a dataset may override it
# with a ``modality_info()`` method (see ViewSetCollator).
DEFAULT_KINDS: dict[str, str] = {
    "text": "text",
    "text_ids": "tokens",
    "audio": "waveform",
    "image": "image",
    "video": "video",
    "flow": "flow",
}


@dataclass(frozen=True)
class ViewConfig:
    """One entry of a view specification before expansion into named views."""

    modality: str
    copies: int = 1
    augment: str | None = None
    natural: bool | None = None  # default: natural when no augmentation is applied
    name: str | None = None  # base name; views are named f"{name}_{i}"
    params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the augmentation


class ViewSpec:
    """The ordered, named M views of a sample.

    Build it from a list of dicts (the YAML form used by recipes)::

        ViewSpec.from_config([
            {"modality": "text", "copies": 2, "augment": "text_default"},
            {"modality": "audio", "copies": 2, "augment": "audio_default"},
            {"modality": "image", "copies": 2, "augment": "simclr", "params": {"strength": 0.5}},
            {"modality": "flow"},            # one natural view, no augmentation
        ])

    A view without ``augment`` is the modality's natural view. Each view's name is unique:
    ``{name or modality}_{i}`` with ``i`` counting that entry's copies (``_aug`` is inserted for
    augmented copies when the same modality also has a natural view, to keep names unique;
    otherwise augmented copies are ``image_0, image_1, ...``, the names the evaluation's
    natural views have, so that training logs and evaluation reports name the same views).
    ``slot`` counts views of the same modality in order of appearance, as in ViewInfo.
    """

    def __init__(self, views: Sequence[ViewInfo], params: Sequence[Mapping[str, Any]] | None = None):
        names = [v.name for v in views]
        if len(set(names)) != len(names):
            raise ValueError(f"view names must be unique, got {names}")
        if not views:
            raise ValueError("a ViewSpec needs at least one view")
        self.views: list[ViewInfo] = list(views)
        self.params: list[dict[str, Any]] = [dict(p) for p in (params or [{} for _ in views])]
        if len(self.params) != len(self.views):
            raise ValueError("params must have one entry per view")

    @classmethod
    def from_config(cls, config: Sequence[Mapping[str, Any] | str], source: str = "views",
                    key: str = "views") -> "ViewSpec":
        """Expand ``[{"modality", "copies", "augment", "natural", "name", "params"}, ...]``.

        A bare string ``"audio"`` means ``{"modality": "audio"}``. Each entry is checked by the
        recipe's validator (:func:`mmviews.schema.build_section`): a wrong one is a
        :class:`~mmviews.schema.ConfigError` naming ``source`` and the entry's key path under ``key``
        (``views.1.copies``). A recipe's views are resolved once, when it loads
        (:attr:`mmviews.config.TrainConfig.view_spec`).
        """
        entries: list[ViewConfig] = []
        for i, raw in enumerate(config):
            item = {"modality": raw} if isinstance(raw, str) else raw
            if not isinstance(item, Mapping):
                raise ConfigError(f"{where(source, f'{key}.{i}')}: expected a modality name or a mapping, "
                                  f"got {raw!r}")
            if "modality" not in item:
                raise ConfigError(f"{where(source, f'{key}.{i}')}: missing 'modality'")
            entry = build_section(ViewConfig, item, f"{key}.{i}", source)
            if entry.copies < 1:
                raise ConfigError(f"{where(source, f'{key}.{i}.copies')}: must be >= 1, got {entry.copies}")
            entries.append(dataclasses.replace(entry, params=dict(entry.params or {})))
        views: list[ViewInfo] = []
        params: list[dict[str, Any]] = []
        slot_count: dict[str, int] = {}
        used: set[str] = set()
        # "_aug" only where a natural view of the modality takes the plain name: otherwise the
        # augmented copies are named as the evaluation names that modality's view (image_0)
        with_natural = {e.modality for e in entries if (e.natural if e.natural is not None else e.augment is None)}
        for e in entries:
            natural = e.natural if e.natural is not None else e.augment is None
            plain = natural or e.modality not in with_natural
            base = e.name or (e.modality if plain else f"{e.modality}_aug")
            for _ in range(e.copies):
                k = 0
                while f"{base}_{k}" in used:
                    k += 1
                name = f"{base}_{k}"
                used.add(name)
                slot = slot_count.get(e.modality, 0)
                slot_count[e.modality] = slot + 1
                views.append(ViewInfo(name=name, modality=e.modality, slot=slot, natural=natural, augmentation=e.augment))
                params.append(e.params)
        return cls(views, params)

    @property
    def modalities(self) -> list[str]:
        """Modalities in order of first appearance."""
        out: list[str] = []
        for v in self.views:
            if v.modality not in out:
                out.append(v.modality)
        return out

    def views_per_modality(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for v in self.views:
            counts[v.modality] = counts.get(v.modality, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.views)

    def __repr__(self) -> str:
        return f"ViewSpec({[v.name for v in self.views]})"


def _seed_for(base_seed: int, epoch: int, index: int, view: str) -> int:
    # A stable hash (not Python's salted hash) so that seeds agree across worker processes.
    digest = hashlib.blake2b(f"{base_seed}/{epoch}/{index}/{view}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def infer_kind(value: Any) -> str:
    """Kind of one modality value (see the module docstring)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, Mapping) and "input_ids" in value:
        return "tokens"
    if isinstance(value, torch.Tensor):
        if value.ndim == 1:
            return "waveform"
        if value.ndim == 2:
            return "sequence"
        if value.ndim == 3:
            return "image"
        if value.ndim == 4:
            return "flow" if value.shape[1] == 2 else "video"
    raise ValueError(f"cannot infer the modality kind of a value of type {type(value).__name__}"
                     + (f" with shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""))


class ViewSetCollator:
    """Collate sample dicts into a :class:`~mmviews.data.batch.ViewBatch`.

    Args:
        view_spec: the M views (a :class:`ViewSpec` or its config list).
        augmentations: optional ``{augmentation name: callable}`` overriding the registry of
            :mod:`mmviews.data.augment`; each callable is ``aug(value, generator) -> value``.
            Names not found here are built with ``get_augmentation(name, **view params)``.
        modality_info: optional ``{modality: {"kind": str, "shape": tuple, "sample_rate": int}}``
            (``dataset.modality_info()`` of the built-in sources). ``shape`` is the per-sample
            shape used to zero-fill a modality that is absent from every sample of a batch.
        seed: base seed; the augmentation of view v of dataset item i in epoch e is seeded by
            a hash of (seed, e, i, view name): results do not depend on worker count or order.
        sample_rate: audio sample rate reported in waveform inputs (default 16000).

    Output layout (per modality m with V_m views, sample-major): item ``k * V_m + v`` of
    every stacked input is view v of sample k. ``mask[k, j]`` is False when sample k lacks
    the modality of view j; its slot is zero-filled (length 0, empty string for raw text).
    Labels: every label key present in all samples, as ``[K]`` tensors (float for
    ``sentiment*``, long for ``class``). ``index``: ``[K]`` dataset indices.
    """

    def __init__(
        self,
        view_spec: ViewSpec | Sequence[Mapping[str, Any] | str],
        augmentations: Mapping[str, Callable[..., Any]] | None = None,
        *,
        modality_info: Mapping[str, Mapping[str, Any]] | None = None,
        seed: int = 0,
        sample_rate: int = 16000,
    ) -> None:
        from mmviews.data.augment import get_augmentation

        self.view_spec = view_spec if isinstance(view_spec, ViewSpec) else ViewSpec.from_config(view_spec)
        self.modality_info = {k: dict(v) for k, v in (modality_info or {}).items()}
        self.seed = int(seed)
        self.epoch = 0
        self.sample_rate = int(sample_rate)
        given = dict(augmentations or {})
        self._augs: list[Callable[..., Any] | None] = []
        # Views that share a seed_group draw the same random numbers (e.g. one crop for the
        # video view and the flow view of a clip); otherwise each view has its own stream.
        self._seed_keys: list[str] = []
        for view, params in zip(self.view_spec.views, self.view_spec.params):
            params = dict(params)
            self._seed_keys.append(str(params.pop("seed_group", view.name)))
            if view.augmentation is None:
                self._augs.append(None)
            elif view.augmentation in given and not params:
                self._augs.append(given[view.augmentation])
            else:
                self._augs.append(get_augmentation(view.augmentation, **params))

    @classmethod
    def for_dataset(cls, dataset: Any, view_spec: ViewSpec | Sequence[Any], **kwargs: Any) -> "ViewSetCollator":
        """A collator that takes kinds, shapes and sample rate from ``dataset.modality_info()``."""
        info = dataset.modality_info() if hasattr(dataset, "modality_info") else {}
        rates = {v.get("sample_rate") for v in info.values() if v.get("sample_rate")}
        if len(rates) == 1 and "sample_rate" not in kwargs:
            kwargs["sample_rate"] = rates.pop()
        return cls(view_spec, modality_info=info, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Change the augmentation seeds (call once per epoch; DataLoader workers copy the
        collator when they start, so use persistent_workers=False or recreate the loader)."""
        self.epoch = int(epoch)

    def _kind(self, modality: str, values: Sequence[Any]) -> str:
        if modality in self.modality_info and "kind" in self.modality_info[modality]:
            return str(self.modality_info[modality]["kind"])
        for v in values:
            if v is not None:
                return infer_kind(v)
        if modality in DEFAULT_KINDS:
            return DEFAULT_KINDS[modality]
        raise ValueError(f"modality {modality!r} is absent from every sample of the batch and its kind is unknown; "
                         "pass modality_info={'%s': {'kind': ..., 'shape': ...}}" % modality)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> ViewBatch:
        # Per-sample augmentations work on tiny tensors, where intra-op threads cost far more
        # than they save (measured: a 9.6k-sample resample takes 50 ms with 2 threads, 0.1 ms
        # with 1). DataLoader workers already run single-threaded; do the same in-process.
        threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)
        try:
            return self._collate(samples)
        finally:
            if threads != 1:
                torch.set_num_threads(threads)

    def _collate(self, samples: Sequence[Mapping[str, Any]]) -> ViewBatch:
        if len(samples) == 0:
            raise ValueError("cannot collate an empty list of samples")
        samples, dropped = readable_samples(samples)
        spec = self.view_spec
        K = len(samples)
        M = len(spec.views)
        if K == 0:  # every sample unreadable: an empty batch that still says which were dropped
            return ViewBatch(inputs={}, views=list(spec.views), mask=torch.zeros(0, M, dtype=torch.bool),
                             index=torch.zeros(0, dtype=torch.long), dropped=dropped)
        indices = [int(s.get("index", i)) for i, s in enumerate(samples)]
        mask = torch.zeros(K, M, dtype=torch.bool)
        for m_pos, view in enumerate(spec.views):
            for k, s in enumerate(samples):
                mods = s["modalities"]
                if view.modality not in mods:
                    raise KeyError(f"sample {indices[k]} has no modality {view.modality!r} "
                                   f"(it has {sorted(mods)}); check the view spec")
                mask[k, m_pos] = mods[view.modality] is not None

        inputs: dict[str, dict[str, Any]] = {}
        for modality in spec.modalities:
            positions = [j for j, v in enumerate(spec.views) if v.modality == modality]
            positions.sort(key=lambda j: spec.views[j].slot)
            raw = [s["modalities"][modality] for s in samples]
            kind = self._kind(modality, raw)
            # Sample-major: item k * V_m + v is view v of sample k.
            items: list[Any] = []
            for k, value in enumerate(raw):
                for j in positions:
                    aug = self._augs[j]
                    if value is None or aug is None:
                        items.append(value)
                    else:
                        g = torch.Generator().manual_seed(_seed_for(self.seed, self.epoch, indices[k], self._seed_keys[j]))
                        items.append(aug(value, g))
            inputs[modality] = self._stack(modality, kind, items)

        labels: dict[str, torch.Tensor] = {}
        keys = set.intersection(*(set(s.get("labels", {})) for s in samples)) if samples else set()
        for key in sorted(keys):
            vals = [s["labels"][key] for s in samples]
            if any(v is None for v in vals):
                continue
            dtype = torch.long if key.startswith("class") else torch.float32
            try:
                labels[key] = torch.as_tensor(vals, dtype=dtype)
            except (TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"label {key!r} is not numeric (first values {vals[:3]}); map it to numbers "
                                 "in the dataset") from err
        return ViewBatch(inputs=inputs, views=list(spec.views), mask=mask, labels=labels,
                         index=torch.as_tensor(indices, dtype=torch.long), dropped=dropped)

    def _shape_hint(self, modality: str) -> tuple[int, ...]:
        shape = self.modality_info.get(modality, {}).get("shape")
        if shape is None:
            raise ValueError(f"modality {modality!r} is absent from every sample of the batch; pass "
                             f"modality_info={{'{modality}': {{'shape': ...}}}} (or use ViewSetCollator.for_dataset)")
        return tuple(int(s) for s in shape)

    def _stack(self, modality: str, kind: str, items: list[Any]) -> dict[str, Any]:
        B = len(items)
        present = [x for x in items if x is not None]
        if kind == "text":
            return {"text": [x if x is not None else "" for x in items]}
        if kind == "tokens":
            L = max([int(x["input_ids"].shape[0]) for x in present] + [1])
            ids = torch.zeros(B, L, dtype=torch.long)
            att = torch.zeros(B, L, dtype=torch.long)
            for b, x in enumerate(items):
                if x is None:
                    continue
                n = int(x["input_ids"].shape[0])
                ids[b, :n] = torch.as_tensor(x["input_ids"], dtype=torch.long)
                att[b, :n] = torch.as_tensor(x.get("attention_mask", torch.ones(n)), dtype=torch.long)
            return {"input_ids": ids, "attention_mask": att}
        if kind in ("waveform", "sequence"):
            if present:
                tail = tuple(present[0].shape[1:])
            else:
                tail = self._shape_hint(modality)[1:] if kind == "sequence" else ()
            L = max([int(x.shape[0]) for x in present] + [1])
            values = torch.zeros((B, L) + tail, dtype=torch.float32)
            lengths = torch.zeros(B, dtype=torch.long)
            for b, x in enumerate(items):
                if x is None:
                    continue
                if tuple(x.shape[1:]) != tail:
                    raise ValueError(f"modality {modality!r}: feature shape {tuple(x.shape[1:])} differs from {tail} in one batch")
                values[b, : x.shape[0]] = x
                lengths[b] = x.shape[0]
            out: dict[str, Any] = {"values": values, "lengths": lengths}
            if kind == "waveform":
                out["sample_rate"] = int(self.modality_info.get(modality, {}).get("sample_rate", self.sample_rate))
            return out
        if kind in ("image", "video", "flow", "flow_frames"):
            shape = tuple(present[0].shape) if present else self._shape_hint(modality)
            for x in present:
                if tuple(x.shape) != shape:
                    fix = ("set data.options.image_size: N (or [H, W]) to resize every image as it is read, "
                           "or crop with an augmentation of a fixed output size") if kind == "image" else \
                        "resize or crop to a common size (e.g. an augmentation with a fixed output size)"
                    raise ValueError(f"modality {modality!r}: got shapes {tuple(x.shape)} and {shape} in one batch; {fix}")
            zero = torch.zeros(shape, dtype=torch.float32)
            key = "frames" if kind == "flow_frames" else "values"  # frames: flow made in the step
            return {key: torch.stack([zero if x is None else x.float() for x in items])}
        raise ValueError(f"unknown modality kind {kind!r} for {modality!r}; expected one of {KINDS}")


def readable_samples(samples: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], tuple[str, ...]]:
    """``(samples that could be read, messages of those that could not)``. A sample whose files
    could not be read (a dataset's ``on_error="skip"`` marks it with the key ``"unreadable"``,
    the message) is left out of its batch, not collated as a sample with every view absent: it
    would enter the loss and the evaluation as a phantom. With none left, the collator returns
    an empty batch (K = 0, ``dropped`` filled): evaluation passes over it, training stops on it
    with one line."""
    dropped = tuple(str(s["unreadable"]) for s in samples if s.get("unreadable"))
    if not dropped:
        return list(samples), ()
    return [s for s in samples if not s.get("unreadable")], dropped


def batch_size_for(num_views: int, batch_size: int, mode: str = "growing", reference_views: int = 2) -> int:
    """Unique samples K per batch under the poly-view batch policies (paper sec. 3.2).

    ``"growing"``: K = batch_size whatever M (the batch grows to K*M views).
    ``"fixed"``: K*M is held at ``batch_size * reference_views``, i.e.
    ``K = max(1, batch_size * reference_views // num_views)``.
    """
    if mode == "growing":
        return int(batch_size)
    if mode == "fixed":
        return max(1, int(batch_size) * int(reference_views) // int(num_views))
    raise ValueError(f"batch mode must be 'growing' or 'fixed', got {mode!r}")


class ViewSetBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices under the growing / fixed batch policy.

    ``K = batch_size_for(num_views, batch_size, mode, reference_views)`` indices per batch,
    shuffled by ``seed`` and the epoch (``set_epoch``). Pass it as ``batch_sampler=`` to a
    DataLoader together with a :class:`ViewSetCollator` as ``collate_fn``.
    """

    def __init__(self, num_samples: int, batch_size: int, num_views: int, mode: str = "growing", *,
                 reference_views: int = 2, shuffle: bool = True, drop_last: bool = True, seed: int = 0) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty: nothing to sample")
        self.num_samples = int(num_samples)
        self.K = batch_size_for(num_views, batch_size, mode, reference_views)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # The epoch's order stays one int64 tensor (8 bytes a sample); only each batch becomes a
        # list. As a list of Python ints it took 36 bytes a sample: 0.6 GB for 2^24 samples.
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        for start in range(0, self.num_samples, self.K):
            chunk = order[start : start + self.K].tolist()
            if len(chunk) < self.K and self.drop_last:
                return
            yield chunk

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.K
        return math.ceil(self.num_samples / self.K)
