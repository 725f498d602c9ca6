"""``mmviews eval RUN_OR_CHECKPOINT``: evaluate a trained encoder and write its report.

:func:`mmviews.run.load_run` gives ``(encoder, config, loaders)``: ``encoder(batch) ->
(z [K, M, d], mask [K, M])``, the run's resolved :class:`~mmviews.config.TrainConfig` (with any
``--set`` below applied) and unshuffled loaders of the ``"train"``, ``"val"`` and ``"test"``
splits (or None); then
:func:`mmviews.eval.evaluate_encoder` writes the report. Its ``meta`` carries the objective
and the number of views M the encoder was trained with (``mmviews compare`` reads them).

It reproduces the run's own final evaluation: every setting that changes the numbers comes
from the run's ``config.yaml`` unless a flag overrides it: the precision of the encoder's
forward (``optimisation.mixed_precision``, under ``torch.autocast`` as in training, see
:class:`~mmviews.eval.extract.AutocastEncoder`), the device (``cpu``: CUDA when the run did not
ask for the CPU and one is present), the tasks, the fusion, the evaluation views and the seed
of the probes. With the run's tasks, the numbers equal those of ``report.md``. The report is
drawn as the training's is: its plots only where the run's ``evaluation.plots`` says so.

``--set evaluation.KEY=VALUE`` overrides a key of the run's ``evaluation`` section, as
``mmviews train --set`` does a recipe's (e.g. ``--set evaluation.plots=false``); the
dedicated flags (``--tasks``, ``--fuse``) win over it. Other sections are refused: the
encoder and the data are the run's.

The report goes to a new folder, ``RUN/eval-N`` (the first N from 1 that is free) unless
``--output`` names one, and the folder is printed. A report written into the run folder takes
the folder's lock (:class:`mmviews.run.RunFolderLock`) for as long as the evaluation runs: a run
folder that another command (a training) holds is refused, naming its process and host. The terminal gets the headline metrics (the probes and retrieval R@1,
with the run's random-init baseline when the evaluation is the run's own, and chance levels)
and the health checks' warnings, as ``mmviews train`` prints them; every metric is in the
report's ``summary.md`` and ``metrics.json``. The run's own evaluations (``eval/``, which
``report.md`` links to, ``eval_random/``, ``eval_epoch_N/``) are never written to.

Multi-process: ``accelerate launch -m mmviews.cli eval RUN``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

from mmviews.config import ConfigError, TrainConfig, apply_overrides, load_config, parse_override
from mmviews.eval.evaluate import evaluate_encoder
from mmviews.eval.extract import PRECISIONS, AutocastEncoder, precision_name
from mmviews.eval.health import HealthSettings, evaluation_warnings
from mmviews.eval.summary import headline_lines, headline_metrics, read_eval_metrics
from mmviews.export.onnx_runtime import is_onnx_folder
from mmviews.fileio import check_writable
from mmviews.modalities.remote import allow_remote_models
from mmviews.notices import print_warning
from mmviews.run import (CONFIG_FILE, LOG_FILE, RunFolderLock, eval_loaders, is_checkpoint, load_run,
                         record_run_outputs, run_dir_of)

DEFAULT_TASKS = ["retrieval", "diagnostics"]
# The run's own evaluations, written by the trainer (report.md links to eval/): never replaced.
TRAINING_EVAL_DIRS = ("eval", "eval_random")
TRAINING_EVAL_PREFIX = "eval_epoch_"
NEW_EVAL_PREFIX = "eval-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or checkpoint folder")
    parser.add_argument(
        "--tasks", nargs="+", default=None,
        help="evaluation tasks, e.g. linear knn msa:mosi retrieval diagnostics "
        "(default: the run's evaluation.tasks, else 'retrieval diagnostics')",
    )
    parser.add_argument("--output", "--out", "-o", dest="output", default=None,
                        help="report folder (default: a new <run folder>/eval-N, printed; never the run's own eval/)")
    parser.add_argument("--fuse", choices=["concat", "mean"], default=None,
                        help="how views are fused for probes (default: the run's evaluation.fuse)")
    parser.add_argument("--precision", choices=["run", *PRECISIONS], default="run",
                        help="autocast of the encoder's forward (default 'run': the run's "
                        "optimisation.mixed_precision, as its training-time evaluation; 'no': float32)")
    parser.add_argument("--device", default=None,
                        help="where the encoder and probes run, e.g. cpu, cuda (default: the run's: CUDA when present "
                        "and the recipe did not set cpu: true)")
    parser.add_argument("--log-csv", default=None,
                        help=f"training log with columns step,loss,... (default: the run folder's {LOG_FILE})")
    parser.add_argument("--seed", type=int, default=None, help="seed of the probes (default: the run's seed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the run's evaluation section, e.g. --set evaluation.plots=false "
                        "(evaluation.* keys only; repeatable; VALUE is YAML)")
    parser.add_argument("--allow-remote-models", action="store_true",
                        help="allow adapters to build open_clip models named 'hf-hub:...' or 'local-dir:...'")


def default_output(run_dir: Path) -> Path:
    """``run_dir/eval-N`` for the first N >= 1 that does not exist."""
    n = 1
    while (run_dir / f"{NEW_EVAL_PREFIX}{n}").exists():
        n += 1
    return run_dir / f"{NEW_EVAL_PREFIX}{n}"


def check_output(out: Path, run_dir: Path) -> None:
    """Refuse a report folder that is one of the run's own evaluations (``ValueError`` naming it)."""
    if out.resolve().parent == run_dir.resolve() and (
            out.name in TRAINING_EVAL_DIRS or out.name.startswith(TRAINING_EVAL_PREFIX)):
        raise ValueError(f"--output {out} is the run's own evaluation (written by mmviews train; report.md links to "
                         "it): choose another folder, or leave --output out for a new eval-N folder")


