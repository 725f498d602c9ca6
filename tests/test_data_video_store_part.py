"""Video at speed: seek-only decoding, the prepared frame/flow store (resume, bad files, safety)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mmviews.data import video_io
from mmviews.data.video import VideoFolder
from mmviews.data.video_io import probe_video, read_video_frames, read_video_window
from mmviews.data.video_store import (
    CLIP_ENTRY,
    MANIFEST,
    TMP_PREFIX,
    VideoStore,
    clear_video_store,
    default_store_path,
    prepare_video_store,
)

FLOW_STEP = 40.0 / 255.0  # one uint8 level of the stored flow, in pixels


def write_video(path: Path, n_frames: int, gop: int = 12, size: tuple[int, int] = (48, 64), seed: int = 0) -> None:
    """A smooth texture panning 1 px right and 1 px down every other frame (real motion for the
    flow, no wrap-around that the encoder would take for a scene cut), mpeg4 at 25 fps."""
    import av
    import cv2

    h, w = size
    rng = np.random.default_rng(seed)
    texture = cv2.resize(rng.integers(0, 256, ((h + n_frames) // 6, (w + n_frames) // 6, 3), dtype=np.uint8),
                         (w + n_frames, h + n_frames), interpolation=cv2.INTER_CUBIC)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=25)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.gop_size = gop
        for i in range(n_frames):
            x, y = i, i // 2
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(texture[y:y + h, x:x + w]), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def make_folder(root: Path, lengths: dict[str, list[int]], bad: str | None = None) -> Path:
    """``root/<class>/v_<class>_<k>.avi`` with the given frame counts, plus an unreadable ``bad`` file."""
    for cls, ns in lengths.items():
        (root / cls).mkdir(parents=True)
        for k, n in enumerate(ns):
            write_video(root / cls / f"v_{cls}_{k}.avi", n, seed=10 * sum(map(ord, cls)) + k)
    if bad is not None:
        (root / bad).write_bytes(b"this is not a video")
    return root


def _no_full_decode(path, *a, **k):
    raise AssertionError(f"{path}: fell back to the full decode")


# --------------------------------------------------------------------------- seek


@pytest.mark.parametrize("ext, gop", [("avi", 12), ("mp4", 50), ("mkv", 50)])
def test_seek_returns_the_frames_of_a_full_decode(tmp_path, monkeypatch, ext, gop):
    path = tmp_path / f"clip.{ext}"
    write_video(path, 80, gop=gop)
    full, fps = read_video_frames(path)
    import av

    with av.open(str(path)) as container:
        keyframes = [i for i, f in enumerate(container.decode(container.streams.video[0])) if f.key_frame]
    assert 50 in keyframes or gop != 50
    info = probe_video(path)
    assert info.num_frames == len(full) == 80 and info.fps == fps == 25.0
    # Matroska records no frame count: it is counted from the packets, not decoded.
    assert info.frames_from == ("packet scan" if ext == "mkv" else "metadata")
    monkeypatch.setattr(video_io, "read_video_frames", _no_full_decode)  # the seek path must not fall back
    for start in (0, 36, 46, 48, 50, 72):  # start, middle, across the keyframe at 50 (gop 50), end
        idx = np.arange(start, start + 8)
        stats: dict = {}
        frames, got, got_fps = read_video_window(path, lambda n: idx, stats=stats)
        assert np.array_equal(frames, full[idx]) and np.array_equal(got, idx) and got_fps == fps
        assert stats["method"] == "seek"
        # decoded from the keyframe at or before `start`, up to the window's last frame, no further
        keyframe = max(k for k in keyframes if k <= start)
        assert stats["decoded"] == start + 8 - keyframe
    # a clip shorter than the window repeats its last frame (VideoFolder's window), seek or not
    frames, got, _ = read_video_window(path, lambda n: np.clip(np.arange(n - 4, n + 4), 0, n - 1))
    assert np.array_equal(frames, full[[76, 77, 78, 79, 79, 79, 79, 79]])


def test_dataset_seek_equals_full_decode(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [40, 9], "Run": [61]})
    kw = dict(split="all", num_frames=8, size=(24, 32), flow="farneback", audio=False, store=False)
    seek, full = VideoFolder(root, decode="seek", **kw), VideoFolder(root, decode="full", **kw)
    for i in range(len(seek)):
        a, b = seek[i]["modalities"], full[i]["modalities"]
        assert torch.equal(a["video"], b["video"]) and torch.equal(a["flow"], b["flow"])


# --------------------------------------------------------------------------- the store


def _compare_with_on_the_fly(root: Path, fmt: str, monkeypatch) -> tuple[float, float]:
    kw = dict(split="all", num_frames=8, size=(24, 32), flow="farneback", audio=False)
    stored, fly = VideoFolder(root, **kw), VideoFolder(root, store=False, **kw)
    assert stored.store is not None and stored.store.options["format"] == fmt
    with monkeypatch.context() as m:  # the store must serve every clip: no video is decoded
        m.setattr("mmviews.data.video.read_video_window", _no_full_decode)
        items = [stored[i]["modalities"] for i in range(len(stored))]
    video_err = flow_err = 0.0
    for i, a in enumerate(items):
        b = fly[i]["modalities"]
        if fmt == "npy":
            assert torch.equal(a["video"], b["video"])
        video_err = max(video_err, float((a["video"] - b["video"]).abs().mean()))
        flow_err = max(flow_err, float((a["flow"] - b["flow"]).abs().max() if fmt == "npy"
                                       else (a["flow"] - b["flow"]).abs().mean()))
    return video_err, flow_err


def test_store_npy_gives_the_on_the_fly_tensors(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "ucf", {"Jump": [30, 5], "Run": [26]})  # the 5-frame clip is shorter than the window
    summary = prepare_video_store(root, image_format="npy", size=0, workers=0, progress=False)
    assert summary["prepared"] == 3 and summary["failed"] == {}
    manifest = json.loads((default_store_path(root) / MANIFEST).read_text())
    entry = manifest["clips"]["Jump/v_Jump_0.avi"]
    src = (root / "Jump/v_Jump_0.avi").stat()
    assert (entry["frames"], entry["flows"], entry["height"], entry["width"]) == (30, 29, 48, 64)
    assert (entry["source_size"], entry["source_mtime_ns"]) == (src.st_size, src.st_mtime_ns)
    assert entry["format"] == "npy" and entry["options"] == manifest["options"]
    assert np.load(default_store_path(root) / entry["dir"] / "flow.npy").shape == (29, 2, 48, 64)
    _, flow_err = _compare_with_on_the_fly(root, "npy", monkeypatch)
    # frames bitwise equal (above); flow: the uint8 rounding (half a level) scaled by the resize (1/2),
    # and Farneback's ~0.05 px on the repeated frames of the short clip (the store gives 0 there).
    assert flow_err < 0.07


def test_store_jpeg_and_resize(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "ucf", {"Jump": [20], "Run": [22]})
    prepare_video_store(root, image_format="jpeg", size=0, jpeg_quality=95, workers=0, progress=False)
    d = default_store_path(root) / "clips/Jump/v_Jump_0"
    assert sorted(p.name for p in d.iterdir())[:3] == ["clip.json", "flow_x_00001.jpg", "flow_x_00002.jpg"]
    assert len(list(d.glob("img_*.jpg"))) == 20 and len(list(d.glob("flow_y_*.jpg"))) == 19
    video_err, flow_err = _compare_with_on_the_fly(root, "jpeg", monkeypatch)
    assert video_err < 2 / 255 and flow_err < 2 * FLOW_STEP  # JPEG loss only
    # --size: short side 24 px, aspect kept; the dataset resizes from there
    out = tmp_path / "small.mmstore"
    prepare_video_store(root, out, size=24, workers=0, progress=False)
    store = VideoStore(out)
    assert (store.clips["Run/v_Run_0.avi"]["height"], store.clips["Run/v_Run_0.avi"]["width"]) == (24, 32)
    x = VideoFolder(root, split="all", num_frames=4, size=16, flow="farneback", audio=False, store=out)[0]["modalities"]
    assert x["video"].shape == (4, 3, 16, 16) and x["flow"].shape == (3, 2, 16, 16)


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from mmviews.data.video_store import prepare_video_store

    def hold_commit(rel):  # runs in the worker before each finished clip is renamed into place
        # The first clip to get here (an atomic claim across the worker processes) is committed;
        # every later one announces itself with a marker and waits to be killed, uncommitted.
        markers = Path(sys.argv[3])
        try:
            os.close(os.open(markers / "first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return
        except FileExistsError:
            (markers / ("holding-" + rel.replace("/", "_"))).write_text(rel)
            time.sleep(600)

    if __name__ == "__main__":
        import mmviews.data.video_store as video_store

        video_store._MANIFEST_SAVE_S = 1e9  # no periodic save: only the journal can list a finished clip
        if len(sys.argv) > 4:  # a break of tests/mutations.py (the tests folder is on PYTHONPATH)
            from mutations import apply_break

            apply_break(sys.argv[4])
        prepare_video_store(sys.argv[1], sys.argv[2], image_format="npy", size=0, workers=2, progress=False,
                            before_commit=hold_commit)
""")


