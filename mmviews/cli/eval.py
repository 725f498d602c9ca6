"""``mmviews eval RUN_OR_CHECKPOINT``: evaluate a trained encoder and write its report.

:func:`mmviews.run.load_run` gives ``(encoder, config, loaders)``: ``encoder(batch) ->
(z [K, M, d], mask [K, M])``, the run's resolved :class:`~mmviews.config.TrainConfig` and
unshuffled loaders of the ``"train"``, ``"val"`` and ``"test"`` splits (or None); then
:func:`mmviews.eval.evaluate_encoder` writes the report. Its ``meta`` carries the objective
and the number of views M the encoder was trained with (``mmviews compare`` reads them).

Multi-process: ``accelerate launch -m mmviews.cli eval RUN``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mmviews.data.views import ViewSpec
from mmviews.eval.evaluate import evaluate_encoder
from mmviews.modalities.base import allow_remote_models
from mmviews.run import LOG_FILE, load_run, record_run_outputs

DEFAULT_TASKS = ["retrieval", "diagnostics"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or checkpoint folder")
    parser.add_argument(
        "--tasks", nargs="+", default=None,
        help="evaluation tasks, e.g. linear knn msa:mosi retrieval diagnostics "
        "(default: the run's evaluation.tasks, else 'retrieval diagnostics')",
    )
    parser.add_argument("--out", default=None, help="report folder (default: <run folder>/eval)")
    parser.add_argument("--fuse", choices=["concat", "mean"], default=None,
                        help="how views are fused for probes (default: the run's evaluation.fuse)")
    parser.add_argument("--log-csv", default=None,
                        help=f"training log with columns step,loss,... (default: the run folder's {LOG_FILE})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-remote-models", action="store_true",
                        help="allow adapters to build open_clip models named 'hf-hub:...' or 'local-dir:...'")


def run(args: argparse.Namespace) -> int:
    """The command. Errors are raised; :func:`mmviews.cli.main` prints them as one line."""
    path = Path(args.run)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run folder or a checkpoint folder")
    with allow_remote_models(args.allow_remote_models):
        encoder, config, loaders = load_run(path)
    tasks = args.tasks or config.evaluation.tasks or DEFAULT_TASKS
    run_dir = path if path.is_dir() else path.parent
    out = Path(args.out) if args.out else run_dir / "eval"
    log_csv = args.log_csv  # an explicit log that is missing gets a note in the report
    if log_csv is None and (run_dir / LOG_FILE).is_file():
        log_csv = run_dir / LOG_FILE
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=config.cpu)
    meta = {"run": str(path), "objective": config.objective.name, "name": config.name,
            "num_views": len(ViewSpec.from_config(config.views))}  # the training M, not the evaluation views
    metrics = evaluate_encoder(
        encoder, loaders["train"], loaders["val"], loaders["test"], tasks, out_dir=out, accelerator=accelerator,
        fuse=args.fuse or config.evaluation.fuse, log_csv=log_csv, meta=meta,
        seed=args.seed,
    )
    if accelerator is None or accelerator.is_main_process:
        if out.parent.resolve() == run_dir.resolve():
            record_run_outputs(run_dir)  # the report is part of the run (for --overwrite)
        print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
        print(f"report written to {out}")
    return 0
