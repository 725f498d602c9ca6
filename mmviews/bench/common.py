"""How every ``mmviews bench`` verb times work and measures memory, written once.

Timing: :func:`synchroniser` (wait for a device's queued kernels, so that a clock reading
charges them to the work timed; nothing to wait for on CPU), :func:`middle` (the median the
step-time verbs report: the upper middle sample, always one that was measured), :func:`timed`
and :func:`seconds_of` (one call), :func:`median_seconds` (one warm-up call, then the middle of
``repeats`` timed calls) and :func:`round_robin` (contenders timed in turn, round after round,
so that a change of machine load between them does not bias their ratios).

Memory: :func:`reset_cuda_peak` and :func:`cuda_peak_mib` (``torch.cuda.max_memory_allocated``),
:func:`cuda_peak_bytes_of` (the same around one call), :func:`tensor_peak_bytes_of`
(live tensor bytes during one call, on CPU too). The process's resident set and its high-water
mark are read by :mod:`mmviews.process_memory`, as the memory estimate reads them.

The report each verb writes (JSON next to a printed table) is in :mod:`mmviews.bench.report`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

Clock = Callable[[], float]
T = TypeVar("T")


def _no_wait() -> None:
    """Nothing to synchronise: CPU work is done when the call returns."""


def synchroniser(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (``torch.cuda.synchronize`` on CUDA,
    nothing elsewhere)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return _no_wait


def middle(samples: Sequence[float]) -> float:
    """The upper middle of ``samples`` once sorted (their median for an odd count)."""
    return sorted(samples)[len(samples) // 2]


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """:func:`middle` seconds per call of ``fn`` over ``repeats`` timed calls after one warm-up
    call, the device synchronised around each."""
    sync = synchroniser(device)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return middle(times)


def timed(fn: Callable[[], T], sync: Callable[[], None] = _no_wait,
          clock: Clock = time.perf_counter) -> tuple[T, float]:
    """What one call of ``fn`` returns, and its seconds (``sync`` waited for before the clock stops)."""
    start = clock()
    value = fn()
    sync()
    return value, clock() - start


def seconds_of(fn: Callable[[], Any], sync: Callable[[], None] = _no_wait, clock: Clock = time.perf_counter) -> float:
    """Seconds of one call of ``fn`` (:func:`timed` without the value)."""
    return timed(fn, sync, clock)[1]


def round_robin(calls: Mapping[str, Callable[[], Any]], repeats: int, warmup: int, sync: Callable[[], None], *,
                clock: Clock = time.perf_counter, before: Callable[[str], Any] | None = None,
                after: Callable[[str], Any] | None = None) -> dict[str, list[float]]:
    """Seconds of each call of ``calls``, timed in turn: ``warmup`` untimed rounds, then
    ``repeats`` timed ones. ``before(key)`` runs ahead of each call, outside the clock (e.g. to
    drop a gradient or reset a peak-memory counter); ``after(key)`` once it is done and timed."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    for round_ in range(warmup + repeats):
        for key, call in calls.items():
            if before is not None:
                before(key)
            sync()
            start = clock()
            call()
            sync()
            if round_ >= warmup:
                times[key].append(clock() - start)
            if after is not None:
                after(key)
    return times


def reset_cuda_peak(device: torch.device) -> None:
    """Start :func:`cuda_peak_mib`'s count afresh on a CUDA ``device`` (nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_mib(device: torch.device, reserved: bool = False) -> float:
    """``torch.cuda.max_memory_allocated`` on ``device`` since its last reset, in MiB; with
    ``reserved``, ``max_memory_reserved`` (what the process holds on the device, the caching
    allocator's free blocks too)."""
    peak = torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)
    return peak / 2**20


