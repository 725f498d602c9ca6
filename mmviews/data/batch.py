"""The batch contract shared by the collator (``mmviews.data``), the modality adapters
(``mmviews.modalities``), the trainer and the evaluation code.

A batch holds K samples and M views per sample. Views are ordered and named; each view
comes from one modality. For every modality, the inputs of all its views are stacked
*sample-major*: item ``k * V_m + v`` is view ``v`` (of that modality's ``V_m`` views)
of sample ``k``. Encoding modality m gives ``[K * V_m, d]``, reshaped to ``[K, V_m, d]``
and placed at the positions of its views in the global view order, which yields
``z: [K, M, d]``.

Per-modality input dictionaries (keys an adapter reads):

- raw text:         ``{"text": list[str]}`` (tokenised by the text adapter)
- token ids:        ``{"input_ids": LongTensor[B, L], "attention_mask": LongTensor[B, L]}``,
                    optionally ``"lengths": list[int]`` (real tokens per row; the trainer's
                    batches carry raw text tokenised so, where they are collated)
- audio waveform:   ``{"values": FloatTensor[B, T], "lengths": LongTensor[B], "sample_rate": int}``
- image:            ``{"values": FloatTensor[B, 3, H, W]}`` in [0, 1] (the adapter normalises)
- video clip:       ``{"values": FloatTensor[B, T, 3, H, W]}`` in [0, 1]
- optical flow:     ``{"values": FloatTensor[B, T, 2, H, W]}`` in pixels
- feature sequence: ``{"values": FloatTensor[B, L, D], "lengths": LongTensor[B]}``

Absent views (a clip without an audio track) still occupy their slot in the stacked
inputs (zero-filled, length 0 where lengths exist) so that shapes stay rectangular; they
are marked False in ``mask`` and every objective ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ViewInfo:
    """One of the M views, in the global view order."""

    name: str  # unique, e.g. "vision_0", "vision_aug_1"
    modality: str  # key into ViewBatch.inputs, e.g. "vision"
    slot: int  # index among this modality's views (v above)
    natural: bool = True  # the natural view of the modality, or an augmented copy
    augmentation: str | None = None  # name of the augmentation pipeline, if any


@dataclass(frozen=True)
class PresentItems:
    """Which items of one modality's stacked inputs belong to present views, known on the host.

    ``positions``: the items ``k * V_m + v`` whose view is present, in order; ``total``:
    ``K * V_m``. ``index``: the same positions as a LongTensor that travels with the batch
    (moved by :meth:`ViewBatch.to`, pinned by :meth:`ViewBatch.pin_memory`), so that code on an
    accelerator can gather the present items without reading the mask back; None when every
    item or none is present (nothing to gather)."""

    positions: tuple[int, ...]
    total: int
    index: torch.Tensor | None = None

    @property
    def all(self) -> bool:
        return len(self.positions) == self.total

    @property
    def none(self) -> bool:
        return not self.positions

    @classmethod
    def from_mask(cls, present: torch.Tensor) -> "PresentItems":
        """From a host ``[B]`` bool mask (reading a device mask would be a synchronisation)."""
        positions = tuple(torch.nonzero(present.cpu()).flatten().tolist())
        total = int(present.numel())
        partial = 0 < len(positions) < total
        return cls(positions, total, torch.tensor(positions, dtype=torch.long) if partial else None)


def _present_range(items: PresentItems, first: int, stop: int) -> PresentItems:
    """The items ``first:stop`` of ``items``' stacked order, renumbered from 0. Positions are
    sorted, so the chunk's are a contiguous run of them, found on the host; its device index
    is a slice of the parent's (no host-to-device copy, which would wait for the device)."""
    import bisect

    lo, hi = bisect.bisect_left(items.positions, first), bisect.bisect_left(items.positions, stop)
    positions = tuple(q - first for q in items.positions[lo:hi])
    total = stop - first
    index = None
    if 0 < len(positions) < total:
        assert items.index is not None  # the parent is partial too
        index = items.index[lo:hi] - first
    return PresentItems(positions, total, index)


