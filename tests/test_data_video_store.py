"""The prepared video store (:mod:`mmviews.data.video_store`): seek-only decoding, preparing the
frame/flow store (resume, bad files, safety), what clearing a store deletes (only what its entries
account for), the names a clip folder may hold, reading flow from a store without any, and the
staleness checks. The worker checks run real forked processes: a worker whose prepare is already
gone exits at once with status 1, and one whose prepare is killed ends with it (``PR_SET_PDEATHSIG``
read back from the kernel, and the watch thread where that is missing)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mmviews.data import video_io
from mmviews.data.video import VideoFolder
from mmviews.data.video_io import probe_video, read_video_frames, read_video_window
from mmviews.fileio import DiskFullError
from mmviews.data.video_store import (
    CLIP_ENTRY,
    MANIFEST,
    STORE_KIND,
    TMP_PREFIX,
    VideoStore,
    _die_with_parent,
    _entry_files,
    _init_worker,
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


# ---------------------------------------------------------------------------------------------
# Workers that die with their prepare, clearing a store, clip folder names, staleness
# ---------------------------------------------------------------------------------------------
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2  # <linux/prctl.h>
WATCH_THREAD = "mmviews-parent-watch"


def death_signal() -> int:
    """The signal the kernel sends this process when its parent dies (0: none)."""
    value = ctypes.c_int(-1)
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) == 0
    return value.value


@pytest.fixture
def restore_death_signal():
    """Put back this process's parent-death signal (the tests set it on the test process)."""
    before = death_signal()
    yield
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, before, 0, 0, 0) == 0


def watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WATCH_THREAD]


# --------------------------------------------------------------------------- workers die with the prepare


@linux_only
def test_die_with_parent_asks_the_kernel_for_sigkill(restore_death_signal):
    threads = watch_threads()
    _die_with_parent(os.getppid())  # the test process as a worker of its own parent: it is alive
    assert death_signal() == signal.SIGKILL
    assert watch_threads() == threads  # the kernel does it: no thread to watch the parent


