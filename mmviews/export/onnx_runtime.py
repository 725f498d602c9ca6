"""Running an encoder exported by ``mmviews export --format onnx`` with onnxruntime and numpy.

This module imports neither torch nor any model code: :class:`OnnxEncoder` reads
``onnx_manifest.json``, opens one ``onnxruntime.InferenceSession`` per modality and does, with
numpy, the preprocessing that the graphs leave out (see :mod:`mmviews.export.onnx`): text is
tokenised with the ``tokenizers`` package from the adapter's saved ``tokenizer.json`` (the
library transformers' fast tokenizers run on), waveforms must come at the graph's sample rate,
ViT images at the tower's input size, and the frames of a clip are embedded as rows whose unit
vectors are averaged and normalised again.

Inputs follow the layout of mmviews batches (:mod:`mmviews.data.batch`), as numpy arrays (or
anything ``numpy.asarray`` takes): ``{"text": [str, ...]}`` or token ids; ``{"values": [B, T],
"sample_rate": r, "lengths": [B]}`` for waveforms; ``{"values": [B, C, H, W] or [B, T, C, H,
W]}`` for images and clips (whole clips ``[B, T, 3, S, S]`` for the spatiotemporal video
backbones); ``{"values": [B, T, 2, H, W]}`` for flow; ``{"values": [B, L, D],
"lengths": [B]}`` for feature sequences. :meth:`OnnxEncoder.__call__` takes a whole
``ViewBatch`` (as ``mmviews embed`` does; that bridge alone converts torch tensors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["FORMAT", "MANIFEST_FILE", "OnnxAdapter", "OnnxEncoder", "is_onnx_folder"]

FORMAT = "mmviews-onnx"
VERSION = 1
MANIFEST_FILE = "onnx_manifest.json"
RECIPE_FILE = "config.yaml"


def is_onnx_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by ``mmviews export --format onnx``."""
    return (Path(path) / MANIFEST_FILE).is_file()


