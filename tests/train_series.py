"""``python tests/train_series.py RUN_ARGS [::: RUN_ARGS ...]``: several ``mmviews train`` runs,
one after the other, in this process (also under ``accelerate launch``: one launch for several
runs, so that the interpreter, the imports and the process group's start are paid once).

Each ``RUN_ARGS`` is the argument list of ``tests/slow_train.py`` (``[OPTIONS] -- TRAIN_ARGS``,
e.g. ``--break scale_loss -- RECIPE --output RUN``): its options (a break of
``tests/mutations.py``, ``--record``, ``--marker``...) apply to that run only and are undone
before the next one, which therefore runs intact code. Accelerate's state is reset between runs
(each run's ``Accelerator`` is a new one) but the process group is kept: ``mmviews train``'s
closing barrier still runs at the end of each run, the group is closed after the last one.
(Closing it and opening a new one in the same processes hung at the second run's start, once
in three tries; the cause was not pinned down.) So every run has the FIRST run's
``distributed.timeout_s``. Rank 0 writes ``train_series: run I of N`` to stderr before run I (a
test can split the launch's output by run), and every rank ``train_series: rank R: run I of N:
exit status S`` after it. A run ending with a nonzero status ends the series with that status.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import slow_train

import mmviews.cli.train as cli_train

SEPARATOR = ":::"
START_LINE = "train_series: run {number} of {runs}"  # rank 0, before the run
STATUS_LINE = "train_series: rank {rank}: run {number} of {runs}: exit status {status}"  # every rank, after it
_INHERITED = object()  # the replaced attribute was not the owner's own (e.g. a base class's method)


def split_runs(argv: list[str]) -> list[list[str]]:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def _reset_accelerate_state() -> None:
    """Forget the Accelerator's state (its singletons), so that the next run's ``Accelerator`` is
    set up from its recipe as in a new process; Accelerate's process state (the group) is kept."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _keeping_the_group(close: Callable[..., None]) -> Callable[..., None]:
    """``mmviews train``'s ``_close_process_group`` for a run that another follows: after a normal
    end only its barrier (the processes leave the run together); after an error it closes the
    group (the series ends there)."""
    import torch.distributed as dist

    def barrier_only(barrier: bool = True) -> None:
        if barrier and dist.is_available() and dist.is_initialized():
            dist.barrier()
        elif not barrier:
            close(barrier=False)

    return barrier_only


def run_one(argv: list[str]) -> int:
    """One run: ``slow_train.py ARGV``'s options installed, ``mmviews train`` run, its exit
    status returned; every attribute replaced for it is put back after it."""
    opts, train_args = slow_train.parse(argv)
    replaced: list[tuple[Any, str, Any]] = []  # (owner, name, its own value before, or _INHERITED)

    def set_undoably(owner: Any, name: str, value: Any) -> None:
        replaced.append((owner, name, vars(owner).get(name, _INHERITED)))
        setattr(owner, name, value)

    try:
        set_undoably(cli_train, "_close_process_group", _keeping_the_group(cli_train._close_process_group))
        slow_train.install(opts, set_undoably)
        return slow_train.main_command(["train", *train_args])
    finally:
        for owner, name, original in reversed(replaced):
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)  # the raw attribute (a class's function, staticmethod...)
        _reset_accelerate_state()


def _say(line: str) -> None:
    """``line`` on a line of its own in stderr, which the ranks share: one write (a pipe does not
    interleave a short write with another process's), after a newline (another process's
    line, e.g. a progress bar, may be unfinished)."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"\n{line}\n".encode())


def main(argv: list[str]) -> int:
    runs, rank = split_runs(argv), int(os.environ.get("RANK", "0"))
    for number, run_argv in enumerate(runs, 1):
        if rank == 0:
            _say(START_LINE.format(number=number, runs=len(runs)))
        status = run_one(run_argv)
        _say(STATUS_LINE.format(rank=rank, number=number, runs=len(runs), status=status))
        if status != 0:
            return status
    cli_train._close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
