"""What a test that runs a user-facing script checks afterwards: nothing in the repository changed.

:func:`repository_state` lists every file of the checkout (tracked, untracked and git-ignored
alike: an ignored cache folder under ``recipes/reproduce/results/`` is in the repository too)
with its size, modification time and inode, so a rewrite, an atomic replace, a new file or a
deleted one all show. Only the interpreter's and tools' own caches are left out. Listing the
checkout's few hundred files takes milliseconds.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
# folders Python, pytest and the mutation runner write while the tests run; not the scripts' doing
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", ".mutation", ".venv", ".mypy_cache", ".ruff_cache"}


def repository_state(root: Path = REPO_ROOT) -> dict[str, tuple[int, int, int]]:
    """``{path relative to root: (size, mtime_ns, inode)}`` of every file under ``root``."""
    state: dict[str, tuple[int, int, int]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            info = path.lstat()
            state[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns, info.st_ino)
    return state


def changes(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> list[str]:
    """The files added, removed or rewritten between two :func:`repository_state` listings."""
    return sorted([f"added {p}" for p in after.keys() - before.keys()]
                  + [f"removed {p}" for p in before.keys() - after.keys()]
                  + [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]])


@contextlib.contextmanager
def repository_unchanged() -> Iterator[None]:
    """Fails (AssertionError naming the files) when the block added, removed or rewrote a file
    of the repository."""
    before = repository_state()
    yield
    assert not changes(before, repository_state()), changes(before, repository_state())
