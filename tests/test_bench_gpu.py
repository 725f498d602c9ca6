"""``mmviews bench gpu`` on a machine without a GPU: its plan (``--dry-run``, ``--only``, the
8-minute budget), the one line it prints without a CUDA device, the reading of each check's
output (pytest's JUnit XML from a real pytest run, the ``bench train`` rows), each check run
within its budget in a process of its own, and the JSON it writes from its checks' results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_utils import REPO, env

from mmviews.bench import gpu
from mmviews.bench import train_report
from mmviews.bench.cli import VERBS
from mmviews.cli import main


def _gpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmviews.cli", "bench", "gpu", *args], capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=120)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["bench", "gpu", "--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_the_plan_names_every_check_its_command_and_fits_eight_minutes(capsys: pytest.CaptureFixture[str]) -> None:
    assert VERBS["gpu"][0] == "mmviews.bench.gpu"
    assert sum(check.budget_s for check in gpu.CHECKS.values()) <= gpu.TOTAL_BUDGET_S <= 8 * 60
    plan = _plan(capsys)
    lines = plan.splitlines()
    assert lines[0] == f"mmviews bench gpu: 3 check(s), at most {gpu.TOTAL_BUDGET_S} s on one GPU"
    assert [line.split()[1] for line in lines if line.startswith("[")] == ["tests", "memory", "step-time"]
    assert "-m pytest -m cuda" in plan and f"{REPO / 'tests'}" in plan
    assert "mmviews.bench.train --case quickstart finetune-small --device cuda" in plan
    assert "--case base-sizes --compile --device cuda" in plan
    only = _plan(capsys, "--only", "memory")
    assert only.splitlines()[0] == "mmviews bench gpu: 1 check(s), at most 90 s on one GPU"
    assert "[1] memory" in only and "pytest" not in only and "base-sizes" not in only
    with pytest.raises(SystemExit) as refused:  # a check it does not have
        main(["bench", "gpu", "--only", "gpus"])
    assert refused.value.code == 2 and "invalid choice: 'gpus'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    done = _gpu("--output", str(tmp_path / "gpu.json"))
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"mmviews bench gpu: no CUDA device (torch {torch.__version__}); nothing to check\n"
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_tests_skip_on_cpu_for_want_of_a_device_only(tmp_path: Path) -> None:
    """What the ``tests`` check runs, on this machine: every CUDA test is collected (none lost to an
    import error) and skips with the reason "no CUDA device", not for a feature it lacks."""
    xml = tmp_path / "cuda.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    str(REPO / "tests" / "test_train_cuda.py")], capture_output=True, env=env(), cwd=REPO, timeout=300)
    result = gpu.tests_result(xml.read_text())
    assert result["status"] == "skipped" and result["skipped"] == len(result["tests"]) >= 5
    assert {t["message"] for t in result["tests"]} == {"no CUDA device"}


def test_junit_report_of_a_real_pytest_run_is_read_test_by_test(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_wrong():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no CUDA device')\ndef test_gpu():\n    pass\n")
    xml = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                    str(tmp_path / "test_sample.py")], capture_output=True, cwd=tmp_path, timeout=120)
    result = gpu.tests_result(xml.read_text())
    assert (result["status"], result["passed"], result["failed"], result["skipped"]) == ("failed", 1, 1, 1)
    by_name = {t["test"].split("::")[-1]: t for t in result["tests"]}
    assert by_name["test_ok"]["outcome"] == "passed" and by_name["test_ok"]["message"] is None
    assert by_name["test_wrong"]["outcome"] == "failed" and "one is not two" in by_name["test_wrong"]["message"]
    assert by_name["test_gpu"]["outcome"] == "skipped" and by_name["test_gpu"]["message"] == "no CUDA device"
    skipped_only = '<testsuites><testsuite><testcase classname="t" name="a"><skipped message="no CUDA device"/>' \
                   "</testcase></testsuite></testsuites>"
    assert gpu.tests_result(skipped_only)["status"] == "skipped"


def _bench_row(case: str, estimated: float, reserved: float) -> dict:
    return {"case": case, "step": "plain", "K": 128, "M": 4, "mixed_precision": "no", "estimated_memory_mb": estimated,
            "peak_reserved_mb": reserved, "peak_memory_mb": reserved * 0.8}


def test_memory_estimate_is_judged_against_max_memory_reserved() -> None:
    within = gpu.memory_result({"cases": [_bench_row("quickstart", 1000.0, 1150.0)]})
    (row,) = within["cases"]
    assert within["status"] == "passed" and row["error"] == pytest.approx(1000 / 1150 - 1)
    assert row["max_memory_reserved_mib"] == 1150.0 and row["max_memory_allocated_mib"] == 920.0
    beyond = gpu.memory_result({"cases": [_bench_row("quickstart", 1000.0, 1150.0),
                                          _bench_row("finetune-small", 1000.0, 1200.0)]})  # -16.7 %
    assert beyond["status"] == "failed" and [r["within_tolerance"] for r in beyond["cases"]] == [True, False]
    assert gpu.memory_result({"cases": [_bench_row("quickstart", 1160.0, 1000.0)]})["status"] == "failed"  # +16 %
    # a CPU row (no CUDA peak) or a case without an estimate is no evidence
    cpu_row = {**_bench_row("quickstart", 1000.0, 1000.0), "peak_reserved_mb": None}
    assert gpu.memory_result({"cases": [cpu_row]})["status"] == "failed"


def test_step_time_is_read_from_the_bench_comparison() -> None:
    row = {"case": "base-sizes", "K": 32, "peak_memory_mb": 9000.0, "samples_per_s": 100.0, "mixed_precision": "bf16"}
    eager = {**row, "step": "plain", "compiled": False, "warmup_s": [5.0, 1.0, 1.0], "step_ms": 300.0}
    compiled = {**row, "step": "plain+compiled", "compiled": True, "warmup_s": [65.0, 1.0, 1.0], "step_ms": 200.0}
    report = {"cases": [eager, compiled], "comparisons": [train_report.compare(compiled, eager)]}
    result = gpu.step_time_result(report)
    assert (result["status"], result["case"], result["step"], result["K"]) == ("measured", "base-sizes",
                                                                             "plain+compiled", 32)
    assert (result["eager_step_ms"], result["compiled_step_ms"]) == (300.0, 200.0)
    assert result["speedup"] == pytest.approx(1.5) and result["compile_s"] == pytest.approx(60.0)
    assert result["break_even_steps"] == pytest.approx(600.0)
    assert gpu.step_time_result({"cases": [eager], "comparisons": []})["status"] == "failed"


def _writes_json(body: str) -> gpu.Check:
    code = f"import json, pathlib, sys; pathlib.Path(sys.argv[1], 'out.json').write_text(json.dumps({body}))"
    return gpu.Check("a fake check", 60, lambda work: [sys.executable, "-c", code, str(work)],
                     gpu._read_json_file("out.json", lambda data: {"status": data["status"], "value": data["value"]}))


def test_each_check_runs_in_its_own_process_within_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = gpu.Check("sleeps past its budget", 1, lambda work: [sys.executable, "-c", "import time; time.sleep(60)"],
                        lambda work: {"status": "passed"})
    monkeypatch.setattr(gpu, "CHECKS", {"good": _writes_json("{'status': 'passed', 'value': 3}"), "slow": sleeper,
                                        "bad": _writes_json("{'status': 'failed', 'value': 4}")})
    good = gpu.run_check("good", tmp_path)
    assert (good["status"], good["value"], good["exit_status"], good["budget_s"]) == ("passed", 3, 0, 60)
    assert "output_tail" not in good and good["command"].startswith(sys.executable)
    slow = gpu.run_check("slow", tmp_path)
    assert slow["status"] == "timed out" and slow["exit_status"] is None and slow["seconds"] < 30
    assert gpu.run_check("bad", tmp_path)["status"] == "failed"


def test_the_json_holds_each_check_and_a_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu, "CHECKS", {"one": _writes_json("{'status': 'passed', 'value': 1}"),
                                        "two": _writes_json("{'status': 'measured', 'value': 2}")})
    out = tmp_path / "gpu.json"
    assert gpu.run_checks(["one", "two"], out, "mmviews bench gpu") == 0
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["summary"] == {"passed": ["one"], "measured": ["two"]}
    assert [result["checks"][n]["value"] for n in ("one", "two")] == [1, 2]
    assert {"torch", "platform"} <= set(result["environment"]) and result["command"] == "mmviews bench gpu"
    printed = capsys.readouterr().out
    assert "[1/2] one: a fake check" in printed and "one: passed in" in printed and f"wrote {out}" in printed
    failed = gpu.report({"one": {"status": "passed", "seconds": 1.0}, "two": {"status": "timed out", "seconds": 9.0}},
                        {}, "mmviews bench gpu")
    assert failed["ok"] is False and failed["summary"] == {"passed": ["one"], "timed out": ["two"]}
    monkeypatch.setattr(gpu, "CHECKS", {"bad": _writes_json("{'status': 'failed', 'value': 0}")})
    assert gpu.run_checks(["bad"], out, "mmviews bench gpu --only bad") == 1
    assert json.loads(out.read_text())["summary"] == {"failed": ["bad"]}
