"""Parquet shard folders read back as sample dicts: map-style, or streamed through ``datasets``.

``build_dataset("hf", root=FOLDER, format="parquet")`` reads a folder of ``<split>/*.parquet``
(written by ``mmviews prepare ... --format parquet``, :mod:`mmviews.data.shards`, or any writer of
that layout) into the same decoded tensors as the map-style source, so the views, augmentations
and collator are shared. With ``streaming=True`` (``data.streaming: true``) the split is a
:class:`ShardStream` read by :class:`StreamLoader`, which keeps what training needs from a stream:
a seeded, repeatable order, each row to one process, the same known number of steps on every
process (:func:`streamed_epoch_batches`, from the Parquet footers), an exact ``--resume`` and
damaged data named or counted. The rules, with their numbers, are in
``data_cards/parquet-shards.md`` ("Reading", "How a streamed epoch is formed", "Damaged data").
"""

from __future__ import annotations

import math
import os
import shlex
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mmviews.data import row_groups
from mmviews.data.decode import decode_audio, decode_flac, decode_image, decode_jpeg, window_flow
from mmviews.data.registry import dataset_error
from mmviews.data.shards import INDEX_COLUMN, SHARDS_META, read_shards_meta, shape_fits, shape_text
from mmviews.notices import MMViewsWarning

DEFAULT_SHUFFLE_BUFFER = 1000


def is_shard_folder(root: str | os.PathLike[str]) -> bool:
    """True for a folder written by ``mmviews prepare --format parquet`` or holding ``<split>/*.parquet``."""
    root = Path(root)
    return (root / SHARDS_META).is_file() or any(root.glob("*/*.parquet"))


def _is_url(root: str) -> bool:
    return "://" in str(root)