def cuda_peak_bytes_of(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak CUDA tensor memory (``torch.cuda.max_memory_allocated``) during one call of ``fn``,
    counting what was allocated before it."""
    sync = synchroniser(device)
    sync()
    reset_cuda_peak(device)
    fn()
    sync()
    return int(torch.cuda.max_memory_allocated(device))


def tensor_peak_bytes_of(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak tensor memory during one call of ``fn``, allocator caching excluded: on CUDA
    :func:`cuda_peak_bytes_of`; on CPU the peak total size of live tensors over the timeline
    torch's memory profiler rebuilds from the allocator's events (a private API: None, with a
    warning, where it is unavailable rather than a made-up number)."""
    if device.type == "cuda":
        return cuda_peak_bytes_of(fn, device)
    # A CUDA build of torch has the profiler (kineto) look for GPUs when it starts; on a
    # machine without a driver that prints "gpuGetDeviceCount failed with code 35" although
    # only CPU activity is recorded. Quiet kineto's own logging (a user's setting wins).
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                         with_stack=True) as prof:
                fn()
            timeline = MemoryProfileTimeline(prof._memory_profile())
            _, sizes = timeline._coalesce_timeline(device)
        return int(max(sum(row) for row in sizes)) if sizes else None
    except Exception as error:  # private API: report the gap rather than a made-up number
        print(f"warning: CPU memory timeline unavailable ({type(error).__name__}: {error})", file=sys.stderr)
        return None


def verb_main(verb: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
              run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """``python -m mmviews.bench.VERB [options]``: parse ``argv`` with the verb's options and run it
    (``argv`` None: the process is the bench's own, see :func:`mmviews.cli.main`)."""
    from mmviews.cli import CommandParser

    parser = CommandParser(prog=f"mmviews bench {verb}", description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.owns_process = argv is None
    from mmviews.cli import USER_ERRORS, error_message

    try:
        with StopOnSignals():
            return int(run(args) or 0)
    except KeyboardInterrupt:  # SIGINT or SIGTERM: its subprocesses are stopped on the way out
        print(f"mmviews bench {verb}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as error:  # a recipe or option at fault: one line, as the mmviews command prints it
        print(f"mmviews bench {verb}: error: {error_message(error)}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------
# Subprocesses that stop with the bench
# ---------------------------------------------------------------------------------------------
#: Seconds a stopped subprocess's group gets to exit after SIGTERM before it is killed.
STOP_GRACE_S = 10.0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class StopOnSignals:
    """Within the block, SIGINT and SIGTERM raise ``KeyboardInterrupt`` in the main thread, so
    that a bench stopped either way leaves through its ``finally`` clauses and stops the
    subprocesses it started (:func:`run_stoppable`). SIGINT is set here, not left to Python's
    default: a process started with SIGINT ignored (a shell's background job, ``nohup``) would
    otherwise go on through ``kill -INT``, which stops ``mmviews train`` (its own handlers). The
    previous handlers come back at the end. Outside the main thread (no signal handlers there) it
    does nothing."""

    def __enter__(self) -> "StopOnSignals":
        import signal
        import threading

        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, _interrupt)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def stop_process_group(proc: Any, grace_s: float = STOP_GRACE_S, *, own_group: bool = True) -> None:
    """Stop ``proc`` and every process of its group: SIGTERM (a bench subprocess stops its own
    subprocesses then), SIGKILL after ``grace_s``. ``own_group`` False: ``proc`` shares this
    process's group (see :func:`run_stoppable`), so only ``proc`` itself is signalled; whoever
    stops this group stops the rest."""
    import signal
    import subprocess

    send = os.killpg if own_group else os.kill
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            send(proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # gone already (the group, or the process alone)
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def run_stoppable(command: Sequence[str], **popen_options: Any) -> Any:
    """``subprocess.run(command)`` (a ``CompletedProcess``; ``stdout``/``stderr`` as in
    ``popen_options``) whose processes (loader workers, its own subprocesses) are stopped
    (:func:`stop_process_group`) when this process is interrupted while it waits: SIGINT, or
    SIGTERM under :class:`StopOnSignals`.

    The bench's own subprocess gets a session of its own, which keeps a terminal's Ctrl-C from
    reaching it twice. A subprocess of that one (a case's estimate process) stays in its parent's
    process group: when the bench stops the case's group, SIGKILL included, it reaches the
    estimate too. In a session of its own the estimate would outlive a case killed at the end of
    the grace period, and hold the bench's stderr open."""
    import subprocess

    # a session leader is the bench's own subprocess: its children stay in its group
    own_group = os.getsid(0) != os.getpid()
    proc = subprocess.Popen(list(command), start_new_session=own_group, **popen_options)
    try:
        out, err = proc.communicate()
    except BaseException:
        stop_process_group(proc, own_group=own_group)
        raise
    return subprocess.CompletedProcess(list(command), proc.returncode, out, err)
