"""Unit guards of the Parquet shard writer (:mod:`mmviews.data.shards`, issue 34): where a shard
closes (size limit and row limit, at the threshold and one past it), the record it keeps (files,
rows, first/last index, skipped samples), resuming after a kill, what a rerun refuses or
replaces (and what it never deletes), the row groups, the dataset card, the feature that keeps an
array column's rank and fixed lengths, the encoding of each hf column kind, and the one-line
errors. Tiny in-memory rows written in each test: no fixture shared between tests, so each test
exercises the writer itself."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from test_data_hf import png_bytes, wav_bytes

from mmviews.data import build_dataset, shards
from mmviews.data.shards import INDEX_COLUMN, SHARDS_META, SplitRows, write_shards

SOURCE = {"dataset": "toy", "root": "/data/toy", "kind": "hf", "options": {"columns": {"blob": "blob"}}}
BLOB = 100  # bytes of each row's blob: a row counts 8 (index) + 2 (id "r0".."r9") + 100 = 110 bytes
ROW_BYTES = 8 + 2 + BLOB
MB = 1024 * 1024


def blob_rows(count: int, absent: tuple[int, ...] = (), calls: list[int] | None = None) -> SplitRows:
    """``count`` rows of ``ROW_BYTES`` counted bytes; the samples in ``absent`` cannot be stored."""
    import datasets

    features = datasets.Features({INDEX_COLUMN: datasets.Value("int64"), "id": datasets.Value("string"),
                                  "blob": datasets.Value("binary")})

    def row(i: int) -> dict | None:
        if calls is not None:
            calls.append(i)
        return None if i in absent else {INDEX_COLUMN: i, "id": f"r{i}", "blob": bytes([i]) * BLOB}

    return SplitRows(count, row, features)


def write(out: Path, splits: dict[str, SplitRows], **options) -> dict:
    options.setdefault("progress", False)
    return write_shards(out, splits, source=SOURCE, columns={"blob": "waveform"}, labels={}, **options)


def record(out: Path) -> dict:
    return json.loads((out / SHARDS_META).read_text())


def indices(out: Path, split: str = "train") -> list[list[int]]:
    return [pq.read_table(f).column(INDEX_COLUMN).to_pylist() for f in sorted((out / split).glob("*.parquet"))]


def test_row_bytes_counts_what_the_size_limit_counts():
    assert shards._row_bytes({INDEX_COLUMN: 3, "id": "r3", "blob": b"x" * BLOB}) == ROW_BYTES
    assert shards._row_bytes({"a": bytearray(5), "b": np.zeros((2, 3), np.float32), "c": {"bytes": b"abc", "path": "p"},
                              "d": [b"12", bytearray(b"3"), 0.5], "e": "four", "f": None}) == 5 + 24 + 3 + (2 + 1 + 8) + 4 + 8
    assert shards._row_bytes({"g": {"bytes": None, "path": "p.png"}, "h": 1.5}) == 8 + 8  # no bytes held: 8 each


def test_a_shard_closes_when_its_size_reaches_the_limit(tmp_path):
    # The limit is exactly 2 rows: a shard closes on reaching it, not one row later.
    result = write(tmp_path / "at", {"train": blob_rows(5)}, shard_size_mb=2 * ROW_BYTES / MB)
    assert record(tmp_path / "at")["splits"]["train"] == {
        "rows": 5, "complete": True, "skipped": [],
        "shards": [{"file": "train-00000.parquet", "rows": 2, "first": 0, "last": 1},
                   {"file": "train-00001.parquet", "rows": 2, "first": 2, "last": 3},
                   {"file": "train-00002.parquet", "rows": 1, "first": 4, "last": 4}]}
    assert indices(tmp_path / "at") == [[0, 1], [2, 3], [4]]
    assert result["out"] == str(tmp_path / "at") and result["written"] == 5
    assert result["splits"] == {"train": {"rows": 5, "shards": 3, "skipped": 0}} and 0 <= result["seconds"] < 600
    # One byte more: two rows stay under it, the third reaches it (in every shard, each counted from 0).
    write(tmp_path / "over" / "nested", {"train": blob_rows(6)}, shard_size_mb=(2 * ROW_BYTES + 1) / MB)
    assert indices(tmp_path / "over" / "nested") == [[0, 1, 2], [3, 4, 5]]


def test_a_shard_closes_at_shard_rows(tmp_path):
    write(tmp_path / "two", {"train": blob_rows(5), "test": blob_rows(2)}, shard_rows=2)
    assert indices(tmp_path / "two") == [[0, 1], [2, 3], [4]] and indices(tmp_path / "two", "test") == [[0, 1]]
    write(tmp_path / "size-only", {"train": blob_rows(5)})  # 256 MB by default: one shard
    assert indices(tmp_path / "size-only") == [[0, 1, 2, 3, 4]]


def test_shard_size_must_be_positive(tmp_path):
    for size in (0, -1.5):
        with pytest.raises(ValueError) as info:
            write(tmp_path / "x", {"train": blob_rows(1)}, shard_size_mb=size)
        assert str(info.value) == f"--shard-size-mb must be > 0, got {size}"
    assert not (tmp_path / "x").exists()
    write(tmp_path / "x", {"train": blob_rows(1)}, shard_size_mb=1e-9)  # any positive size: a row per shard
    assert indices(tmp_path / "x") == [[0]]


def test_samples_that_cannot_be_stored_are_recorded_as_skipped(tmp_path):
    result = write(tmp_path / "s", {"train": blob_rows(6, absent=(1, 5))}, shard_rows=2)
    split = record(tmp_path / "s")["splits"]["train"]
    assert split["skipped"] == [1, 5] and split["rows"] == 4
    assert split["shards"] == [{"file": "train-00000.parquet", "rows": 2, "first": 0, "last": 2},
                               {"file": "train-00001.parquet", "rows": 2, "first": 3, "last": 4}]
    assert result["splits"]["train"] == {"rows": 4, "shards": 2, "skipped": 2}
    # A rerun starts after the last skipped sample when it comes after the last shard: nothing read again.
    calls: list[int] = []
    again = write(tmp_path / "s", {"train": blob_rows(6, absent=(1, 5), calls=calls)}, shard_rows=2)
    assert calls == [] and again["written"] == 0 and record(tmp_path / "s")["splits"]["train"]["skipped"] == [1, 5]


def test_a_rerun_writes_only_the_shards_a_kill_lost(tmp_path):
    out = tmp_path / "r"
    write(out, {"train": blob_rows(6)}, shard_rows=2)
    meta = record(out)
    lost = meta["splits"]["train"]["shards"].pop()  # killed before the last shard was recorded
    meta["splits"]["train"]["rows"] -= lost["rows"]
    meta["splits"]["train"]["complete"] = False
    (out / SHARDS_META).write_text(json.dumps(meta))
    kept = {name: (out / "train" / name).stat().st_mtime_ns for name in ("train-00000.parquet", "train-00001.parquet")}
    (out / "train" / "train-00002.parquet.mmviews-tmp").write_bytes(b"half a shard")
    (out / "train" / "notes.mmviews-tmp").write_text("not a shard of ours")
    calls: list[int] = []
    result = write(out, {"train": blob_rows(6, calls=calls)}, shard_rows=2)
    assert calls == [4, 5] and result["written"] == 2
    assert result["splits"]["train"] == {"rows": 6, "shards": 3, "skipped": 0}
    assert {name: (out / "train" / name).stat().st_mtime_ns for name in kept} == kept
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        "notes.mmviews-tmp", "train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    assert record(out)["splits"]["train"]["complete"] and indices(out) == [[0, 1], [2, 3], [4, 5]]


def test_a_folder_that_is_not_a_shard_folder_is_refused(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    with pytest.raises(FileExistsError) as info:
        write(out, {"train": blob_rows(1)})
    assert str(info.value) == (f"{out} exists and is not a mmviews shard folder (no {SHARDS_META}); "
                               "choose another --output")
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", {"train": blob_rows(1)})  # an empty folder is taken
    assert indices(tmp_path / "empty") == [[0]]


def test_another_source_is_refused_or_replaced_with_overwrite(tmp_path):
    out = tmp_path / "o"
    write(out, {"train": blob_rows(3), "test": blob_rows(2)}, shard_rows=2)
    (out / "train" / "notes.txt").write_text("a user's file")
    before = record(out)
    other = {**SOURCE, "options": {"columns": {"blob": "other"}}}
    with pytest.raises(FileExistsError) as info:
        write_shards(out, {"train": blob_rows(1)}, source=other, columns={"blob": "waveform"}, labels={}, progress=False)
    assert str(info.value) == (f"{out} holds shards of another source or options ({SHARDS_META} differs); "
                               "pass --overwrite to replace them, or choose another --output")
    assert record(out) == before
    (out / "test" / "test-00000.parquet").unlink()  # a listed file the user removed already
    write_shards(out, {"train": blob_rows(1)}, source=other, columns={"blob": "waveform"}, labels={}, progress=False,
                 overwrite=True)
    meta = record(out)
    assert meta["source"] == other and list(meta["splits"]) == ["train"] and meta["splits"]["train"]["rows"] == 1
    # The files of the old record are gone (the test split's too); a file it did not list stays.
    assert sorted(p.name for p in (out / "train").iterdir()) == ["notes.txt", "train-00000.parquet"]
    assert list((out / "test").iterdir()) == [] and indices(out) == [[0]]


def test_the_record_keeps_the_array_shapes_and_a_change_is_another_source(tmp_path):
    out = tmp_path / "shapes"
    write(out, {"train": blob_rows(1)}, shapes={"vec": (None, 4)})
    meta = record(out)
    assert meta["shapes"] == {"vec": [None, 4]}
    assert {k: meta[k] for k in ("kind", "version", "source", "columns", "labels")} == {
        "kind": "mmviews-parquet-shards", "version": 1, "source": SOURCE, "columns": {"blob": "waveform"}, "labels": {}}
    write(out, {"train": blob_rows(1)}, shapes={"vec": [None, 4]})  # the same: accepted
    with pytest.raises(FileExistsError, match="another source or options"):
        write(out, {"train": blob_rows(1)}, shapes={"vec": [2, 4]})
    write(tmp_path / "none", {"train": blob_rows(1)}, shapes={})
    assert "shapes" not in record(tmp_path / "none")  # records of sources without arrays stay as they were


def test_row_groups_hold_about_row_group_bytes(tmp_path, monkeypatch):
    write(tmp_path / "one", {"train": blob_rows(6)})
    assert pq.ParquetFile(tmp_path / "one" / "train" / "train-00000.parquet").metadata.num_row_groups == 1
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 2 * ROW_BYTES)
    write(tmp_path / "three", {"train": blob_rows(6)})
    metadata = pq.ParquetFile(tmp_path / "three" / "train" / "train-00000.parquet").metadata
    assert [metadata.row_group(k).num_rows for k in range(metadata.num_row_groups)] == [2, 2, 2]
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 1)  # smaller than a row: a row per group, never 0
    write(tmp_path / "tiny", {"train": blob_rows(2)})
    assert pq.ParquetFile(tmp_path / "tiny" / "train" / "train-00000.parquet").metadata.num_row_groups == 2


def test_progress_bar_per_split(tmp_path, capsys):
    write(tmp_path / "quiet", {"train": blob_rows(3)})
    assert capsys.readouterr().err == ""
    write(tmp_path / "p", {"train": blob_rows(3)}, progress=True)
    err = capsys.readouterr().err
    assert "train -> parquet: 100%" in err and "3/3" in err and "sample/s" in err
    out = tmp_path / "resumed"
    write(out, {"train": blob_rows(4)}, shard_rows=2)
    meta = record(out)
    meta["splits"]["train"]["shards"].pop()
    (out / SHARDS_META).write_text(json.dumps(meta))
    write(out, {"train": blob_rows(4)}, shard_rows=2, progress=True)
    assert "2/4" in capsys.readouterr().err  # the bar starts where the recorded shards end


def test_the_dataset_card(tmp_path):
    meta = {"source": {"dataset": "toy", "root": "/data/toy", "options": {"fold": 1}},
            "columns": {"frames": "jpeg_frames", "flow_x": "flow_images", "audio": "flac_track", "text": "sequence",
                        "text_ids": "tokens", "raw_text": "text", "img": "image", "snd": "waveform", "vec": "array",
                        "other": "something new"},
            "labels": {"class": "label"},
            "splits": {"train": {"rows": 5, "shards": [{}, {}]}, "test": {"rows": 1, "shards": [{}]}}}
    assert shards.dataset_card(meta).splitlines() == [
        "# toy as Parquet shards", "",
        "Written by `mmviews prepare toy ... --format parquet` from `/data/toy`.",
        "One row per sample; `mmviews_index` is the sample's index in the source split.", "",
        "| column | content |", "|---|---|",
        "| `frames` | list of JPEG images, every frame of the clip in order (RGB) |",
        "| `flow_x` | list of grayscale JPEG images, one flow component per frame pair, uint8 = (f + 20) * 255 / 40 |",
        "| `audio` | the clip's whole audio track, FLAC 24-bit mono 16 kHz (null: no audio track) |",
        "| `text` | float32 [len, D] feature sequence (valid steps only; null: absent) |",
        "| `text_ids` | int64 token ids |",
        "| `raw_text` | string |",
        "| `img` | Image(): the original encoded image file |",
        "| `snd` | bytes of an audio file (WAV/FLAC; decode with soundfile) |",
        "| `vec` | float32 list |",
        "| `other` | something new |",
        "| `label` | label `class` |", "",
        "| split | rows | shards |", "|---|---|---|", "| train | 5 | 2 |", "| test | 1 | 1 |", "",
        "Read with mmviews (`data.name: hf`, `data.root: <this folder>`, `data.options.format: parquet`,",
        "`data.streaming: true` to stream) or with `datasets.load_dataset(\"parquet\", data_files=\"<split>/*.parquet\")`.",
        'Options used: `{"fold": 1}`.']
    write(tmp_path / "w", {"train": blob_rows(2)})
    assert (tmp_path / "w" / "README.md").read_text() == shards.dataset_card(record(tmp_path / "w"))
    assert "Options used: `{}`." in shards.dataset_card({**meta, "source": {"dataset": "toy", "root": "r"}})


def test_read_shards_meta_names_a_foreign_record(tmp_path):
    assert shards.read_shards_meta(tmp_path) is None  # a Parquet folder without a record
    path = tmp_path / SHARDS_META
    path.write_text(json.dumps({"kind": "something-else", "version": 1}))
    with pytest.raises(ValueError) as info:
        shards.read_shards_meta(tmp_path)
    assert str(info.value) == f"{path}: not a mmviews shard record (kind 'something-else', expected 'mmviews-parquet-shards')"
    path.write_text(json.dumps({"kind": "mmviews-parquet-shards", "version": 2}))
    with pytest.raises(ValueError) as info:
        shards.read_shards_meta(str(tmp_path))
    assert str(info.value) == f"{path}: shard format version 2, this mmviews reads 1"
    path.write_text(json.dumps({"kind": "mmviews-parquet-shards", "version": 1, "splits": {}}))
    assert shards.read_shards_meta(tmp_path) == {"kind": "mmviews-parquet-shards", "version": 1, "splits": {}}


def test_default_shards_path_is_beside_the_source():
    assert shards.default_shards_path("/data/ucf101") == Path("/data/ucf101-parquet")
    assert shards.default_shards_path(Path("mosi.pkl")) == Path("mosi.pkl-parquet")


def test_flac_bytes_is_24_bit_mono_at_the_given_rate():
    wav = np.linspace(-0.9, 0.9, 1000)  # float64 in: stored as float32
    data = shards.flac_bytes(wav, 8000)
    info = sf.info(io.BytesIO(data))
    assert (info.format, info.subtype, info.samplerate, info.channels, info.frames) == ("FLAC", "PCM_24", 8000, 1, 1000)
    back, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 8000 and np.abs(back - wav.astype(np.float32)).max() <= 2.0 ** -23
    back, _ = sf.read(io.BytesIO(shards.flac_bytes(np.array([1.5, -3.0, 0.25], np.float32), 16000)), dtype="float32")
    assert np.abs(back - [1.0, -1.0, 0.25]).max() <= 2.0 ** -23  # clipped to full scale, not wrapped


def test_shape_fits_and_shape_text():
    assert shards.shape_fits((3, 4), [None, 4]) and shards.shape_fits([2, 4], (2, 4)) and shards.shape_fits((), [])
    assert not shards.shape_fits((3, 5), [None, 4]) and not shards.shape_fits((1, 4), [2, 4])
    assert not shards.shape_fits((4,), [None, 4]) and not shards.shape_fits((1, 4), [4])  # another rank
    assert shards.shape_text([None, 16]) == "[L, 16]" and shards.shape_text([None, None, 3]) == "[L, M, 3]"
    assert shards.shape_text([2, 4]) == "[2, 4]" and shards.shape_text([]) == "[]"


def test_array_feature_keeps_rank_and_fixed_lengths():
    import datasets

    f32 = datasets.Value("float32")
    cases = [
        (datasets.Value("int64"), f32, []),
        (datasets.List(datasets.Value("float64")), datasets.List(f32), [None]),
        (datasets.List(datasets.Value("float64"), length=4), datasets.List(f32, length=4), [4]),
        (datasets.LargeList(datasets.Value("int32")), datasets.List(f32), [None]),
        (datasets.List(datasets.List(datasets.Value("float32"), length=3)), datasets.List(datasets.List(f32, length=3)),
         [None, 3]),
        (datasets.Array2D(shape=(None, 4), dtype="float64"), datasets.List(datasets.List(f32, length=4)), [None, 4]),
        (datasets.Array3D(shape=(2, 3, 4), dtype="int64"),
         datasets.List(datasets.List(datasets.List(f32, length=4), length=3), length=2), [2, 3, 4]),
    ]
    for source, stored, shape in cases:
        got = shards.array_feature(source, "c")
        assert got == (stored, shape), (source, got)
        datasets.Features({"c": got[0]}).arrow_schema  # a schema pyarrow can build


@pytest.mark.parametrize("dtype", ["string", "large_string", "binary", "large_binary"])
def test_array_feature_refuses_non_numeric_columns_by_name(dtype):
    import datasets

    for feature in (datasets.Value(dtype), datasets.List(datasets.Value(dtype))):
        with pytest.raises(ValueError) as info:
            shards.array_feature(feature, "caption")
        assert str(info.value) == (f"column 'caption': cannot store {datasets.Value(dtype)} as a numeric array; map it "
                                   "to an image, audio or text column, or leave it out of --columns")


def test_hf_rows_encode_each_column_kind(tmp_path):
    """Images and audio given as files are stored as the files' bytes; audio given as arrays as
    FLAC at its sampling rate; arrays keep their shape; labels as they are."""
    import datasets

    (tmp_path / "files").mkdir()
    image_file, sound_file = tmp_path / "files" / "a.png", tmp_path / "files" / "a.wav"
    image_file.write_bytes(png_bytes(40, (3, 5)))
    sound_file.write_bytes(wav_bytes(300))
    wave = np.linspace(-0.5, 0.5, 200, dtype=np.float32)
    feats = datasets.Features({
        "img": datasets.Image(), "audio": {"array": datasets.List(datasets.Value("float32")),
                                           "sampling_rate": datasets.Value("int64")},
        "path_audio": datasets.Value("string"), "blob_audio": datasets.Value("binary"),
        "vec": datasets.Array2D(shape=(1, 3), dtype="float64"), "sentence": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["a", "b"])})
    source = datasets.Dataset.from_dict({
        "img": [{"bytes": None, "path": str(image_file)}, {"bytes": png_bytes(90), "path": None}],
        "audio": [{"array": wave, "sampling_rate": 8000}, {"array": wave[:50], "sampling_rate": 22050}],
        "path_audio": [str(sound_file)] * 2, "blob_audio": [wav_bytes(120), wav_bytes(130)],
        "vec": [np.ones((1, 3)), np.full((1, 3), 2.0)], "sentence": ["one", "two"], "label": [1, 0]}, features=feats)
    source.save_to_disk(str(tmp_path / "src"))
    ds = build_dataset("hf", root=str(tmp_path / "src"), split="train", labels={"class": "label"},
                       columns={"image": "img", "audio": "audio", "sound": "blob_audio",
                                "vec": "vec", "text": "sentence"})
    rows = shards.hf_split_rows(ds)
    assert rows.count == 2 and rows.shapes == {"vec": [1, 3]}
    first, second = rows.row(0), rows.row(1)
    assert first[INDEX_COLUMN] == 0 and second[INDEX_COLUMN] == 1
    assert first["img"] == {"bytes": image_file.read_bytes(), "path": "a.png"}  # the file's bytes, its name only
    assert second["img"]["bytes"] == png_bytes(90)
    for row, n, rate in ((first, 200, 8000), (second, 50, 22050)):
        back, got_rate = sf.read(io.BytesIO(row["audio"]), dtype="float32")
        assert got_rate == rate and sf.info(io.BytesIO(row["audio"])).format == "FLAC"
        assert np.abs(back - wave[:n]).max() <= 2.0 ** -23
    assert first["blob_audio"] == wav_bytes(120)
    assert first["vec"] == [[1.0, 1.0, 1.0]] and second["vec"] == [[2.0, 2.0, 2.0]]
    assert (first["sentence"], second["label"]) == ("one", 0) and first["label"] == 1
    assert set(rows.features) == {INDEX_COLUMN, "img", "audio", "blob_audio", "vec", "sentence", "label"}
    assert isinstance(rows.features["img"], datasets.Image) and rows.features["label"] == feats["label"]
    assert rows.features["audio"] == rows.features["blob_audio"] == datasets.Value("binary")
    assert rows.features["sentence"] == datasets.Value("string")
    assert rows.features["vec"] == datasets.List(datasets.List(datasets.Value("float32"), length=3), length=1)
    # A column that holds no numbers is named (its modality taken for an array by its type).
    tags = datasets.Dataset.from_dict({"tags": [["a"], ["b", "c"]]})
    tags.save_to_disk(str(tmp_path / "tags"))
    with pytest.raises(ValueError) as info:
        shards.hf_split_rows(build_dataset("hf", root=str(tmp_path / "tags"), split="train", columns={"tags": "tags"}))
    assert str(info.value).startswith("column 'tags': cannot store Value('string') as a numeric array")
    # An audio column of file paths: the file's bytes.
    paths = build_dataset("hf", root=str(tmp_path / "src"), split="train", columns={"audio": "path_audio"})
    assert shards.hf_split_rows(paths).row(1) == {INDEX_COLUMN: 1, "path_audio": sound_file.read_bytes(), "label": 0}


def test_hf_rows_name_a_row_whose_array_has_another_shape(tmp_path):
    import datasets

    feats = datasets.Features({"vec": datasets.List(datasets.Value("float32"), length=3), "flag": datasets.Value("bool")})
    source = datasets.Dataset.from_dict({"vec": [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]], "flag": [True, False]}, features=feats)
    source.save_to_disk(str(tmp_path / "src"))
    ds = build_dataset("hf", root=str(tmp_path / "src"), split="train", columns={"vec": "vec", "flag": "flag"})
    rows = shards.hf_split_rows(ds)
    flags = [rows.row(i)["flag"] for i in range(2)]  # numbers of any numeric type are stored as float32
    assert flags == [1.0, 0.0] and all(type(f) is float for f in flags)
    ds.ds = datasets.Dataset.from_dict({"vec": [[0.0, 1.0, 2.0], [0.0, 1.0]], "flag": [True, True]})  # a row of another length
    assert rows.row(0)["vec"] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError) as info:
        rows.row(1)
    assert str(info.value) == f"{tmp_path / 'src'} row 1, column 'vec': shape [2] differs from the column's [3]"


def test_sentiment_rows_of_a_one_sample_split(tmp_path):
    """Sequences as float32 [len, D] (an absent one with 0 steps: a null Array2D would read back
    as NaN), token ids as a list, the class label as int64 and the others as float32."""
    import datasets
    from test_data_pickle import mmsa_split
    from test_data_pickle import write as write_pickle

    train = mmsa_split(1)
    train["text_bert"][0, 1, :] = 0  # no token: absent token ids
    pkl = write_pickle(tmp_path / "mosi.pkl", {"train": train, "valid": mmsa_split(1), "test": mmsa_split(1)})
    modalities = ["text", "audio", "vision", "text_ids", "raw_text"]
    ds = build_dataset("mosi", root=str(pkl), split="train", modalities=modalities)
    sample = ds[0]
    assert sample["modalities"]["vision"] is None  # the first sample has no vision steps (mmsa_split)
    rows = shards.sentiment_split_rows(ds)
    assert rows.count == 1 and rows.shapes == {}
    assert dict(rows.features) == {
        INDEX_COLUMN: datasets.Value("int64"), "id": datasets.Value("string"),
        "text": datasets.Array2D(shape=(None, 768), dtype="float32"), "audio": datasets.Array2D(shape=(None, 5), dtype="float32"),
        "vision": datasets.Array2D(shape=(None, 20), dtype="float32"), "text_ids": datasets.List(datasets.Value("int64")),
        "raw_text": datasets.Value("string"), "sentiment": datasets.Value("float32"), "class": datasets.Value("int64")}
    row = rows.row(0)
    assert row[INDEX_COLUMN] == 0 and row["id"] == str(sample["id"]) and row["raw_text"] == sample["modalities"]["raw_text"]
    assert np.array_equal(row["audio"], sample["modalities"]["audio"].numpy()) and row["audio"].dtype == np.float32
    assert sample["modalities"]["text"] is None and row["text"].shape == (0, 768)  # no token: no text steps either
    assert row["vision"].shape == (0, 20) and row["vision"].dtype == np.float32
    assert sample["modalities"]["text_ids"] is None and row["text_ids"] is None
    assert (row["sentiment"], row["class"]) == (sample["labels"]["sentiment"], sample["labels"]["class"])


def test_hf_rows_of_image_and_audio_folders_hold_the_files_bytes(tmp_path):
    """imagefolder / audiofolder sources give a path and no bytes: the shard holds the file's bytes
    (and the image's file name, not the path of the machine that wrote it)."""
    for label, value in (("cat", 30), ("dog", 220)):
        (tmp_path / "img" / "train" / label).mkdir(parents=True)
        (tmp_path / "img" / "train" / label / f"{label}.png").write_bytes(png_bytes(value, (3, 4)))
        (tmp_path / "aud" / "train" / label).mkdir(parents=True)
        (tmp_path / "aud" / "train" / label / f"{label}.wav").write_bytes(wav_bytes(100 + value))
    images = shards.hf_split_rows(build_dataset("hf", root=tmp_path / "img", split="train", format="imagefolder"))
    assert [images.row(i)["image"] for i in range(2)] == [
        {"bytes": png_bytes(30, (3, 4)), "path": "cat.png"}, {"bytes": png_bytes(220, (3, 4)), "path": "dog.png"}]
    sounds = shards.hf_split_rows(build_dataset("hf", root=tmp_path / "aud", split="train", format="audiofolder"))
    assert [sounds.row(i)["audio"] for i in range(2)] == [wav_bytes(130), wav_bytes(320)]


def test_hf_audio_arrays_without_a_rate_are_taken_at_16_khz(tmp_path):
    import datasets

    wave = np.linspace(-0.25, 0.25, 160, dtype=np.float32)
    feats = datasets.Features({"audio": {"array": datasets.List(datasets.Value("float32"))}})
    datasets.Dataset.from_dict({"audio": [{"array": wave}]}, features=feats).save_to_disk(str(tmp_path / "src"))
    rows = shards.hf_split_rows(build_dataset("hf", root=str(tmp_path / "src"), split="train", columns={"audio": "audio"}))
    back, rate = sf.read(io.BytesIO(rows.row(0)["audio"]), dtype="float32")
    assert rate == shards.AUDIO_RATE == 16000 and np.abs(back - wave).max() <= 2.0 ** -23


def test_hf_audio_structs_of_bytes_or_path(tmp_path):
    """An audio column stored as {bytes, path} (as Parquet exports of datasets' Audio() hold it):
    the bytes where present, else the file's."""
    import datasets

    (tmp_path / "a.wav").write_bytes(wav_bytes(140))
    feats = datasets.Features({"audio": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}})
    datasets.Dataset.from_dict({"audio": [{"bytes": None, "path": str(tmp_path / "a.wav")},
                                          {"bytes": wav_bytes(150), "path": "elsewhere.wav"}]},
                               features=feats).save_to_disk(str(tmp_path / "src"))
    rows = shards.hf_split_rows(build_dataset("hf", root=str(tmp_path / "src"), split="train", columns={"audio": "audio"}))
    assert [rows.row(i)["audio"] for i in range(2)] == [wav_bytes(140), wav_bytes(150)]


