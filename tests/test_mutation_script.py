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
