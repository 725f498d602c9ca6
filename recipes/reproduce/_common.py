"""Shared driver of the CPU-scale reproduction scripts in ``recipes/reproduce/``.

Every run goes through the public trainer: a recipe derived from ``recipes/quickstart.yaml`` (the
same four synthetic modalities and adapters, fewer samples) is written to
``OUT/recipes/base.yaml`` and each run is ``mmviews.config.load_config(recipe, overrides)``
followed by ``mmviews.train.train(config, run_dir)`` -- exactly what ``mmviews train RECIPE --set
...`` does (the equivalent command line of every run is stored in ``OUT/commands.txt`` and in the
table). Runs are spread over ``--jobs`` worker processes (one torch thread each by default);
each worker imports torch and the trainer once, which on a 2-core machine is a large share of a
one-minute run.

Probes (trainer's evaluation): a linear probe on the class and the representation diagnostics
(effective rank, alignment, uniformity) of the test split, on the mean of the per-modality
natural views' embeddings (``evaluation.fuse: mean``, as in quickstart), for every run and for
the encoder as initialised (``random_init.json``): a trained encoder is only better than nothing
if it beats the latter.

Where a script writes (one rule, :func:`output_dir`, for every script): under a folder of the
user's, ``runs/reproduce/<name>/`` below the current directory by default, or ``--out DIR``;
never into the repository's shipped tables (``recipes/reproduce/results/``), which only
``--update-shipped`` regenerates (and never from ``--smoke``, whose numbers test the plumbing
only: its first line of output says so).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shlex
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import yaml

from mmviews.fileio import atomic_save, atomic_write_text

REPRO_DIR = Path(__file__).resolve().parent
REPO_ROOT = REPRO_DIR.parents[1]
RESULTS_DIR = REPRO_DIR / "results"
QUICKSTART = REPRO_DIR.parent / "quickstart.yaml"
# Where a script writes by default, relative to the current directory (the trainer's own ``runs/``).
RUNS_DIR = Path("runs") / "reproduce"
SMOKE_NOTICE = ("--smoke: tiny data and a few steps; these numbers test the plumbing only and say nothing "
                "about the method (the default size gives results)")

ACC = "test/linear/class/acc"
ERANK = "test/diag/erank/fused"
ERANK_VIEWS = "test/diag/erank/view_mean"
ALIGN = "test/diag/align"
UNIF = "test/diag/unif"

NATURAL = ("text", "audio", "image", "flow")
# Sizes: (train samples, valid, test, epochs). At "default" size the quickstart encoder (four
# modalities, K = 64, 96 AdamW steps) reaches 0.84 test accuracy against 0.50 for the encoder as
# initialised, in about a minute on one core; with 768 samples and 48 steps it only reached 0.62.
SIZES: dict[str, dict[str, int]] = {
    "smoke": {"train": 32, "valid": 16, "test": 32, "epochs": 1},
    "default": {"train": 1024, "valid": 128, "test": 512, "epochs": 6},
    "full": {"train": 4096, "valid": 512, "test": 1024, "epochs": 30},
}


def small_recipe(name: str, *, modalities: Sequence[str] = NATURAL, size: str = "default",
                 batch_size: int = 64, seed: int = 0) -> dict[str, Any]:
    """A recipe derived from ``quickstart.yaml``: the given synthetic modalities as natural views
    with quickstart's adapters (at smoke size narrower ones), a linear probe on the class plus
    the diagnostics (effective rank), fewer samples (``SIZES[size]``)."""
    unknown = set(modalities) - set(NATURAL)
    if unknown or not modalities:
        raise ValueError(f"modalities must be a non-empty subset of {NATURAL}, got {list(modalities)}")
    base = yaml.safe_load(QUICKSTART.read_text())
    sz = SIZES[size]
    recipe: dict[str, Any] = {
        "name": name,
        "description": f"reproduction run derived from quickstart.yaml ({size} size)",
        "seed": seed,
        "data": {
            **base["data"],
            "options": {"num_classes": 4, "modalities": list(modalities)},
            "split_options": {"train": {"num_samples": sz["train"]}, "valid": {"num_samples": sz["valid"]},
                              "test": {"num_samples": sz["test"]}},
            "batch_size": batch_size,
            "eval_batch_size": 256,
        },
        "views": [{"modality": m} for m in modalities],
        "encoder": dict(base["encoder"]),
        "adapters": {m: dict(base["adapters"][m]) for m in modalities},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        # float32 on every machine, so that the shipped tables reproduce anywhere: `auto` would
        # pick bf16 on a CPU with AVX512-BF16/AMX, and the tables were measured in float32
        "optimisation": {**base["optimisation"], "epochs": sz["epochs"], "warmup_epochs": 0.5, "mixed_precision": "no"},
        "evaluation": {"tasks": ["linear:class", {"kind": "diagnostics"}], "fuse": "mean", "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 0, "keep_last": 1, "tensorboard": False,
                   "progress_bar": False},
    }
    if size == "smoke":  # seconds per run in the tests
        # no PNGs in the runs' own reports: about 1 s of matplotlib per run, two thirds of a
        # smoke run's time (the script's own plot is still drawn)
        recipe["evaluation"]["plots"] = False
        recipe["encoder"]["embed_dim"] = 32
        for m in modalities:
            if "channels" in recipe["adapters"][m]:
                recipe["adapters"][m]["channels"] = [8, 16]
            recipe["adapters"][m]["head"] = {"kind": "mlp", "hidden_dim": 32, "batch_norm": True}
    return recipe


def write_recipe(recipe: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(dict(recipe), sort_keys=False, default_flow_style=None))
    return path


def repo_relative(path: Path | str) -> str:
    """``path`` relative to the repository root when it lies inside it (tables and commands
    stay valid in any checkout; run them from the root), else as given."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def from_repo(path: Path | str) -> Path:
    """Inverse of :func:`repo_relative`."""
    path = Path(path)
    return path if path.is_absolute() else REPO_ROOT / path


