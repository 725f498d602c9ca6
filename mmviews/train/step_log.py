"""What a run records per optimiser step: the ``metrics.csv`` row, the same row to the experiment
trackers (:mod:`mmviews.train.trackers`), the live health checks and the progress bar.

A ``metrics.csv`` row holds ``step``, ``epoch`` (fractional), ``loss`` (mean over
processes), the objective's metrics (and the critic's, e.g. IPMC) in name order,
``mi_lower_bound = log(K M - M + 1) - loss`` for objectives whose ``poly_view_bound`` is True
(K the global batch, M the views), one ``lr_<part>`` column per parameter group name (backbone,
head), ``samples_per_s`` and ``time_s`` (since the start of ``train``).
"""

from __future__ import annotations

import csv
import io
import os
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from mmviews.config import TrainConfig
from mmviews.eval.health import HealthSettings, LiveHealth
from mmviews.fileio import DiskFullError, atomic_write_text, disk_full, fsync_path
from mmviews.notices import MMViewsWarning
from mmviews.objectives import ObjectiveOutput, mi_lower_bound
from mmviews.run import LOG_FILE, REPORT_FILE, RESULTS_FILE, record_run_outputs
from mmviews.train.state import TrainState
from mmviews.train.trackers import flat_hparams, record_tracker_runs, tracker_init_kwargs, tracker_metric_name


class CSVLogger:
    """Appends one row per logged step to ``metrics.csv`` (main process only). The columns
    are fixed by the first row. On resume, rows after the checkpoint's step are dropped. The rows
    reach the disk (:meth:`sync`) before each checkpoint is committed."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.fields: list[str] | None = None
        self.last_loss: float | None = None  # loss of the last row kept on resume
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
                if rows and rows[-1].get("loss"):
                    self.last_loss = float(rows[-1]["loss"])
        elif path.exists():
            path.unlink()

    def log(self, row: dict[str, Any]) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.fields, extrasaction="ignore", restval="")
        if new:
            writer.writeheader()
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with disk_full(self.path.parent, self.path.name, len(text.getvalue().encode())):
                with self.path.open("a", newline="") as f:
                    f.write(text.getvalue())
        except DiskFullError:
            os.truncate(self.path, size)  # no half row: the log stays readable for a resume
            raise
        if new:
            record_run_outputs(self.path.parent)  # the run's manifest lists the log from its first row

    def sync(self) -> None:
        """Flush the rows written so far to the disk (``fsync``): called before each checkpoint is
        committed, so that after a power cut a resumed run's log has every row up to its step."""
        if self.path.exists():
            with disk_full(self.path.parent, self.path.name, 0):
                fsync_path(self.path)


