"""``mmviews eval RUN_OR_CHECKPOINT``: evaluate a trained encoder and write its report.

Loading a run belongs to the trainer: this command calls
``mmviews.train.load_run(path) -> (encoder, config, loaders)`` where ``encoder(batch) ->
(z [K, M, d], mask [K, M])``, ``config`` is the resolved run configuration (a mapping or the
trainer's ``TrainConfig``) and ``loaders`` maps ``"train"``, ``"val"``, ``"test"`` to
unshuffled ViewBatch loaders (or None), then :func:`mmviews.eval.evaluate_encoder`.

Multi-process: ``accelerate launch -m mmviews.cli eval RUN``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_TASKS = ["retrieval", "diagnostics"]
LOG_CSV_NAMES = ("log.csv", "train_log.csv", "metrics.csv")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or checkpoint (whatever mmviews.train.load_run accepts)")
    parser.add_argument(
        "--tasks", nargs="+", default=None,
        help="evaluation tasks, e.g. linear knn msa:mosi retrieval diagnostics "
        "(default: the run's evaluation.tasks, else 'retrieval diagnostics')",
    )
    parser.add_argument("--out", default=None, help="report folder (default: <run folder>/eval)")
    parser.add_argument("--fuse", choices=["concat", "mean"], default=None,
                        help="how views are fused for probes (default: the run's evaluation.fuse, else concat)")
    parser.add_argument("--log-csv", default=None, help="training log with columns step,loss,... (default: found in the run folder)")
    parser.add_argument("--seed", type=int, default=0)


def _get(config: Any, *keys: str) -> Any:
    node = config
    for key in keys:
        if node is None:
            return None
        node = node.get(key) if isinstance(node, dict) else getattr(node, key, None)
    return node


def _loaders(loaders: Any) -> tuple[Any, Any, Any]:
    if isinstance(loaders, dict):
        unknown = set(loaders) - {"train", "val", "valid", "test"}
        if unknown:
            raise ValueError(f"load_run returned loaders for unknown splits {sorted(unknown)}")
        return loaders.get("train"), loaders.get("val", loaders.get("valid")), loaders.get("test")
    if isinstance(loaders, (list, tuple)) and len(loaders) == 3:
        return tuple(loaders)  # type: ignore[return-value]
    raise ValueError("load_run must return loaders as a dict {'train', 'val', 'test'} or a (train, val, test) tuple")


def run(args: argparse.Namespace) -> int:
    path = Path(args.run)
    if not path.exists():
        print(f"mmviews eval: {path} does not exist", file=sys.stderr)
        return 2
    try:
        from mmviews.train import load_run  # type: ignore[attr-defined]
    except ImportError as err:
        print(
            "mmviews eval: loading a run needs mmviews.train.load_run(path) -> (encoder, config, loaders), "
            f"which is not available in this installation ({err})",
            file=sys.stderr,
        )
        return 2
    from mmviews.eval.evaluate import evaluate_encoder

    encoder, config, loaders = load_run(path)
    train, val, test = _loaders(loaders)
    tasks = args.tasks or _get(config, "evaluation", "tasks") or DEFAULT_TASKS
    run_dir = path if path.is_dir() else path.parent
    out = Path(args.out) if args.out else run_dir / "eval"
    log_csv = args.log_csv
    if log_csv is None:
        log_csv = next((run_dir / n for n in LOG_CSV_NAMES if (run_dir / n).is_file()), None)
    accelerator = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=bool(_get(config, "cpu")))
    meta = {"run": str(path)}
    for key, value in (
        ("objective", _get(config, "objective", "name")),
        ("name", _get(config, "name")),
        ("num_views", _get(config, "num_views")),  # training M, if the run's config exposes it
    ):
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            meta[key] = value
    metrics = evaluate_encoder(
        encoder, train, val, test, tasks, out_dir=out, accelerator=accelerator,
        fuse=args.fuse or _get(config, "evaluation", "fuse") or "concat", log_csv=log_csv, meta=meta, seed=args.seed,
    )
    if accelerator is None or accelerator.is_main_process:
        print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
        print(f"report written to {out}")
    return 0
