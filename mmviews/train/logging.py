"""What a run records: ``metrics.csv`` and TensorBoard per optimiser step, the progress bar,
and the summary (``results.json``, ``report.md``) at the end.

A ``metrics.csv`` row holds ``step``, ``epoch`` (fractional), ``loss`` (mean over
processes), the objective's metrics (and the critic's, e.g. IPMC) in name order,
``mi_lower_bound = log(K M - M + 1) - loss`` for objectives whose ``poly_view_bound`` is True
(K the global batch, M the views), one ``lr_<part>`` column per parameter group name (backbone,
head), ``samples_per_s`` and ``time_s`` (since the start of ``train``).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from mmviews.config import TrainConfig
from mmviews.fileio import atomic_write_text
from mmviews.objectives import ObjectiveOutput, mi_lower_bound
from mmviews.run import EVAL_METRICS_FILE, LOG_FILE, REPORT_FILE, RESULTS_FILE
from mmviews.train.checkpoint import TrainState


class CSVLogger:
    """Appends one row per logged step to ``metrics.csv`` (main process only). The columns
    are fixed by the first row. On resume, rows after the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.fields: list[str] | None = None
        if resume_step is not None and path.is_file():
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                fields = reader.fieldnames
                rows = [r for r in reader if int(float(r["step"])) <= resume_step]
            if fields:
                kept = io.StringIO()
                writer = csv.DictWriter(kept, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)
                atomic_write_text(path, kept.getvalue())
                self.fields = list(fields)
        elif path.exists():
            path.unlink()

    def log(self, row: dict[str, Any]) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore", restval="")
            if new:
                writer.writeheader()
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def flat_hparams(config: TrainConfig) -> dict[str, Any]:
    """The recipe as ``{"optimisation.lr": 0.001, ...}`` (scalars only), for TensorBoard."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, str, bool)):
            out[prefix] = value

    walk("", config.to_dict())
    return out


class StepLogger:
    """Per optimiser step: the ``metrics.csv`` row (every ``output.log_every`` steps and at the
    last one), TensorBoard (``output.tensorboard``, when installed) and the progress bar.

    Every process calls :meth:`log` (the metrics are averaged over processes); only the main
    process writes."""

    def __init__(self, accelerator: Any, config: TrainConfig, run_dir: Path, *, use_tensorboard: bool,
                 total_steps: int, batches_per_epoch: int, poly_view_bound: bool, state: TrainState,
                 resumed: bool, started: float) -> None:
        self.accelerator = accelerator
        self.log_every = config.output.log_every
        self.total_steps, self.batches_per_epoch = total_steps, batches_per_epoch
        self.poly_view_bound = poly_view_bound
        self.grad_accum_steps = config.optimisation.grad_accum_steps
        main = accelerator.is_main_process
        self.csv = CSVLogger(run_dir / LOG_FILE, resume_step=state.step if resumed else None) if main else None
        self.use_tensorboard = use_tensorboard
        if use_tensorboard:
            accelerator.init_trackers("tensorboard", config=flat_hparams(config))
        self.bar = tqdm(total=total_steps, initial=state.step, desc="train",
                        disable=not (main and config.output.progress_bar), dynamic_ncols=True)
        self.started = started
        self.last_time = time.perf_counter()
        self.last_loss = float("nan")  # loss of the last logged step

    def log(self, state: TrainState, out: ObjectiveOutput, extra_metrics: dict[str, Any], optimizer: Any,
            num_samples: int, num_views: int) -> None:
        """After optimiser step ``state.step``; ``out`` is the loss of the last micro-batch,
        ``extra_metrics`` the critic's, ``num_samples`` the micro-batch's samples on this process."""
        now = time.perf_counter()
        K = num_samples * self.accelerator.num_processes
        if state.step % self.log_every == 0 or state.step == self.total_steps:
            metrics = {**out.metrics, **extra_metrics}
            names = sorted(metrics)
            values = torch.stack([out.loss.detach().float()] + [
                torch.as_tensor(metrics[k], device=out.loss.device).float().reshape(()) for k in names])
            values = self.accelerator.reduce(values, reduction="mean").tolist()  # one collective for all
            self.last_loss = values[0]
            row: dict[str, Any] = {"step": state.step, "epoch": state.epoch + state.batch_in_epoch / self.batches_per_epoch,
                                   "loss": self.last_loss}
            row.update(zip(names, values[1:]))
            if self.poly_view_bound:
                row["mi_lower_bound"] = float(mi_lower_bound(self.last_loss, K, num_views))
            for group in optimizer.param_groups:  # one column per part (backbone, head)
                part = str(group.get("name", "group")).split(".")[-1].replace("_no_decay", "")
                row.setdefault(f"lr_{part}", group["lr"])
            row["samples_per_s"] = K * self.grad_accum_steps / max(now - self.last_time, 1e-9)
            row["time_s"] = now - self.started
            if self.csv is not None:
                self.csv.log(row)
            if self.use_tensorboard:
                self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
            self.bar.set_postfix(loss=f"{self.last_loss:.4f}")
        self.bar.update(1)
        self.last_time = now

    def close(self) -> None:
        self.bar.close()


def read_eval_metrics(eval_dir: Path) -> dict[str, float] | None:
    """The metrics of an evaluation folder's ``metrics.json``, or None if it has none."""
    path = eval_dir / EVAL_METRICS_FILE
    return json.loads(path.read_text())["metrics"] if path.is_file() else None


def _lower_is_better(metric: str) -> bool:
    leaf = metric.rsplit("/", 1)[-1].lower()
    return leaf in {"mae", "mse", "rmse", "loss"} or leaf.startswith("mae")


def write_results(run_dir: Path, summary: dict[str, Any]) -> None:
    """``results.json`` and ``report.md``: the run summary and, per metric, trained vs
    randomly initialised encoder."""
    atomic_write_text(run_dir / RESULTS_FILE, json.dumps(summary, indent=2, default=str))
    lines = [f"# Run report: {summary['name']}", "",
             f"- objective: {summary['objective']}",
             f"- optimiser steps: {summary['steps']} ({summary['epochs']} epochs, {summary['samples_seen']} samples)",
             f"- final training loss: {summary['final_loss']:.4f}",
             f"- wall time: {summary['wall_time_s']:.1f} s on {summary['num_processes']} process(es), {summary['device']}",
             ""]
    trained, random_ = summary["eval"], summary["eval_random"] or {}
    if trained:
        lines += ["| metric | trained | random init | trained - random |", "|---|---|---|---|"]
        for key in sorted(trained):
            if "weight_decay" in key or not key.startswith(("test/", "val/")):
                continue
            t = trained[key]
            r = random_.get(key)
            diff = "" if r is None else f"{t - r:+.4f}" + (" (lower is better)" if _lower_is_better(key) else "")
            lines.append(f"| {key} | {t:.4f} | {'' if r is None else f'{r:.4f}'} | {diff} |")
        lines += ["", "Full evaluation report: [eval/summary.md](eval/summary.md)"
                  + ("; random-initialisation baseline: [eval_random/summary.md](eval_random/summary.md)" if random_ else ""), ""]
    atomic_write_text(run_dir / REPORT_FILE, "\n".join(lines))
