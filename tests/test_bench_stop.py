"""``mmviews bench train`` stopped by SIGINT or SIGTERM stops the processes it started (each case's
process, that one's estimate process and loader workers): a real bench, real signals, the process
tree read from /proc. And a recipe the realistic case does not fit (ucf101's video) times its own
step without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_utils import env, process_alive, tiny_config, wait_until_gone, write_recipe

pytestmark = pytest.mark.slow


def children_of() -> dict[int, list[int]]:
    """``{parent pid: [child pids]}`` of every process in /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z":  # a zombie has ended
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = children_of(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# A bench case (a session leader, as run_stoppable starts it) that runs a subprocess of its own
# through run_stoppable, then prints both pids and waits.
NESTED = """
import os, subprocess, sys, threading
from mmviews.bench.common import run_stoppable
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
threading.Thread(target=run_stoppable, args=(sleeper,), daemon=True).start()
while True:
    kids = [int(p) for p in os.listdir("/proc") if p.isdigit()
            and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
    if kids:
        print(os.getpid(), kids[0], flush=True)
        break
threading.Event().wait(300)
"""


def test_a_case_killed_whole_takes_its_estimate_process_with_it() -> None:
    """The bench stops a case by its process group, SIGKILL at the end of the grace period: a
    subprocess the case started (its estimate) is in that group, so nothing outlives the case."""
    case = subprocess.Popen([sys.executable, "-c", NESTED], env=env(), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        case_pid, estimate_pid = map(int, case.stdout.readline().split())
        assert os.getpgid(estimate_pid) == case_pid
        os.killpg(case_pid, signal.SIGKILL)
        case.wait(30)
        assert not wait_until_gone([estimate_pid])
    finally:
        try:
            os.killpg(case.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_the_block_even_where_sigint_started_ignored(signum: int) -> None:
    """A bench started as a shell's background job inherits SIGINT ignored; ``kill -INT`` still
    stops it, as it stops ``mmviews train``. After the block the previous handlers are back."""
    script = (
        "import signal, sys, time\n"
        "from mmviews.bench.common import StopOnSignals\n"
        "try:\n"
        "    with StopOnSignals():\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped', signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)\n"
        "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env(), stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and out.strip() == "stopped True", (proc.returncode, out)


def test_the_bench_own_subprocess_gets_a_session_of_its_own() -> None:
    """From a process that leads no session (a terminal's, a test's: here a child of this test,
    which leads none whatever this process is), the subprocess gets its own session: a
    terminal's Ctrl-C reaches it once, through the bench."""
    script = (
        "import os, subprocess, sys\n"
        "from mmviews.bench.common import run_stoppable\n"
        "assert os.getsid(0) != os.getpid()\n"
        "leader = 'import os; print(os.getsid(0) == os.getpid())'\n"
        "print(run_stoppable([sys.executable, '-c', leader], stdout=subprocess.PIPE, text=True).stdout.strip())\n")
    done = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_bench_stops_its_subprocesses(tmp_path: Path, signum: int) -> None:
    raw = tiny_config(text=False, num_samples=64, batch_size=8)
    raw["data"]["num_workers"] = 1  # a loader worker: a grandchild of the bench
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    # --encode-chunk-size: the plain and the cached step each in a process of its own; many steps
    command = [sys.executable, "-m", "mmviews.cli", "bench", "train", "--recipe", str(recipe), "--case", "quickstart",
               "--device", "cpu", "--steps", "100000", "--warmup", "0", "--encode-chunk-size", "4",
               "--output", str(tmp_path / "b.json")]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 240, []
        while time.monotonic() < deadline and proc.poll() is None:
            seen = descendants(proc.pid)
            # the case process and, below it, its loader worker (after its estimate process ended)
            if any(len(descendants(child)) >= 1 for child in seen) and len(seen) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None and len(seen) >= 2, (seen, proc.poll())
        time.sleep(1.0)
        seen = descendants(proc.pid)
        os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "mmviews bench: interrupted" in err or "mmviews bench train: interrupted" in err, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert not wait_until_gone(seen), f"still running after the bench stopped: {seen}"


def test_a_video_recipe_times_its_own_step_without_a_traceback(tmp_path: Path) -> None:
    from video_clips import make_ucf101

    root = make_ucf101(tmp_path / "ucf", classes=2, train_per_class=2, test_per_class=1, n_frames=5, size=(40, 48))
    command = [sys.executable, "-m", "mmviews.cli", "bench", "train", "--recipe", "ucf101_smoke",
               "--set", f"data.root={root}", "--set", "data.batch_size=2", "--set", "data.num_workers=0",
               "--set", "data.options.num_frames=3", "--set", "data.options.size=32",
               "--device", "cpu", "--steps", "1", "--warmup", "0", "--output", str(tmp_path / "b.json")]
    done = subprocess.run(command, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "the realistic case is left out" in done.stderr and "video" in done.stderr
    import json

    row = json.loads((tmp_path / "b.json").read_text())["cases"][0]
    assert row["case"] == "quickstart" and row["recipe"] == "ucf101_smoke" and row["M"] == 5
    assert row["adapters"] == {"video": "small_cnn", "flow": "flow_cnn", "audio": "audio_cnn"}
    assert row["mixed_precision_asked"] == "auto" and set(row["phase_ms"]) >= {"data", "flow", "forward", "backward"}
