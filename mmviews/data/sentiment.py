"""CMU-MOSI, CMU-MOSEI and CH-SIMS feature pickles: reading, checking, and a memory-mapped store.

Two layouts are read (``data_cards/mosi.md``, ``mosei.md`` and ``sims.md`` say where each comes from):

- **MMSA / M-SENA**: ``{"train"|"valid"|"test": {"text": (N, L, 768), "text_bert": (N, 3, L),
  "audio": (N, La, Da), "vision": (N, Lv, Dv), "audio_lengths", "vision_lengths" (unaligned
  files only), "regression_labels": (N,), ["regression_labels_T/A/V"], "raw_text", "id"}}``,
  features right-padded with zeros.
- **MulT / MultiBench**: ``{split: {"text", "audio", "vision", "labels": (N, 1, 1), "id"}}``,
  features **left**-padded with zeros and no length keys (lengths are recovered from the
  padding).

Pickles are only ever read through :func:`mmviews.data.safe_load_pickle`. Non-finite values
(MOSI/MOSEI audio has -inf) become 0 and are counted. :func:`convert_sentiment_pickle` writes
each split once as float32 ``.npy`` files that :class:`SentimentStoreDataset` opens with
``mmap_mode="r"``, so MOSEI's 20+ GB of float64 arrays never have to be in memory again.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from mmviews.data.registry import dataset_error, register_dataset
from mmviews.data.safe_pickle import safe_load_pickle
from mmviews.fileio import read_json_object
from mmviews.notices import MMViewsWarning

SPLITS = ("train", "valid", "test")
# Marks a store folder being written (``<store>.partial``): only such a folder is removed
# when a later conversion starts over.
_PARTIAL_MARKER = ".mmviews-partial"
_SPLIT_ALIASES = {"val": "valid", "dev": "valid", "validation": "valid"}
STORE_FORMAT = "mmviews-sentiment-store"
STORE_VERSION = 1

# Split sizes (train, valid, test) of the published files, from the data cards.
KNOWN_SPLIT_SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "mosi": {"mmsa": (1284, 229, 686)},
    "mosei": {"mmsa": (16326, 1871, 4659), "mult": (16265, 1869, 4643)},
    "sims": {"mmsa": (1368, 456, 457)},
}
# Feature dims (text, audio, vision) of the MMSA files.
KNOWN_DIMS: dict[str, tuple[int, int, int]] = {"mosi": (768, 5, 20), "mosei": (768, 74, 35), "sims": (768, 33, 709)}
SEQUENCE_MODALITIES = ("text", "audio", "vision")


class SplitSizeWarning(MMViewsWarning):
    """Split sizes differ from the published ones, or match the MulT/MultiBench variant."""


def _canon_split(name: str) -> str:
    return _SPLIT_ALIASES.get(name, name)


def detect_layout(data: Mapping[str, Any], source: str = "<pickle>") -> str:
    """``"mmsa"`` or ``"mult"`` from the keys of the first split."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a dict of splits at the top level, got {type(data).__name__}")
    splits = [k for k in data if _canon_split(str(k)) in SPLITS]
    if not splits:
        raise ValueError(f"{source}: no split found; expected top-level keys {SPLITS}, got {sorted(map(str, data))}")
    first = data[splits[0]]
    if not isinstance(first, Mapping):
        raise ValueError(f"{source}: split {splits[0]!r} is a {type(first).__name__}, expected a dict")
    if "regression_labels" in first or "text_bert" in first or "classification_labels" in first:
        return "mmsa"
    if "labels" in first:
        return "mult"
    raise ValueError(f"{source}: split {splits[0]!r} has neither 'regression_labels' (MMSA layout) nor 'labels' "
                     f"(MulT layout); keys: {sorted(first)}")


def check_split_sizes(dataset: str | None, sizes: Mapping[str, int], source: str = "<pickle>") -> str | None:
    """Compare ``{split: N}`` with the published sizes; returns the matching variant or None.

    Warns (SplitSizeWarning) when the sizes are the MulT/MultiBench variant (numbers are not
    comparable with papers using the MMSA split) or match no known variant.
    """
    if dataset is None or dataset not in KNOWN_SPLIT_SIZES:
        return None
    got = tuple(int(sizes.get(s, -1)) for s in SPLITS)
    for variant, expected in KNOWN_SPLIT_SIZES[dataset].items():
        if got == expected:
            if variant == "mult":
                warnings.warn(f"{source}: split sizes {got} are the MulT/MultiBench {dataset.upper()} split, not the "
                              f"MMSA one {KNOWN_SPLIT_SIZES[dataset]['mmsa']}: results are not comparable with papers "
                              "that use the MMSA split; say which split you report", SplitSizeWarning, stacklevel=2)
            return variant
    known = ", ".join(f"{v}: {e}" for v, e in KNOWN_SPLIT_SIZES[dataset].items())
    warnings.warn(f"{source}: split sizes (train, valid, test) = {got} match no published {dataset} file ({known}); "
                  "the copy may be incomplete or a different release", SplitSizeWarning, stacklevel=2)
    return None


