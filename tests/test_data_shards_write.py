"""Writing Parquet shards is temp + rename: a writer that fails in the middle of a shard leaves no
file under a shard's name (nothing a reader would take for a shard), and a rerun completes the
folder (issue 27: shard writing without temp + rename was untested)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mutations import apply_break
from test_data_pickle import mmsa_split, write
from test_data_shards import as_list, prepare

from mmviews.data import build_dataset
from mmviews.data.streaming import StreamLoader

ROWS = 30  # --shard-rows 12: shards of 12, 12 and 6 rows


def _prepare(pkl: Path, out: Path):
    return prepare("mosi", str(pkl), "--format", "parquet", "--shard-rows", "12", "--output", str(out), "--splits", "train")


def check_failed_write_leaves_no_partial_shard(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second shard's write stops half-way (its first bytes on disk, then an OSError); the guard:
    the half-written file is under the temporary name only, the record lists the first shard only,
    a reader sees the 12 rows of that shard, and a rerun writes the rest and removes the leftover."""
    folder.mkdir()
    pkl, out = folder / "mosi.pkl", folder / "shards"
    write(pkl, {"train": mmsa_split(ROWS), "valid": mmsa_split(3), "test": mmsa_split(3)})
    write_table, calls = pq.write_table, []

    def fail_mid_shard(table: pa.Table, where: str, *args, **kwargs) -> None:
        calls.append(where)
        if len(calls) != 2:
            return write_table(table, where, *args, **kwargs)
        whole = pa.BufferOutputStream()
        write_table(table, whole, row_group_size=4)
        data = whole.getvalue().to_pybytes()
        Path(where).write_bytes(data[: len(data) // 2])  # the first row groups, no footer
        raise OSError(f"{where}: no space left on device (injected)")

    monkeypatch.setattr(pq, "write_table", fail_mid_shard)
    failed = _prepare(pkl, out)
    monkeypatch.setattr(pq, "write_table", write_table)
    assert failed.returncode == 2 and "no space left on device (injected)" in failed.stdout + failed.stderr
    left = sorted(p.name for p in (out / "train").iterdir())
    assert left == ["train-00000.parquet", "train-00001.parquet.mmviews-tmp"], left
    with pytest.raises(pa.ArrowInvalid):
        pq.ParquetFile(out / "train" / "train-00001.parquet.mmviews-tmp")  # it really is a partial shard
    record = json.loads((out / "mmviews_shards.json").read_text())["splits"]["train"]
    assert [s["file"] for s in record["shards"]] == ["train-00000.parquet"] and not record["complete"]
    stream = build_dataset("hf", root=str(out), split="train", streaming=True)
    assert len(stream) == 12 and stream.num_skipped_shards == 0  # nothing damaged to skip: the reader sees one shard
    first = (out / "train" / "train-00000.parquet").stat().st_mtime_ns

    rerun = _prepare(pkl, out)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert sorted(p.name for p in (out / "train").iterdir()) == [f"train-{i:05d}.parquet" for i in range(3)]
    assert (out / "train" / "train-00000.parquet").stat().st_mtime_ns == first  # kept, not rewritten
    stream = build_dataset("hf", root=str(out), split="train", streaming=True)
    assert stream.shards.rows == [12, 12, 6]
    seen = [s["index"] for b in StreamLoader(stream, 7, as_list, drop_last=False) for s in b]
    assert sorted(seen) == list(range(ROWS))


def test_a_shard_failing_mid_write_leaves_no_partial_shard_and_a_rerun_completes(tmp_path, monkeypatch):
    check_failed_write_leaves_no_partial_shard(tmp_path / "w", monkeypatch)


def test_partial_shard_check_fails_when_shards_are_written_in_place(tmp_path, monkeypatch):
    """Mutation test (tests/README.md): shards written under their final name (no temporary name)."""
    apply_break("write_shards_in_place", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="train-00001.parquet"):
        check_failed_write_leaves_no_partial_shard(tmp_path / "w", monkeypatch)
