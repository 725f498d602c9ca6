"""A Parquet shard damaged in the middle of its data, footer intact (issue 28; the writer closes
row groups of ``ROW_GROUP_BYTES``, here a few rows, so that damage loses one row group): with
``on_error: raise`` one line naming the shard and the row group, exit status 2 (a streamed run
with a loader worker too); with ``on_error: skip`` the row group is left out, the streamed epoch
still has the steps its footers promised, and the run counts what it left out in its last lines,
``results.json`` and ``report.md``. Nothing is deleted or rewritten."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from crafted_files import cli, one_line_error
from mutations import apply_break
from test_data_shards import as_list, prepare

from mmviews.data import build_dataset, shards
from mmviews.data.streaming import StreamLoader

ROWS, D, GROUP = 32, 4, 4  # two shards of 16 rows; the first rewritten as 4 row groups of 4
BAD = 1  # the damaged row group: rows 4-7


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> dict:
    import datasets

    folder = tmp_path_factory.mktemp("damaged")
    rng = np.random.default_rng(0)
    feats = datasets.Features({"row": datasets.Array2D(shape=(1, D), dtype="float32"),
                               "label": datasets.ClassLabel(names=["a", "b"])})
    split = datasets.Dataset.from_dict({"row": [rng.standard_normal((1, D)).astype(np.float32) for _ in range(ROWS)],
                                        "label": [i % 2 for i in range(ROWS)]}, features=feats)
    datasets.DatasetDict({"train": split}).save_to_disk(str(folder / "src"))
    row_bytes = shards._row_bytes({shards.INDEX_COLUMN: 0, "row": [[0.0] * D], "label": 0})
    with pytest.MonkeyPatch.context() as patch:  # the writer closes a row group every GROUP rows
        patch.setattr(shards, "ROW_GROUP_BYTES", GROUP * row_bytes)
        r = prepare("hf", str(folder / "src"), "--format", "parquet", "--shard-rows", "16", "--columns", "row=row")
    assert r.returncode == 0, r.stdout + r.stderr
    shard = folder / "src-parquet" / "train" / "train-00000.parquet"
    metadata = pq.ParquetFile(shard).metadata
    assert metadata.num_row_groups == 4 and metadata.row_group(BAD).num_rows == GROUP
    data = bytearray(shard.read_bytes())
    group = metadata.row_group(BAD)
    (column,) = [group.column(k) for k in range(group.num_columns) if group.column(k).path_in_schema.startswith("row.")]
    start = column.data_page_offset
    for k in range(start + 8, start + 48):  # inside the row group's data: the footer stays intact
        data[k] ^= 0x5A
    shard.write_bytes(bytes(data))
    parquet = pq.ParquetFile(shard)
    assert parquet.metadata.num_rows == 16
    parquet.read_row_group(BAD + 1)
    with pytest.raises(OSError):  # what pyarrow says: it names neither the file nor the row group
        parquet.read_row_group(BAD)
    return {"shards": folder / "src-parquet", "shard": shard, "bytes": bytes(data)}


def recipe(folder: Path, shards: Path, on_error: str, streaming: bool = True, workers: int = 0) -> Path:
    raw = {"name": "damaged", "seed": 0, "cpu": True,
           "data": {"name": "hf", "root": str(shards), "streaming": streaming, "batch_size": 8, "num_workers": workers,
                    "shuffle_buffer": 8, "val_split": None, "test_split": None,
                    "options": {"columns": {"row": "row"}, "on_error": on_error}},
           "views": [{"modality": "row"}, {"modality": "row"}], "encoder": {"embed_dim": 8},
           "adapters": {"row": {"type": "mlp", "input_dim": D, "head": {"kind": "linear"}}},
           "objective": {"name": "mv_dhel"}, "optimisation": {"epochs": 2, "warmup_steps": 0},
           "evaluation": {"tasks": []}, "output": {"progress_bar": False, "checkpoint_every": 0}}
    path = folder / f"{on_error}-{streaming}-{workers}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_raise_names_the_shard_and_row_group(damaged):
    for streaming in (False, True):
        with pytest.raises(ValueError) as info:
            stream = build_dataset("hf", root=str(damaged["shards"]), split="train", streaming=streaming, check_rows=0)
            [b for b in StreamLoader(stream, 8, as_list)]  # streamed: found where the rows are read
        message = str(info.value)
        assert f"{damaged['shard']}: row group {BAD} of 4 (rows 4-7 of the shard) cannot be read" in message, message
        assert "data.options.on_error: skip" in message and "\n" not in message
    assert damaged["shard"].read_bytes() == damaged["bytes"]  # nothing rewritten or deleted


def test_skip_leaves_the_row_group_out_and_counts_it(damaged):
    with pytest.warns(UserWarning, match=f"row group {BAD} of 4 .*its {GROUP} rows are left out"):
        mapped = build_dataset("hf", root=str(damaged["shards"]), split="train", on_error="skip")
    assert len(mapped) == ROWS - GROUP
    assert [mapped[i]["index"] for i in range(len(mapped))] == [i for i in range(ROWS) if not 4 <= i < 8]
    expected = {f"{damaged['shard']}#{BAD}": GROUP}
    assert mapped.skipped_data()["row_groups"] == expected
    stream = build_dataset("hf", root=str(damaged["shards"]), split="train", streaming=True, on_error="skip")
    with pytest.warns(UserWarning, match=f"row group {BAD} of 4"):
        every = [s["index"] for b in StreamLoader(stream, 8, as_list, drop_last=False) for s in b]
    assert sorted(every) == [i for i in range(ROWS) if not 4 <= i < 8]
    assert stream.skipped_data()["row_groups"] == expected and stream.skipped_data()["rows_in_skipped_row_groups"] == GROUP
    # A training epoch keeps the length the footers promised (4 batches of 8): the epoch's first
    # rows, read again, fill the last batch.
    loader = StreamLoader(stream, 8, as_list, seed=1, shuffle_buffer=8)
    with pytest.warns(UserWarning, match=f"row group {BAD} of 4"):
        batches = [[s["index"] for s in b] for b in loader]
    assert len(loader) == 4 and [len(b) for b in batches] == [8, 8, 8, 8]
    drawn = [i for b in batches for i in b]
    assert not set(drawn) & set(range(4, 8)) and set(drawn) == set(every) and len(drawn) - len(set(drawn)) == GROUP


def test_streamed_run_stops_with_one_line_naming_the_row_group(damaged, tmp_path, capsys):
    """The rows are read while a loader worker decodes them (num_workers: 1): still one line, rc 2."""
    path = recipe(tmp_path, damaged["shards"], "raise", workers=1)
    rc, _, err = cli(capsys, "train", str(path), "--output", str(tmp_path / "run"))
    line = one_line_error(err)
    assert rc == 2 and f"{damaged['shard']}: row group {BAD} of 4" in line, err
    assert not (tmp_path / "run" / "results.json").exists()
    assert multiprocessing.active_children() == []  # the loader's worker was stopped with the error


def test_skipped_row_group_is_counted_in_the_run_record(damaged, tmp_path, capsys):
    path = recipe(tmp_path, damaged["shards"], "skip")
    with pytest.warns(UserWarning, match=f"row group {BAD} of 4"):
        rc, out, err = cli(capsys, "train", str(path), "--output", str(tmp_path / "run"))
    assert rc == 0, err
    summary = json.loads((tmp_path / "run" / "results.json").read_text())
    assert summary["steps"] == 2 * 4  # 2 epochs of the 4 batches the footers promised
    left = summary["data_skipped"]["train"]
    assert left["row_groups"] == {f"{damaged['shard']}#{BAD}": GROUP} and left["rows_in_skipped_row_groups"] == GROUP
    line = f"split 'train': 1 damaged row group(s), {GROUP} rows ({damaged['shard']}#{BAD})"
    assert f"data left out (data.options.on_error: skip): {line}" in out
    assert f"- {line}" in (tmp_path / "run" / "report.md").read_text()
    assert damaged["shard"].read_bytes() == damaged["bytes"]


def test_what_processes_left_out_is_merged_by_name():
    """Two processes reading every shard both meet the damaged row group: it counts once; values
    marked absent (each process decodes its own rows) add up."""
    from mmviews.data.loaders import merge_data_left_out

    first = {"train": {"shards": ["s2"], "row_groups": {"s0#1": 4}, "rows_in_skipped_row_groups": 4,
                       "values_marked_absent": 1}}
    second = {"train": {"shards": [], "row_groups": {"s0#1": 4, "s1#0": 6}, "rows_in_skipped_row_groups": 10,
                        "values_marked_absent": 2}, "test": {"values_marked_absent": 3}}
    assert merge_data_left_out([first, second]) == {
        "train": {"shards": ["s2"], "row_groups": {"s0#1": 4, "s1#0": 6}, "rows_in_skipped_row_groups": 10,
                  "values_marked_absent": 3},
        "test": {"values_marked_absent": 3}}


def test_row_group_check_fails_when_read_errors_are_not_caught(damaged, monkeypatch):
    """Mutation: with pyarrow's read errors let through, the damaged row group is no longer named
    (the guard above fails)."""
    test_raise_names_the_shard_and_row_group(damaged)
    apply_break("let_row_group_errors_through", monkeypatch.setattr)
    with pytest.raises((AssertionError, OSError)):
        test_raise_names_the_shard_and_row_group(damaged)
