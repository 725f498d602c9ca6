"""Atomic, durable file writes, shared by every part of mmviews that saves a file, the error a
full disk gives, and the checks every reader of a user's folder applies (JSON objects, single
folder names).

A file is written to a temporary file in the destination folder and moved over the destination
with ``os.replace`` (atomic on POSIX and Windows), so a crash or an exception leaves either the
old file or the new one, never half of one, and no temporary file behind. The result gets the
usual permissions of the process's umask (``mkstemp`` alone would leave 0600).

**Durable commits.** A rename is atomic for the running system, but after a power cut or a
kernel crash the file system may hold the new name pointing at data never written to the disk
(the rename reached the journal, the file's pages did not). So every commit is: the new file's
data flushed (``fsync``), then the rename, then the parent folder flushed (``fsync`` of the
folder makes the rename itself durable). A folder (a checkpoint, ``encoder/``, an export) is
committed the same way by :func:`commit_folder`: every file and sub-folder in it flushed, the
folder renamed, its parent flushed. Its files and folders get the umask's permissions too,
whichever library wrote them (safetensors leaves 0600, ``mkdtemp`` 0700).

**A full disk** (or a quota reached) while writing is turned into a :class:`DiskFullError`
naming the folder, the bytes the write needed and the bytes free (:func:`disk_full`), after the
partial temporary file or folder is removed. Whether a failed write was a full disk is decided
from the device (:func:`full_device`: its free space against the write's size, a probe for a
quota), whatever the writer's error says.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

# errno values of a write that failed for want of space: the device is full, or the user's quota is.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


class DiskFullError(OSError):
    """A write failed because the device (or the user's quota) is full; the message names the
    folder, the bytes needed and the bytes free."""


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return mask


def _umask_mode() -> int:
    """The mode ``open`` gives a new file under the process's umask."""
    return 0o666 & ~_umask()


def follow_umask(path: str | os.PathLike[str]) -> None:
    """Give ``path`` the permissions the process's umask gives a new file (``0o666 & ~umask``)
    or folder (``0o777 & ~umask``): for what another library created with its own (``mkstemp``
    and safetensors leave files 0600, ``mkdtemp`` folders 0700), so that a colleague reads a run
    as the umask allows. A symbolic link is left alone (chmod would change its target)."""
    path = Path(path)
    if path.is_symlink():
        return
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a folder's data to the disk (a folder: its entries, e.g. a rename in it).
    Where a folder cannot be opened or flushed (Windows, some network file systems) nothing is
    done: the rename is then as durable as that file system makes it."""
    try:
        fd = os.open(path, os.O_RDONLY)  # a folder too (POSIX opens one read-only)
    except (IsADirectoryError, PermissionError):  # Windows opens no folder
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.EROFS):  # a folder that cannot be flushed
            raise
    finally:
        os.close(fd)


def is_temporary_file_of(path: str | os.PathLike[str], name: str) -> bool:
    """Whether ``path`` is one of :func:`atomic_save`'s temporary files for a file called ``name``
    (``.<name>.<random>.tmp``, the random part of ``tempfile.mkstemp``): left behind only when
    the process was killed mid-write."""
    rest = Path(path).name.removeprefix(f".{name}.")
    return rest != Path(path).name and re.fullmatch(r"[a-z0-9_]+\.tmp", rest) is not None


def atomic_save(path: str | os.PathLike[str], write: Callable[[str], None], needed: int | None = None) -> Path:
    """``write(tmp_path)`` fills a temporary file that then replaces ``path`` atomically and
    durably (flushed, renamed, parent folder flushed: see the module docstring).

    For writers that take a file name (``safetensors.save_file``, ``Figure.savefig``). The
    parent folder is created; if ``write`` raises, the temporary file is removed and ``path``
    is left as it was; a full disk is a :class:`DiskFullError` (``needed``: the bytes the file
    needs, when known; else the bytes written before the disk filled).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with disk_full(path.parent, path.name, lambda: needed if needed is not None else _size(tmp)):
            write(tmp)
            os.chmod(tmp, _umask_mode())
            fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _size(path: str | os.PathLike[str]) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``folder`` (0 when it is gone)."""
    return sum(_size(p) for p in Path(folder).rglob("*") if p.is_file())  # nothing under a folder that is gone


def commit_folder(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> Path:
    """Rename the complete folder ``tmp`` to ``final`` durably: every file and sub-folder of
    ``tmp`` given the umask's permissions (:func:`follow_umask`: whichever library wrote them,
    e.g. safetensors' 0600 weights) and flushed, then the rename (``final`` must not exist), then
    the parent folder flushed."""
    tmp, final = Path(tmp), Path(final)
    for path in sorted(tmp.rglob("*"), reverse=True):  # a path sorts after its folder: files flushed first
        follow_umask(path)
        fsync_path(path)
    follow_umask(tmp)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(final.parent)
    return final


def temporary_folder(final: str | os.PathLike[str]) -> Path:
    """A new empty folder beside ``final`` named ``.<final's name>.tmp-<random>`` (a name no one
    else has), to be filled and then committed with :func:`commit_folder`."""
    final = Path(final)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def save_folder(final: str | os.PathLike[str], write: Callable[[Path], Any], needed: int | None = None) -> Path:
    """``write(folder)`` fills a temporary folder beside ``final`` (:func:`temporary_folder`) that
    then replaces ``final`` durably (:func:`commit_folder`; a ``final`` already there, which the
    caller wrote before, is swapped out by :func:`replace_folder` and deleted after). If ``write``
    raises, the temporary folder is removed and ``final`` is left as it was; a full disk is a
    :class:`DiskFullError` (``needed``: the bytes the folder needs, when known)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(final)
    try:
        with disk_full(final.parent, f"{final.name}/", lambda: needed if needed is not None else folder_bytes(tmp)):
            write(tmp)
            replace_folder(tmp, final)  # its flushes may be where a full disk shows (delayed allocation)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