@dataclass
class ViewBatch:
    inputs: dict[str, dict[str, Any]]
    views: list[ViewInfo]
    mask: torch.Tensor  # [K, M] bool, True = view present
    labels: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. "class" [K], "sentiment" [K]
    index: torch.Tensor | None = None  # [K] dataset indices (IPMC's memory bank)
    # Whether every view of every sample is present, read from the mask while it was still in
    # host memory (by :meth:`to` and :meth:`pin_memory`), so that code running on an
    # accelerator can branch on it without reading the device mask back (a synchronisation).
    # None: not known yet.
    all_present: bool | None = None
    # Per modality, which of its stacked items are present (see :meth:`present_items`), read from
    # the mask in host memory like ``all_present``. None: not known yet.
    presence: dict[str, PresentItems] | None = None
    # True when the inputs' values (finite, lengths, token ids...) were checked on the host where
    # the batch was built (``MultiViewEncoder.host_preparation``, installed by the trainer in
    # the training loader, or ``input_check``): the adapters then skip their own value checks,
    # each of which would read the device back. Carried by :meth:`to` and :meth:`pin_memory`.
    inputs_checked: bool = False
    # Samples the collator left out because their files could not be read (a dataset's
    # on_error="skip", sample key "unreadable"): one message per sample, naming its file. The
    # trainer counts them per split (``data_losses`` of results.json).
    dropped: tuple[str, ...] = ()

    @property
    def num_samples(self) -> int:
        return int(self.mask.shape[0])

    @property
    def num_views(self) -> int:
        return len(self.views)

    def views_of(self, modality: str) -> list[int]:
        """Positions (in the global view order) of the views of ``modality``, by slot."""
        positions = [i for i, v in enumerate(self.views) if v.modality == modality]
        return sorted(positions, key=lambda i: self.views[i].slot)

    def all_views_present(self) -> bool:
        """True when no view of any sample is absent (``mask.all()``). Free when the batch
        was moved by :meth:`to` or pinned by :meth:`pin_memory` (read while in host memory);
        otherwise it reads the mask, a device synchronisation for an accelerator's mask."""
        if self.all_present is None:
            self.all_present = bool(self.mask.all())
        return self.all_present

    def present_items(self, modality: str) -> PresentItems:
        """Which stacked items of ``modality`` (``k * V_m + v``) belong to present views. Free
        when the batch was moved by :meth:`to` or pinned by :meth:`pin_memory` (read while in
        host memory); otherwise read from the mask, a device synchronisation for an
        accelerator's mask."""
        if self.presence is None:
            self.presence = {}
        if modality not in self.presence:
            self.presence[modality] = PresentItems.from_mask(self.modality_mask(modality))
        return self.presence[modality]

    def modality_mask(self, modality: str) -> torch.Tensor:
        """``[K * V_m]`` bool, in the stacked order of ``modality``'s inputs: True where the
        item's view is present (on the mask's device)."""
        return self.mask[:, self.views_of(modality)].reshape(-1)

    def sample_range(self, start: int, stop: int) -> "ViewBatch":
        """Samples ``start:stop`` of the batch, all their views (the cached-embedding step's
        chunks, :mod:`mmviews.train.step`). Each modality's stacked inputs are sliced at
        items ``start * V_m : stop * V_m`` (tensors and lists of ``K * V_m`` items; other
        entries, e.g. ``sample_rate``, are kept): views of the parent's tensors, no copies.
        Which items are present is taken from the parent's host-side record when it has one
        (a batch moved by :meth:`to`), so that the chunk, too, is encoded without reading the
        device; the chunk may have none of a modality."""
        k = self.num_samples
        if not 0 <= start < stop <= k:
            raise ValueError(f"sample_range({start}, {stop}): need 0 <= start < stop <= K = {k}")

        def cut(x: Any, total: int, per_sample: int) -> Any:
            if isinstance(x, torch.Tensor):
                return x[start * per_sample:stop * per_sample] if x.dim() > 0 and x.shape[0] == total else x
            if isinstance(x, dict):
                return {key: cut(v, total, per_sample) for key, v in x.items()}
            if isinstance(x, (list, tuple)) and len(x) == total:
                return type(x)(x[start * per_sample:stop * per_sample])
            return x

        inputs = {}
        for modality, values in self.inputs.items():
            per_sample = len(self.views_of(modality))
            inputs[modality] = cut(values, k * per_sample, per_sample) if per_sample else values
        presence = None
        if self.presence is not None:
            presence = {m: _present_range(p, start * (p.total // k), stop * (p.total // k))
                        for m, p in self.presence.items()}
        all_present = True if self.all_present else None
        if all_present is None and presence is not None and set(presence) >= {v.modality for v in self.views}:
            all_present = all(p.all for p in presence.values())
        return ViewBatch(inputs=inputs, views=list(self.views), mask=self.mask[start:stop],
                         labels=cut(self.labels, k, 1), index=None if self.index is None else self.index[start:stop],
                         all_present=all_present, presence=presence, inputs_checked=self.inputs_checked)

    def _host_all_present(self) -> bool | None:
        if self.all_present is not None:
            return self.all_present
        return bool(self.mask.all()) if self.mask.device.type == "cpu" else None

    def _host_presence(self) -> dict[str, PresentItems] | None:
        if self.mask.device.type == "cpu":  # complete it while it costs no synchronisation
            for modality in dict.fromkeys(v.modality for v in self.views):
                self.present_items(modality)
        return self.presence

    def _map(self, fn: Any) -> "ViewBatch":
        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return fn(x)
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            return x

        presence = self._host_presence()
        return ViewBatch(
            inputs=walk(self.inputs),
            views=list(self.views),
            mask=fn(self.mask),
            labels=walk(self.labels),
            index=None if self.index is None else fn(self.index),
            all_present=self._host_all_present(),
            presence=None if presence is None else {
                m: PresentItems(p.positions, p.total, None if p.index is None else fn(p.index))
                for m, p in presence.items()},
            inputs_checked=self.inputs_checked,
            dropped=self.dropped,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ViewBatch":
        """The batch with every tensor on ``device``. ``non_blocking=True`` lets copies from
        pinned host memory (:meth:`pin_memory`) overlap with work already queued on the device
        (Accelerate passes it when the loader is configured with ``non_blocking``)."""
        return self._map(lambda x: x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "ViewBatch":
        """The batch with its CPU tensors in page-locked memory; called by ``DataLoader(...,
        pin_memory=True)`` in its pinning thread, so that :meth:`to` can copy asynchronously."""
        return self._map(lambda x: x.pin_memory() if x.device.type == "cpu" else x)
