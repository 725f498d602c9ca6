"""Parquet shards (:mod:`mmviews.data.shards`, read by :mod:`mmviews.data.streaming`).

End to end: ``mmviews prepare ... --format parquet`` read back map-style and streamed gives the
map-style source's decoded tensors for every modality and column kind (token ids, vectors, arrays
with absent values, images, audio, text, labels), and the shards' schema keeps each array column's
rank and fixed lengths. The writer on tiny in-memory rows: where a shard closes, the record it keeps,
resuming after a kill, what a rerun refuses or replaces (never deleting what it did not write), row
groups, the dataset card, temp + rename (a failed write leaves no file under a shard's name), and
the one-line errors. Damage: a row group damaged inside a shard stops the run naming shard and row
group, or with ``on_error: skip`` is left out and counted in the run's last lines and reports."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
import yaml
from crafted_files import cli, one_line_error
from mutations import apply_break
from test_data_hf import png_bytes, wav_bytes
from test_data_pickle import mmsa_split, write
from test_data_video_audio import write_av

from mmviews.cli import main
from mmviews.data import build_dataset, shards
from mmviews.data.shards import INDEX_COLUMN, SHARDS_META, SplitRows, read_shards_meta, write_shards
from mmviews.data.streaming import ParquetShardDataset, StreamLoader


REPO = Path(__file__).resolve().parents[1]
# The audio window of the video file (seek) and the slice of the whole track stored as 24-bit FLAC:
# equal up to float32 rounding of the decode (see test_data_video_audio) and 2^-23 quantisation.
AUDIO_TOL = 2e-6
VIDEO_OPTIONS = dict(num_frames=4, size=24, flow="farneback", sample_rate=16000, max_audio_seconds=1.0)


def prepare(*args: str) -> subprocess.CompletedProcess:
    """``mmviews prepare ARGS`` in this process (the CLI's own entry point; no interpreter start-up)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["prepare", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def as_list(batch):
    """A collate function that keeps the sample dicts (picklable, for loader workers)."""
    return batch


def same_sample(a: dict, b: dict, where: str) -> None:
    assert a["index"] == b["index"] and a["labels"] == b["labels"], where
    assert a["modalities"].keys() == b["modalities"].keys(), where
    for m, x in a["modalities"].items():
        y = b["modalities"][m]
        if x is None or y is None:
            assert x is None and y is None, f"{where} {m}"
        elif isinstance(x, str):
            assert x == y, f"{where} {m}"
        elif isinstance(x, dict):
            assert all(torch.equal(x[k], y[k]) for k in x), f"{where} {m}"
        elif m == "audio" and x.ndim == 1 and x.dtype == torch.float32 and where.startswith("video"):
            assert x.shape == y.shape and (x - y).abs().max() <= AUDIO_TOL, f"{where} {m}"
        else:
            assert x.shape == y.shape and torch.equal(x, y), f"{where} {m}"


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    """A UCF-101-like folder (2 classes, split lists, one clip without audio) and its shards."""
    root = tmp_path_factory.mktemp("vid") / "ucf"
    clips = {"Jump/v_Jump_1.mp4": 1.6, "Jump/v_Jump_2.mp4": 0.8, "Run/v_Run_1.mp4": 1.2, "Run/v_Run_2.mp4": 1.0}
    for rel, seconds in clips.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        write_av(root / rel, seconds, audio=rel != "Run/v_Run_2.mp4")
    (root / "classInd.txt").write_text("1 Jump\n2 Run\n")
    (root / "trainlist01.txt").write_text("Jump/v_Jump_1.mp4 1\nRun/v_Run_1.mp4 2\nRun/v_Run_2.mp4 2\n")
    (root / "testlist01.txt").write_text("Jump/v_Jump_2.mp4\n")
    r = prepare("ucf101", str(root), "--format", "parquet", "--shard-size-mb", "0.001", "--workers", "0", "--size", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    return root, root.with_name("ucf-parquet")


def test_video_round_trip_every_modality(video):
    root, out = video
    meta = read_shards_meta(out)
    assert meta["splits"]["train"]["rows"] == 3 and len(meta["splits"]["train"]["shards"]) == 3  # 1 clip per shard
    assert (out / "README.md").is_file() and sorted(p.name for p in (out / "train").iterdir())[0] == "train-00000.parquet"
    ref = build_dataset("ucf101", root=str(root), split="train", **VIDEO_OPTIONS)
    assert ref.store is not None  # the map-style source reads the store prepare made first
    mapped = build_dataset("hf", root=str(out), split="train", fold=1, **VIDEO_OPTIONS)  # a video recipe's options
    with pytest.raises(ValueError, match="fold 1, not fold 2"):
        build_dataset("hf", root=str(out), split="train", fold=2, **VIDEO_OPTIONS)
    assert isinstance(mapped, ParquetShardDataset) and len(mapped) == 3
    assert mapped.modality_info() == ref.modality_info()
    for i in range(3):
        same_sample(ref[i], mapped[i], f"video map-style {i}")
    assert ref[2]["modalities"]["audio"] is None  # the clip without an audio track stays absent
    stream = build_dataset("hf", root=str(out), split="train", streaming=True, **VIDEO_OPTIONS)
    seen = [s for batch in StreamLoader(stream, 1, as_list, seed=3, drop_last=False) for s in batch]
    assert sorted(s["index"] for s in seen) == [0, 1, 2]
    for s in seen:
        same_sample(ref[s["index"]], s, f"video streamed {s['index']}")


def test_sentiment_round_trip(tmp_path):
    pkl = tmp_path / "mosi.pkl"
    write(pkl, {"train": mmsa_split(7), "valid": mmsa_split(3), "test": mmsa_split(4)})
    r = prepare("mosi", str(pkl), "--format", "parquet", "--output", str(tmp_path / "shards"), "--shard-size-mb", "0.01")
    assert r.returncode == 0, r.stdout + r.stderr
    mods = ["text", "audio", "vision", "text_ids", "raw_text"]
    ref = build_dataset("mosi", root=str(pkl), split="train", modalities=mods)
    stream = build_dataset("hf", root=str(tmp_path / "shards"), split="train", streaming=True)
    assert len(stream) == 7 and len(stream.shards.files) > 1
    seen = {s["index"]: s for b in StreamLoader(stream, 2, as_list, seed=0, drop_last=False) for s in b}
    assert sorted(seen) == list(range(7))
    for i, s in seen.items():
        same_sample(ref[i], s, f"sentiment {i}")
    info = stream.modality_info()
    assert info["audio"]["kind"] == "sequence" and info["audio"]["shape"][1] == ref.modality_info()["audio"]["shape"][1]


def test_hf_round_trip_and_resumable_write(tmp_path):
    import datasets

    feats = datasets.Features({"img": datasets.Image(), "snd": datasets.Value("binary"), "sentence": datasets.Value("string"),
                               "label": datasets.ClassLabel(names=["neg", "pos"])})
    n = 12
    train = datasets.Dataset.from_dict({"img": [{"bytes": png_bytes(20 * i, (4 + i % 3, 6)), "path": None} for i in range(n)],
                                        "snd": [wav_bytes(100 + 10 * i) for i in range(n)],
                                        "sentence": [f"sentence {i}" for i in range(n)], "label": [i % 2 for i in range(n)]},
                                       features=feats)
    root = tmp_path / "hfds"
    datasets.DatasetDict({"train": train}).save_to_disk(str(root))
    options = dict(columns={"image": "img", "audio": "snd", "text": "sentence"}, image_size=8, sample_rate=8000)
    ref = build_dataset("hf", root=str(root), split="train", **options)
    out = tmp_path / "hfds-parquet"
    cols = ("--columns", "image=img,audio=snd,text=sentence")
    r = prepare("hf", str(root), "--format", "parquet", "--shard-size-mb", "0.0005", *cols)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted((out / "train").glob("*.parquet"))
    assert len(files) > 2
    # Resumable: drop the last shard from the record (as if killed before it was recorded) and
    # leave a temporary file behind; a rerun rewrites only what is missing.
    meta = json.loads((out / SHARDS_META).read_text())
    before = {p.name: p.stat().st_mtime_ns for p in files}
    last = meta["splits"]["train"]["shards"].pop()
    meta["splits"]["train"]["rows"] -= last["rows"]
    meta["splits"]["train"]["complete"] = False
    (out / SHARDS_META).write_text(json.dumps(meta))
    (out / "train" / "train-00099.parquet.mmviews-tmp").write_bytes(b"half")
    r = prepare("hf", str(root), "--format", "parquet", "--shard-size-mb", "0.0005", "--json", *cols)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["written now"] == last["rows"]
    after = {p.name: p.stat().st_mtime_ns for p in sorted((out / "train").glob("*.parquet"))}
    assert after.keys() == before.keys() and not list((out / "train").glob("*.mmviews-tmp"))
    assert all(after[k] == before[k] for k in before if k != last["file"])
    # The same samples, map-style (format auto detects the shards) and streamed.
    mapped = build_dataset("hf", root=str(out), split="train", **options)
    for i in range(n):
        same_sample(ref[i], mapped[i], f"hf map-style {i}")
    stream = build_dataset("hf", root=str(out), split="train", streaming=True, format="parquet", **options)
    seen = [s for b in StreamLoader(stream, 5, as_list, seed=1, drop_last=False) for s in b]
    assert sorted(s["index"] for s in seen) == list(range(n))
    for s in seen:
        same_sample(ref[s["index"]], s, f"hf streamed {s['index']}")
    # Other columns into the same folder are refused, not mixed.
    r = prepare("hf", str(root), "--format", "parquet", "--columns", "image=img")
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_check_reads_every_modality_column_and_names_a_bad_one(tmp_path):
    """Opening a split (what `mmviews train --check` does) decodes its first rows: a damaged image is
    named by row and column there; with on_error: skip it is marked absent and counted."""
    import datasets

    from mmviews.config import DataConfig
    from mmviews.data.loaders import build_dataset_split

    feats = datasets.Features({"img": datasets.Image(), "sentence": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"img": [{"bytes": png_bytes(9), "path": None}, {"bytes": b"\x89PNG broken", "path": None}],
                                     "sentence": ["a", "b"]}, features=feats)
    ds.save_to_disk(str(tmp_path / "src"))
    r = prepare("hf", str(tmp_path / "src"), "--format", "parquet", "--columns", "image=img,text=sentence")
    assert r.returncode == 0, r.stdout + r.stderr
    data = DataConfig(name="hf", root=str(tmp_path / "src-parquet"), streaming=True,
                      options={"columns": {"image": "img", "text": "sentence"}})
    with pytest.raises(ValueError, match=r"row mmviews_index=1, column 'img': .*cannot read image"):
        build_dataset_split(data, "train")
    data.options["on_error"] = "skip"
    with pytest.warns(UserWarning, match="marked absent"):
        stream = build_dataset_split(data, "train")
    assert stream.num_skipped == 1


# ---------------------------------------------------------------------------------------------
# The writer on tiny in-memory rows: no fixture shared between tests, so each exercises the writer
# ---------------------------------------------------------------------------------------------
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


def write_blobs(out: Path, splits: dict[str, SplitRows], **options) -> dict:
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
    result = write_blobs(tmp_path / "at", {"train": blob_rows(5)}, shard_size_mb=2 * ROW_BYTES / MB)
    assert record(tmp_path / "at")["splits"]["train"] == {
        "rows": 5, "complete": True, "skipped": [],
        "shards": [{"file": "train-00000.parquet", "rows": 2, "first": 0, "last": 1},
                   {"file": "train-00001.parquet", "rows": 2, "first": 2, "last": 3},
                   {"file": "train-00002.parquet", "rows": 1, "first": 4, "last": 4}]}
    assert indices(tmp_path / "at") == [[0, 1], [2, 3], [4]]
    assert result["out"] == str(tmp_path / "at") and result["written"] == 5
    assert result["splits"] == {"train": {"rows": 5, "shards": 3, "skipped": 0}} and 0 <= result["seconds"] < 600
    # One byte more: two rows stay under it, the third reaches it (in every shard, each counted from 0).
    write_blobs(tmp_path / "over" / "nested", {"train": blob_rows(6)}, shard_size_mb=(2 * ROW_BYTES + 1) / MB)
    assert indices(tmp_path / "over" / "nested") == [[0, 1, 2], [3, 4, 5]]


def test_a_shard_closes_at_shard_rows(tmp_path):
    write_blobs(tmp_path / "two", {"train": blob_rows(5), "test": blob_rows(2)}, shard_rows=2)
    assert indices(tmp_path / "two") == [[0, 1], [2, 3], [4]] and indices(tmp_path / "two", "test") == [[0, 1]]
    write_blobs(tmp_path / "size-only", {"train": blob_rows(5)})  # 256 MB by default: one shard
    assert indices(tmp_path / "size-only") == [[0, 1, 2, 3, 4]]


def test_shard_size_must_be_positive(tmp_path):
    for size in (0, -1.5):
        with pytest.raises(ValueError) as info:
            write_blobs(tmp_path / "x", {"train": blob_rows(1)}, shard_size_mb=size)
        assert str(info.value) == f"--shard-size-mb must be > 0, got {size}"
    assert not (tmp_path / "x").exists()
    write_blobs(tmp_path / "x", {"train": blob_rows(1)}, shard_size_mb=1e-9)  # any positive size: a row per shard
    assert indices(tmp_path / "x") == [[0]]


def test_samples_that_cannot_be_stored_are_recorded_as_skipped(tmp_path):
    result = write_blobs(tmp_path / "s", {"train": blob_rows(6, absent=(1, 5))}, shard_rows=2)
    split = record(tmp_path / "s")["splits"]["train"]
    assert split["skipped"] == [1, 5] and split["rows"] == 4
    assert split["shards"] == [{"file": "train-00000.parquet", "rows": 2, "first": 0, "last": 2},
                               {"file": "train-00001.parquet", "rows": 2, "first": 3, "last": 4}]
    assert result["splits"]["train"] == {"rows": 4, "shards": 2, "skipped": 2}
    # A rerun starts after the last skipped sample when it comes after the last shard: nothing read again.
    calls: list[int] = []
    again = write_blobs(tmp_path / "s", {"train": blob_rows(6, absent=(1, 5), calls=calls)}, shard_rows=2)
    assert calls == [] and again["written"] == 0 and record(tmp_path / "s")["splits"]["train"]["skipped"] == [1, 5]


def test_a_rerun_writes_only_the_shards_a_kill_lost(tmp_path):
    out = tmp_path / "r"
    write_blobs(out, {"train": blob_rows(6)}, shard_rows=2)
    meta = record(out)
    lost = meta["splits"]["train"]["shards"].pop()  # killed before the last shard was recorded
    meta["splits"]["train"]["rows"] -= lost["rows"]
    meta["splits"]["train"]["complete"] = False
    (out / SHARDS_META).write_text(json.dumps(meta))
    kept = {name: (out / "train" / name).stat().st_mtime_ns for name in ("train-00000.parquet", "train-00001.parquet")}
    (out / "train" / "train-00002.parquet.mmviews-tmp").write_bytes(b"half a shard")
    (out / "train" / "notes.mmviews-tmp").write_text("not a shard of ours")
    calls: list[int] = []
    result = write_blobs(out, {"train": blob_rows(6, calls=calls)}, shard_rows=2)
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
        write_blobs(out, {"train": blob_rows(1)})
    assert str(info.value) == (f"{out} exists and is not a mmviews shard folder (no {SHARDS_META}); "
                               "choose another --output")
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    (tmp_path / "empty").mkdir()
    write_blobs(tmp_path / "empty", {"train": blob_rows(1)})  # an empty folder is taken
    assert indices(tmp_path / "empty") == [[0]]


def test_another_source_is_refused_or_replaced_with_overwrite(tmp_path):
    out = tmp_path / "o"
    write_blobs(out, {"train": blob_rows(3), "test": blob_rows(2)}, shard_rows=2)
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
    write_blobs(out, {"train": blob_rows(1)}, shapes={"vec": (None, 4)})
    meta = record(out)
    assert meta["shapes"] == {"vec": [None, 4]}
    assert {k: meta[k] for k in ("kind", "version", "source", "columns", "labels")} == {
        "kind": "mmviews-parquet-shards", "version": 1, "source": SOURCE, "columns": {"blob": "waveform"}, "labels": {}}
    write_blobs(out, {"train": blob_rows(1)}, shapes={"vec": [None, 4]})  # the same: accepted
    with pytest.raises(FileExistsError, match="another source or options"):
        write_blobs(out, {"train": blob_rows(1)}, shapes={"vec": [2, 4]})
    write_blobs(tmp_path / "none", {"train": blob_rows(1)}, shapes={})
    assert "shapes" not in record(tmp_path / "none")  # records of sources without arrays stay as they were


def test_row_groups_hold_about_row_group_bytes(tmp_path, monkeypatch):
    write_blobs(tmp_path / "one", {"train": blob_rows(6)})
    assert pq.ParquetFile(tmp_path / "one" / "train" / "train-00000.parquet").metadata.num_row_groups == 1
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 2 * ROW_BYTES)
    write_blobs(tmp_path / "three", {"train": blob_rows(6)})
    metadata = pq.ParquetFile(tmp_path / "three" / "train" / "train-00000.parquet").metadata
    assert [metadata.row_group(k).num_rows for k in range(metadata.num_row_groups)] == [2, 2, 2]
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 1)  # smaller than a row: a row per group, never 0
    write_blobs(tmp_path / "tiny", {"train": blob_rows(2)})
    assert pq.ParquetFile(tmp_path / "tiny" / "train" / "train-00000.parquet").metadata.num_row_groups == 2