def test_die_with_parent_watches_the_parent_without_prctl(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")  # no PR_SET_PDEATHSIG there
    before = set(watch_threads())
    _die_with_parent(os.getppid())
    [thread] = [t for t in watch_threads() if t not in before]
    # a daemon: it neither keeps the worker alive nor ends it while the parent lives
    time.sleep(0.05)
    assert thread.daemon and thread.is_alive()


@linux_only
def test_init_worker_limits_opencv_threads_and_ties_the_worker_to_its_parent(restore_death_signal):
    import cv2

    threads = cv2.getNumThreads()
    try:
        cv2.setNumThreads(4)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
        _init_worker()  # in-process prepare (no parent to watch)
        assert cv2.getNumThreads() == 1 and death_signal() == 0
        _init_worker(os.getppid())
        assert death_signal() == signal.SIGKILL
    finally:
        cv2.setNumThreads(threads)


def reached_in_this_process(monkeypatch, platform: str) -> None:
    """Tie the test process to its own (living) parent as well: mutation testing (mutmut) runs
    a test against a function's mutants only where the test reaches the function in its own
    process, not only in the forked children below."""
    monkeypatch.setattr(sys, "platform", platform)
    _die_with_parent(os.getppid())
    monkeypatch.undo()


def forked(body, stderr_to: Path) -> int:
    """Run ``body()`` in a forked child (stderr into ``stderr_to``) and return its pid; the child
    exits 3 if ``body`` returns or raises."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            fd = os.open(stderr_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            body()
        except BaseException:  # noqa: BLE001 - any way out of the body is a failure, status 3
            import traceback

            traceback.print_exc()
        finally:
            os._exit(3)
    return pid


def exit_status(pid: int, within: float) -> int | None:
    """The exit status of the child ``pid`` if it ends within ``within`` seconds (else it is killed, None)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.parametrize("platform", [pytest.param("linux", marks=linux_only), "darwin"])
def test_worker_whose_parent_is_already_gone_exits_at_once(tmp_path, platform, monkeypatch, restore_death_signal):
    """A worker started for a prepare that died before it (its recorded parent is not its parent
    any more) exits with status 1 and no traceback, whether the kernel or a thread watches."""
    reached_in_this_process(monkeypatch, platform)

    def worker() -> None:
        sys.platform = platform
        _die_with_parent(-1)  # no process has this id: the parent is gone
        time.sleep(30)  # the worker's work, which it must not get to finish

    pid = forked(worker, tmp_path / "stderr")
    assert exit_status(pid, within=10) == 1, (tmp_path / "stderr").read_text()
    assert (tmp_path / "stderr").read_text() == ""


def process_ended(pid: int) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie its new parent did not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("platform", [pytest.param("linux", marks=linux_only), "darwin"])
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_worker_ends_when_its_prepare_is_killed(tmp_path, platform, monkeypatch, restore_death_signal):
    """A prepare (forked) starts a worker (forked from it) that ties itself to its parent; the
    prepare is SIGKILLed: the worker ends within seconds (the watch thread polls each second)."""
    reached_in_this_process(monkeypatch, platform)
    read_end, write_end = os.pipe()

    def prepare() -> None:
        os.close(read_end)
        worker_pid = os.fork()
        if worker_pid == 0:
            try:
                sys.platform = platform
                _die_with_parent(os.getppid())
                os.write(write_end, b"ready\n")
                time.sleep(60)
            finally:
                os._exit(3)
        os.write(write_end, f"{worker_pid}\n".encode())
        time.sleep(60)

    prepare_pid = forked(prepare, tmp_path / "stderr")
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        lines = [pipe.readline().strip(), pipe.readline().strip()]
    worker_pid = int(next(line for line in lines if line.isdigit()))
    try:
        assert "ready" in lines and not process_ended(worker_pid)
        time.sleep(0.3)
        assert not process_ended(worker_pid)  # tied to a living parent: it keeps working
        os.kill(prepare_pid, signal.SIGKILL)
        os.waitpid(prepare_pid, 0)
        deadline = time.monotonic() + 10
        while not process_ended(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process_ended(worker_pid), (tmp_path / "stderr").read_text()
    finally:
        if not process_ended(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


# --------------------------------------------------------------------------- clip folders and clearing


def test_entry_files_are_the_names_a_clip_folder_holds():
    assert _entry_files({"format": "jpeg", "frames": 3, "flows": 2}) == [
        CLIP_ENTRY, "img_00001.jpg", "img_00002.jpg", "img_00003.jpg",
        "flow_x_00001.jpg", "flow_y_00001.jpg", "flow_x_00002.jpg", "flow_y_00002.jpg"]
    assert _entry_files({"format": "jpeg", "frames": 1}) == [CLIP_ENTRY, "img_00001.jpg"]  # no flow recorded
    assert _entry_files({"format": "npy", "frames": 9, "flows": 8}) == [CLIP_ENTRY, "frames.npy", "flow.npy"]


@pytest.fixture
def jpeg_store(tmp_path) -> tuple[Path, Path]:
    """A JPEG store with flow of two clips (3 and 4 frames, 16 px)."""
    root = make_folder(tmp_path / "ucf", {"Jump": [3, 4]})
    store = tmp_path / "store"
    prepare_video_store(root, store, size=16, workers=0, progress=False)
    return root, store


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("name", ["img_00000.jpg", "img_00004.jpg", "flow_x_00000.jpg", "flow_y_00003.jpg"])
def test_clear_refuses_files_beyond_what_the_entry_accounts_for(jpeg_store, name):
    """A file named like ours but not among the clip's (one frame or flow past either end) is not
    ours: clearing refuses, names it, and deletes nothing (every folder is checked first)."""
    _, store = jpeg_store
    before = files_under(store)
    clip = store / "clips" / "Jump" / "v_Jump_0"  # 3 frames, 2 flows
    (clip / name).write_bytes(b"the user's")
    with pytest.raises(ValueError) as err:
        clear_video_store(store)
    assert str(err.value) == (f"{clip}: holds files mmviews did not write (['{name}']); nothing deleted, "
                              "move them away first")
    assert files_under(store) == before | {f"clips/Jump/v_Jump_0/{name}"}


def test_clear_finds_clip_folders_the_manifest_missed_and_keeps_the_users(jpeg_store):
    _, store = jpeg_store
    manifest = json.loads((store / MANIFEST).read_text())
    listed = manifest["clips"].pop("Jump/v_Jump_1.avi")  # a clip committed after the last manifest save
    (store / MANIFEST).write_text(json.dumps(manifest))
    (store / "clips" / "Jump" / "v_Jump_0" / CLIP_ENTRY).unlink()  # listed, its own entry file lost
    tmp = store / "clips" / "Jump" / f"{TMP_PREFIX}v_Jump_2.123"  # an interrupted prepare's
    tmp.mkdir()
    (tmp / "img_00001.jpg").write_bytes(b"")
    (store / "clips" / "Jump" / "mine").mkdir()  # the user's folder, neither ours nor a clip
    (store / "clips" / "Jump" / "mine" / "notes.txt").write_text("mine")
    (store / "clips" / "README").write_text("mine too")
    notes = [f"note-{k:02d}.txt" for k in range(30)]  # files beside the class folders: skipped, not an end
    for name in notes:
        (store / "clips" / name).write_text("")
    (store / "clips" / f"{TMP_PREFIX}file").write_text("not a folder")
    # the unlisted clip is cleaned by the names its own entry gives: a stray frame name is refused
    unlisted = store / listed["dir"]
    (unlisted / "img_00005.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match=r"v_Jump_1: holds files mmviews did not write \(\['img_00005.jpg'\]\)"):
        clear_video_store(store)
    (unlisted / "img_00005.jpg").unlink()
    assert clear_video_store(store) == 3  # both clips and the temporary folder
    assert files_under(store) == {"clips", "clips/Jump", "clips/Jump/mine", "clips/Jump/mine/notes.txt",
                                  "clips/README", f"clips/{TMP_PREFIX}file", ".mmviews-lock",
                                  *(f"clips/{name}" for name in notes)}


def test_clear_removes_empty_class_folders_and_the_store_files(jpeg_store):
    _, store = jpeg_store
    (store / "clips" / "Empty").mkdir()
    (store / "prepare-report.json").write_text("{}")
    (store / "manifest.journal").write_text("")
    assert clear_video_store(store) == 2
    assert files_under(store) == {".mmviews-lock"}


def test_clear_a_store_without_clips_and_a_folder_that_is_none(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": STORE_KIND}))  # a manifest that lists nothing
    assert clear_video_store(tmp_path) == 0 and not (tmp_path / MANIFEST).exists()
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError) as err:
        clear_video_store(tmp_path)
    assert str(err.value) == (f"{tmp_path} is not a mmviews video store (no {MANIFEST} of kind {STORE_KIND!r}): "
                              "refusing to delete anything in it")
    assert (tmp_path / MANIFEST).is_file()


# --------------------------------------------------------------------------- reading


def test_find_only_a_store_that_is_there(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [3]})
    assert VideoStore.find(root) is None
    prepare_video_store(root, image_format="npy", size=16, flow=None, workers=0, progress=False)
    store = VideoStore.find(root)
    assert store is not None and store.path == tmp_path / "ucf.mmstore" and not store.has_flow


def test_reading_flow_from_a_store_without_flow(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [3]})
    prepare_video_store(root, image_format="npy", size=16, flow=None, workers=0, progress=False)
    store = VideoStore.find(root)
    entry = store.clips["Jump/v_Jump_0.avi"]
    h, w = entry["height"], entry["width"]
    # a clip of one frame repeated, or a single frame: no flow needed, zero flow
    assert np.array_equal(store.read_flow(entry, np.array([0, 0, 0])), np.zeros((2, 2, h, w), np.float32))
    assert store.read_flow(entry, np.array([2])).shape == (0, 2, h, w)
    for idx in ([0, 1], [1, 2, 2], [0, 0, 1], [0, 2, 3]):  # any consecutive pair needs the stored flow
        with pytest.raises(ValueError) as err:
            store.read_flow(entry, np.array(idx))
        assert str(err.value) == f"{store.folder(entry)}: the store holds no flow (prepared with flow=None)"



# --------------------------------------------------------------------------- options and sizes


def test_store_options_defaults_and_bounds():
    from mmviews.data.video_store import store_options

    assert store_options() == {"format": "jpeg", "size": 128, "flow": "farneback", "jpeg_quality": 90}
    assert store_options("npy", 0, None, 0) == {"format": "npy", "size": 0, "flow": None, "jpeg_quality": None}
    assert store_options(jpeg_quality=1)["jpeg_quality"] == 1 and store_options(jpeg_quality=100)["jpeg_quality"] == 100
    for args, message in [
        (("png",), "image format must be one of ('jpeg', 'npy'), got 'png'"),
        (("jpeg", 128, "tvl1"), "flow must be None or one of ('farneback',), got 'tvl1'"),
        (("jpeg", -1), "size (short side in pixels, 0 = as decoded) must be >= 0, got -1"),
        (("jpeg", 128, None, 0), "jpeg_quality must be in 1..100, got 0"),
        (("jpeg", 128, None, 101), "jpeg_quality must be in 1..100, got 101"),
    ]:
        with pytest.raises(ValueError) as err:
            store_options(*args)
        assert str(err.value) == message


def test_output_size_scales_the_short_side_down_only():
    from mmviews.data.video_store import _output_size

    assert _output_size(48, 64, 16) == (16, 21)  # 64 * 16 / 48 = 21.3
    assert _output_size(64, 48, 16) == (21, 16)
    assert _output_size(30, 50, 20) == (20, 33)  # 33.3
    assert _output_size(30, 51, 20) == (20, 34)  # 34.0
    assert _output_size(48, 64, 48) == (48, 64)  # the short side already at size: as is
    assert _output_size(48, 64, 47) == (47, 63)  # one pixel below: scaled (62.67)
    assert _output_size(48, 64, 100) == (48, 64)  # never upscaled
    assert _output_size(48, 64, 0) == (48, 64)  # 0: as decoded


def test_paths_of_a_store_and_its_clips():
    from mmviews.data.video_store import clip_dir_name, default_store_path

    assert default_store_path("/data/UCF-101") == Path("/data/UCF-101.mmstore")
    assert default_store_path("/data/UCF-101/") == Path("/data/UCF-101.mmstore")
    assert clip_dir_name("Jump/v_Jump_g01_c01.avi") == "clips/Jump/v_Jump_g01_c01"
    assert clip_dir_name("Jump/sub/clip.v2.mp4") == "clips/Jump/clip.v2"


# --------------------------------------------------------------------------- manifest and journal


def write_store_manifest(store: Path, **fields) -> None:
    store.mkdir(parents=True, exist_ok=True)
    (store / MANIFEST).write_text(json.dumps({"kind": STORE_KIND, "version": 1, **fields}))


def test_read_manifest_merges_the_journal(tmp_path):
    from mmviews.data.video_store import JOURNAL, _append_journal, read_manifest

    kept = {"frames": 9, "declared_frames": 9}
    write_store_manifest(tmp_path, min_frames=10, clips={"A/a.avi": kept}, failed={"B/b.avi": "old", "C/c.avi": "bad"})
    _append_journal(tmp_path, "clips", "B/b.avi", {"frames": 12, "declared_frames": 20})  # repaired, truncated
    _append_journal(tmp_path, "failed", "D/d.avi", "cannot read")
    assert json.loads((tmp_path / JOURNAL).read_text().splitlines()[0]) == {
        "key": "clips", "rel": "B/b.avi", "value": {"frames": 12, "declared_frames": 20}}
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"key": "other", "rel": "E/e.avi", "value": 1}\n')  # foreign lines are ignored ...
        f.write('{"key": "clips", "rel": 5, "value": {}}\n')
        f.write('{"key": "clips", "rel": "F/f.avi"}\n')
        f.write('["clips", "G/g.avi", {}]\n')
        f.write('{"key": "failed", "rel": "H/h.avi", "value": "x"}\n')
        f.write('{"key": "clips", "rel": "C/c.av')  # ... and so is a torn last line
    manifest = read_manifest(tmp_path)
    assert manifest["clips"] == {"A/a.avi": kept, "B/b.avi": {"frames": 12, "declared_frames": 20}}
    assert manifest["failed"] == {"C/c.avi": "bad", "D/d.avi": "cannot read", "H/h.avi": "x"}
    # the bad-clip lists are derived again, with the store's min_frames
    assert manifest["truncated"] == {"B/b.avi": {"declared": 20, "decoded": 12}}
    assert manifest["short"] == {"A/a.avi": {"decoded": 9, "needed": 10}}
    write_store_manifest(tmp_path, clips={"A/a.avi": {"frames": 7}})  # no min_frames: the recipes' 8
    assert read_manifest(tmp_path)["short"] == {"A/a.avi": {"decoded": 7, "needed": 8}}
    (tmp_path / JOURNAL).write_bytes(b"\xff\xfe not text")
    assert read_manifest(tmp_path)["clips"] == {"A/a.avi": {"frames": 7}}  # as written, no journal read
    (tmp_path / JOURNAL).unlink()
    manifest = read_manifest(tmp_path)  # no journal: the manifest as written (nothing derived again)
    assert "short" not in manifest and manifest["clips"] == {"A/a.avi": {"frames": 7}}


def test_read_manifest_of_what_is_not_a_store(tmp_path):
    from mmviews.data.video_store import read_manifest

    assert read_manifest(tmp_path) is None
    for text in ("{not json", "[1, 2]", json.dumps({"kind": "other"}), json.dumps({"version": 1})):
        (tmp_path / MANIFEST).write_text(text)
        assert read_manifest(tmp_path) is None, text
    (tmp_path / MANIFEST).unlink()
    (tmp_path / MANIFEST).mkdir()
    assert read_manifest(tmp_path) is None


def test_known_bad_clips(tmp_path):
    from mmviews.data.video_store import known_bad_clips

    assert known_bad_clips(tmp_path) == {}
    write_store_manifest(tmp_path, clips={}, failed={"B/b.avi": "B/b.avi: InvalidDataError: bad", "A/a.avi": "gone"})
    assert known_bad_clips(tmp_path) == {"B/b.avi": "failed: B/b.avi: InvalidDataError: bad", "A/a.avi": "failed: gone"}
    write_store_manifest(tmp_path, clips={}, failed=["A/a.avi"])  # not a map: nothing known
    assert known_bad_clips(tmp_path) == {}
    write_store_manifest(tmp_path, clips={})
    assert known_bad_clips(tmp_path) == {}


def test_video_store_refuses_other_folders_and_versions(tmp_path):
    with pytest.raises(ValueError) as err:
        VideoStore(tmp_path)
    assert str(err.value) == (f"{tmp_path} is not a mmviews video store (no {MANIFEST} of kind {STORE_KIND!r}); "
                              "make one with `mmviews prepare ucf101|hmdb51 ROOT --out STORE`")
    write_store_manifest(tmp_path, version=2, options={}, clips={})
    with pytest.raises(ValueError) as err:
        VideoStore(tmp_path)
    assert str(err.value) == (f"{tmp_path}: video store version 2, this mmviews reads 1; rebuild it with "
                              "`mmviews prepare ... --overwrite`")
    write_store_manifest(tmp_path, options={"flow": "farneback"}, clips={"A/a.avi": {"frames": 3}})
    store = VideoStore(tmp_path)
    assert store.has_flow and store.clips == {"A/a.avi": {"frames": 3}} and store.options == {"flow": "farneback"}


# --------------------------------------------------------------------------- staleness


def test_source_matches_by_size_then_time_then_fingerprint(tmp_path):
    from mmviews.data.video_store import source_fingerprint, source_matches

    video = tmp_path / "a.avi"
    video.write_bytes(bytes(range(256)) * 8)
    st = video.stat()
    entry = {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}
    assert source_matches(entry, video)  # same size and time: no hashing needed
    assert not source_matches({**entry, "source_size": st.st_size + 1}, video)
    assert not source_matches(entry, tmp_path / "gone.avi")
    copied = {**entry, "source_mtime_ns": st.st_mtime_ns - 1}  # a copy: new time
    assert not source_matches(copied, video)  # an older entry without a fingerprint: by time only
    assert source_matches({**copied, "source_fingerprint": source_fingerprint(video)}, video)
    assert not source_matches({**copied, "source_fingerprint": f"{st.st_size}:0"}, video)


def test_lookup_checks_each_copied_video_once(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "ucf", {"Jump": [3]})
    prepare_video_store(root, image_format="npy", size=16, flow=None, workers=0, progress=False)
    store = VideoStore.find(root)
    video = root / "Jump" / "v_Jump_0.avi"
    entry = store.clips["Jump/v_Jump_0.avi"]
    assert store.lookup("Jump/v_Jump_9.avi", video) == (None, False)  # not in the store: nothing stale
    assert store.lookup("Jump/v_Jump_0.avi", tmp_path / "gone.avi") == (entry, False)  # the store is all there is
    assert store.lookup("Jump/v_Jump_0.avi", video) == (entry, False)
    hashed = []
    real = video_store_module().source_fingerprint
    monkeypatch.setattr(video_store_module(), "source_fingerprint", lambda p: hashed.append(p) or real(p))
    assert store.lookup("Jump/v_Jump_0.avi", video) == (entry, False) and hashed == []  # same time: not hashed
    os.utime(video, ns=(entry["source_mtime_ns"] + 10**9, entry["source_mtime_ns"] + 10**9))  # copied
    for _ in range(3):
        assert store.lookup("Jump/v_Jump_0.avi", video) == (entry, False)
    assert hashed == [video]  # hashed once per process
    data = bytearray(video.read_bytes())
    data[100] ^= 0xFF  # same size, same (new) time, other content: not re-hashed, taken as the copy
    video.write_bytes(bytes(data))
    os.utime(video, ns=(entry["source_mtime_ns"] + 2 * 10**9,) * 2)  # its time moves with the edit
    assert store.lookup("Jump/v_Jump_0.avi", video) == (None, True)
    video.write_bytes(bytes(data) + b"x")
    assert store.lookup("Jump/v_Jump_0.avi", video) == (None, True)  # another size: stale without hashing


def video_store_module():
    import mmviews.data.video_store as module

    return module


# --------------------------------------------------------------------------- prepare


def test_prepare_writes_the_entries_and_the_summary(tmp_path):
    import cv2
    from test_data_video import write_clip as write_clip_with_audio

    from mmviews.data.video_io import read_video_frames
    from mmviews.data.video_store import JOURNAL, read_manifest, source_fingerprint, store_options

    root = make_folder(tmp_path / "ucf", {"Jump": [5], "Run": [3]})  # 48 x 64 px, 25 fps
    (root / "Talk").mkdir()
    write_clip_with_audio(root / "Talk" / "v_Talk_0.mp4", n_frames=4, audio=True)  # 32 x 48 px, 10 fps
    store = tmp_path / "store"
    summary = prepare_video_store(root, store, dataset="ucf101", image_format="npy", size=16, workers=0,
                                  progress=False, min_frames=4)
    assert isinstance(summary["seconds"], float) and summary["seconds"] >= 0
    assert summary == {"store": str(store), "clips": 3, "already_done": 0, "prepared": 3, "failed": {},
                       "truncated": {}, "short": {"Run/v_Run_0.avi": {"decoded": 3, "needed": 4}}, "with_audio": 1,
                       "seconds": summary["seconds"]}
    options = store_options("npy", 16)
    manifest = json.loads((store / MANIFEST).read_text())
    assert {k: manifest[k] for k in ("kind", "version", "dataset", "source_root", "options", "min_frames")} == {
        "kind": STORE_KIND, "version": 1, "dataset": "ucf101", "source_root": str(root.resolve()),
        "options": options, "min_frames": 4}
    assert time.strptime(manifest["updated"], "%Y-%m-%dT%H:%M:%S")
    assert not (store / JOURNAL).exists()  # the final manifest holds everything
    video = root / "Jump" / "v_Jump_0.avi"
    st = video.stat()
    entry = manifest["clips"]["Jump/v_Jump_0.avi"]
    assert entry == {"dir": "clips/Jump/v_Jump_0", "frames": 5, "declared_frames": 5, "flows": 4, "height": 16,
                     "width": 21, "fps": 25.0, "audio": False, "source_size": st.st_size,
                     "source_mtime_ns": st.st_mtime_ns, "source_fingerprint": source_fingerprint(video),
                     "source_height": 48, "source_width": 64, "format": "npy", "options": options}
    assert json.loads((store / entry["dir"] / CLIP_ENTRY).read_text()) == entry
    talk = manifest["clips"]["Talk/v_Talk_0.mp4"]
    assert (talk["fps"], talk["audio"], talk["height"], talk["width"]) == (10.0, True, 16, 24)
    # the frames: decoded, resized with area averaging; the flow: 4 pairs, uint8
    frames = np.load(store / entry["dir"] / "frames.npy")
    decoded, _ = read_video_frames(video)
    expected = np.stack([cv2.resize(f, (21, 16), interpolation=cv2.INTER_AREA) for f in decoded])
    assert frames.dtype == np.uint8 and np.array_equal(frames, expected)
    flow = np.load(store / entry["dir"] / "flow.npy")
    assert flow.shape == (4, 2, 16, 21) and flow.dtype == np.uint8
    assert read_manifest(store) == manifest

    # a rerun does nothing; a copy of the dataset (new times, same bytes) is current, its time recorded once
    summary = prepare_video_store(root, store, image_format="npy", size=16, workers=0, progress=False, min_frames=4)
    assert (summary["already_done"], summary["prepared"], summary["with_audio"]) == (3, 0, 1)
    os.utime(video, ns=(st.st_mtime_ns + 10**9, st.st_mtime_ns + 10**9))
    summary = prepare_video_store(root, store, image_format="npy", size=16, workers=0, progress=False, min_frames=4)
    assert (summary["already_done"], summary["prepared"]) == (3, 0)
    assert json.loads((store / entry["dir"] / CLIP_ENTRY).read_text()) == {**entry, "source_mtime_ns": st.st_mtime_ns
                                                                            + 10**9}


def test_prepare_without_flow_as_decoded_jpeg(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [2]})
    store = tmp_path / "store"
    prepare_video_store(root, store, size=0, flow=None, jpeg_quality=100, workers=0, progress=False)
    entry = json.loads((store / "clips/Jump/v_Jump_0" / CLIP_ENTRY).read_text())
    assert (entry["flows"], entry["height"], entry["width"], entry["format"]) == (0, 48, 64, "jpeg")
    assert sorted(p.name for p in (store / "clips/Jump/v_Jump_0").iterdir()) == [CLIP_ENTRY, "img_00001.jpg",
                                                                                 "img_00002.jpg"]
    store2 = tmp_path / "store2"
    prepare_video_store(root, store2, size=0, flow=None, jpeg_quality=1, workers=0, progress=False)
    # the quality is the one asked for: 1 makes far smaller files than 100
    assert (store2 / "clips/Jump/v_Jump_0/img_00001.jpg").stat().st_size * 3 < (
        store / "clips/Jump/v_Jump_0/img_00001.jpg").stat().st_size