def _running(procs: list) -> list:
    """The processes of ``procs`` still running (a zombie no one reaped has ended)."""
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def kill_prepare_mid_run(root: Path, store: Path, markers: Path, script: Path,
                         break_name: str | None = None) -> tuple[list, dict]:
    """Run a prepare (2 workers) until one clip is committed and recorded in the manifest and
    another is held before its commit, SIGKILL the prepare process alone (not its workers) and
    return ``(its workers still running 5 s later, the manifest as read then)``. Whatever
    happens, no process of it is left behind."""
    import psutil

    from mmviews.data.video_store import read_manifest

    script.write_text(_KILL_SCRIPT)
    markers.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(store), str(markers),
                             *([break_name] if break_name else [])], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    workers: list = []
    try:
        deadline = time.monotonic() + 120
        # wait until one clip is committed and another is written but held before its commit
        # (markers from the worker, so the state does not depend on timing) ...
        while not (_done_clips(store) and list(markers.glob("holding-*"))):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no clip held before its commit in 120 s"
            time.sleep(0.02)
        # ... and the prepare has recorded the committed clip (its journal line, the marker of that
        # moment; it comes within milliseconds: without it, the caller's check of the manifest fails)
        listed_by = time.monotonic() + 30
        while not (read_manifest(store) or {}).get("clips") and time.monotonic() < listed_by:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.02)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        os.kill(proc.pid, signal.SIGKILL)  # the prepare alone, mid-run: its workers must not outlive it
        proc.wait()
        until = time.monotonic() + 5.0  # dying with the parent takes milliseconds (PR_SET_PDEATHSIG)
        while _running(workers) and time.monotonic() < until:
            time.sleep(0.02)
        return _running(workers), read_manifest(store)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for worker in _running(workers):  # a failed (or broken) run leaves no process behind
            worker.kill()