def test_progress_bar_per_split(tmp_path, capsys):
    write_blobs(tmp_path / "quiet", {"train": blob_rows(3)})
    assert capsys.readouterr().err == ""
    write_blobs(tmp_path / "p", {"train": blob_rows(3)}, progress=True)
    err = capsys.readouterr().err
    assert "train -> parquet: 100%" in err and "3/3" in err and "sample/s" in err
    out = tmp_path / "resumed"
    write_blobs(out, {"train": blob_rows(4)}, shard_rows=2)
    meta = record(out)
    meta["splits"]["train"]["shards"].pop()
    (out / SHARDS_META).write_text(json.dumps(meta))
    write_blobs(out, {"train": blob_rows(4)}, shard_rows=2, progress=True)
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
    write_blobs(tmp_path / "w", {"train": blob_rows(2)})
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


# ---------------------------------------------------------------------------------------------
# Every column kind of an hf source, map-style and streamed; the shards' schema; prepare hf --recipe
# ---------------------------------------------------------------------------------------------
SHAPE_ROWS = 7
D = 4
# modality -> column of the source; the kind each stands for, as the cards list them
COLUMNS = {"ids": "ids", "vec": "vec", "pair": "pair", "row": "row", "seq": "seq", "fixed": "fixed", "image": "img",
           "audio": "snd", "text": "sentence"}