def test_prepare_refusals_name_what_is_wrong(tmp_path):
    from mmviews.data.video_store import LOCK_FILE

    root = make_folder(tmp_path / "ucf", {"Jump": [2]})
    cases = [
        (dict(root=tmp_path / "none"), f"no such video folder: {tmp_path / 'none'}"),
        (dict(on_error="ignore"), "on_error must be 'skip' or 'raise', got 'ignore'"),
        (dict(min_frames=0), "min_frames (frames one view needs) must be >= 1, got 0"),
        (dict(out=root / "store"), f"store {root / 'store'} is inside the video folder {root}, where it would be taken "
                                   f"for a class folder; choose another --out (default {tmp_path / 'ucf.mmstore'})"),
        (dict(out=root), f"store {root} is inside the video folder {root}, where it would be taken "
                         f"for a class folder; choose another --out (default {tmp_path / 'ucf.mmstore'})"),
    ]
    (tmp_path / "file").write_text("")
    cases.append((dict(out=tmp_path / "file"), f"{tmp_path / 'file'} exists and is not a folder"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "thesis.tex").write_text("")
    cases.append((dict(out=tmp_path / "full"), f"{tmp_path / 'full'} is not a mmviews video store (no {MANIFEST} of "
                  f"kind {STORE_KIND!r}) and is not empty: refusing to write into it; choose another --out"))
    for kwargs, message in cases:
        kwargs = {"root": root, "out": tmp_path / "store", **kwargs}
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            prepare_video_store(kwargs.pop("root"), kwargs.pop("out"), workers=0, progress=False, **kwargs)
        assert str(err.value) == message
    assert not (tmp_path / "store").exists()
    empty = tmp_path / "empty"
    (empty / "Jump").mkdir(parents=True)
    (empty / "Jump" / "notes.txt").write_text("")
    with pytest.raises(ValueError) as err:
        prepare_video_store(empty, tmp_path / "store", workers=0, progress=False)
    assert str(err.value) == f"{empty}: no videos in class folders (expected {empty}/<class>/<clip>.avi)"
    (root / "Jump" / "v_Jump_0.mp4").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        prepare_video_store(root, tmp_path / "store", workers=0, progress=False)
    assert str(err.value) == (f"{root}: Jump/v_Jump_0.avi and Jump/v_Jump_0.mp4 would share the store folder "
                              "clips/Jump/v_Jump_0")
    (root / "Jump" / "v_Jump_0.mp4").unlink()

    (tmp_path / "fresh").mkdir()  # an empty folder is fine, and min_frames=1 is
    assert prepare_video_store(root, tmp_path / "fresh", workers=0, progress=False, min_frames=1)["prepared"] == 1
    with pytest.raises(ValueError) as err:
        prepare_video_store(root, tmp_path / "fresh", size=64, workers=0, progress=False)
    assert str(err.value) == (f"{tmp_path / 'fresh'} was prepared with options {{'format': 'jpeg', 'size': 128, "
                              "'flow': 'farneback', 'jpeg_quality': 90}, not {'format': 'jpeg', 'size': 64, 'flow': "
                              "'farneback', 'jpeg_quality': 90}: pass --overwrite to rebuild it with the new ones, "
                              "or choose another --out")
    import fcntl

    with open(tmp_path / "fresh" / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another prepare at work
        with pytest.raises(ValueError) as err:
            prepare_video_store(root, tmp_path / "fresh", workers=0, progress=False)
        assert str(err.value) == f"{tmp_path / 'fresh'}: another mmviews prepare is writing this store"
    # released by the prepare that held it: the next one runs
    assert prepare_video_store(root, tmp_path / "fresh", workers=0, progress=False)["already_done"] == 1
    assert prepare_video_store(root, tmp_path / "fresh", workers=0, progress=False)["already_done"] == 1
    (tmp_path / "fresh" / "clips" / "Jump" / "v_Jump_1").mkdir()
    write_video_like = root / "Jump" / "v_Jump_1.avi"
    write_video_like.write_bytes((root / "Jump" / "v_Jump_0.avi").read_bytes())
    with pytest.raises(ValueError) as err:
        prepare_video_store(root, tmp_path / "fresh", workers=0, progress=False)
    assert str(err.value) == (f"{tmp_path / 'fresh' / 'clips/Jump/v_Jump_1'} exists but was not written by mmviews "
                              f"(no {CLIP_ENTRY}): move it away or choose another --out")


def test_prepare_reports_unreadable_videos(tmp_path, capsys):
    root = make_folder(tmp_path / "ucf", {"Jump": [2]}, bad="Jump/v_Jump_5.avi")
    summary = prepare_video_store(root, tmp_path / "s1", workers=0, progress=False)
    message = summary["failed"]["Jump/v_Jump_5.avi"]
    assert message.startswith(f"{root / 'Jump/v_Jump_5.avi'}: ") and "Error: " in message
    assert capsys.readouterr().err.splitlines() == [f"warning: skipped unreadable video {message}"]
    with pytest.raises(ValueError) as err:
        prepare_video_store(root, tmp_path / "s2", workers=0, progress=False, on_error="raise")
    assert str(err.value) == (f"cannot read {message} (prepare stopped: on_error='raise'; finished clips are kept, "
                              "a rerun resumes)")
    assert json.loads((tmp_path / "s2" / MANIFEST).read_text())["failed"] == {"Jump/v_Jump_5.avi": message}


def test_prepare_shows_progress_named_after_the_dataset(tmp_path, capsys):
    root = make_folder(tmp_path / "UCF-101", {"Jump": [2]})
    prepare_video_store(root, tmp_path / "s1", dataset="ucf101", workers=0, progress=True)
    assert "preparing ucf101: 100%" in capsys.readouterr().err
    prepare_video_store(root, tmp_path / "s2", workers=0, progress=True)
    err = capsys.readouterr().err
    assert "preparing UCF-101: 100%" in err and "1/1" in err and "clip/s" in err
    prepare_video_store(root, tmp_path / "s3", workers=0, progress=False)
    assert capsys.readouterr().err == ""


def test_prepare_removes_an_interrupted_prepares_temporary_folders(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [2]})
    store = tmp_path / "store"
    prepare_video_store(root, store, workers=0, progress=False)
    tmp = store / "clips" / "Jump" / f"{TMP_PREFIX}v_Jump_1.999"
    tmp.mkdir()
    (tmp / "img_00001.jpg").write_bytes(b"")
    prepare_video_store(root, store, workers=0, progress=False)
    assert not tmp.exists()
    tmp.mkdir()
    (tmp / "mine.txt").write_text("")
    with pytest.raises(ValueError, match=r"holds files mmviews did not write \(\['mine.txt'\]\)"):
        prepare_video_store(root, store, workers=0, progress=False)
    assert (tmp / "mine.txt").is_file()


def test_journal_keeps_finished_clips_between_manifest_saves(tmp_path, monkeypatch):
    """Clip by clip, each finished clip is in the journal at once, while manifest.json is only
    rewritten every _MANIFEST_SAVE_S seconds (and at the end)."""
    from mmviews.data.video_store import read_manifest

    root = make_folder(tmp_path / "ucf", {"Jump": [2, 2, 2]})
    store = tmp_path / "store"
    seen = []

    def before_commit(rel: str) -> None:
        written = json.loads((store / MANIFEST).read_text())
        seen.append((rel, sorted(written["clips"]), sorted(read_manifest(store)["clips"])))

    prepare_video_store(root, store, workers=0, progress=False, before_commit=before_commit)
    rels = [f"Jump/v_Jump_{k}.avi" for k in range(3)]
    assert seen == [(rels[0], [], []), (rels[1], [], rels[:1]), (rels[2], [], rels[:2])]
    seen.clear()
    monkeypatch.setattr(video_store_module(), "_MANIFEST_SAVE_S", -1.0)  # save after every clip
    prepare_video_store(root, tmp_path / "store2", workers=0, progress=False,
                        before_commit=lambda rel: seen.append(sorted(json.loads((tmp_path / "store2" / MANIFEST).read_text())["clips"])))
    assert seen == [[], rels[:1], rels[:2]]
    assert sorted(json.loads((tmp_path / "store2" / MANIFEST).read_text())["clips"]) == rels


# --------------------------------------------------------------------------- one clip


def prepare_one(root: Path, rel: str, store: Path, **options):
    from mmviews.data.video_store import _prepare_clip, store_options

    (store / "clips" / rel.split("/")[0]).mkdir(parents=True, exist_ok=True)
    return _prepare_clip(str(root), rel, str(store), store_options(**options), None)


def test_clip_is_written_to_a_temporary_folder_then_renamed(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [1, 3]})
    store = tmp_path / "store"
    seen = []

    def before_commit(rel: str) -> None:  # the finished clip, not yet in place
        seen.append(sorted(p.name for p in (store / "clips" / "Jump").iterdir()))
        folder = store / "clips" / "Jump" / f"{TMP_PREFIX}{Path(rel).stem}.{os.getpid()}"
        seen.append(sorted(p.name for p in folder.iterdir()))

    prepare_video_store(root, store, image_format="npy", size=0, workers=0, progress=False, before_commit=before_commit)
    assert seen == [[f"{TMP_PREFIX}v_Jump_0.{os.getpid()}"], [CLIP_ENTRY, "flow.npy", "frames.npy"],
                    [f"{TMP_PREFIX}v_Jump_1.{os.getpid()}", "v_Jump_0"], [CLIP_ENTRY, "flow.npy", "frames.npy"]]
    # one frame: no flow pair, an empty flow array of the frame size
    entry = json.loads((store / "clips/Jump/v_Jump_0" / CLIP_ENTRY).read_text())
    assert (entry["frames"], entry["declared_frames"], entry["flows"]) == (1, 1, 0)
    flow = np.load(store / "clips/Jump/v_Jump_0/flow.npy")
    assert flow.shape == (0, 2, 48, 64) and flow.dtype == np.uint8


