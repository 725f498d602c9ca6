"""`tests/mutation/run.py`, the per-module mutation runner: its table of guarding tests stays in
step with the repository, and its score counts what it says. mutmut itself is not run here (the
`mutation` extra, minutes per module); nothing below needs it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "mutation" / "run.py"


def load_runner():
    spec = importlib.util.spec_from_file_location("mutation_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


runner = load_runner()


def test_every_row_names_an_existing_module_and_existing_test_files() -> None:
    rows = tomllib.loads((REPO / "tests" / "mutation" / "modules.toml").read_text())["modules"]
    assert rows, "modules.toml lists no module"
    for module, row in rows.items():
        assert (REPO / module).is_file(), f"modules.toml: {module} does not exist"
        tests, _ = runner.tests_for(module, rows)
        assert tests and all((REPO / test).is_file() for test in tests), module


def test_a_module_without_a_row_falls_back_to_the_test_files_named_after_it() -> None:
    tests, equivalent = runner.tests_for("mmviews/eval/metrics.py", {})
    assert tests == ["tests/test_eval_metrics.py"] and equivalent == {}
    with pytest.raises(SystemExit, match="mmviews/demo.py: no test files named after it"):
        runner.tests_for("mmviews/demo.py", {})


def test_score_leaves_out_equivalent_and_unchecked_mutants() -> None:
    statuses = {
        "m.x_f__mutmut_1": "killed",
        "m.x_f__mutmut_2": "timeout",
        "m.x_f__mutmut_3": "survived",
        "m.x_f__mutmut_4": "survived",  # listed as equivalent below
        "m.x_f__mutmut_5": "no tests",
        "m.x_f__mutmut_6": "not checked",
    }
    score = runner.ModuleScore("m.py", ["tests/test_m.py"], statuses, {"m.x_f__mutmut_4": "same output"})
    assert (score.detected, score.counted, score.unchecked) == (2, 4, 1)
    assert score.score == pytest.approx(50.0)
    assert score.undetected() == ["m.x_f__mutmut_3", "m.x_f__mutmut_5"]
    row = runner.table([score]).splitlines()[-1]
    assert row.startswith("| `m.py` | 6 | 4 | 2 | 1 | 1 | 1 | 50.0 % |"), row


def test_list_names_the_modules_and_their_tests_without_running() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "mmviews/eval/health.py", "mmviews/eval/metrics.py"],
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.splitlines() == [
        "mmviews/eval/health.py: tests/test_eval_health.py tests/test_eval_chance.py",
        "mmviews/eval/metrics.py: tests/test_eval_metrics.py",
    ]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--list", "setup.py"], capture_output=True, text=True)
    assert bad.returncode != 0 and "setup.py: not a module of the mmviews package" in bad.stderr


def test_rerun_survivors_takes_every_undetected_mutant_of_the_last_run(tmp_path, monkeypatch) -> None:
    stats = pytest.importorskip("mutmut.stats", reason="the `mutation` extra installs mutmut")
    code_of = {status: code for code, status in stats.status_by_exit_code.items()}
    module = "mmviews/m.py"
    meta = tmp_path / module.replace("/", "__") / "mutants" / (module + ".meta")
    meta.parent.mkdir(parents=True)
    exit_codes = {"k": code_of["killed"], "s": code_of["survived"], "n": code_of["no tests"], "u": None,
                  "t": code_of["timeout"]}
    meta.write_text(json.dumps({"exit_code_by_key": exit_codes}))
    monkeypatch.setattr(runner, "WORK_ROOT", tmp_path)
    assert runner.undetected_in_last_run(module) == ["n", "s", "u"]
    assert runner.undetected_in_last_run(module, {"s": "no behaviour change"}) == ["n", "u"]
    with pytest.raises(SystemExit, match="no earlier run"):
        runner.undetected_in_last_run("mmviews/other.py")


def test_mutmuts_environment_drops_checkouts_of_the_package_from_pythonpath(monkeypatch, tmp_path) -> None:
    """A PYTHONPATH entry holding ``mmviews/`` (this checkout, another worktree) would import the
    unmutated package; other entries (a folder of mutmut's own dependencies) stay."""
    import os

    other = tmp_path / "site"
    other.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(other), ""]))
    env = runner.mutmut_env()
    assert env["PYTHONPATH"] == str(other)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    assert "PYTHONPATH" not in runner.mutmut_env()