def _normalise(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit length (as ``torch.nn.functional.normalize``, eps 1e-12)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _array(inputs: Mapping[str, Any], key: str, where: str) -> np.ndarray:
    if key not in inputs:
        raise ValueError(f"{where}: inputs have no key {key!r} (keys: {sorted(inputs)})")
    value = inputs[key]
    if hasattr(value, "detach"):  # a torch tensor (without importing torch)
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise ValueError(f"{where}: inputs[{key!r}] of shape {array.shape} holds non-finite values (NaN or inf)")
    return array


class OnnxAdapter:
    """One modality's graph and preprocessing (one entry of the manifest)."""

    def __init__(self, folder: Path, name: str, entry: Mapping[str, Any], providers: Sequence[str],
                 threads: int | None = None) -> None:
        import onnxruntime as ort

        self.name, self.entry = name, dict(entry)
        self.kind: str = entry["type"]
        self.embed_dim = int(entry["embed_dim"])
        self.pre: dict[str, Any] = dict(entry.get("preprocessing") or {})
        self.where = f"{name} ({self.kind}, ONNX)"
        graph = _inside(folder, entry["graph"], "graph")
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: the exporter's unused-initialiser notes are noise
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(graph), options, providers=list(providers))
        self.input_names = [i["name"] for i in entry["inputs"]]
        self.tokenizer: Any = None
        if self.kind == "text":
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(_inside(folder, self.pre["tokenizer"], "tokenizer")))
            tokenizer.enable_truncation(int(self.pre["max_length"]))
            tokenizer.enable_padding(direction=self.pre.get("padding_side", "right"),
                                     pad_id=int(self.pre.get("pad_token_id", 0)))
            self.tokenizer = tokenizer

    def _run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, {n: feeds[n] for n in self.input_names})[0]

    def embed(self, inputs: Mapping[str, Any]) -> np.ndarray:
        """``[B, embed_dim]`` float32 unit vectors of ``inputs`` (every row present)."""
        if self.kind == "text":
            return self._run(self._tokens(inputs))
        if self.kind in ("hf_audio", "audio_cnn"):
            return self._run(self._waveforms(inputs))
        if self.kind in ("feature_sequence", "mlp"):
            return self._run(self._sequences(inputs))
        if self.pre.get("clips") == "video":
            return self._run(self._clips(inputs))
        return self._frames(inputs)

    def _tokens(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        max_length = int(self.pre["max_length"])
        if "text" in inputs:
            texts = inputs["text"]
            if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{self.where}: inputs['text'] must be a non-empty list of strings")
            encodings = self.tokenizer.encode_batch(list(texts))
            ids = np.array([e.ids for e in encodings], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
            return {"input_ids": ids, "attention_mask": mask}
        ids = _array(inputs, "input_ids", self.where).astype(np.int64)
        mask = np.ones_like(ids) if inputs.get("attention_mask") is None else \
            _array(inputs, "attention_mask", self.where).astype(np.int64)
        if inputs.get("lengths") is not None:  # token ids collated for more rows: only the columns these need
            longest = int(max(np.asarray(inputs["lengths"]).tolist(), default=0))
            columns = slice(ids.shape[1] - longest, None) if self.pre.get("padding_side") == "left" else slice(0, longest)
            ids, mask = ids[:, columns], mask[:, columns]
        return {"input_ids": ids[:, :max_length], "attention_mask": mask[:, :max_length]}

    def _waveforms(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        values = _array(inputs, "values", self.where).astype(np.float32)
        if values.ndim != 2 or values.shape[1] == 0:
            raise ValueError(f"{self.where}: waveform values must be [B, T] with T > 0, got shape {values.shape}")
        rate, wanted = int(inputs.get("sample_rate", 0)), int(self.pre["sample_rate"])
        if rate != wanted:
            raise ValueError(f"{self.where}: audio at {rate} Hz; the graph takes {wanted} Hz (resampling is not part "
                             "of the ONNX export: resample the audio first)")
        if values.shape[1] < int(self.pre["min_samples"]):
            raise ValueError(f"{self.where}: waveform of {values.shape[1]} samples is too short for the backbone's "
                             f"conv front end (it needs {self.pre['min_samples']} at {wanted} Hz)")
        lengths = self._lengths(inputs, values)
        short = np.flatnonzero(lengths < max(1, int(self.pre["min_samples"])))
        if len(short):
            raise ValueError(f"{self.where}: waveform(s) at position(s) {short.tolist()[:10]} too short to give one "
                             f"frame (fewer than {self.pre['min_samples']} samples at {wanted} Hz)")
        return {"values": values, "lengths": lengths}

    def _lengths(self, inputs: Mapping[str, Any], values: np.ndarray) -> np.ndarray:
        if inputs.get("lengths") is None:
            return np.full(values.shape[0], values.shape[1], dtype=np.int64)
        lengths = _array(inputs, "lengths", self.where).astype(np.int64)
        if lengths.shape != (values.shape[0],) or (lengths < 0).any() or (lengths > values.shape[1]).any():
            raise ValueError(f"{self.where}: lengths must be [B] in [0, {values.shape[1]}], got {lengths.tolist()[:10]}")
        return lengths

    def _sequences(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        values = _array(inputs, "values", self.where).astype(np.float32)
        dim = int(self.pre["input_dim"])
        if values.ndim != 3 or values.shape[2] != dim or values.shape[1] == 0:
            raise ValueError(f"{self.where}: values must be [B, L, {dim}] with L > 0, got shape {values.shape}")
        feeds = {"values": values}
        if "lengths" in self.input_names:
            feeds["lengths"] = self._lengths(inputs, values)
        return feeds

    def _clips(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Whole clips ``[B, T, 3, S, S]`` in [0, 1] for a spatiotemporal graph: the frame size
        and the number of frames it takes."""
        values = _array(inputs, "values", self.where).astype(np.float32)
        side = self.pre["image_size"]
        if values.ndim != 5 or values.shape[2] != 3:
            raise ValueError(f"{self.where}: values must be clips [B, T, 3, H, W], got shape {values.shape}")
        if list(values.shape[-2:]) != list(side):
            raise ValueError(f"{self.where}: frames of {values.shape[-2]}x{values.shape[-1]}; the graph takes "
                             f"{side[0]}x{side[1]} (resizing is not part of the ONNX export: resize the frames first)")
        t, fixed, least = values.shape[1], self.pre.get("frames"), int(self.pre.get("min_frames", 1))
        if fixed is not None and t != int(fixed):
            raise ValueError(f"{self.where}: the graph takes clips of {fixed} frames, got {t}")
        if t < least:
            raise ValueError(f"{self.where}: the graph takes clips of at least {least} frames, got {t}")
        if values.size and (values.min() < -1e-3 or values.max() > 1 + 1e-3):
            raise ValueError(f"{self.where}: clips must be in [0, 1], got range [{values.min():.3g}, "
                             f"{values.max():.3g}] in inputs['values'] of shape {values.shape}")
        return {"values": values}

    def _frames(self, inputs: Mapping[str, Any]) -> np.ndarray:
        """Images, clips and flow: rows of ``frames_per_row`` frames through the graph; a clip's
        row vectors averaged and normalised again (the adapter's per-clip pooling)."""
        values = _array(inputs, "values", self.where).astype(np.float32)
        channels, group = int(self.pre["channels"]), int(self.pre["frames_per_row"])
        flow = self.kind.startswith("flow")
        given = values.shape  # the error names the shape the caller gave
        if values.ndim == 4:  # one image or one flow per item
            values = values[:, None]
        if values.ndim != 5 or values.shape[2] != channels:
            raise ValueError(f"{self.where}: values must be [B, {channels}, H, W] or [B, T, {channels}, H, W], got "
                             f"shape {given}")
        size = self.pre.get("image_size")
        if size is not None and list(values.shape[-2:]) != list(size):
            raise ValueError(f"{self.where}: frames of {values.shape[-2]}x{values.shape[-1]}; the graph takes "
                             f"{size[0]}x{size[1]} (resizing is not part of the ONNX export: resize the frames first)")
        if self.kind == "open_clip" and values.size and (values.min() < -1e-3 or values.max() > 1 + 1e-3):
            raise ValueError(f"{self.where}: images must be in [0, 1], got range [{values.min():.3g}, "
                             f"{values.max():.3g}] in inputs['values'] of shape {values.shape}")
        b, t = values.shape[:2]
        if self.pre["clips"] == "whole":
            if t != group:
                raise ValueError(f"{self.where}: the graph takes clips of T={group} flows stacked, got T={t}")
            return self._run({"values": values})
        if t % group:
            raise ValueError(f"{self.where}: T={t} flows is not a multiple of stacked_flows={group}")
        rows = values.reshape(b * (t // group), group, *values.shape[2:])
        z = self._run({"values": rows if flow else rows[:, 0]})
        if t // group == 1:
            return z
        return _normalise(z.reshape(b, t // group, -1).mean(1)).astype(np.float32)


def _inside(folder: Path, relative: str, what: str) -> Path:
    """``folder / relative``, refused when it leaves ``folder`` (the manifest is a user's file)."""
    path = (folder / relative).resolve()
    if not path.is_relative_to(folder.resolve()) or not path.is_file():
        raise ValueError(f"{folder / MANIFEST_FILE}: {what} {relative!r} is not a file inside {folder}")
    return path


class OnnxEncoder:
    """The encoder of an ONNX export folder: ``embed(modality, inputs)`` per modality, or a whole
    ``ViewBatch`` through ``__call__`` (``z [K, M, d]``, ``mask [K, M]``, as the torch encoder)."""

    def __init__(self, folder: str | os.PathLike[str], providers: Sequence[str] = ("CPUExecutionProvider",),
                 threads: int | None = None) -> None:
        self.folder = Path(folder)
        path = self.folder / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{self.folder} is not an ONNX export of mmviews: missing {path}")
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not a JSON manifest ({error})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} manifest of version {VERSION}")
        self.manifest = manifest
        self.adapters = {name: OnnxAdapter(self.folder, name, entry, providers, threads)
                         for name, entry in manifest["modalities"].items()}
        self.not_exported: dict[str, str] = dict(manifest.get("not_exported") or {})
        self.embed_dim = next(iter(self.adapters.values())).embed_dim

    def embed(self, modality: str, inputs: Mapping[str, Any]) -> np.ndarray:
        """``[B, d]`` unit vectors of one modality's inputs (every row present)."""
        if modality not in self.adapters:
            reason = self.not_exported.get(modality)
            raise KeyError(f"modality {modality!r} " + (f"was not exported to ONNX: {reason}" if reason else
                           f"is not in {self.folder} (modalities: {sorted(self.adapters)})"))
        return self.adapters[modality].embed(inputs)

    def embed_present(self, modality: str, inputs: Mapping[str, Any], present: np.ndarray) -> np.ndarray:
        """``[len(present), d]``: the rows where ``present`` is True embedded, zeros elsewhere (only
        present rows reach the graph, as in the torch encoder)."""
        total = len(present)
        out = np.zeros((total, self.embed_dim), dtype=np.float32)
        rows = np.flatnonzero(present)
        if len(rows) == 0:
            return out
        if len(rows) < total:
            inputs = _subset(inputs, rows, total)
        out[rows] = self.embed(modality, inputs)
        return out

    def __call__(self, batch: Any) -> tuple[Any, Any]:
        """A ``ViewBatch`` -> ``(z [K, M, d], mask [K, M])`` torch tensors (imports torch: the
        bridge to mmviews' data loaders and :func:`mmviews.eval.extract.extract_embeddings`)."""
        import torch

        k, m = batch.num_samples, batch.num_views
        mask = batch.mask.bool().cpu()
        z = np.zeros((k, m, self.embed_dim), dtype=np.float32)
        for modality in dict.fromkeys(v.modality for v in batch.views):
            positions = batch.views_of(modality)
            present = batch.modality_mask(modality).cpu().numpy()
            vectors = self.embed_present(modality, batch.inputs[modality], present)
            z[:, positions] = vectors.reshape(k, len(positions), -1)
        return torch.from_numpy(z) * mask.unsqueeze(-1), mask

    def eval(self) -> "OnnxEncoder":
        return self


def _subset(inputs: Mapping[str, Any], rows: np.ndarray, total: int) -> dict[str, Any]:
    """The items ``rows`` of an input dict: arrays and lists of ``total`` items are indexed, the
    rest (``sample_rate``) kept."""
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray) and value.ndim > 0 and value.shape[0] == total:
            out[key] = value[rows]
        elif isinstance(value, (list, tuple)) and len(value) == total:
            out[key] = [value[i] for i in rows.tolist()]
        else:
            out[key] = value
    return out
