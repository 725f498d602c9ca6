"""Unit guards of the shard readers (:mod:`mmviews.data.streaming`): the shard list and
its row counts, the fewest rows a process is given and the streamed epoch length, the loader's
position (state_dict), a resume refused by the setting that changed, the short last batch of a
whole read (``--check``'s first samples, evaluation), a stream that ends early, the row decoder
(each column kind, labels, errors named by row and column) and the readers' one-line errors.

The shard folders are written once per module with :func:`mmviews.data.shards.write_shards` (no
reader code runs in the fixture, so each test below exercises the readers itself)."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mmviews.data import build_dataset
from mmviews.data.shards import INDEX_COLUMN, SHARDS_META, SplitRows, write_shards
from mmviews.data.streaming import (
    DEFAULT_SHUFFLE_BUFFER, ParquetShardDataset, RowDecoder, ShardFiles, ShardStream, StreamLoader, _DecodeRows,
    first_samples, is_shard_folder, streamed_epoch_batches)
from mmviews.notices import MMViewsWarning

TRAIN_SHARDS = [12, 12, 12, 2]  # the short last shard prepare writes
VALID_ROWS = 10  # shards of 4, 4 and 2


def vec_rows(count: int) -> SplitRows:
    import datasets

    features = datasets.Features({INDEX_COLUMN: datasets.Value("int64"), "id": datasets.Value("string"),
                                  "vec": datasets.List(datasets.Value("float32"), length=2),
                                  "label": datasets.Value("int64")})
    return SplitRows(count, lambda i: {INDEX_COLUMN: i, "id": f"r{i}", "vec": [float(i), -float(i)], "label": i % 3},
                     features, {"vec": [2]})


def write_folder(out: Path) -> Path:
    source = {"dataset": "hf", "root": "/src", "kind": "hf", "options": {"columns": {"vec": "vec"}}}
    for split, count, per_shard in (("train", sum(TRAIN_SHARDS), 12), ("valid", VALID_ROWS, 4)):
        write_shards(out, {split: vec_rows(count)}, source=source, columns={"vec": "array"},
                     labels={"class": "label"}, shard_rows=per_shard, progress=False, shapes={"vec": [2]})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("streaming") / "shards")


def as_list(batch: list) -> list:
    return batch


def indices(batch: list) -> list[int]:
    return [s["index"] for s in batch]


# --------------------------------------------------------------------------- shard files


def test_shard_files_and_row_counts(folder):
    files = ShardFiles(folder, "train")
    assert files.files == [str(folder / "train" / f"train-{k:05d}.parquet") for k in range(4)]
    assert files.rows == TRAIN_SHARDS and files.total == 38 and files.skipped == []
    assert ShardFiles(f"{folder}/", "train").files == files.files  # a root given with a trailing slash
    assert is_shard_folder(folder) and not is_shard_folder(folder / "train")
    with pytest.raises(KeyError) as info:
        ShardFiles(folder, "test")
    assert info.value.args[0] == f"{folder}: no split 'test' (no test/*.parquet); available: ['train', 'valid']"


def test_a_folder_without_record_is_found_by_its_parquet_files(tmp_path, folder):
    (tmp_path / "foreign" / "train").mkdir(parents=True)
    shutil.copy(folder / "train" / "train-00003.parquet", tmp_path / "foreign" / "train" / "a.parquet")
    assert is_shard_folder(tmp_path / "foreign") and not is_shard_folder(tmp_path)


def test_shards_of_an_fsspec_url_are_named_by_url(folder):
    import fsspec

    memory = fsspec.filesystem("memory")
    for k in range(2):
        memory.pipe(f"/guards/valid/valid-{k:05d}.parquet", (folder / "valid" / f"valid-{k:05d}.parquet").read_bytes())
    files = ShardFiles("memory://guards", "valid")
    assert files.files == [f"memory:///guards/valid/valid-{k:05d}.parquet" for k in range(2)] and files.rows == [4, 4]
    # A URL is read without a local folder or record (the columns named, their kinds from the schema).
    stream = ShardStream("memory://guards", "valid", columns={"vec": "vec"})
    assert stream.meta is None and stream.kinds == {"vec": "array"} and len(stream) == 8
    assert [s["index"] for s in first_samples(stream, 8)] == list(range(8))


def test_min_rows_per_process_and_epoch_length(folder):
    files = ShardFiles(folder, "train")
    # One process: every row. Shards a multiple of the processes: each process reads its own
    # shards, the poorest the smallest ones. Otherwise every process keeps one row in N.
    assert [files.min_rows_per_process(n) for n in (1, 2, 3, 4)] == [38, 2 + 12, 38 // 3, 2]
    assert files.min_rows_per_process(0) == 38
    # The example of data_cards/parquet-shards.md: 2 processes at K = 8 draw floor(14 / 4) = 3 batches.
    assert streamed_epoch_batches(files, 2, 4) == 3 and streamed_epoch_batches(files, 1, 8) == 4
    assert streamed_epoch_batches(files, 4, 2) == 1 and streamed_epoch_batches(files, 4, 3) == 0


def test_a_damaged_footer_is_named_or_skipped(tmp_path, folder):
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    bad = out / "train" / "train-00001.parquet"
    bad.write_bytes(bad.read_bytes()[:-20])  # the footer cut off
    with pytest.raises(ValueError) as info:
        ShardFiles(out, "train")
    message = str(info.value)
    assert message.startswith(f"{bad}: damaged Parquet shard (") and "\n" not in message
    assert message.endswith("); remove or rewrite it, or set data.options.on_error: skip")
    with pytest.warns(MMViewsWarning) as caught:
        stream = ShardStream(out, "train", on_error="skip")
    (warning,) = [w for w in caught if "damaged" in str(w.message)]
    assert str(warning.message).startswith(f"{bad}: damaged Parquet shard (") and str(warning.message).endswith("; skipped")
    assert stream.shards.skipped == [str(bad)] and stream.shards.rows == [12, 12, 2] and len(stream) == 26
    assert stream.num_skipped_shards == 1 and stream.skipped_data()["shards"] == [str(bad)]
    for name in ("train-00000.parquet", "train-00002.parquet", "train-00003.parquet"):
        (out / "train" / name).write_bytes(b"not parquet")
    with pytest.warns(UserWarning), pytest.raises(ValueError) as info:
        ShardFiles(out, "train", on_error="skip")
    assert str(info.value) == f"{out}: split 'train' has no readable shard"
    stream = ShardStream(folder, "train", on_error="skip")
    assert stream.num_skipped_shards == 0 and stream.skipped_data() == {
        "shards": [], "row_groups": {}, "rows_in_skipped_row_groups": 0, "values_marked_absent": 0}


# --------------------------------------------------------------------------- the loader


def test_epoch_length_and_the_poorest_process(folder):
    stream = ShardStream(folder, "train")
    assert len(stream) == 38
    assert len(StreamLoader(stream, 4, as_list)) == 9  # floor(38 / 4): the short last batch dropped
    assert len(StreamLoader(stream, 4, as_list, world=2, rank=1)) == 3
    assert len(StreamLoader(stream, 4, as_list, drop_last=False)) == math.ceil(38 / 4)
    loader = StreamLoader(stream, 19, as_list, shuffle_buffer=0)
    assert [len(b) for b in loader] == [19, 19]  # exactly one batch's worth: 2 full batches
    with pytest.raises(ValueError) as info:
        StreamLoader(stream, 8, as_list, world=4)
    assert str(info.value) == (f"{folder} [train]: 2 rows for the process given the fewest cannot fill one batch of 8 "
                               "rows (4 shards, 4 processes)")
    with pytest.raises(ValueError) as info:
        StreamLoader(stream, 39, as_list)
    assert str(info.value) == (f"{folder} [train]: 38 rows for the process given the fewest cannot fill one batch of 39 "
                               "rows (4 shards, 1 processes)")
    assert len(StreamLoader(stream, 39, as_list, drop_last=False)) == 1  # a whole read needs no full batch


def collating_process(samples: list) -> int:
    import os

    return os.getpid()


def test_loader_defaults(folder):
    import os

    stream = ShardStream(folder, "train")
    loader = StreamLoader(stream, 4, collating_process)
    state = loader.state_dict()
    assert (state["seed"], state["rank"], state["world"], state["shuffle_buffer"]) == (0, 0, 1, 1000)
    assert len(loader) == 9 and set(loader) == {os.getpid()}  # full batches only, collated in this process


def test_epochs_are_shuffled_differently_and_reproducibly(folder):
    stream = ShardStream(folder, "train")

    def epoch(e: int) -> list[int]:
        loader = StreamLoader(stream, 4, as_list, seed=3, shuffle_buffer=8)
        loader.set_epoch(e)
        return [i for b in loader for i in indices(b)]

    first, second = epoch(0), epoch(1)
    assert len(first) == len(second) == 36 and len(set(first)) == 36 and set(first) <= set(range(38))
    assert first != second and first != sorted(first) and epoch(0) == first


def test_a_buffer_of_one_row_mixes_the_shards_and_none_reads_them_whole_in_file_order(folder):
    """What the data card says of ``shuffle_buffer``: 0 reads the shards whole, in file order; with
    ``datasets`` 5 a buffer of even 1 row is filled from several shards in turn, so consecutive
    rows come from different shards (a source written in class order still gives mixed batches)."""
    import datasets

    stream = ShardStream(folder, "train")
    starts = np.cumsum([0, *TRAIN_SHARDS])
    shard_of = {row: k for k in range(len(TRAIN_SHARDS)) for row in range(starts[k], starts[k + 1])}
    unshuffled = [i for b in StreamLoader(stream, 2, as_list, seed=3, shuffle_buffer=0) for i in indices(b)]
    assert unshuffled == list(range(len(unshuffled)))
    if int(datasets.__version__.split(".")[0]) < 5:
        return  # one shard at a time: nothing more to claim
    drawn = [i for b in StreamLoader(stream, 2, as_list, seed=3, shuffle_buffer=1) for i in indices(b)]
    assert len({shard_of[i] for i in drawn[:len(TRAIN_SHARDS)]}) == len(TRAIN_SHARDS), drawn[:8]


def test_processes_draw_disjoint_rows_of_the_same_count(folder):
    stream = ShardStream(folder, "train")
    drawn = [[i for b in StreamLoader(stream, 4, as_list, world=2, rank=r, seed=1, shuffle_buffer=8) for i in indices(b)]
             for r in (0, 1)]
    assert [len(d) for d in drawn] == [12, 12] and not set(drawn[0]) & set(drawn[1])


def test_shuffle_buffer_must_not_be_negative(folder):
    stream = ShardStream(folder, "valid")
    with pytest.raises(ValueError) as info:
        StreamLoader(stream, 2, as_list, shuffle_buffer=-1)
    assert str(info.value) == "key 'data.shuffle_buffer': must be >= 0 rows, got -1"
    unshuffled = [indices(b) for b in StreamLoader(stream, 2, as_list, shuffle_buffer=0)]
    assert unshuffled == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # no buffer: the shards' order
    assert StreamLoader(stream, 2, as_list).shuffle_buffer == DEFAULT_SHUFFLE_BUFFER == 1000


def test_whole_reads_keep_the_short_last_batch(folder):
    """Evaluation and the checks read every row once, in shard order, the short last batch
    included: 10 rows in batches of 4 are 4, 4 and 2 (not 2 batches of 4)."""
    valid = ShardStream(folder, "valid")
    loader = StreamLoader(valid, 4, as_list, drop_last=False, seed=3, shuffle_buffer=16, world=2, rank=1)
    assert [indices(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # no shuffle, every row, any rank
    assert [s["index"] for s in first_samples(valid, 16)] == list(range(10))
    assert [s["index"] for s in first_samples(valid, 10)] == list(range(10))
    assert [s["index"] for s in first_samples(valid, 3)] == [0, 1, 2]
    mapped = ParquetShardDataset(folder, "valid")
    assert len(mapped) == 10 and [s["index"] for s in first_samples(mapped, 16)] == list(range(10))
    assert [s["index"] for s in first_samples(mapped, 2)] == [0, 1]


def test_first_samples_of_no_rows_is_an_empty_list_and_a_negative_count_is_refused(folder):
    """A count of 0 reads nothing from either reader (a streamed split once gave every row: 0 rows
    per batch meant no limit); a negative count is refused by name, not read as "all but"."""
    stream, mapped = ShardStream(folder, "train"), ParquetShardDataset(folder, "train")
    for split in (stream, mapped):
        assert first_samples(split, 0) == []
        with pytest.raises(ValueError) as info:
            first_samples(split, -1)
        assert str(info.value) == "first_samples: count must be >= 0 samples, got -1"
    assert [s["index"] for s in first_samples(stream, 1)] == [0]


def test_first_samples_of_a_split_without_rows_is_an_empty_list(tmp_path, folder):
    """A foreign Parquet folder whose only shard holds no row: no sample, as a list (what map-style gives)."""
    (tmp_path / "empty" / "train").mkdir(parents=True)
    table = pq.read_table(folder / "valid" / "valid-00000.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "empty" / "train" / "part-0.parquet")
    stream = ShardStream(tmp_path / "empty", "train", columns={"vec": "vec"})
    assert len(stream) == 0 and first_samples(stream, 4) == []


def test_a_shard_without_rows_adds_nothing_to_either_reader(tmp_path, folder):
    """A 0-row shard among others (a foreign writer's empty part file) is read as nothing by both
    readers, map-style as streamed (``datasets``' Parquet reader fails on it: it is not given it);
    a split whose every shard is empty has no rows either way."""
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    empty = pq.read_table(out / "valid" / "valid-00001.parquet").slice(0, 0)
    pq.write_table(empty, out / "valid" / "valid-00001.parquet")
    kept = [0, 1, 2, 3, 8, 9]  # shards of 4, 0 and 2 rows
    assert [s["index"] for s in first_samples(ShardStream(out, "valid"), 16)] == kept
    mapped = ParquetShardDataset(out, "valid")
    assert len(mapped) == 6 and [s["index"] for s in first_samples(mapped, 16)] == kept
    (tmp_path / "empty" / "train").mkdir(parents=True)
    pq.write_table(empty, tmp_path / "empty" / "train" / "part-0.parquet")
    pq.write_table(empty, tmp_path / "empty" / "train" / "part-1.parquet")
    for split in (ShardStream(tmp_path / "empty", "train", columns={"vec": "vec"}),
                  ParquetShardDataset(tmp_path / "empty", "train", columns={"vec": "vec"})):
        assert len(split) == 0 and first_samples(split, 4) == []


def test_the_loaders_dataset_decodes_the_raw_rows_it_is_given():
    rows = _DecodeRows(decoder(kinds={"vec": "array"}))
    row = {INDEX_COLUMN: 2, "id": "r2", "vec": [1.0, -1.0]}
    assert rows[row]["index"] == 2 and rows[row]["modalities"]["vec"].tolist() == [1.0, -1.0]
    assert [s["id"] for s in rows.__getitems__([row, {**row, "id": "r3"}])] == ["r2", "r3"]


def test_state_dict_is_the_position(folder):
    stream = ShardStream(folder, "train")
    loader = StreamLoader(stream, 4, as_list, seed=7, shuffle_buffer=5, rank=0, world=1)
    loader.set_epoch(2)
    assert loader.state_dict() == {"epoch": 2, "batches": 0, "rows": 0, "rank": 0, "world": 1, "seed": 7,
                                   "shuffle_buffer": 5, "datasets_state": None,
                                   "shards": [f"train-{k:05d}.parquet" for k in range(4)]}
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = json.loads(json.dumps(loader.state_dict()))  # JSON data
    assert (state["epoch"], state["batches"], state["rows"]) == (2, 3, 12) and state["datasets_state"]
    rest = [indices(b) for b in batches]
    assert len(rest) == 6 and (loader.batches_in_epoch, loader.rows_in_epoch) == (9, 36)
    again = StreamLoader(stream, 4, as_list, seed=7, shuffle_buffer=5)
    again.load_state_dict(state)
    assert again.epoch == 2 and [indices(b) for b in again] == rest
    assert (again.batches_in_epoch, again.rows_in_epoch) == (9, 36)  # the skipped batches counted
    assert len([b for b in again]) == 9  # the next pass over the epoch is whole again


@pytest.mark.parametrize("key, changed, message", [
    ("shuffle_buffer", {"shuffle_buffer": 6}, "key 'data.shuffle_buffer' changed since the checkpoint (5 -> 6)"),
    ("seed", {"seed": 8}, "key 'seed' changed since the checkpoint (7 -> 8)"),
    ("world", {"world": 2}, "the number of processes changed since the checkpoint (1 -> 2)"),
])
def test_a_resume_with_another_setting_is_refused_by_key(folder, key, changed, message):
    stream = ShardStream(folder, "train")
    state = StreamLoader(stream, 2, as_list, seed=7, shuffle_buffer=5).state_dict()
    with pytest.raises(ValueError) as info:
        StreamLoader(stream, 2, as_list, **{"seed": 7, "shuffle_buffer": 5, **changed}).load_state_dict(state)
    assert str(info.value) == (f"cannot resume the stream of {folder} [train]: {message}; resume with the "
                               "checkpoint's value, or start a new run")


def test_a_resume_with_another_shard_list_is_refused(folder):
    stream = ShardStream(folder, "train")
    state = {**StreamLoader(stream, 2, as_list).state_dict(), "shards": ["train-00000.parquet"]}
    names = [f"train-{k:05d}.parquet" for k in range(4)]
    with pytest.raises(ValueError) as info:
        StreamLoader(stream, 2, as_list).load_state_dict(state)
    assert str(info.value) == (f"cannot resume the stream of {folder} [train]: its shard list changed since the "
                               f"checkpoint (['train-00000.parquet'] -> {names!r}); resume with the checkpoint's "
                               "value, or start a new run")


def test_set_epoch_forgets_a_resume_position_only_for_another_epoch(folder):
    stream = ShardStream(folder, "valid")
    loader = StreamLoader(stream, 2, as_list, shuffle_buffer=0)
    loader.set_epoch(1)
    loader.skip_batches(3)
    loader.set_epoch(1)  # the same epoch (the trainer sets it again): the position stays
    assert [indices(b) for b in loader] == [[6, 7], [8, 9]]
    loader.skip_batches(3)
    loader.set_epoch(2)
    assert len([b for b in loader]) == 5 and loader.epoch == 2


def test_batches_are_moved_to_the_device(folder):
    stream = ShardStream(folder, "valid")
    loader = StreamLoader(stream, 4, lambda samples: torch.tensor(indices(samples)), shuffle_buffer=0)
    assert loader.to(torch.device("cpu")) is loader and loader.device == torch.device("cpu")
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def worker_seed(samples: list) -> int:
    """A collate function that gives the seed of the process it runs in (a loader worker)."""
    return torch.initial_seed()


def test_loader_seeds_come_from_the_recipe_seed_and_epoch_only(folder):
    """The workers' seeds depend on the seed and the epoch, not on the training RNG, and a pass
    over the stream leaves the training RNG where it was (a resumed run draws the same dropout)."""
    stream = ShardStream(folder, "valid")
    loader = StreamLoader(stream, 10, worker_seed, seed=4, shuffle_buffer=0, drop_last=False, num_workers=1)
    torch.manual_seed(1)
    first = list(loader)
    torch.manual_seed(2)
    assert list(loader) == first
    loader.set_epoch(1)
    assert list(loader) != first
    assert list(StreamLoader(stream, 10, worker_seed, seed=5, shuffle_buffer=0, drop_last=False, num_workers=1)) != first
    torch.manual_seed(3)
    before = torch.get_rng_state()
    [b for b in StreamLoader(stream, 4, as_list, seed=4)]
    assert torch.equal(torch.get_rng_state(), before)


def test_a_stream_whose_every_row_group_is_damaged_names_it(tmp_path, folder):
    """on_error: skip with nothing readable left: the epoch cannot be filled again; one line, no hang."""
    out = tmp_path / "damaged"
    (out / "valid").mkdir(parents=True)
    shutil.copy(folder / SHARDS_META, out / SHARDS_META)
    shard = out / "valid" / "valid-00000.parquet"
    shutil.copy(folder / "valid" / "valid-00000.parquet", shard)
    group = pq.ParquetFile(shard).metadata.row_group(0)
    (column,) = [group.column(k) for k in range(group.num_columns) if group.column(k).path_in_schema.startswith("vec")]
    data = bytearray(shard.read_bytes())
    for k in range(column.data_page_offset + 8, column.data_page_offset + 48):  # inside the data, footer intact
        data[k] ^= 0x5A
    shard.write_bytes(bytes(data))
    with pytest.warns(MMViewsWarning):
        stream = ShardStream(out, "valid", on_error="skip")
        loader = StreamLoader(stream, 2, as_list)
        assert len(loader) == 2  # what the footer promises
        with pytest.raises(ValueError) as info:
            [b for b in loader]
    assert str(info.value) == ("the streamed split has no readable row left: every row group read in this epoch was "
                               "damaged and left out (on_error: skip)")


def test_a_stream_that_ends_early_names_the_process(tmp_path, folder):
    """Shards changed under a run (a shard rewritten shorter): the epoch promised by the footers
    cannot be drawn; one line naming the process, never a shorter epoch."""
    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    stream = ShardStream(out, "train")
    loader = StreamLoader(stream, 4, as_list, world=2, rank=1, shuffle_buffer=0)
    assert len(loader) == 3
    shard = out / "train" / "train-00003.parquet"
    table = pq.read_table(out / "train" / "train-00001.parquet")
    pq.write_table(table.slice(0, 1), out / "train" / "train-00001.parquet")  # 12 rows -> 1
    with pytest.raises(ValueError) as info:
        [b for b in loader]
    assert str(info.value) == (
        f"{out} [train], process 1 of 2, epoch 0: the stream ended after 0 full batches of 4 rows (and 3 rows), "
        "3 expected from the shards' row counts (shards changed since the run started, or too many rows left out "
        "as damaged); every process must run the same steps")
    assert shard.is_file()


# --------------------------------------------------------------------------- the row decoder


def decoder(**options) -> RowDecoder:
    kinds = options.pop("kinds", {"vec": "array"})
    columns = options.pop("columns", {m: m for m in kinds})
    return RowDecoder("/shards", "hf", columns, kinds, options.pop("labels", {}), **options)


def test_decoded_values_of_each_kind():
    d = decoder(kinds={"ids": "tokens", "seq": "sequence", "text": "text", "vec": "array"},
                shapes={"seq": (None, 2)}, array_shapes={"vec": [None, 2]})
    row = {INDEX_COLUMN: 4, "ids": [5, 6, 7], "seq": [[1.0, 2.0]], "text": 12, "vec": [[1.0, 2.0], [3.0, 4.0]]}
    sample = d(row)
    assert sample["index"] == 4 and "id" not in sample and sample["labels"] == {}
    mods = sample["modalities"]
    assert torch.equal(mods["ids"]["input_ids"], torch.tensor([5, 6, 7])) and mods["ids"]["input_ids"].dtype == torch.int64
    assert torch.equal(mods["ids"]["attention_mask"], torch.ones(3, dtype=torch.long))
    assert mods["ids"]["attention_mask"].dtype == torch.int64
    assert mods["seq"].dtype == torch.float32 and mods["seq"].tolist() == [[1.0, 2.0]]
    assert mods["text"] == "12" and mods["vec"].shape == (2, 2)
    empty = d({"ids": [], "seq": np.zeros((0, 2)), "text": None, "vec": None})
    assert empty["index"] == -1 and empty["modalities"] == {"ids": None, "seq": None, "text": None, "vec": None}
    assert d({"ids": None, "seq": float("nan"), "text": "a", "vec": None, "id": "x7"})["modalities"]["seq"] is None
    assert d({"ids": None, "seq": None, "text": "a", "vec": None, "id": "x7"})["id"] == "x7"
    # Token ids are int64 (what embedding layers index with) whatever integer type a column holds.
    narrow = d({"ids": np.array([5, 6], np.int32), "seq": None, "text": None, "vec": None})["modalities"]["ids"]
    assert narrow["input_ids"].dtype == torch.int64 and narrow["input_ids"].tolist() == [5, 6]


def test_a_value_that_cannot_be_decoded_is_named_by_row_and_column():
    d = decoder(kinds={"seq": "sequence", "vec": "array"}, array_shapes={"vec": [None, 2]})
    with pytest.raises(ValueError) as info:
        d({INDEX_COLUMN: 3, "id": "r3", "seq": [1.0, 2.0, 3.0], "vec": None})
    assert str(info.value) == "/shards row mmviews_index=3 (id 'r3'), column 'seq': expected a [len, D] sequence, got shape (3,)"
    with pytest.raises(ValueError) as info:
        d({INDEX_COLUMN: 5, "seq": None, "vec": [[1.0, 2.0, 3.0]]})
    assert str(info.value) == (f"/shards row mmviews_index=5, column 'vec': shape [1, 3] differs from the column's [L, 2] "
                               f"recorded in {SHARDS_META}")
    skipping = decoder(kinds={"vec": "array"}, array_shapes={"vec": [2]}, on_error="skip")
    with pytest.warns(MMViewsWarning) as caught:
        sample = skipping({INDEX_COLUMN: 6, "id": "r6", "vec": [1.0]})
        skipping({INDEX_COLUMN: 7, "vec": [1.0, 2.0, 3.0]})
    assert sample["modalities"]["vec"] is None and skipping.num_skipped == 2
    assert all(w.category is MMViewsWarning for w in caught)  # the user's data: mmviews' own warning class
    assert [str(w.message) for w in caught] == [
        f"/shards row mmviews_index=6 (id 'r6'), column 'vec': shape [1] differs from the column's [2] recorded in {SHARDS_META}; marked absent",
        f"/shards row mmviews_index=7, column 'vec': shape [3] differs from the column's [2] recorded in {SHARDS_META}; marked absent"]


def test_labels_come_back_as_python_numbers():
    d = decoder(labels={"class": "label", "class_fine": "fine", "score": "s", "name": "n"})
    labels = d({"vec": None, "label": np.int64(2), "fine": None, "s": np.float32(0.5), "n": "x"})["labels"]
    assert labels == {"class": 2, "class_fine": None, "score": 0.5, "name": "x"}
    assert type(labels["class"]) is int and type(labels["score"]) is float
    assert d({"vec": None, "label": 1.0, "fine": 3.0, "s": 2, "n": None})["labels"] == {
        "class": 1, "class_fine": 3, "score": 2, "name": None}


def test_modality_info_of_each_kind():
    d = decoder(kinds={"img": "image", "snd": "waveform", "text": "text", "ids": "tokens", "seq": "sequence",
                       "bare": "sequence", "vec": "array"}, shapes={"seq": (None, 5)}, sample_rate=8000, image_size=(4, 6))
    assert d.modality_info() == {"img": {"kind": "image", "shape": (3, 4, 6)},
                                 "snd": {"kind": "waveform", "shape": (None,), "sample_rate": 8000},
                                 "text": {"kind": "text"}, "ids": {"kind": "tokens"},
                                 "seq": {"kind": "sequence", "shape": (None, 5)}}
    assert decoder(kinds={"img": "image"}).modality_info() == {"img": {"kind": "image"}}
    assert decoder(kinds={"snd": "waveform"}).modality_info()["snd"]["sample_rate"] == 16000  # the default rate
    video = RowDecoder("/v", "video", {}, {}, {}, sample_rate=16000,
                       video={"num_frames": 4, "size": (8, 10), "flow": True, "audio": True})
    assert video.modality_info() == {"video": {"kind": "video", "shape": (4, 3, 8, 10)},
                                     "flow": {"kind": "flow", "shape": (3, 2, 8, 10)},
                                     "audio": {"kind": "waveform", "shape": (None,), "sample_rate": 16000}}
    bare = RowDecoder("/v", "video", {}, {}, {}, video={"num_frames": 4, "size": (8, 10), "flow": False, "audio": False})
    assert bare.modality_info() == {"video": {"kind": "video", "shape": (4, 3, 8, 10)}}


# --------------------------------------------------------------------------- opening a split


def test_the_readers_decode_the_recorded_columns_and_labels(folder):
    for reader in (ParquetShardDataset(folder, "valid"), ShardStream(folder, "valid")):
        assert reader.columns == {"vec": "vec"} and reader.label_columns == {"class": "label"}
        assert reader.kinds == {"vec": "array"} and reader.decoder.array_shapes == {"vec": [2]}
    mapped = ParquetShardDataset(folder, "valid")
    sample = mapped[7]
    assert sample["index"] == 7 and sample["id"] == "r7" and sample["labels"] == {"class": 1}
    assert sample["modalities"]["vec"].tolist() == [7.0, -7.0]


def test_options_that_cannot_be_read_are_refused(folder, tmp_path):
    with pytest.raises(ValueError) as info:
        ShardStream(folder, "valid", on_error="ignore")
    assert str(info.value) == "on_error must be 'raise' or 'skip', got 'ignore'"
    with pytest.raises(FileNotFoundError) as info:
        ShardStream(tmp_path / "nowhere", "valid")
    assert str(info.value) == f"no such shard folder: {tmp_path / 'nowhere'}"
    columns = ["id", "label", "mmviews_index", "vec"]
    with pytest.raises(KeyError) as info:
        ShardStream(folder, "valid", columns={"vec": "vector"})
    assert info.value.args[0] == f"{folder}: split 'valid' has no column 'vector' (for 'vec'); columns: {columns}"
    with pytest.raises(KeyError) as info:
        ShardStream(folder, "valid", labels={"class": "cls"})
    assert info.value.args[0] == f"{folder}: split 'valid' has no column 'cls' (for label 'class'); columns: {columns}"
    with pytest.raises(ValueError) as info:
        ShardStream(folder, "valid", fold=2)
    assert str(info.value) == (f"{folder}: the shards hold the splits of fold None, not fold 2 "
                               "(write them with `mmviews prepare ... --format parquet --fold 2`)")
    # The options of video shards: no columns, the store's flow only, the fold they were written with.
    video = tmp_path / "video"
    shutil.copytree(folder, video)
    meta = json.loads((video / SHARDS_META).read_text())
    meta["source"] = {**meta["source"], "kind": "video", "options": {"fold": 1}}
    (video / SHARDS_META).write_text(json.dumps(meta))
    with pytest.raises(ValueError) as info:
        ShardStream(video, "valid", columns={"video": "vec"})
    assert str(info.value) == (f"{video}: shards of a video folder give the modalities video, flow and audio; use the "
                               "options num_frames, size, flow, audio instead of columns")
    with pytest.raises(ValueError) as info:
        ShardStream(video, "valid", fold=1, flow="precomputed")
    assert str(info.value) == (f"{video}: shards hold the store's Farneback flow: flow must be None or 'farneback', "
                               "got 'precomputed'")
    with pytest.raises(ValueError, match=f"^{video}: the shards hold the splits of fold 1, not fold 3 "):
        ShardStream(video, "valid", fold=3)


def test_the_first_rows_are_decoded_when_a_split_is_opened(tmp_path, folder):
    out = tmp_path / "bad-row"
    shutil.copytree(folder, out)
    shard = out / "valid" / "valid-00000.parquet"
    table = pq.read_table(shard)
    vec = pa.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [9.0]], pa.list_(pa.float32()))
    pq.write_table(table.set_column(table.schema.get_field_index("vec"), "vec", vec), shard)  # row 3: [9.0]
    ShardStream(out, "valid", check_rows=3)  # rows 0-2 fine
    ShardStream(out, "valid", check_rows=0)
    with pytest.raises(ValueError, match=r"row mmviews_index=3 \(id 'r3'\), column 'vec': shape \[1\] differs"):
        ShardStream(out, "valid", check_rows=4)
    with pytest.raises(ValueError, match="row mmviews_index=3"):
        ParquetShardDataset(out, "valid", check_rows=4)


def test_a_foreign_parquet_folder_infers_its_columns(tmp_path, folder):
    """Parquet files without a mmviews record: image/audio/text columns by name, the kind of
    each column from its type, the label from a column named label."""
    import datasets

    from test_data_hf import png_bytes, wav_bytes

    feats = datasets.Features({"image": datasets.Image(), "audio": datasets.Value("binary"),
                               "text": datasets.Value("string"), "blob": datasets.Value("large_binary"),
                               "caption": datasets.Value("large_string"), "vec": datasets.List(datasets.Value("float32")),
                               "label": datasets.Value("int64")})
    data = datasets.Dataset.from_dict({"image": [{"bytes": png_bytes(5), "path": None}] * 2,
                                       "audio": [wav_bytes(80)] * 2, "text": ["a", "b"], "blob": [wav_bytes(90)] * 2,
                                       "caption": ["c", "d"], "vec": [[1.0], [2.0, 3.0]], "label": [1, 0]},
                                      features=feats)
    (tmp_path / "foreign" / "train").mkdir(parents=True)
    data.to_parquet(str(tmp_path / "foreign" / "train" / "part-0.parquet"))
    plain = ShardStream(tmp_path / "foreign", "train")
    assert plain.columns == {"image": "image", "audio": "audio", "text": "text"}
    assert plain.kinds == {"image": "image", "audio": "waveform", "text": "text"}
    assert plain.label_columns == {"class": "label"} and plain.image_columns == ["image"]
    every = ShardStream(tmp_path / "foreign", "train", labels={},
                        columns={"picture": "image", "sound": "blob", "words": "caption", "vec": "vec"})
    assert every.kinds == {"picture": "image", "sound": "waveform", "words": "text", "vec": "array"}
    sample = first_samples(every, 2)[1]
    assert sample["labels"] == {} and sample["index"] == -1 and sample["modalities"]["words"] == "d"
    assert sample["modalities"]["vec"].tolist() == [2.0, 3.0] and sample["modalities"]["picture"].shape[0] == 3
    data.remove_columns(["image", "audio", "text", "label"]).to_parquet(str(tmp_path / "foreign" / "train" / "part-0.parquet"))
    with pytest.raises(ValueError) as info:
        ShardStream(tmp_path / "foreign", "train")
    assert getattr(info.value, "option", None) == "columns"  # what `prepare` turns into its --columns flag
    assert str(info.value) == (f"{tmp_path / 'foreign'}: no modality columns (no column is named image, audio or text): "
                               "name the columns to read, modality -> column (columns: ['blob', 'caption', 'vec'])")
    assert ShardStream(tmp_path / "foreign", "train", columns={"vec": "vec"}).label_columns == {}


def test_a_damaged_image_read_map_style_is_named_by_row_and_column(tmp_path):
    """The map-style reader leaves images encoded for mmviews to decode: a damaged one is named."""
    import datasets

    from test_data_hf import png_bytes

    feats = datasets.Features({"image": datasets.Image()})
    images = [{"bytes": png_bytes(10), "path": None}, {"bytes": b"\x89PNG broken", "path": None}]
    (tmp_path / "foreign" / "train").mkdir(parents=True)
    datasets.Dataset.from_dict({"image": images}, features=feats).to_parquet(str(tmp_path / "foreign" / "train" / "a.parquet"))
    mapped = ParquetShardDataset(tmp_path / "foreign", check_rows=1)  # the train split by default
    assert mapped.split == "train" and mapped[0]["modalities"]["image"].shape == (3, 6, 6)
    with pytest.raises(ValueError) as info:
        mapped[1]
    assert str(info.value).startswith(f"{tmp_path / 'foreign'} row mmviews_index=None, column 'image': <image bytes>: "
                                      "cannot read image (")
    assert ShardStream(tmp_path / "foreign", check_rows=1).split == "train"


def test_foreign_audio_columns_are_waveforms_by_type_or_by_name(tmp_path):
    """An ``Audio()`` column (datasets' metadata in the schema) or a binary one is a waveform under
    any modality name; any column read as the modality ``audio`` is one too (file paths). The
    Audio() column is read as its {bytes, path} storage (datasets would need torchcodec for it)."""
    from test_data_hf import wav_bytes

    (tmp_path / "a.wav").write_bytes(wav_bytes(60))
    snd = pa.array([{"bytes": wav_bytes(70), "path": None}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"snd": snd, "blob": pa.array([wav_bytes(80)], pa.binary()), "where": [str(tmp_path / "a.wav")]})
    hf_meta = {"info": {"features": {"snd": {"_type": "Audio"}, "blob": {"dtype": "binary", "_type": "Value"},
                                     "where": {"dtype": "string", "_type": "Value"}}}}
    (tmp_path / "foreign" / "train").mkdir(parents=True)
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps(hf_meta)}),
                   tmp_path / "foreign" / "train" / "part-0.parquet")
    columns = {"voice": "snd", "clip": "blob", "audio": "where"}
    for reader in (ShardStream, ParquetShardDataset):  # an Audio() column is read without torchcodec
        opened = reader(tmp_path / "foreign", "train", columns=columns, sample_rate=8000)
        assert opened.kinds == {"voice": "waveform", "clip": "waveform", "audio": "waveform"}
        mods = first_samples(opened, 1)[0]["modalities"]
        assert [tuple(mods[m].shape) for m in ("voice", "clip", "audio")] == [(70,), (80,), (60,)]
    assert ShardStream(tmp_path / "foreign", "train", columns={"text": "where"}).kinds == {"text": "text"}


# --------------------------------------------------------------------------- video rows


def jpeg(value: int, gray: bool = False, size: tuple[int, int] = (8, 10)) -> bytes:
    import cv2

    image = np.full(size if gray else (*size, 3), value, np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


def video_decoder(on_error: str = "raise", flow: bool = True, audio: bool = True, size=(8, 10)) -> RowDecoder:
    return RowDecoder("/v", "video", {}, {}, {"class": "class"}, on_error, sample_rate=8000,
                      video={"num_frames": 4, "size": size, "flow": flow, "audio": audio, "max_audio_seconds": 0.2})


RAMP = np.linspace(-0.5, 0.5, 8000, dtype=np.float32)  # one second at 8 kHz


def video_row(frames: int = 6, track: np.ndarray | None = RAMP) -> dict:
    """A clip of ``frames`` solid frames (gray 40 * k), flow x alternating +20 / -20 px (stored as
    255 / 0), flow y -20 px (0), 10 fps, and an audio track."""
    from mmviews.data.shards import flac_bytes

    return {INDEX_COLUMN: 0, "id": "Jump/a.mp4", "class": 1, "fps": 10.0,
            "frames": [jpeg(40 * k) for k in range(frames)],
            "flow_x": [jpeg(255 if k % 2 else 0, gray=True) for k in range(frames - 1)],
            "flow_y": [jpeg(0, gray=True) for _ in range(frames - 1)],
            "audio": None if track is None else flac_bytes(track, 8000)}


def test_video_rows_take_the_middle_window_its_flow_and_audio():
    sample = video_decoder()(video_row())
    mods = sample["modalities"]
    assert sample["labels"] == {"class": 1} and sample["id"] == "Jump/a.mp4"
    # 4 frames from the middle of 6: frames 1-4.
    assert mods["video"].shape == (4, 3, 8, 10)
    assert np.allclose(mods["video"].mean(dim=(1, 2, 3)).numpy(), [40 / 255, 80 / 255, 120 / 255, 160 / 255], atol=2 / 255)
    # The flow of the pairs (1, 2), (2, 3), (3, 4): x = +20, -20, +20 px; y = -20 px.
    assert mods["flow"].shape == (3, 2, 8, 10)
    assert np.allclose(mods["flow"][:, 0].mean(dim=(1, 2)).numpy(), [20, -20, 20], atol=0.5)
    assert np.allclose(mods["flow"][:, 1].numpy(), -20, atol=0.5)
    # 0.2 s of audio centred on the frames' window (0.1 s to 0.5 s: centre 0.3 s): samples 1600-3200.
    assert mods["audio"].shape == (1600,) and np.abs(mods["audio"].numpy() - RAMP[1600:3200]).max() <= 2.0 ** -23
    resized = video_decoder(size=(4, 5))(video_row())["modalities"]
    assert resized["video"].shape == (4, 3, 4, 5) and resized["flow"].shape == (3, 2, 4, 5)


def test_a_short_clip_repeats_its_last_frame_and_its_audio_window_fits_the_track():
    mods = video_decoder()(video_row(frames=2, track=RAMP[:2000]))["modalities"]
    assert np.allclose(mods["video"].mean(dim=(1, 2, 3)).numpy(), [0, 40 / 255, 40 / 255, 40 / 255], atol=2 / 255)
    assert np.allclose(mods["flow"][0, 0].numpy(), -20, atol=0.5)  # the one pair (0, 1): its stored flow
    assert torch.count_nonzero(mods["flow"][1:]) == 0  # a repeated frame does not move
    # The window (samples 800-2400: 0.2 s centred on 0 s to 0.4 s) shifted back inside the 2000-sample track.
    assert np.abs(mods["audio"].numpy() - RAMP[400:2000]).max() <= 2.0 ** -23
    whole = video_decoder()(video_row(track=RAMP[:1000]))["modalities"]["audio"]
    assert np.abs(whole.numpy() - RAMP[:1000]).max() <= 2.0 ** -23  # a track shorter than the window: all of it
    assert video_decoder()(video_row(track=None))["modalities"]["audio"] is None
    single = video_decoder()(video_row(track=RAMP[:1]))["modalities"]["audio"]  # a one-sample track: that sample
    assert single.shape == (1,) and abs(float(single[0]) - float(RAMP[0])) <= 2.0 ** -23
    bare = video_decoder(flow=False, audio=False)(video_row())
    assert list(bare["modalities"]) == ["video"]


def test_video_values_that_cannot_be_decoded_are_named_by_column():
    where = "/v row mmviews_index=0 (id 'Jump/a.mp4'), column"
    with pytest.raises(ValueError) as info:
        video_decoder()({**video_row(), "frames": []})
    assert str(info.value) == f"{where} 'frames': no frames"
    with pytest.raises(ValueError) as info:
        video_decoder()({**video_row(), "frames": [b"not a jpeg"] * 6})
    assert str(info.value) == f"{where} 'frames': cannot decode JPEG image"
    with pytest.raises(ValueError) as info:
        video_decoder()({**video_row(), "flow_x": [], "flow_y": []})
    assert str(info.value) == f"{where} 'flow_x': the shards hold no flow (prepared with --flow none)"
    with pytest.raises(ValueError) as info:
        video_decoder()({**video_row(), "flow_x": video_row()["flow_x"][:2]})  # fewer flow images than frame pairs
    assert str(info.value).startswith(f"{where} 'flow_x': ")
    with pytest.raises(ValueError) as info:
        video_decoder()({**video_row(), "audio": b"not audio"})
    assert str(info.value).startswith(f"{where} 'audio': cannot decode audio (")
    skipping = video_decoder(on_error="skip")
    with pytest.warns(MMViewsWarning) as caught:
        mods = skipping({**video_row(), "frames": None, "flow_x": [], "audio": b"not audio"})["modalities"]
    assert mods == {"video": None, "flow": None, "audio": None} and skipping.num_skipped == 3
    assert [str(w.message).split(": ")[0] for w in caught] == [f"{where} 'frames'", f"{where} 'flow_x'", f"{where} 'audio'"]
    # Frames that cannot be read leave the audio window where the clip starts (0.2 s around 0 s to 0.4 s).
    with pytest.warns(MMViewsWarning, match="column 'frames': no frames"):
        audio = video_decoder(on_error="skip", flow=False)({**video_row(), "frames": []})["modalities"]["audio"]
    assert np.abs(audio.numpy() - RAMP[800:2400]).max() <= 2.0 ** -23