def crafted_store(path: Path, clips: dict, failed: dict | None = None) -> Path:
    """A video store in the on-disk format ``mmviews prepare`` writes (manifest.json and each
    clip's JPEG files), made by hand: every stored file holds its own name, so a shard that
    copies the wrong file is seen."""
    import mmviews.data.video_store as video_store

    manifest = {"kind": video_store.STORE_KIND, "version": video_store.STORE_VERSION, "options": {"size": 0},
                "clips": {}, "failed": failed or {}}
    for k, (rel, entry) in enumerate(clips.items()):
        folder = path / f"clip{k}"
        folder.mkdir(parents=True)
        names = [f"img_{i:05d}.jpg" for i in range(1, entry["frames"] + 1)]
        names += [f"flow_{axis}_{i:05d}.jpg" for axis in "xy" for i in range(1, entry.get("flows", 0) + 1)]
        for name in names:
            (folder / name).write_bytes(f"{rel}/{name}".encode())
        manifest["clips"][rel] = {"dir": f"clip{k}", **entry}
    (path / video_store.MANIFEST).write_text(json.dumps(manifest))
    return path


def test_video_rows_copy_the_stores_files_of_the_listed_clips(tmp_path):
    """The rows of a split are the clips its list names (the fold and split lists given), each
    with every stored frame and flow image in order; a clip the store failed is skipped (None)."""
    import datasets

    from mmviews.data.video_store import VideoStore

    root, lists = tmp_path / "ucf", tmp_path / "lists"
    for name in ("Jump", "Run"):
        (root / name).mkdir(parents=True)
    lists.mkdir()
    (lists / "classInd.txt").write_text("1 Run\n2 Jump\n")  # not the folders' sorted order
    (lists / "trainlist01.txt").write_text("Run/b.mp4 1\n")
    (lists / "trainlist02.txt").write_text("Jump/a.mp4 2\nRun/bad.mp4 1\nRun/b.mp4 1\n")
    (lists / "testlist02.txt").write_text("Run/b.mp4\n")
    store = VideoStore(crafted_store(tmp_path / "ucf.mmstore", {  # where prepare puts the store of ucf
        "Jump/a.mp4": {"format": "jpeg", "frames": 3, "flows": 2, "fps": 25},
        "Run/b.mp4": {"format": "jpeg", "frames": 2, "fps": 10}},  # stored without flow (--flow none)
        failed={"Run/bad.mp4": "cannot decode"}))
    rows = shards.video_split_rows(root, "train", 2, store, dataset="ucf101", splits_dir=lists)
    assert rows.count == 3
    first = rows.row(0)
    assert {k: first[k] for k in (INDEX_COLUMN, "id", "class", "fps", "audio")} == {
        INDEX_COLUMN: 0, "id": "Jump/a.mp4", "class": 1, "fps": 25.0, "audio": None}  # no video file: no track
    assert first["frames"] == [f"Jump/a.mp4/img_{i:05d}.jpg".encode() for i in (1, 2, 3)]
    assert first["flow_x"] == [f"Jump/a.mp4/flow_x_{i:05d}.jpg".encode() for i in (1, 2)]
    assert first["flow_y"] == [f"Jump/a.mp4/flow_y_{i:05d}.jpg".encode() for i in (1, 2)]
    assert rows.row(1) is None  # the clip the store could not decode
    last = rows.row(2)
    assert (last["id"], last["class"], last["flow_x"], last["flow_y"]) == ("Run/b.mp4", 0, [], [])
    test = shards.video_split_rows(root, "test", 2, store, dataset="ucf101", splits_dir=lists)
    assert test.count == 1 and test.row(0)["id"] == "Run/b.mp4"
    assert shards.video_split_rows(root, "train", 1, store, dataset="ucf101", splits_dir=lists).count == 1
    # HMDB-51's lists beside UCF-101's: the dataset named says which are read (and its class order: sorted).
    (lists / "Jump_test_split2.txt").write_text("a.mp4 2\n")
    hmdb = shards.video_split_rows(root, "test", 2, store, dataset="hmdb51", splits_dir=lists)
    assert hmdb.count == 1 and (hmdb.row(0)["id"], hmdb.row(0)["class"]) == ("Jump/a.mp4", 0)
    binary = datasets.Sequence(datasets.Value("binary"))
    assert dict(rows.features) == {
        INDEX_COLUMN: datasets.Value("int64"), "id": datasets.Value("string"), "class": datasets.Value("int64"),
        "fps": datasets.Value("float32"), "frames": binary, "flow_x": binary, "flow_y": binary,
        "audio": datasets.Value("binary")}
    arrays = VideoStore(crafted_store(tmp_path / "npy-store", {"Run/b.mp4": {"format": "npy", "frames": 2, "fps": 10}}))
    with pytest.raises(ValueError) as info:
        shards.video_split_rows(root, "test", 2, arrays, dataset="ucf101", splits_dir=lists).row(0)
    assert str(info.value) == (f"{tmp_path / 'npy-store'}: Parquet shards copy the store's JPEG files; this store holds "
                               "npy arrays (prepare the store with --format jpeg first)")
