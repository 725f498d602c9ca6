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

    def to(self, device: torch.device | str) -> "ViewBatch":
        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x

        return ViewBatch(
            inputs=move(self.inputs),
            views=list(self.views),
            mask=self.mask.to(device),
            labels=move(self.labels),
            index=None if self.index is None else self.index.to(device),
        )
