"""Lost and hung processes, with 2 real gloo processes (``output.auto_resume``; the one-line
failure of :func:`mmviews.train.distributed.collective_failure`).

- A worker SIGKILLed under ``accelerate launch --max_restarts 1`` (torch's elastic agent, with
  the rendezvous a restart needs: ``--rdzv_backend c10d``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``):
  the agent restarts both workers, the same command continues from the newest complete
  checkpoint, and the run ends (exit status 0, ``results.json`` status ok) on the weights of an
  uninterrupted run (one process, to float rounding: no BatchNorm, no dropout).
- A peer stopped with SIGSTOP: the live process (the ``mmviews`` command itself) leaves within
  ``distributed.timeout_s`` (3 s here) plus its exit, with one line of mmviews's own (the process,
  the step, the timeout, the newest complete checkpoint, the command that resumes), no traceback
  and exit status 2.

Each launch is as small as the claim allows: the tiny text recipe, 4 optimiser steps, a
checkpoint after every one, the hold of ``tests/slow_train.py`` at the moment of the fault."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_utils import (
    env,
    free_port,
    load_weights,
    started,
    tiny_config,
    train_command,
    train_in_process,
    wait_for_file,
    write_recipe,
)

from mmviews.run import list_checkpoints
from mmviews.train.distributed import collective_failure
from mmviews.train.resume import restart_setup_lines

SLOW_TRAIN = str(Path(__file__).resolve().parent / "slow_train.py")
TIMEOUT_S = 3
# Text views (a tiny BERT) without BatchNorm or dropout: one process computes what two do (the CNN
# backbones have BatchNorm, whose statistics are per process on CPU).
CONFIG = tiny_config(num_samples=32, batch_size=16, epochs=2, image=False, batch_norm=False, dropout=0.0)
CONFIG["cpu"] = True
CONFIG["output"].update(checkpoint_every=1, keep_last=10, auto_resume=True)
CONFIG["distributed"] = {"timeout_s": TIMEOUT_S}
TOTAL = 4


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


@pytest.fixture(scope="module")
def restart_recipe(tmp_path_factory) -> Path:
    """CONFIG with a generous collective timeout: the restart claim needs no timeout (the agent sees
    the killed worker and restarts the group), and on a loaded machine a start of one worker more
    than 3 s after the other would fail the group's first rendezvous for the wrong reason."""
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", dict(CONFIG, distributed={"timeout_s": 120}))


def test_killed_worker_is_restarted_and_the_run_continues(restart_recipe, tmp_path):
    recipe = restart_recipe
    run = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--max_restarts", "1", "--rdzv_backend", "c10d", "--main_process_port", str(free_port()),
               "--monitor_interval", "0.1", SLOW_TRAIN, "--marker", str(tmp_path / "step"), "--hold-after-step", "3",
               "--hold-rank", "1", "--first-attempt-only", "--hold-marker", str(tmp_path / "held"),
               "--", str(recipe), "--output", str(run)]
    with started(command, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")) as proc:
        wait_for_file(proc, tmp_path / "held", "rank 1 holding after step 3")
        os.kill(int((tmp_path / "step.rank1").read_text().split()[1]), signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    assert f"mmviews train: warning: resumed from {run / 'checkpoints' / 'checkpoint-00000002'} at step 2 of {TOTAL}" in err, err
    assert json.loads((run / "results.json").read_text())["status"] == "ok"
    # the surviving worker's line says that the agent restarts the run, not how to resume it
    failed = [line for line in err.splitlines() if "mmviews train: error: process" in line]
    assert failed and all("the elastic agent restarts the processes (restart 1 of 1)" in line
                          and "resume with" not in line for line in failed), err[-4000:]
    assert [c.name for c in list_checkpoints(run)][-1] == f"checkpoint-{TOTAL:08d}"
    reference = tmp_path / "reference"
    r = train_in_process(str(recipe), "--output", str(reference))  # one process, never interrupted
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = load_weights(run / "encoder"), load_weights(reference / "encoder")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_stopped_peer_fails_the_run_in_bounded_time_with_one_line(recipe, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    held = [sys.executable, SLOW_TRAIN, "--hold-after-step", "2", "--hold-marker", str(tmp_path / "held"), "--",
            str(recipe), "--output", str(run)]
    # the live process is the mmviews command itself: its own exit after the failure is part of the claim
    commands = [train_command(str(recipe), "--output", str(run)), held]
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(started(commands[rank], env=env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port)))) for rank in range(2)]
        wait_for_file(ranks[1], tmp_path / "held", "rank 1 holding after step 2")
        os.kill(ranks[1].pid, signal.SIGSTOP)  # hung: alive, holding its sockets, answering nothing
        stopped = time.monotonic()
        _, err = ranks[0].communicate(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - stopped
        os.kill(ranks[1].pid, signal.SIGCONT)  # so that the group's SIGKILL ends it at once
    assert ranks[0].returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("mmviews ")]
    assert len(lines) == 1, err[-3000:]
    newest = run / "checkpoints" / "checkpoint-00000001"
    assert lines[0].startswith("mmviews train: error: process 0 of 2 stopped after step 2: it waited more than "
                               f"distributed.timeout_s = {TIMEOUT_S} s"), lines[0]
    assert f"newest complete checkpoint: {newest}" in lines[0] and "resume with: accelerate launch" in lines[0]
    # the timeout, then the teardown (a loaded machine: 2 cores shared by the suite's processes)
    assert TIMEOUT_S <= waited < TIMEOUT_S + 30, waited