#: ``.<name>.previous-<random>``: a complete folder moved aside while its replacement is renamed in
#: (:func:`replace_folder` where folders cannot be exchanged); the next start puts it back if the
#: replacement never came (:func:`is_previous_folder_of`).
PREVIOUS_INFIX = ".previous-"


def replace_folder(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> Path:
    """Commit the complete folder ``tmp`` as ``final`` (:func:`commit_folder`), replacing a
    ``final`` already there, with a complete folder named ``final`` at every moment: the two are
    exchanged in one atomic rename (Linux ``renameat2(RENAME_EXCHANGE)``), then the old one, now
    named ``tmp``, is deleted. Where folders cannot be exchanged (another system, some network file
    systems) the old one is first moved into ``.<name>.previous-<random>/``, which
    :func:`mmviews.train.run_folder.remove_leftovers` moves back when a kill came before ``final``
    was there again, and deletes otherwise."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        return commit_folder(tmp, final)
    for path in sorted(tmp.rglob("*"), reverse=True):
        fsync_path(path)
    fsync_path(tmp)
    if _exchange(tmp, final):
        fsync_path(final.parent)
        shutil.rmtree(tmp)  # the old folder
        return final
    previous = Path(tempfile.mkdtemp(prefix=f".{final.name}{PREVIOUS_INFIX}", dir=final.parent))
    os.replace(final, previous / final.name)
    commit_folder(tmp, final)
    shutil.rmtree(previous)
    return final


def is_previous_folder_of(path: str | os.PathLike[str], name: str) -> bool:
    """Whether ``path`` is the name :func:`replace_folder` moves a complete ``name`` folder to
    while its replacement is renamed in (``.<name>.previous-<random>``)."""
    rest = Path(path).name.removeprefix(f".{name}{PREVIOUS_INFIX}")
    return rest != Path(path).name and re.fullmatch(r"[a-z0-9_]+", rest) is not None


def is_temporary_folder_of(path: str | os.PathLike[str], name: str) -> bool:
    """Whether ``path`` is one of :func:`temporary_folder`'s folders for a folder called ``name``
    (``.<name>.tmp-<random>``, the random part of ``tempfile.mkdtemp``): only such a name, not one
    that merely starts like it (a user's ``.encoder.tmp-backup.old``)."""
    rest = Path(path).name.removeprefix(f".{name}.tmp-")
    return rest != Path(path).name and re.fullmatch(r"[a-z0-9_]+", rest) is not None


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# renameat2's errors where the system or the file system cannot exchange: not supported, not for
# these (e.g. a folder into its own sub-folder), not permitted (a container's seccomp filter)
_CANNOT_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM})


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``);
    False where the system or the file system cannot (nothing is changed then)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without renameat2 (glibc < 2.28, some others)
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def nearest_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it is an existing folder, else its nearest existing ancestor folder:
    where ``path`` would be created, and so the device and permissions that decide for it."""
    where = Path(path).absolute()
    while not where.is_dir() and where.parent != where:
        where = where.parent
    return where


def free_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes free to this user where ``folder`` (or its nearest existing ancestor) is."""
    return shutil.disk_usage(nearest_folder(folder)).free


