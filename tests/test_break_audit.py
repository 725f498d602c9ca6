"""Guards for what a break audit of the fault code found unguarded: each test fails when the
line it names is broken.

- a signal during the final evaluation stops the run (``StopOnSignal.end_of_loop`` turns the
  deferral off: left on, the signal would be recorded and ignored, and the run would finish);
- ``mmviews.cli.main([...])`` called from a program returns 2 on a collective failure instead of
  ending that program (only the command's own process leaves without the teardown);
- :func:`mmviews.cli.leave_without_teardown` flushes stdout first (``os._exit`` drops a buffer);
- the checkpoint size estimate counts an EMA teacher (its copy of the encoder's weights);
- a timed-out ``mmviews bench gpu`` check leaves no process behind, not even one in a session of
  its own (a test's subprocess);
- ``optimisation.backbone_lr: 0`` freezes the backbone's parameters (0 is not "unset");
- the identifiability benchmark's mixing matrices have the documented unit-norm columns.
(``remove_leftovers`` and a user's look-alike folder names: ``test_train_run_folder_writes.py``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_utils import REPO, env, tiny_config, train_in_process, write_recipe

import mmviews.cli as cli
from mmviews.run import list_checkpoints

CONFIG = tiny_config(num_samples=32, batch_size=16, epochs=2, text=False)  # 4 optimiser steps
CONFIG["output"].update(checkpoint_every=1, keep_last=10)


def test_a_signal_during_the_final_evaluation_stops_the_run(tmp_path, monkeypatch):
    import mmviews.train.trainer as trainer

    recipe = write_recipe(tmp_path / "tiny.yaml", {**CONFIG, "evaluation": {"tasks": ["linear:class"],
                                                                          "random_baseline": False, "plots": False}})
    evaluate = trainer.run_evaluation

    def signalled_evaluation(model, parts, out_dir, *args, **kwargs):
        if Path(out_dir).name == "eval":  # the final evaluation, after the loop
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(model, parts, out_dir, *args, **kwargs)

    monkeypatch.setattr(trainer, "run_evaluation", signalled_evaluation)
    run = tmp_path / "run"
    r = train_in_process(str(recipe), "--output", str(run))
    assert r.returncode == 143, (r.returncode, r.stderr[-3000:])
    assert (f"mmviews train: interrupted by SIGTERM; resume from its last complete checkpoint (step 4) with: mmviews "
            f"train --resume {run}") in r.stderr, r.stderr[-3000:]
    assert not (run / "results.json").exists() and len(list_checkpoints(run)) == 4


def test_stop_on_signal_raises_at_once_after_the_loop():
    from mmviews.train.interrupt import StopOnSignal, TrainingInterrupted

    with StopOnSignal() as stop:
        stop.defer(1, is_main=False)
        assert not stop.end_of_loop()
        with pytest.raises(TrainingInterrupted, match="outside the training loop"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at once, not at the end of a sleep


def _peer_failing_command(monkeypatch):
    from mmviews.train.distributed import CollectiveFailure

    def run(args):
        raise CollectiveFailure("process 0 of 2 stopped after step 2: it waited more than distributed.timeout_s")

    command = types.ModuleType("peer_failing_command")
    command.add_arguments, command.run = (lambda parser: None), run
    monkeypatch.setitem(sys.modules, "peer_failing_command", command)
    monkeypatch.setitem(cli.COMMANDS, "peer", ("peer_failing_command", "a command whose collective failed"))


def test_a_collective_failure_returns_2_to_a_program_that_called_main(monkeypatch, capsys):
    _peer_failing_command(monkeypatch)
    left: list[int] = []
    monkeypatch.setattr(cli, "leave_without_teardown", lambda status: left.append(status))
    assert cli.main(["peer"]) == 2 and left == []  # the program goes on
    assert capsys.readouterr().err.startswith("mmviews peer: error: process 0 of 2 stopped after step 2")
    monkeypatch.setattr(sys, "argv", ["mmviews", "peer"])
    cli.main()  # the command's own process
    assert left == [2]


def test_leaving_without_teardown_flushes_stdout_first(tmp_path):
    script = ("import sys, mmviews.cli as cli\nsys.stdout.write('said before leaving')\n"
              "sys.stderr.write('and on stderr')\ncli.leave_without_teardown(3)\n")
    buffered = {k: v for k, v in env().items() if k != "PYTHONUNBUFFERED"}  # a pipe: block-buffered, as for a user
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=buffered, cwd=REPO,
                       timeout=120)
    assert r.returncode == 3 and r.stdout == "said before leaving" and r.stderr == "and on stderr", r


def test_checkpoint_estimate_counts_the_ema_teacher(tmp_path):
    """The estimate of one checkpoint, with ``objective.ema_teacher``, is within 15 % of the real
    checkpoints of such a run (which hold ``teacher.safetensors``, a copy of the encoder's weights)."""
    import mmviews.fileio as fileio
    from mmviews.cli.train import disk_space_line
    from mmviews.config import load_config
    from mmviews.train import build_run

    raw = {**CONFIG, "objective": {"name": "er", "ema_teacher": True}}  # ER takes a teacher's embeddings
    recipe = write_recipe(tmp_path / "teacher.yaml", raw)
    run = tmp_path / "run"
    r = train_in_process(str(recipe), "--output", str(run), "--set", "optimisation.max_steps=1",
                         "--set", "evaluation.at_end=false", "--set", "evaluation.random_baseline=false")
    assert r.returncode == 0, r.stderr[-3000:]
    checkpoint = list_checkpoints(run)[-1]
    assert (checkpoint / "teacher.safetensors").is_file()
    real = fileio.folder_bytes(checkpoint)
    parts = build_run(load_config(recipe))
    with pytest.MonkeyPatch.context() as patch:  # how --check estimates one checkpoint (said when space is short)
        patch.setattr(fileio, "free_bytes", lambda folder: 0)
        line = disk_space_line(parts, tmp_path / "nowhere")
    import re

    estimate = int(re.search(r"about (\d+) bytes each", line).group(1))
    teacher = (checkpoint / "teacher.safetensors").stat().st_size
    assert teacher > 0.15 * real  # large enough that leaving it out shows
    assert abs(estimate - real) <= 0.15 * real, (estimate, real)


def test_a_timed_out_gpu_check_leaves_no_process_behind(tmp_path, monkeypatch):
    """The check's own child, and that child's child in a session of its own (a test's subprocess
    starting another), are gone after the budget; a process of the caller's is not touched; the
    check's output, both streams, is in its log."""
    import psutil

    from mmviews.bench.gpu import _run_within

    pid_file = tmp_path / "descendants"
    inner = ("import subprocess, sys, time\n"
             "p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
             f"open({str(pid_file)!r}, 'a').write(str(p.pid) + '\\n')\n"
             "time.sleep(600)\n")
    script = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', {inner!r}], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'a').write(str(p.pid) + '\\n')\n"
              "print('said on stdout', flush=True)\nprint('said on stderr', file=sys.stderr, flush=True)\n"
              "time.sleep(600)\n")
    bystander = subprocess.Popen(["sleep", "600"])  # the caller's own
    kill = psutil.Process.kill
    raced: list[int] = []

    def killed_meanwhile(self: psutil.Process) -> None:  # the first one ends by itself just before the kill
        kill(self)
        if not raced:
            raced.append(self.pid)
            raise psutil.NoSuchProcess(self.pid)

    monkeypatch.setattr(psutil.Process, "kill", killed_meanwhile)
    try:
        deadline = time.monotonic() + 120

        def started_both() -> bool:
            return pid_file.is_file() and len(pid_file.read_text().split()) == 2

        status, seconds = _run_within([sys.executable, "-c", script], 10, tmp_path / "log")
        assert status is None and seconds < 60
        assert started_both() and time.monotonic() < deadline
        assert (tmp_path / "log").read_text().split("\n")[:2] == ["said on stdout", "said on stderr"]
        for pid in map(int, pid_file.read_text().split()):
            end = time.monotonic() + 10
            while time.monotonic() < end:
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"process {pid} below the check outlived the check's timeout")
        assert bystander.poll() is None  # not one of the check's
    finally:
        bystander.kill()
        bystander.wait()


