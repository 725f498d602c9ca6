"""This process's memory as the kernel counts it, read in one place.

The memory estimate (:mod:`mmviews.train.memory`) and the benchmarks (``mmviews bench``) measure
host memory with these: the resident set now (:func:`resident_bytes`), its high-water mark
(:func:`resident_peak_bytes`, :func:`resident_high_water_bytes`), resetting that mark
(:func:`reset_resident_peak`) and giving glibc's free memory back first (:func:`trim_host_memory`),
so that the resident set is what the process holds. Linux's ``/proc/self`` files where there are
some; elsewhere ``getrusage``'s high-water mark, or nothing.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys


def _maxrss_bytes() -> int:
    """``getrusage``'s high-water mark of the resident set, in bytes (kilobytes on Linux, bytes on
    macOS). On Linux it includes the spawning process's resident set carried over at ``exec``."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def resident_bytes() -> int:
    """The process's resident set now (Linux ``/proc/self/statm``; elsewhere the high-water mark)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _maxrss_bytes()


def resident_peak_bytes() -> int:
    """The resident set's high-water mark (``VmHWM``, Linux), bytes; 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_high_water_bytes() -> int:
    """The resident set's high-water mark since the process started or since the last
    :func:`reset_resident_peak`: ``VmHWM`` where Linux has it, else ``getrusage``'s. Not
    ``getrusage`` on Linux: the kernel carries the spawning process's resident set over into it
    at ``exec``, so a process started by a large one (a test process, a bench holding torch)
    would report its parent's peak as its own."""
    return resident_peak_bytes() or _maxrss_bytes()


def reset_resident_peak() -> bool:
    """Reset the resident set's high-water mark to the resident set now; False where the kernel
    does not allow it (``/proc/self/clear_refs``, Linux 4.0 and later)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset VmHWM to the current resident set
        return True
    except OSError:
        return False


def trim_host_memory() -> None:
    """Give the C allocator's free memory back to the system (glibc ``malloc_trim``), so that the
    resident set is what the process holds; nothing elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass
