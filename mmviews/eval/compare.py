"""``mmviews compare RUN...``: several runs side by side in one table and one set of plots.

Each RUN is a run folder (its ``eval/metrics.json``), an evaluation folder (its
``metrics.json``) or a ``metrics.json`` file, as written by the trainer or ``mmviews eval``.
The file's ``meta`` gives each run's objective (``meta["objective"]``) and the number of views
M its encoder was trained with (``meta["num_views"]``).

For a run folder it also reads what the trainer wrote beside the evaluation: ``results.json``
(final training loss, wall time, optimiser steps), ``eval_random/metrics.json`` (the same
probes on the encoder as initialised) and ``metrics.csv`` (the training log).

Writes ``comparison.md`` (rows: metrics, columns: runs; then each metric's margin over the
run's own random-init baseline), ``comparison.csv``, ``comparison.json``, ``metrics_bar.png``
(headline metrics per run, the random-init value as a black tick), ``training_curves.png``
(loss, positive/negative similarity and the MI lower bound against the step, one colour per
run) and, when the runs differ in their number of views, ``metric_vs_views.png`` (one line
per objective).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmviews.eval.report import _format, _pyplot, _save_figure, acc2_note, atomic_write_json, atomic_write_text
from mmviews.fileio import read_json_object
from mmviews.run import EVAL_METRICS_FILE, LOG_FILE, RESULTS_FILE

# Training-log columns plotted by ``training_curves.png`` (panel title -> columns; a column
# no run logged is left out, a panel with none is dropped).
CURVE_PANELS: dict[str, tuple[str, ...]] = {
    "training loss": ("loss",),
    "similarity (solid: positive pairs, dashed: negative)": ("pos_sim", "neg_sim"),
    "MI lower bound (nats)": ("mi_lower_bound",),
}

# Suffixes of the metrics plotted by default (the ones papers print).
HEADLINE_SUFFIXES = ("/acc", "/top1", "Has0_acc_2", "Non0_acc_2", "/Acc_2", "/R@1", "/MAE", "erank/fused")


@dataclass
class RunMetrics:
    label: str
    path: Path
    metrics: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)
    random_init: dict[str, float] = field(default_factory=dict)  # eval_random/metrics.json
    results: dict[str, Any] = field(default_factory=dict)  # results.json (final_loss, wall_time_s, steps)
    curves: dict[str, list[float]] = field(default_factory=dict)  # metrics.csv columns, with "step"

    @property
    def num_views(self) -> float | None:
        """Training M (``meta["num_views"]``), None when the metrics do not record it."""
        value = self.meta.get("num_views")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None

    @property
    def objective(self) -> str:
        value = self.meta.get("objective")
        return value if isinstance(value, str) else "run"


def load_run_metrics(path: str | Path) -> RunMetrics:
    """Reads one run's metrics and meta. Raises FileNotFoundError / ValueError naming the file."""
    path = Path(path)
    again: list[Path] = []
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run folder or metrics file")
    if path.is_file():
        metrics_file = path
    else:
        # the run's own final evaluation, else the latest one `mmviews eval RUN` wrote (RUN/eval-N)
        again = sorted((p for p in path.glob("eval-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        candidates = [path / "metrics.json", path / "eval" / "metrics.json", *(p / "metrics.json" for p in again[::-1])]
        metrics_file = next((c for c in candidates if c.is_file()), None)
        if metrics_file is None:
            raise FileNotFoundError(f"no metrics.json in {path} or {path / 'eval'} (run 'mmviews eval {path}' first)")
    raw = read_json_object(metrics_file)
    if not isinstance(raw.get("metrics"), dict):
        raise ValueError(f"{metrics_file}: expected an evaluation report {{\"metrics\": {{...}}, \"meta\": {{...}}}}")
    metrics_raw = raw["metrics"]
    meta = raw.get("meta", {}) if isinstance(raw.get("meta"), dict) else {}
    metrics = {
        k: float("nan") if v is None else float(v)
        for k, v in metrics_raw.items()
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    }
    in_run = metrics_file.parent.name == "eval" or metrics_file.parent in again
    run_dir = metrics_file.parent.parent if in_run else metrics_file.parent
    run = RunMetrics(run_dir.name or str(run_dir), run_dir, metrics, meta)
    random_file = run_dir / "eval_random" / EVAL_METRICS_FILE
    if random_file.is_file():
        random_raw = read_json_object(random_file).get("metrics")
        if isinstance(random_raw, dict):
            run.random_init = {k: float(v) for k, v in random_raw.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if (run_dir / RESULTS_FILE).is_file():
        run.results = read_json_object(run_dir / RESULTS_FILE)
    run.curves = read_training_curves(run_dir / LOG_FILE)
    return run


def read_training_curves(path: Path) -> dict[str, list[float]]:
    """The plotted columns of a training log (``metrics.csv``) as float lists with their
    ``step``; ``{}`` when there is no log. A value that is not a number becomes NaN."""
    if not path.is_file():
        return {}
    wanted = ("step", *(c for columns in CURVE_PANELS.values() for c in columns))
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the training log ({type(err).__name__}: {err})") from err
    curves: dict[str, list[float]] = {}
    for column in wanted:
        if rows and column in rows[0]:
            curves[column] = [_to_float(row.get(column)) for row in rows]
    return curves if "step" in curves else {}


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def headline_metrics(keys: list[str], limit: int = 6) -> list[str]:
    chosen = [k for k in keys if k.endswith(HEADLINE_SUFFIXES)]
    return chosen[:limit]


def _unique_labels(runs: list[RunMetrics]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        if r.label in seen:
            seen[r.label] += 1
            r.label = f"{r.label}#{seen[r.label]}"
        else:
            seen[r.label] = 0


def compare_runs(paths: list[str | Path], out_dir: str | Path, metrics: list[str] | None = None) -> dict[str, Path]:
    """Writes the comparison of ``paths`` into ``out_dir``; returns name -> written path."""
    if not paths:
        raise ValueError("compare needs at least one run")
    runs = [load_run_metrics(p) for p in paths]
    _unique_labels(runs)
    keys = sorted(set().union(*(r.metrics for r in runs)))
    if metrics:
        missing = [m for m in metrics if m not in keys]
        if missing:
            raise ValueError(f"metrics {missing} are in none of the runs; known: {keys}")
    plotted = metrics or headline_metrics(keys)
    out = Path(out_dir)
    written: dict[str, Path] = {}

    header = ["metric"] + [r.label for r in runs]
    lines = ["# Run comparison", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    info_rows = [("objective", [r.objective for r in runs]), ("num_views", [r.num_views for r in runs]),
                 ("steps", [r.results.get("steps") for r in runs]),
                 ("final training loss", [r.results.get("final_loss") for r in runs]),
                 ("wall time (s)", [r.results.get("wall_time_s") for r in runs])]
    for name, values in info_rows:
        cells = ["-" if v is None else str(int(v)) if isinstance(v, float) and v.is_integer() else _format(v) for v in values]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_format(r.metrics[k]) if k in r.metrics else "-" for r in runs) + " |")
    baseline_keys = [k for k in keys if any(k in r.random_init and k in r.metrics for r in runs)
                     and not k.endswith("/n")]
    if baseline_keys:
        lines += ["", "Trained minus random init (each run against its own encoder as initialised; "
                  "random-init value in brackets):", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for k in baseline_keys:
            cells = [f"{r.metrics[k] - r.random_init[k]:+.4f} ({_format(r.random_init[k])})"
                     if k in r.metrics and k in r.random_init else "-" for r in runs]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "Runs: " + ", ".join(f"{r.label} = `{r.path}`" for r in runs), "", acc2_note(keys), ""]

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["run", "path", "objective", "num_views", "steps", "final_loss", "wall_time_s"] + keys
                    + [f"random_init/{k}" for k in baseline_keys])
    for r in runs:
        writer.writerow([r.label, str(r.path), r.objective, r.num_views, r.results.get("steps", ""),
                         r.results.get("final_loss", ""), r.results.get("wall_time_s", "")]
                        + [r.metrics.get(k, "") for k in keys] + [r.random_init.get(k, "") for k in baseline_keys])
    written["csv"] = atomic_write_text(out / "comparison.csv", buf.getvalue())
    written["json"] = atomic_write_json(
        out / "comparison.json",
        {r.label: {"path": str(r.path), "objective": r.objective, "num_views": r.num_views, "metrics": r.metrics,
                   "random_init": r.random_init, "steps": r.results.get("steps"),
                   "final_loss": r.results.get("final_loss"), "wall_time_s": r.results.get("wall_time_s")}
         for r in runs},
    )

    if plotted:
        written["metrics_bar"] = _plot_bars(runs, plotted, out / "metrics_bar.png")
        views = {r.num_views for r in runs if r.num_views is not None}
        if len(views) > 1:
            written["metric_vs_views"] = _plot_vs_views(runs, plotted, out / "metric_vs_views.png")
    if any(r.curves for r in runs):
        written["training_curves"] = _plot_curves(runs, out / "training_curves.png")
    if len(written) > 2:
        lines.append("Plots: " + ", ".join(f"[{p.name}]({p.name})" for k, p in written.items()
                                           if k.endswith(("bar", "views", "curves"))))
    written["markdown"] = atomic_write_text(out / "comparison.md", "\n".join(lines) + "\n")
    return written


def _plot_bars(runs: list[RunMetrics], keys: list[str], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(max(4.0, 1.2 * len(runs)) * len(keys) / 1.5, 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = [r.metrics.get(key, math.nan) for r in runs]
        ax.bar(np.arange(len(runs)), values, color=[f"C{i % 10}" for i in range(len(runs))])
        baseline = [r.random_init.get(key, math.nan) for r in runs]
        if any(math.isfinite(v) for v in baseline):  # each run's encoder as initialised
            ax.scatter(np.arange(len(runs)), baseline, marker="_", s=400, color="black", label="random init", zorder=3)
            ax.legend(fontsize=7)
        ax.set_xticks(np.arange(len(runs)), [r.label for r in runs], rotation=45, ha="right", fontsize=8)
        ax.set_title(key, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    return _save_figure(fig, path)


def _plot_curves(runs: list[RunMetrics], path: Path) -> Path:
    """One panel per :data:`CURVE_PANELS` entry that some run logged, one colour per run."""
    panels = [(title, columns) for title, columns in CURVE_PANELS.items()
              if any(c in r.curves for r in runs for c in columns)]
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.6), squeeze=False)
    for ax, (title, columns) in zip(axes[0], panels):
        for i, r in enumerate(runs):
            for column, style in zip(columns, ("-", "--")):
                if column in r.curves:
                    ax.plot(r.curves["step"], r.curves[column], style, color=f"C{i % 10}",
                            label=r.label if column == columns[0] else None)
        if columns == ("mi_lower_bound",):
            ax.axhline(0.0, color="grey", lw=0.8)  # <= 0: no better than chance
        ax.set_xlabel("optimiser step")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save_figure(fig, path)


def _plot_vs_views(runs: list[RunMetrics], keys: list[str], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        groups: dict[str, list[tuple[float, float]]] = {}
        for r in runs:
            if r.num_views is not None and key in r.metrics:
                groups.setdefault(r.objective, []).append((r.num_views, r.metrics[key]))
        for group, pts in sorted(groups.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=group)
        ax.set_xlabel("number of views M")
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize=7)
    return _save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run folders (or metrics.json files)")
    parser.add_argument("--output", "--out", "-o", dest="out", default="comparison",
                        help="output folder (default: ./comparison)")
    parser.add_argument("--metrics", nargs="+", default=None, help="metrics to plot (default: headline metrics)")


def run(args: argparse.Namespace) -> int:
    written = compare_runs(args.runs, args.out, args.metrics)  # errors: one line, exit 2 (mmviews.cli.main)
    print((Path(args.out) / "comparison.md").read_text())
    print("written: " + ", ".join(str(p) for p in written.values()))
    return 0
