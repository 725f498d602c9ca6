"""The measuring pieces every ``mmviews bench`` verb shares (:mod:`mmviews.bench.common`,
:mod:`mmviews.bench.report`): round-robin timing, the one-call timer, the median they report,
the report writer and the verbs' entry points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmviews.bench import common
from mmviews.bench.report import write_report
from mutations import apply_break


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
