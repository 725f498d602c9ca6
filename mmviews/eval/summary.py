"""A run's summary: ``results.json`` (strict JSON, the status), ``report.md``, and the headline
metrics (trained against random initialisation, beside each chance level) that ``mmviews train``
and ``mmviews eval`` print."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Mapping

from mmviews.eval.health import HealthSettings, chance_level, run_warnings
from mmviews.eval.identifiability import finding_lines
from mmviews.eval.report import format_metric
from mmviews.fileio import atomic_write_text
from mmviews.run import EVAL_METRICS_FILE, LOG_FILE, REPORT_FILE, RESULTS_FILE


def read_eval_metrics(eval_dir: Path) -> dict[str, float] | None:
    """The metrics of an evaluation folder's ``metrics.json``, or None if it has none."""
    path = eval_dir / EVAL_METRICS_FILE
    return json.loads(path.read_text())["metrics"] if path.is_file() else None


def _lower_is_better(metric: str) -> bool:
    leaf = metric.rsplit("/", 1)[-1].lower()
    return leaf in {"mse", "rmse", "loss"} or leaf.startswith("mae")  # mae, mae_7 (MSA)


def _finite_or_none(value: Any, key: str, bad: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(key)
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v, f"{key}.{k}" if key else str(k), bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v, f"{key}.{i}", bad) for i, v in enumerate(value)]
    return value


def finalise_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as valid JSON data: a non-finite number (NaN, inf) becomes None and
    marks the run ``"status": "failed"`` with a ``"reason"`` naming the keys; otherwise
    ``"status": "ok"``."""
    bad: list[str] = []
    clean = _finite_or_none(dict(summary), "", bad)
    if bad:
        clean["status"] = "failed"
        clean["reason"] = f"non-finite values (written as null): {', '.join(bad)}"
    else:
        clean.setdefault("status", "ok")
    return clean


def read_training_log(path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.csv`` (empty when there is none or it cannot be read)."""
    try:
        with path.open(newline="") as f:
            return [dict(row) for row in csv.DictReader(f)]
    except (OSError, csv.Error, UnicodeDecodeError):
        return []


def epochs_text(summary: Mapping[str, Any]) -> str:
    """How much of the training split a run went through, for its report and model card:
    ``"2 epochs"``, or the fraction it saw (``"0.0183 of an epoch"``) where it stopped inside an
    epoch: a split of fresh samples (the identifiability data's 2^24) is never gone through, and
    its count of completed epochs, 0, would read as no training. From ``epochs_trained`` (the
    fraction, written since it exists), else ``epochs`` (completed epochs)."""
    done = summary.get("epochs_trained")
    if done is None:
        completed = int(summary.get("epochs") or 0)
        if completed == 0 and (summary.get("steps") or 0) > 0:
            return "less than one epoch"
        done = completed
    done = float(done)
    if done.is_integer():
        return f"{int(done)} epoch" + ("" if done == 1 else "s")
    return f"{done:.3g} of an epoch" if done < 1 else f"{done:.3g} epochs"


# Where train() logs the end of a run (its warnings, its headline metrics) for Python users;
# ``mmviews train`` prints them itself and silences this logger.
RESULTS_LOGGER = "mmviews.train.results"
# The probe tasks whose metrics head a run's results; retrieval adds its R@1.
_HEADLINE_TASKS = ("/linear/", "/knn/", "/regression/", "/msa/", "/prototype/")
_HEADLINE_DIAGNOSTICS = ("/diag/align", "/diag/unif", "/diag/erank/fused")


