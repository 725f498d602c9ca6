"""Ctrl-C and SIGTERM as a user meets them: a real signal to a real `mmviews train` process
(tests/slow_train.py: the command with a callback that holds after a chosen optimiser step until
the signal comes, and writes a marker file when it holds, so the test signals at a known step
without guessing with sleeps), the step the run stops at (exactly that one), the one-line
message, the exit status, and the printed command that resumes the run to the uninterrupted
run's weights.
Also: a run folder with no checkpoint starts again as the message says, and `--resume` of a
finished run does nothing unless `--reevaluate`.

What needs no signal runs in this process (the uninterrupted reference, the printed resume
commands, ``--reevaluate``: ``test_train_utils.train_in_process``, the command's ``main``), one
interpreter start fewer each, with one torch thread as the subprocesses (``OMP_NUM_THREADS=1``):
weights compared bitwise across the two kinds of process are the same."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from crafted_files import cli
from test_train_utils import (
    free_port,
    load_weights,
    own_accelerate_state,
    started,
    tiny_config,
    train_in_process,
    wait_for_file,
    write_recipe,
)

from mmviews.cli import main
from mmviews.config import load_config
from mmviews.run import (
    RUN_MANIFEST,
    RunExistsError,
    list_checkpoints,
    read_manifest,
    read_train_state,
)
from mmviews.train.run_folder import Intent, RunFolder, claim_run_dir

SLOW_TRAIN = Path(__file__).resolve().parent / "slow_train.py"

# 4 batches per epoch x 2 epochs = 8 optimiser steps (a resume from step 1, 2 or 3 crosses the
# epoch boundary); no periodic checkpoint (the default checkpoint_every: 0), so a checkpoint
# mid-epoch can only come from the interrupt. Dropout and BatchNorm are on (in the heads; the
# CNNs have BatchNorm), and a view is augmented: equal weights also need the RNG states and BN
# buffers restored. No BERT (text=False) and an audio augmentation instead of the image one: the
# text tower and torchvision have nothing to do with signals, and a process that imports
# neither transformers nor torchvision starts sooner.
STEPS = 8
CONFIG = tiny_config(num_samples=64, batch_size=16, epochs=2, dropout=0.1, batch_norm=True, tasks=["linear:class"],
                     text=False)
CONFIG["views"] = [{"modality": "image"}, {"modality": "audio"}, {"modality": "audio", "augment": "audio_shift"}]
CONFIG["output"]["checkpoint_every"] = 0
CONFIG["evaluation"]["random_baseline"] = True
CONFIG["evaluation"]["plots"] = False  # the reports' metrics without their PNGs (about a second each)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("recipe") / "tiny.yaml", CONFIG)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory) -> Path:
    """The uninterrupted run's folder (trained in this process: no signal is involved)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    r = train_in_process(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _slow_train(recipe: Path, run: Path, marker: Path, *options: str) -> list[str]:
    return [sys.executable, str(SLOW_TRAIN), "--marker", str(marker), *options, "--", str(recipe), "--output", str(run)]


def _held_until_signal(step: int, held: Path) -> tuple[str, ...]:
    """slow_train options: hold after optimiser ``step`` until a signal comes (``held`` marks the hold)."""
    return "--hold-after-step", str(step), "--until-signal", "--hold-marker", str(held)


