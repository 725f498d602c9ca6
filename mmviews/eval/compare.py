"""``mmviews compare RUN...``: several runs side by side in one table and one set of plots.

A comparison is what an experiment is judged by, so it puts each run's numbers beside what they
must beat: the metric's chance level, the run's own random-init baseline, and, where runs differ
only in their seed, the spread over seeds (with a note for each headline difference that is within
noise). Each RUN is a run folder, an evaluation folder or a ``metrics.json`` file, as the trainer
or ``mmviews eval`` wrote it; the runs' health warnings come first. What it reads and the files it
writes: ``docs/evaluation.md`` ("Comparing runs and seeds").
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmviews.eval.health import chance_level, is_chance_key
from mmviews.eval.report import (_format, _pyplot, _save_figure, acc2_note, atomic_write_json, atomic_write_text,
                                 format_metric)
from mmviews.eval.summary import _lower_is_better
from mmviews.eval.summary import headline_metrics as run_headline_metrics
from mmviews.fileio import check_writable, read_json_object
from mmviews.run import CONFIG_FILE, EVAL_METRICS_FILE, LOG_FILE, RESULTS_FILE

# Training-log columns plotted by ``training_curves.png`` (panel title -> columns; a column
# no run logged is left out, a panel with none is dropped).
CURVE_PANELS: dict[str, tuple[str, ...]] = {
    "training loss": ("loss",),
    "similarity (solid: positive pairs, dashed: negative)": ("pos_sim", "neg_sim"),
    "MI lower bound (nats)": ("mi_lower_bound",),
}

# The bar plot's panels per row (more headline metrics wrap onto further rows).
BAR_COLUMNS = 4
# A panel title longer than this is broken at a "/" onto two lines, so neighbours' titles never meet.
TITLE_WIDTH = 22


@dataclass
class RunMetrics:
    label: str
    path: Path
    metrics: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)
    random_init: dict[str, float] = field(default_factory=dict)  # eval_random/metrics.json
    results: dict[str, Any] = field(default_factory=dict)  # results.json (final_loss, wall_time_s, steps)
    curves: dict[str, list[float]] = field(default_factory=dict)  # metrics.csv columns, with "step"
    # the run's config.yaml without its seed and output settings (None without one): runs with
    # the same configuration are seeds of one configuration
    configuration: str | None = None
    config_name: str | None = None

    @property
    def warnings(self) -> list[str]:
        """The health checks' warnings the trainer wrote to ``results.json``."""
        found = self.results.get("warnings")
        return [str(w) for w in found] if isinstance(found, list) else []

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
    run.configuration, run.config_name = read_configuration(run_dir / CONFIG_FILE)
    return run


# Settings that tell seeds of one configuration apart, not configurations.
SEED_ONLY_SETTINGS = ("seed", "output")


def read_configuration(path: Path) -> tuple[str | None, str | None]:
    """``(configuration, name)`` of a run's ``config.yaml``: the resolved recipe without
    :data:`SEED_ONLY_SETTINGS` as canonical JSON (runs that differ only there are seeds of
    one configuration) and the recipe's name; ``(None, None)`` without a readable mapping."""
    if not path.is_file():
        return None, None
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read the run's configuration ({type(err).__name__}: {err})") from err
    if not isinstance(data, dict):
        return None, None
    kept = {k: v for k, v in data.items() if k not in SEED_ONLY_SETTINGS}
    name = data.get("name")
    return json.dumps(kept, sort_keys=True, default=str), (str(name) if name is not None else None)


def is_metric(key: str) -> bool:
    """A metric the comparison lists: not a probe's chosen weight decay (a setting the probe
    picked, not a result) and not a chance level (shown beside its metric)."""
    return not key.endswith("/weight_decay") and not is_chance_key(key)


@dataclass
class Configuration:
    """Runs that differ only in their seed (:data:`SEED_ONLY_SETTINGS`)."""

    label: str
    runs: list[RunMetrics]

    def values(self, key: str) -> list[float]:
        return [r.metrics[key] for r in self.runs if key in r.metrics and math.isfinite(r.metrics[key])]