def cli_command(recipe_path: Path, run_dir: Path, overrides: Sequence[str]) -> str:
    """The ``mmviews train`` command line equivalent to :func:`train_run` (run from the repo root)."""
    parts = ["mmviews", "train", repo_relative(recipe_path)] + [f"--set {shlex.quote(o)}" for o in overrides]
    parts += ["--output", repo_relative(run_dir), "--overwrite"]
    return " ".join(parts)


def train_run(recipe_path: Path, run_dir: Path, overrides: Sequence[str] = (), *, threads: int = 1,
              reuse: bool = True) -> dict[str, Any]:
    """Train and evaluate one run with the public trainer; returns a flat row.

    ``reuse``: a run folder whose ``results.json`` exists and whose ``config.yaml`` equals the
    config resolved now is not retrained (lets an interrupted sweep continue).
    Row keys: ``acc``, ``erank``, ``erank_views``, ``align``, ``unif``, ``final_loss``, ``steps``,
    ``wall_s``, ``status`` (``ok`` or the error message: a diverging objective is a result).
    """
    import torch

    from mmviews.config import load_config
    from mmviews.eval.precision import resolve_precision
    from mmviews.train import train

    torch.set_num_threads(threads)
    config = load_config(recipe_path, list(overrides))
    run_dir = Path(run_dir)
    # compared with the run's config.yaml, which holds the precision ``auto`` resolved to
    resolved = yaml.safe_dump(resolve_precision(config)[0].to_dict(), sort_keys=False, default_flow_style=None)
    results = run_dir / "results.json"
    started = time.perf_counter()
    summary: dict[str, Any] | None = None
    status = "ok"
    if reuse and results.is_file() and (run_dir / "config.yaml").is_file() \
            and yaml.safe_load((run_dir / "config.yaml").read_text()) == yaml.safe_load(resolved):
        summary = json.loads(results.read_text())
    else:
        try:
            summary = train(config, run_dir, source=str(recipe_path), overwrite=True)  # a stale run of the sweep
        except (FloatingPointError, ValueError, RuntimeError) as error:  # divergence is a finding
            status = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            atomic_write_text(run_dir / "failed.txt", status + "\n")
    wall = time.perf_counter() - started
    metrics = (summary or {}).get("eval") or {}
    row = {
        "acc": metrics.get(ACC, float("nan")),
        "erank": metrics.get(ERANK, float("nan")),
        "erank_views": metrics.get(ERANK_VIEWS, float("nan")),
        "align": metrics.get(ALIGN, float("nan")),
        "unif": metrics.get(UNIF, float("nan")),
        "final_loss": (summary or {}).get("final_loss", float("nan")),
        "steps": (summary or {}).get("steps", 0),
        "wall_s": round((summary or {}).get("wall_time_s", wall), 1),
        "status": status,
        "run_dir": repo_relative(run_dir),
        "command": cli_command(recipe_path, run_dir, overrides),
    }
    return row


