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
- token ids:        ``{"input_ids": LongTensor[B, L], "attention_mask": LongTensor[B, L]}``
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

    def _host_all_present(self) -> bool | None:
        if self.all_present is not None:
            return self.all_present
        return bool(self.mask.all()) if self.mask.device.type == "cpu" else None

    def _map(self, fn: Any) -> "ViewBatch":
        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return fn(x)
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            return x

        return ViewBatch(
            inputs=walk(self.inputs),
            views=list(self.views),
            mask=fn(self.mask),
            labels=walk(self.labels),
            index=None if self.index is None else fn(self.index),
            all_present=self._host_all_present(),
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
