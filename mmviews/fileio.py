"""Atomic file writes, shared by every part of mmviews that saves a file, and the checks every
reader of a user's folder applies (JSON objects, single folder names).

A file is written to a temporary file in the destination folder and moved over the destination
with ``os.replace`` (atomic on POSIX and Windows), so a crash or an exception leaves either the
old file or the new one, never half of one, and no temporary file behind. The result gets the
usual permissions of the process's umask (``mkstemp`` alone would leave 0600).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def _umask_mode() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return 0o666 & ~mask


def atomic_save(path: str | os.PathLike[str], write: Callable[[str], None]) -> Path:
    """``write(tmp_path)`` fills a temporary file that then replaces ``path`` atomically.

    For writers that take a file name (``safetensors.save_file``, ``Figure.savefig``). The
    parent folder is created; if ``write`` raises, the temporary file is removed and ``path``
    is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_save`)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_save(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_save`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_json_object(path: str | os.PathLike[str], error: type[Exception] = ValueError, hint: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; a file that is not valid JSON (or not UTF-8), or whose top
    level is not an object, raises ``error`` naming the path, with ``hint`` (e.g. what to do
    about it) appended."""
    try:
        data = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid JSON ({err}){hint}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}{hint}")
    return data


def is_folder_name(name: str) -> bool:
    """Whether ``name`` is one path component: not empty, not ``.``/``..``, no separator or NUL
    (a name read from a user's file may then be joined to a folder without leaving it)."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