def check_finite_labels(labels: Mapping[str, np.ndarray], where: str, ids: Sequence[Any] | None = None) -> None:
    """Raise ``ValueError`` naming the label, the row (and its id) of the first NaN/inf label:
    a non-finite target would otherwise surface much later as a probe's "non-finite value"."""
    for name, values in labels.items():
        finite = np.isfinite(np.asarray(values, dtype=np.float64))
        if not finite.all():
            row = int(np.argmin(finite))
            sample = f" (id {ids[row]!r})" if ids is not None and row < len(ids) else ""
            raise ValueError(f"{where}: label {name!r} is not finite ({float(values[row])}) at row {row}{sample}; "
                             f"{int((~finite).sum())} of {finite.size} labels are non-finite: fix or drop those samples")


def _lengths_from_left_padding(arr: np.ndarray) -> np.ndarray:
    """Valid steps of left-zero-padded ``(N, L, D)`` arrays: L minus the leading all-zero rows."""
    nonzero = np.any(arr != 0, axis=2)
    first = np.argmax(nonzero, axis=1)
    lengths = arr.shape[1] - first
    lengths[~nonzero.any(axis=1)] = 0
    return lengths.astype(np.int64)


def _normalise_split(raw: Mapping[str, Any], layout: str, source: str, split: str,
                     modalities: Sequence[str] = SEQUENCE_MODALITIES) -> dict[str, Any]:
    """Arrays of one split in a common form (no copies of the big arrays yet).

    Returns ``{"features": {m: (N, L, D) array}, "lengths": {m: (N,) int64}, "padding": "right"|"left",
    "labels": {name: (N,) float}, "text_ids": (N, 2, L) or None, "ids": list, "raw_text": list or None}``.
    """
    where = f"{source} [{split}]"

    def need(key: str) -> Any:
        if key not in raw:
            raise KeyError(f"{where}: missing key {key!r}; keys present: {sorted(raw)}")
        return raw[key]

    feats: dict[str, np.ndarray] = {}
    for m in modalities:
        arr = need(m)
        if not isinstance(arr, np.ndarray) or arr.ndim != 3:
            raise ValueError(f"{where}: {m!r} must be an array (N, L, D), got "
                             f"{getattr(arr, 'shape', type(arr).__name__)}")
        feats[m] = arr
    ns = {m: a.shape[0] for m, a in feats.items()}
    if len(set(ns.values())) != 1:
        raise ValueError(f"{where}: modalities disagree on the number of samples: {ns}")
    N = next(iter(ns.values()))

    labels: dict[str, np.ndarray] = {}
    if layout == "mmsa":
        key = "regression_labels" if "regression_labels" in raw else None
        if key is None:
            raise KeyError(f"{where}: missing key 'regression_labels'; keys present: {sorted(raw)}")
        labels["sentiment"] = np.asarray(raw[key], dtype=np.float64).reshape(-1)
        for suffix in ("T", "A", "V"):
            k = f"regression_labels_{suffix}"
            if k in raw:
                labels[f"sentiment_{suffix}"] = np.asarray(raw[k], dtype=np.float64).reshape(-1)
        if "classification_labels" in raw:
            labels["class_original"] = np.asarray(raw["classification_labels"], dtype=np.float64).reshape(-1)
    else:
        lab = np.asarray(need("labels"), dtype=np.float64)
        if lab.size != N:
            raise ValueError(f"{where}: 'labels' has shape {lab.shape}; expected one sentiment score per sample "
                             f"(N = {N}, e.g. (N, 1, 1))")
        labels["sentiment"] = lab.reshape(-1)
    for k, v in labels.items():
        if v.shape[0] != N:
            raise ValueError(f"{where}: label {k!r} has {v.shape[0]} entries but the features have {N} samples")
    check_finite_labels(labels, where, raw.get("id"))

    lengths: dict[str, np.ndarray] = {}
    text_ids = None
    if layout == "mmsa":
        padding = "right"
        if "text_bert" in raw:
            tb = np.asarray(raw["text_bert"])
            if tb.ndim != 3 or tb.shape[0] != N or tb.shape[1] < 2:
                raise ValueError(f"{where}: 'text_bert' must be (N, 3, L) with N = {N}, got {tb.shape}")
            text_ids = tb[:, :2, :]
            if "text" in feats:
                lengths["text"] = np.rint(tb[:, 1, :]).sum(axis=1).astype(np.int64)
        for m in feats:
            k = f"{m}_lengths"
            if k in raw:
                lens = np.asarray(raw[k]).reshape(-1)
                if lens.shape[0] != N:
                    raise ValueError(f"{where}: {k!r} has {lens.shape[0]} entries but {m!r} has {N} samples")
                lengths[m] = np.rint(lens).astype(np.int64)
            elif m not in lengths:
                lengths[m] = np.full(N, feats[m].shape[1], dtype=np.int64)
    else:
        padding = "left"
        for m, a in feats.items():
            lengths[m] = _lengths_from_left_padding(a)
    for m, lens in lengths.items():
        L = feats[m].shape[1]
        if lens.size and (lens.max() > L or lens.min() < 0):
            bad = int(np.argmax((lens > L) | (lens < 0)))
            raise ValueError(f"{where}: lengths of {m!r} disagree with the array: sample {bad} has length "
                             f"{int(lens[bad])} but {m!r} has {L} steps (shape {feats[m].shape})")

    # MulT ids are rows [video_id, start, end]; MMSA ids are "video_id$_$clip_id" strings.
    ids = [("_".join(str(v) for v in np.asarray(x).reshape(-1)) if np.ndim(x) else str(x)) for x in raw["id"]] \
        if "id" in raw else [str(i) for i in range(N)]
    if len(ids) != N:
        raise ValueError(f"{where}: 'id' has {len(ids)} entries but the features have {N} samples")
    raw_text = [str(x) for x in raw["raw_text"]] if "raw_text" in raw else None
    return {"features": feats, "lengths": lengths, "padding": padding, "labels": labels, "text_ids": text_ids,
            "ids": ids, "raw_text": raw_text, "num_samples": N}