class StepLogger:
    """Per optimiser step: the ``metrics.csv`` row (every ``output.log_every`` steps and at the
    last one), the same row to the Accelerate ``trackers`` (:func:`resolve_trackers`; the
    accelerator was made with ``log_with=trackers``) and the progress bar, or with
    ``output.progress_bar: false`` a line per logged step on standard output.

    Every process calls :meth:`log` (the metrics are averaged over processes); only the main
    process writes (Accelerate's trackers act on the main process only)."""

    def __init__(self, accelerator: Any, config: TrainConfig, run_dir: Path, *, trackers: Sequence[str],
                 total_steps: int, batches_per_epoch: int, poly_view_bound: bool, state: TrainState,
                 resumed: bool, started: float) -> None:
        self.accelerator = accelerator
        self.log_every = config.output.log_every
        self.total_steps, self.batches_per_epoch = total_steps, batches_per_epoch
        self.poly_view_bound = poly_view_bound
        self.grad_accum_steps = config.optimisation.grad_accum_steps
        main = accelerator.is_main_process
        self.csv = CSVLogger(run_dir / LOG_FILE, resume_step=state.step if resumed else None) if main else None
        self.trackers = list(trackers)
        self.run_dir = run_dir
        if self.trackers:  # project = the recipe's name (TensorBoard: <run>/logs/<name>/)
            init_kwargs = tracker_init_kwargs(self.trackers, run_dir, resumed) if main else {}
            accelerator.init_trackers(config.name, config=flat_hparams(config), init_kwargs=init_kwargs)
            if main:
                record_tracker_runs(accelerator, self.trackers, run_dir)
        self.bar = tqdm(total=total_steps, initial=state.step, desc="train",
                        disable=not (main and config.output.progress_bar), dynamic_ncols=True)
        # Without a progress bar (output.progress_bar: false, e.g. logs to a file), one line per log step.
        self.print_lines = main and not config.output.progress_bar
        self.started = started
        self.last_time = time.perf_counter()
        self.last_loss = float("nan")  # loss of the last logged step
        # divergence / collapse / chance-level warnings, printed once each, hints for this run's settings
        self.health = LiveHealth(total_steps, settings=HealthSettings.from_config(config))
        if self.csv is not None and self.csv.last_loss is not None:
            self.last_loss = self.csv.last_loss  # resumed at the end: no step left to log
        if resumed and accelerator.num_processes > 1:
            # Only the main process reads metrics.csv; the others take its last loss, or a run
            # resumed at its last step would end with a NaN loss (a "failed" status) on them.
            from accelerate.utils import broadcast_object_list

            self.last_loss = broadcast_object_list([self.last_loss], from_process=0)[0]

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
                for message in self.health.check(row):
                    # the command line shows it as one line on stderr (mmviews.notices)
                    warnings.warn(message, MMViewsWarning, stacklevel=2)
            if self.trackers:
                self.to_trackers({k: v for k, v in row.items() if k != "step"}, step=state.step)
            self.bar.set_postfix(loss=f"{self.last_loss:.4f}")
            if self.print_lines:
                print(f"step {state.step}/{self.total_steps}  epoch {row['epoch']:.2f}  loss {self.last_loss:.4f}  "
                      f"{row['samples_per_s']:.0f} samples/s  {row['time_s']:.0f} s", flush=True)
        self.bar.update(1)
        self.last_time = now

    def log_evaluation(self, metrics: dict[str, float], random_metrics: dict[str, float] | None, step: int) -> None:
        """The final evaluation to the trackers, at the last step: the trained encoder's metrics
        under their names (``test/linear/class/acc``), the random initialisation's under
        ``random_init/...``."""
        if not self.trackers:
            return
        values = {k: float(v) for k, v in metrics.items()}
        values.update({f"random_init/{k}": float(v) for k, v in (random_metrics or {}).items()})
        if values:
            self.to_trackers(values, step=step)

    def to_trackers(self, values: dict[str, Any], step: int) -> None:
        """``accelerator.log`` with each tracker's own spelling of the names (main process only)."""
        if not self.accelerator.is_main_process:
            return
        for name in self.trackers:
            named = {tracker_metric_name(name, k): v for k, v in values.items()}
            self.accelerator.get_tracker(name).log(named, step=step)

    def log_report(self) -> None:
        """The run's report to the trackers that keep files (MLflow artifacts, W&B run files):
        ``report.md``, ``results.json`` and the evaluation's plots (``eval*/**/*.png``), under
        their paths in the run folder (main process, at the end)."""
        if not self.accelerator.is_main_process or not ({"mlflow", "wandb"} & set(self.trackers)):
            return
        files = [self.run_dir / REPORT_FILE, self.run_dir / RESULTS_FILE]
        files += sorted(p for folder in sorted(self.run_dir.glob("eval*")) for p in folder.rglob("*.png"))
        for path in (p for p in files if p.is_file()):
            relative = path.relative_to(self.run_dir)
            if "mlflow" in self.trackers:
                folder = relative.parent.as_posix()
                self.accelerator.get_tracker("mlflow").log_artifact(str(path), None if folder == "." else folder)
            if "wandb" in self.trackers:
                run = self.accelerator.get_tracker("wandb", unwrap=True)
                run.save(str(path), base_path=str(self.run_dir), policy="now")

    def sync(self) -> None:
        """``metrics.csv``'s rows so far flushed to the disk (main process; :meth:`CSVLogger.sync`)."""
        if self.csv is not None:
            self.csv.sync()

    def close(self) -> None:
        self.bar.close()