def _done_clips(store: Path) -> list[Path]:
    return sorted(p.parent for p in store.glob(f"clips/*/*/{CLIP_ENTRY}") if not p.parent.name.startswith(TMP_PREFIX))


def test_prepare_resumes_after_sigkill(tmp_path):
    root = make_folder(tmp_path / "ucf", {"A": [12, 13, 14], "B": [12, 15, 16]})
    store = tmp_path / "store"
    survivors, manifest = kill_prepare_mid_run(root, store, tmp_path / "markers", tmp_path / "prepare_slowly.py")
    assert survivors == []  # the workers died with the prepare (none orphaned, blocked on a pipe)
    done = _done_clips(store)
    assert len(done) == 1  # the held clips were never committed
    # the manifest lists the finished clip (its journal line), not only what a periodic save had
    assert [store / e["dir"] for e in manifest["clips"].values()] == done
    assert list(store.glob(f"clips/*/{TMP_PREFIX}*"))  # killed while writing the next clip(s)
    before = {d: ((d / CLIP_ENTRY).stat().st_mtime_ns, (d / "frames.npy").stat().st_ino) for d in done}

    summary = prepare_video_store(root, store, image_format="npy", size=0, workers=0, progress=False)
    assert summary["already_done"] == len(done) and summary["prepared"] == 6 - len(done)
    for d, stamp in before.items():  # finished clips were not redone
        assert ((d / CLIP_ENTRY).stat().st_mtime_ns, (d / "frames.npy").stat().st_ino) == stamp
    assert not list(store.glob(f"clips/*/{TMP_PREFIX}*"))

    ref = tmp_path / "ref"
    prepare_video_store(root, ref, image_format="npy", size=0, workers=0, progress=False)
    got, want = json.loads((store / MANIFEST).read_text()), json.loads((ref / MANIFEST).read_text())
    assert got["clips"] == want["clips"] and len(got["clips"]) == 6
    for entry in want["clips"].values():
        for name in ("frames.npy", "flow.npy"):
            assert np.array_equal(np.load(store / entry["dir"] / name), np.load(ref / entry["dir"] / name))