def write_table(rows: Sequence[Mapping[str, Any]], out_dir: Path, stem: str = "results") -> tuple[Path, Path]:
    """``<stem>.csv`` and ``<stem>.json`` (atomic)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    atomic_write_text(out_dir / f"{stem}.csv", buf.getvalue())
    atomic_write_text(out_dir / f"{stem}.json", json.dumps(list(rows), indent=2, default=str))
    commands = [str(r["command"]) for r in rows if r.get("command")]
    if commands:  # a summary table (no command per row) keeps the commands of the runs it summarises
        atomic_write_text(out_dir / "commands.txt", "\n".join(commands) + "\n")
    return out_dir / f"{stem}.csv", out_dir / f"{stem}.json"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of ``columns``: floats to 3 decimals, a missing cell empty; a standard
    deviation (a column named ``*_std*``) that is nan, as for one seed (:func:`mean_std`), is
    ``-``: it is not known, not zero."""
    def fmt(v: Any, column: str) -> str:
        if isinstance(v, float):
            if v != v:
                return "-" if "_std" in column else "nan"
            return f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, ""), c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Save a PNG atomically."""
    return atomic_save(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def add_size_arguments(parser: Any) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true", help="a few steps on tiny data (tests)")
    group.add_argument("--full", action="store_true", help="the paper-like size (hours on a CPU)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="runs trained at once, one process each (default: the CPU count, at most 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run (default 1)")
    parser.add_argument("--no-reuse", action="store_true", help="retrain runs whose folder already holds a result")


def add_output_arguments(parser: Any, default: str) -> None:
    """``--out`` and ``--update-shipped``, the arguments :func:`output_dir` reads. ``default``:
    the folder name under ``runs/reproduce/`` (or its description, where a choice picks it)."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output folder (default: {RUNS_DIR}/{default}/ under the current directory)")
    parser.add_argument("--update-shipped", action="store_true",
                        help=f"write into the tables shipped with the repository, "
                             f"{repo_relative(RESULTS_DIR)}/{default}/ (or the --out folder under it), "
                             f"to regenerate them; refused with --smoke")


def output_dir(parser: Any, args: Any, name: str) -> Path:
    """The folder a script writes into, absolute, after printing :data:`SMOKE_NOTICE` at smoke
    size (the script's first line of output). ``args.out``, else ``runs/reproduce/<name>/``
    under the current directory. A folder in the shipped tables (``recipes/reproduce/results/``)
    needs ``--update-shipped``, whose default is ``results/<name>/``; smoke runs never go there.
    Errors go through ``parser.error`` (one line, exit status 2) before anything is written."""
    smoke = bool(getattr(args, "smoke", False)) or getattr(args, "size", None) == "smoke"
    if smoke:
        print(SMOKE_NOTICE, flush=True)
    shipped = RESULTS_DIR.resolve()
    if args.update_shipped:
        if smoke:
            parser.error("--update-shipped with --smoke: smoke numbers test the plumbing only and are never shipped")
        out = (RESULTS_DIR / name if args.out is None else Path(args.out)).resolve()
        if not out.is_relative_to(shipped):
            parser.error(f"--update-shipped: --out {args.out} is not under {shipped}, the shipped tables")
        return out
    out = (RUNS_DIR / name if args.out is None else Path(args.out)).resolve()
    if out.is_relative_to(shipped):
        parser.error(f"--out {args.out}: inside the tables shipped with the repository ({shipped}); "
                     f"pass --update-shipped to regenerate them, or choose another folder")
    return out


def size_of(args: Any) -> str:
    return "smoke" if args.smoke else "full" if args.full else "default"


def compare_runs(run_dirs: Iterable[str], out_dir: Path) -> int:
    """``mmviews compare RUN... --out OUT`` over the finished runs (best effort: the table and
    plot of the script do not depend on it)."""
    import argparse

    from mmviews.eval import compare

    # repo-relative names in the report when run from the root, as the commands are
    here = Path.cwd().resolve() == REPO_ROOT
    dirs = [repo_relative(d) if here else str(from_repo(d)) for d in run_dirs if (from_repo(d) / "results.json").is_file()]
    if len(dirs) < 2:
        return 1
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    try:
        args = parser.parse_args(dirs + ["--out", str(out_dir)])
    except SystemExit:
        return 1
    try:
        return int(compare.run(args) or 0)
    except Exception as error:  # noqa: BLE001 - comparison is an extra; report and go on
        print(f"mmviews compare failed: {error}")
        return 1


def _progress(row: Mapping[str, Any]) -> str:
    """The probe metrics a finished run has (a run without a class probe, such as the
    identifiability runs, has no accuracy: nothing is printed for it)."""
    parts = [f"{name} {row[key]:{fmt}}" for name, key, fmt in (("acc", "acc", ".3f"), ("erank", "erank", ".2f"))
             if isinstance(row.get(key), float) and math.isfinite(row[key])]
    return ", ".join(parts + [f"loss {row['final_loss']:.4f}", f"{row['wall_s']} s", str(row["status"])])