def test_prepare_clip_clears_a_stale_temporary_folder_of_its_own_process(tmp_path):
    root = make_folder(tmp_path / "ucf", {"Jump": [2]})
    store = tmp_path / "store"
    stale = store / "clips" / "Jump" / f"{TMP_PREFIX}v_Jump_0.{os.getpid()}"
    stale.mkdir(parents=True)
    (stale / "img_00007.jpg").write_bytes(b"left by a killed worker")
    rel, entry, message = prepare_one(root, "Jump/v_Jump_0.avi", store, image_format="npy", size=0)
    assert (rel, message) == ("Jump/v_Jump_0.avi", None) and entry["frames"] == 2
    assert sorted(p.name for p in (store / "clips" / "Jump").iterdir()) == ["v_Jump_0"]


def test_prepare_clip_reports_a_video_without_a_video_stream_by_name(tmp_path):
    import av

    root = tmp_path / "ucf"
    (root / "Jump").mkdir(parents=True)
    with av.open(str(root / "Jump" / "sound.mkv"), "w") as out:  # an audio track alone
        stream = out.add_stream("pcm_s16le", rate=8000)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    store = tmp_path / "store"
    for name, message in [("sound.mkv", "ValueError: no video stream")]:
        assert prepare_one(root, f"Jump/{name}", store) == (f"Jump/{name}", None, f"{root / 'Jump' / name}: {message}")
        assert list((store / "clips" / "Jump").iterdir()) == []  # nothing half-written left