def disk_full_errno(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT when ``error``, or an error it was raised from (``__cause__``,
    ``__context__``), is an ``OSError`` with the system's own code for a full device or quota."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return cause.errno
        cause = cause.__cause__ or cause.__context__
    return None


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is an ``OSError`` of ENOSPC or EDQUOT."""
    return disk_full_errno(error) is not None


# A probe written where a write failed although the device reports room: a quota (invisible to
# the device's free count) refuses it too.
_PROBE_BYTES = 64 * 1024


def _probe_refused(folder: str | os.PathLike[str]) -> int | None:
    """The errno (ENOSPC or EDQUOT) with which ``folder``'s device refuses a small file written and
    flushed there, or None when it takes it (or the folder cannot be written for another reason)."""
    try:
        fd, probe = tempfile.mkstemp(dir=nearest_folder(folder), prefix=".mmviews-space-probe-")
    except OSError as error:
        return error.errno if error.errno in DISK_FULL_ERRNOS else None
    try:
        os.write(fd, bytes(_PROBE_BYTES))
        os.fsync(fd)
    except OSError as error:
        return error.errno if error.errno in DISK_FULL_ERRNOS else None
    finally:
        os.close(fd)
        os.unlink(probe)
    return None


def full_device(error: BaseException, folder: str | os.PathLike[str],
                needed: int | Callable[[], int]) -> tuple[int, int] | None:
    """Whether the write into ``folder`` that raised ``error`` failed for want of space, decided
    from the device, not from the error's words (each writer words it its own way: torch's zip
    writer "iostream error" or "unexpected pos", safetensors "I/O error"): the error carries the
    system's ENOSPC or EDQUOT (:func:`disk_full_errno`), or the folder's device has less free
    space than the write ``needed`` (a number, or a function called now), none at all, or it
    refuses a small probe file for want of space (a quota, which the free count does not show).
    ``(bytes needed or 0 when unknown, errno)`` then, else None (the device had room: another
    error). An estimate of ``needed`` that itself fails does not count against the device."""
    code = disk_full_errno(error)
    try:
        free: int | None = free_bytes(folder)
    except OSError:
        free = None
    try:
        bytes_needed: int | None = needed() if callable(needed) else needed
    except Exception:  # e.g. a sharded model's state after a failed collective cannot be measured
        bytes_needed = None
    short = free is not None and (free == 0 or (bytes_needed is not None and free < bytes_needed))
    if code is None:
        code = errno.ENOSPC if short else _probe_refused(folder)
    return None if code is None else (bytes_needed or 0, code)


@contextlib.contextmanager
def disk_full(folder: str | os.PathLike[str], what: str, needed: int | Callable[[], int],
              cleanup: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Around a write into ``folder``: an error raised while the device or the quota is full
    (:func:`full_device`, whatever the error says) becomes a :class:`DiskFullError` naming
    ``folder``, ``what`` was written, the bytes it ``needed`` (a number, or a function called after
    the failure) and the bytes free, once the partial folder ``cleanup`` (if given) is removed.
    Other errors pass unchanged."""
    try:
        yield
    except Exception as error:
        # (a DiskFullError of a write inside: said again for the whole of this one, its folder removed)
        full = full_device(error, folder, needed)
        if full is None:
            raise
        bytes_needed, code = full
        _release_frames(error)
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise disk_full_error(folder, what, bytes_needed, code) from error


def _release_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames of ``error`` and of the errors it was raised from:
    a failed writer's frames may still hold its open file (torch's zip writer), whose space a
    device frees only when it is closed, so that the free space then told is the device's."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    gc.collect()  # a writer caught in a reference cycle


def disk_full_error(folder: str | os.PathLike[str], what: str, bytes_needed: int, code: int = errno.ENOSPC) -> DiskFullError:
    """The :class:`DiskFullError` of a write of ``what`` into ``folder`` (its partial output
    already removed) that needed about ``bytes_needed``; ``code``: ENOSPC, or EDQUOT for a quota."""
    quota = code != errno.ENOSPC  # EDQUOT (the same number as ENOSPC where a system has no quotas)
    stopped = DiskFullError(f"{folder}: no space left{' (disk quota exceeded)' if quota else ''} while writing "
                            f"{what}: it needs about {bytes_needed} bytes, {free_bytes(folder)} bytes are free; "
                            "nothing partial was left there")
    stopped.errno = code
    return stopped


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_save`)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_save(path, write, needed=len(data))


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


def check_writable(path: str | os.PathLike[str]) -> Path:
    """Raise a ``PermissionError`` naming ``path`` (the ``--output`` a command was given, or its
    default), the folder that refused and the fix, unless this process can create files where
    ``path`` goes: in ``path`` itself when it is an existing folder, else in its nearest existing
    ancestor (where it would be created). Tried for real, with a temporary file created and
    removed at once: ``os.access`` says yes to root on a read-only mount or under ``/sys``, where
    every write then fails. Returns the folder tried."""
    path = Path(path)
    where = nearest_folder(path)
    try:
        fd, probe = tempfile.mkstemp(dir=where, prefix=".mmviews-write-test-")
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise PermissionError(f"cannot write {path}: {where} refuses new files ({reason}); choose a folder this user "
                              "can write to with --output") from None
    os.close(fd)
    os.unlink(probe)
    return where
