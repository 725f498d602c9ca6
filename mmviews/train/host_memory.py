"""Whether the process's C allocator keeps the host memory a training step frees (recipe key
``host_memory``).

A step on the CPU allocates and frees the same activations at every step. With its defaults,
glibc's malloc gives memory back to the system as soon as it can: the free top of its heap once
it exceeds a threshold, and every block above its ``mmap`` threshold (which it raises up to 32
MiB) is a mapping of its own, unmapped when freed. The next step gets the memory again from the
kernel, page by page, zeroed: kernel time and page faults at every step. Measured on
``mmviews bench train --case quickstart`` (2 threads, idle 2-core CPU): the step takes 0.74-0.79 s
at K = 128 with glibc's defaults, 0.48-0.53 s keeping the heap, 0.40-0.41 s holding everything.

``host_memory``:

- ``auto`` (the default): ``heap`` when mmviews's command owns the process (``mmviews train``,
  ``python -m mmviews.cli train``, ``accelerate launch -m mmviews.cli train``, the ``mmviews
  bench train`` processes; not :func:`mmviews.train.train` called from a program of yours, whose
  allocator is yours to set) and the step runs on the CPU; the allocator is left as it is when
  the environment already configures glibc's malloc (``MALLOC_*`` variables, or
  ``GLIBC_TUNABLES`` naming ``glibc.malloc``): the user's setting stands.
- ``heap``: the heap is kept (its free top is given back only beyond 2 GiB) and the ``mmap``
  threshold is fixed at 32 MiB: blocks up to 32 MiB reuse the heap's memory from step to step,
  larger ones are still mapped and given back. The peak resident set is that of glibc's
  defaults (within the 2-4 % spread of runs on the quickstart at K = 128 and 512).
- ``hold``: everything from the heap, nothing given back (no ``mmap`` for large blocks): the
  fastest (1.9-2.1x glibc's defaults on the quickstart), but the heap fragments, and the peak
  resident set can rise well beyond the live tensors' (+8 % at K = 128, +42 % at K = 512 on
  the quickstart's plain step), beyond what ``mmviews train --check`` estimates.
- ``system``: leave the allocator as it is (glibc's defaults, or the environment's).

Linux with glibc only; elsewhere nothing changes. Loader workers forked after the setting
inherit it. A setting cannot be undone inside the process; ``results.json`` records what the
process ran with (``heap``, ``hold``, ``environment`` or ``system``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Mapping

HOST_MEMORY_SETTINGS = ("auto", "heap", "hold", "system")

# glibc's malloc.h parameter numbers for mallopt
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
#: The heap's free top is given back only beyond this (mallopt takes a C int: 2 GiB - 1).
KEEP_TRIM_THRESHOLD = 2**31 - 1
#: glibc's largest mmap threshold on 64-bit systems (half its 64 MiB heap size)
LARGEST_MMAP_THRESHOLD = 32 * 2**20
#: mallopt calls of each setting mmviews makes
MALLOPT_CALLS = {
    "heap": ((M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)),
    "hold": ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)),
}

_applied: str | None = None  # the setting mmviews applied in this process
#: What ``mmviews train --check`` says under ``host_memory: hold`` (its estimate counts live tensors)
HOLD_NOTE = ("host_memory: hold serves every block from the heap, which fragments: the peak resident set can exceed "
             "this estimate (by 42 % on the quickstart's plain step at K = 512); host_memory: heap (the default on "
             "the CPU) keeps the estimate's peak")


def is_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def allocator_set_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment configures glibc's malloc itself (read by glibc when the process started)."""
    # glibc's names: MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_MAX_, ..., MALLOC_ARENA_MAX (no underscore)
    return any(name.startswith("MALLOC_") for name in environ) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(setting: str) -> bool:
    """Apply ``heap`` or ``hold`` (see the module docstring) to glibc's malloc for the rest of
    the process; False where that cannot be done (not glibc). The first setting applied stays."""
    global _applied
    if _applied is not None:
        return _applied == setting
    if not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # mallopt returns 1 on success; a setting only half made is said so by False
    done = all(mallopt(parameter, value) == 1 for parameter, value in MALLOPT_CALLS[setting])
    if done:
        _applied = setting
    return done


def configure_host_memory(setting: str, *, owns_process: bool, on_cpu: bool) -> str:
    """Apply ``host_memory`` (``setting``) to this process and return what the process now runs
    with (:func:`host_memory_state`). ``owns_process``: mmviews's command started this process;
    ``on_cpu``: the training step runs on the CPU."""
    if setting not in HOST_MEMORY_SETTINGS:
        raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORY_SETTINGS)}, got {setting!r}")
    if setting == "auto":
        setting = "heap" if owns_process and on_cpu and not allocator_set_by_environment() else "system"
    if setting != "system":
        keep_freed_memory(setting)
    return host_memory_state()


def host_memory_state() -> str:
    """``heap`` or ``hold`` (what mmviews applied in this process), ``environment`` (the
    environment configures malloc), or ``system`` (glibc's defaults, or not glibc)."""
    if _applied is not None:
        return _applied
    return "environment" if is_glibc() and allocator_set_by_environment() else "system"
