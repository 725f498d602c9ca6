"""The measuring pieces every ``mmviews bench`` verb shares (:mod:`mmviews.bench.common`,
:mod:`mmviews.bench.report`): round-robin timing, the one-call timer, the median they report,
the report writer and the verbs' entry points."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mmviews.bench import common
from mmviews.bench.report import write_report
from mutations import apply_break
from test_train_utils import process_alive, wait_until_gone


class FakeClock:
    """A clock that moves only when the code under test says so (no wall time in the checks)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check_round_robin() -> None:
    """Contenders run in turn, round after round; warm-up rounds are not counted; ``before``
    runs ahead of the clock and ``after`` once the call is timed."""
    clock, log = FakeClock(), []
    warm_cost, cost = 100.0, {"a": 1.0, "b": 2.0, "c": 3.0}
    calls_made = {key: 0 for key in cost}

    def call_of(key: str):
        def call() -> None:
            log.append(f"call:{key}")
            clock.now += warm_cost if calls_made[key] < 2 else cost[key]  # the first two calls are the warm-up
            calls_made[key] += 1
        return call

    times = common.round_robin({key: call_of(key) for key in cost}, repeats=3, warmup=2,
                               sync=lambda: log.append("sync"), clock=clock, before=lambda key: log.append(f"before:{key}"),
                               after=lambda key: log.append(f"after:{key}"))
    assert times == {key: [value] * 3 for key, value in cost.items()}
    one_round = [event for key in cost for event in (f"before:{key}", "sync", f"call:{key}", "sync", f"after:{key}")]
    assert log == one_round * 5


def test_round_robin_interleaves_contenders_and_drops_the_warm_up() -> None:
    check_round_robin()


def test_round_robin_check_fails_when_contenders_are_timed_one_after_another(monkeypatch: pytest.MonkeyPatch) -> None:
    apply_break("bench_time_contenders_in_blocks", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        check_round_robin()


def test_timed_stops_the_clock_after_the_device_is_synchronised() -> None:
    clock = FakeClock()

    def work() -> str:
        clock.now += 1.0
        return "done"

    def sync() -> None:  # the queued kernels finish only here
        clock.now += 5.0

    assert common.timed(work, sync, clock) == ("done", 6.0)
    assert common.seconds_of(work, sync, clock) == 6.0


def test_middle_is_a_measured_sample() -> None:
    assert common.middle([3.0, 1.0, 2.0]) == 2.0
    assert common.middle([4.0, 1.0, 3.0, 2.0]) == 3.0  # the upper of the two middle samples, as the reports always had
    assert common.middle([7.0]) == 7.0


def test_write_report_prints_then_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = {"rows": [{"case": "x", "seconds": 0.5}]}
    write_report(result, "the table", tmp_path / "a.json")
    write_report(result, None, str(tmp_path / "b.json"))  # rows already printed as they came
    assert capsys.readouterr().out == f"the table\nwrote {tmp_path / 'a.json'}\n\nwrote {tmp_path / 'b.json'}\n"
    for name in ("a.json", "b.json"):
        assert json.loads((tmp_path / name).read_text()) == result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]  # no temporary file left


@pytest.mark.parametrize("verb", ["objectives", "scale", "adapters", "dropout", "train"])
def test_each_verb_main_parses_its_own_options(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    module = importlib.import_module(f"mmviews.bench.{verb}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: mmviews bench {verb} ")


# --- stopping a bench's subprocesses (in this process, so that each call is seen here) --------

# A child that starts a grandchild (in the child's process group, as a loader worker is) and writes both pids.
TREE = ("import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "open(sys.argv[1], 'w').write(f'{__import__(\"os\").getpid()} {g.pid}')\n"
        "time.sleep(300)\n")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signals_raise_keyboard_interrupt_in_the_block_and_the_old_handlers_come_back(signum: int) -> None:
    old_int, old_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts
    try:
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signum)}"):
            with common.StopOnSignals():
                os.kill(os.getpid(), signum)
                time.sleep(5)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is old_term
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def test_stop_signals_do_nothing_outside_the_main_thread() -> None:
    before = signal.getsignal(signal.SIGTERM)
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with common.StopOnSignals():
                pass
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert not errors and signal.getsignal(signal.SIGTERM) is before


