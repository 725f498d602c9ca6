"""Unit guards of :mod:`mmviews.data.video_store`: workers that die with their prepare, what
clearing a store deletes (only what its entries account for), the names a clip folder may hold,
reading flow from a store without any, and the staleness checks.

The worker checks run real processes, forked from the test process (no interpreter start-up):
a worker whose prepare is already gone exits at once with status 1, and one whose prepare is
killed ends with it, with ``PR_SET_PDEATHSIG`` and with the watch thread used where that is
missing. The parent-death signal itself is read back from the kernel (``PR_GET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_data_video_store import make_folder

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
    prepare_video_store,
)

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
def test_worker_whose_parent_is_already_gone_exits_at_once(tmp_path, platform):
    """A worker started for a prepare that died before it (its recorded parent is not its parent
    any more) exits with status 1 and no traceback, whether the kernel or a thread watches."""

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
def test_worker_ends_when_its_prepare_is_killed(tmp_path, platform):
    """A prepare (forked) starts a worker (forked from it) that ties itself to its parent; the
    prepare is SIGKILLed: the worker ends within seconds (the watch thread polls each second)."""
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
    (store / "clips" / f"{TMP_PREFIX}file").write_text("not a folder")
    # the unlisted clip is cleaned by the names its own entry gives: a stray frame name is refused
    unlisted = store / listed["dir"]
    (unlisted / "img_00005.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match=r"v_Jump_1: holds files mmviews did not write \(\['img_00005.jpg'\]\)"):
        clear_video_store(store)
    (unlisted / "img_00005.jpg").unlink()
    assert clear_video_store(store) == 3  # both clips and the temporary folder
    assert files_under(store) == {"clips", "clips/Jump", "clips/Jump/mine", "clips/Jump/mine/notes.txt",
                                  "clips/README", f"clips/{TMP_PREFIX}file", ".mmviews-lock"}


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
    for idx in ([0, 1], [1, 2, 2], [0, 0, 1]):  # any consecutive pair needs the stored flow
        with pytest.raises(ValueError) as err:
            store.read_flow(entry, np.array(idx))
        assert str(err.value) == f"{store.folder(entry)}: the store holds no flow (prepared with flow=None)"