def read_sentiment_pickle(path: str | os.PathLike[str], dataset: str | None = None, layout: str = "auto",
                          splits: Sequence[str] = SPLITS) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Load and validate a MOSI/MOSEI/SIMS pickle. Returns ``(info, {split: normalised split})``.

    ``info``: ``{"layout", "variant", "dataset", "sizes"}``. Raises KeyError naming a missing
    split or key, ValueError for inconsistent shapes or lengths.
    """
    source = str(path)
    data = safe_load_pickle(path)
    layout = detect_layout(data, source) if layout == "auto" else layout
    if layout not in ("mmsa", "mult"):
        raise dataset_error(ValueError, f"layout must be 'auto', 'mmsa' or 'mult', got {layout!r}", "layout")
    present = {_canon_split(str(k)): k for k in data}
    out: dict[str, dict[str, Any]] = {}
    for split in splits:
        split = _canon_split(split)
        if split not in present:
            raise dataset_error(KeyError, f"{source}: missing split {split!r}; splits present: {sorted(present)}", "split")
        out[split] = _normalise_split(data[present[split]], layout, source, split)
    sizes = {s: v["num_samples"] for s, v in out.items()}
    variant = check_split_sizes(dataset, sizes, source) if set(sizes) == set(SPLITS) else None
    if dataset in KNOWN_DIMS and layout == "mmsa":
        dims = tuple(out[next(iter(out))]["features"][m].shape[2] for m in SEQUENCE_MODALITIES)
        if dims != KNOWN_DIMS[dataset]:
            warnings.warn(f"{source}: feature dims (text, audio, vision) = {dims}, the card lists {KNOWN_DIMS[dataset]} "
                          f"for the MMSA {dataset} files (a different feature extraction?)", MMViewsWarning, stacklevel=2)
    return {"layout": layout, "variant": variant, "dataset": dataset, "sizes": sizes}, out


def _write_npy(path: Path, arr: np.ndarray, chunk: int = 512) -> int:
    """Write ``arr`` as float32 through a memory map in chunks of rows, its non-finite values
    set to 0; returns how many there were."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=arr.shape)
    bad = 0
    for s in range(0, arr.shape[0], chunk):
        block = np.asarray(arr[s : s + chunk], dtype=np.float64)
        finite = np.isfinite(block)
        if not finite.all():
            bad += int((~finite).sum())
            block = np.where(finite, block, 0.0)
        out[s : s + chunk] = block
    out.flush()
    del out
    return bad