def test_prepare_clip_that_cannot_create_its_folder_stops(tmp_path):
    from mmviews.data.video_store import StoreWriteError, _prepare_clip, store_options

    root = make_folder(tmp_path / "ucf", {"Jump": [2]})
    store = tmp_path / "store"
    (store / "clips").mkdir(parents=True)
    (store / "clips" / "Jump").write_text("a file where the class folder goes")
    with pytest.raises(StoreWriteError) as err:
        _prepare_clip(str(root), "Jump/v_Jump_0.avi", str(store), store_options(), None)
    tmp = store / "clips" / "Jump" / f"{TMP_PREFIX}v_Jump_0.{os.getpid()}"
    assert str(err.value).startswith(f"{tmp}: cannot create (")


def test_container_without_a_frame_count_records_none(tmp_path):
    from test_data_video_store import write_video

    root = tmp_path / "ucf"
    (root / "Jump").mkdir(parents=True)
    write_video(root / "Jump" / "v.mkv", 4)  # Matroska states no frame count
    rel, entry, _ = prepare_one(root, "Jump/v.mkv", tmp_path / "store", image_format="npy", size=0)
    assert entry["declared_frames"] is None and entry["frames"] == 4


def test_clear_names_at_most_five_foreign_names_and_sub_folders(jpeg_store):
    _, store = jpeg_store
    clip = store / "clips" / "Jump" / "v_Jump_0"
    (clip / "sub").mkdir()
    for name in ("f.txt", "e.txt", "d.txt", "c.txt", "b.txt"):
        (clip / name).write_text("")
    with pytest.raises(ValueError) as err:
        clear_video_store(store)
    assert str(err.value) == (f"{clip}: holds files mmviews did not write (['b.txt', 'c.txt', 'd.txt', 'e.txt', "
                              "'f.txt']); nothing deleted, move them away first")
    for name in ("f.txt", "e.txt", "d.txt", "c.txt", "b.txt"):
        (clip / name).unlink()
    with pytest.raises(ValueError, match=r"\(\['sub'\]\)"):  # a folder is not one of our files
        clear_video_store(store)


