"""Atomic writes (mmviews.fileio): all or nothing, no temporary file left, umask permissions; a full
disk is one error naming the folder, the bytes needed and free."""

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from mmviews.fileio import atomic_save, atomic_write_bytes, atomic_write_text


def test_atomic_write_text_creates_parents_and_replaces(tmp_path: Path):
    path = tmp_path / "a" / "b" / "out.txt"
    assert atomic_write_text(path, "first\n") == path
    atomic_write_text(path, "second, ünïcode\n")
    assert path.read_text(encoding="utf-8") == "second, ünïcode\n"
    assert atomic_write_bytes(path, b"\x00\x01") == path and path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")

    def half_write(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save(path, half_write)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


@pytest.mark.parametrize(("umask", "mode"), [
    (0o027, 0o640),  # not mkstemp's 0600
    (0o022, 0o644),  # a umask that leaves execute bits: read-write for the owner, read for the others, never execute
])
def test_permissions_follow_the_umask(tmp_path: Path, umask: int, mode: int):
    old = os.umask(umask)
    try:
        path = atomic_write_text(tmp_path / "report.md", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_a_committed_folder_follows_the_umask_whichever_library_wrote_it(tmp_path: Path, umask: int):
    """safetensors writes its files 0600 and mkdtemp makes folders 0700: a folder committed by
    save_folder / commit_folder gives each the umask's permissions."""
    import torch
    from safetensors.torch import save_file

    from mmviews.fileio import save_folder

    def write(folder: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        (folder / "sub").mkdir(mode=0o700)
        (folder / "sub" / "state.bin").write_bytes(b"x")
        os.chmod(folder / "sub" / "state.bin", 0o600)
        (folder / "link").symlink_to(folder / "sub" / "state.bin")

    old = os.umask(umask)
    try:
        final = save_folder(tmp_path / "checkpoint", write)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in [final, *final.rglob("*")]
             if not p.is_symlink()}
    files, folders = 0o666 & ~umask, 0o777 & ~umask
    assert modes == {"checkpoint": folders, "checkpoint/model.safetensors": files, "checkpoint/sub": folders,
                     "checkpoint/sub/state.bin": files}
    assert (final / "link").is_symlink()


def test_disk_full_errors_name_folder_needed_and_free(tmp_path, monkeypatch):
    """Unit: ENOSPC and EDQUOT become one DiskFullError naming the folder, the bytes needed and
    free; the partial folder is removed; other errors pass unchanged."""
    from mmviews.fileio import DiskFullError, disk_full

    partial = tmp_path / ".tmp-checkpoint-00000003"
    partial.mkdir()
    for code in (errno.ENOSPC, errno.EDQUOT):
        with pytest.raises(DiskFullError) as caught:
            with disk_full(tmp_path, "the checkpoint of step 3", 12345, cleanup=partial):
                raise OSError(code, os.strerror(code))
        message = str(caught.value)
        assert message.startswith(f"{tmp_path}: no space left") and "12345 bytes" in message
        assert " bytes are free" in message and caught.value.errno == code and not partial.exists()
    with pytest.raises(PermissionError):
        with disk_full(tmp_path, "x", 1):
            raise PermissionError(errno.EACCES, "denied")


def test_check_writable_tries_the_nearest_existing_folder_and_leaves_nothing(tmp_path: Path):
    from crafted_files import unwritable_folder

    from mmviews.fileio import check_writable

    assert check_writable(tmp_path / "a" / "b" / "run") == tmp_path and list(tmp_path.iterdir()) == []
    (tmp_path / "f.parquet").write_text("x")
    assert check_writable(tmp_path / "f.parquet") == tmp_path  # an existing file: its folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.parquet"]
    folder = unwritable_folder(tmp_path)
    try:  # the system's own reason, found here by writing there
        open(folder / "probe", "w").close()
        raise AssertionError(f"{folder} took a file")
    except OSError as error:
        reason = error.strerror
    with pytest.raises(PermissionError) as refused:
        check_writable(folder / "x" / "y")
    assert str(refused.value) == (f"cannot write {folder / 'x' / 'y'}: {folder} refuses new files ({reason}); choose a "
                                  "folder this user can write to with --output")


def test_commits_flush_files_then_rename_then_flush_the_parent(tmp_path, monkeypatch):
    """atomic_save, commit_folder and save_folder: the new data flushed before the rename, the
    parent folder flushed after it (the calls recorded in order)."""
    from test_train_utils import CallRecorder, check_committed_durably

    from mmviews.fileio import commit_folder, save_folder

    calls = CallRecorder()
    calls.install(monkeypatch)
    path = atomic_write_text(tmp_path / "results.json", "{}")
    (tmp_name,) = [Path(c[1]) for c in calls.calls if c[0] == "replace"]
    assert tmp_name.parent == tmp_path and tmp_name.name.startswith(".results.json.") and tmp_name.name.endswith(".tmp")
    assert calls.calls == [("fsync", str(tmp_name)), ("replace", str(tmp_name), str(path)), ("fsync", str(tmp_path))]

    tmp = tmp_path / ".tmp-checkpoint-00000001"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(b"a")
    (tmp / "sub" / "b.bin").write_bytes(b"b")
    calls.calls.clear()
    assert commit_folder(tmp, tmp_path / "checkpoint-00000001") == tmp_path / "checkpoint-00000001"
    check_committed_durably(calls, tmp, tmp_path / "checkpoint-00000001", ["a.bin", "sub/b.bin", "sub"])
    assert calls.calls.index(("fsync", str(tmp / "sub" / "b.bin"))) < calls.calls.index(("fsync", str(tmp / "sub")))

    calls.calls.clear()
    final = save_folder(tmp_path / "encoder", lambda d: (d / "w.bin").write_bytes(b"w"))
    (renamed,) = [Path(c[1]) for c in calls.calls if c[0] == "replace"]
    assert renamed.name.startswith(".encoder.tmp-")
    check_committed_durably(calls, renamed, final, ["w.bin"])


def test_save_folder_replaces_and_keeps_the_old_one_on_failure(tmp_path):
    from mmviews.fileio import DiskFullError, save_folder

    final = save_folder(tmp_path / "encoder", lambda d: (d / "old.bin").write_bytes(b"old"))
    assert [p.name for p in final.iterdir()] == ["old.bin"]
    save_folder(final, lambda d: (d / "new.bin").write_bytes(b"new"))  # a run evaluated again
    assert [p.name for p in final.iterdir()] == ["new.bin"] and sorted(p.name for p in tmp_path.iterdir()) == ["encoder"]

    def half(d: Path) -> None:
        (d / "part.bin").write_bytes(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=r"encoder/: it needs about 10 bytes"):
        save_folder(final, half)
    with pytest.raises(DiskFullError, match=r"it needs about 99 bytes"):
        save_folder(final, half, needed=99)
    with pytest.raises(RuntimeError, match="boom"):
        save_folder(final, lambda d: (_ for _ in ()).throw(RuntimeError("boom")))
    assert [p.name for p in final.iterdir()] == ["new.bin"] and sorted(p.name for p in tmp_path.iterdir()) == ["encoder"]


def test_a_full_disk_in_an_atomic_write_names_the_bytes(tmp_path, monkeypatch):
    from mmviews.fileio import DiskFullError

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFullError) as caught:
        atomic_write_text(tmp_path / "results.json", "0123456789")
    assert str(caught.value).startswith(f"{tmp_path}: no space left while writing results.json: it needs about 10 bytes")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DiskFullError, match="needs about 7 bytes"):  # a writer given a file name: its bytes so far
        atomic_save(tmp_path / "x.bin", lambda tmp: Path(tmp).write_bytes(b"1234567"))


