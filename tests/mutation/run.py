"""Mutation testing, one module at a time, with the tests that guard it (mutmut 3).

    python tests/mutation/run.py mmviews/eval/health.py [more modules...]
    python tests/mutation/run.py --changed main        # the modules `git diff main` touches
    python tests/mutation/run.py --changed main --fail-under 85 --table scores.md

For each module the script keeps a work folder ``.mutation/<module>/`` (git-ignored): a copy
of the repository's files with a ``[tool.mutmut]`` section added to its ``pyproject.toml`` that
mutates only that module and runs only the test files that ``tests/mutation/modules.toml``
lists for it. mutmut copies that folder once more into ``mutants/`` with every mutant compiled
in behind a switch (the environment variable ``MUTANT_UNDER_TEST``), records which test calls
which function, then runs each mutant against the tests that called the mutated function. A
rerun reuses the results of the functions that did not change. The repository's own files are
never written, so the work tree stays clean.

Subprocesses: the tests start ``mmviews`` subprocesses with ``PYTHONPATH`` set to the folder
that holds their own ``tests/`` (``test_train_utils.REPO``); under mutmut that folder is
``mutants/``, so a subprocess imports the mutated copy and inherits the active mutant from the
environment, and a mutant that breaks a subprocess is killed. But mutmut records which test
reaches which function in the pytest process only: a function reached *only* inside a
subprocess has no test on record and its mutants are reported as ``no tests`` (counted as not
killed, listed apart) rather than run.

The score is the killed mutants (a failing test, a timeout or a crash of the test process)
over all mutants less the ones ``modules.toml`` lists as equivalent (with their reason).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAPPING = Path(__file__).resolve().with_name("modules.toml")
WORK_ROOT = REPO / ".mutation"
# The files mutmut copies next to the mutated package besides tests/ and pyproject.toml (its
# defaults): the tests read recipes, dataset cards and the README from the repository root.
ALSO_COPY = ["recipes", "data_cards", "README.md", "docs", "setup.py", "MANIFEST.in", "constraints"]
# mutmut's outcome names that count as the mutant detected.
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
# Outcomes of mutants that were not run to the end (a time limit, Ctrl-C).
UNCHECKED = {"not checked", "check was interrupted by user"}


@dataclass
class ModuleScore:
    module: str
    tests: list[str]
    status_by_mutant: dict[str, str]
    equivalent: dict[str, str]
    diff_by_mutant: dict[str, str] = field(default_factory=dict)

    def names_with(self, status: str) -> list[str]:
        return sorted(name for name, s in self.status_by_mutant.items() if s == status and name not in self.equivalent)

    @property
    def counted(self) -> int:
        """The mutants run (all but the equivalent ones and those a time limit left unchecked)."""
        return sum(
            1 for name, s in self.status_by_mutant.items() if s not in UNCHECKED and name not in self.equivalent
        )

    @property
    def detected(self) -> int:
        return sum(1 for name, s in self.status_by_mutant.items() if s in DETECTED and name not in self.equivalent)

    @property
    def score(self) -> float:
        return 100.0 * self.detected / self.counted if self.counted else 100.0

    def undetected(self) -> list[str]:
        return sorted(
            name for name, s in self.status_by_mutant.items()
            if s not in DETECTED | UNCHECKED and name not in self.equivalent
        )

    @property
    def unchecked(self) -> int:
        return sum(1 for s in self.status_by_mutant.values() if s in UNCHECKED)


def load_mapping() -> dict[str, dict]:
    with MAPPING.open("rb") as file:
        return tomllib.load(file).get("modules", {})


def tests_for(module: str, mapping: dict[str, dict]) -> tuple[list[str], dict[str, str]]:
    """The test files guarding ``module`` (the table's row, else the files named after it) and
    its equivalent mutants."""
    row = mapping.get(module)
    if row is not None:
        tests = list(row["tests"])
        missing = [test for test in tests if not (REPO / test).is_file()]
        if missing:
            raise SystemExit(f"{MAPPING.name}: {module}: no such test file {', '.join(missing)}")
        return tests, dict(row.get("equivalent", {}))
    parts = Path(module).with_suffix("").parts[1:]
    tests = sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob(f"test_{'_'.join(parts)}*.py"))
    if not tests:
        raise SystemExit(f"{module}: no test files named after it; add a row for it to {MAPPING.relative_to(REPO)}")
    return tests, {}


def changed_modules(base: str) -> list[str]:
    """The package's Python modules that differ between ``base`` and the work tree (committed or
    not), plus new untracked ones."""
    diff = subprocess.run(
        ["git", "diff", "--name-only", "--diff-filter=AMR", base, "--", "mmviews"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout.split()
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "--", "mmviews"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout.split()
    return sorted({path for path in diff + untracked if path.endswith(".py") and not path.endswith("__init__.py")})


def sync_copy(work: Path) -> None:
    """Copy the repository's files (tracked, and untracked ones git does not ignore) into
    ``work``, rewriting only files whose bytes changed: mutmut compares modification times to
    decide which mutated files are stale, and ``copy2`` keeps the source's."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source, target = REPO / name, work / name
        if not source.is_file():
            continue  # deleted in the work tree but still in the index
        if target.is_file() and target.read_bytes() == source.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def deselected_for(module: str, mapping: dict[str, dict]) -> list[str]:
    """Test ids the table leaves out of a module's mutant runs (slow end-to-end tests whose
    every run would cost a mutant a training)."""
    return list(mapping.get(module, {}).get("deselect", []))


