"""`mmviews prepare ucf101|hmdb51` on damaged and messy folders: truncated videos,
short clips (each threshold at its boundary and one frame past it), the content fingerprint's
exact bytes, UCF-101 and HMDB-51 side by side, missing clips, a store copied with ``cp -r``, and a
SIGKILLed prepare (the kill itself: ``test_data_video_store.py::test_prepare_resumes_after_sigkill``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_data_video_store import kill_prepare_mid_run, make_folder, write_video

from mmviews.data import prepare
from mmviews.data.video import VideoFolder
from mmviews.data.video_store import (
    MANIFEST,
    REPORT_FILE,
    default_store_path,
    prepare_video_store,
    read_manifest,
    source_fingerprint,
)


def write_h264(path: Path, n_frames: int, size: tuple[int, int] = (96, 128)) -> None:
    """A panning texture as H.264 (libx264) in an AVI, as re-encoded UCF-101 / HMDB-51 copies are."""
    import av
    import cv2

    h, w = size
    rng = np.random.default_rng(1)
    texture = cv2.resize(rng.integers(0, 256, ((h + n_frames) // 6, (w + n_frames) // 6, 3), dtype=np.uint8),
                         (w + n_frames, h + n_frames), interpolation=cv2.INTER_CUBIC)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(n_frames):
            pixels = np.ascontiguousarray(texture[i // 2:i // 2 + h, i:i + w])
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def cut_avi(path: Path, keep: float, mid_frame: bool) -> None:
    """Cut an AVI the way an interrupted download or copy does: the header (and its frame count)
    stays, the frame data stops about ``keep`` of the way through, the index at the end is gone.
    The cut falls between two frames' chunks, or (``mid_frame``) after the first byte of a frame
    (which FFmpeg's decoder then refuses: decoding stops on an error)."""
    data = path.read_bytes()
    movi, index = data.find(b"movi"), data.find(b"idx1")
    assert 0 < movi < index, f"{path}: not an AVI with an index"
    chunk = data.find(b"00dc", movi + int((index - movi) * keep))  # the next frame's chunk header
    assert 0 < chunk < index
    path.write_bytes(data[:chunk + 8 + 1] if mid_frame else data[:chunk])


def count_frames(path: Path) -> tuple[int, int, bool]:
    """``(frames the header states, frames that decode, whether decoding stopped on an error)``,
    read with PyAV directly (independently of mmviews)."""
    import av

    decoded, error = 0, False
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        try:
            for _ in container.decode(stream):
                decoded += 1
        except av.error.FFmpegError:
            error = True
    return int(stream.frames), decoded, error


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time (to prove nothing changed)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def run_prepare(capsys, *args: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    rc = prepare.run(parser.parse_args(list(args)))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def write_ucf_lists(folder: Path, train: list[str], test: list[str], classes: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classInd.txt").write_text("".join(f"{i} {c}\n" for i, c in enumerate(classes, 1)))
    (folder / "trainlist01.txt").write_text("".join(f"{rel} 1\n" for rel in train))
    (folder / "testlist01.txt").write_text("".join(f"{rel}\n" for rel in test))


# --------------------------------------------------------------------------- truncated and short clips


def test_truncated_and_short_clips_are_reported_and_listed(tmp_path, capsys):
    root = make_folder(tmp_path / "data" / "UCF-101", {"Jump": [12, 5]})  # v_Jump_1: 5 frames, short for 8
    (root / "Run").mkdir()
    silent, broken = root / "Run/v_Run_0.avi", root / "Run/v_Run_1.avi"
    write_h264(silent, 50)
    cut_avi(silent, 0.5, mid_frame=False)  # decoding just stops early
    write_video(broken, 50, size=(96, 128))
    cut_avi(broken, 0.5, mid_frame=True)  # decoding stops on the cut frame, with an error
    declared_s, decoded_s, error_s = count_frames(silent)
    declared_b, decoded_b, error_b = count_frames(broken)
    # the crafted damage, as a user met it: the header states 50 frames, far fewer decode
    assert (declared_s, declared_b) == (50, 50) and 0 < decoded_s < 40 and 0 < decoded_b < 40
    assert not error_s and error_b
    clips = ["Jump/v_Jump_0.avi", "Jump/v_Jump_1.avi", "Run/v_Run_0.avi", "Run/v_Run_1.avi"]
    write_ucf_lists(root.parent / "ucfTrainTestlist", clips, clips[:1], ["Jump", "Run"])
    before = snapshot(root)
    store = tmp_path / "store"

    rc, out, err = run_prepare(capsys, "ucf101", str(root), "--out", str(store), "--workers", "0", "--format", "npy",
                               "--size", "0")
    assert rc == 1 and "problems: 1" in out and "2 truncated clips" in out  # a problem, not "problems: 0"
    assert "truncated (stored as decoded): 2" in out
    assert f"Run/v_Run_0.avi: {decoded_s} of 50 frames decode" in out
    # short: fewer frames than one view needs (8), the truncated clips included when they are
    short = {rel: {"decoded": n, "needed": 8} for rel, n in
             (("Jump/v_Jump_1.avi", 5), ("Run/v_Run_0.avi", decoded_s), ("Run/v_Run_1.avi", decoded_b)) if n < 8}
    assert f"short (fewer than --num-frames 8 frames): {len(short)}" in out and "Jump/v_Jump_1.avi: 5 frames" in out
    # one clean line per damaged clip on stderr, no Python warning text
    lines = [ln for ln in err.splitlines() if "v_Run_" in ln]
    assert len(lines) == 2 and all(ln.startswith("warning: truncated video ") for ln in lines)
    assert "UserWarning" not in err
    # the manifest (what training reads) and the report file say the same, with the numbers
    manifest = read_manifest(store)
    truncated = {"Run/v_Run_0.avi": {"declared": 50, "decoded": decoded_s},
                 "Run/v_Run_1.avi": {"declared": 50, "decoded": decoded_b}}
    assert {rel: {k: v for k, v in t.items() if k != "error"} for rel, t in manifest["truncated"].items()} == truncated
    # the decode error is recorded for the clip whose decoding stopped on one
    assert ["error" in t for t in manifest["truncated"].values()] == [False, True]
    assert manifest["short"] == short and manifest["failed"] == {}
    assert f"report: {store / REPORT_FILE}" in out
    report = json.loads((store / REPORT_FILE).read_text())
    assert report["truncated"] == manifest["truncated"] and report["short"] == manifest["short"]
    # what decodes is stored (all of it), and nothing was written into the dataset folder
    frames = np.load(store / manifest["clips"]["Run/v_Run_0.avi"]["dir"] / "frames.npy")
    assert frames.shape[0] == decoded_s == manifest["clips"]["Run/v_Run_0.avi"]["frames"]
    assert snapshot(root) == before

    # a rerun lists them again (from the stored entries), with the frames one view needs now
    rc, out, _ = run_prepare(capsys, "ucf101", str(root), "--out", str(store), "--workers", "0", "--format", "npy",
                             "--size", "0", "--num-frames", "4")
    assert rc == 1 and "prepared now: 0" in out and "truncated (stored as decoded): 2" in out
    assert read_manifest(store)["short"] == {rel: {"decoded": v["decoded"], "needed": 4} for rel, v in short.items()
                                             if v["decoded"] < 4}


def test_truncated_at_the_tolerance_and_one_frame_past_it():
    """A clip is truncated when more than TRUNCATION_TOLERANCE (2) frames of those its container
    states fail to decode, or decoding stopped on an error: 48 of 50 decoded is not truncated, 47 is."""
    from mmviews.data.video_store import TRUNCATION_TOLERANCE, bad_clip_keys, truncation

    assert TRUNCATION_TOLERANCE == 2  # the figures below are written for it
    assert truncation({"declared_frames": 50, "frames": 50}) is None
    assert truncation({"declared_frames": 50, "frames": 48}) is None
    assert truncation({"declared_frames": 50, "frames": 47}) == {"declared": 50, "decoded": 47}
    assert truncation({"declared_frames": None, "frames": 3}) is None  # no stated count: nothing to compare
    assert truncation({"declared_frames": 50, "frames": 50, "decode_error": "bad frame"}) == {
        "declared": 50, "decoded": 50, "error": "bad frame"}
    clips = {"a.avi": {"declared_frames": 10, "frames": 8}, "b.avi": {"declared_frames": 10, "frames": 7}}
    assert bad_clip_keys(clips, 1)["truncated"] == {"b.avi": {"declared": 10, "decoded": 7}}


def test_short_at_num_frames_and_one_frame_below(tmp_path, capsys):
    """A clip is short when it has fewer frames than one view needs (--num-frames): with 8, a clip
    of 7 frames is listed and one of 8 is not; with 7, neither (the manifest and the report)."""
    from mmviews.data.video_store import bad_clip_keys

    assert bad_clip_keys({"a.avi": {"frames": 8}, "b.avi": {"frames": 7}}, 8)["short"] == {
        "b.avi": {"decoded": 7, "needed": 8}}
    root = make_folder(tmp_path / "UCF-101", {"Jump": [7, 8]})
    clips = ["Jump/v_Jump_0.avi", "Jump/v_Jump_1.avi"]
    write_ucf_lists(tmp_path / "ucfTrainTestlist", clips, clips, ["Jump"])
    store = tmp_path / "store"
    for needed, short in ((8, {"Jump/v_Jump_0.avi": {"decoded": 7, "needed": 8}}), (7, {})):
        rc, out, err = run_prepare(capsys, "ucf101", str(root), "--out", str(store), "--workers", "0", "--format", "npy",
                                   "--size", "16", "--flow", "none", "--num-frames", str(needed))
        assert rc == 0, out + err
        assert f"short (fewer than --num-frames {needed} frames): {len(short)}" in out
        assert read_manifest(store)["short"] == short
        assert json.loads((store / REPORT_FILE).read_text())["short"] == short


# --------------------------------------------------------------------------- split lists


def test_ucf_and_hmdb_side_by_side_read_their_own_split_lists(tmp_path, capsys):
    data = tmp_path / "data"  # the common layout: both datasets and their split folders in one parent
    ucf = make_folder(data / "UCF-101", {"Jump": [3], "Run": [3]})
    write_ucf_lists(data / "ucfTrainTestlist", ["Jump/v_Jump_0.avi"], ["Run/v_Run_0.avi"], ["Jump", "Run"])
    hmdb = make_folder(data / "hmdb51", {"clap": [3], "wave": [3]})
    hmdb_lists = data / "testTrainMulti_7030_splits"
    hmdb_lists.mkdir()
    (hmdb_lists / "clap_test_split1.txt").write_text("v_clap_0.avi 2\n")
    (hmdb_lists / "wave_test_split1.txt").write_text("v_wave_0.avi 1\n")

    h = VideoFolder(hmdb, "train", dataset="hmdb51", audio=False, store=False)
    assert h.splits_dir == hmdb_lists and h.clips == [("wave", "wave/v_wave_0.avi")] and h.classes == ["clap", "wave"]
    assert str(hmdb_lists) in h.source_note  # what `mmviews train` prints at its start ("data: ...")
    u = VideoFolder(ucf, "train", dataset="ucf101", audio=False, store=False)
    assert u.splits_dir == data / "ucfTrainTestlist" and u.clips == [("Jump", "Jump/v_Jump_0.avi")]

    rc, out, _ = run_prepare(capsys, "hmdb51", str(hmdb), "--check-only", "--out", str(tmp_path / "index.json"))
    assert rc == 0 and f"split lists: {hmdb_lists}" in out
    assert "train (fold 1): 1 clips listed, 0 missing" in out and "test (fold 1): 1 clips listed, 0 missing" in out
    # --splits-dir names another folder: used, and printed
    mine = tmp_path / "my_splits"
    mine.mkdir()
    (mine / "clap_test_split1.txt").write_text("v_clap_0.avi 1\n")  # train and test swapped
    (mine / "wave_test_split1.txt").write_text("v_wave_0.avi 2\n")
    rc, out, _ = run_prepare(capsys, "hmdb51", str(hmdb), "--check-only", "--out", str(tmp_path / "index.json"),
                             "--splits-dir", str(mine))
    assert rc == 0 and f"split lists: {mine}" in out
    assert VideoFolder(hmdb, "train", dataset="hmdb51", splits_dir=mine, audio=False, store=False).clips == [
        ("clap", "clap/v_clap_0.avi")]
    # without its own lists HMDB-51 does not fall back to UCF-101's: one line naming what it expected
    shutil.rmtree(hmdb_lists)
    rc, out, err = run_prepare(capsys, "hmdb51", str(hmdb), "--check-only", "--out", str(tmp_path / "index.json"))
    assert rc == 2 and out == "" and err.count("\n") == 1 and "*_test_split1.txt (HMDB-51)" in err and "UCF" not in err
    rc, out, err = run_prepare(capsys, "hmdb51", str(hmdb), "--check-only", "--splits-dir", str(tmp_path / "nope"))
    assert rc == 2 and err == f"mmviews prepare: error: splits_dir {tmp_path / 'nope'}: no such folder\n"


# --------------------------------------------------------------------------- missing clips


def test_missing_clips_are_named_and_listed_outside_the_dataset(tmp_path, capsys):
    root = make_folder(tmp_path / "UCF-101", {"Jump": [9]})
    gone = [f"Jump/v_Jump_g{k:02d}.avi" for k in range(1, 8)]
    write_ucf_lists(tmp_path / "ucfTrainTestlist", ["Jump/v_Jump_0.avi", *gone], ["Jump/v_Jump_g99.avi"], ["Jump"])
    before = snapshot(root)
    rc, out, _ = run_prepare(capsys, "ucf101", str(root), "--workers", "0")
    store = default_store_path(root)
    report = store / REPORT_FILE
    assert rc == 1 and "train: 7 listed clips missing" in out and "test: 1 listed clips missing" in out
    assert "missing (listed, not on disk): 8" in out
    assert all(f"train: {rel}" in out for rel in gone[:5])  # the first few by name
    assert f"... and 3 more: all in {report}" in out
    assert json.loads(report.read_text())["missing"] == {"train": gone, "test": ["Jump/v_Jump_g99.avi"]}
    assert "prepared now: 1" in out
    # --check-only writes its index beside the dataset, not inside it (as it used to)
    rc, out, _ = run_prepare(capsys, "ucf101", str(root), "--check-only")
    index = tmp_path / "UCF-101.mmviews-index.json"
    assert rc == 1 and f"index: {index}" in out and f"... and 3 more: all in {index}" in out
    assert json.loads(index.read_text())["splits"]["train"]["missing"] == gone
    assert snapshot(root) == before


# --------------------------------------------------------------------------- a copied store


def check_copied_store_stays_current(tmp_path: Path, monkeypatch) -> None:
    """A dataset and its store copied with ``cp -r`` (new modification times): the store still
    serves every clip and a rerun redoes nothing; a video whose content changed (same size) is
    stale. (Shared with the mutation test.)"""
    original = make_folder(tmp_path / "orig" / "ucf", {"Jump": [9, 10]})
    prepare_video_store(original, image_format="npy", size=0, workers=0, progress=False)
    (tmp_path / "copy").mkdir()
    for name in ("ucf", "ucf.mmstore"):
        subprocess.run(["cp", "-r", str(tmp_path / "orig" / name), str(tmp_path / "copy" / name)], check=True)
    root = tmp_path / "copy" / "ucf"
    video = root / "Jump/v_Jump_1.avi"
    assert video.stat().st_mtime_ns != (original / "Jump/v_Jump_1.avi").stat().st_mtime_ns  # cp -r: new times

    ds = VideoFolder(root, "all", num_frames=4, size=16, audio=False)
    with monkeypatch.context() as m:  # the copied store serves every clip: no video is decoded
        m.setattr("mmviews.data.video.read_video_window", lambda path, *a, **k: pytest.fail(f"{path} decoded"))
        for i in range(len(ds)):
            ds[i]
    assert ds.num_stale == 0
    summary = prepare_video_store(root, image_format="npy", size=0, workers=0, progress=False)
    assert (summary["already_done"], summary["prepared"]) == (2, 0)

    data = bytearray(video.read_bytes())  # a changed video of the same size is still stale
    data[len(data) // 2] ^= 0xFF
    video.write_bytes(bytes(data))
    ds = VideoFolder(root, "all", num_frames=4, size=16, audio=False)
    with pytest.warns(UserWarning, match="v_Jump_1.avi changed"):
        ds[1]
    assert ds.num_stale == 1
    summary = prepare_video_store(root, image_format="npy", size=0, workers=0, progress=False)
    assert (summary["already_done"], summary["prepared"]) == (1, 1)
    entry = json.loads((default_store_path(root) / MANIFEST).read_text())["clips"]["Jump/v_Jump_1.avi"]
    assert entry["source_fingerprint"] == source_fingerprint(video)  # of the changed source video, recorded anew


def test_store_copied_with_cp_r_stays_current(tmp_path, monkeypatch):
    check_copied_store_stays_current(tmp_path, monkeypatch)


@pytest.mark.filterwarnings("ignore:.*changed after the store")
def test_copy_check_fails_when_staleness_is_by_mtime_only(tmp_path, monkeypatch):
    """Mutation test: the guard above fails when only size and mtime decide staleness."""
    from mutations import apply_break

    apply_break("mtime_only_staleness", monkeypatch.setattr)
    with pytest.raises(pytest.fail.Exception, match="decoded"):
        check_copied_store_stays_current(tmp_path, monkeypatch)


def check_fingerprint_coverage(tmp_path: Path, size_in_blocks: float) -> None:
    """The content fingerprint of a video (what decides that a copy with new modification times
    is still the prepared video) is its size and the SHA-256 of its first and last
    FINGERPRINT_BYTES bytes: a change of any byte of those blocks, or of the size, is seen;
    a change between them is not (by design: hashing whole videos would read the whole dataset at
    every start; a re-encode or a cut changes the container header, the index at the end and
    the size). Files of half a block to 3.25 blocks: the two blocks overlap, touch, or leave a gap."""
    import hashlib

    import mmviews.data.video_store as video_store
    from mmviews.data.video_store import FINGERPRINT_BYTES as BLOCK

    fingerprint_of = video_store.source_fingerprint  # looked up now: the mutation test replaces it
    size = int(size_in_blocks * BLOCK) + (3 if size_in_blocks == 3.25 else 0)
    data = bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    path = tmp_path / "clip.avi"
    path.write_bytes(data)
    fingerprint = fingerprint_of(path)
    head, tail = data[:BLOCK], data[max(0, size - BLOCK):]
    covered = set(range(min(size, BLOCK))) | set(range(max(0, size - BLOCK), size))
    if size <= 2 * BLOCK:  # one block, or two that overlap or touch: every byte once
        assert fingerprint == f"{size}:{hashlib.sha256(data).hexdigest()}"
    else:
        assert fingerprint == f"{size}:{hashlib.sha256(head + tail).hexdigest()}"
    positions = {0, BLOCK - 1, BLOCK, size - BLOCK - 1, size - BLOCK, size - 1, size // 2}
    for position in sorted(p for p in positions if 0 <= p < size):
        changed = bytearray(data)
        changed[position] ^= 0x01
        path.write_bytes(bytes(changed))
        seen = fingerprint_of(path) != fingerprint
        assert seen == (position in covered), (size, position, seen)
    path.write_bytes(data + b"\0")
    assert fingerprint_of(path).split(":")[0] == str(size + 1)


@pytest.mark.parametrize("size_in_blocks", [0.5, 1, 1.5, 2, 3.25])
def test_fingerprint_covers_exactly_the_first_and_last_block(tmp_path, size_in_blocks):
    check_fingerprint_coverage(tmp_path, size_in_blocks)


def test_fingerprint_check_fails_when_the_last_block_is_not_hashed(tmp_path, monkeypatch):
    """Mutation test (tests/README.md): the fingerprint hashes the first block only."""
    from mutations import apply_break

    apply_break("fingerprint_first_block_only", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        check_fingerprint_coverage(tmp_path, 3.25)


# --------------------------------------------------------------------------- SIGKILL


def test_sigkill_check_fails_when_workers_ignore_their_parent(tmp_path):
    """Mutation test of the orphan check in ``test_prepare_resumes_after_sigkill``: workers that
    do not watch their parent outlive a SIGKILLed prepare, and the check sees them (they are
    then killed, so the test leaves no process behind)."""
    root = make_folder(tmp_path / "ucf", {"A": [12, 13, 14], "B": [12, 15, 16]})
    survivors, _ = kill_prepare_mid_run(root, tmp_path / "store", tmp_path / "markers", tmp_path / "slow.py",
                                        break_name="orphan_prepare_workers")
    assert len(survivors) >= 2  # the two workers (held in their commit, or waiting for work)


# --------------------------------------------------------------------------- train start


def test_train_prints_the_split_lists_it_read(tmp_path, capsys):
    from test_train_utils import write_recipe

    from mmviews.cli import main

    data = tmp_path / "data"
    hmdb = make_folder(data / "hmdb51", {"clap": [4, 4, 4], "wave": [4, 4, 4]})
    write_ucf_lists(data / "ucfTrainTestlist", ["clap/v_clap_0.avi"], ["wave/v_wave_0.avi"], ["clap", "wave"])
    lists = data / "testTrainMulti_7030_splits"
    lists.mkdir()
    for cls in ("clap", "wave"):
        (lists / f"{cls}_test_split1.txt").write_text(f"v_{cls}_0.avi 1\nv_{cls}_1.avi 1\nv_{cls}_2.avi 2\n")
    head = {"kind": "linear"}
    recipe = write_recipe(tmp_path / "tiny_hmdb.yaml", {
        "name": "tiny_hmdb", "seed": 0,
        "data": {"name": "hmdb51", "root": str(hmdb), "batch_size": 2, "eval_batch_size": 2, "val_split": None,
                 "test_split": "test",
                 "options": {"num_frames": 2, "size": 16, "audio": False, "store": False}},
        "views": [{"modality": "video"}, {"modality": "video"}],
        "encoder": {"embed_dim": 8},
        "adapters": {"video": {"type": "small_cnn", "channels": [4], "head": head}},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": 1},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 100, "progress_bar": False},
    })
    line = f"data: hmdb51 {hmdb}: 4 clips, split lists from {lists}"  # HMDB-51's lists, not UCF-101's beside them
    assert main(["train", str(recipe), "--check"]) == 0
    assert line in capsys.readouterr().out
    assert main(["train", str(recipe), "--output", str(tmp_path / "run")]) == 0
    assert line in capsys.readouterr().out


def test_parquet_prepare_reads_the_datasets_own_split_lists(tmp_path, capsys):
    """`prepare hmdb51 --format parquet` next to UCF-101 writes HMDB-51's split, not UCF-101's."""
    import datasets

    data = tmp_path / "data"
    make_folder(data / "UCF-101", {"Jump": [3]})
    write_ucf_lists(data / "ucfTrainTestlist", ["Jump/v_Jump_0.avi"], ["Jump/v_Jump_0.avi"], ["Jump"])
    hmdb = make_folder(data / "hmdb51", {"clap": [3, 3], "wave": [3]})
    lists = data / "testTrainMulti_7030_splits"
    lists.mkdir()
    (lists / "clap_test_split1.txt").write_text("v_clap_0.avi 1\nv_clap_1.avi 2\n")
    (lists / "wave_test_split1.txt").write_text("v_wave_0.avi 1\n")
    out = tmp_path / "hmdb-parquet"
    rc, text, err = run_prepare(capsys, "hmdb51", str(hmdb), "--format", "parquet", "--workers", "0", "--size", "32",
                                "--output", str(out), "--flow", "none")
    assert rc == 0, text + err
    ids = datasets.load_dataset("parquet", data_files=str(out / "train" / "*.parquet"), split="train")["id"]
    assert sorted(ids) == ["clap/v_clap_0.avi", "wave/v_wave_0.avi"]
    # the same with the lists moved elsewhere and named by --splits-dir
    moved = tmp_path / "my_lists"
    shutil.move(str(lists), moved)
    rc, text, err = run_prepare(capsys, "hmdb51", str(hmdb), "--format", "parquet", "--workers", "0", "--size", "32",
                                "--output", str(tmp_path / "again"), "--flow", "none", "--splits-dir", str(moved))
    assert rc == 0, text + err
    ids = datasets.load_dataset("parquet", data_files=str(tmp_path / "again" / "test" / "*.parquet"),
                                split="train")["id"]
    assert ids == ["clap/v_clap_1.avi"]
