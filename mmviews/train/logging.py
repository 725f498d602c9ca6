"""What a run records: ``metrics.csv`` and the experiment trackers (``output.trackers``, e.g.
TensorBoard, MLflow, Weights & Biases) per optimiser step, the progress bar, and the summary
(``results.json``, ``report.md``) at the end.

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
import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mmviews.config import ConfigError, TrainConfig
from mmviews.eval.health import HealthSettings, LiveHealth, chance_level, run_warnings
from mmviews.eval.report import format_metric
from mmviews.fileio import atomic_write_text, read_json_object
from mmviews.objectives import ObjectiveOutput, mi_lower_bound
from mmviews.run import EVAL_METRICS_FILE, LOG_FILE, REPORT_FILE, RESULTS_FILE, record_run_outputs
from mmviews.train.state import TrainState
from mmviews.notices import MMViewsWarning


class CSVLogger:
    """Appends one row per logged step to ``metrics.csv`` (main process only). The columns
    are fixed by the first row. On resume, rows after the checkpoint's step are dropped."""

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
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore", restval="")
            if new:
                writer.writeheader()
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        if new:
            record_run_outputs(self.path.parent)  # the run's manifest lists the log from its first row


# Accelerate tracker name -> the modules any one of which makes it usable (Accelerate's own
# availability test silently drops a tracker whose package is missing; we refuse instead).
_TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"), "aim": ("aim",), "mlflow": ("mlflow",), "wandb": ("wandb",),
    "comet_ml": ("comet_ml",), "clearml": ("clearml",), "dvclive": ("dvclive",), "swanlab": ("swanlab",),
    "trackio": ("trackio",),
}
#: Sub-folder of the run folder given to Accelerate as ``logging_dir``; file-based trackers
#: write under ``<run>/logs/<recipe name>/`` (TensorBoard's event files).
TRACKERS_DIR = "logs"
#: In ``<run>/logs/``: the run id each tracker gave this run (``{"mlflow": ..., "wandb": ...}``),
#: read on resume so that a resumed run goes on logging into the same tracker run.
TRACKER_RUNS_FILE = "tracker_runs.json"
#: Where MLflow writes unless ``MLFLOW_TRACKING_URI`` names a server or database: a file store
#: in the run folder (``mlflow ui --backend-store-uri <run>/logs/mlruns``).
MLFLOW_STORE_DIR = "mlruns"
# MLflow metric and parameter names: letters, digits and ``_ - . / : space`` (no ``@``).
_MLFLOW_NAME_REFUSED = re.compile(r"[^\w\-./: ]")


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def tracker_installed(name: str) -> bool:
    """Whether the package of Accelerate tracker ``name`` can be imported."""
    return any(importlib.util.find_spec(module) is not None for module in _TRACKER_MODULES[name])


def check_trackers_installed(config: TrainConfig, source: str = "recipe") -> None:
    """A :class:`ConfigError` naming the key ``output.trackers`` and what to ``pip install``
    for the first tracker there whose package is missing (``mmviews train --check`` and the
    command itself call this before building anything, :func:`resolve_trackers` again)."""
    for name in dict.fromkeys(config.output.trackers):
        if not tracker_installed(name):
            extra = (f"pip install 'mmviews[{name}]'" if name in ("tensorboard", "mlflow", "wandb")
                     else f"pip install {name}")
            raise ConfigError(f"{source}: key 'output.trackers': tracker {name!r} is not installed ({extra}); "
                              "metrics.csv is always written, remove the tracker to train without it")


def resolve_trackers(config: TrainConfig, source: str = "recipe") -> list[str]:
    """The Accelerate trackers of a run (``log_with=``): ``output.trackers`` in order, without
    repeats; a tracker whose package is missing is a :class:`ConfigError` naming the key
    (:func:`check_trackers_installed`). The deprecated ``output.tensorboard: true`` adds
    TensorBoard when it is installed and is skipped with a warning otherwise (its old meaning),
    either way with a warning to move to ``trackers``."""
    check_trackers_installed(config, source)
    names = list(dict.fromkeys(config.output.trackers))
    if config.output.tensorboard:
        if tensorboard_available():
            names = list(dict.fromkeys([*names, "tensorboard"]))
        else:
            warnings.warn(f"{source}: output.tensorboard is true but TensorBoard is not installed; logging to "
                          "metrics.csv only", MMViewsWarning, stacklevel=2)
        warnings.warn(f"{source}: key 'output.tensorboard' is deprecated, use 'output.trackers: [tensorboard]'",
                      FutureWarning, stacklevel=2)
    return names