def run_device(cpu: bool, requested: str | None = None) -> str:
    """The device the run evaluated on: CUDA when present, unless the recipe set ``cpu: true``;
    or ``requested`` (``--device``), which must exist here (a ``ValueError`` naming it)."""
    if requested is None:
        return "cuda" if not cpu and torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device {requested!r} is not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: no CUDA device here")
    return str(device)


#: The recipe section ``--set`` may change: how the run is evaluated, not what is evaluated.
OVERRIDABLE_SECTION = "evaluation"


def check_overrides(overrides: list[str]) -> None:
    """Refuse a ``--set`` outside :data:`OVERRIDABLE_SECTION`, or naming a key the section does not
    have (a ``ConfigError`` naming the ``--set``); its value is checked with the run's recipe."""
    for text in overrides:
        parts, _ = parse_override(text)
        if parts[0] != OVERRIDABLE_SECTION or len(parts) < 2:
            raise ConfigError(f"--set {text!r}: mmviews eval overrides keys of the run's {OVERRIDABLE_SECTION} section "
                              f"only (e.g. --set {OVERRIDABLE_SECTION}.plots=false); the encoder, the data and the "
                              "other settings are the run's")
    apply_overrides({}, overrides)  # an unknown key (with its did-you-mean) before the run is loaded


def evaluation_config(run_dir: Path, run_config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """The run's recipe with ``overrides`` applied (checked as ``mmviews train --set`` checks
    them: an error names the ``--set`` at fault); ``run_config`` itself without any."""
    return load_config(run_dir / CONFIG_FILE, overrides) if overrides else run_config


def run(args: argparse.Namespace) -> int:
    """The command. Errors are raised; :func:`mmviews.cli.main` prints them as one line."""
    path = Path(args.run)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run folder or a checkpoint folder")
    # (a file is refused by load_run below; only a folder is a run)
    if is_onnx_folder(path):
        raise ValueError(f"{path} is an ONNX export (mmviews export --format onnx), not a run (mmviews eval "
                         f"evaluates a run or checkpoint folder); embed samples with it (mmviews embed {path} DATA_OR_RECIPE --output FILE.parquet), "
                         "or evaluate the run it was exported from (mmviews eval RUN)")
    run_dir = run_dir_of(path) if is_checkpoint(path) else path
    if args.output is not None:
        check_output(Path(args.output), run_dir)  # before the (slow) loading
    check_writable(args.output or run_dir)  # likewise (the default is a new RUN/eval-N)
    if args.device is not None:
        run_device(False, args.device)  # likewise
    check_overrides(args.overrides)  # likewise
    out = Path(args.output) if args.output else default_output(run_dir)
    with contextlib.ExitStack() as held:
        if out.resolve().parent == run_dir.resolve() and os.environ.get("RANK", "0") == "0":
            # the report goes into the run folder: one command at a time (a run training there is refused)
            held.enter_context(RunFolderLock(run_dir, "mmviews eval"))
        return _evaluate(args, path, run_dir, out)


def _evaluate(args: argparse.Namespace, path: Path, run_dir: Path, out: Path) -> int:
    with allow_remote_models(args.allow_remote_models):
        encoder, run_config, loaders = load_run(path)
    config = evaluation_config(run_dir, run_config, args.overrides)
    if config.evaluation.views != run_config.evaluation.views:  # the only overridable key the loaders read
        loaders = eval_loaders(config)
    tasks = args.tasks or config.evaluation.tasks or DEFAULT_TASKS
    log_csv = args.log_csv  # an explicit log that is missing gets a note in the report
    if log_csv is None and (run_dir / LOG_FILE).is_file():
        log_csv = run_dir / LOG_FILE
    precision = config.optimisation.mixed_precision if args.precision == "run" else args.precision
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=config.cpu)
        device = str(accelerator.device)
    else:
        device = run_device(config.cpu, args.device)
    seed = config.seed if args.seed is None else args.seed
    fuse = args.fuse or config.evaluation.fuse
    meta = {"run": str(path), "objective": config.objective.name, "name": config.name,
            "num_views": len(config.view_spec),  # the training M, not the evaluation views
            "precision": precision, "seed": seed}
    if isinstance(encoder, torch.nn.Module):
        encoder.to(device)
    metrics = evaluate_encoder(
        AutocastEncoder(encoder, precision), loaders["train"], loaders["val"], loaders["test"], tasks,
        out_dir=out, accelerator=accelerator, fuse=fuse, log_csv=log_csv, meta=meta, seed=seed, device=device,
        plots=config.evaluation.plots,  # as the training's evaluation draws them (mmviews.train.evaluation)
    )
    if accelerator is None or accelerator.is_main_process:
        if out.parent.resolve() == run_dir.resolve():
            record_run_outputs(run_dir)  # the report is part of the run (for --overwrite)
        # the run's random-init baseline sits beside the numbers only where it measured the same thing
        same_evaluation = (list(tasks) == list(run_config.evaluation.tasks or []) and fuse == run_config.evaluation.fuse
                           and seed == run_config.seed and config.evaluation.views == run_config.evaluation.views)
        random_init = read_eval_metrics(run_dir / "eval_random") if same_evaluation else None
        for line in headline_lines(headline_metrics(metrics, random_init)):
            print(line)
        sys.stdout.flush()
        for message in evaluation_warnings(metrics, random_init, HealthSettings.from_config(config)):
            print_warning("mmviews eval", message)
        print(f"report written to {out} (precision {precision_name(precision)}, seed {seed}, fuse {fuse}; every metric "
              f"in {out / 'summary.md'})")
    return 0
