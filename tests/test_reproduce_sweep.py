"""recipes/reproduce/_common.py's ``run_sweep`` with worker processes: SIGTERM to the script
stops the workers with it (none is left running its training as an orphan), the script exits
with 128 + SIGTERM and says how many runs finished, and the unfinished run leaves no result a
rerun would take as finished. A real script (the identifiability reproduction at smoke size, one
run made endless) in a real subprocess, signalled from outside.

Also the progress line of a finished run: the metrics it has, never "acc nan"."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_train_utils import wait_until_gone

REPRO = Path(__file__).resolve().parents[1] / "recipes" / "reproduce"


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the fields after the command's closing parenthesis: state, ppid, ...
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.add(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_the_sweep_workers(tmp_path: Path) -> None:
    """About 45 s under load average 5 on 2 cores: a script and its two spawned workers each
    import torch and the trainer before the first run can start; nothing smaller shows them."""
    out = tmp_path / "ident"
    # part a at smoke size: a one-step random-init run and a trained run of a million steps,
    # each in one of the two workers
    proc = subprocess.Popen([sys.executable, str(REPRO / "identifiability.py"), "--smoke", "--part", "a",
                             "--jobs", "2", "--steps-a", "1000000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        # the random-init run finished: both workers are up, one of them inside the endless training
        while not any("[1/2] random_init_both_s0" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers  # the two pool workers (and multiprocessing's resource tracker)
        assert (out / "runs" / "a_both_s0").is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, "".join(lines)
        assert not wait_until_gone(sorted(workers), timeout=30), "workers left running after the script ended"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=10)
    output = "".join(lines)
    assert "SIGTERM: sweep stopped with 1 of 2 runs finished" in output, output
    # the endless run never wrote a result (a rerun trains it again, not reuses a partial one)
    assert not (out / "runs" / "a_both_s0" / "results.json").exists()
    assert (out / "runs" / "random_init_both_s0" / "results.json").is_file()
    assert "acc nan" not in output and "erank nan" not in output


def test_progress_line_prints_only_the_metrics_a_run_has() -> None:
    sys.path.insert(0, str(REPRO))
    try:
        spec = importlib.util.spec_from_file_location("reproduce_common_progress", REPRO / "_common.py")
        common = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(common)
    finally:
        sys.path.remove(str(REPRO))
    row = {"acc": float("nan"), "erank": float("nan"), "final_loss": 4.25, "wall_s": 3.5, "status": "ok"}
    assert common._progress(row) == "loss 4.2500, 3.5 s, ok"
    row |= {"acc": 0.8125, "erank": 7.5}
    assert common._progress(row) == "acc 0.812, erank 7.50, loss 4.2500, 3.5 s, ok"