def test_a_full_disk_is_decided_from_the_device_not_the_errors_words(tmp_path, monkeypatch):
    """The system's code (ENOSPC, EDQUOT, also as the cause of another error) is a full disk; any
    other error is one when the folder's device has less free space than the write needed, or
    none, or refuses a small probe file for want of space (a quota); the words of an error
    decide nothing."""
    import mmviews.fileio as fileio
    from mmviews.fileio import DiskFullError, disk_full, disk_full_errno, is_disk_full

    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EACCES, "No space left on device"))  # the errno decides
    assert not is_disk_full(RuntimeError("I/O error: No space left on device (os error 28)"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 930112 vs 930004")  # torch's writer, after the system's error
    except RuntimeError as error:
        assert disk_full_errno(error) == errno.ENOSPC
    free = [100]
    monkeypatch.setattr(fileio, "free_bytes", lambda folder: free[0])
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 930112 vs 930004")
    with pytest.raises(DiskFullError, match=r"^/.*: no space left while writing x: it needs about 101 bytes, 100 bytes "
                                            "are free; nothing partial was left there$") as caught:
        with disk_full(tmp_path, "x", 101):
            raise torch_error
    assert caught.value.__cause__ is torch_error and caught.value.errno == errno.ENOSPC
    with pytest.raises(DiskFullError, match="it needs about 7 bytes"):  # any error, what it says aside
        with disk_full(tmp_path, "x", lambda: 7 if free[0] else 0):
            free[0] = 3
            raise KeyError("model")
    free[0] = 0
    with pytest.raises(DiskFullError, match="it needs about 0 bytes, 0 bytes are free"):  # nothing free, size unknown
        with disk_full(tmp_path, "x", lambda: 1 // 0):
            raise ValueError("half a header")
    free[0] = 100
    for error in (RuntimeError("basic_ios::clear: iostream error"), KeyError("No space left on device"),
                  OSError(errno.EIO, "No space left on device")):
        with pytest.raises(type(error)) as passed:  # room on the device: another cause, passed on as it is
            with disk_full(tmp_path, "x", 100):
                raise error
        assert passed.value is error
    with pytest.raises(RuntimeError, match="collective"):  # an estimate that fails never replaces the error
        with disk_full(tmp_path, "x", lambda: 1 // 0):
            raise RuntimeError("collective timed out")

    # a quota: the device shows room, the probe file is refused
    fsync = os.fsync

    def quota_reached(fd: int) -> None:
        if ".mmviews-space-probe-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", quota_reached)
    with pytest.raises(DiskFullError, match=r"no space left \(disk quota exceeded\) while writing q: it needs about 5 "
                                            "bytes") as caught:
        with disk_full(tmp_path, "q", 5):
            raise RuntimeError("basic_ios::clear: iostream error")
    assert caught.value.errno == errno.EDQUOT
    assert list(tmp_path.iterdir()) == []  # the probe removed


def test_sizes_names_and_free_space(tmp_path):
    from mmviews.fileio import folder_bytes, free_bytes, fsync_path, is_temporary_file_of

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"12")
    assert folder_bytes(tmp_path) == 7 and folder_bytes(tmp_path / "missing") == 0
    assert free_bytes(tmp_path / "not" / "yet") == free_bytes(tmp_path) > 0
    fsync_path(tmp_path)
    fsync_path(tmp_path / "y")
    assert is_temporary_file_of(".results.json.k2j4x9q1.tmp", "results.json")
    assert is_temporary_file_of(Path("/r/..mmviews-run.json.a_b0.tmp"), ".mmviews-run.json")
    assert not any(is_temporary_file_of(n, "results.json") for n in (
        "results.json.k2j4x9q1.tmp", ".results.json.tmp", ".results.json..tmp", ".results.json.K2.tmp",
        ".results.json.k2.tmpx", ".results.json.a.b.tmp", ".other.json.k2j4x9q1.tmp", ".results.jsonk2j4x9q1.tmp"))
    path = atomic_write_text(tmp_path / "results.json", "{}")  # the name mkstemp really gives is one
    assert is_temporary_file_of(tempfile.mkstemp(dir=tmp_path, prefix=f".{path.name}.", suffix=".tmp")[1], path.name)


def test_save_folder_writes_beside_the_final_folder_and_creates_parents(tmp_path):
    from mmviews.fileio import save_folder

    seen: list[Path] = []
    final = save_folder(tmp_path / "a" / "b" / "encoder", lambda d: seen.append(d) or (d / "w").write_bytes(b""))
    assert seen[0].parent == final.parent and seen[0].name.startswith(".encoder.tmp-")
    assert [p.name for p in final.parent.iterdir()] == ["encoder"]


def test_needed_bytes_are_the_files_not_what_was_written(tmp_path, monkeypatch):
    """A full disk mid-write: the bytes named are the whole file's (``needed``), not the part
    written before the disk filled."""
    import builtins

    import mmviews.fileio as fileio
    from mmviews.fileio import DiskFullError

    class HalfFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio, "open", lambda *args, **kwargs: HalfFile(builtins.open(*args, **kwargs)), raising=False)
    with pytest.raises(DiskFullError, match="it needs about 10 bytes"):
        atomic_write_bytes(tmp_path / "x.bin", b"0123456789")
    monkeypatch.undo()
    def full_after_three_bytes(tmp: str) -> None:
        Path(tmp).write_bytes(b"123")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match="it needs about 99 bytes"):
        atomic_save(tmp_path / "y.bin", full_after_three_bytes, needed=99)
    assert list(tmp_path.iterdir()) == []

    def cleans_up_then_fails(tmp: str) -> None:  # a writer that removes its own partial file
        Path(tmp).write_bytes(b"123")
        os.unlink(tmp)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match="it needs about 0 bytes"):  # nothing left to measure: 0, no other error
        atomic_save(tmp_path / "z.bin", cleans_up_then_fails)
    assert list(tmp_path.iterdir()) == []