def test_corrupt_video_skipped_or_refused(tmp_path, capsys):
    root = make_folder(tmp_path / "ucf", {"Jump": [10], "Run": [11]}, bad="Run/v_Run_9.avi")
    summary = prepare_video_store(root, tmp_path / "s1", workers=0, progress=False, on_error="skip")
    assert list(summary["failed"]) == ["Run/v_Run_9.avi"] and summary["prepared"] == 2
    err = capsys.readouterr().err  # one clean line per problem (not a UserWarning)
    assert [ln for ln in err.splitlines() if "v_Run_9.avi" in ln][0].startswith("warning: skipped unreadable video ")
    assert "v_Run_9.avi" in json.loads((tmp_path / "s1" / MANIFEST).read_text())["failed"]["Run/v_Run_9.avi"]
    with pytest.raises(ValueError, match="v_Run_9.avi"):
        prepare_video_store(root, tmp_path / "s2", workers=0, progress=False, on_error="raise")

    # the command line: lists checked, store written, the bad clip named, exit status 1
    import argparse

    from mmviews.data import prepare

    (root / "ucfTrainTestlist").mkdir()
    (root / "ucfTrainTestlist" / "trainlist01.txt").write_text("Jump/v_Jump_0.avi 1\nRun/v_Run_9.avi 2\n")
    (root / "ucfTrainTestlist" / "testlist01.txt").write_text("Run/v_Run_0.avi\n")
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    out = tmp_path / "cli.mmstore"
    rc = prepare.run(parser.parse_args(["ucf101", str(root), "--out", str(out), "--workers", "0", "--format", "npy"]))
    text = capsys.readouterr().out
    assert rc == 1 and "v_Run_9.avi" in text and "prepared now: 2" in text
    rc = prepare.run(parser.parse_args(["ucf101", str(root), "--out", str(tmp_path / "s3"), "--workers", "0",
                                        "--on-error", "raise"]))
    assert rc == 2 and "v_Run_9.avi" in capsys.readouterr().err
    # the dataset reads the store and leaves out the clip its manifest lists as failed; without
    # the store, that clip is decoded (raises, naming it)
    ds = VideoFolder(root, split="train", num_frames=4, size=16, audio=False, store=out)
    assert len(ds) == 1 and list(ds.excluded) == ["Run/v_Run_9.avi"]
    assert ds[0]["modalities"]["video"].shape == (4, 3, 16, 16)
    with pytest.raises(ValueError, match="v_Run_9.avi"):
        VideoFolder(root, split="train", num_frames=4, size=16, audio=False, store=False)[1]


def test_store_write_failure_stops_the_prepare(tmp_path, monkeypatch):
    import cv2

    from mmviews.data.video_store import StoreWriteError

    root = make_folder(tmp_path / "ucf", {"Jump": [6]})
    monkeypatch.setattr(cv2, "imwrite", lambda *args: False)  # e.g. a full disk: not an unreadable video
    with pytest.raises(StoreWriteError, match="img_00001.jpg: cannot write"):
        prepare_video_store(root, tmp_path / "store", workers=0, progress=False, on_error="skip")
    assert not list((tmp_path / "store").glob(f"clips/*/{TMP_PREFIX}*"))  # no half-written clip left


