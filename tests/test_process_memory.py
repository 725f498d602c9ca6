"""The process's memory as mmviews reads it (:mod:`mmviews.process_memory`), for the memory
estimate and the benchmarks alike: the resident set, its high-water mark and its reset, the
allocator's trim, and the fallbacks where ``/proc`` cannot be read. References read
``/proc/self/status`` (or ``getrusage``) here, independently of the module."""

from __future__ import annotations

import mmap
import resource
import subprocess
import sys

import pytest
import torch

from mmviews import process_memory
from mutations import apply_break

MiB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_resident_bytes_is_the_processes_resident_set() -> None:
    low = _status_kib("VmRSS") * 1024
    reading = process_memory.resident_bytes()
    high = _status_kib("VmRSS") * 1024
    assert low - 4 * MiB <= reading <= high + 4 * MiB, (low, reading, high)


def test_trimming_gives_freed_small_blocks_back() -> None:
    """40,000 blocks of 2 kB (malloc's heap, not mmap: 78 MiB) freed below one kept: the
    resident set stays up until the allocator is trimmed."""
    blocks = [bytes(2000) for _ in range(40_000)]
    kept = blocks[-1]
    del blocks
    before = process_memory.resident_bytes()
    process_memory.trim_host_memory()
    assert before - process_memory.resident_bytes() > 40 * MiB and len(kept) == 2000


def test_resident_peak_is_the_high_water_mark_and_resets_to_the_resident_set() -> None:
    low = _status_kib("VmHWM") * 1024
    peak = process_memory.resident_peak_bytes()
    assert low <= peak <= _status_kib("VmHWM") * 1024
    assert process_memory.resident_high_water_bytes() >= peak  # the same mark, read again later
    # reset: the mark comes down to the resident set now (earlier work in this process set it higher)
    assert process_memory.reset_resident_peak()
    now = process_memory.resident_bytes()
    start = process_memory.resident_peak_bytes()
    assert abs(start - now) <= 4 * MiB
    grown = torch.ones(64 * MiB // 4)  # 64 MiB touched (mmap: freed at once)
    del grown
    assert process_memory.resident_peak_bytes() >= start + 60 * MiB


def check_peak_probe() -> None:
    """The high-water mark's rise is what a call adds: 64 MiB touched, then (after a reset)
    8 MiB. The blocks are fresh anonymous mappings (not malloc's, which may hand back pages that
    earlier tests in this process left resident)."""
    for mib in (64, 8):
        assert process_memory.reset_resident_peak(), "/proc/self/clear_refs did not reset the high-water mark"
        before = process_memory.resident_bytes()
        block = mmap.mmap(-1, mib * MiB)
        for offset in range(0, len(block), mmap.PAGESIZE):  # every page touched, no other buffer
            block[offset] = 1
        added = (process_memory.resident_high_water_bytes() - before) / MiB
        block.close()
        assert mib - 1 <= added <= mib + 16, f"{mib} MiB allocated, the probe saw {added:.1f} MiB"


def test_peak_probe_sees_what_a_call_adds() -> None:
    check_peak_probe()


def test_peak_probe_check_fails_when_the_high_water_mark_is_not_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    apply_break("bench_rss_reset_does_nothing", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        check_peak_probe()


def test_high_water_mark_of_a_spawned_process_is_its_own() -> None:
    """A bench case runs in a process spawned by a larger one (the bench holding torch, a test
    process): its peak must be its own. Linux carries the parent's resident set over into the
    child's ``ru_maxrss`` at exec (the old measure: a 16-sample case measured 1.26 GB, its test
    process's size, against 0.83 GB run alone); ``VmHWM`` starts with the child's own memory."""
    held = bytearray(1536 * MiB)
    held[::4096] = b"\1" * len(held[::4096])  # touch every page: resident in this process
    code = "from mmviews.process_memory import resident_high_water_bytes; print(resident_high_water_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert process_memory.resident_high_water_bytes() >= len(held)  # this process's own peak holds it
    assert child < len(held), f"the child reports {child / MiB:.0f} MB: the parent's peak"


def _refused(*args: object, **kwargs: object) -> None:
    raise OSError("no /proc")


def test_readings_where_proc_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """No /proc (not Linux): the resident set and the high-water mark fall back to the mark
    getrusage gives (kilobytes on Linux), the peak is unknown (0) and cannot be reset."""
    monkeypatch.setattr(process_memory, "open", _refused, raising=False)
    low = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert low <= process_memory.resident_bytes() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert low <= process_memory.resident_high_water_bytes() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert process_memory.resident_peak_bytes() == 0
    assert process_memory.reset_resident_peak() is False


def test_resident_set_fallback_on_macos_is_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS's getrusage reports the high-water mark in bytes (Linux's in kilobytes)."""
    monkeypatch.setattr(process_memory, "open", _refused, raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    low = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert low <= process_memory.resident_bytes() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_the_estimate_and_the_benchmarks_read_memory_here() -> None:
    """One reader: the memory estimate and the benchmarks use these functions, not copies."""
    from mmviews.bench import scale, text_step
    from mmviews.bench import train_measure
    from mmviews.train import memory

    assert memory.resident_bytes is process_memory.resident_bytes
    assert memory.resident_peak_bytes is process_memory.resident_peak_bytes
    assert memory.trim_host_memory is process_memory.trim_host_memory
    assert scale.resident_high_water_bytes is process_memory.resident_high_water_bytes
    assert train_measure.resident_high_water_bytes is process_memory.resident_high_water_bytes
    assert text_step.resident_high_water_bytes is process_memory.resident_high_water_bytes
