"""Parquet shards read row group by row group, so that damaged data is named or left out.

A shard whose footer is intact but whose data is damaged (a bad disk block, a truncated copy
patched up, a bit flip: ``OSError: Corrupt snappy compressed data``) fails only when the
damaged row group is read, deep inside ``datasets`` or ``pyarrow``, with a message that names
nothing. Here each row group is read on its own:

- ``on_error="raise"``: a ``ValueError`` of one line naming the shard, the row group, its rows
  and the reader's error, and how to go on (``data.options.on_error: skip``).
- ``on_error="skip"``: the row group is left out, warned about (same line), and recorded in
  :class:`SkippedRowGroups` (shard, row group, rows), which the run reports
  (``results.json``/``report.md``: ``data_skipped``).

The map-style reader (:func:`load_map_style`) keeps ``datasets.load_dataset("parquet")`` (fast,
memory-mapped) and only when it fails scans the row groups (:func:`find_damaged`) to name the
damaged ones; with ``skip`` it then builds the split from the readable row groups
(``Dataset.from_generator``, cached by the files' sizes and modification times). The streamed
reader (:func:`stream_rows`) reads every row group itself (``IterableDataset.from_generator``,
one shard per file as ``datasets``' Parquet reader, so shuffling and the split between processes
are unchanged).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from mmviews.notices import MMViewsWarning

# The records of the readers of this process, by token (a generator handed to ``datasets`` cannot
# carry an object that it would not copy): {token: SkippedRowGroups}.
_RECORDS: dict[str, "SkippedRowGroups"] = {}
_TOKENS = itertools.count()


@dataclass
class SkippedRowGroups:
    """The row groups left out (``on_error: skip``) by one split's reader, in this process."""

    row_groups: dict[tuple[str, int], int] = field(default_factory=dict)  # (shard, row group) -> rows

    @property
    def rows(self) -> int:
        return sum(self.row_groups.values())

    def add(self, shard: str, index: int, rows: int) -> None:
        self.row_groups[(shard, index)] = rows


def new_record() -> str:
    """A token for a reader's :class:`SkippedRowGroups` (see :func:`record`)."""
    token = f"row-groups-{next(_TOKENS)}"
    _RECORDS[token] = SkippedRowGroups()
    return token


def record(token: str) -> SkippedRowGroups:
    return _RECORDS.setdefault(token, SkippedRowGroups())


def _row_range(metadata: Any, index: int) -> tuple[int, int]:
    first = sum(metadata.row_group(k).num_rows for k in range(index))
    return first, first + metadata.row_group(index).num_rows


def damaged_message(shard: str, metadata: Any, index: int, error: BaseException) -> str:
    """One line: the shard, the row group and its rows, and the reader's error."""
    first, end = _row_range(metadata, index)
    reason = " ".join(f"{type(error).__name__}: {error}".split())
    return (f"{shard}: row group {index} of {metadata.num_row_groups} (rows {first}-{end - 1} of the shard) cannot be "
            f"read ({reason}); its data is damaged, or the storage failed while reading it")


def _raise_or_skip(shard: str, metadata: Any, index: int, error: BaseException, on_error: str, token: str | None) -> None:
    message = damaged_message(shard, metadata, index, error)
    if on_error == "raise":
        raise ValueError(message + ": write it again, or set data.options.on_error: skip to leave its rows out") from None
    if token is not None:
        record(token).add(shard, index, metadata.row_group(index).num_rows)
    warnings.warn(message + f"; its {metadata.row_group(index).num_rows} rows are left out (data.options.on_error: skip)",
                  MMViewsWarning, stacklevel=3)


# Errors of pyarrow reading damaged pages (OSError: "Corrupt snappy compressed data",
# "Couldn't deserialize thrift"; ArrowInvalid / ArrowException: bad lengths, bad encodings).
def _read_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (OSError, pa.ArrowException, ValueError, EOFError)


def stream_rows(files: list[str], on_error: str, token: str) -> Iterator[dict[str, Any]]:
    """The rows of ``files`` in order, row group by row group (the generator of the streamed
    reader: ``gen_kwargs={"files": [...]}`` makes each file one ``datasets`` shard)."""
    import fsspec
    import pyarrow.parquet as pq

    errors = _read_errors()
    for shard in files:
        with fsspec.open(shard, "rb") as f:
            parquet = pq.ParquetFile(f)
            for index in range(parquet.metadata.num_row_groups):
                try:
                    table = parquet.read_row_group(index)
                except errors as error:
                    _raise_or_skip(shard, parquet.metadata, index, error, on_error, token)
                    continue
                yield from table.to_pylist()


def find_damaged(files: Sequence[str]) -> list[tuple[str, Any, int, BaseException]]:
    """Every row group of ``files`` that cannot be read: ``(shard, metadata, index, error)``."""
    import fsspec
    import pyarrow.parquet as pq

    errors = _read_errors()
    found = []
    for shard in files:
        with fsspec.open(shard, "rb") as f:
            parquet = pq.ParquetFile(f)
            for index in range(parquet.metadata.num_row_groups):
                try:
                    parquet.read_row_group(index)
                except errors as error:
                    found.append((shard, parquet.metadata, index, error))
    return found


def _readable_rows(units: list[tuple[str, int]], stamps: tuple[Any, ...]) -> Iterator[dict[str, Any]]:
    """The rows of the row groups ``units`` [(shard, row group)] (map-style split with damaged row
    groups left out). ``stamps`` (sizes and modification times of the files) is only part of the
    ``datasets`` cache key: a shard written again is read again."""
    import fsspec
    import pyarrow.parquet as pq

    for shard, group in itertools.groupby(units, key=lambda unit: unit[0]):
        with fsspec.open(shard, "rb") as f:
            parquet = pq.ParquetFile(f)
            for _, index in group:
                yield from parquet.read_row_group(index).to_pylist()


def _stamps(files: Sequence[str]) -> tuple[Any, ...]:
    import fsspec

    out = []
    for shard in files:
        fs, path = fsspec.core.url_to_fs(shard)
        info = fs.info(path)
        out.append((shard, info.get("size"), str(info.get("mtime", info.get("LastModified", info.get("updated"))))))
    return tuple(out)


def load_map_style(files: list[str], split: str, features: Any, on_error: str, token: str) -> Any:
    """The split as a ``datasets.Dataset`` (see the module docstring)."""
    import datasets
    import fsspec
    import pyarrow.parquet as pq

    try:
        return datasets.load_dataset("parquet", data_files={split: files}, split=split)
    except Exception as error:  # datasets wraps pyarrow's error (DatasetGenerationError): find the damage
        damaged = find_damaged(files)
        if not damaged:
            raise
        if on_error == "raise":
            shard, metadata, index, first = damaged[0]
            more = f" (and {len(damaged) - 1} more damaged row groups)" if len(damaged) > 1 else ""
            raise ValueError(damaged_message(shard, metadata, index, first) + more + ": write it again, or set "
                             "data.options.on_error: skip to leave its rows out") from None
    for shard, metadata, index, error in damaged:
        _raise_or_skip(shard, metadata, index, error, on_error, token)
    bad = {(shard, index) for shard, _, index, _ in damaged}
    units = []
    for shard in files:
        with fsspec.open(shard, "rb") as f:
            groups = pq.ParquetFile(f).metadata.num_row_groups
        units += [(shard, index) for index in range(groups) if (shard, index) not in bad]
    if not units:
        raise ValueError(f"{Path(files[0]).parent}: split {split!r} has no readable row group (data.options.on_error: skip left "
                         f"out all {len(damaged)})")
    return datasets.Dataset.from_generator(_readable_rows, features=features,
                                           gen_kwargs={"units": units, "stamps": _stamps(files)}, split=split)