def write_config(work: Path, module: str, tests: list[str], deselect: list[str]) -> None:
    base = (REPO / "pyproject.toml").read_text()
    if "[tool.mutmut]" in base:
        raise SystemExit("pyproject.toml already has a [tool.mutmut] section; tests/mutation/run.py writes its own")
    config = "\n".join([
        "",
        "[tool.mutmut]",
        'source_paths = ["mmviews"]',
        f"only_mutate = {toml_list([module])}",
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}",
        # xdist off (mutmut runs pytest in its own process), no cache folder in the copy.
        "pytest_add_cli_args = "
        + toml_list(["-p", "no:xdist", "-p", "no:cacheprovider"] + [f"--deselect={test}" for test in deselect]),
        f"also_copy = {toml_list(ALSO_COPY)}",
        # The work folder sits inside the repository's git work tree: mutmut's git-based change
        # detection would compare against the repository, not the copy.
        "use_git_change_detection = false",
        "",
    ])
    target = work / "pyproject.toml"
    text = base + config
    if not target.is_file() or target.read_text() != text:
        target.write_text(text)


# mutmut's command line with its results files written whole (see its docstring): a time limit
# stops mutmut, and mutmut's own writer could be cut mid-file and lose every result of a module.
# (Not ``python -m mutmut``, which loads mutmut's main module twice.)
MUTMUT = Path(__file__).resolve().with_name("mutmut_safe.py")
# How long a stopped mutmut gets to end its workers before its process group is killed.
STOP_GRACE_S = 30.0


def mutmut_command() -> list[str]:
    return [sys.executable, str(MUTMUT)]


def mutmut_env() -> dict[str, str]:
    env = dict(os.environ)
    # mutmut puts mutants/ first on sys.path itself; a PYTHONPATH naming a checkout of the
    # package (this one or another worktree) would let the tests import the unmutated package
    # instead. Other entries (e.g. a folder holding mutmut's own dependencies) are kept.
    kept = [entry for entry in env.pop("PYTHONPATH", "").split(os.pathsep)
            if entry and not (Path(entry) / "mmviews" / "__init__.py").is_file()]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


def meta_path(work: Path, module: str) -> Path:
    """mutmut's results file of ``module``: each mutant's exit code, ``None`` while unchecked."""
    return work / "mutants" / (module + ".meta")