def _marked_step(marker: Path) -> int:
    return int(marker.read_text().split()[0]) if marker.is_file() else 0


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Wait for the signalled process to end (``timeout`` only bounds a hung test: a held
    process that does not stop sleeps far longer)."""
    try:
        proc.stdout_text, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process did not stop within {timeout} s of the signal")
    return proc.returncode, err


def check_stopped_at(run: Path, marker: Path, step: int) -> None:
    """The guard of "a signal stops the run after the step during which it came": the last step
    run (the callback's marker), the checkpoint written (its name and ``train_state.json``) and
    the logged steps all end at ``step``, not one later."""
    assert _marked_step(marker) == step, f"signalled at step {step}, the last step run is {_marked_step(marker)}"
    assert [c.name for c in list_checkpoints(run)] == [f"checkpoint-{step:08d}"]
    assert read_train_state(list_checkpoints(run)[-1])["step"] == step
    assert _steps_logged(run) == list(range(1, step + 1))


def _last_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.strip()][-1]


def _run_printed(line: str) -> subprocess.CompletedProcess:
    """Run the command a message prints after 'with: ' (``mmviews train ...``) as the user would
    (in this process: the ``mmviews`` command is :func:`mmviews.cli.main`)."""
    words = shlex.split(line.split("with: ", 1)[1])
    assert words[:2] == ["mmviews", "train"], line
    return train_in_process(*words[2:])


def _assert_same_weights(run: Path, reference: Path) -> None:
    a, b = load_weights(run / "encoder"), load_weights(reference / "encoder")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def _steps_logged(run: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in (run / "metrics.csv").read_text().splitlines()[1:]]


def test_sigint_stops_after_the_step_and_printed_resume_reaches_the_uninterrupted_weights(recipe, reference, tmp_path):
    run, marker, held = tmp_path / "run", tmp_path / "marker", tmp_path / "held"
    with started(_slow_train(recipe, run, marker, *_held_until_signal(3, held))) as proc:
        wait_for_file(proc, held, "the hold after step 3")
        proc.send_signal(signal.SIGINT)
        rc, err = _finish(proc)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err
    check_stopped_at(run, marker, 3)  # the step during which the signal came is finished, no later one starts
    line = _last_line(err)
    assert line == f"mmviews train: stopped by SIGINT after step 3, checkpoint saved; resume with: " \
                   f"mmviews train --resume {run}", err
    # output.progress_bar is false: a line per logged step instead.
    assert [line.split()[1] for line in proc.stdout_text.splitlines() if line.startswith("step ")] == \
        [f"{s}/{STEPS}" for s in range(1, 4)]
    # The manifest lists everything the run wrote (--overwrite would otherwise call these foreign).
    manifest = read_manifest(run)
    assert {"eval_random", "metrics.csv", "checkpoints", "config.yaml"} <= set(manifest["created"])
    assert manifest["foreign"] == []

    r = _run_printed(line)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_weights(run, reference)
    assert _steps_logged(run) == list(range(1, STEPS + 1))


def _signal_this_process_when(marker: Path, signum: int, give_up: threading.Event) -> threading.Thread:
    """A thread that sends ``signum`` to this process once ``marker`` exists (the run in this
    process holds there, its handlers in place), unless ``give_up`` is set first (the run
    ended without holding)."""

    def wait_then_signal() -> None:
        while not marker.exists():
            if give_up.wait(0.02):
                return
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


def test_stop_check_fails_when_the_run_stops_one_step_late(tmp_path, monkeypatch, capsys):
    """Mutation test (tests/README.md): a loop that runs one more step after the signal (break
    ``stop_one_step_late``) fails :func:`check_stopped_at`. The run is in this process
    (``slow_train.install``, undone after the test) and gets a real SIGINT from a thread of it
    at the hold (the guard reads the run's files, which do not depend on the process)."""
    import slow_train

    run, marker, held = tmp_path / "run", tmp_path / "marker", tmp_path / "held"
    # The recipe without the random-baseline evaluation before training (the run stops before its own).
    no_baseline = {**CONFIG, "evaluation": {**CONFIG["evaluation"], "random_baseline": False}}
    quick = write_recipe(tmp_path / "quick.yaml", no_baseline)
    options = ["--marker", str(marker), *_held_until_signal(2, held), "--break", "stop_one_step_late"]
    opts, rest = slow_train.parse([*options, "--", str(quick), "--output", str(run)])
    slow_train.install(opts, monkeypatch.setattr)
    give_up = threading.Event()
    signaller = _signal_this_process_when(held, signal.SIGINT, give_up)
    try:
        with own_accelerate_state():
            rc, _, err = cli(capsys, "train", *rest)
    finally:
        give_up.set()
        signaller.join()
    assert rc == 130, err[-3000:]
    with pytest.raises(AssertionError, match="signalled at step 2, the last step run is 3"):
        check_stopped_at(run, marker, 2)
    assert _marked_step(marker) == 3  # the break did what it says


def test_sigterm_exits_143_with_a_checkpoint_and_overwrite_removes_the_whole_run(recipe, tmp_path):
    run, marker, held = tmp_path / "run", tmp_path / "marker", tmp_path / "held"
    with started(_slow_train(recipe, run, marker, *_held_until_signal(2, held))) as proc:
        wait_for_file(proc, held, "the hold after step 2")
        proc.send_signal(signal.SIGTERM)
        rc, err = _finish(proc)
    assert rc == 143, err[-3000:]
    check_stopped_at(run, marker, 2)
    assert _last_line(err).startswith("mmviews train: stopped by SIGTERM after step 2, checkpoint saved; "
                                      f"resume with: mmviews train --resume {run}")
    (run / "notes.txt").write_text("the user's own file, put next to the run: --overwrite must keep it")
    # What --overwrite does first: remove what the run wrote, which is everything but notes.txt.
    claim_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == [RUN_MANIFEST, "notes.txt"]
    assert read_manifest(run)["foreign"] == ["notes.txt"]


def test_second_sigint_aborts_at_once_and_leaves_no_corrupt_checkpoint(recipe, reference, tmp_path):
    """The first SIGINT comes after step 1; the checkpoint it causes then holds (sleeps far
    longer than the test waits) once complete in its temporary folder, before its rename: the
    run can only end because the second SIGINT aborts it at once."""
    run, marker, held, writing = tmp_path / "run", tmp_path / "marker", tmp_path / "held", tmp_path / "writing"
    with started(_slow_train(recipe, run, marker, *_held_until_signal(1, held), "--hold-after-checkpoint", "1",
                             "--checkpoint-hold-marker", str(writing))) as proc:
        wait_for_file(proc, held, "the hold after step 1")
        proc.send_signal(signal.SIGINT)
        wait_for_file(proc, writing, "the checkpoint of step 1 written to its temporary folder")
        proc.send_signal(signal.SIGINT)
        rc, err = _finish(proc)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err
    line = _last_line(err)
    # The interrupt's checkpoint was the first: none is complete.
    assert line == (f"mmviews train: aborted at once by a second SIGINT; {run} has no checkpoint yet, start it again "
                    f"with: mmviews train --resume {run}"), err
    folder = run / "checkpoints"
    # The half-done checkpoint stays in its temporary folder; no checkpoint-N exists.
    assert [p.name for p in folder.iterdir()] == [".tmp-checkpoint-00000001"] and not list_checkpoints(run)
    # The printed command starts the run again and finishes it exactly.
    r = _run_printed(line)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("mmviews train: warning: " f"{run} has no checkpoint (the run stopped before its first one): starting it "
            "again from step 0") in r.stderr
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


def test_setup_failure_then_the_same_command_starts_again(tmp_path, capsys):
    # The command in this process (crafted_files.cli): no signal is involved, and it saves two interpreter starts.
    recipe, run = _gaussian_recipe(tmp_path / "gauss.yaml", input_dim=5), tmp_path / "run"  # the data has 1
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(run))
    assert rc == 2, err[-3000:]
    assert f"{run} holds no checkpoint: once fixed, the same command starts it again there" in err
    assert (run / "config.yaml").is_file()  # the folder was claimed before the failure
    _gaussian_recipe(recipe, input_dim=1)  # fixed
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(run))  # the same command, no --overwrite
    assert rc == 0, err[-3000:]
    assert (run / "encoder").is_dir()
    assert read_manifest(run)["foreign"] == []
    # A run that has something to keep is still protected.
    decided = RunFolder(run).decide(load_config(recipe), Intent(), act=False)
    assert isinstance(decided.error, RunExistsError) and "already holds a run" in str(decided.error)