class ShardFiles:
    """The shard files of one split and their row counts (from the Parquet footers).

    ``root``: a local folder or an fsspec URL. A footer that cannot be read raises a ValueError
    naming the shard, or with ``on_error="skip"`` leaves the shard out (``skipped``)."""

    def __init__(self, root: str | os.PathLike[str], split: str, on_error: str = "raise") -> None:
        import fsspec
        import pyarrow.parquet as pq

        self.root = str(root)
        fs, base = fsspec.core.url_to_fs(self.root)
        pattern = f"{base.rstrip('/')}/{split}/*.parquet"
        found = sorted(fs.glob(pattern))
        if not found:
            splits = sorted({Path(p).parent.name for p in fs.glob(f"{base.rstrip('/')}/*/*.parquet")})
            raise KeyError(f"{self.root}: no split {split!r} (no {split}/*.parquet); available: {splits}")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.files: list[str] = []
        self.rows: list[int] = []
        self.skipped: list[str] = []
        for path in found:
            url = path if protocol in ("file", "local") else f"{protocol}://{path}"
            try:
                with fs.open(path, "rb") as f:
                    rows = pq.ParquetFile(f).metadata.num_rows
            except Exception as err:  # pyarrow raises ArrowInvalid / OSError for damaged files
                message = f"{url}: damaged Parquet shard ({type(err).__name__}: {err})".replace("\n", " ")
                if on_error == "raise":
                    raise ValueError(message + "; remove or rewrite it, or set data.options.on_error: skip") from None
                self.skipped.append(url)
                warnings.warn(message + "; skipped", MMViewsWarning, stacklevel=3)
                continue
            self.files.append(url)
            self.rows.append(int(rows))
        if not self.files:
            raise ValueError(f"{self.root}: split {split!r} has no readable shard")

    @property
    def total(self) -> int:
        return sum(self.rows)

    def min_rows_per_process(self, num_processes: int) -> int:
        """The fewest rows :func:`datasets.distributed.split_dataset_by_node` can give one of
        ``num_processes`` processes (see ``data_cards/parquet-shards.md``)."""
        if num_processes <= 1:
            return self.total
        if len(self.rows) % num_processes == 0:
            return sum(sorted(self.rows)[: len(self.rows) // num_processes])
        return self.total // num_processes


class RowDecoder:
    """Turns a raw Parquet row into the sample dict of the source (picklable: runs in loader workers)."""

    def __init__(self, root: str, kind: str, columns: Mapping[str, str], kinds: Mapping[str, str],
                 labels: Mapping[str, str], on_error: str = "raise", image_size: tuple[int, int] | None = None,
                 sample_rate: int = 16000, video: Mapping[str, Any] | None = None,
                 shapes: Mapping[str, tuple[Any, ...]] | None = None,
                 array_shapes: Mapping[str, Sequence[int | None]] | None = None) -> None:
        self.root, self.kind = root, kind
        self.columns, self.kinds, self.labels = dict(columns), dict(kinds), dict(labels)
        self.on_error, self.image_size, self.sample_rate = on_error, image_size, int(sample_rate)
        self.video = dict(video or {})
        self.shapes = dict(shapes or {})  # per-sample shapes of sequence columns (zero-filling absent ones)
        self.array_shapes = dict(array_shapes or {})  # recorded shapes of hf array columns (None: varies)
        self.num_skipped = 0

    def modality_info(self) -> dict[str, dict[str, Any]]:
        if self.kind == "video":
            v = self.video
            H, W = v["size"]
            info: dict[str, dict[str, Any]] = {"video": {"kind": "video", "shape": (v["num_frames"], 3, H, W)}}
            if v["flow"]:
                info["flow"] = {"kind": "flow", "shape": (v["num_frames"] - 1, 2, H, W)}
            if v["audio"]:
                info["audio"] = {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate}
            return info
        info = {}
        for m, k in self.kinds.items():
            if k == "image":
                info[m] = {"kind": "image"} | ({"shape": (3, *self.image_size)} if self.image_size else {})
            elif k == "waveform":
                info[m] = {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate}
            elif k in ("text",):
                info[m] = {"kind": "text"}
            elif k == "tokens":
                info[m] = {"kind": "tokens"}
            elif k == "sequence" and self.shapes.get(m):
                info[m] = {"kind": "sequence", "shape": self.shapes[m]}
        return info

    def _where(self, row: Mapping[str, Any], col: str) -> str:
        ident = f" (id {row['id']!r})" if "id" in row else ""
        return f"{self.root} row {INDEX_COLUMN}={row.get(INDEX_COLUMN)}{ident}, column {col!r}"

    def _fail(self, row: Mapping[str, Any], col: str, err: Exception) -> None:
        if self.on_error == "raise":
            raise ValueError(f"{self._where(row, col)}: {err}") from err
        self.num_skipped += 1
        warnings.warn(f"{self._where(row, col)}: {err}; marked absent", MMViewsWarning, stacklevel=3)

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        index = int(row[INDEX_COLUMN]) if INDEX_COLUMN in row else -1
        if self.kind == "video":
            mods = self._video(row)
        else:
            mods = {m: self._value(row, m, col) for m, col in self.columns.items()}
        sample = {"index": index, "modalities": mods, "labels": self._labels(row)}
        if "id" in row:
            sample["id"] = row["id"]
        return sample

    def _labels(self, row: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for name, col in self.labels.items():
            value = row[col]
            out[name] = int(value) if name.startswith("class") and value is not None else \
                (float(value) if isinstance(value, (float, np.floating)) else value)
        return out

    def _value(self, row: Mapping[str, Any], m: str, col: str) -> Any:
        value = row[col]
        if value is None:
            return None
        kind = self.kinds[m]
        try:
            if kind == "image":
                return decode_image(value, self.image_size)
            if kind == "waveform":
                return decode_audio(value, self.sample_rate)
            if kind == "text":
                return str(value)
            if kind == "tokens":
                ids = torch.as_tensor(np.asarray(value, dtype=np.int64))
                return {"input_ids": ids, "attention_mask": torch.ones(len(ids), dtype=torch.long)} if len(ids) else None
            arr = torch.as_tensor(np.asarray(value, dtype=np.float32))
            if kind == "sequence" and (arr.ndim != 2 or arr.shape[0] == 0):
                if arr.numel() == 0 or (arr.ndim == 0 and bool(arr.isnan())):  # 0 steps, or a null read back as NaN
                    return None
                raise ValueError(f"expected a [len, D] sequence, got shape {tuple(arr.shape)}")
            expected = self.array_shapes.get(m)
            if expected is not None and not shape_fits(arr.shape, expected):
                raise ValueError(f"shape {list(arr.shape)} differs from the column's {shape_text(expected)} "
                                 f"recorded in {SHARDS_META}")
            return arr
        except (ValueError, TypeError) as err:
            self._fail(row, col, err)
            return None

    def _video(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The modalities :class:`~mmviews.data.video.VideoFolder` gives for this clip from its store."""
        import cv2

        from mmviews.data.video import audio_window_start, clip_window, resize_flow, resize_frames

        v = self.video
        mods: dict[str, Any] = {"video": None}
        if v["flow"]:
            mods["flow"] = None
        if v["audio"]:
            mods["audio"] = None

        frames = row["frames"] or []
        fps = float(row["fps"])
        start_time = 0.0
        idx = clip_window(max(len(frames), 1), v["num_frames"])
        try:
            if not frames:
                raise ValueError("no frames")
            uniq, inverse = np.unique(idx, return_inverse=True)
            frames_np = np.stack([decode_jpeg(frames[i], gray=False) for i in uniq])[inverse]
            start_time = float(idx[0]) / fps
            video = torch.from_numpy(frames_np).permute(0, 3, 1, 2).float().div_(255.0)
            mods["video"] = resize_frames(video, v["size"]).clamp_(0, 1)
        except (ValueError, cv2.error) as err:
            self._fail(row, "frames", err)
        if v["flow"]:
            try:
                if not row["flow_x"]:
                    raise ValueError("the shards hold no flow (prepared with --flow none)")
                h, w = decode_jpeg(row["flow_x"][0], gray=True).shape

                def read(wanted: np.ndarray) -> np.ndarray:
                    return np.stack([np.stack([decode_jpeg(row["flow_x"][i], True), decode_jpeg(row["flow_y"][i], True)])
                                     for i in wanted])

                mods["flow"] = resize_flow(torch.from_numpy(window_flow(idx, h, w, read)), v["size"])
            except (ValueError, IndexError, cv2.error) as err:
                self._fail(row, "flow_x", err)
        if v["audio"] and row.get("audio"):
            try:
                track = decode_flac(row["audio"], self.sample_rate)
                first, n = audio_window_start(start_time, v["num_frames"], fps, v["max_audio_seconds"], self.sample_rate)
                s = max(0, min(len(track) - n, first))  # as read_audio_window: shifted to fit inside the track
                wav = track[s: s + n]
                if wav.size > 0:
                    mods["audio"] = torch.from_numpy(np.ascontiguousarray(wav))
            except ValueError as err:
                self._fail(row, "audio", err)
        return mods


def _infer_kinds(features: Any, columns: Mapping[str, str]) -> dict[str, str]:
    """Modality kinds of columns of a Parquet folder without a mmviews record (as HFDataset infers them)."""
    import datasets

    kinds = {}
    for m, col in columns.items():
        f = features[col]
        if isinstance(f, datasets.Image):
            kinds[m] = "image"
        elif isinstance(f, datasets.Audio) or m == "audio" or (isinstance(f, datasets.Value) and f.dtype in ("binary", "large_binary")):
            kinds[m] = "waveform"
        elif isinstance(f, datasets.Value) and f.dtype in ("string", "large_string"):
            kinds[m] = "text"
        else:
            kinds[m] = "array"
    return kinds


class ShardSource:
    """What both readers share: the split's shards, the column mapping and the row decoder."""

    def __init__(self, root: str | os.PathLike[str], split: str = "train", *, columns: Mapping[str, str] | None = None,
                 labels: Mapping[str, str] | None = None, image_size: int | tuple[int, int] | None = None,
                 sample_rate: int = 16000, on_error: str = "raise", num_frames: int = 8,
                 size: int | tuple[int, int] = 112, flow: str | None = None, audio: bool = True,
                 max_audio_seconds: float = 5.0, fold: int | None = None, check_rows: int = 2) -> None:
        import pyarrow.parquet as pq

        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.root, self.split = str(root), split
        if not _is_url(self.root) and not Path(self.root).exists():
            raise FileNotFoundError(f"no such shard folder: {self.root}")
        self.meta = read_shards_meta(self.root) if not _is_url(self.root) else None
        self.shards = ShardFiles(self.root, split, on_error)
        self.on_error = on_error
        self._skip_token = row_groups.new_record()  # the damaged row groups this reader leaves out
        import datasets
        import fsspec

        with fsspec.open(self.shards.files[0], "rb") as f:
            schema = pq.read_schema(f)
        self.features = datasets.Features.from_arrow_schema(schema)
        kind = self.meta["source"]["kind"] if self.meta else "hf"
        meta_kinds = dict(self.meta["columns"]) if self.meta else {}
        if kind == "video":
            if columns is not None:
                raise ValueError(f"{self.root}: shards of a video folder give the modalities video, flow and audio; "
                                 "use the options num_frames, size, flow, audio instead of columns")
            columns = {}
            kinds: dict[str, str] = {}
        else:
            if columns is None:
                columns = {c: c for c in meta_kinds} if meta_kinds else \
                    {m: m for m in ("image", "audio", "text") if m in self.features}
            for name, col in columns.items():
                if col not in self.features:
                    raise KeyError(f"{self.root}: split {split!r} has no column {col!r} (for {name!r}); columns: {sorted(self.features)}")
            if not columns:
                raise dataset_error(ValueError, f"{self.root}: no modality columns (no column is named image, audio or "
                                    f"text): name the columns to read, modality -> column (columns: {sorted(self.features)})",
                                    "columns")
            inferred = _infer_kinds(self.features, columns)
            kinds = {m: meta_kinds.get(col, inferred[m]) for m, col in columns.items()}
        if labels is None:
            if self.meta:
                labels = dict(self.meta["labels"])
            else:
                labels = {"class": "label"} if "label" in self.features else {}
        for name, col in labels.items():
            if col not in self.features:
                raise KeyError(f"{self.root}: split {split!r} has no column {col!r} (for label {name!r}); columns: {sorted(self.features)}")
        self.columns, self.label_columns, self.kinds = dict(columns), dict(labels), kinds
        self.image_columns = [col for m, col in columns.items() if isinstance(self.features[col], datasets.Image)]
        # datasets encodes and decodes Audio() values through torchcodec, which mmviews does not
        # require: such a column is read as what it stores, {bytes, path}, and decoded by mmviews.
        self.audio_columns = [col for col, f in self.features.items() if isinstance(f, datasets.Audio)]
        audio_storage = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
        self.features = datasets.Features({col: audio_storage if col in self.audio_columns else f
                                           for col, f in self.features.items()})
        size_t = (size, size) if isinstance(size, int) else tuple(size)
        image_t = (image_size, image_size) if isinstance(image_size, int) else image_size
        video = {"num_frames": int(num_frames), "size": size_t, "flow": flow is not None, "audio": bool(audio),
                 "max_audio_seconds": float(max_audio_seconds)} if kind == "video" else None
        written_fold = (self.meta or {}).get("source", {}).get("options", {}).get("fold")
        if fold is not None and fold != written_fold:  # a video recipe's data.options.fold
            raise ValueError(f"{self.root}: the shards hold the splits of fold {written_fold}, not fold {fold} "
                             f"(write them with `mmviews prepare ... --format parquet --fold {fold}`)")
        if kind == "video" and flow not in (None, "farneback"):
            raise ValueError(f"{self.root}: shards hold the store's Farneback flow: flow must be None or 'farneback', got {flow!r}")
        self.decoder = RowDecoder(self.root, kind, columns, kinds, labels, on_error, image_t, sample_rate, video,
                                  self._sequence_shapes(), array_shapes=self._array_shapes(kind))
        self._check(check_rows)

    def _array_shapes(self, kind: str) -> dict[str, list[int | None]]:
        """The shapes ``mmviews_shards.json`` records for the hf array columns read. Shards written
        before shapes were recorded stored every array flat (``[1, D]`` and ``[L, D]`` came back as
        ``[D]`` and ``[L * D]``, which failed late, in an adapter): refused here, naming the
        column and the command that writes them again."""
        if not self.meta or kind != "hf":
            return {}
        recorded = self.meta.get("shapes", {})
        out = {}
        for m, col in self.columns.items():
            if self.kinds[m] != "array":
                continue
            if col not in recorded:
                src = self.meta["source"]
                options = src.get("options", {})
                flags = "".join(f" --{key} " + shlex.quote(",".join(f"{k}={v}" for k, v in options[key].items()))
                                for key in ("columns", "labels") if options.get(key))
                raise ValueError(f"{self.root}: column {col!r} was written flat, without its shape, by an older mmviews "
                                 "([1, D] and [L, D] arrays would come back as [D] and [L*D]); write the shards again: "
                                 f"mmviews prepare hf {shlex.quote(str(src.get('root')))}{flags} --format parquet "
                                 f"--output {shlex.quote(self.root)} --overwrite")
            out[m] = recorded[col]
        return out

    def _sequence_shapes(self) -> dict[str, tuple[Any, ...]]:
        import datasets

        out = {}
        for m, col in self.columns.items():
            f = self.features[col]
            if isinstance(f, datasets.Array2D):
                out[m] = (None, f.shape[1])
        return out

    def _check(self, rows: int) -> None:
        """Decode the first ``rows`` rows of the first shard, every modality column: a bad column
        fails here (named), before any training work."""
        if rows <= 0:
            return
        for row in self._rows(self.shards.files[:1]).take(rows):
            self.decoder(row)

    def _rows(self, files: Sequence[str]) -> Any:
        """``files`` as a ``datasets.IterableDataset`` of raw rows (images left encoded), read row
        group by row group: a damaged one is named or left out (:mod:`mmviews.data.row_groups`)."""
        import datasets

        ds = datasets.IterableDataset.from_generator(
            row_groups.stream_rows, features=self.features, split=self.split,
            gen_kwargs={"files": list(files), "on_error": self.on_error, "token": self._skip_token})
        for col in self.image_columns:
            ds = ds.cast_column(col, datasets.Image(decode=False))
        return ds

    @property
    def num_skipped_shards(self) -> int:
        return len(self.shards.skipped)

    @property
    def skipped_row_groups(self) -> row_groups.SkippedRowGroups:
        """The damaged row groups left out so far in this process (``on_error: skip``)."""
        return row_groups.record(self._skip_token)

    def skipped_data(self) -> dict[str, Any]:
        """What this process has left out of the split so far: damaged shards and row groups (by
        name) and their rows, and values that could not be decoded (marked absent)."""
        groups = self.skipped_row_groups.row_groups
        return {"shards": list(self.shards.skipped),
                "row_groups": {f"{shard}#{index}": rows for (shard, index), rows in groups.items()},
                "rows_in_skipped_row_groups": sum(groups.values()), "values_marked_absent": self.num_skipped}

    @property
    def num_skipped(self) -> int:
        return self.decoder.num_skipped

    def modality_info(self) -> dict[str, dict[str, Any]]:
        return self.decoder.modality_info()


class ParquetShardDataset(ShardSource, Dataset):
    """A split of a shard folder, map-style (``datasets.load_dataset("parquet")``, memory-mapped)."""

    def __init__(self, root: str | os.PathLike[str], split: str = "train", **options: Any) -> None:
        import datasets

        ShardSource.__init__(self, root, split, **options)
        # A shard of 0 rows holds nothing, and datasets' Parquet reader fails on it (its batch size
        # comes from the row groups): it is left out, as it adds nothing to a stream.
        files = [f for f, rows in zip(self.shards.files, self.shards.rows) if rows > 0]
        if files:
            ds = row_groups.load_map_style(files, split, self.features, self.on_error, self._skip_token)
        else:
            ds = datasets.Dataset.from_dict({col: [] for col in self.features}, features=self.features, split=split)
        for col in self.image_columns:
            ds = ds.cast_column(col, datasets.Image(decode=False))
        for col in self.audio_columns:
            ds = ds.cast_column(col, datasets.Audio(decode=False))
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.decoder(self.ds[int(index)])


class ShardStream(ShardSource):
    """A split of a shard folder, streamed (see ``data_cards/parquet-shards.md``). ``len()`` is the number
    of rows of the readable shards (from their footers); iterate with :class:`StreamLoader`."""

    streamed = True
    _all_rows: Any = None

    def __len__(self) -> int:
        return self.shards.total

    def iterable(self, *, seed: int, epoch: int, shuffle_buffer: int, rank: int = 0, world: int = 1) -> Any:
        """The ``datasets.IterableDataset`` of rows for process ``rank`` of ``world`` in ``epoch``."""
        from datasets.distributed import split_dataset_by_node

        if self._all_rows is None:  # building the IterableDataset resolves the files: once per split
            self._all_rows = self._rows(self.shards.files)
        ds = self._all_rows
        if shuffle_buffer > 0:
            ds = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)
        if world > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world)
        ds.set_epoch(epoch)
        return ds


def _keep_samples(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A collate function that keeps the sample dicts."""
    return samples


def first_samples(dataset: Any, count: int) -> list[dict[str, Any]]:
    """The first ``count`` samples of a split, decoded (fewer when the split is shorter).

    ``dataset[i]`` for a map-style split; a streamed split (:class:`ShardStream`) cannot be
    indexed: its first rows in shard order are read through the stream as training reads them,
    one unshuffled batch of a :class:`StreamLoader`. The checks use it (``mmviews train
    --check``'s measured batch, ``mmviews prepare hf --recipe``). A ``count`` of 0 gives ``[]``
    from either reader; a negative one is a ValueError."""
    if count < 0:
        raise ValueError(f"first_samples: count must be >= 0 samples, got {count}")
    if count == 0:  # a StreamLoader batch of 0 rows would never be full: it would read the whole split
        return []
    if getattr(dataset, "streamed", False):
        return next(iter(StreamLoader(dataset, count, _keep_samples, drop_last=False)), [])
    return [dataset[i] for i in range(min(count, len(dataset)))]


class _DecodeRows(Dataset):
    """The loader's "dataset": its indices are raw rows, decoded where the loader fetches them."""

    def __init__(self, decoder: RowDecoder) -> None:
        self.decoder = decoder

    def __getitem__(self, row: Any) -> dict[str, Any]:
        return self.decoder(row)

    def __getitems__(self, rows: list[Any]) -> list[dict[str, Any]]:
        return [self.decoder(r) for r in rows]


def streamed_epoch_batches(shards: ShardFiles, num_processes: int, batch_size: int) -> int:
    """Batches of ``batch_size`` rows that every one of ``num_processes`` processes draws per epoch:
    ``floor(R / batch_size)``, R the fewest rows any process can be given
    (:meth:`ShardFiles.min_rows_per_process`; see ``data_cards/parquet-shards.md``).

    The one epoch length of a streamed run: the loader stops there, and the trainer's batches per
    epoch, schedule, progress bar and ``results.json`` all take it from ``len(loader)``. Rounding
    down and taking the poorest process is what keeps every process at the same step count: one
    batch more and the process given R rows would end its epoch first while the others wait for
    it in a collective (a hang under DDP)."""
    return shards.min_rows_per_process(num_processes) // int(batch_size)


class _RawBatches:
    """Batches of raw rows drawn from a row iterator, recording the position after each batch.

    With a ``limit`` (training), a stream that ends before ``limit`` full batches (once refilled,
    see ``refill``) is an error naming ``where``: a process that stopped early would leave the
    others waiting for it."""

    def __init__(self, stream: Any, batch_size: int, limit: int | None, skip: int, positions: deque,
                 refill: Any = None, where: str = "") -> None:
        self.stream, self.rows = stream, iter(stream)
        self.batch_size, self.limit, self.skip, self.positions = batch_size, limit, skip, positions
        self.refill = refill  # () -> bool: may the epoch's rows be read again to fill its last batches
        self.error: Exception | None = None
        self.where = where

    def _take(self, count: int) -> list[Any]:
        batch: list[Any] = []
        for row in self.rows:
            batch.append(row)
            if len(batch) == count:
                break
        return batch

    def __iter__(self) -> Iterator[list[Any]]:
        try:
            yield from self._batches()
        except Exception as error:  # reading failed (a damaged row group, named): kept for the
            self.error = error  # consumer, so that the loader first ends its workers as at the end of an epoch

    def _batches(self) -> Iterator[list[Any]]:
        drawn = 0
        while self.limit is None or drawn < self.limit:
            batch = self._take(self.batch_size)
            if self.limit is not None and len(batch) < self.batch_size and self.refill is not None and self.refill():
                # Damaged row groups were left out (on_error: skip; counted): the epoch's first rows,
                # read again, fill its last batches, so that every process still runs the steps
                # the footers promised (the same on a resumed run: the damage is found again).
                self.rows, self.refill = iter(self.stream), None
                batch += self._take(self.batch_size - len(batch))
                if not batch:
                    raise ValueError("the streamed split has no readable row left: every row group read in this epoch "
                                     "was damaged and left out (on_error: skip)")
            if self.limit is not None and len(batch) < self.batch_size:
                raise ValueError(f"{self.where}: the stream ended after {drawn} full batches of {self.batch_size} rows "
                                 f"(and {len(batch)} rows), {self.limit} expected from the shards' row counts (shards changed "
                                 "since the run started, or too many rows left out as damaged); every process must run "
                                 "the same steps")
            if not batch:
                return
            drawn += 1
            self.positions.append((len(batch), self.stream.state_dict()))
            if drawn <= self.skip:  # resuming: these batches were trained on before the stop
                continue
            yield batch


# What a resumed stream must share with its checkpoint (state_dict key -> how a user sets it).
_RESUMED_STREAM_KEYS = {"shards": "its shard list", "world": "the number of processes", "seed": "key 'seed'",
                        "shuffle_buffer": "key 'data.shuffle_buffer'"}


class StreamLoader:
    """Batches of a :class:`ShardStream` for one process (see ``data_cards/parquet-shards.md``).

    ``batch_size``: rows per batch of this process (K / N in training). ``drop_last``: training
    (every process draws the same ``len(self)`` full batches per epoch); evaluation reads every
    row once (``drop_last=False``, no shuffling, every process the whole split). Batches are
    moved to ``device`` when one is set (:meth:`to`). ``state_dict()`` is JSON data."""

    streamed = True

    def __init__(self, stream: ShardStream, batch_size: int, collate_fn: Any, *, seed: int = 0,
                 shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER, rank: int = 0, world: int = 1, drop_last: bool = True,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        if shuffle_buffer < 0:
            raise ValueError(f"key 'data.shuffle_buffer': must be >= 0 rows, got {shuffle_buffer}")
        self.dataset, self.batch_size, self.collate_fn = stream, int(batch_size), collate_fn
        self.seed, self.shuffle_buffer, self.rank, self.world = int(seed), int(shuffle_buffer), int(rank), int(world)
        self.drop_last, self.num_workers, self.pin_memory = drop_last, int(num_workers), pin_memory
        self.epoch, self.device = 0, None
        self._skip = 0
        self.batches_in_epoch, self.rows_in_epoch = 0, 0
        self._hf_state: dict[str, Any] | None = None
        if drop_last:
            rows = stream.shards.min_rows_per_process(self.world)
            self.num_batches = streamed_epoch_batches(stream.shards, self.world, self.batch_size)
            if self.num_batches < 1:
                raise ValueError(f"{stream.root} [{stream.split}]: {rows} rows for the process given the fewest cannot "
                                 f"fill one batch of {self.batch_size} rows ({len(stream.shards.files)} shards, {self.world} processes)")

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_batches
        return math.ceil(len(self.dataset) / self.batch_size)

    def to(self, device: Any) -> "StreamLoader":
        self.device = device
        return self

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self._skip = 0
        self.epoch = int(epoch)

    def skip_batches(self, count: int) -> None:
        """Resume: the next iteration of this epoch starts after its first ``count`` batches."""
        self._skip = int(count)

    def state_dict(self) -> dict[str, Any]:
        """The position, as JSON data: epoch, batches and rows of it drawn so far, the shard list and
        the ``datasets`` stream state (kept for inspection: see ``data_cards/parquet-shards.md`` on resuming)."""
        return {"epoch": self.epoch, "batches": self.batches_in_epoch, "rows": self.rows_in_epoch, "rank": self.rank,
                "world": self.world, "seed": self.seed, "shuffle_buffer": self.shuffle_buffer,
                "shards": [Path(f).name for f in self.dataset.shards.files], "datasets_state": self._hf_state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; refuses a state of another shard list, seed, shuffle buffer or
        process count: the replay would draw other batches, so the resumed run would not be the
        uninterrupted one. The one-line error names what changed (the recipe key where there is one)."""
        mine = self.state_dict()
        for key, what in _RESUMED_STREAM_KEYS.items():
            if state.get(key) != mine[key]:
                raise ValueError(f"cannot resume the stream of {self.dataset.root} [{self.dataset.split}]: {what} "
                                 f"changed since the checkpoint ({state.get(key)!r} -> {mine[key]!r}); resume with "
                                 "the checkpoint's value, or start a new run")
        self.set_epoch(int(state["epoch"]))
        self.skip_batches(int(state["batches"]))

    def __iter__(self) -> Iterator[Any]:
        shuffle = self.shuffle_buffer if self.drop_last else 0
        world = self.world if self.drop_last else 1
        ds = self.dataset.iterable(seed=self.seed, epoch=self.epoch, shuffle_buffer=shuffle, rank=self.rank, world=world)
        positions: deque = deque()
        where = (f"{self.dataset.root} [{self.dataset.split}], process {self.rank} of {self.world}, "
                 f"epoch {self.epoch}")
        raw = _RawBatches(ds, self.batch_size, len(self) if self.drop_last else None, self._skip, positions,
                          refill=lambda: bool(self.dataset.skipped_row_groups.row_groups), where=where)
        self.batches_in_epoch, self.rows_in_epoch = 0, 0
        # The loader draws its workers' base seed from its own generator: from the global RNG, a
        # resumed run (a new iterator mid-epoch) would shift the training RNG stream (dropout).
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        loader = DataLoader(_DecodeRows(self.dataset.decoder), batch_sampler=raw, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory, generator=generator)
        skipped = self._skip
        batches = iter(loader)
        try:
            for batch in batches:
                # The loader runs ahead of the consumer: the position is that of the batch handed out.
                while skipped:
                    self.rows_in_epoch += positions.popleft()[0]
                    self.batches_in_epoch += 1
                    skipped -= 1
                rows, self._hf_state = positions.popleft()
                self.rows_in_epoch += rows
                self.batches_in_epoch += 1
                if self.device is not None:
                    batch = batch.to(self.device, non_blocking=self.pin_memory)
                yield batch
        finally:
            # A consumer that stops early (an error, max_steps) leaves the loader's workers running
            # until the iterator is freed: stop them now.
            stop_workers = getattr(batches, "_shutdown_workers", None)
            if stop_workers is not None:
                stop_workers()
        if raw.error is not None:
            raise raw.error
        self._skip = 0
