"""Sharded Parquet datasets: ``mmviews prepare DATASET ROOT --format parquet`` writes them.

Corpora of millions of clips are better kept as a few hundred shards than as millions of small
files, and a folder HuggingFace ``datasets`` reads as it is can be streamed from any fsspec URL.
:func:`write_shards` writes any source mmviews reads (video folders through their prepared store,
sentiment pickles, ``hf`` folders) as one row per sample with the encoded bytes or arrays of each
modality and ``mmviews_index`` (so streamed and map-style runs draw the same augmentations), a
record of the shards written (``mmviews_shards.json``) and a dataset card. Writing is resumable
(temporary file, rename, record) and never deletes what its record does not list.
:mod:`mmviews.data.streaming` reads the shards back. The layout, the columns of each source and
the options are in ``data_cards/parquet-shards.md``.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mmviews.fileio import atomic_write_text, read_json_object

SHARDS_KIND = "mmviews-parquet-shards"
SHARDS_VERSION = 1
SHARDS_META = "mmviews_shards.json"
INDEX_COLUMN = "mmviews_index"
TMP_SUFFIX = ".mmviews-tmp"
AUDIO_RATE = 16000
# Rows of a shard are written in row groups of about this many encoded bytes: the unit a reader
# loads at once, and what on_error: skip leaves out when a block of the file is damaged.
ROW_GROUP_BYTES = 32 * 1024 * 1024


def default_shards_path(root: str | os.PathLike[str]) -> Path:
    """Where ``mmviews prepare ... --format parquet`` writes by default: ``<root>-parquet`` beside ROOT."""
    root = Path(root)
    return root.with_name(root.name + "-parquet")


def read_shards_meta(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The folder's ``mmviews_shards.json``, or None when it has none (a foreign Parquet folder)."""
    path = Path(folder) / SHARDS_META
    if not path.is_file():
        return None
    meta = read_json_object(path)
    if meta.get("kind") != SHARDS_KIND:
        raise ValueError(f"{path}: not a mmviews shard record (kind {meta.get('kind')!r}, expected {SHARDS_KIND!r})")
    if meta.get("version") != SHARDS_VERSION:
        raise ValueError(f"{path}: shard format version {meta.get('version')}, this mmviews reads {SHARDS_VERSION}")
    return meta