LABELS = {"class": "label", "score": "score"}
# The shape each array modality must come back with (row i); None: absent in that row.
SHAPES = {"ids": lambda i: (3 + i % 2,), "vec": lambda i: (D,), "pair": lambda i: (D,),
          "row": lambda i: None if i == 3 else (1, D),
          "seq": lambda i: None if i == 5 else (1 + i % 3, D), "fixed": lambda i: (2, D)}


def source_split(rows: int, offset: int):
    import datasets

    rng = np.random.default_rng(offset)
    feats = datasets.Features({
        "ids": datasets.List(datasets.Value("int64")),                    # token ids, varying length
        "vec": datasets.List(datasets.Value("float32")),                  # [D]
        "pair": datasets.List(datasets.Value("float32"), length=D),       # [D], its length fixed by the source
        "row": datasets.Array2D(shape=(1, D), dtype="float32"),            # [1, D], one absent
        "seq": datasets.List(datasets.List(datasets.Value("float64"))),    # [L, D] varying L, one absent
        "fixed": datasets.Array2D(shape=(2, D), dtype="float64"),          # fixed [2, D]
        "img": datasets.Image(), "snd": datasets.Value("binary"), "sentence": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["neg", "pos"]), "score": datasets.Value("float32"),
    })
    data = {
        "ids": [list(range(100 + i, 103 + i + i % 2)) for i in range(rows)],
        "vec": [rng.standard_normal(D).astype(np.float32) for _ in range(rows)],
        "pair": [rng.standard_normal(D).astype(np.float32) for _ in range(rows)],
        "row": [None if i == 3 else rng.standard_normal((1, D)).astype(np.float32) for i in range(rows)],
        "seq": [None if i == 5 else rng.standard_normal((1 + i % 3, D)).tolist() for i in range(rows)],
        "fixed": [rng.standard_normal((2, D)) for _ in range(rows)],
        "img": [{"bytes": png_bytes(30 * i + offset, (4 + i % 2, 5)), "path": None} for i in range(rows)],
        "snd": [wav_bytes(200 + 10 * i) for i in range(rows)],
        "sentence": [f"sentence {offset} {i}" for i in range(rows)],
        "label": [i % 2 for i in range(rows)], "score": [0.25 * i - 1 for i in range(rows)],
    }
    return datasets.Dataset.from_dict(data, features=feats)


