"""Feature cache for frozen backbones.

With a frozen backbone, ``adapter.features(inputs)`` depends only on the backbone (its
architecture and weights) and the preprocessing. The cache stores those pooled
features once per dataset split, keyed by item id, so that later epochs run only the
heads. Its key is a SHA-256 over the adapter type, its preprocessing signature and every
backbone tensor (parameters and buffers); the key is part of the file name and is
checked against the file's metadata on load, so a changed backbone or preprocessing
never reads a stale file.

Files: ``<directory>/<name>-<split>-<key>.safetensors`` with tensors ``ids [N]`` and
``features [N, ...]``, written atomically (temp file + ``os.replace``) by :meth:`save`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from mmviews.fileio import atomic_save

from .base import Adapter
from .inputs import subset_inputs


def backbone_fingerprint(adapter: Adapter) -> str:
    """Hex SHA-256 of the adapter type, its preprocessing and its backbone tensors."""
    h = hashlib.sha256()
    h.update(type(adapter).__name__.encode())
    h.update(json.dumps(adapter.preprocessing_signature(), sort_keys=True, default=str).encode())
    for name, t in sorted(adapter.backbone.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class FeatureCache:
    """Pooled backbone features of one adapter on one dataset split, by item id."""

    def __init__(self, directory: str | os.PathLike[str], adapter: Adapter, split: str = "train", name: str | None = None) -> None:
        self.directory = Path(directory)
        self.key = backbone_fingerprint(adapter)
        self.name = name or adapter.config.type
        self.split = split
        self.path = self.directory / f"{self.name}-{split}-{self.key[:24]}.safetensors"
        self._ids = torch.empty(0, dtype=torch.long)  # sorted
        self._feats: torch.Tensor | None = None
        self._dirty = False
        self.hits = 0
        self.misses = 0
        if self.path.is_file():
            self._load()

    def __len__(self) -> int:
        return int(self._ids.numel())

    def _load(self) -> None:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != self.key:
                # Same file name prefix but another key: never use it.
                return
            self._ids = f.get_tensor("ids")
            self._feats = f.get_tensor("features")

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``ids [B]`` (int64; negative = never cached) return ``hit [B]`` bool and the
        row positions in the store (valid where hit)."""
        ids = ids.to("cpu", torch.long)
        if self._ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        pos = torch.searchsorted(self._ids, ids).clamp_max(self._ids.numel() - 1)
        hit = (self._ids[pos] == ids) & (ids >= 0)
        return hit, pos

    def get(self, pos: torch.Tensor) -> torch.Tensor:
        assert self._feats is not None
        return self._feats[pos]

    def put(self, ids: torch.Tensor, features: torch.Tensor) -> None:
        """Store rows (ids < 0 and ids already present are skipped)."""
        ids = ids.to("cpu", torch.long)
        features = features.detach().to("cpu")
        hit, _ = self.lookup(ids)
        keep = (ids >= 0) & ~hit
        if not bool(keep.any()):
            return
        ids, features = ids[keep], features[keep]
        # Duplicates inside one batch (same item twice): keep the first.
        uniq, inverse = torch.unique(ids, return_inverse=True)
        first = torch.full_like(uniq, ids.numel()).scatter_reduce(0, inverse, torch.arange(ids.numel()), "amin")
        ids, features = ids[first], features[first]
        if self._feats is not None and self._feats.shape[1:] != features.shape[1:]:
            raise ValueError(f"feature cache {self.path.name}: rows of shape {tuple(features.shape[1:])} "
                             f"do not match stored {tuple(self._feats.shape[1:])}")
        all_ids = torch.cat([self._ids, ids])
        all_feats = features if self._feats is None else torch.cat([self._feats, features])
        order = torch.argsort(all_ids)
        self._ids, self._feats = all_ids[order], all_feats[order]
        self._dirty = True

    def features(
        self,
        ids: torch.Tensor,
        inputs: Mapping[str, Any],
        compute: Callable[[Mapping[str, Any], torch.Tensor | None], torch.Tensor],
        batch_size: int,
        needed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Features of a batch: cached rows are read, the others computed with one call
        ``compute(inputs_of_those_rows, rows)`` (``rows`` None: the whole batch) and stored.
        Rows where ``needed [B]`` is False (absent views) are neither computed nor
        stored; they come back as zeros when not cached."""
        ids = ids.to("cpu", torch.long)
        hit, pos = self.lookup(ids)
        needed = torch.ones_like(hit) if needed is None else needed.to("cpu").bool()
        todo = ~hit & needed
        n_hit, n_todo = int(hit.sum()), int(todo.sum())
        self.hits += n_hit
        self.misses += n_todo
        if n_todo == 0 and n_hit == batch_size:
            return self.get(pos)
        out: torch.Tensor | None = None
        if n_todo:
            todo_rows = torch.nonzero(todo).flatten()
            if n_todo == batch_size:
                computed = compute(inputs, None)
                self.put(ids, computed)
                return computed
            computed = compute(subset_inputs(inputs, todo_rows, batch_size), todo_rows)
            self.put(ids[todo_rows], computed)
            out = computed.new_zeros((batch_size, *computed.shape[1:]))
            out[todo_rows.to(out.device)] = computed
        if n_hit:
            hit_rows = torch.nonzero(hit).flatten()
            cached = self.get(pos[hit_rows])
            if out is None:
                out = cached.new_zeros((batch_size, *cached.shape[1:]))
            out[hit_rows.to(out.device)] = cached.to(out.device, out.dtype)
        if out is None:
            # Nothing needed and nothing cached (every view absent): compute once to get the shape.
            return compute(inputs, None)
        return out

    def save(self) -> Path | None:
        """Write the store (atomically) if it changed. Returns the path written."""
        from safetensors.torch import save_file

        if not self._dirty or self._feats is None:
            return None
        tensors = {"ids": self._ids.contiguous(), "features": self._feats.contiguous()}
        metadata = {"key": self.key, "name": self.name, "split": self.split}
        atomic_save(self.path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        self._dirty = False
        return self.path
