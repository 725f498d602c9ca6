"""How the ``mmviews`` command's process ends after a stop on a signal (exit 130 or 143, a second
signal), when a peer hangs during the stop (:func:`mmviews.cli.main`,
:func:`mmviews.cli.leave_without_teardown`).

Two real gloo processes of ``mmviews train``: rank 1 (``tests/slow_train.py``) holds after step 2
until the test sends it SIGTERM; both agree to stop after step 3 and write its checkpoint; then
rank 1 stops itself (SIGSTOP), a peer hung while the others leave. Rank 0, the ``mmviews``
command as its own process (``main()`` with no argument list), says it stopped with the resume
command and exits 143 at once: no barrier with the hung peer (which would wait
``distributed.timeout_s``, then fail with a traceback), its exit handlers run, and no interpreter
teardown, where an operation to the peer still in flight in gloo's threads would abort it (as
after a collective failure, ``test_cli_collective_failure.py``). Called from a program
(``main([...])``) the same stop returns the status instead of ending that program
(``test_cli_errors.py``-like check below, without processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from test_train_utils import env, free_port, started, tiny_config, wait_for_file, write_recipe

from mmviews.run import list_checkpoints, read_train_state

SLOW_TRAIN = str(Path(__file__).resolve().parent / "slow_train.py")
TIMEOUT_S = 20  # the group's timeout: far longer than rank 0 may take to leave

# rank 0: the mmviews command as its own process, saying when its exit handlers and its teardown run
COMMAND = r"""
import atexit, sys
import mmviews.cli as cli

atexit.register(print, "exit handlers ran", flush=True)


class Teardown:  # says when the interpreter's teardown reaches this module's objects
    def __del__(self, say=print):
        say("teardown ran", flush=True)


teardown = Teardown()
sys.argv = ["mmviews", "train", *sys.argv[1:]]
sys.exit(cli.main())
"""


def test_a_peer_hung_during_a_signal_stop_does_not_hold_or_abort_the_command(tmp_path):
    raw = tiny_config(batch_norm=False, dropout=0.0, num_samples=64, batch_size=16, epochs=2, text=False)
    raw["views"] = [view for view in raw["views"] if "augment" not in view]  # image, audio
    raw["cpu"] = True
    raw["output"].update(checkpoint_every=0, progress_bar=False)
    raw["distributed"] = {"timeout_s": TIMEOUT_S}
    recipe = write_recipe(tmp_path / "dist.yaml", raw)
    run, held, marker = tmp_path / "run", tmp_path / "held", tmp_path / "marker"
    port = free_port()
    rank1 = [sys.executable, SLOW_TRAIN, "--marker", str(marker), "--hold-after-step", "2", "--until-signal",
             "--hold-marker", str(held), "--stop-self-after-checkpoint", "3", "--", str(recipe), "--output", str(run)]
    commands = [[sys.executable, "-c", COMMAND, str(recipe), "--output", str(run)], rank1]
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(started(commands[rank], env=env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port)))) for rank in range(2)]
        wait_for_file(ranks[1], held, "rank 1 holding after step 2", timeout=240)
        os.kill(ranks[1].pid, signal.SIGTERM)
        signalled = time.monotonic()
        out, err = ranks[0].communicate(timeout=TIMEOUT_S + 120)
        waited = time.monotonic() - signalled
        assert ranks[1].poll() is None  # stopped, not gone
        os.kill(ranks[1].pid, signal.SIGCONT)  # so that the group's SIGKILL ends it at once
    assert read_train_state(list_checkpoints(run)[-1])["step"] == 3
    assert ranks[0].returncode == 143, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("mmviews train:")]
    assert lines == [f"mmviews train: stopped by SIGTERM after step 3, checkpoint saved; resume with: accelerate launch "
                     f"--multi_gpu --num_processes 2 -m mmviews.cli train --resume {run}"], err[-3000:]
    assert "exit handlers ran" in out and "teardown ran" not in out, out[-2000:]
    assert waited < TIMEOUT_S, waited  # no wait for the hung peer


def test_a_signal_stop_called_from_a_program_returns_its_status(monkeypatch, capsys):
    """``mmviews.cli.main([...])`` from a user's program: the stop's status comes back as the
    return value, the program goes on (no ``os._exit``)."""
    import types

    import mmviews.cli as cli
    from mmviews.train.interrupt import TrainingInterrupted

    def run(args):
        stopped = TrainingInterrupted(signal.SIGTERM, step=3, checkpoint=Path("c"))
        setattr(stopped, cli.SAID, True)
        raise stopped

    command = types.ModuleType("stopping_command")
    command.add_arguments, command.run = (lambda parser: None), run
    monkeypatch.setitem(sys.modules, "stopping_command", command)
    monkeypatch.setitem(cli.COMMANDS, "stopping", ("stopping_command", "a command stopped by SIGTERM"))
    left = []
    monkeypatch.setattr(cli, "leave_without_teardown", lambda status: left.append(status))
    assert cli.main(["stopping"]) == 143 and left == []
    assert capsys.readouterr().err == ""  # the command said it already
    monkeypatch.setattr(sys, "argv", ["mmviews", "stopping"])
    cli.main()  # the command's own process: it leaves without the teardown
    assert left == [143]


def test_help_and_version_are_answered_in_this_process(capsys):
    import mmviews
    import mmviews.cli as cli

    for flag in ("-h", "--help"):
        assert cli.main([flag]) == 0
        assert "Run 'mmviews COMMAND --help'" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"{mmviews.__version__}\n"