def test_backbone_lr_zero_freezes_the_backbone(tmp_path):
    from safetensors.torch import load_file

    from mmviews.config import load_config
    from mmviews.train import build_run

    recipe = write_recipe(tmp_path / "frozen.yaml", {**CONFIG, "optimisation": {**CONFIG["optimisation"],
                                                                                 "backbone_lr": 0.0}})
    run = tmp_path / "run"
    r = train_in_process(str(recipe), "--output", str(run), "--set", "evaluation.at_end=false",
                         "--set", "evaluation.random_baseline=false")
    assert r.returncode == 0, r.stderr[-3000:]
    names = {n for n, _ in build_run(load_config(recipe)).encoder.named_parameters()}
    first, last = (load_file(str(c / "model.safetensors")) for c in (list_checkpoints(run)[0], list_checkpoints(run)[-1]))
    backbone = sorted(n for n in names if ".backbone." in n)
    head = sorted(n for n in names if ".backbone." not in n)
    assert backbone and head
    assert all(torch.equal(first[n], last[n]) for n in backbone), "a backbone parameter moved at backbone_lr 0"
    assert any(not torch.equal(first[n], last[n]) for n in head)  # the heads train
    log = (run / "metrics.csv").read_text().splitlines()
    column = log[0].split(",").index("lr_backbone")
    assert {float(row.split(",")[column]) for row in log[1:]} == {0.0}


