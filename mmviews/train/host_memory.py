"""Whether the process's C allocator keeps the host memory a training step frees (recipe key
``host_memory``).

A step on the CPU allocates and frees the same activations at every step. glibc's malloc
serves a block above its ``mmap`` threshold (which it raises to at most 32 MiB) with a fresh
mapping and unmaps it when it is freed, and gives the free top of its heap back to the system.
A step whose activations are larger than that (the feed-forward output of a small BERT over
both views of K = 128 samples of 32 tokens is 48 MiB) then maps, faults in page by page and
unmaps them at every step: kernel time that grows with the batch (measured with
all-MiniLM-L6-v2 at K = 128 on 2 threads: about 0.8 s of a 6 s step, and 2.8 times the page
faults of sentence-transformers' step, which makes two calls of half the size). Told to keep
what is freed (``mallopt``: no ``mmap`` for large blocks, the heap's top kept up to 2 GiB),
malloc hands the same memory to the next step: the resident set stays at the step's peak
between steps instead of dropping and climbing again, and the peak itself is the same.

``host_memory``:

- ``auto`` (the default): hold freed memory when mmviews's command owns the process (``mmviews
  train``, ``python -m mmviews.cli train``, ``accelerate launch -m mmviews.cli train``, the
  ``mmviews bench train`` processes; not :func:`mmviews.train.train` called from a program of
  yours, whose allocator is yours to set) and the step runs on the CPU; leave the allocator as
  it is when the environment already configures glibc's malloc (``MALLOC_*`` variables, or
  ``GLIBC_TUNABLES`` naming ``glibc.malloc``): the user's setting stands.
- ``hold``: hold freed memory, also inside a program of yours (for the rest of its process).
- ``system``: leave the allocator as it is (glibc's defaults, or the environment's).

Linux with glibc only; elsewhere nothing changes. Loader workers forked after the setting
inherit it. The setting cannot be undone inside the process (``results.json`` records what the
process ran with: ``hold``, ``environment`` or ``system``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Mapping

HOST_MEMORY_SETTINGS = ("auto", "hold", "system")

# glibc's malloc.h parameter numbers for mallopt
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: The heap's free top is given back only beyond this (mallopt takes a C int: 2 GiB - 1).
HOLD_TRIM_THRESHOLD = 2**31 - 1
#: The same setting for a process that is about to start (glibc reads these when it starts).
HOLD_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(HOLD_TRIM_THRESHOLD)}

_held_by_mmviews = False


def is_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def allocator_set_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment configures glibc's malloc itself (read by glibc when the process started)."""
    # glibc's names: MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_MAX_, ..., MALLOC_ARENA_MAX (no underscore)
    return any(name.startswith("MALLOC_") for name in environ) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


def hold_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (see the module docstring), for the
    rest of the process; False where that cannot be done (not glibc)."""
    global _held_by_mmviews
    if not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # mallopt returns 1 on success; both or the setting is only half made (then said so by False)
    done = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, HOLD_TRIM_THRESHOLD) == 1
    _held_by_mmviews = _held_by_mmviews or done
    return done


def configure_host_memory(setting: str, *, owns_process: bool, on_cpu: bool) -> str:
    """Apply ``host_memory`` (``setting``) to this process and return what the process now runs
    with (:func:`host_memory_state`). ``owns_process``: mmviews's command started this process;
    ``on_cpu``: the training step runs on the CPU."""
    if setting not in HOST_MEMORY_SETTINGS:
        raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORY_SETTINGS)}, got {setting!r}")
    wanted = setting == "hold" or (setting == "auto" and owns_process and on_cpu and not allocator_set_by_environment())
    if wanted and not _held_by_mmviews:
        hold_freed_memory()
    return host_memory_state()


def host_memory_state() -> str:
    """``hold`` (mmviews told malloc to keep freed memory in this process), ``environment`` (the
    environment configures malloc), or ``system`` (glibc's defaults, or not glibc)."""
    if _held_by_mmviews:
        return "hold"
    return "environment" if is_glibc() and allocator_set_by_environment() else "system"