def group_by_configuration(runs: list[RunMetrics]) -> list[Configuration]:
    """The runs grouped by configuration, in the order of their first run; a run without a
    ``config.yaml`` is a configuration of its own. Labels: the recipe's name (numbered where
    two configurations share one), else the run's label."""
    groups: dict[str, list[RunMetrics]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.configuration if r.configuration is not None else f"run {i}", []).append(r)
    configurations = [Configuration(g[0].config_name or g[0].label, g) for g in groups.values()]
    seen: dict[str, int] = {}
    for c in configurations:
        seen[c.label] = seen.get(c.label, 0) + 1
        if seen[c.label] > 1:
            c.label = f"{c.label}#{seen[c.label] - 1}"
    return configurations


def mean_and_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1 in the denominator; None for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# A difference between two configurations' means is "within noise" when it is at most this
# many standard errors of the difference, sqrt(s_a^2 / n_a + s_b^2 / n_b) (about a 95 % band).
NOISE_STANDARD_ERRORS = 2.0


def within_noise(a: list[float], b: list[float]) -> tuple[bool, float] | None:
    """``(within, band)`` for the difference of the means of seeds ``a`` and ``b``: band =
    :data:`NOISE_STANDARD_ERRORS` standard errors of the difference; None when either has
    fewer than 2 seeds (its noise is unknown)."""
    (ma, sa), (mb, sb) = mean_and_std(a), mean_and_std(b)
    if sa is None or sb is None:
        return None
    band = NOISE_STANDARD_ERRORS * math.sqrt(sa**2 / len(a) + sb**2 / len(b))
    return abs(ma - mb) <= band, band