def test_free_bytes_asks_the_nearest_existing_folder(tmp_path, monkeypatch):
    import shutil

    from mmviews.fileio import free_bytes

    asked: list[Path] = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: asked.append(Path(p)) or shutil._ntuple_diskusage(9, 2, 7))
    assert free_bytes(tmp_path / "not" / "yet") == 7 and free_bytes(tmp_path) == 7
    assert asked == [tmp_path, tmp_path]


def test_json_objects_and_folder_names(tmp_path):
    from mmviews.fileio import is_folder_name, read_json_object

    path = tmp_path / "m.json"
    path.write_text('{"a": 1}')
    assert read_json_object(path) == {"a": 1}
    path.write_text("[1]")
    with pytest.raises(KeyError, match=r"m.json: expected a JSON object, got list; fix it"):
        read_json_object(path, KeyError, "; fix it")
    path.write_bytes(b"\xff{")
    with pytest.raises(ValueError, match=r"m.json: not valid JSON \(.*\)$"):
        read_json_object(path)
    assert is_folder_name("run-1") and is_folder_name(".hidden") and is_folder_name("X")
    assert not any(is_folder_name(n) for n in ("", ".", "..", "a/b", "a\\b", "a\0b"))


def test_other_errors_pass_unchanged_without_estimating_the_bytes(tmp_path):
    """An error that cannot be a full disk (a collective timing out mid-checkpoint) reaches the
    caller as raised: the estimate of the bytes needed is not computed, so an error of the
    estimate itself (a sharded model's state after the failed collective) cannot replace it."""
    from mmviews.fileio import DiskFullError, disk_full

    def estimate() -> int:
        raise RuntimeError("Attempted to access the data pointer on an invalid python storage.")

    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    with pytest.raises(RuntimeError) as caught:
        with disk_full(tmp_path, "the checkpoint of step 3", estimate, cleanup=tmp_path / "partial"):
            raise timed_out
    assert caught.value is timed_out
    asked: list[int] = []
    with pytest.raises(DiskFullError, match="it needs about 1000000000000000000 bytes"):
        with disk_full(tmp_path, "x", lambda: asked.append(1) or 10 ** 18):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert asked == [1]  # a full disk: the estimate is asked, for the message


