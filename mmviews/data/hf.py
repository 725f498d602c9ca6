"""Local HuggingFace ``datasets`` as sample dicts (no hub access needed).

Three forms of ``root``:

- ``format="disk"``: a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
- ``format="imagefolder"``: ``root/[split/]label/xxx.png`` (the ``imagefolder`` builder).
- ``format="parquet"``: ``root/<split>/*.parquet`` shards (``mmviews prepare ... --format parquet``
  writes them; detected under ``format="auto"``), map-style or streamed: :mod:`mmviews.data.streaming`.
- ``format="audiofolder"``: ``root/[split/]label/xxx.wav``. The ``audiofolder`` builder
  decodes with torchcodec (plus a system FFmpeg), which mmviews does not require, so the
  folder is listed directly into a ``datasets.Dataset`` of file paths.

``columns`` maps modality names to columns (``{"image": "img", "text": "sentence"}``) and
``labels`` maps label names to columns (``{"class": "label"}``). Image and audio columns
are read with decoding turned off and decoded by mmviews (PIL, soundfile: :mod:`mmviews.data.decode`),
so a damaged file raises an error naming it (or, with ``on_error="skip"``, is marked absent and counted).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch.utils.data import Dataset

from mmviews.data.decode import decode_audio, decode_image
from mmviews.data.registry import dataset_error, dataset_folder, register_dataset
from mmviews.notices import MMViewsWarning

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


# Folder names that ``datasets`` reads as the split "validation" (its imagefolder builder
# renames them), and the names users give that split in recipes.
VALIDATION_NAMES = ("validation", "valid", "val", "dev")
SPLIT_FOLDER_NAMES = ("train", "test", *VALIDATION_NAMES)


def missing_split_error(root: Path, split: str, available: Any) -> KeyError:
    """A KeyError naming the split asked for and the ones there, and saying when ``datasets``
    renamed a ``valid/``-like folder to ``validation``."""
    available = sorted(str(a) for a in available)
    note = ""
    if split in VALIDATION_NAMES and "validation" in available:
        folders = [n for n in VALIDATION_NAMES[1:] if (root / n).is_dir()]
        said = f"datasets names the folder {folders[0]}/ split 'validation'" if folders else \
            "this dataset calls its validation split 'validation'"
        note = f"; {said}: ask for split 'validation' (e.g. --set data.val_split=validation)"
    return dataset_error(KeyError, f"{root}: no split {split!r}; available: {available}{note}", "split")


#: Where an image folder's labels come from (said where a label is missing).
IMAGEFOLDER_LABELS = "an image folder's label 'class' is the name of the folder each image is in: ROOT/SPLIT/LABEL/x.png"


def _labels_are_split_folders(feature: Any) -> bool:
    """Whether an ``imagefolder`` split's ``label`` column names split folders (``train``,
    ``test``...): what ``datasets`` makes of ``ROOT/SPLIT/x.png``, images without ``LABEL/`` folders."""
    import datasets

    return isinstance(feature, datasets.ClassLabel) and bool(feature.names) and \
        all(name in SPLIT_FOLDER_NAMES for name in feature.names)


def _audiofolder(root: Path, split: str) -> Any:
    import datasets

    split_dirs = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name in SPLIT_FOLDER_NAMES)
    if split_dirs and not (root / split).is_dir():
        # A folder with split sub-folders but not this one: taking every file would mix splits.
        raise dataset_error(KeyError, f"{root}: no split folder {split!r}; split folders: {split_dirs}", "split")
    base = root / split if (root / split).is_dir() else root
    files = sorted(p for p in base.rglob("*") if p.suffix.lower() in AUDIO_EXTENSIONS)
    names = sorted({p.parent.name for p in files if p.parent != base})
    data: dict[str, list[Any]] = {"audio": [str(p) for p in files]}
    features = {"audio": datasets.Value("string")}
    if names:
        data["label"] = [names.index(p.parent.name) if p.parent != base else -1 for p in files]
        features["label"] = datasets.ClassLabel(names=names)
    return datasets.Dataset.from_dict(data, features=datasets.Features(features))


class HFDataset(Dataset):
    """A local HuggingFace dataset split yielding sample dicts.

    Args:
        root: dataset folder (see module docstring).
        split: split name for DatasetDicts / split sub-folders.
        format: ``"auto"`` (disk if ``dataset_dict.json`` or ``dataset_info.json`` is present,
            else imagefolder/audiofolder by the files found), ``"disk"``, ``"imagefolder"``,
            ``"audiofolder"``.
        columns: ``{modality: column}``; default: the columns named image, audio, text.
        labels: ``{label name: column}``; default ``{"class": "label"}`` if present.
        image_size: resize images to this (int or (H, W)) so a batch stacks; None keeps sizes.
        sample_rate: audio is resampled to it (torchaudio) after decoding with soundfile.

    Modality values: images FloatTensor[3, H, W] in [0, 1]; audio FloatTensor[T] mono; text str;
    numeric list columns FloatTensor of their shape. ``label_note``: where an image folder's labels
    come from (None for the other formats), said by the checks that find a label missing.
    """

    label_note: str | None = None

    def __init__(self, root: str | os.PathLike[str], split: str = "train", *, format: str = "auto",
                 columns: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
                 image_size: int | tuple[int, int] | None = None, sample_rate: int = 16000, on_error: str = "raise") -> None:
        import datasets

        self.root = dataset_folder(root, "a save_to_disk folder, an image or audio folder, or a folder of Parquet shards")
        if not self.root.exists():
            raise FileNotFoundError(f"no such dataset folder: {self.root}")
        if on_error not in ("raise", "skip"):
            raise dataset_error(ValueError, f"on_error must be 'raise' or 'skip', got {on_error!r}", "on_error")
        if format == "auto":
            if (self.root / "dataset_dict.json").is_file() or (self.root / "dataset_info.json").is_file():
                format = "disk"
            elif any(p.suffix.lower() in AUDIO_EXTENSIONS for p in self.root.rglob("*")):
                format = "audiofolder"
            else:
                format = "imagefolder"
        if format == "disk":
            try:
                ds = datasets.load_from_disk(str(self.root))
            except (FileNotFoundError, KeyError):
                raise
            except Exception as err:  # datasets fails deep inside (e.g. IndexError) on an empty save
                raise ValueError(f"{self.root}: cannot load the saved dataset ({type(err).__name__}: {err}); "
                                 "it may be empty or incompletely written") from err
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise missing_split_error(self.root, split, ds)
                ds = ds[split]
        elif format == "imagefolder":
            # Every split is prepared anyway; asking for all of them lets a missing one be named.
            splits = datasets.load_dataset("imagefolder", data_dir=str(self.root))
            if split not in splits:
                raise missing_split_error(self.root, split, splits)
            ds = splits[split]
            self.label_note = IMAGEFOLDER_LABELS
            if _labels_are_split_folders(ds.features.get("label")):
                # images straight in ROOT/SPLIT/: datasets names each image's folder, the split, as its "label"
                ds = ds.remove_columns("label")
                self.label_note = (f"{IMAGEFOLDER_LABELS}; the images of {self.root} lie directly in ROOT/SPLIT/, "
                                   "with no LABEL/ folders")
        elif format == "audiofolder":
            ds = _audiofolder(self.root, split)
        else:
            raise dataset_error(ValueError, f"format must be auto, disk, imagefolder or audiofolder, got {format!r}", "format")
        feats = ds.features
        if columns is None:
            columns = {m: m for m in ("image", "audio", "text") if m in feats}
        if labels is None:
            labels = {"class": "label"} if "label" in feats else {}
        for option, mapping in (("columns", columns), ("labels", labels)):
            for name, col in mapping.items():
                if col not in feats:
                    raise dataset_error(KeyError, f"{self.root}: split {split!r} has no column {col!r} (for {name!r}); "
                                        f"columns: {sorted(feats)}", option)
        if not columns:
            raise dataset_error(ValueError, f"{self.root}: no modality columns (no column is named image, audio or text): "
                                f"name the columns to read, modality -> column (columns: {sorted(feats)})", "columns")
        # Decode images and audio here, not in datasets: names the file on failure, and
        # datasets' Audio() decoding needs torchcodec, which mmviews does not require.
        self.kinds: dict[str, str] = {}
        for m, col in columns.items():
            f = feats[col]
            if isinstance(f, datasets.Image):
                ds = ds.cast_column(col, datasets.Image(decode=False))
                self.kinds[m] = "image"
            elif isinstance(f, datasets.Audio):
                ds = ds.cast_column(col, datasets.Audio(decode=False))
                self.kinds[m] = "waveform"
            elif m == "audio" or (isinstance(f, datasets.Value) and f.dtype in ("binary", "large_binary")):
                self.kinds[m] = "waveform"
            elif isinstance(f, datasets.Value) and f.dtype in ("string", "large_string"):
                self.kinds[m] = "text"
            else:
                self.kinds[m] = "array"
        if len(ds) == 0:
            raise dataset_error(ValueError, f"{self.root}: split {split!r} is empty", "split")
        for name, col in labels.items():
            f = feats[col]
            if isinstance(f, datasets.Value) and f.dtype.startswith("float"):
                values = np.asarray(ds[col], dtype=np.float64)  # a NaN target fails later, far from its row
                finite = np.isfinite(values)
                if not finite.all():
                    row = int(np.argmin(finite))
                    raise ValueError(f"{self.root} [split {split!r}]: label {name!r} (column {col!r}) is not finite "
                                     f"({values[row]}) at row {row}; {int((~finite).sum())} of {len(values)} labels "
                                     "are non-finite: fix or drop those rows")
        self.ds = ds
        self.columns = dict(columns)
        self.label_columns = dict(labels)
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.sample_rate = int(sample_rate)
        self.on_error = on_error
        self.num_skipped = 0

    def __len__(self) -> int:
        return len(self.ds)

    def modality_info(self) -> dict[str, dict[str, Any]]:
        info: dict[str, dict[str, Any]] = {}
        for m, k in self.kinds.items():
            if k == "image":
                info[m] = {"kind": "image"} | ({"shape": (3, *self.image_size)} if self.image_size else {})
            elif k == "waveform":
                info[m] = {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate}
            elif k == "text":
                info[m] = {"kind": "text"}
        return info

    def _decode_image(self, value: Any) -> torch.Tensor:
        return decode_image(value, self.image_size)

    def _decode_audio(self, value: Any) -> torch.Tensor:
        return decode_audio(value, self.sample_rate)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.ds[int(index)]
        mods: dict[str, Any] = {}
        for m, col in self.columns.items():
            value = row[col]
            kind = self.kinds[m]
            if value is None:
                mods[m] = None
                continue
            try:
                if kind == "image":
                    mods[m] = self._decode_image(value)
                elif kind == "waveform":
                    mods[m] = self._decode_audio(value)
                elif kind == "text":
                    mods[m] = str(value)
                else:
                    mods[m] = torch.as_tensor(np.asarray(value, dtype=np.float32))
            except ValueError as err:
                if self.on_error == "raise":
                    raise ValueError(f"{self.root} row {index}, column {col!r}: {err}") from err
                self.num_skipped += 1
                warnings.warn(f"{self.root} row {index}, column {col!r}: {err}; marked absent", MMViewsWarning, stacklevel=2)
                mods[m] = None
        labels = {name: row[col] for name, col in self.label_columns.items()}
        return {"index": int(index), "modalities": mods, "labels": labels}


@register_dataset("hf", "a HuggingFace dataset (save_to_disk, imagefolder, audiofolder, Parquet shards, streamed) "
                        "with a column mapping", options_from=[HFDataset, "mmviews.data.streaming:ShardSource"])
def _build_hf(root: Any = None, split: str = "train", streaming: bool = False, **options: Any) -> Dataset:
    """``format="parquet"`` (or ``"auto"`` on a folder of ``<split>/*.parquet``, or a URL) reads Parquet
    shards (:mod:`mmviews.data.streaming`), streamed with ``streaming=True``; the other formats
    are map-style only."""
    from mmviews.data.streaming import ParquetShardDataset, ShardStream, is_shard_folder

    if root is None:
        raise dataset_error(ValueError, "hf: pass root= a local dataset folder (see data_cards/hf.md)", "root")
    fmt = options.get("format", "auto")
    if fmt == "parquet" or (fmt == "auto" and ("://" in str(root) or is_shard_folder(root))):
        options.pop("format", None)
        return ShardStream(root, split, **options) if streaming else ParquetShardDataset(root, split, **options)
    if streaming:
        raise ValueError(f"{root}: data.streaming reads Parquet shard folders; write this dataset as shards first "
                         f"(`mmviews prepare hf {root} --format parquet`) and point data.root at them")
    return HFDataset(root, split=split, **options)
