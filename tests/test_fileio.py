"""Atomic writes (mmviews.fileio): all or nothing, no temporary file left, umask permissions."""

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
