"""`mmviews eval RUN` reproduces the run's own report (issue 29, item 1): it evaluates with the
run's recorded precision (bf16 autocast here, on CPU), seed, fusion and views, so that with the
run's tasks it prints report.md's numbers to the printed digits; and it writes a new folder
(`RUN/eval-N`, named in its output), never the run's final evaluation that report.md links to."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from test_train_utils import run_train, tiny_config, write_recipe

from mmviews.cli import main

TASKS = ["linear:class", "knn:class", "retrieval", "diagnostics"]
_ROW = re.compile(r"^\| (\S+) \| ([^|]*) \|")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny finished run trained and evaluated under bf16 autocast on CPU, with seed 3 (a
    seed other than the eval command's old default 0)."""
    tmp = tmp_path_factory.mktemp("bf16")
    raw = tiny_config(num_samples=64, epochs=2, tasks=TASKS)
    raw["seed"] = 3
    raw["cpu"] = True
    raw["optimisation"]["mixed_precision"] = "bf16"
    raw["output"]["checkpoint_every"] = 0
    recipe = write_recipe(tmp / "bf16.yaml", raw)
    run = tmp / "run"
    r = run_train(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def table(path: Path) -> dict[str, str]:
    """First value column of a Markdown metric table (report.md: trained; summary.md: value)."""
    rows = {}
    for line in path.read_text().splitlines():
        found = _ROW.match(line)
        if found and found.group(1) not in ("metric", "---"):
            rows[found.group(1)] = found.group(2).strip()
    return rows


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def check_eval_reproduces_report(run: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """The guard's check: ``mmviews eval RUN`` (no options) gives every number of report.md."""
    before = folder_digest(run / "eval")
    report = table(run / "report.md")
    assert report and {"test/linear/class/acc", "test/knn/class/top1", "test/diag/unif"} <= set(report), report
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    written = re.search(r"report written to (\S+)", out)
    assert written is not None, out
    new = Path(written.group(1))
    assert new.parent == run and new.name.startswith("eval-"), new
    again = table(new / "summary.md")
    assert {k: again.get(k) for k in report} == report
    assert folder_digest(run / "eval") == before  # the final evaluation report.md links to is untouched
    return new


def test_eval_reproduces_the_report_of_a_bf16_run_in_a_new_folder(bf16_run: Path, capsys):
    first = check_eval_reproduces_report(bf16_run, capsys)
    assert first.name == "eval-1"
    meta = json.loads((first / "metrics.json").read_text())["meta"]
    assert (meta["precision"], meta["seed"]) == ("bf16", 3)  # the run's, recorded beside the numbers
    # a second evaluation takes the next free folder; the first stays as it was
    kept = folder_digest(first)
    assert main(["eval", str(bf16_run), "--tasks", "knn:class"]) == 0
    assert (bf16_run / "eval-2" / "summary.md").is_file() and folder_digest(first) == kept


@pytest.mark.parametrize("name", ["eval", "eval_random", "eval_epoch_1"])
def test_eval_refuses_the_runs_own_evaluation_folders(bf16_run: Path, capsys, name: str):
    before = folder_digest(bf16_run)
    assert main(["eval", str(bf16_run), "--out", str(bf16_run / name)]) == 2  # the old spelling still works
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bf16_run / name} is the run's own evaluation" in err, err
    assert folder_digest(bf16_run) == before


def test_eval_reproduction_check_fails_when_eval_runs_in_float32(bf16_run: Path, capsys, monkeypatch, tmp_path):
    """Mutation test: with the encoder's forward in float32 (the old behaviour), the check fails."""
    from mutations import apply_break

    apply_break("eval_in_float32", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        check_eval_reproduces_report(bf16_run, capsys)
