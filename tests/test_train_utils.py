"""Shared helpers of the training tests: tiny recipes on the synthetic data, a runner for
``mmviews train`` in a subprocess, weight loading, and a recorder of the `os.fsync`/`os.replace` calls
of a commit. (No tests here.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def tiny_config(*, batch_norm: bool = True, dropout: float = 0.1, image: bool = True, num_samples: int = 64,
                batch_size: int = 16, epochs: int = 2, tasks: list[Any] | None = None,
                text: bool = True) -> dict[str, Any]:
    """A recipe that trains in seconds on CPU: tiny BERT text views (+ a tiny CNN image view).

    ``text=False``: no BERT (a process that never imports transformers starts about 3 s sooner):
    a tiny CNN on the image, an augmented image view and a tiny audio CNN, with ``dropout`` in
    the projection heads; for tests about the trainer rather than the text tower."""
    from mmviews.data.synthetic import synthetic_vocabulary

    head = {"kind": "mlp", "hidden_dim": 32, "batch_norm": batch_norm}
    if not text:
        head["dropout"] = dropout
        config = tiny_config(batch_norm=batch_norm, dropout=dropout, num_samples=num_samples, batch_size=batch_size,
                             epochs=epochs, tasks=tasks)
        config["adapters"] = {"image": {"type": "small_cnn", "channels": [8], "head": head},
                              "audio": {"type": "audio_cnn", "channels": [8], "head": head}}
        config["views"] = [{"modality": "image"}, {"modality": "image", "augment": "simclr", "params": {"size": 32}},
                           {"modality": "audio"}]
        config["data"]["options"]["modalities"] = ["image", "audio"]
        return config
    adapters: dict[str, Any] = {
        "text": {
            "type": "text",
            "bert_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                            "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout},
            "vocab": synthetic_vocabulary(False),
            "max_length": 16,
            "head": head,
        }
    }
    views: list[Any] = [{"modality": "text"}, {"modality": "text", "augment": "text_default", "copies": 1}]
    modalities = ["text"]
    if image:
        adapters["image"] = {"type": "small_cnn", "channels": [8], "head": head}
        views.append({"modality": "image"})
        modalities.append("image")
    else:
        views[1]["copies"] = 2
    return {
        "name": "tiny",
        "seed": 0,
        "data": {"name": "synthetic", "options": {"num_samples": num_samples, "modalities": modalities},
                 "batch_size": batch_size, "eval_batch_size": 64},
        "views": views,
        "encoder": {"embed_dim": 16},
        "adapters": adapters,
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        # float32 on every machine: `auto` picks bf16 on a CPU with AVX512-BF16/AMX, and the
        # equality checks of these runs (one process against two, cached against plain) are float32's
        "optimisation": {"optimizer": "adamw", "lr": 3e-3, "epochs": epochs, "warmup_steps": 1, "max_grad_norm": 5.0,
                         "mixed_precision": "no"},
        "evaluation": {"tasks": tasks if tasks is not None else [], "random_baseline": True},
        "output": {"log_every": 1, "checkpoint_every": 2, "keep_last": 2, "progress_bar": False},
    }


def write_recipe(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def train_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mmviews.cli", "train", *args]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "1")  # several runs share 2 cores; one thread keeps them deterministic
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    out.update(extra)
    return out


def run_train(*args: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(*args), capture_output=True, text=True, timeout=timeout, env=env(**extra_env),
                          cwd=REPO)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a saved MultiViewEncoder folder (``encoder/``), keyed by modality/name."""
    from safetensors.torch import load_file

    out = {}
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        for k, v in load_file(str(sub / "model.safetensors")).items():
            out[f"{sub.name}/{k}"] = v
    return out


def _kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid``: torchrun (``accelerate launch``) starts each rank in a
    session of its own, out of reach of a kill of the launcher's process group."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