def convert_sentiment_pickle(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dataset: str | None = None,
                             layout: str = "auto", overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Convert a MOSI/MOSEI/SIMS pickle once into a memory-mapped store directory.

    The store (``meta.json`` + ``<split>/<array>.npy``, float32 features) is written to a
    temporary directory and moved into place at the end, so an interrupted run leaves
    nothing half-written. Peak memory is the unpickled file (unavoidable with pickle) plus
    one chunk; the arrays are released split by split. Returns the store's metadata.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    check_replaceable_store(out_dir)
    info, splits = read_sentiment_pickle(path, dataset=dataset, layout=layout)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        if not (tmp / _PARTIAL_MARKER).is_file():
            raise FileExistsError(f"{tmp} exists and was not left by an interrupted conversion (no {_PARTIAL_MARKER}); "
                                  "mmviews does not delete it: move it away or choose another store folder")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / _PARTIAL_MARKER).write_text("an mmviews sentiment store being written\n")
    src = Path(path)
    meta: dict[str, Any] = {"format": STORE_FORMAT, "version": STORE_VERSION, "dataset": dataset,
                            "layout": info["layout"], "variant": info["variant"],
                            "source": {"path": str(src.resolve()), "size": src.stat().st_size,
                                       "mtime": src.stat().st_mtime},
                            "splits": {}}
    total = sum(len(s["features"]) for s in splits.values())
    bar = tqdm(total=total, desc=f"converting {src.name}", unit="array", disable=not progress)
    for split in list(splits):
        part = splits.pop(split)  # drop our reference so each split's arrays can be freed after use
        d = tmp / split
        d.mkdir()
        sm: dict[str, Any] = {"num_samples": part["num_samples"], "padding": part["padding"], "modalities": {},
                              "labels": sorted(part["labels"]), "has_text_ids": part["text_ids"] is not None,
                              "has_raw_text": part["raw_text"] is not None, "nonfinite_set_to_zero": {}}
        for m in list(part["features"]):
            arr = part["features"].pop(m)
            bad = _write_npy(d / f"{m}.npy", arr)
            np.save(d / f"{m}_lengths.npy", part["lengths"][m])
            sm["modalities"][m] = {"shape": list(arr.shape)}
            sm["nonfinite_set_to_zero"][m] = bad
            del arr
            bar.update(1)
        for k, v in part["labels"].items():
            np.save(d / f"label_{k}.npy", np.asarray(v, dtype=np.float32))
        if part["text_ids"] is not None:
            np.save(d / "text_ids.npy", np.rint(part["text_ids"]).astype(np.int64))
        (d / "ids.json").write_text(json.dumps(part["ids"]))
        if part["raw_text"] is not None:
            (d / "raw_text.json").write_text(json.dumps(part["raw_text"], ensure_ascii=False))
        meta["splits"][split] = sm
        del part
    bar.close()
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    (tmp / _PARTIAL_MARKER).unlink()
    if out_dir.exists():
        check_replaceable_store(out_dir)  # again: the folder may have changed during the conversion
        if out_dir.is_dir():
            shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return meta