def test_exchange_swaps_two_folders_or_says_it_cannot(tmp_path, monkeypatch):
    import ctypes

    import mmviews.fileio as fileio

    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "name").write_text(folder.name)
    assert fileio._exchange(a, b)
    assert ((a / "name").read_text(), (b / "name").read_text()) == ("b", "a")
    (a / "inside").mkdir()
    assert not fileio._exchange(a, a / "inside")  # EINVAL: not for these two; nothing changed
    assert sorted(p.name for p in a.iterdir()) == ["inside", "name"]
    with pytest.raises(OSError) as caught:  # a real error is one
        fileio._exchange(a, tmp_path / "missing")
    assert (caught.value.errno, caught.value.filename, caught.value.filename2) == (
        errno.ENOENT, str(a), str(tmp_path / "missing"))
    with monkeypatch.context() as patch:
        patch.setattr(sys, "platform", "darwin")
        assert not fileio._exchange(a, b)
    with monkeypatch.context() as patch:
        def no_library(*args, **kwargs):
            raise OSError("no C library here")

        patch.setattr(ctypes, "CDLL", no_library)
        assert not fileio._exchange(a, b)
    assert ((a / "name").read_text(), (b / "name").read_text()) == ("b", "a")


@pytest.mark.parametrize("exchange", [True, False], ids=["exchanged", "moved-aside"])
def test_replace_folder_flushes_every_file_before_its_folder_and_the_rename(exchange, tmp_path, monkeypatch):
    import mmviews.fileio as fileio

    final, tmp = tmp_path / "encoder", tmp_path / ".encoder.tmp-x1"
    for folder, tag in ((final, "old"), (tmp, "new")):
        (folder / "text").mkdir(parents=True)
        (folder / "encoder.json").write_text(tag)
        (folder / "text" / "model.safetensors").write_text(tag)
    calls: list[tuple[str, str]] = []
    fsync, exchanged, replace = os.fsync, fileio._exchange, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd)))
    monkeypatch.setattr(fileio, "_exchange", lambda a, b: (calls.append(("rename", str(a))), exchanged(a, b))[1]
                        if exchange else False)
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("rename", str(a))), replace(a, b))[1])
    fileio.replace_folder(tmp, final)
    assert (final / "encoder.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["encoder"]
    renamed = calls.index(("rename", str(tmp) if exchange else str(final)))
    for path in [tmp / "encoder.json", tmp / "text" / "model.safetensors", tmp / "text", tmp]:
        assert calls.index(("fsync", str(path))) < renamed, path
    # a file before its folder: flushing a folder makes its entries durable, the files' data first
    assert calls.index(("fsync", str(tmp / "text" / "model.safetensors"))) < calls.index(("fsync", str(tmp / "text")))
    assert ("fsync", str(tmp_path)) in calls[renamed + 1:]


def test_the_space_probe_is_a_file_in_the_folder_that_is_removed(tmp_path, monkeypatch):
    import tempfile

    import mmviews.fileio as fileio

    probes: list[str] = []
    fsync = os.fsync

    def failing(code):
        def fsync_probe(fd: int) -> None:
            probes.append(os.readlink(f"/proc/self/fd/{fd}"))
            if code is not None:
                raise OSError(code, os.strerror(code))
            fsync(fd)
        return fsync_probe

    for code, said in [(None, None), (errno.EIO, None), (errno.ENOSPC, errno.ENOSPC), (errno.EDQUOT, errno.EDQUOT)]:
        with monkeypatch.context() as patch:
            patch.setattr(os, "fsync", failing(code))
            assert fileio._probe_refused(tmp_path / "not" / "yet") == said  # probed where the folder would be
        assert Path(probes[-1]).parent == tmp_path and Path(probes[-1]).name.startswith(".mmviews-space-probe-")
        assert not Path(probes[-1]).exists()  # removed
    for code, said in [(errno.ENOSPC, errno.ENOSPC), (errno.EACCES, None)]:  # not even a new file
        with monkeypatch.context() as patch:
            def refused(*args, code=code, **kwargs):
                raise OSError(code, os.strerror(code))

            patch.setattr(tempfile, "mkstemp", refused)
            assert fileio._probe_refused(tmp_path) == said
    assert list(tmp_path.iterdir()) == []


def test_error_chains_and_an_unreadable_device(tmp_path, monkeypatch):
    import mmviews.fileio as fileio
    from mmviews.fileio import disk_full, disk_full_errno

    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a  # a cycle, as code that sets __context__ by hand can make
    assert disk_full_errno(a) is None
    c = OSError(errno.EDQUOT, "quota")
    d = RuntimeError("d")
    d.__cause__ = c
    assert disk_full_errno(d) == errno.EDQUOT

    def unreadable(folder):
        raise OSError(errno.EIO, "the device does not answer")

    monkeypatch.setattr(fileio, "free_bytes", unreadable)
    monkeypatch.setattr(fileio, "_probe_refused", lambda folder: None)
    error = RuntimeError("basic_ios::clear: iostream error")
    with pytest.raises(RuntimeError) as passed:  # nothing known of the device: the error as it was
        with disk_full(tmp_path, "x", 100):
            raise error
    assert passed.value is error
    assert fileio.full_device(error, tmp_path, 100) is None
    monkeypatch.setattr(fileio, "_probe_refused", lambda folder: errno.ENOSPC)
    assert fileio.full_device(error, tmp_path, 100) == (100, errno.ENOSPC)


def test_a_full_disk_at_a_folders_commit_is_the_short_error(tmp_path, monkeypatch):
    """Delayed allocation: the disk fills when the committed folder itself is flushed."""
    import mmviews.fileio as fileio
    from mmviews.fileio import DiskFullError

    final = tmp_path / "encoder"
    fileio.save_folder(final, lambda f: (f / "a.bin").write_bytes(b"old"))
    fsync = os.fsync

    def full_at_the_folder(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name.startswith(".encoder.tmp-") and path.is_dir():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_at_the_folder)
    with pytest.raises(DiskFullError, match=r"no space left while writing encoder/: it needs about 4 bytes"):
        fileio.save_folder(final, lambda f: (f / "a.bin").write_bytes(b"new!"), needed=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder"] and (final / "a.bin").read_bytes() == b"old"


def test_a_failed_writers_frames_are_released_before_the_free_space_is_told(tmp_path, monkeypatch):
    """What the failed writer's frames hold (torch's zip writer: its deleted partial file, still
    open) is let go, in every error of the chain, before the free space is measured for the message."""
    import weakref

    import mmviews.fileio as fileio
    from mmviews.fileio import DiskFullError, disk_full

    class OpenFile:
        pass

    held: list[weakref.ref] = []

    def write() -> None:
        partial = OpenFile()
        held.append(weakref.ref(partial))
        raise RuntimeError("basic_ios::clear: iostream error")

    def close_the_zip() -> None:
        try:
            write()
        except RuntimeError:
            writer = OpenFile()
            held.append(weakref.ref(writer))
            raise RuntimeError("unexpected pos 930112 vs 930004")

    alive_when_measured: list[list[bool]] = []
    free = fileio.free_bytes
    monkeypatch.setattr(fileio, "free_bytes", lambda folder: (alive_when_measured.append([r() is not None for r in held]),
                                                               0)[1] if held else free(folder))
    with pytest.raises(DiskFullError):
        with disk_full(tmp_path, "x", 100):
            close_the_zip()
    assert alive_when_measured[0] == [True, True]  # the decision: while the partial file is held
    assert alive_when_measured[-1] == [False, False]  # the message: after both frames let go

    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    fileio._release_frames(a)  # a cycle ends


def test_exchange_of_relative_paths(tmp_path, monkeypatch):
    import mmviews.fileio as fileio

    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        Path(name).mkdir()
        (Path(name) / "name").write_text(name)
    assert fileio._exchange(Path("a"), Path("b")) and (Path("a") / "name").read_text() == "b"
    with pytest.raises(OSError) as caught:
        fileio._exchange(Path("a"), Path("missing"))
    assert caught.value.strerror == os.strerror(errno.ENOENT)