def test_identifiability_mixing_matrices_have_unit_norm_columns():
    from mmviews.data.identifiability import generative_process

    process = generative_process(0, num_modalities=3)
    for weights in process.mixing:
        for w in weights:
            np.testing.assert_allclose(np.linalg.norm(w, axis=0), 1.0, rtol=0, atol=1e-12)
            assert np.abs(w).max() <= 1.0
            assert not np.allclose(np.linalg.norm(w, axis=1), 1.0)  # the rows are not what is normalised


@pytest.mark.parametrize("optimizer, momentum, teacher, processes, optimizer_state", [
    ("adamw", 0.9, False, 1, 2 * 40), ("adamw", 0.9, True, 3, 2 * 40), ("sgd", 0.9, False, 2, 40),
    ("sgd", 0.0, True, 1, 0)])
def test_checkpoint_estimate_written_out(optimizer, momentum, teacher, processes, optimizer_state):
    """The estimate of one checkpoint, by its documented parts, for a module whose sizes are known:
    the encoder's 7 tensors of 72 bytes (twice with a teacher), the optimiser's state of its 40
    trainable bytes (AdamW two moments, SGD with momentum one), the objective's buffer, 300 bytes
    of records per tensor written, 16 KiB of RNG states per process and 4 KiB of small files."""
    from torch import nn

    from mmviews.train.checkpoint import estimate_checkpoint_bytes

    encoder = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))  # 12 parameters, 4 float and 1 int64 buffers
    encoder[1].bias.requires_grad_(False)  # trainable: 10 floats in 3 tensors
    objective = nn.Module()
    objective.register_buffer("bank", torch.zeros(5))
    weights = 12 * 4 + 4 * 4 + 8
    tensors = 7 * (2 if teacher else 1) + 3 * 3 + 1
    want = weights * (2 if teacher else 1) + optimizer_state + 20 + 300 * tensors + 16 * 1024 * processes + 4 * 1024
    assert estimate_checkpoint_bytes(encoder, objective, optimizer, momentum, teacher, processes) == want
    if processes == 1:  # one process unless told
        assert estimate_checkpoint_bytes(encoder, objective, optimizer, momentum, teacher) == want
