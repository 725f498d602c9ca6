"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what cluster schedulers send before they
preempt a job) without losing it.

:class:`StopOnSignal` is a context manager around :func:`mmviews.train.train`. During the
training loop (from :meth:`StopOnSignal.defer` to :meth:`StopOnSignal.end_of_loop`) the first
SIGINT or SIGTERM only records the request (and says so on the main process): the loop asks
:meth:`StopOnSignal.requested` after every optimiser step, leaves at the first step where it
answers True, writes a checkpoint (atomically, see :mod:`mmviews.train.checkpoint`) and raises
:class:`TrainingInterrupted`; ``mmviews train`` turns that into one line with the command that
resumes the run and the exit status 128 + signal (130 for SIGINT, 143 for SIGTERM). A second
signal aborts at once: the handler raises :class:`TrainingInterrupted` with ``aborted=True``
wherever the program is. A checkpoint being written then stays in its temporary folder, which
loading ignores and the next start removes; complete checkpoints are never modified in place
(one being replaced or deleted is first renamed to a temporary name), so no ``checkpoint-N``
is ever half-written. Outside the loop (building the run, evaluating) nothing can be finished
first: a signal raises :class:`TrainingInterrupted` at once, and the run resumes from its last
complete checkpoint (or, without one, starts again).

Several processes must stop at the same optimiser step (a process that leaves the loop early
would wait forever in the next collective of the others), but the signal may reach them at
different moments (the launcher forwards it one process after the other; a scheduler may
signal one process only). They agree through an all-reduce (MAX) of the host-side flag on a
separate gloo group, so it never waits for the accelerator: each step reads the result of the
all-reduce started at the step before (long finished by then: the step's gradient all-reduce
already ties the processes together) and starts the next one. Every process therefore sees
the same answer at the same step, one step after the signal; no per-step device
synchronisation and no blocking rendezvous is added. With one process it is a Python flag,
read at the step where the signal came.

Handlers can only be installed from the main thread; elsewhere (training in a worker thread)
the previous behaviour stays.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal. ``signum``: the signal; ``step``: the last optimiser step
    done and ``checkpoint`` the checkpoint written at that step, when the loop stopped cleanly;
    both None when the signal came outside the loop (building the run, evaluating) or when
    ``aborted`` (a second signal stopped the program at once): the latest complete checkpoint,
    if any, is the one to resume from. A ``KeyboardInterrupt``, so that code not expecting it
    stops as on Ctrl-C."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None,
                 aborted: bool = False) -> None:
        self.signum, self.step, self.checkpoint, self.aborted = signum, step, checkpoint, aborted
        name = signal.Signals(signum).name
        if aborted:
            what = f"aborted at once by a second {name}"
        elif step is None:
            what = f"interrupted by {name} outside the training loop"
        else:
            what = f"stopped by {name} after optimiser step {step}"
        super().__init__(what + (f"; checkpoint written: {checkpoint}" if checkpoint else ""))

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + signal number."""
        return 128 + self.signum


class StopOnSignal:
    """SIGINT/SIGTERM handling of :func:`mmviews.train.train` (see the module docstring).

    Entered around the whole run: a signal raises :class:`TrainingInterrupted` at once. Between
    :meth:`defer` (just before the loop; every process calls it at the same point) and
    :meth:`end_of_loop` the first signal is only recorded; the loop calls :meth:`requested`
    after every optimiser step on every process. Leaving the context restores the previous
    handlers."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal this process received
        self.agreed: int | None = None  # the signal every process stops on, once they agree
        self.deferring, self.is_main = False, True
        self._previous: dict[int, Any] = {}
        self._group: Any = None  # gloo group of the agreement (several processes)
        self._pending: Any = None  # (work, buffer) of the all-reduce in flight

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._pending is not None:  # left mid-loop (an error, an abort): let the agreement in flight end
            # It ends within the group's timeout (a peer gone or hung makes it fail): a process group
            # torn down while its worker thread still waits can abort the process instead of exiting.
            with contextlib.suppress(Exception):
                self._pending[0].wait()
        self._previous, self._pending = {}, None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.deferring or self.signum is not None:  # outside the loop, or the second signal
            raise TrainingInterrupted(signum, aborted=self.signum is not None)
        self.signum = signum
        if self.is_main:
            name = signal.Signals(signum).name
            # os.write, not print: the handler may run while the program is inside a print to
            # the same stream (the progress bar), where a buffered write would raise.
            os.write(2, f"\nmmviews train: {name} received: finishing the current step and saving a checkpoint "
                        f"(send it again to abort at once)\n".encode())

    def defer(self, num_processes: int, is_main: bool, timeout: datetime.timedelta | None = None) -> None:
        """From now until :meth:`end_of_loop`, the first signal stops the run after the step.
        ``timeout``: the agreement group's (the run's ``distributed.timeout_s``; torch's default
        for a new group is 30 minutes, whatever the default group's)."""
        self.is_main = is_main
        if num_processes > 1 and self._group is None:
            import torch.distributed as dist

            # host tensors: never waits for the device
            self._group = dist.new_group(backend="gloo", **({"timeout": timeout} if timeout is not None else {}))
        self.deferring = True

    def requested(self) -> bool:
        """After every optimiser step, on every process: whether to stop now (the same answer
        on every process at the same step)."""
        if self._group is None:
            self.agreed = self.signum
            return self.signum is not None
        import torch.distributed as dist

        if self._pending is not None:
            work, buffer = self._pending
            work.wait()  # started a step ago: done
            self._pending = None
            if int(buffer.item()):
                self.agreed = int(buffer.item())
                return True
        buffer = torch.tensor([self.signum or 0], dtype=torch.int64)
        self._pending = (dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self._group, async_op=True), buffer)
        return False

    def end_of_loop(self) -> bool:
        """After the loop, on every process: whether some process received a signal (then all
        stop), with one blocking all-reduce. Signals received after this raise at once."""
        self.deferring = False
        if self.agreed is None and self._group is not None:
            import torch.distributed as dist

            if self._pending is not None:
                self._pending[0].wait()
                self._pending = None
            buffer = torch.tensor([self.signum or 0], dtype=torch.int64)
            dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self._group)
            self.agreed = int(buffer.item()) or None
        elif self.agreed is None:
            self.agreed = self.signum
        return self.agreed is not None