def test_jpeg_and_npy_stores_hold_the_same_flow(tmp_path):
    """Flow pair t of a JPEG store is ``flow_x/y_{t + 1}``: read back it matches the exact npy
    store's pair t (up to JPEG loss), and not its neighbours (the texture moves down every other
    frame, so consecutive pairs differ)."""
    root = make_folder(tmp_path / "ucf", {"Jump": [6]})
    prepare_video_store(root, tmp_path / "npy", image_format="npy", size=0, workers=0, progress=False)
    prepare_video_store(root, tmp_path / "jpeg", size=0, jpeg_quality=100, workers=0, progress=False)
    npy, jpeg = VideoStore(tmp_path / "npy"), VideoStore(tmp_path / "jpeg")
    rel = "Jump/v_Jump_0.avi"
    idx = np.arange(6)
    exact, lossy = npy.read_flow(npy.clips[rel], idx), jpeg.read_flow(jpeg.clips[rel], idx)
    assert exact.shape == lossy.shape == (5, 2, 48, 64)
    stored = np.load(tmp_path / "npy" / npy.clips[rel]["dir"] / "flow.npy")
    assert np.array_equal(exact, stored * np.float32(40 / 255) - 20)  # the stored levels, in pixels
    step = 40 / 255
    error = np.abs(lossy - exact).mean(axis=(1, 2, 3))
    assert np.all(error < 2 * step), error
    shifted = np.abs(lossy[1:] - exact[:-1]).mean(axis=(1, 2, 3))
    assert np.all(shifted > 2 * error[1:]), (shifted, error)
    frames_npy, frames_jpeg = npy.read_frames(npy.clips[rel], idx), jpeg.read_frames(jpeg.clips[rel], idx)
    assert frames_npy.shape == frames_jpeg.shape == (6, 48, 64, 3)
    # each JPEG frame is nearest to its own exact frame (the texture pans 1 px a frame)
    distance = np.abs(frames_jpeg[:, None].astype(float) - frames_npy[None]).mean(axis=(2, 3, 4))
    assert distance.argmin(axis=1).tolist() == list(range(6)), distance
    assert distance.diagonal().max() < 12  # JPEG loss only (colours in the right order)