def seeds_lines(configurations: list[Configuration], keys: list[str], compared: list[str]) -> list[str]:
    """The comparison's "over seeds" section: per configuration and metric, mean ± standard
    deviation over its seeds and their number; then, for the ``compared`` metrics, each pair
    of configurations whose difference is within noise (or whose noise is unknown)."""
    header = ["metric"] + [c.label for c in configurations]
    lines = ["## Over seeds", "",
             "Runs that differ only in their seed are one configuration: mean ± standard deviation over "
             "its seeds (n - 1 in the denominator), with the number of seeds n.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             "| seeds | " + " | ".join(str(len(c.runs)) for c in configurations) + " |"]
    for key in keys:
        cells = []
        for c in configurations:
            values = c.values(key)
            if not values:
                cells.append("-")
                continue
            mean, std = mean_and_std(values)
            cells.append(f"{format_metric(mean)} ± {format_metric(std)} (n={len(values)})" if std is not None
                         else f"{format_metric(mean)} (n=1)")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    notes = []
    for key in compared:
        for i, a in enumerate(configurations):
            for b in configurations[i + 1:]:
                va, vb = a.values(key), b.values(key)
                if not va or not vb:
                    continue
                verdict = within_noise(va, vb)
                difference = format_metric(mean_and_std(va)[0] - mean_and_std(vb)[0], signed=True)
                if verdict is None:
                    notes.append(f"- {key}: {a.label} - {b.label} = {difference}; noise unknown (fewer than 2 seeds)")
                elif verdict[0]:
                    notes.append(f"- {key}: {a.label} - {b.label} = {difference} is within noise "
                                 f"({NOISE_STANDARD_ERRORS:g} standard errors: {format_metric(verdict[1])})")
    if notes:
        lines += ["", "Differences that the seeds do not resolve:", "", *notes]
    return lines + [""]


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


def run_headline(run: RunMetrics) -> list[str]:
    """The metrics a run leads with, as ``mmviews train`` printed them: the ``headline`` of its
    ``results.json`` (those of them the compared evaluation holds); for a run without one (a
    ``metrics.json`` file, an evaluation of ``mmviews eval``), the same choice
    (:func:`mmviews.eval.summary.headline_metrics`) made over its metrics."""
    listed = run.results.get("headline")
    keys = [h["metric"] for h in listed if isinstance(h, dict) and h.get("metric") in run.metrics] \
        if isinstance(listed, list) else []
    # (which keys it picks does not depend on the baseline: none is given)
    return keys or [h["metric"] for h in run_headline_metrics(run.metrics, None)]


def headline_keys(runs: list[RunMetrics]) -> list[str]:
    """Every run's headline (:func:`run_headline`), in the order the runs first list them."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run_headline(run) if k not in keys and is_metric(k)]
    return keys


def _unique_labels(runs: list[RunMetrics]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        if r.label in seen:
            seen[r.label] += 1
            r.label = f"{r.label}#{seen[r.label]}"
        else:
            seen[r.label] = 0


def run_table_lines(runs: list[RunMetrics], keys: list[str]) -> list[str]:
    """The per-run table: columns the runs and the chance level; rows what each run is (objective,
    M, steps, final loss, wall time, warnings) and the metrics ``keys``."""
    header = ["metric"] + [r.label for r in runs] + ["chance"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    info_rows = [("objective", [r.objective for r in runs]), ("num_views", [r.num_views for r in runs]),
                 ("steps", [r.results.get("steps") for r in runs]),
                 ("final training loss", [r.results.get("final_loss") for r in runs]),
                 ("wall time (s)", [r.results.get("wall_time_s") for r in runs])]
    for name, values in info_rows:
        cells = ["-" if v is None else str(int(v)) if isinstance(v, float) and v.is_integer() else _format(v) for v in values]
        lines.append(f"| {name} | " + " | ".join(cells) + " | |")
    lines.append("| warnings | " + " | ".join(str(len(r.warnings)) for r in runs) + " | |")
    for k in keys:
        chance = next((c for c in (chance_level(k, r.metrics) for r in runs if k in r.metrics) if c is not None), None)
        lines.append(f"| {k} | " + " | ".join(_format(r.metrics[k]) if k in r.metrics else "-" for r in runs)
                     + f" | {'' if chance is None else format_metric(chance)} |")
    return lines


def compare_runs(paths: list[str | Path], out_dir: str | Path, metrics: list[str] | None = None,
                 summary_lines: list[str] | None = None) -> dict[str, Path]:
    """Writes the comparison of ``paths`` into ``out_dir``; returns name -> written path.
    ``summary_lines``, when given, is filled with the short version ``mmviews compare`` prints:
    the health warnings, the over-seeds table (mean ± std per setting; where runs share a setting)
    and the per-run rows, of the headline (or ``metrics``) metrics only."""
    summary_lines = [] if summary_lines is None else summary_lines
    if not paths:
        raise ValueError("compare needs at least one run")
    runs = [load_run_metrics(p) for p in paths]
    _unique_labels(runs)
    keys = sorted(k for k in set().union(*(r.metrics for r in runs)) if is_metric(k))
    if metrics:
        missing = [m for m in metrics if m not in keys]
        if missing:
            raise ValueError(f"metrics {missing} are in none of the runs; known: {keys}")
    plotted = metrics or headline_keys(runs)
    configurations = group_by_configuration(runs)
    out = Path(out_dir)
    written: dict[str, Path] = {}

    lines = ["# Run comparison", ""]
    warned = [(r.label, w) for r in runs for w in r.warnings]
    if warned:  # a run that collapsed or did not align says so before its numbers are read
        lines += ["## Warnings: did it learn?", "", *(f"- {label}: {w}" for label, w in warned), ""]
    seeded = any(len(c.runs) > 1 for c in configurations)
    if seeded:  # what several seeds per setting are run for comes first: each setting's mean and spread
        lines += seeds_lines(configurations, [k for k in keys if not k.endswith("/n")], plotted)
    lines += ["## Per run", "", *run_table_lines(runs, keys)]
    baseline_keys = [k for k in keys if any(k in r.random_init and k in r.metrics for r in runs)
                     and not k.endswith("/n")]
    run_header = ["metric"] + [r.label for r in runs]
    if baseline_keys:
        lines += ["", "Trained minus random init (each run against its own encoder as initialised; "
                  "random-init value in brackets):", "", "| " + " | ".join(run_header) + " |",
                  "|" + "---|" * len(run_header)]
        for k in baseline_keys:
            cells = [f"{format_metric(r.metrics[k] - r.random_init[k], signed=True)} ({_format(r.random_init[k])})"
                     if k in r.metrics and k in r.random_init else "-" for r in runs]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    # the terminal's short version: the warnings, the seeds table and the per-run rows of the headline metrics
    summary = ["## Warnings: did it learn?", "", *(f"- {label}: {w}" for label, w in warned), ""] if warned else []
    if seeded:
        summary += seeds_lines(configurations, plotted, plotted)
    summary += ["## Per run" + (" (headline metrics)" if plotted != keys else ""), "", *run_table_lines(runs, plotted)]
    summary_lines[:] = summary
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
        {r.label: {"path": str(r.path), "objective": r.objective, "num_views": r.num_views,
                   "metrics": {k: v for k, v in r.metrics.items() if is_metric(k)},
                   "random_init": r.random_init, "steps": r.results.get("steps"),
                   "final_loss": r.results.get("final_loss"), "wall_time_s": r.results.get("wall_time_s"),
                   "warnings": r.warnings,
                   "configuration": next(c.label for c in configurations if r in c.runs)}
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


def panel_title(key: str, width: int = TITLE_WIDTH) -> str:
    """``key`` as a panel title: broken at the "/" nearest its middle when longer than
    ``width`` (so titles of neighbouring panels do not run into each other), with "(lower is
    better)" for an error or loss."""
    title = key
    if len(key) > width and "/" in key:
        cuts = [i + 1 for i, c in enumerate(key[:-1]) if c == "/"]
        cut = min(cuts, key=lambda i: abs(len(key) - 2 * i))
        title = key[:cut] + "\n" + key[cut:]
    return title + ("\n(lower is better)" if _lower_is_better(key) else "")


