"""``mmviews train RECIPE [--set KEY=VALUE ...] [--output DIR] [--resume DIR] [--check]``.

RECIPE is a YAML path or a bare recipe name (``quickstart``) looked up in ``recipes/``.
``--resume DIR`` continues the run in DIR (its latest complete checkpoint, or DIR itself
if it is a checkpoint folder) with the run's saved ``config.yaml``; ``--set`` may still
change it (e.g. more epochs). Several GPUs or nodes::

    accelerate launch -m mmviews.cli train quickstart
    accelerate launch --multi_gpu --num_processes 2 -m mmviews.cli train quickstart --set cpu=true   # CPU, gloo

``data.batch_size`` is the global batch (split between processes), so a recipe gives the
same negatives and the same results on any number of processes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmviews.config import ConfigError, load_config, resolve_recipe
from mmviews.run import CONFIG_FILE, find_checkpoint, run_dir_of
from mmviews.train import TrainCallback, build_run, train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="recipe YAML path or name in recipes/ (optional with --resume)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set optimisation.lr=3e-4 (repeatable; VALUE is YAML)")
    parser.add_argument("--output", "-o", default=None, help="run folder (default: output.dir, else runs/<name>)")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue the run in DIR (run folder or checkpoint folder) from its last checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="allow training into an existing run folder")
    parser.add_argument("--check", action="store_true",
                        help="validate the recipe (config, dataset, views, objective) and exit without training")


def _close_process_group() -> None:
    """Under ``accelerate launch``, tear the process group down before exit: left to
    interpreter shutdown, gloo can abort ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _fail(message: str) -> int:
    print(f"mmviews train: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, callback: TrainCallback | None = None) -> int:
    """The command; ``callback`` is handed to :func:`mmviews.train.train` (tests use it to
    slow a run down, see ``tests/slow_train.py``)."""
    try:
        if args.resume is not None:
            checkpoint = find_checkpoint(args.resume)
            run_dir = run_dir_of(checkpoint) if Path(args.resume).resolve() == checkpoint.resolve() else Path(args.resume)
            recipe = resolve_recipe(args.recipe) if args.recipe is not None else run_dir / CONFIG_FILE
            config = load_config(recipe, args.overrides)
            if args.output is not None and Path(args.output).resolve() != run_dir.resolve():
                return _fail(f"--output {args.output} differs from the resumed run folder {run_dir}")
        else:
            if args.recipe is None:
                return _fail("give a RECIPE (path or name in recipes/) or --resume DIR")
            recipe = resolve_recipe(args.recipe)
            config = load_config(recipe, args.overrides)
            run_dir = Path(args.output or config.output.dir or Path("runs") / config.name)
            if not args.check and (run_dir / CONFIG_FILE).exists() and not args.overwrite:
                return _fail(f"{run_dir} already holds a run; continue it with --resume {run_dir}, "
                             "or choose another --output (or --overwrite)")
        if args.check:
            parts = build_run(config, source=str(recipe))
            print(f"{recipe}: OK ({len(parts.view_spec)} views: {', '.join(v.name for v in parts.view_spec.views)}; "
                  f"objective {config.objective.name}; {len(parts.datasets['train'])} training samples)")
            return 0
        summary = train(config, run_dir, resume=args.resume, source=str(recipe), callback=callback)
    except (ConfigError, FileNotFoundError) as error:
        return _fail(str(error))
    finally:
        _close_process_group()
    print(f"run folder: {run_dir}  (steps {summary['steps']}, final loss {summary['final_loss']:.4f}, "
          f"{summary['wall_time_s']:.1f} s)")
    if summary["eval"]:
        print(f"report: {run_dir / 'report.md'}")
    return 0
