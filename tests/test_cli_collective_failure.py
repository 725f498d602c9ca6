"""How the ``mmviews`` command's process ends after a collective failed because a peer stopped
answering (:func:`mmviews.cli.main`, :func:`mmviews.cli.leave_without_teardown`).

Two real gloo processes: the second stops itself (SIGSTOP) after joining the group. The first
runs ``mmviews`` as the command's own process (``main()`` with no argument list) with a command
that fails as ``mmviews train`` does: a collective to the stopped peer times out and becomes a
:class:`~mmviews.train.distributed.CollectiveFailure` while more operations to that peer are
still in flight on another group (as a sharded run's prefetches are), their tensors left to
the group's worker threads, and the group is closed as ``mmviews train`` closes it. The process
ends with exactly its one line and exit status 2, after its exit handlers ran but without the
interpreter's teardown: an operation that ended during the teardown would release its tensors
there and abort the process (SIGABRT, "terminate called without an active exception"; a race
that needs the timing of a loaded machine, hence the check that no teardown runs).
"""

from __future__ import annotations

import subprocess
import sys

from test_train_utils import free_port, started

# rank 1: join, then stop (the test kills it); rank 0: the command, failing against it
SCRIPT = r"""
import atexit, datetime, os, signal, sys, time, types
import torch
import torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
first = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1))
second = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)

import mmviews.cli as cli
from mmviews.train.distributed import collective_failure


def run(args):
    try:
        dist.all_reduce(torch.ones(8), group=first)
    except RuntimeError as error:
        # in flight to the stopped peer, on a group whose timeout has not passed yet
        _in_flight = [dist.all_reduce(torch.ones(1000), group=second, async_op=True) for _ in range(2)]
        raise collective_failure(error, 1.0, 2, None) from error
    finally:
        dist.destroy_process_group()


command = types.ModuleType("peer_command")
command.add_arguments, command.run = (lambda parser: None), run
sys.modules["peer_command"] = command
cli.COMMANDS["peer"] = ("peer_command", "a command whose collective fails against a stopped peer")
atexit.register(print, "exit handlers ran", flush=True)


class Teardown:  # says when the interpreter's teardown reaches this module's objects
    def __del__(self, say=print):
        say("teardown ran", flush=True)


teardown = Teardown()
sys.argv = ["mmviews", "peer"]
sys.exit(cli.main())
"""


def test_a_stopped_peer_ends_the_command_with_its_line_and_status_not_an_abort():
    port = str(free_port())
    with started([sys.executable, "-c", SCRIPT, "1", port]) as peer, \
            started([sys.executable, "-c", SCRIPT, "0", port]) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert peer.poll() is None  # stopped, not gone: the failure is the timeout's
    assert out == "exit handlers ran\n"  # and no teardown, where an operation ending would abort the process
    assert proc.returncode == 2, err[-3000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["mmviews peer: error: process 0 of 2 stopped after step 2: it waited more than "
                     "distributed.timeout_s = 1 s for the other processes in a collective (one of them hung, was "
                     "stopped, or died); no checkpoint yet"], err[-3000:]