def _plot_bars(runs: list[RunMetrics], keys: list[str], path: Path) -> Path:
    """One panel per metric, :data:`BAR_COLUMNS` to a row: a bar per run, each run's random-init
    value as a black tick over its bar, and the metric's chance level as a grey dotted line
    (one line where the runs share it, else a tick per run); one legend under the panels."""
    plt = _pyplot()
    columns = min(len(keys), BAR_COLUMNS)
    rows = math.ceil(len(keys) / columns)
    width = max(2.8, 0.45 * len(runs) + 1.2)  # inches per panel: room for the runs' bars and a title
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, 3.6 * rows), squeeze=False)
    x = np.arange(len(runs))
    for ax, key in zip(axes.flat, keys):
        values = [r.metrics.get(key, math.nan) for r in runs]
        ax.bar(x, values, color=[f"C{i % 10}" for i in range(len(runs))])
        baseline = [r.random_init.get(key, math.nan) for r in runs]
        if any(math.isfinite(v) for v in baseline):  # each run's encoder as initialised
            ax.scatter(x, baseline, marker="_", s=400, color="black", label="random init", zorder=3)
        chances = [chance_level(key, r.metrics) if key in r.metrics else None for r in runs]
        known = {c for c in chances if c is not None}
        if len(known) == 1:
            ax.axhline(known.pop(), color="grey", ls=":", lw=1.2, label="chance", zorder=2)
        elif known:  # runs on different data: each its own chance
            ax.scatter(x, [math.nan if c is None else c for c in chances], marker="_", s=400, color="grey",
                       label="chance", zorder=3)
        ax.set_xticks(x, [r.label for r in runs], rotation=45, ha="right", fontsize=8)
        ax.set_title(panel_title(key), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:  # the last row's empty panels
        ax.set_visible(False)
    fig.tight_layout()
    # one legend for the figure, under the panels: in a panel it would cover bars and ticks
    legend: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=len(legend), fontsize=7, frameon=False)
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
    parser.add_argument("--all", action="store_true",
                        help="print the whole comparison.md (every metric, the random-init margins); by default the "
                        "terminal gets the over-seeds table and the per-run rows of the headline metrics")
    parser.add_argument("--output", "--out", "-o", dest="out", default="comparison",
                        help="output folder (default: ./comparison)")
    parser.add_argument("--metrics", nargs="+", default=None, help="metrics to plot (default: headline metrics)")


def run(args: argparse.Namespace) -> int:
    check_writable(args.out)
    summary: list[str] = []
    written = compare_runs(args.runs, args.out, args.metrics, summary)  # errors: one line, exit 2 (mmviews.cli.main)
    if args.all:
        print((Path(args.out) / "comparison.md").read_text())
    else:
        print("\n".join(summary))
        print(f"\nevery metric and the random-init margins: {written['markdown']} (or mmviews compare ... --all)")
    print("written: " + ", ".join(str(p) for p in written.values()))
    return 0