def test_stale_clip_folder_is_cleared_by_its_entrys_names_only(tmp_path):
    """A clip whose video changed is redone: its old folder is removed, but only when it holds
    nothing but the files its entry names (a stray frame name is the user's: refused, kept)."""
    from test_data_video_store import write_video

    root = make_folder(tmp_path / "ucf", {"Jump": [3]})
    store = tmp_path / "store"
    prepare_video_store(root, store, size=16, workers=0, progress=False)
    write_video(root / "Jump" / "v_Jump_0.avi", 5, seed=9)  # the user replaced the video
    clip = store / "clips" / "Jump" / "v_Jump_0"
    (clip / "img_00009.jpg").write_bytes(b"the user's")
    with pytest.raises(ValueError) as err:
        prepare_video_store(root, store, size=16, workers=0, progress=False)
    assert str(err.value) == (f"{clip}: holds files mmviews did not write (['img_00009.jpg']); nothing deleted, "
                              "move them away first")
    assert (clip / "img_00009.jpg").read_bytes() == b"the user's" and (clip / "img_00003.jpg").is_file()
    (clip / "img_00009.jpg").unlink()
    assert prepare_video_store(root, store, size=16, workers=0, progress=False)["prepared"] == 1
    assert json.loads((clip / CLIP_ENTRY).read_text())["frames"] == 5