def test_collective_failures_are_recognised():
    """The engines' words for a peer that hung or is gone become the one line; anything else
    passes unchanged (gloo's messages as torch 2.11 raises them)."""
    timed_out = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                             "3000ms for recv operation to complete")
    failure = collective_failure(timed_out, 3.0, 2, "/run/checkpoints/checkpoint-00000001")
    assert str(failure) == ("process 0 of 1 stopped after step 2: it waited more than distributed.timeout_s = 3 s "
                            "for the other processes in a collective (one of them hung, was stopped, or died); "
                            "newest complete checkpoint: /run/checkpoints/checkpoint-00000001")
    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
                        "[127.0.0.1]:63175")
    assert "another process left (it died or was killed); no checkpoint yet" in str(
        collective_failure(gone, 3.0, None, None))
    assert collective_failure(RuntimeError("CUDA out of memory"), 3.0, 2, None) is None
    assert collective_failure(ValueError("Connection closed by peer"), 3.0, 2, None) is None


def test_restart_setup_is_said_in_one_line(monkeypatch, tmp_path):
    """Under torch's elastic agent with restarts, a rendezvous that cannot restart the workers
    (the launcher's shared store) and a recipe without ``auto_resume`` are each one line."""
    from mmviews.config import load_config

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    config = load_config(write_recipe(tmp_path / "r.yaml", dict(CONFIG, output={**CONFIG["output"], "auto_resume": False})))
    lines = restart_setup_lines(config)
    assert len(lines) == 2 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0] and "c10d" in lines[0]
    assert lines[0].startswith("--max_restarts 1: ") and lines[0].endswith(" (docs/reliability.md)")
    assert lines[1] == ("--max_restarts 1: a restart would refuse this run's folder; add --set output.auto_resume=true "
                        "so that it continues from the newest checkpoint")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # a launcher that does not say: only the recipe is judged
    assert restart_setup_lines(config) == lines[1:]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    config.output.auto_resume = True
    assert restart_setup_lines(config) == []
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert restart_setup_lines(config) == []



@pytest.mark.parametrize("value,count", [(None, 0), ("", 0), ("0", 0), ("3", 3), ("12", 12), ("-1", 0), ("two", 0)])
def test_max_restarts_reads_the_agents_count_and_nothing_else(monkeypatch, value, count):
    """The restarts the elastic agent allows: its ``TORCHELASTIC_MAX_RESTARTS`` when that is a
    count, else none (no agent, or a value that is not one); both lines above read it here."""
    from mmviews.train.resume import max_restarts, restarts_left

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    if value is None:
        monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", value)
    assert max_restarts() == count and restarts_left() == count
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarts_left() == max(count - 1, 0)


def test_after_a_collective_failure_the_line_says_what_happens_next(monkeypatch, tmp_path):
    """A restart the elastic agent will make (restarts left, ``auto_resume``) continues the run by
    itself: the failed process's line says so rather than giving a command to resume; without a
    restart left, or without ``auto_resume`` (the restart would refuse the folder), it gives the
    command."""
    from mmviews.cli.train import after_collective_failure
    from mmviews.config import load_config
    from mmviews.train.resume import restarts_left

    config, run = load_config(write_recipe(tmp_path / "r.yaml", CONFIG)), tmp_path / "run"
    for name in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert restarts_left() == 0 and after_collective_failure(config, run) == f"resume with: mmviews train --resume {run}"
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarts_left() == 2
    line = after_collective_failure(config, run)
    assert line == ("the elastic agent restarts the processes (restart 2 of 3), which continue from the newest "
                    "complete checkpoint (output.auto_resume)")
    config.output.auto_resume = False  # the restart would refuse the folder
    assert after_collective_failure(config, run, allow_remote_models=True) == (
        f"resume with: mmviews train --resume {run} --allow-remote-models")
    config.output.auto_resume = True
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # the last restart was made
    assert restarts_left() == 0 and after_collective_failure(config, run).startswith("resume with: ")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "5")
    assert restarts_left() == 0
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "many")
    assert restarts_left() == 0