# Saves mutmut's results file over and over as mutmut does after each mutant, with the saves made
# the way tests/mutation/run.py's mutmut command makes them; prints once the first one is whole.
SAVE_FOREVER = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("mutmut_safe", sys.argv[1])
safe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(safe)
safe.make_saves_atomic()
from mutmut.mutation.data import SourceFileMutationData
data = SourceFileMutationData(path="mmviews/m.py")
Path(data.meta_path).parent.mkdir(parents=True)
data.exit_code_by_key = {f"mmviews.m.x_f__mutmut_{i}": 1 for i in range(int(sys.argv[2]))}
data.durations_by_key = {name: 0.5 for name in data.exit_code_by_key}
data.save()
print("saved", flush=True)
while True:
    data.save()
"""


def test_a_time_limit_stop_leaves_the_results_file_whole(tmp_path) -> None:
    """The time limit's stop (SIGINT, then SIGKILL) lands while mutmut rewrites its results file:
    each rewrite here takes most of a second, so the stop falls inside one. mutmut's own writer
    leaves a cut file there (every result of the module lost); run.py's must leave it whole."""
    pytest.importorskip("mutmut", reason="the `mutation` extra installs mutmut")
    import time

    assert runner.mutmut_command() == [sys.executable, str(runner.MUTMUT)]
    mutants = 60_000
    process = subprocess.Popen(
        [sys.executable, "-c", SAVE_FOREVER, str(runner.MUTMUT), str(mutants)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        assert process.stdout.readline() == "saved\n"
        time.sleep(0.3)
    finally:
        runner.stop_mutmut(process, grace=20)
    results = runner.read_results(tmp_path, "mmviews/m.py")
    assert len(results) == mutants and set(results.values()) == {1}
    assert not list((tmp_path / "mutants" / "mmviews").glob("*.partial"))  # SIGINT waited for the write


def test_an_unreadable_results_file_stops_with_its_name_and_the_mutants_lost(tmp_path, monkeypatch, capsys) -> None:
    """A results file cut by an older run's stop: --report-only, --rerun-survivors and a run say
    which file and how many mutants' results are gone, and how to start afresh; no traceback."""
    module = "mmviews/eval/metrics.py"
    work = tmp_path / module.replace("/", "__")
    meta = runner.meta_path(work, module)
    meta.parent.mkdir(parents=True)
    whole = json.dumps({"exit_code_by_key": {f"mmviews.eval.metrics.x_f__mutmut_{i}": 1 for i in (1, 2, 3)}}, indent=4)
    meta.write_text(whole[: len(whole) // 2])
    spans = {"x_f__mutmut_orig": [1, 2], "x_f__mutmut_1": [3, 4], "x_f__mutmut_2": [5, 6], "x_f__mutmut_3": [7, 8]}
    meta.with_suffix(".spans").write_text(json.dumps({"version": 1, "spans": spans}))
    monkeypatch.setattr(runner, "WORK_ROOT", tmp_path)
    for call in (lambda: runner.main(["--report-only", module]), lambda: runner.undetected_in_last_run(module)):
        with pytest.raises(SystemExit) as stop:
            call()
        message = str(stop.value.code)
        assert f"{meta}: unreadable (JSONDecodeError" in message, message
        assert f"the results of all 3 mutants of {module} are lost" in message and f"rm '{meta}'" in message
    meta.with_suffix(".spans").unlink()
    with pytest.raises(SystemExit, match="the results of every mutant of"):
        runner.read_results(work, module)
    meta.write_text(whole)
    assert runner.read_results(work, module) == json.loads(whole)["exit_code_by_key"]