def test_resume_of_a_finished_run_does_nothing_unless_reevaluate(reference, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    rc, out, err = cli(capsys, "train", "--resume", str(run))  # in this process: no signal is involved
    assert rc == 0, err[-3000:]
    assert f"{run} has already finished (step {STEPS}, results.json written): nothing to do" in out
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert after == before  # not a file touched

    wall = json.loads((run / "results.json").read_text())["wall_time_s"]
    metrics = run / "eval" / "metrics.json"
    # One thread, as the run was evaluated: the numbers must be the same.
    r = train_in_process("--resume", str(run), "--reevaluate")
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics.stat().st_mtime_ns != before[metrics][0]  # evaluated again...
    results = json.loads((run / "results.json").read_text())
    assert results["wall_time_s"] == wall  # ...keeping the training's wall time
    assert results["eval"] == json.loads(before[run / "results.json"][1])["eval"]  # same encoder, same numbers
    _assert_same_weights(run, reference)

    assert main(["train", "--reevaluate", str(run / "config.yaml")]) == 2
    assert "--reevaluate only applies with --resume DIR" in capsys.readouterr().err


def test_two_processes_stop_at_the_same_step_when_only_one_is_signalled(tmp_path):
    """A scheduler (or the launcher) may signal the processes at different moments, here only
    rank 1: both must stop at the same step (else the one still training waits forever in its
    next collective), write one complete checkpoint, and rank 0 prints the resume line once."""
    raw = tiny_config(batch_norm=False, dropout=0.0, num_samples=64, batch_size=16, epochs=2, text=False)
    raw["views"] = [view for view in raw["views"] if "augment" not in view]  # image, audio: no torchvision to import
    raw["cpu"] = True
    raw["output"]["checkpoint_every"] = 0
    recipe = write_recipe(tmp_path / "dist.yaml", raw)
    run, marker, held = tmp_path / "run", tmp_path / "marker", tmp_path / "held"
    port = free_port()
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(port), str(SLOW_TRAIN), *_held_until_signal(2, held),
                "--hold-rank", "1", "--marker", str(marker), "--", str(recipe), "--output", str(run)]
    rank1 = Path(f"{marker}.rank1")
    with started(launcher) as proc:
        # Rank 1 holds after step 2 (rank 0 waits for it in step 3's gradient all-reduce).
        wait_for_file(proc, held, "the hold of rank 1 after step 2", timeout=240)
        os.kill(int(rank1.read_text().split()[1]), signal.SIGTERM)
        rc, err = _finish(proc, timeout=180)
    assert rc != 0
    steps = [_marked_step(Path(f"{marker}.rank{r}")) for r in (0, 1)]
    # Both at the same step, the one after the signal's: the processes agree on the signal with
    # an all-reduce started at the step where it came and read at the next (mmviews.train.interrupt).
    assert steps == [3, 3], f"the ranks stopped at steps {steps}"
    checkpoint = list_checkpoints(run)[-1]
    assert read_train_state(checkpoint)["step"] == 3
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    lines = [line for line in err.splitlines() if line.startswith("mmviews train: stopped by")]
    assert lines == ["mmviews train: stopped by SIGTERM after step 3, checkpoint saved; resume with: "
                     "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
                     f"--dynamo_backend no --main_process_port {port} -m mmviews.cli train --resume {run}"], err[-4000:]
    assert re.search(r"exitcode\s*:\s*143", err), err[-4000:]
