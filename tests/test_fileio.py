"""Atomic writes (mmviews.fileio): all or nothing, no temporary file left, umask permissions; a full
disk is one error naming the folder, the bytes needed and free."""

import errno
import os
import stat
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


def test_permissions_follow_the_umask(tmp_path: Path):
    old = os.umask(0o027)
    try:
        path = atomic_write_text(tmp_path / "report.md", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # not mkstemp's 0600


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
    with pytest.raises(PermissionError, match=rf"^cannot write {folder / 'x'}/y: {folder} refuses new files \("):
        check_writable(folder / "x" / "y")
