"""Ctrl-C and SIGTERM as a user meets them: a real signal to a real `mmviews train` process
(tests/slow_train.py: the command with a callback that marks each optimiser step in a file, so
the test signals once training runs, without guessing with sleeps), the one-line message, the
exit status, and the printed command that resumes the run to the uninterrupted run's weights.
Also: a run folder with no checkpoint starts again as the message says, and `--resume` of a
finished run does nothing unless `--reevaluate`."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_utils import REPO, env, load_weights, run_train, tiny_config, write_recipe

from mmviews.cli import main
from mmviews.run import (
    RUN_MANIFEST,
    RunFolderError,
    check_run_dir,
    claim_run_dir,
    list_checkpoints,
    read_manifest,
    read_train_state,
)

SLOW_TRAIN = Path(__file__).resolve().parent / "slow_train.py"

# 4 batches per epoch x 3 epochs = 12 optimiser steps; no periodic checkpoint (the default
# checkpoint_every: 0), so a checkpoint mid-epoch can only come from the interrupt. Dropout and
# BatchNorm are on: equal weights also need the RNG states and BN buffers restored.
CONFIG = tiny_config(num_samples=64, batch_size=16, epochs=3, dropout=0.1, batch_norm=True, tasks=["linear:class"])
CONFIG["output"]["checkpoint_every"] = 0
CONFIG["evaluation"]["random_baseline"] = True


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory) -> Path:
    """The uninterrupted run's folder."""
    run = tmp_path_factory.mktemp("ref") / "run"
    r = run_train(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _start(recipe: Path, run: Path, marker: Path, *options: str) -> subprocess.Popen:
    command = [sys.executable, str(SLOW_TRAIN), "--marker", str(marker), *options, "--", str(recipe),
               "--output", str(run)]
    return subprocess.Popen(command, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _marked_step(marker: Path) -> int:
    return int(marker.read_text().split()[0]) if marker.is_file() else 0


def _wait_for(proc: subprocess.Popen, condition, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"training ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        proc.stdout_text, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the process did not stop within {timeout} s of the signal")
    return proc.returncode, err


def _last_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.strip()][-1]


def _run_printed(line: str) -> subprocess.CompletedProcess:
    """Run the command a message prints after 'with: ' (``mmviews train ...``) as the user would."""
    words = shlex.split(line.split("with: ", 1)[1])
    assert words[:2] == ["mmviews", "train"], line
    return run_train(*words[2:], timeout=180)


def _assert_same_weights(run: Path, reference: Path) -> None:
    a, b = load_weights(run / "encoder"), load_weights(reference / "encoder")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def _steps_logged(run: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in (run / "metrics.csv").read_text().splitlines()[1:]]


def test_sigint_stops_after_the_step_and_printed_resume_reaches_the_uninterrupted_weights(recipe, reference, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "marker"
    proc = _start(recipe, run, marker, "--step-sleep", "0.3")
    _wait_for(proc, lambda: _marked_step(marker) >= 3, "step 3")
    proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err
    step = _marked_step(marker)  # the step during which the signal came is finished, no later one starts
    assert 3 <= step < 12
    line = _last_line(err)
    assert line == f"mmviews train: stopped by SIGINT after step {step}, checkpoint saved; resume with: " \
                   f"mmviews train --resume {run}", err
    assert [c.name for c in list_checkpoints(run)] == [f"checkpoint-{step:08d}"]
    assert _steps_logged(run) == list(range(1, step + 1))
    # output.progress_bar is false: a line per logged step instead.
    assert [line.split()[1] for line in proc.stdout_text.splitlines() if line.startswith("step ")] == \
        [f"{s}/12" for s in range(1, step + 1)]
    # The manifest lists everything the run wrote (--overwrite would otherwise call these foreign).
    manifest = read_manifest(run)
    assert {"eval_random", "metrics.csv", "checkpoints", "config.yaml"} <= set(manifest["created"])
    assert manifest["foreign"] == []

    r = _run_printed(line)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_weights(run, reference)
    assert _steps_logged(run) == list(range(1, 13))


def test_sigterm_exits_143_with_a_checkpoint_and_overwrite_removes_the_whole_run(recipe, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "marker"
    proc = _start(recipe, run, marker, "--step-sleep", "0.3")
    _wait_for(proc, lambda: _marked_step(marker) >= 2, "step 2")
    proc.send_signal(signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 143, err[-3000:]
    step = _marked_step(marker)
    assert _last_line(err).startswith(f"mmviews train: stopped by SIGTERM after step {step}, checkpoint saved; "
                                      f"resume with: mmviews train --resume {run}")
    assert read_train_state(list_checkpoints(run)[-1])["step"] == step
    (run / "notes.txt").write_text("the user's own file, put next to the run: --overwrite must keep it")
    # What --overwrite does first: remove what the run wrote, which is everything but notes.txt.
    claim_run_dir(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [RUN_MANIFEST, "notes.txt"]
    assert read_manifest(run)["foreign"] == ["notes.txt"]


def test_second_sigint_aborts_at_once_and_leaves_no_corrupt_checkpoint(recipe, reference, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "marker"
    # Every checkpoint sleeps 60 s once complete in its temporary folder, before its rename.
    proc = _start(recipe, run, marker, "--step-sleep", "0.3", "--checkpoint-sleep", "60")
    _wait_for(proc, lambda: _marked_step(marker) >= 1, "step 1")
    proc.send_signal(signal.SIGINT)
    folder = run / "checkpoints"
    _wait_for(proc, lambda: any((p / "train_state.json").is_file() for p in folder.glob(".tmp-*")),
              "a checkpoint written to its temporary folder")
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    rc, err = _finish(proc)
    assert time.monotonic() - sent < 30, "the second signal did not abort at once (the checkpoint sleeps 60 s)"
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err
    line = _last_line(err)
    assert line.startswith("mmviews train: aborted at once by a second SIGINT; "), err
    if not list_checkpoints(run):  # the usual case: the interrupt's checkpoint was the first
        assert line.endswith(f"{run} has no checkpoint yet, start it again with: mmviews train --resume {run}")
    # The half-done checkpoint stays in its temporary folder; every checkpoint-N is complete.
    assert list(folder.glob(".tmp-*"))
    for checkpoint in list_checkpoints(run):
        files = read_train_state(checkpoint)["files"]
        assert sorted(files) == sorted(p.name for p in checkpoint.iterdir() if p.name != "train_state.json")
    # Whether or not an earlier checkpoint exists, the printed command finishes the run exactly.
    r = _run_printed(line)
    assert r.returncode == 0, r.stderr[-3000:]
    if "start it again" in line:
        assert "has no checkpoint (the run stopped before its first one): starting it again from step 0" in r.stdout
    assert not list(folder.glob(".tmp-*"))
    _assert_same_weights(run, reference)


def _gaussian_recipe(path: Path, input_dim: int) -> Path:
    raw = {
        "name": "gauss", "seed": 0,
        "data": {"name": "gaussian_latents", "options": {"sigma0": 1.0},
                 "split_options": {"train": {"num_samples": 256}, "valid": {"num_samples": 64},
                                   "test": {"num_samples": 64}}, "batch_size": 64, "eval_batch_size": 64},
        "views": [{"modality": "x", "copies": 2, "augment": "seq_noise", "params": {"std": 0.03}}],
        "encoder": {"embed_dim": 8},
        "adapters": {"x": {"type": "mlp", "input_dim": input_dim, "hidden_dim": 8, "head": {"kind": "linear"}}},
        "objective": {"name": "geometric_pvc", "params": {"temperature": 0.1}},
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": 1},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": 1, "progress_bar": False},
    }
    return write_recipe(path, raw)


def test_setup_failure_then_the_same_command_starts_again(tmp_path):
    recipe, run = _gaussian_recipe(tmp_path / "gauss.yaml", input_dim=5), tmp_path / "run"  # the data has 1
    r = run_train(str(recipe), "--output", str(run))
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{run} holds no checkpoint: once fixed, the same command starts it again there" in r.stderr
    assert (run / "config.yaml").is_file()  # the folder was claimed before the failure
    _gaussian_recipe(recipe, input_dim=1)  # fixed
    r = run_train(str(recipe), "--output", str(run))  # the same command, no --overwrite
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "encoder").is_dir()
    assert read_manifest(run)["foreign"] == []
    # A run that has something to keep is still protected.
    with pytest.raises(RunFolderError, match="already holds a run"):
        check_run_dir(run)


def test_resume_of_a_finished_run_does_nothing_unless_reevaluate(reference, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    r = run_train("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{run} has already finished (step 12, results.json written): nothing to do" in r.stdout
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert after == before  # not a file touched

    wall = json.loads((run / "results.json").read_text())["wall_time_s"]
    metrics = run / "eval" / "metrics.json"
    r = run_train("--resume", str(run), "--reevaluate")
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics.stat().st_mtime_ns != before[metrics][0]  # evaluated again...
    results = json.loads((run / "results.json").read_text())
    assert results["wall_time_s"] == wall  # ...keeping the training's wall time
    assert results["eval"] == json.loads(before[run / "results.json"][1])["eval"]  # same encoder, same numbers
    _assert_same_weights(run, reference)

    assert main(["train", "--reevaluate", str(run / "config.yaml")]) == 2
    assert "--reevaluate only applies with --resume DIR" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_stop_at_the_same_step_when_only_one_is_signalled(tmp_path):
    """A scheduler (or the launcher) may signal the processes at different moments, here only
    rank 1: both must stop at the same step (else the one still training waits forever in its
    next collective), write one complete checkpoint, and rank 0 prints the resume line once."""
    raw = tiny_config(image=False, batch_norm=False, dropout=0.0, num_samples=64, batch_size=16, epochs=3)
    raw["cpu"] = True
    raw["output"]["checkpoint_every"] = 0
    recipe = write_recipe(tmp_path / "dist.yaml", raw)
    run, marker = tmp_path / "run", tmp_path / "marker"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port()), str(SLOW_TRAIN), "--step-sleep", "0.3",
                "--marker", str(marker), "--", str(recipe), "--output", str(run)]
    proc = subprocess.Popen(launcher, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = Path(f"{marker}.rank1")
    _wait_for(proc, lambda: _marked_step(rank1) >= 2, "step 2 on rank 1", timeout=240)
    os.kill(int(rank1.read_text().split()[1]), signal.SIGTERM)
    rc, err = _finish(proc, timeout=180)
    assert rc != 0
    steps = {_marked_step(Path(f"{marker}.rank{r}")) for r in (0, 1)}
    assert len(steps) == 1, f"the ranks stopped at different steps: {steps}"
    step = steps.pop()
    assert 2 <= step < 12
    checkpoint = list_checkpoints(run)[-1]
    assert read_train_state(checkpoint)["step"] == step
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    lines = [line for line in err.splitlines() if line.startswith("mmviews train: stopped by")]
    assert lines == [f"mmviews train: stopped by SIGTERM after step {step}, checkpoint saved; resume with: "
                     f"accelerate launch <the same launch options> -m mmviews.cli train --resume {run}"], err[-4000:]
    assert re.search(r"exitcode\s*:\s*143", err), err[-4000:]