def mutant_count(work: Path, module: str) -> int | None:
    """How many mutants mutmut made of ``module`` (its line spans file lists each), if readable."""
    spans = work / "mutants" / (module + ".spans")
    try:
        names = json.loads(spans.read_text())["spans"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sum(1 for name in names if not name.endswith("__mutmut_orig"))


def read_results(work: Path, module: str) -> dict[str, int | None]:
    """The exit code of each of ``module``'s mutants from its results file; a clear stop, not a
    traceback, when the file cannot be read (a stop cut it while mutmut rewrote it: this script
    writes it whole since, but a folder from an older run can hold a cut one)."""
    meta = meta_path(work, module)
    try:
        return json.loads(meta.read_text())["exit_code_by_key"]
    except (ValueError, KeyError, TypeError) as error:
        count = mutant_count(work, module)
        lost = f"all {count} mutants" if count is not None else "every mutant"
        raise SystemExit(
            f"{meta}: unreadable ({type(error).__name__}: {error}); the results of {lost} of {module} are lost "
            f"(the file was cut while being written). Remove it to check them afresh: rm '{meta}'"
        ) from None


def stop_mutmut(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Stop a mutmut started in a session of its own: SIGINT first (mutmut ends its workers and
    the mutant in flight stays unchecked; its results file is only ever replaced whole, see
    mutmut_safe.py, so the stop cannot cut it), then, after ``grace`` seconds, SIGKILL to the
    whole group (mutmut does not always stop on SIGINT, seen with a worker running; whatever it
    leaves running, its forked workers and the tests' subprocesses, goes with it)."""
    process.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def undetected_in_last_run(module: str, equivalent: dict[str, str] | None = None) -> list[str]:
    """The mutants of the module's last run that no test detected (survived, no tests,
    unchecked), less the ``equivalent`` ones (no test can detect them).

    mutmut reruns a mutant on its own only when its function's code changed; after new guards
    were written for a module, these are the mutants worth running again.
    """
    work = WORK_ROOT / module.replace("/", "__")
    meta = meta_path(work, module)
    if not meta.is_file():
        raise SystemExit(f"{module}: no earlier run to take survivors from ({meta} is missing)")
    exit_codes = read_results(work, module)
    from mutmut.stats import status_by_exit_code

    return sorted(name for name, code in exit_codes.items()
                  if (code is None or status_by_exit_code[code] not in DETECTED) and name not in (equivalent or {}))


def run_module(module: str, tests: list[str], deselect: list[str], max_children: int, time_limit: float | None,
               log, mutants: list[str] | None = None, refresh_stats: bool = False) -> Path:
    work = WORK_ROOT / module.replace("/", "__")
    work.mkdir(parents=True, exist_ok=True)
    if meta_path(work, module).is_file():
        read_results(work, module)  # mutmut would stop on an unreadable one with a traceback
    sync_copy(work)
    write_config(work, module, tests, deselect)
    # A mutant can make a command write where the tests run (e.g. `--check` turned into a real
    # run writes runs/<recipe>/ under mutants/); left there, it fails the next clean test run.
    shutil.rmtree(work / "mutants" / "runs", ignore_errors=True)
    if refresh_stats:
        # mutmut records which functions a test reaches only when it first sees the test: a test
        # edited since keeps its old record. Removing the record makes mutmut collect it again
        # (the mutants' results are kept).
        (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    # Named mutants (names or fnmatch patterns) are run again even where a result is on record.
    command = mutmut_command() + ["run", "--max-children", str(max_children), *(mutants or [])]
    print(f"[{module}] mutmut run in {work.relative_to(REPO)} with {' '.join(tests)}", file=log, flush=True)
    # A session of its own, so that whatever mutmut leaves running after a time limit (its
    # forked workers, the tests' subprocesses) can be ended as a group.
    process = subprocess.Popen(command, cwd=work, env=mutmut_env(), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        returncode = process.wait(timeout=time_limit)
    except subprocess.TimeoutExpired:
        # mutmut saves each mutant's result as it comes, so ending it loses at most the mutant in
        # flight; the rest stay "not checked" and a rerun goes on from there.
        stop_mutmut(process)
        print(f"{module}: stopped after the time limit of {time_limit:.0f} s", file=sys.stderr)
        return work
    if returncode != 0:
        raise SystemExit(f"{module}: mutmut run exited {returncode} (log: {getattr(log, 'name', 'stderr')})")
    return work


# Run in a module's work folder: the unified diff of each mutant named on stdin, as JSON.
SHOW_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
names = json.load(sys.stdin)
print(json.dumps({name: get_diff_for_mutant(name, path=sys.argv[1]) for name in names}))
"""


def read_score(module: str, tests: list[str], equivalent: dict[str, str], work: Path, with_diffs: bool) -> ModuleScore:
    exit_codes = read_results(work, module)  # an unreadable file is reported first, mutmut installed or not
    from mutmut.stats import status_by_exit_code

    score = ModuleScore(
        module=module,
        tests=tests,
        status_by_mutant={name: status_by_exit_code[code] for name, code in exit_codes.items()},
        equivalent=equivalent,
    )
    unknown = sorted(set(equivalent) - set(exit_codes))
    if unknown:
        print(f"{MAPPING.name}: {module}: equivalent mutants that no longer exist: {', '.join(unknown)}", file=sys.stderr)
    if with_diffs and score.undetected():
        # One process for all the diffs (``mutmut show`` per mutant costs a start each).
        shown = subprocess.run(
            [sys.executable, "-c", SHOW_DIFFS, module], input=json.dumps(score.undetected()),
            cwd=work, env=mutmut_env(), capture_output=True, text=True, check=True,
        )
        score.diff_by_mutant = json.loads(shown.stdout)
    return score


def report(score: ModuleScore) -> str:
    lines = [
        f"{score.module}: {score.detected}/{score.counted} killed = {score.score:.1f} %"
        + (f" ({len(score.equivalent)} equivalent left out)" if score.equivalent else "")
        + (f"; {score.unchecked} of {len(score.status_by_mutant)} mutants NOT CHECKED (time limit): "
           "the score is over the checked ones" if score.unchecked else ""),
        f"  tests: {' '.join(score.tests)}",
    ]
    for status in ("timeout", "segfault"):
        if names := score.names_with(status):
            lines.append(f"  {status} (counted as killed): {len(names)}")
    for status in ("survived", "no tests", "suspicious", "skipped"):
        if names := score.names_with(status):
            lines.append(f"  {status}: {len(names)}")
            for name in names:
                lines.append(f"    {name}")
                if diff := score.diff_by_mutant.get(name):
                    lines.extend("      " + line for line in diff.splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---")))
    for name, reason in sorted(score.equivalent.items()):
        lines.append(f"  equivalent: {name}: {reason}")
    return "\n".join(lines)


def test_cell(tests: list[str]) -> str:
    """``a.py``, ``b.py``, not ``b.py::slow_test`` (a deselected test keeps its ``not``)."""
    cells = []
    for test in tests:
        negated = test.startswith("not ")
        name = Path(test.removeprefix("not ")).name
        cells.append(("not " if negated else "") + f"`{name}`")
    return ", ".join(cells)


def table(scores: list[ModuleScore]) -> str:
    """Rows for the score table of tests/README.md."""
    today = date.today().isoformat()
    rows = [
        "| module | mutants | checked | killed | survived | no tests | equivalent | score | tests | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for score in scores:
        rows.append(
            f"| `{score.module}` | {len(score.status_by_mutant)} | {score.counted} | {score.detected} | {len(score.names_with('survived'))} "
            f"| {len(score.names_with('no tests'))} | {len(score.equivalent)} | {score.score:.1f} % "
            f"| {test_cell(score.tests)} | {today} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="module paths, e.g. mmviews/eval/health.py")
    parser.add_argument("--changed", metavar="BASE", nargs="?", const="main",
                        help="also the modules that differ from BASE (default main)")
    parser.add_argument("--max-children", type=int, default=1,
                        help="mutants run at once (default 1: the CI machines have 2 cores)")
    parser.add_argument("--fail-under", type=float, metavar="PERCENT",
                        help="exit 1 when a module scores below PERCENT")
    parser.add_argument("--table", metavar="FILE", help="write the score table's rows to FILE ('-': stdout)")
    parser.add_argument("--log", metavar="FILE", help="mutmut's output goes here (default: stderr)")
    parser.add_argument("--diffs", action="store_true", help="print each surviving mutant's change")
    parser.add_argument("--list", action="store_true", help="print the modules and their tests, run nothing")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop each module's run after SECONDS, keep what was checked (a rerun goes on)")
    parser.add_argument("--mutants", nargs="+", metavar="NAME",
                        help="run only these mutants (names or patterns such as 'mmviews.data.prepare.x__prepare_parquet*'), "
                             "again where a result is on record")
    parser.add_argument("--rerun-survivors", action="store_true",
                        help="run again every mutant that the module's last run did not detect (after writing guards), "
                             "with which test reaches which function recorded afresh")
    parser.add_argument("--report-only", action="store_true",
                        help="print the results of the last runs without running anything")
    args = parser.parse_args(argv)

    modules = [str(Path(m)) for m in args.modules]
    if args.changed:
        modules += changed_modules(args.changed)
    modules = list(dict.fromkeys(modules))
    if not modules:
        print("no module to mutate", file=sys.stderr)
        return 0
    for module in modules:
        if not module.startswith("mmviews/") or not (REPO / module).is_file():
            raise SystemExit(f"{module}: not a module of the mmviews package")

    mapping = load_mapping()
    plan = {module: tests_for(module, mapping) for module in modules}
    if args.list:
        for module, (tests, _) in plan.items():
            print(f"{module}: {' '.join(tests)}")
        return 0

    log = open(args.log, "a") if args.log else sys.stderr
    scores = []
    for module, (tests, equivalent) in plan.items():
        if args.report_only:
            work = WORK_ROOT / module.replace("/", "__")
            if not meta_path(work, module).is_file():
                raise SystemExit(f"{module}: no results yet in {work.relative_to(REPO)}")
        else:
            named = list(args.mutants or [])
            if args.rerun_survivors:
                named += undetected_in_last_run(module, equivalent)
                if not named:
                    print(f"{module}: every mutant of the last run was detected; nothing to rerun", file=sys.stderr)
            work = (WORK_ROOT / module.replace("/", "__")) if args.rerun_survivors and not named else run_module(
                module, tests, deselected_for(module, mapping), args.max_children, args.time_limit, log, named,
                refresh_stats=args.rerun_survivors)
        score = read_score(module, tests + [f"not {test}" for test in deselected_for(module, mapping)], equivalent,
                           work, args.diffs)
        print(report(score), flush=True)
        scores.append(score)

    if args.table:
        text = table(scores)
        if args.table == "-":
            print(text, end="")
        else:
            Path(args.table).write_text(text)
    if args.fail_under is not None:
        low = [s for s in scores if s.score < args.fail_under]
        for score in low:
            print(f"{score.module}: {score.score:.1f} % < {args.fail_under} %", file=sys.stderr)
        return 1 if low else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