def headline_metrics(trained: dict[str, Any] | None, random_init: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The metrics a user reads first, trained against randomly initialised encoder:
    ``[{"metric", "trained", "random_init", "chance"}]`` (None where unknown) for the probes
    (linear, kNN, regression, MSA), the retrieval R@1 of the evaluated split (test, else
    val; the mean over the pairs when there are several) and the identifiability R^2 of the
    content and specific blocks; the main diagnostics when the run evaluated nothing else."""
    trained, random_init = trained or {}, random_init or {}
    split = "test/" if any(k.startswith("test/") for k in trained) else "val/"
    # retrieval and prototypes: the mean over pairs where there is one (12 directions for 4
    # modalities), else each pair's figure
    keys = [k for k in sorted(trained) if k.startswith(split) and not _has_mean_beside(k, trained) and (
        any(t in k for t in _HEADLINE_TASKS) or ("/retrieval/" in k and k.endswith("/R@1"))
        or ("/identifiability/" in k and ("/content/" in k or "/specific/" in k)))]
    if not keys:
        keys = [k for k in sorted(trained) if k.startswith(split) and k.endswith(_HEADLINE_DIAGNOSTICS)]
    return [{"metric": k, "trained": trained[k], "random_init": random_init.get(k), "chance": chance_level(k, trained)}
            for k in keys]


def _has_mean_beside(key: str, metrics: Mapping[str, Any]) -> bool:
    """A per-pair metric (``.../a->b/R@1``) whose task also reports the mean over pairs."""
    head, _, leaf = key.rpartition("/")
    task, _, pair = head.rpartition("/")
    return "->" in pair and f"{task}/mean/{leaf}" in metrics


def headline_lines(headline: list[dict[str, Any]]) -> list[str]:
    """The headline metrics as aligned terminal lines, after a title line naming the split
    and whether a random-init baseline is beside them (``mmviews train``, ``mmviews eval``)."""
    if not headline:
        return []
    width = max(len(h["metric"]) for h in headline)
    split = "test" if headline[0]["metric"].startswith("test/") else "val"
    baseline = any(h.get("random_init") is not None for h in headline)
    lines = [f"{split} metrics" + (", trained vs random init:" if baseline else ":")]
    for h in headline:
        t, r, c = (_finite_float(h.get(k)) for k in ("trained", "random_init", "chance"))
        line = f"  {h['metric']:<{width}}  trained {format_metric(t)}"
        if r is not None:
            line += f"  random init {format_metric(r)}" + ("" if t is None else f"  ({format_metric(t - r, signed=True)})")
        if c is not None:
            line += f"  chance {format_metric(c)}"
        lines.append(line)
    return lines


def _finite_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def data_left_out_lines(data_skipped: dict[str, dict[str, Any]]) -> list[str]:
    """One line per split of ``results.json``'s ``data_skipped`` (what ``on_error: skip`` left
    out: :func:`mmviews.data.loaders.data_left_out`)."""
    lines = []
    for split, info in data_skipped.items():
        parts = []
        if info.get("shards"):
            parts.append(f"{len(info['shards'])} unreadable shard(s) ({', '.join(info['shards'])})")
        if info.get("row_groups"):
            parts.append(f"{len(info['row_groups'])} damaged row group(s), {info.get('rows_in_skipped_row_groups', 0)} rows "
                         f"({', '.join(info['row_groups'])})")
        if info.get("values_marked_absent"):
            parts.append(f"{info['values_marked_absent']} value(s) that could not be decoded, marked absent")
        extra = [f"{k}: {v}" for k, v in info.items()
                 if k not in ("shards", "row_groups", "rows_in_skipped_row_groups", "values_marked_absent") and v]
        lines.append(f"split {split!r}: " + "; ".join(parts + extra))
    return lines


def data_report_lines(summary: Mapping[str, Any]) -> list[str]:
    """The report's "Data left out" section: per split, the samples lost (``data_losses``,
    :mod:`mmviews.data.losses`), and the modalities no sample has; nothing when none."""
    from mmviews.data.losses import ABSENT_MODALITIES_KEY, DATA_LOSSES_KEY, loss_lines

    losses = summary.get(DATA_LOSSES_KEY) or {}
    absent = summary.get(ABSENT_MODALITIES_KEY) or {}
    lines = (loss_lines(losses) + data_left_out_lines(summary.get("data_skipped") or {})
             + list(absent.values()))
    if not lines:
        return []
    examples = [e for r in losses.values() for e in r.get("examples") or []]
    return (["## Data left out", "", *(f"- {line}" for line in lines), ""]
            + (["Examples:", "", *(f"- `{e}`" for e in examples), ""] if examples else []))


def write_results(run_dir: Path, summary: dict[str, Any], settings: HealthSettings | None = None) -> None:
    """``results.json`` and ``report.md``: the run summary and, per metric, trained vs
    randomly initialised encoder. The JSON is strict (no NaN; see :func:`finalise_summary`).

    Adds ``summary["warnings"]`` (to the dict given, so the caller can print them): the
    collapse, chance-level and below-random-init checks of :mod:`mmviews.eval.health` on the
    training log and the evaluation, with the one hint that fits the run's ``settings``; the
    report lists them first."""
    summary["warnings"] = run_warnings(read_training_log(run_dir / LOG_FILE), summary.get("eval"),
                                       summary.get("eval_random"), settings)
    summary = finalise_summary(summary)
    atomic_write_text(run_dir / RESULTS_FILE, json.dumps(summary, indent=2, default=str, allow_nan=False))
    lines = [f"# Run report: {summary['name']}", "",
             f"- objective: {summary['objective']}",
             f"- optimiser steps: {summary['steps']} ({epochs_text(summary)}, {summary['samples_seen']} samples"
             + (f"; global batch {summary['global_batch_size']} x {summary.get('grad_accum_steps', 1)} micro-batch(es)"
                if summary.get("global_batch_size") is not None else "") + ")",
             f"- final training loss: {format_metric(summary['final_loss'])}",
             f"- wall time: {summary['wall_time_s']:.1f} s on {summary['num_processes']} process(es), {summary['device']}"
             + (" (every leg of the resumed run, each up to the checkpoint the next one resumed from)"
                if summary.get("resumed_from") else ""),
             *([f"- status: **failed**: {summary['reason']}"] if summary["status"] == "failed" else []),
             ""]
    if summary["warnings"]:
        lines += ["## Warnings: did it learn?", "", *(f"- {message}" for message in summary["warnings"]), ""]
    lines += data_report_lines(summary)
    trained, random_ = summary["eval"], summary["eval_random"] or {}
    lines += finding_lines(trained, random_)
    if trained:
        lines += ["| metric | trained | random init | trained - random | chance |", "|---|---|---|---|---|"]
        for key in sorted(trained):
            if "weight_decay" in key or key.endswith("/n") or not key.startswith(("test/", "val/")):
                continue
            t = trained[key]
            r = random_.get(key)
            diff = "" if r is None or t is None else format_metric(t - r, signed=True) + (
                " (lower is better)" if _lower_is_better(key) else "")
            chance = chance_level(key, trained)
            lines.append(f"| {key} | {format_metric(t)} | {'' if r is None else format_metric(r)} | {diff} | "
                         f"{'' if chance is None else format_metric(chance)} |")
        lines += ["", "Full evaluation report: [eval/summary.md](eval/summary.md)"
                  + ("; random-initialisation baseline: [eval_random/summary.md](eval_random/summary.md)" if random_ else ""), ""]
    atomic_write_text(run_dir / REPORT_FILE, "\n".join(lines))