def pairs(mapping: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in mapping.items())


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """The source (train and test splits), its shards (3 rows per shard), and every train
    sample read from the source, the map-style shards and the streamed shards."""
    import datasets

    folder = tmp_path_factory.mktemp("kinds")
    root, out = folder / "src", folder / "src-parquet"
    datasets.DatasetDict({"train": source_split(SHAPE_ROWS, 0), "test": source_split(3, 50)}).save_to_disk(str(root))
    r = prepare("hf", str(root), "--format", "parquet", "--shard-rows", "3", "--columns", pairs(COLUMNS),
                "--labels", pairs(LABELS))
    assert r.returncode == 0, r.stdout + r.stderr
    options = {"columns": COLUMNS, "labels": LABELS}
    ref = build_dataset("hf", root=str(root), split="train", **options)
    mapped = build_dataset("hf", root=str(out), split="train", **options)
    stream = build_dataset("hf", root=str(out), split="train", streaming=True, **options)
    streamed = {s["index"]: s for b in StreamLoader(stream, 2, as_list, drop_last=False) for s in b}
    assert len(stream.shards.files) == 3 and sorted(streamed) == list(range(SHAPE_ROWS))
    return {"root": root, "out": out, "ref": [ref[i] for i in range(SHAPE_ROWS)], "mapped": [mapped[i] for i in range(SHAPE_ROWS)],
            "streamed": [streamed[i] for i in range(SHAPE_ROWS)]}