def test_stale_clip_is_redone_and_decoded_meanwhile(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [10, 12]})
    prepare_video_store(root, image_format="npy", size=0, workers=0, progress=False)
    write_video(root / "Jump/v_Jump_1.avi", 20, seed=5)  # the user replaces a video
    ds = VideoFolder(root, split="all", num_frames=4, size=16, audio=False)
    with pytest.warns(UserWarning, match="v_Jump_1.avi changed"):
        ds[1]
    assert ds.num_stale == 1
    summary = prepare_video_store(root, image_format="npy", size=0, workers=0, progress=False)
    assert (summary["already_done"], summary["prepared"]) == (1, 1)
    assert VideoStore(default_store_path(root)).clips["Jump/v_Jump_1.avi"]["frames"] == 20


def test_store_safety(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [8]})
    # a folder that is not a store: refused by name, with or without --overwrite, nothing deleted
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="mine is not a mmviews video store"):
            prepare_video_store(root, other, workers=0, progress=False, overwrite=overwrite)
    with pytest.raises(ValueError, match="mine is not a mmviews video store"):
        clear_video_store(other)
    assert (other / "thesis.tex").read_text() == "precious"
    with pytest.raises(ValueError, match="inside the video folder"):
        prepare_video_store(root, root / "store", workers=0, progress=False)

    store = tmp_path / "store"
    prepare_video_store(root, store, workers=0, progress=False)
    with pytest.raises(ValueError, match="--overwrite"):  # other options: refused without --overwrite
        prepare_video_store(root, store, image_format="npy", workers=0, progress=False)
    (store / "notes.txt").write_text("mine")  # files the user put in the store are never deleted
    summary = prepare_video_store(root, store, image_format="npy", size=0, workers=0, progress=False, overwrite=True)
    assert summary["prepared"] == 1 and (store / "notes.txt").read_text() == "mine"
    assert not list(store.glob("clips/*/*/*.jpg"))  # the old JPEG outputs were listed, hence removed
    clip = store / "clips/Jump/v_Jump_0"
    (clip / "extra.txt").write_text("mine too")
    with pytest.raises(ValueError, match=r"v_Jump_0: holds files mmviews did not write \(\['extra.txt'\]\)"):
        prepare_video_store(root, store, workers=0, progress=False, overwrite=True)
    assert (clip / "extra.txt").read_text() == "mine too" and (clip / CLIP_ENTRY).is_file()  # nothing deleted
    (clip / "extra.txt").unlink()
    # a clip folder in the way that mmviews did not write (no clip.json): named, left alone
    write_video(root / "Jump/v_Jump_1.avi", 8)
    (store / "clips/Jump/v_Jump_1").mkdir()
    with pytest.raises(ValueError, match="v_Jump_1 exists but was not written by mmviews"):
        prepare_video_store(root, store, image_format="npy", size=0, workers=0, progress=False)
    (store / "clips/Jump/v_Jump_1").rmdir()
    assert prepare_video_store(root, store, image_format="npy", size=0, workers=0, progress=False)["prepared"] == 1
    assert clear_video_store(store) == 2
    assert not (store / "clips").exists() and not (store / MANIFEST).exists() and (store / "notes.txt").exists()


def test_bench_data_video_smoke(capsys):
    import argparse

    from mmviews.bench import data as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--cases", "video", "--workers", "0", "--video-clips", "2", "--video-seconds", "0.8",
                              "--video-passes", "1"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])["video"]
    assert set(result["cases"]) == {"full+flow", "seek+flow", "store+flow", "full 0.4s", "seek 0.4s", "full 0.8s",
                                    "seek 0.8s", "full 1.6s", "seek 1.6s"}
    assert result["prepare"]["clips"] == 2 and set(result["targets"]) >= {"store_at_least_5x", "seek_independent_of_length"}
    assert "store vs on-the-fly" in out