def flac_bytes(wav: np.ndarray, sample_rate: int) -> bytes:
    """Mono float32 ``[T]`` as FLAC bytes, 24-bit (quantisation error below 1.2e-7 of full scale)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.clip(np.asarray(wav, dtype=np.float32), -1.0, 1.0), sample_rate, format="FLAC", subtype="PCM_24")
    return buf.getvalue()


class SplitRows:
    """One split of a source: ``count`` samples, ``row(i)`` the Parquet row of sample ``i`` (None
    when the sample cannot be stored, e.g. a clip the store could not decode), ``features`` the
    ``datasets.Features`` of the rows."""

    def __init__(self, count: int, row: Callable[[int], dict[str, Any] | None], features: Any,
                 shapes: dict[str, list[int | None]] | None = None) -> None:
        self.count, self.row, self.features = count, row, features
        # {column: per-sample shape, None where it varies} of numeric array columns (hf sources):
        # recorded in mmviews_shards.json, checked by the readers.
        self.shapes = dict(shapes or {})


# --------------------------------------------------------------------------- sources


def video_split_rows(root: Path, split: str, fold: int, store: Any, *, dataset: str | None = None,
                     splits_dir: str | Path | None = None) -> SplitRows:
    """Rows of a video folder's split from its prepared store (JPEG frames and flow, copied).
    ``dataset`` (``ucf101``/``hmdb51``) makes it read only that dataset's split lists, from
    ``splits_dir`` when given (as ``prepare --splits-dir``)."""
    import datasets

    from mmviews.data.video import VideoFolder
    from mmviews.data.video_io import read_audio_track

    folder = VideoFolder(root, split=split, dataset=dataset, fold=fold, splits_dir=splits_dir, audio=False, store=False)
    features = datasets.Features({
        INDEX_COLUMN: datasets.Value("int64"), "id": datasets.Value("string"), "class": datasets.Value("int64"),
        "fps": datasets.Value("float32"), "frames": datasets.Sequence(datasets.Value("binary")),
        "flow_x": datasets.Sequence(datasets.Value("binary")), "flow_y": datasets.Sequence(datasets.Value("binary")),
        "audio": datasets.Value("binary"),
    })

    def row(i: int) -> dict[str, Any] | None:
        cls, rel = folder.clips[i]
        entry = store.clips.get(rel)
        if entry is None:
            return None  # failed in the store (reported by prepare)
        if entry["format"] != "jpeg":
            raise ValueError(f"{store.path}: Parquet shards copy the store's JPEG files; this store holds {entry['format']} "
                             "arrays (prepare the store with --format jpeg first)")
        d = store.folder(entry)
        frames = [(d / f"img_{k:05d}.jpg").read_bytes() for k in range(1, int(entry["frames"]) + 1)]
        flows = int(entry.get("flows", 0))
        flow_x = [(d / f"flow_x_{k:05d}.jpg").read_bytes() for k in range(1, flows + 1)]
        flow_y = [(d / f"flow_y_{k:05d}.jpg").read_bytes() for k in range(1, flows + 1)]
        track = read_audio_track(root / rel, AUDIO_RATE) if (root / rel).is_file() else None
        audio = flac_bytes(track, AUDIO_RATE) if track is not None and track.size else None
        return {INDEX_COLUMN: i, "id": rel, "class": folder.class_to_index[cls], "fps": float(entry["fps"]),
                "frames": frames, "flow_x": flow_x, "flow_y": flow_y, "audio": audio}

    return SplitRows(len(folder), row, features)


def sentiment_split_rows(dataset: Any) -> SplitRows:
    """Rows of a :class:`~mmviews.data.sentiment.SentimentStoreDataset` split."""
    import datasets

    info = dataset.modality_info()
    cols: dict[str, Any] = {INDEX_COLUMN: datasets.Value("int64"), "id": datasets.Value("string")}
    for m, i in info.items():
        if i["kind"] == "sequence":
            cols[m] = datasets.Array2D(shape=(None, int(i["shape"][1])), dtype="float32")
        elif i["kind"] == "tokens":
            cols[m] = datasets.Sequence(datasets.Value("int64"))
        else:
            cols[m] = datasets.Value("string")
    first = dataset[0]["labels"]
    for k in first:
        cols[k] = datasets.Value("int64") if k == "class" else datasets.Value("float32")

    def row(i: int) -> dict[str, Any]:
        s = dataset[i]
        out: dict[str, Any] = {INDEX_COLUMN: i, "id": str(s["id"])}
        for m, v in s["modalities"].items():
            if v is None and info[m]["kind"] == "sequence":
                # datasets reads a null Array2D back as NaN: an absent sequence is stored with 0 steps.
                out[m] = np.zeros((0, int(info[m]["shape"][1])), np.float32)
            elif v is None:
                out[m] = None
            elif info[m]["kind"] == "tokens":
                out[m] = v["input_ids"].tolist()
            elif isinstance(v, str):
                out[m] = v
            else:
                out[m] = v.numpy()
        out.update(s["labels"])
        return out

    return SplitRows(len(dataset), row, datasets.Features(cols))


def array_feature(feature: Any, column: str) -> tuple[Any, list[int | None]]:
    """The float32 ``datasets`` feature that stores a numeric column of an hf source with its shape,
    and that per-sample shape (``None`` for a dimension that varies between rows).

    Nested lists (``List(List(Value))``, the ``Array2D``..``Array5D`` of the source as lists with
    their fixed lengths) rather than ``Array2D``: those cannot hold a null (an absent value)."""
    import datasets

    if isinstance(feature, (datasets.Array2D, datasets.Array3D, datasets.Array4D, datasets.Array5D)):
        shape = [None if d is None else int(d) for d in feature.shape]
        stored: Any = datasets.Value("float32")
        for d in reversed(shape):
            stored = datasets.List(stored, length=-1 if d is None else d)
        return stored, shape
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        inner, shape = array_feature(feature.feature, column)
        length = getattr(feature, "length", -1)
        return datasets.List(inner, length=length), [None if length in (None, -1) else int(length), *shape]
    if isinstance(feature, datasets.Value) and feature.dtype not in ("string", "large_string", "binary", "large_binary"):
        return datasets.Value("float32"), []
    raise ValueError(f"column {column!r}: cannot store {feature} as a numeric array; map it to an image, audio or "
                     "text column, or leave it out of --columns")


def hf_split_rows(dataset: Any) -> SplitRows:
    """Rows of a :class:`~mmviews.data.hf.HFDataset` split: images and audio as their encoded bytes,
    numeric columns as float32 arrays of their shape (:func:`array_feature`)."""
    import datasets

    feats = dataset.ds.features
    cols: dict[str, Any] = {INDEX_COLUMN: datasets.Value("int64")}
    shapes: dict[str, list[int | None]] = {}
    for m, col in dataset.columns.items():
        kind = dataset.kinds[m]
        if kind == "array":
            cols[col], shapes[col] = array_feature(feats[col], col)
        else:
            cols[col] = {"image": datasets.Image(), "waveform": datasets.Value("binary"),
                         "text": datasets.Value("string")}[kind]
    for col in dataset.label_columns.values():
        cols[col] = feats[col]

    def encoded(value: Any, kind: str) -> Any:
        if value is None:
            return None
        if kind == "image":
            if isinstance(value, dict) and not value.get("bytes") and value.get("path"):
                return {"bytes": Path(value["path"]).read_bytes(), "path": Path(value["path"]).name}
            return value
        if kind == "waveform":
            if isinstance(value, dict) and "array" in value:
                return flac_bytes(np.asarray(value["array"]), int(value.get("sampling_rate", AUDIO_RATE)))
            if isinstance(value, dict):
                return value["bytes"] if value.get("bytes") else Path(value["path"]).read_bytes()
            return value if isinstance(value, (bytes, bytearray)) else Path(str(value)).read_bytes()
        if kind == "text":
            return str(value)
        return np.asarray(value, dtype=np.float32)  # its shape kept: checked against the column's in row()

    def row(i: int) -> dict[str, Any]:
        raw = dataset.ds[i]
        out: dict[str, Any] = {INDEX_COLUMN: i}
        for m, col in dataset.columns.items():
            value = encoded(raw[col], dataset.kinds[m])
            if isinstance(value, np.ndarray):
                if not shape_fits(value.shape, shapes[col]):
                    raise ValueError(f"{dataset.root} row {i}, column {col!r}: shape {list(value.shape)} differs from "
                                     f"the column's {shape_text(shapes[col])}")
                value = value.tolist()
            out[col] = value
        for col in dataset.label_columns.values():
            out[col] = raw[col]
        return out

    return SplitRows(len(dataset), row, datasets.Features(cols), shapes)


def shape_fits(shape: Sequence[int], expected: Sequence[int | None]) -> bool:
    """``shape`` has the dimensions of ``expected`` (``None``: any length)."""
    return len(shape) == len(expected) and all(e is None or int(s) == e for s, e in zip(shape, expected))


def shape_text(shape: Sequence[int | None]) -> str:
    """``[None, 16]`` as ``[L, 16]`` (a varying dimension as a letter)."""
    return "[" + ", ".join("LMNOP"[k] if d is None else str(d) for k, d in enumerate(shape)) + "]"


# --------------------------------------------------------------------------- writer


def _clean_tmp(folder: Path) -> None:
    """Remove the temporary shard files a kill left behind (only ours: ``*.parquet.mmviews-tmp``)."""
    if folder.is_dir():
        for p in folder.glob(f"*.parquet{TMP_SUFFIX}"):
            p.unlink()


def write_shards(out: str | os.PathLike[str], splits: dict[str, SplitRows], *, source: dict[str, Any],
                 columns: dict[str, str], labels: dict[str, str], shard_size_mb: float = 256.0,
                 shard_rows: int | None = None, overwrite: bool = False, progress: bool = True,
                 shapes: dict[str, list[int | None]] | None = None) -> dict[str, Any]:
    """Write every split of ``splits`` to ``out/<split>/*.parquet`` (see ``data_cards/parquet-shards.md``).

    ``source``: ``{"dataset", "root", "kind" ("video", "sentiment" or "hf"), "options"}``, kept in the
    record so that a rerun with other options is refused instead of mixing two datasets;
    ``columns``: ``{column: kind}`` of the modality columns; ``labels``: ``{label name: column}``;
    ``shapes``: ``{column: per-sample shape}`` of the numeric array columns (hf sources), recorded
    so that the readers give the source's shapes back.
    A shard is closed when it reaches ``shard_size_mb`` or holds ``shard_rows`` rows (when given):
    equal shards split evenly between processes (see :mod:`mmviews.data.streaming`).
    Returns ``{"out", "splits": {split: {"rows", "shards", "skipped"}}, "written", "seconds"}``."""
    import datasets
    from tqdm.auto import tqdm

    if shard_size_mb <= 0:
        raise ValueError(f"--shard-size-mb must be > 0, got {shard_size_mb}")
    started = time.perf_counter()
    out = Path(out)
    meta = read_shards_meta(out) if out.exists() else None
    if out.exists() and meta is None and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a mmviews shard folder (no {SHARDS_META}); choose another --output")
    header = {"kind": SHARDS_KIND, "version": SHARDS_VERSION, "source": source, "columns": columns, "labels": dict(labels)}
    if shapes:  # only where there are array columns: the records of other sources stay as they were
        header["shapes"] = {col: list(shape) for col, shape in shapes.items()}
    if meta is not None and any(meta.get(k) != v for k, v in header.items()):
        if not overwrite:
            raise FileExistsError(f"{out} holds shards of another source or options ({SHARDS_META} differs); "
                                  "pass --overwrite to replace them, or choose another --output")
        for split, sm in meta.get("splits", {}).items():  # only the files our record lists
            for shard in sm["shards"]:
                (out / split / shard["file"]).unlink(missing_ok=True)
        meta = None
    if meta is None:
        meta = {**header, "splits": {}}
    out.mkdir(parents=True, exist_ok=True)
    limit = shard_size_mb * 1024 * 1024
    written = 0
    summary: dict[str, Any] = {}

    def save_meta() -> None:
        atomic_write_text(out / SHARDS_META, json.dumps(meta, indent=1))

    for split, rows in splits.items():
        folder = out / split
        folder.mkdir(exist_ok=True)
        _clean_tmp(folder)
        sm = meta["splits"].setdefault(split, {"rows": 0, "shards": [], "skipped": [], "complete": False})
        start = sm["shards"][-1]["last"] + 1 if sm["shards"] else 0
        if sm["skipped"]:
            start = max(start, max(sm["skipped"]) + 1)
        buffer: list[dict[str, Any]] = []
        size = 0

        def flush(last: int) -> None:
            nonlocal buffer, size, written
            if not buffer:
                return
            name = f"{split}-{len(sm['shards']):05d}.parquet"
            tmp = folder / (name + TMP_SUFFIX)
            import pyarrow.parquet as pq

            # datasets encodes the rows (its schema metadata keeps the features: Image(), Array2D...).
            group_rows = max(1, int(len(buffer) * ROW_GROUP_BYTES // max(size, 1)))
            pq.write_table(datasets.Dataset.from_list(buffer, features=rows.features).data.table, str(tmp),
                           row_group_size=group_rows)
            os.replace(tmp, folder / name)
            sm["shards"].append({"file": name, "rows": len(buffer), "first": buffer[0][INDEX_COLUMN], "last": last})
            sm["rows"] += len(buffer)
            written += len(buffer)
            save_meta()  # the progress record: a kill after this point keeps this shard
            buffer, size = [], 0

        for i in tqdm(range(start, rows.count), desc=f"{split} -> parquet", unit="sample", disable=not progress,
                      initial=start, total=rows.count):
            row = rows.row(i)
            if row is None:
                sm["skipped"].append(i)
                continue
            buffer.append(row)
            size += _row_bytes(row)
            if size >= limit or (shard_rows is not None and len(buffer) >= shard_rows):
                flush(i)
        flush(rows.count - 1)
        sm["complete"] = True
        save_meta()
        summary[split] = {"rows": sm["rows"], "shards": len(sm["shards"]), "skipped": len(sm["skipped"])}
    (out / "README.md").write_text(dataset_card(meta))
    return {"out": str(out), "splits": summary, "written": written, "seconds": round(time.perf_counter() - started, 2)}


def _row_bytes(row: dict[str, Any]) -> int:
    """Encoded size of a row, roughly (what the shard size limit counts)."""
    total = 0
    for v in row.values():
        if isinstance(v, (bytes, bytearray)):
            total += len(v)
        elif isinstance(v, np.ndarray):
            total += v.nbytes
        elif isinstance(v, dict) and isinstance(v.get("bytes"), (bytes, bytearray)):
            total += len(v["bytes"])
        elif isinstance(v, list):
            total += sum(len(x) if isinstance(x, (bytes, bytearray)) else 8 for x in v)
        elif isinstance(v, str):
            total += len(v)
        else:
            total += 8
    return total


KIND_TEXT = {
    "jpeg_frames": "list of JPEG images, every frame of the clip in order (RGB)",
    "flow_images": "list of grayscale JPEG images, one flow component per frame pair, uint8 = (f + 20) * 255 / 40",
    "flac_track": "the clip's whole audio track, FLAC 24-bit mono 16 kHz (null: no audio track)",
    "sequence": "float32 [len, D] feature sequence (valid steps only; null: absent)",
    "tokens": "int64 token ids",
    "text": "string",
    "image": "Image(): the original encoded image file",
    "waveform": "bytes of an audio file (WAV/FLAC; decode with soundfile)",
    "array": "float32 list",
}


def dataset_card(meta: dict[str, Any]) -> str:
    """The README.md of a shard folder."""
    src = meta["source"]
    lines = [f"# {src.get('dataset')} as Parquet shards", "",
             f"Written by `mmviews prepare {src.get('dataset')} ... --format parquet` from `{src.get('root')}`.",
             "One row per sample; `mmviews_index` is the sample's index in the source split.", "",
             "| column | content |", "|---|---|"]
    lines += [f"| `{c}` | {KIND_TEXT.get(k, k)} |" for c, k in meta["columns"].items()]
    lines += [f"| `{c}` | label `{name}` |" for name, c in meta["labels"].items()]
    lines += ["", "| split | rows | shards |", "|---|---|---|"]
    lines += [f"| {s} | {sm['rows']} | {len(sm['shards'])} |" for s, sm in meta["splits"].items()]
    lines += ["", "Read with mmviews (`data.name: hf`, `data.root: <this folder>`, `data.options.format: parquet`,",
              "`data.streaming: true` to stream) or with `datasets.load_dataset(\"parquet\", data_files=\"<split>/*.parquet\")`.",
              f"Options used: `{json.dumps(src.get('options', {}))}`.", ""]
    return "\n".join(lines)