def test_source_that_cannot_be_hashed_does_not_match(tmp_path):
    from mmviews.data.video_store import source_matches

    folder = tmp_path / "a.avi"  # a folder where the video was: its size can be read, its bytes not
    folder.mkdir()
    entry = {"source_size": folder.stat().st_size, "source_mtime_ns": 0, "source_fingerprint": "0:x"}
    assert source_matches(entry, folder) is False


def test_truncated_videos_are_named_on_stderr(tmp_path, capsys):
    from test_data_video_prepare import cut_avi
    from test_data_video_store import write_video

    root = tmp_path / "ucf"
    (root / "Jump").mkdir(parents=True)
    silent, broken = root / "Jump" / "silent.avi", root / "Jump" / "broken.avi"
    write_video(silent, 30, size=(48, 64))
    cut_avi(silent, 0.5, mid_frame=False)  # decoding just stops early
    write_video(broken, 30, size=(48, 64))
    cut_avi(broken, 0.5, mid_frame=True)  # decoding stops on the cut frame, with an error
    summary = prepare_video_store(root, tmp_path / "store", image_format="npy", size=0, flow=None, workers=0,
                                  progress=False)
    cut = summary["truncated"]
    assert set(cut) == {"Jump/silent.avi", "Jump/broken.avi"} and "error" in cut["Jump/broken.avi"]
    assert "error" not in cut["Jump/silent.avi"]
    import av

    error_type = cut["Jump/broken.avi"]["error"].split(":", 1)[0]  # PyAV's error, by its class name
    assert issubclass(getattr(av.error, error_type), av.error.FFmpegError), error_type
    assert capsys.readouterr().err.splitlines() == [
        f"warning: truncated video {broken}: the container states 30 frames, {cut['Jump/broken.avi']['decoded']} "
        f"decode ({cut['Jump/broken.avi']['error']}); stored as decoded, listed under 'truncated'",
        f"warning: truncated video {silent}: the container states 30 frames, {cut['Jump/silent.avi']['decoded']} "
        "decode; stored as decoded, listed under 'truncated'"]


def test_a_store_write_failure_after_decoding_stops_the_prepare(tmp_path, monkeypatch):
    """Writing the arrays (after the video decoded) fails: the prepare stops with that error (a
    full disk is not an unreadable video), leaving no temporary folder."""
    root = make_folder(tmp_path / "ucf", {"Jump": [2]})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    with pytest.raises(DiskFullError, match=f"^{tmp_path / 'store'}: no space left while writing the clip of "
                                            r"Jump/v_Jump_0.avi: it needs about \d+ bytes, \d+ bytes are free"):
        prepare_video_store(root, tmp_path / "store", image_format="npy", workers=0, progress=False)
    assert sorted(p.name for p in (tmp_path / "store" / "clips" / "Jump").iterdir()) == []


def test_a_jpeg_write_refused_by_a_full_device_is_a_full_disk(tmp_path, monkeypatch):
    """OpenCV only answers False when a write fails: with the store's device short of a frame's
    bytes that is the full-disk error (folder, bytes needed, bytes free), with room it stays the
    store's write error (``test_store_write_failure_stops_the_prepare``)."""
    import cv2

    import mmviews.fileio as fileio

    root = make_folder(tmp_path / "ucf", {"Jump": [6]})
    monkeypatch.setattr(cv2, "imwrite", lambda *args: False)
    monkeypatch.setattr(fileio, "free_bytes", lambda folder: 1000)  # less than one frame
    with pytest.raises(DiskFullError, match=r"no space left while writing the clip of Jump/v_Jump_0.avi: it needs "
                                            r"about \d+ bytes, 1000 bytes are free") as caught:
        prepare_video_store(root, tmp_path / "store", workers=0, progress=False, on_error="skip")
    assert "cannot write" in str(caught.value.__cause__)
    assert not list((tmp_path / "store").glob(f"clips/*/{TMP_PREFIX}*"))


def test_progress_counts_the_clips_already_done(tmp_path, capsys):
    from test_data_video_store import write_video

    root = make_folder(tmp_path / "ucf", {"Jump": [2]})
    store = tmp_path / "deep" / "er" / "store"  # made with its parents
    prepare_video_store(root, store, size=16, workers=0, progress=False)
    write_video(root / "Jump" / "v_Jump_1.avi", 2)
    (store / "clips" / "Jump" / f"{TMP_PREFIX}notes").write_text("a file, not a clip folder: left alone")
    capsys.readouterr()
    summary = prepare_video_store(root, store, size=16, workers=0, progress=True)
    err = capsys.readouterr().err
    assert " 1/2 " in err and " 2/2 " in err  # starts at the clip already done
    assert (summary["already_done"], summary["prepared"]) == (1, 1)
    assert summary["seconds"] == round(summary["seconds"], 2)
    assert (store / "clips" / "Jump" / f"{TMP_PREFIX}notes").is_file()


def test_an_opencv_write_error_stops_the_prepare_naming_the_file(tmp_path, monkeypatch):
    import cv2

    from mmviews.data.video_store import StoreWriteError

    root = make_folder(tmp_path / "ucf", {"Jump": [2]})

    def refuse(path, *args):
        raise cv2.error("the encoder refused")

    monkeypatch.setattr(cv2, "imwrite", refuse)
    with pytest.raises(StoreWriteError) as err:
        prepare_video_store(root, tmp_path / "store", workers=0, progress=False)
    tmp = tmp_path / "store" / "clips" / "Jump" / f"{TMP_PREFIX}v_Jump_0.{os.getpid()}"
    assert str(err.value) == f"{tmp / 'img_00001.jpg'}: cannot write (the encoder refused)"  # the first file
    assert not tmp.exists()