@contextlib.contextmanager
def started(command: list[str], **popen_options: Any) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(command)`` in a session of its own (``env()``, text pipes by default),
    whose whole process group (loader workers, a launcher's ranks) is SIGKILLed when the block
    ends, however it ends: a failed test leaves no process behind."""
    options: dict[str, Any] = {"env": env(), "cwd": REPO, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                               "text": True, **popen_options}
    proc = subprocess.Popen(command, start_new_session=True, **options)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # still running, so the pid is still its own
            _kill_descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def wait_for_file(proc: subprocess.Popen, marker: Path, what: str, timeout: float = 180) -> None:
    """Wait until ``marker`` exists (written by the process at the moment the test acts on, see
    ``tests/slow_train.py``). An error if the process ends first; ``timeout`` only bounds a hung
    test, it decides nothing."""
    import pytest

    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            err = proc.stderr.read()[-3000:] if proc.stderr is not None else ""
            pytest.fail(f"the process ended (rc {proc.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (read from /proc: a zombie has ended, only its parent has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # the state field, after "pid (comm) "


def wait_until_gone(pids: list[int], timeout: float = 20) -> list[int]:
    """Waits up to ``timeout`` seconds for the processes to end; returns those still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if process_alive(pid)]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its process group (its loader workers), and reap it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def read_record(path: Path) -> list[dict[str, Any]]:
    """The per-step rows written by ``tests/slow_train.py --record`` (none if the file is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_in_group(command: list[str], timeout: float = 240, **popen_options: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` for a multi-process launch: in a
    session of its own, whose whole process group (the launcher's ranks) is killed when it ends or
    times out, so that a failed or hung launch leaves no process behind."""
    with started(command, **popen_options) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            import pytest

            pytest.fail(f"{' '.join(command[:6])} ... did not finish within {timeout} s")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def free_port() -> int:
    """A TCP port free on this machine now, for a test's process group (``MASTER_PORT``,
    ``--main_process_port``): never a fixed one, since test files run beside each other."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(command: list[str], folder: Path, num_processes: int = 2,
              timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``command`` as the ``num_processes`` ranks of one torch.distributed job on this machine,
    each a real process with the environment ``torchrun`` (or ``accelerate launch``) gives its
    workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), started by the test itself: no launcher process, one interpreter start
    (~2 s of imports) fewer per launch. Each rank's output goes to ``folder/rank<R>.{out,err}``
    (files, not pipes: a rank never blocks on a full pipe while the test waits for another).
    Every rank runs in a session of its own whose group is SIGKILLed when this returns or
    fails: a failed or hung launch leaves no process behind. Returns the ranks' results, rank 0
    first."""
    port = free_port()
    ranks = []
    with contextlib.ExitStack() as stack:
        for rank in range(num_processes):
            rank_env = env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(num_processes),
                           LOCAL_WORLD_SIZE=str(num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            out, err = (stack.enter_context(open(folder / f"rank{rank}.{kind}", "w")) for kind in ("out", "err"))
            ranks.append(stack.enter_context(started(command, env=rank_env, stdout=out, stderr=err)))
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in ranks):
            if any(proc.returncode not in (None, 0) for proc in ranks):
                break  # a rank failed: the others would wait for it in a collective (killed on leaving)
            if time.monotonic() > deadline:  # bounds a hung launch only
                import pytest

                pytest.fail(f"{' '.join(command[:4])} ... did not finish within {timeout} s")
            time.sleep(0.05)
    return [subprocess.CompletedProcess(command, proc.returncode, (folder / f"rank{r}.out").read_text(),
                                        (folder / f"rank{r}.err").read_text()) for r, proc in enumerate(ranks)]


@contextlib.contextmanager
def own_accelerate_state() -> Iterator[None]:
    """Accelerate's process-wide state (a singleton that refuses a second precision) empty for
    a run inside this pytest process, and put back as it was after: the run neither meets nor
    leaves a state that clashes with another in-process run (a bf16 one after a float32 one).
    One torch thread inside, as the training subprocesses (``OMP_NUM_THREADS=1``, :func:`env`)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    saved = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    for cls, _ in saved:
        cls._shared_state.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for cls, state in saved:
            cls._shared_state.clear()
            cls._shared_state.update(state)


def train_in_process(*args: str) -> subprocess.CompletedProcess:
    """``mmviews train ARGS`` run by the command's ``main`` in this process (a subprocess pays
    about 3 s of imports first), under :func:`own_accelerate_state`; its exit code and what it
    printed, as :func:`run_train` returns them."""
    import io

    from mmviews.cli import main

    out, err = io.StringIO(), io.StringIO()
    with own_accelerate_state(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["train", *args])
    return subprocess.CompletedProcess(["mmviews", "train", *args], rc, out.getvalue(), err.getvalue())


class CallRecorder:
    """Records ``os.fsync`` (by the path of its descriptor) and ``os.replace`` calls, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def install(self, patch: Any) -> None:
        fsync, replace = os.fsync, os.replace

        def recording_fsync(fd: int) -> None:
            self.calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            fsync(fd)

        def recording_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.calls.append(("replace", os.path.abspath(src), os.path.abspath(dst)))
            replace(src, dst, *args, **kwargs)

        patch.setattr(os, "fsync", recording_fsync)
        patch.setattr(os, "replace", recording_replace)

    def index(self, call: tuple[str, ...]) -> int:
        assert call in self.calls, f"{call} was never made"
        return self.calls.index(call)


def check_committed_durably(calls: CallRecorder, tmp: Path, final: Path, files: list[str]) -> None:
    """``tmp`` renamed to ``final`` after each of ``files`` (paths relative to it) and ``tmp``
    itself were flushed, and ``final``'s parent flushed after the rename."""
    renamed = calls.index(("replace", str(tmp), str(final)))
    for name in [*files, "."]:
        path = os.path.normpath(tmp / name)
        flushed = [i for i, call in enumerate(calls.calls) if call == ("fsync", path)]
        assert flushed and flushed[0] < renamed, f"{path} was not flushed before the rename to {final}"
    assert any(call == ("fsync", str(final.parent)) for call in calls.calls[renamed + 1:]), \
        f"{final.parent} was not flushed after the rename to {final}"
