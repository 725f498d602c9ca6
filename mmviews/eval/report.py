"""Evaluation reports: ``metrics.json``, a Markdown summary and PNG plots.

Every file is written to a temporary name in the same folder and moved into place with
``os.replace``, so a crash never leaves a half-written report. Plots use matplotlib's Agg
backend (no display needed).
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from mmviews.fileio import atomic_save, atomic_write_text
from mmviews.eval.metrics import ACC2_CONVENTIONS


def _jsonable(obj: Any) -> Any:
    """NaN/inf become None (standard JSON has no NaN); numpy/torch scalars become floats."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(_jsonable(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig: Any, path: Path) -> Path:
    """Save ``fig`` as a PNG atomically and close it."""
    try:
        return atomic_save(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight"))
    finally:
        _pyplot().close(fig)


def read_log_csv(csv_path: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reads a training log with a ``step`` column; returns column -> (steps, values) for
    every other column that has numeric values (empty cells are skipped)."""
    csv_path = Path(csv_path)
    if not csv_path.is_file():
        raise FileNotFoundError(f"training log {csv_path} does not exist")
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{csv_path}: a training log needs a 'step' column, got columns {reader.fieldnames}")
        columns: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in reader.fieldnames if c != "step"}
        for line_no, row in enumerate(reader, start=2):
            try:
                step = float(row["step"])
            except (TypeError, ValueError):
                raise ValueError(f"{csv_path}:{line_no}: step {row['step']!r} is not a number") from None
            for c in columns:
                try:
                    value = float(row[c])
                except (TypeError, ValueError):
                    continue  # empty cell (metric not logged at this step) or text column
                columns[c][0].append(step)
                columns[c][1].append(value)
    return {c: (np.asarray(s), np.asarray(v)) for c, (s, v) in columns.items() if v}


# Columns of the trainer's metrics.csv that get a panel of their own or share one, in this
# order; the objective's other metrics follow, one panel each. ``epoch`` and ``time_s`` are
# only other x axes and get no panel.
_CURVE_PANELS = (
    ("loss", ("loss",)),
    ("MI lower bound (nats)", ("mi_lower_bound",)),
    ("cosine similarity", ("pos_sim", "neg_sim")),
)
_NOT_PLOTTED = frozenset({"epoch", "time_s"})


def training_curve_panels(columns: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``[(title, columns plotted in the panel)]`` for a training log's columns: the loss, the
    MI bound (poly-view objectives), positive and negative similarity in one panel, the
    objective's other metrics, the learning rates in one panel, the throughput."""
    columns = [c for c in columns if c not in _NOT_PLOTTED]
    panels = [(title, [c for c in names if c in columns]) for title, names in _CURVE_PANELS]
    lrs = [c for c in columns if c == "lr" or c.startswith("lr_")]
    grouped = {c for _, names in _CURVE_PANELS for c in names} | set(lrs) | {"samples_per_s"}
    panels += [(c, [c]) for c in columns if c not in grouped]
    panels += [("learning rate", lrs), ("throughput (samples/s)", [c for c in ("samples_per_s",) if c in columns])]
    return [(title, names) for title, names in panels if names]


def plot_training_curves(csv_path: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """The panels of :func:`training_curve_panels` against the optimiser step."""
    curves = read_log_csv(csv_path)
    panels = training_curve_panels(curves)
    if not panels:
        raise ValueError(f"{csv_path}: no numeric column to plot besides 'step', 'epoch' and 'time_s'")
    plt = _pyplot()
    n = len(panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False, layout="constrained")
    for ax, (title, names) in zip(axes.flat, panels):
        for name in names:
            steps, values = curves[name]
            ax.plot(steps, values, lw=1.2, label=name)
        if len(names) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("training curves")
    return _save_figure(fig, Path(out_png))


def plot_similarity_histograms(pos: np.ndarray, neg: np.ndarray, out_png: str | os.PathLike) -> Path:
    """Overlaid densities of positive- and negative-pair cosine similarities on [-1, 1]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.linspace(-1.0, 1.0, 81)
    if len(neg):
        ax.hist(np.asarray(neg), bins=bins, density=True, alpha=0.6, label=f"negative pairs (n={len(neg)})")
    if len(pos):
        ax.hist(np.asarray(pos), bins=bins, density=True, alpha=0.6, label=f"positive pairs (n={len(pos)})")
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.legend()
    ax.set_title("positive vs negative similarities")
    return _save_figure(fig, Path(out_png))


def plot_spectrum(spectra: Mapping[str, np.ndarray], out_png: str | os.PathLike) -> Path:
    """Normalised singular values (s / s_max) on a log scale, one line per embedding matrix."""
    if not spectra:
        raise ValueError("plot_spectrum needs at least one spectrum")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in spectra.items():
        s = np.asarray(s, dtype=np.float64)
        if s.size == 0 or s[0] <= 0:
            continue
        ax.semilogy(np.arange(1, s.size + 1), np.maximum(s / s[0], 1e-16), label=name)
    ax.set_xlabel("index")
    ax.set_ylabel("singular value / largest")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("singular-value spectrum")
    return _save_figure(fig, Path(out_png))


# Significant digits a metric keeps below 0.1 (an MSE of 0.00021 is not printed as 0.0002).
METRIC_SIGNIFICANT_DIGITS = 3


def format_metric(value: Any, signed: bool = False) -> str:
    """A metric as the reports and the terminal print it: 4 decimals from 0.1 up to 10^4;
    below 0.1, as many decimals as keep 3 significant digits (0.0036 -> ``0.00360``, an MSE
    of 0.00021 -> ``0.000210``, not ``0.0002`` or ``0.0000``); in exponent form below 10^-4
    (3 significant digits: a weight decay ``1e-05``) and from 10^4 up (4). ``signed``: a sign on every value (a
    difference). ``n/a`` for None, NaN and inf; anything else that is not a number as
    ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a" if value is None else str(value)
    value = float(value)
    if not math.isfinite(value):
        return "n/a"
    sign = "+" if signed else ""
    size = abs(value)
    if size == 0 or 0.1 <= size < 1e4:
        return f"{value:{sign}.4f}"
    if 1e-4 <= size < 0.1:
        decimals = METRIC_SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(size))
        return f"{value:{sign}.{decimals}f}"
    if size < 1e-4:
        return f"{value:{sign}.{METRIC_SIGNIFICANT_DIGITS}g}"
    return f"{value:{sign}.4g}"  # 10^4 and up: 4 significant digits


def _format(value: Any) -> str:
    """Meta values and metrics in a report: numbers by :func:`format_metric`, ints as such."""
    if isinstance(value, float):
        return format_metric(value)
    return str(value)


def acc2_note(metric_names: Iterable[str] | None = None) -> str:
    """The Markdown paragraph that names the Acc-2 conventions; empty when ``metric_names`` is
    given and holds no binary-sentiment accuracy (a class probe needs no such note)."""
    if metric_names is not None and not any(name.rsplit("/", 1)[-1] in ACC2_CONVENTIONS for name in metric_names):
        return ""
    lines = ["Acc-2 conventions (papers disagree on which one they print; both are reported):", ""]
    lines += [f"- `{k}`: {v}" for k, v in ACC2_CONVENTIONS.items()]
    return "\n".join(lines)


def markdown_summary(metrics: Mapping[str, Any], meta: Mapping[str, Any] | None = None, title: str = "Evaluation") -> str:
    lines = [f"# {title}", ""]
    for k, v in (meta or {}).items():
        if isinstance(v, (str, int, float, bool)):
            lines.append(f"- {k}: {_format(v)}")
    from mmviews.eval.health import chance_level, is_chance_key

    # retrieval and alignment figures with the value that embeddings carrying no information give
    lines += ["", "| metric | value | chance |", "|---|---|---|"]
    for k, v in sorted(metrics.items()):
        if is_chance_key(k):
            continue  # shown in the chance column of its metric
        chance = chance_level(k, metrics)
        lines.append(f"| {k} | {_format(v)} | {'' if chance is None else _format(float(chance))} |")
    lines += ["", "Accuracies, F1 and R@k are fractions in [0, 1].", "", acc2_note(metrics), ""]
    return "\n".join(lines)


def write_report(
    out_dir: str | os.PathLike,
    metrics: Mapping[str, Any],
    *,
    meta: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    log_csv: str | os.PathLike | None = None,
    title: str = "mmviews evaluation",
    plots: bool = True,
) -> dict[str, Path]:
    """Writes ``metrics.json`` (``{"metrics": ..., "meta": ...}``), ``summary.md`` and plots.

    Args:
        metrics: flat name -> value mapping.
        meta: run information (dataset sizes, view names, tasks ...), stored in the JSON.
        data: arrays from :func:`mmviews.eval.representation_diagnostics`: ``sim_pos`` /
            ``sim_neg`` give ``similarity_hist.png``; ``spectrum/<name>`` entries give
            ``spectrum.png``.
        log_csv: a training log with columns ``step,loss,...`` for ``training_curves.png``
            (skipped, with a note in the summary, if it does not exist).
        plots: ``False`` draws no PNG (a note in the summary says so); metrics and summary
            are the same.
    Returns:
        name -> written path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    data = data or {}
    notes: list[str] = []
    if not plots:
        notes.append("Plots not drawn (evaluation.plots: false).")
    elif log_csv is not None:
        if Path(log_csv).is_file():
            written["training_curves"] = plot_training_curves(log_csv, out / "training_curves.png")
        else:
            notes.append(f"No training log at {log_csv}; training curves not plotted.")
    if plots and "sim_pos" in data and "sim_neg" in data:
        written["similarity_hist"] = plot_similarity_histograms(data["sim_pos"], data["sim_neg"], out / "similarity_hist.png")
    spectra = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith("spectrum/")}
    if plots and spectra:
        written["spectrum"] = plot_spectrum(spectra, out / "spectrum.png")
    meta = dict(meta or {})
    meta["plots"] = sorted(p.name for p in written.values())
    written["metrics"] = atomic_write_json(out / "metrics.json", {"metrics": dict(metrics), "meta": meta})
    summary = markdown_summary(metrics, meta, title)
    if notes:
        summary += "\n" + "\n".join(notes) + "\n"
    if written.keys() - {"metrics"}:
        summary += "\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for k, p in written.items() if k != "metrics") + "\n"
    written["summary"] = atomic_write_text(out / "summary.md", summary)
    return written