def flat_hparams(config: TrainConfig) -> dict[str, Any]:
    """The recipe as ``{"optimisation.lr": 0.001, ...}`` (scalars only), for the trackers'
    hyper-parameter tables."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, str, bool)):
            out[prefix] = value

    walk("", config.to_dict())
    return out


def tracker_init_kwargs(trackers: Sequence[str], run_dir: Path, resumed: bool) -> dict[str, dict[str, Any]]:
    """Accelerate's ``init_kwargs`` for the run's trackers: MLflow and W&B write under
    ``<run>/logs/`` (MLflow: a file store there unless ``MLFLOW_TRACKING_URI`` is set; W&B: its
    ``wandb/`` folder, online or offline as ``WANDB_MODE`` says), and a resumed run reopens the
    tracker runs recorded in :data:`TRACKER_RUNS_FILE` when it started."""
    logs = run_dir / TRACKERS_DIR
    previous: dict[str, Any] = {}
    if resumed and (logs / TRACKER_RUNS_FILE).is_file():
        previous = read_json_object(logs / TRACKER_RUNS_FILE)
    kwargs: dict[str, dict[str, Any]] = {}
    if "mlflow" in trackers:
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            # MLflow 3 keeps its file store behind this switch; a run folder is what it suits.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((logs / MLFLOW_STORE_DIR).resolve().as_uri())
        kwargs["mlflow"] = {"run_id": previous["mlflow"]} if previous.get("mlflow") else {}
    if "wandb" in trackers:
        logs.mkdir(parents=True, exist_ok=True)
        kwargs["wandb"] = {"dir": str(logs)}
        if previous.get("wandb"):
            kwargs["wandb"].update(id=previous["wandb"], resume="allow")
    return kwargs


def record_tracker_runs(accelerator: Any, trackers: Sequence[str], run_dir: Path) -> None:
    """Write :data:`TRACKER_RUNS_FILE`: the run id of the MLflow and W&B runs (main process)."""
    ids: dict[str, str] = {}
    if "mlflow" in trackers:
        ids["mlflow"] = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    if "wandb" in trackers:
        ids["wandb"] = accelerator.get_tracker("wandb", unwrap=True).id
    if ids:
        atomic_write_text(run_dir / TRACKERS_DIR / TRACKER_RUNS_FILE, json.dumps(ids, indent=2))


def tracker_metric_name(tracker: str, name: str) -> str:
    """``name`` as ``tracker`` accepts it: MLflow refuses some characters (``R@1`` -> ``R_at_1``)."""
    if tracker == "mlflow":
        return _MLFLOW_NAME_REFUSED.sub("_", name.replace("@", "_at_"))
    return name


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
                    tqdm.write(f"warning: {message}")
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

    def close(self) -> None:
        self.bar.close()


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


# Where train() logs the end of a run (its warnings, its headline metrics) for Python users;
# ``mmviews train`` prints them itself and silences this logger.
RESULTS_LOGGER = "mmviews.train.results"
# The probe tasks whose metrics head a run's results; retrieval adds its R@1.
_HEADLINE_TASKS = ("/linear/", "/knn/", "/regression/", "/msa/", "/prototype/")
_HEADLINE_DIAGNOSTICS = ("/diag/align", "/diag/unif", "/diag/erank/fused")


def headline_metrics(trained: dict[str, Any] | None, random_init: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The metrics a user reads first, trained against randomly initialised encoder:
    ``[{"metric", "trained", "random_init", "chance"}]`` (None where unknown) for the probes
    (linear, kNN, regression, MSA) and the retrieval R@1 of the evaluated split (test, else
    val; the mean over the pairs when there are several); the main diagnostics when the run
    evaluated nothing else."""
    trained, random_init = trained or {}, random_init or {}
    split = "test/" if any(k.startswith("test/") for k in trained) else "val/"
    # retrieval and prototypes: the mean over pairs where there is one (12 directions for 4
    # modalities), else each pair's figure
    keys = [k for k in sorted(trained) if k.startswith(split) and not _has_mean_beside(k, trained) and (
        any(t in k for t in _HEADLINE_TASKS) or ("/retrieval/" in k and k.endswith("/R@1")))]
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
             f"- optimiser steps: {summary['steps']} ({summary['epochs']} epochs, {summary['samples_seen']} samples)",
             f"- final training loss: {format_metric(summary['final_loss'])}",
             f"- wall time: {summary['wall_time_s']:.1f} s on {summary['num_processes']} process(es), {summary['device']}",
             *([f"- status: **failed**: {summary['reason']}"] if summary["status"] == "failed" else []),
             ""]
    if summary["warnings"]:
        lines += ["## Warnings: did it learn?", "", *(f"- {message}" for message in summary["warnings"]), ""]
    lines += data_report_lines(summary)
    trained, random_ = summary["eval"], summary["eval_random"] or {}
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