def check_replaceable_store(out_dir: Path) -> None:
    """Raise ``FileExistsError`` naming ``out_dir`` unless it is absent, an empty folder, or a
    sentiment store (``meta.json`` of format ``mmviews-sentiment-store``): mmviews replaces only
    what it wrote."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a sentiment store: mmviews does not replace it; "
                              "choose another store folder (--out / data.options.store_dir)")
    if not any(out_dir.iterdir()):
        return
    meta = out_dir / "meta.json"
    try:
        ours = json.loads(meta.read_text()).get("format") == STORE_FORMAT if meta.is_file() else False
    except (ValueError, UnicodeDecodeError, AttributeError):
        ours = False
    if not ours:
        raise FileExistsError(f"{out_dir} is not empty and is not an mmviews sentiment store (no meta.json of format "
                              f"{STORE_FORMAT!r}): mmviews does not delete it; choose another store folder "
                              "(--out / data.options.store_dir)")


def read_store_meta(store: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(store) / "meta.json"
    if not p.is_file():
        raise FileNotFoundError(f"{store} is not a sentiment store (no meta.json); create it with "
                                "`mmviews prepare mosi PATH.pkl` or convert_sentiment_pickle()")
    meta = read_json_object(p)
    if meta.get("format") != STORE_FORMAT:
        raise ValueError(f"{p}: not a {STORE_FORMAT} (format = {meta.get('format')!r})")
    return meta


class SentimentStoreDataset(Dataset):
    """One split of a converted MOSI/MOSEI/SIMS store, read through memory maps.

    Items: ``{"index", "id", "modalities": {...}, "labels": {"sentiment": float, "class": int,
    ["sentiment_T"/"_A"/"_V"]}}`` with modalities among

    - ``"text"``, ``"audio"``, ``"vision"``: FloatTensor[len, D] (valid steps only; the
      collator pads and reports lengths). A sequence of length 0 is absent (None).
    - ``"text_ids"``: ``{"input_ids": LongTensor[len], "attention_mask": LongTensor[len]}``
      (MMSA files with ``text_bert``).
    - ``"raw_text"``: str.

    ``class`` follows the paper conventions of the data card: MOSI/MOSEI ``sentiment >= 0``
    (Has0, negative vs non-negative), SIMS ``sentiment > 0``.
    """

    def __init__(self, store: str | os.PathLike[str], split: str = "train",
                 modalities: Sequence[str] = SEQUENCE_MODALITIES, dataset: str | None = None) -> None:
        self.store = Path(store)
        self.meta = read_store_meta(self.store)
        prepared_as = self.meta.get("dataset")
        if dataset is not None and prepared_as is not None and dataset != prepared_as:
            # Each dataset checks its own card and has its own class rule: a store of another would
            # silently take that one's.
            raise dataset_error(ValueError, f"{self.store}: this store was prepared as {prepared_as!r} "
                                f"(mmviews prepare {prepared_as}), not {dataset!r}: open it as {prepared_as!r}, or "
                                f"prepare the copy again as {dataset!r}", "root")
        split = _canon_split(split)
        if split not in self.meta["splits"]:
            raise dataset_error(KeyError, f"{self.store}: no split {split!r}; available: {sorted(self.meta['splits'])}", "split")
        self.split = split
        self.smeta = self.meta["splits"][split]
        known = set(self.smeta["modalities"]) | ({"text_ids"} if self.smeta["has_text_ids"] else set()) | \
            ({"raw_text"} if self.smeta["has_raw_text"] else set())
        missing = [m for m in modalities if m not in known]
        if missing:
            raise dataset_error(KeyError, f"{self.store} [{split}]: modalities {missing} not in the store "
                                f"(available: {sorted(known)})", "modalities")
        self.modalities = tuple(modalities)
        self.dir = self.store / split
        self.num_samples = int(self.smeta["num_samples"])
        self.dataset = dataset or prepared_as
        # Stores written before labels were checked at conversion (or edited since) may hold NaN.
        check_finite_labels({k: np.load(self.dir / f"label_{k}.npy") for k in self.smeta["labels"]},
                            f"{self.store} [{split}]")
        self._arrays: dict[str, np.ndarray] | None = None  # opened lazily in each worker

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = None  # memmaps would be pickled as full copies into each worker
        return state

    def _open(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            arrays: dict[str, Any] = {}
            for m in self.smeta["modalities"]:
                arrays[m] = np.load(self.dir / f"{m}.npy", mmap_mode="r")
                arrays[f"{m}_lengths"] = np.load(self.dir / f"{m}_lengths.npy")
            for k in self.smeta["labels"]:
                arrays[f"label_{k}"] = np.load(self.dir / f"label_{k}.npy")
            if self.smeta["has_text_ids"]:
                arrays["text_ids"] = np.load(self.dir / "text_ids.npy", mmap_mode="r")
            arrays["ids"] = json.loads((self.dir / "ids.json").read_text())
            if self.smeta["has_raw_text"]:
                arrays["raw_text"] = json.loads((self.dir / "raw_text.json").read_text())
            self._arrays = arrays
        return self._arrays

    def modality_info(self) -> dict[str, dict[str, Any]]:
        info: dict[str, dict[str, Any]] = {}
        for m in self.modalities:
            if m in self.smeta["modalities"]:
                shape = self.smeta["modalities"][m]["shape"]
                info[m] = {"kind": "sequence", "shape": (shape[1], shape[2])}
            elif m == "text_ids":
                info[m] = {"kind": "tokens"}
            else:
                info[m] = {"kind": "text"}
        return info

    def labels(self, name: str = "sentiment") -> np.ndarray:
        """All labels of one kind as an array [N] (for evaluation)."""
        return np.asarray(self._open()[f"label_{name}"])

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples in {self.store} [{self.split}]")
        a = self._open()
        mods: dict[str, Any] = {}
        for m in self.modalities:
            if m in self.smeta["modalities"]:
                n = int(a[f"{m}_lengths"][index])
                arr = a[m][index]
                rows = arr[:n] if self.smeta["padding"] == "right" else arr[arr.shape[0] - n :]
                mods[m] = torch.from_numpy(np.array(rows, dtype=np.float32)) if n > 0 else None
            elif m == "text_ids":
                ids, att = a["text_ids"][index]
                n = int(att.sum())
                mods[m] = {"input_ids": torch.from_numpy(np.array(ids[:n])), "attention_mask": torch.ones(n, dtype=torch.long)} \
                    if n > 0 else None
            else:
                mods[m] = a["raw_text"][index]
        labels: dict[str, Any] = {k: float(a[f"label_{k}"][index]) for k in self.smeta["labels"]}
        s = labels["sentiment"]
        labels["class"] = int(s > 0) if self.dataset == "sims" else int(s >= 0)
        return {"index": index, "id": a["ids"][index], "modalities": mods, "labels": labels}


def open_sentiment(path: str | os.PathLike[str], split: str = "train", dataset: str | None = None,
                   store_dir: str | os.PathLike[str] | None = None, layout: str = "auto",
                   modalities: Sequence[str] = SEQUENCE_MODALITIES, progress: bool = False) -> SentimentStoreDataset:
    """A split of a MOSI/MOSEI/SIMS copy: a store directory, or a pickle converted once.

    For a pickle ``x.pkl`` the store goes to ``store_dir`` (default ``x.pkl.mmstore``) and is
    rebuilt only when the pickle's size or mtime changed, or when it was converted as another
    ``dataset`` (each dataset checks its own card and has its own ``class`` rule) or from another
    ``layout`` than one asked for (``auto`` takes the stored one). A store directory prepared as
    another dataset or layout is refused with one line naming both.
    """
    path = Path(path)
    if path.is_dir():
        stored = None if layout == "auto" else read_store_meta(path).get("layout")  # auto: whatever it holds
        if layout not in ("auto", stored):
            # A store folder keeps no link to a pickle it could be converted from again.
            raise dataset_error(ValueError, f"{path}: this store holds the {stored!r} layout of its pickle, not the "
                                f"{layout!r} asked for (option layout): open it with layout 'auto' or {stored!r}, "
                                f"or prepare the pickle again with --layout {layout}", "layout")
        return SentimentStoreDataset(path, split, modalities, dataset=dataset)
    if not path.exists():
        raise FileNotFoundError(f"no such file or store: {path}")
    store = Path(store_dir) if store_dir is not None else path.with_name(path.name + ".mmstore")
    stale = True
    if (store / "meta.json").is_file():
        meta = read_store_meta(store)
        src, st = meta["source"], path.stat()
        stale = not (src.get("size") == st.st_size and src.get("mtime") == st.st_mtime)
        # converted (by mmviews) for another dataset: converted again, checked against this one's card
        stale = stale or dataset not in (None, meta.get("dataset"))
        stale = stale or layout not in ("auto", meta.get("layout"))  # converted as another layout than asked
    if stale:
        convert_sentiment_pickle(path, store, dataset=dataset, layout=layout, overwrite=True, progress=progress)
    return SentimentStoreDataset(store, split, modalities, dataset=dataset)


def _build_sentiment(dataset: str, *, root: Any, split: str, **options: Any) -> Dataset:
    """``build_dataset``'s builder of one of the sentiment datasets (it always passes ``root`` and
    ``split``; a ``root`` of None is refused). A function of the module rather than a closure made
    at import, so that it runs (and is tested) as called."""
    if root is None:
        raise dataset_error(ValueError, f"{dataset}: pass root= the MMSA/MulT .pkl file or a store made by "
                            f"`mmviews prepare {dataset}` (see data_cards/{dataset}.md)", "root")
    return open_sentiment(root, split=split, dataset=dataset, **options)


for _name, _desc in (("mosi", "CMU-MOSI features (MMSA or MulT pickle, or a prepared store)"),
                     ("mosei", "CMU-MOSEI features (MMSA or MulT pickle, or a prepared store)"),
                     ("sims", "CH-SIMS features (MMSA pickle or a prepared store)")):
    register_dataset(_name, _desc, options_from=[open_sentiment])(functools.partial(_build_sentiment, _name))