def _pretend_to_lead_a_session(monkeypatch: pytest.MonkeyPatch, leader: bool) -> None:
    """This process's own session id (``os.getsid(0)``) as a leader's (its pid) or another's."""
    real = os.getsid
    me = os.getpid()
    monkeypatch.setattr(common.os, "getsid", lambda pid: (me if leader else -1) if pid == 0 else real(pid))


@pytest.mark.parametrize("leader", [False, True])
def test_run_stoppable_gives_a_session_only_below_a_process_that_leads_none(monkeypatch: pytest.MonkeyPatch,
                                                                              leader: bool) -> None:
    """Below a session leader (a bench case) the subprocess stays in the leader's group."""
    _pretend_to_lead_a_session(monkeypatch, leader)
    probe = "import os, sys; print(os.getsid(0) == os.getpid(), os.getpgid(0)); print('probe', file=sys.stderr)"
    done = common.run_stoppable([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    own_session, group = done.stdout.split()
    assert done.returncode == 0 and done.args[0] == sys.executable and done.stderr == "probe\n"
    assert own_session == str(not leader)
    assert (int(group) == os.getpgid(0)) is leader


@pytest.mark.parametrize("leader", [False, True])
def test_an_interrupted_run_stoppable_stops_its_subprocess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           leader: bool) -> None:
    """Interrupted while it waits, it stops the subprocess: its whole group when the subprocess
    has a session of its own; the subprocess alone when it shares this process's group (whoever
    stops that group stops the rest)."""
    me = os.getpid()
    _pretend_to_lead_a_session(monkeypatch, leader)
    pids = tmp_path / "pids"
    timer = None

    def interrupt_when_started() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pids.is_file() and pids.read_text()):
            time.sleep(0.05)
        os.kill(me, signal.SIGTERM)

    old_term = signal.getsignal(signal.SIGTERM)
    try:
        timer = threading.Thread(target=interrupt_when_started, daemon=True)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            with common.StopOnSignals():
                common.run_stoppable([sys.executable, "-c", TREE, str(pids)])
        child, grandchild = map(int, pids.read_text().split())
        assert not wait_until_gone([child])
        if leader:  # the grandchild is in this process's group: left to whoever stops it
            assert process_alive(grandchild)
        else:
            assert not wait_until_gone([grandchild])
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if pids.is_file() and pids.read_text():
            for pid in map(int, pids.read_text().split()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.mark.parametrize("own_group", [True, False])
def test_a_subprocess_deaf_to_sigterm_is_killed_after_the_grace(own_group: bool) -> None:
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True,
                            start_new_session=own_group)
    try:
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        common.stop_process_group(proc, grace_s=0.5, own_group=own_group)
        assert proc.returncode == -signal.SIGKILL and time.monotonic() - started >= 0.5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("own_group", [True, False])
def test_a_subprocess_that_stops_on_sigterm_is_not_killed(own_group: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(300)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=own_group)
    try:
        assert proc.stdout.readline().strip() == "ready"
        common.stop_process_group(proc, grace_s=30, own_group=own_group)
        assert proc.returncode == -signal.SIGTERM
        common.stop_process_group(proc, grace_s=30, own_group=own_group)  # gone already: returns at once
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stopping_a_subprocess_stops_its_whole_group_by_default(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", TREE, str(pids)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pids.is_file() and pids.read_text()):
            time.sleep(0.05)
        child, grandchild = map(int, pids.read_text().split())
        common.stop_process_group(proc, grace_s=30)
        assert proc.returncode == -signal.SIGTERM and not wait_until_gone([grandchild])
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_subprocess_reaped_elsewhere_still_gets_its_exit_status() -> None:
    """Its group is gone (no signal can be sent), and the Popen still ends with a return code."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    os.waitpid(proc.pid, 0)  # reaped behind the Popen's back, as a SIGCHLD handler would
    common.stop_process_group(proc, grace_s=1)
    assert proc.returncode is not None