def same_value(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    if isinstance(x, str):
        return x == y
    return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("modality", list(COLUMNS))
def test_every_column_kind_decodes_to_the_source_tensors(written, modality):
    for i in range(SHAPE_ROWS):
        x = written["ref"][i]["modalities"][modality]
        if modality in SHAPES:  # the source itself gives the shape the card promises
            expected = SHAPES[modality](i)
            assert (None if x is None else tuple(x.shape)) == expected, (modality, i)
        for reader in ("mapped", "streamed"):
            y = written[reader][i]["modalities"][modality]
            assert same_value(x, y), f"{reader} row {i} {modality}: {x!r} != {y!r}"


def test_labels_and_indices_round_trip(written):
    for reader in ("mapped", "streamed"):
        for i in range(SHAPE_ROWS):
            assert written[reader][i]["labels"] == written["ref"][i]["labels"] and written[reader][i]["index"] == i
    assert written["streamed"][1]["labels"] == {"class": 1, "score": -0.75}


def test_shapes_are_recorded(written):
    meta = json.loads((written["out"] / SHARDS_META).read_text())
    assert meta["shapes"] == {"ids": [None], "vec": [None], "pair": [D], "row": [1, D], "seq": [None, None],
                              "fixed": [2, D]}
    assert meta["splits"]["test"]["rows"] == 3


def arrow_dims(arrow_type: pa.DataType) -> tuple[list[int | None], pa.DataType]:
    """The nesting of an Arrow list column as per-sample dims (a fixed-size list's size, None for a
    list of any length) and the leaf type."""
    dims: list[int | None] = []
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        dims.append(arrow_type.list_size if pa.types.is_fixed_size_list(arrow_type) else None)
        arrow_type = arrow_type.value_type
    return dims, arrow_type


# The per-sample dims each array column of the fixture must have in the Parquet schema.
ARROW_DIMS = {"ids": [None], "vec": [None], "pair": [D], "row": [1, D], "seq": [None, None], "fixed": [2, D]}


def check_shard_schema(out: Path, columns: list[str]) -> None:
    """The guard: every shard of every split stores each array column as float32 lists nested to
    the column's rank, with the source's fixed lengths as fixed-size lists (what any Parquet reader
    sees, whatever mmviews_shards.json says), the varying dimensions as plain lists."""
    files = sorted(out.glob("*/*.parquet"))
    assert {f.parent.name for f in files} == {"train", "test"}
    for file in files:
        schema = pq.read_schema(file)
        for column in columns:
            assert arrow_dims(schema.field(column).type) == (ARROW_DIMS[column], pa.float32()), (
                file.name, column, schema.field(column).type)


def test_shard_schema_keeps_each_columns_rank_and_fixed_lengths(written):
    check_shard_schema(written["out"], list(ARROW_DIMS))


def test_schema_check_fails_when_fixed_lengths_are_dropped(written, tmp_path, monkeypatch):
    """Mutation test (tests/README.md): array columns written as lists of any length."""
    from mutations import apply_break

    apply_break("shards_drop_fixed_lengths", monkeypatch.setattr)
    out = tmp_path / "no-fixed-lengths"
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--columns", "pair=pair,fixed=fixed",
                "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    with pytest.raises(AssertionError, match="pair"):
        check_shard_schema(out, ["pair", "fixed"])


def test_flat_shards_of_an_older_mmviews_are_refused_by_column(written, tmp_path):
    """Shards as the writer before this fix left them (arrays flattened, no recorded shape): opening
    them names the column and gives the command that writes them again; that command works."""
    old = tmp_path / "old"
    meta = json.loads((written["out"] / SHARDS_META).read_text())
    del meta["shapes"]
    (old / "train").mkdir(parents=True)
    (old / SHARDS_META).write_text(json.dumps(meta))
    for shard in meta["splits"]["train"]["shards"]:
        table = pq.read_table(written["out"] / "train" / shard["file"])
        flat = pa.array([None if v is None else np.asarray(v, np.float32).reshape(-1).tolist()
                         for v in table.column("row").to_pylist()], pa.list_(pa.float32()))
        pq.write_table(table.set_column(table.schema.get_field_index("row"), "row", flat), old / "train" / shard["file"])
    with pytest.raises(ValueError) as info:
        build_dataset("hf", root=str(old), split="train", columns={"row": "row"})
    message = str(info.value)
    assert "column 'row' was written flat" in message and "\n" not in message
    command = shlex.split(message.split("write the shards again: ", 1)[1])
    assert command[:3] == ["mmviews", "prepare", "hf"] and "--overwrite" in command
    r = prepare(*command[2:])
    assert r.returncode == 0, r.stdout + r.stderr
    again = build_dataset("hf", root=str(old), split="train", columns={"row": "row"})
    assert again[0]["modalities"]["row"].shape == (1, D)


def test_prepare_parquet_uses_the_recipe_and_speaks_in_flags(written, tmp_path):
    recipe = {"name": "r", "data": {"name": "hf", "root": "elsewhere", "train_split": "train", "val_split": None,
                                    "test_split": None, "options": {"format": "parquet", "columns": {"feature": "row"},
                                                                    "labels": {"grade": "score"}}},
              "views": [{"modality": "feature"}, {"modality": "feature"}], "encoder": {"embed_dim": 8},
              "adapters": {"feature": {"type": "mlp", "input_dim": D}}, "objective": {"name": "mv_dhel"}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "from-recipe"
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--recipe", str(path), "--output", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((out / SHARDS_META).read_text())
    assert meta["columns"] == {"row": "array"} and meta["labels"] == {"grade": "score"}
    assert list(meta["splits"]) == ["train"]  # the recipe's splits only (no test split in it)
    # A wrong column in the recipe names its key; on the command line, the flag. Never Python syntax.
    recipe["data"]["options"]["columns"] = {"feature": "nope"}
    path.write_text(yaml.safe_dump(recipe))
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--recipe", str(path), "--output", str(tmp_path / "x"))
    assert r.returncode == 2 and f"key 'data.options.columns' of {path}" in r.stderr and "'nope'" in r.stderr
    r = prepare("hf", str(written["root"]), "--format", "parquet", "--output", str(tmp_path / "y"))  # no image/audio/text
    assert r.returncode == 2 and "--columns MODALITY=COLUMN" in r.stderr and "no modality columns" in r.stderr
    assert "={" not in r.stderr and "columns=" not in r.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()  # nothing half-written
    r = prepare("mosi", str(path), "--format", "parquet", "--recipe", str(path))
    assert r.returncode == 2 and "--recipe reads the data options of an hf recipe" in r.stderr


def test_streamed_recipe_is_checked_through_its_stream(written, tmp_path, capsys):
    """``train --check`` and ``prepare hf --recipe`` on a ``data.streaming: true`` recipe read a batch
    through the stream (a ShardStream cannot be indexed) and report in lines, no traceback."""
    recipe = {"name": "s", "seed": 0, "cpu": True,
              "data": {"name": "hf", "root": str(written["out"]), "streaming": True, "batch_size": 4, "val_split": None,
                       "test_split": "test", "options": {"columns": {"row": "row"}}},
              "views": [{"modality": "row"}, {"modality": "row"}], "encoder": {"embed_dim": 8},
              "adapters": {"row": {"type": "mlp", "input_dim": D, "head": {"kind": "linear"}}},
              "objective": {"name": "mv_dhel"}, "optimisation": {"epochs": 1}, "evaluation": {"tasks": []}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(recipe))
    rc, out, err = cli(capsys, "train", str(path), "--check")
    assert rc == 0 and "Traceback" not in err, err
    assert out.splitlines()[0] == f"{path}: OK (2 views: row_0, row_1; objective mv_dhel; {SHAPE_ROWS} training samples)"
    assert "activations" in out and "(measured)" in out  # a batch of the stream went through the encoder
    rc, out, err = cli(capsys, "prepare", "hf", str(written["out"]), "--recipe", str(path))
    assert rc == 0 and "Traceback" not in err, out + err
    assert "decoded: 7 of the first 7 rows (read through the stream)" in out
    assert "decoded: 3 of the first 3 rows (read through the stream)" in out  # the test split


# ---------------------------------------------------------------------------------------------
# A row group damaged inside a shard, its footer intact
# ---------------------------------------------------------------------------------------------
DAMAGED_ROWS, GROUP = 32, 4  # two shards of 16 rows; the first rewritten as 4 row groups of 4
BAD = 1  # the damaged row group: rows 4-7


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> dict:
    import datasets

    folder = tmp_path_factory.mktemp("damaged")
    rng = np.random.default_rng(0)
    feats = datasets.Features({"row": datasets.Array2D(shape=(1, D), dtype="float32"),
                               "label": datasets.ClassLabel(names=["a", "b"])})
    split = datasets.Dataset.from_dict({"row": [rng.standard_normal((1, D)).astype(np.float32) for _ in range(DAMAGED_ROWS)],
                                        "label": [i % 2 for i in range(DAMAGED_ROWS)]}, features=feats)
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
    assert len(mapped) == DAMAGED_ROWS - GROUP
    assert [mapped[i]["index"] for i in range(len(mapped))] == [i for i in range(DAMAGED_ROWS) if not 4 <= i < 8]
    expected = {f"{damaged['shard']}#{BAD}": GROUP}
    assert mapped.skipped_data()["row_groups"] == expected
    stream = build_dataset("hf", root=str(damaged["shards"]), split="train", streaming=True, on_error="skip")
    with pytest.warns(UserWarning, match=f"row group {BAD} of 4"):
        every = [s["index"] for b in StreamLoader(stream, 8, as_list, drop_last=False) for s in b]
    assert sorted(every) == [i for i in range(DAMAGED_ROWS) if not 4 <= i < 8]
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


# ---------------------------------------------------------------------------------------------
# Temp + rename: a failed write leaves no file under a shard's name
# ---------------------------------------------------------------------------------------------
WRITE_ROWS = 30  # --shard-rows 12: shards of 12, 12 and 6 rows


def _prepare(pkl: Path, out: Path):
    return prepare("mosi", str(pkl), "--format", "parquet", "--shard-rows", "12", "--output", str(out), "--splits", "train")


def check_failed_write_leaves_no_partial_shard(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second shard's write stops half-way (its first bytes on disk, then an OSError); the guard:
    the half-written file is under the temporary name only, the record lists the first shard only,
    a reader sees the 12 rows of that shard, and a rerun writes the rest and removes the leftover."""
    folder.mkdir()
    pkl, out = folder / "mosi.pkl", folder / "shards"
    write(pkl, {"train": mmsa_split(WRITE_ROWS), "valid": mmsa_split(3), "test": mmsa_split(3)})
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
    assert sorted(seen) == list(range(WRITE_ROWS))


def test_a_shard_failing_mid_write_leaves_no_partial_shard_and_a_rerun_completes(tmp_path, monkeypatch):
    check_failed_write_leaves_no_partial_shard(tmp_path / "w", monkeypatch)


def test_partial_shard_check_fails_when_shards_are_written_in_place(tmp_path, monkeypatch):
    """Mutation test (tests/README.md): shards written under their final name (no temporary name)."""
    apply_break("write_shards_in_place", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="train-00001.parquet"):
        check_failed_write_leaves_no_partial_shard(tmp_path / "w", monkeypatch)
