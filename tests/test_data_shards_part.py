"""Parquet shards: `mmviews prepare ... --format parquet`, read back map-style and streamed (the same
decoded tensors as the map-style source, every modality), resumable writing, damaged shards."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
from test_data_hf import png_bytes, wav_bytes
from test_data_pickle import mmsa_split, write
from test_data_video_audio import write_av

from mmviews.cli import main
from mmviews.data import build_dataset
from mmviews.data.shards import SHARDS_META, read_shards_meta
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