def _indexed_run(task: tuple[int, tuple[Any, ...], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """One run of a sweep in a worker process (module level: the spawned workers import it)."""
    i, call, options = task
    return i, train_run(*call, **options)


class SweepInterrupted(KeyboardInterrupt):
    """SIGTERM reached the process running a sweep (SIGINT is Python's KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`SweepInterrupted` in the main thread while the sweep waits for its
    workers: by default it would end this process at once and leave the workers running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise SweepInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_sweep(specs: Sequence[Mapping[str, Any]], recipe_path: Path, out_dir: Path, args: Any,
              *, stem: str = "results", describe: Callable[[Mapping[str, Any]], str] | None = None
              ) -> list[dict[str, Any]]:
    """Train every spec (``{"run": folder name, "overrides": [...], **fields}``) and return the
    rows (spec fields + :func:`train_run` metrics) in spec order. ``args.jobs`` worker processes
    (spawned, ``args.threads`` torch threads each) share the runs; every run is deterministic on
    its own, so the numbers do not depend on ``--jobs``. The table is rewritten after each run,
    so an interrupted sweep leaves the finished rows on disk (and a rerun reuses those runs
    unless ``--no-reuse``). ``describe``: the metrics printed for a finished row (default: the
    class accuracy and effective rank, where the run has them).

    SIGINT (Ctrl-C) or SIGTERM stops the workers with it: each one gets SIGTERM (a run stops
    after its current step, see :mod:`mmviews.train.interrupt`), the sweep waits for them to end
    and exits with status 128 + the signal's number; the unfinished runs have no
    ``results.json``, so a rerun trains them again."""
    total = len(specs)
    done: dict[int, dict[str, Any]] = {}

    def finish(i: int, row: dict[str, Any]) -> None:
        spec = specs[i]
        done[i] = {**{k: v for k, v in spec.items() if k not in ("run", "overrides")}, **row}
        extra = describe(done[i]) if describe is not None else ""
        print(f"[{len(done)}/{total}] {spec['run']}: " + (f"{extra}, " if extra else "") + _progress(row), flush=True)
        write_table([done[j] for j in sorted(done)], out_dir, stem)

    jobs = max(1, min(int(getattr(args, "jobs", 1) or 1), total))
    calls = [(recipe_path, out_dir / "runs" / spec["run"], list(spec["overrides"])) for spec in specs]
    options = {"threads": args.threads, "reuse": not args.no_reuse}
    if jobs == 1:  # in this process: the trainer itself stops on a signal
        for i, call in enumerate(calls):
            print(f"[{i + 1}/{total}] {specs[i]['run']} ...", flush=True)
            finish(i, train_run(*call, **options))
        return [done[i] for i in range(total)]
    import multiprocessing

    print(f"{total} runs on {jobs} worker processes", flush=True)
    # multiprocessing's Pool, not concurrent.futures: its terminate() stops the workers' runs
    pool = multiprocessing.get_context("spawn").Pool(jobs)
    try:
        with _sigterm_raises():
            for i, row in pool.imap_unordered(_indexed_run, [(i, call, options) for i, call in enumerate(calls)]):
                finish(i, row)
        pool.close()
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (SweepInterrupted)
        pool.terminate()
        signum = stop.signum if isinstance(stop, SweepInterrupted) else int(signal.SIGINT)
        print(f"{signal.Signals(signum).name}: sweep stopped with {len(done)} of {total} runs finished "
              f"(rows in {out_dir / stem}.csv; a rerun reuses them)", flush=True)
        raise SystemExit(128 + signum) from None
    except BaseException:  # an error in a worker: the other runs are not waited for
        pool.terminate()
        raise
    finally:
        pool.join()
    return [done[i] for i in range(total)]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation, ignoring nan; the deviation is nan (unknown, printed
    ``-``) for one value, both are nan for none."""
    vals = [float(v) for v in values if v == v]
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def random_init_baseline(recipe_path: Path, out_dir: Path, overrides: Sequence[str], args: Any) -> dict[str, Any]:
    """The same probes on the encoder as initialised (before any step): the trainer's
    ``evaluation.random_baseline`` of a one-step run (its ``eval_random``). Rows reference it,
    because on this data a random encoder's embeddings already carry class information."""
    run_dir = out_dir / "runs" / "random_init"
    row = train_run(recipe_path, run_dir, list(overrides) + ["evaluation.random_baseline=true", "optimisation.max_steps=1"],
                    threads=args.threads, reuse=not args.no_reuse)
    results = run_dir / "results.json"
    metrics = (json.loads(results.read_text()).get("eval_random") or {}) if results.is_file() else {}
    base = {"acc": metrics.get(ACC, float("nan")), "erank": metrics.get(ERANK, float("nan")),
            "command": row["command"], "run_dir": repo_relative(run_dir)}
    atomic_write_text(out_dir / "random_init.json", json.dumps(base, indent=2))
    print(f"random-init encoder: acc {base['acc']:.3f}, erank {base['erank']:.2f}", flush=True)
    return base
