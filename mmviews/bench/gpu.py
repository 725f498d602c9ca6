"""``mmviews bench gpu``: every check that only a GPU can answer, in one command and one JSON.

Three checks, each in processes of its own and stopped at its time budget (together at most
:data:`TOTAL_BUDGET_S`, 8 minutes, on one GPU):

- ``tests``: the test suite's CUDA-marked tests (``pytest -m cuda``; on a machine without CUDA
  they skip with the reason "no CUDA device"): bf16 plain and cached steps against float32,
  the cached step against the plain one, FSDP2 over NCCL (two processes: needs two GPUs, else
  skipped with that reason), compiled against eager with inductor, and a training step free of
  host synchronisations under ``torch.cuda.set_sync_debug_mode``. Needs a source checkout (the
  ``tests/`` folder beside the package); the JSON lists each test with its outcome.
- ``memory``: ``mmviews bench train`` on the quickstart and the finetune shape at small size:
  the ``--check`` estimate of the training step against ``torch.cuda.max_memory_reserved``,
  within :data:`MEMORY_TOLERANCE` (15 %).
- ``step-time``: ``mmviews bench train --compile`` on the base-size case (BERT-base, HuBERT-base,
  CLIP ViT-B/32 of random weights, the finetune recipe's settings): eager and compiled step
  times, the compile time, and the steps after which compiling pays.

The checks reuse ``mmviews bench train`` (its JSON is read back, see :func:`memory_result` and
:func:`step_time_result`) and pytest's JUnit XML (:func:`tests_result`). ``--dry-run`` prints
the plan (each check's command and budget) on any machine; without a CUDA device the command
says so in one line and exits 0. Exit status 1 when a check failed or ran out of time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mmviews.bench.common import verb_main

#: The whole command's time on one GPU, and the share of it each check gets (its process
#: group is killed at its budget: the JSON then says "timed out").
TOTAL_BUDGET_S = 480
#: The estimate of the training step against torch.cuda.max_memory_reserved.
MEMORY_TOLERANCE = 0.15
#: The base-size case at K = 32 samples, the plain step (the finetune shape's own chunk of 2
#: samples would time the chunk loop, not the encoders): what compiling speeds up.
STEP_TIME_SETTINGS = ("data.batch_size=32", "optimisation.encode_chunk_size=null")


def tests_folder() -> Path | None:
    """The ``tests/`` folder of the source checkout this package runs from (None when it is an
    installed copy without one)."""
    folder = Path(__file__).resolve().parents[2] / "tests"
    return folder if (folder / "conftest.py").is_file() else None


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def tests_command(work: Path) -> list[str]:
    folder = tests_folder()
    return _python("-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={work / 'tests.xml'}",
                   str(folder if folder is not None else "tests"))


def memory_command(work: Path) -> list[str]:
    return _python("-m", "mmviews.bench.train", "--case", "quickstart", "finetune-small", "--device", "cuda",
                   "--steps", "5", "--warmup", "2", "--output", str(work / "memory.json"))


def step_time_command(work: Path) -> list[str]:
    settings = [word for item in STEP_TIME_SETTINGS for word in ("--set", item)]
    return _python("-m", "mmviews.bench.train", "--case", "base-sizes", "--compile", "--device", "cuda",
                   "--steps", "10", "--warmup", "3", *settings, "--output", str(work / "step_time.json"))


def tests_result(junit_xml: str) -> dict[str, Any]:
    """The outcome of each test of pytest's JUnit XML report (``passed``, ``failed``, ``error``
    or ``skipped``, with pytest's message), and their counts. ``status``: failed when one failed
    or errored, passed when the others passed or skipped, skipped when none ran."""
    root = ET.fromstring(junit_xml)
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = found.get("message") or (found.text or "").strip()[:500]
                break
        tests.append({"test": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0.0)), "message": message})
    counts = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failed", "error", "skipped")}
    if counts["failed"] or counts["error"]:
        status = "failed"
    else:
        status = "passed" if counts["passed"] else "skipped"
    return {"status": status, **counts, "tests": tests}


def memory_result(bench: dict[str, Any], tolerance: float = MEMORY_TOLERANCE) -> dict[str, Any]:
    """Each case of a ``mmviews bench train`` report that has a ``--check`` estimate: the
    estimated training step against the measured ``torch.cuda.max_memory_reserved`` (MiB), and
    whether they agree within ``tolerance``."""
    rows = []
    for case in bench["cases"]:
        if case.get("estimated_memory_mb") is None or case.get("peak_reserved_mb") is None:
            continue
        estimated, reserved = case["estimated_memory_mb"], case["peak_reserved_mb"]
        error = estimated / reserved - 1
        rows.append({"case": case["case"], "step": case.get("step"), "K": case["K"], "M": case["M"],
                     "mixed_precision": case.get("mixed_precision"), "estimated_mib": estimated,
                     "max_memory_reserved_mib": reserved, "max_memory_allocated_mib": case.get("peak_memory_mb"),
                     "error": error, "within_tolerance": abs(error) <= tolerance})
    if not rows:
        return {"status": "failed", "reason": "no case with an estimate and a CUDA peak in the bench's report",
                "tolerance": tolerance, "cases": []}
    return {"status": "passed" if all(r["within_tolerance"] for r in rows) else "failed", "tolerance": tolerance,
            "cases": rows}


def step_time_result(bench: dict[str, Any]) -> dict[str, Any]:
    """The eager and compiled step times of a ``mmviews bench train --compile`` report, the
    compile time and the steps after which compiling pays (None: never, the compiled steps are
    not faster)."""
    if not bench.get("comparisons"):
        return {"status": "failed", "reason": "the bench's report holds no eager/compiled comparison"}
    c = bench["comparisons"][0]
    compiled = next((row for row in bench["cases"] if row.get("compiled")), {})
    return {"status": "measured", "case": c["case"], "K": c["K"], "step": compiled.get("step"),
            "mixed_precision": compiled.get("mixed_precision"), "eager_step_ms": c["eager_step_ms"],
            "compiled_step_ms": c["compiled_step_ms"], "speedup": c["eager_step_ms"] / c["compiled_step_ms"],
            "compile_s": c["compile_s"], "break_even_steps": c["break_even_steps"]}


def _read_json_file(name: str, parse: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    def read(work: Path) -> dict[str, Any]:
        path = work / name
        if not path.is_file():
            return {"status": "failed", "reason": f"the check wrote no {name}"}
        return parse(json.loads(path.read_text()))

    return read


def _read_tests(work: Path) -> dict[str, Any]:
    if tests_folder() is None:
        return {"status": "skipped", "reason": "no tests/ folder beside the mmviews package: run from a source checkout"}
    path = work / "tests.xml"
    if not path.is_file():
        return {"status": "failed", "reason": "pytest wrote no JUnit report"}
    return tests_result(path.read_text())


@dataclass(frozen=True)
class Check:
    """One check: what it answers, its time budget, its command (given a scratch folder) and
    how its output is read back into the JSON (given the same folder)."""

    what: str
    budget_s: int
    command: Callable[[Path], list[str]]
    read: Callable[[Path], dict[str, Any]]


CHECKS: dict[str, Check] = {
    "tests": Check("CUDA-marked tests: bf16 vs float32 (plain and cached), cached = plain, FSDP2 on NCCL, "
                   "compiled = eager with inductor, no host synchronisation per step", 210, tests_command, _read_tests),
    "memory": Check(f"--check estimate vs torch.cuda.max_memory_reserved (within {MEMORY_TOLERANCE:.0%}): quickstart "
                    "and finetune-small", 90, memory_command, _read_json_file("memory.json", memory_result)),
    "step-time": Check("base-size case (BERT-base, HuBERT-base, ViT-B/32; finetune settings, K = 32): eager vs compiled "
                       "step time", 180, step_time_command, _read_json_file("step_time.json", step_time_result)),
}


def plan_lines(names: list[str], work: Path) -> list[str]:
    """What the command would run: each check, its budget and its command line."""
    total = sum(CHECKS[n].budget_s for n in names)
    lines = [f"mmviews bench gpu: {len(names)} check(s), at most {total} s on one GPU"]
    for number, name in enumerate(names, 1):
        check = CHECKS[name]
        lines += [f"[{number}] {name} (at most {check.budget_s} s): {check.what}",
                  "    " + " ".join(check.command(work))]
    return lines


def _kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid``, those in sessions of their own too (a test's
    subprocesses, a launcher's ranks), which a kill of ``pid``'s process group does not reach."""
    import psutil  # (a dependency of accelerate)

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _run_within(command: list[str], budget_s: float, log: Path) -> tuple[int | None, float]:
    """``command`` in a session of its own, output to ``log``; at ``budget_s`` every process
    below it (:func:`_kill_descendants`) and its whole process group are killed. Returns its exit
    status (None: timed out) and its seconds."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status: int | None = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            status = None
            _kill_descendants(proc.pid)  # while it still runs, its descendants are found through it
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a timed-out check, or a process it left behind
            except ProcessLookupError:
                pass
            proc.wait()
    return status, time.monotonic() - start


def run_check(name: str, work: Path) -> dict[str, Any]:
    """Run one check within its budget; its result (:class:`Check`'s ``read``) with its
    command, seconds, exit status and, unless it passed, the tail of its output."""
    check = CHECKS[name]
    command = check.command(work)
    log = work / f"{name}.log"
    status, seconds = _run_within(command, check.budget_s, log)
    if status is None:
        result: dict[str, Any] = {"status": "timed out", "reason": f"stopped at its budget of {check.budget_s} s"}
    else:
        result = check.read(work)
        if status != 0 and result["status"] not in ("failed", "skipped"):
            result = {**result, "status": "failed", "reason": f"exit status {status}"}
    result.update(command=" ".join(command), seconds=round(seconds, 1), exit_status=status, budget_s=check.budget_s)
    if result["status"] not in ("passed", "measured"):
        result["output_tail"] = log.read_text(errors="replace")[-3000:]
    return result


def report(checks: dict[str, dict[str, Any]], environment: dict[str, Any], command: str) -> dict[str, Any]:
    """The JSON of a run: the environment, each check's result and, in ``summary``, the checks
    by status (``passed`` and ``measured`` are good; ``failed`` and ``timed out`` are not)."""
    summary: dict[str, list[str]] = {}
    for name, result in checks.items():
        summary.setdefault(result["status"], []).append(name)
    ok = not any(status in summary for status in ("failed", "timed out"))
    return {"command": command, "environment": environment, "ok": ok, "summary": summary, "checks": checks}


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, check in result["checks"].items():
        detail = ""
        if name == "tests" and "tests" in check:
            detail = f": {check['passed']} passed, {check['failed'] + check['error']} failed, {check['skipped']} skipped"
            detail += "".join(f"\n    skipped {t['test']}: {t['message']}" for t in check["tests"]
                              if t["outcome"] == "skipped")
            detail += "".join(f"\n    FAILED {t['test']}" for t in check["tests"] if t["outcome"] in ("failed", "error"))
        elif name == "memory" and check.get("cases"):
            detail = "".join(f"\n    {r['case']} {r['step']} K = {r['K']}: estimated {r['estimated_mib']:.0f} MiB, "
                             f"max_memory_reserved {r['max_memory_reserved_mib']:.0f} MiB ({100 * r['error']:+.1f} %)"
                             for r in check["cases"])
        elif name == "step-time" and "eager_step_ms" in check:
            pays = ("never" if check["break_even_steps"] is None else f"after {check['break_even_steps']:.0f} steps")
            detail = (f": eager {check['eager_step_ms']:.1f} ms, compiled {check['compiled_step_ms']:.1f} ms "
                      f"({check['speedup']:.2f}x), compile {check['compile_s']:.0f} s, pays {pays}")
        reason = f" ({check['reason']})" if check.get("reason") else ""
        lines.append(f"{name}: {check['status']} in {check['seconds']:.0f} s{reason}{detail}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), default=None, metavar="CHECK",
                        help=f"run only these checks ({', '.join(CHECKS)}; default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (checks, budgets, commands); run nothing")
    parser.add_argument("--output", "--out", dest="out", type=Path, default=Path("bench-gpu.json"),
                        help="JSON output path (default bench-gpu.json)")


def run(args: argparse.Namespace) -> int:
    import torch

    names = [name for name in CHECKS if args.only is None or name in args.only]
    if args.dry_run:
        print("\n".join(plan_lines(names, Path("<scratch>"))))
        return 0
    if not torch.cuda.is_available():
        print(f"mmviews bench gpu: no CUDA device (torch {torch.__version__}); nothing to check")
        return 0
    command = " ".join(["mmviews", "bench", "gpu", *(["--only", *names] if args.only else [])])
    return run_checks(names, args.out, command)


def run_checks(names: list[str], out: Path, command: str) -> int:
    """Run the checks ``names`` one after the other (their files in a scratch folder removed
    after), print a line per check as it starts and one with its result, and write the JSON to
    ``out``. Exit status 0 when none failed or ran out of time, else 1."""
    from mmviews.bench.report import environment, write_report

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-gpu-") as tmp:
        for number, name in enumerate(names, 1):
            print(f"[{number}/{len(names)}] {name}: {CHECKS[name].what} (at most {CHECKS[name].budget_s} s)", flush=True)
            results[name] = run_check(name, Path(tmp))
    result = report(results, environment(details=True), command)
    write_report(result, "\n".join(summary_lines(result)), out)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m mmviews.bench.gpu [options]``."""
    return verb_main("gpu", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
