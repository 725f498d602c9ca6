"""``mmviews bench data --recipe RECIPE``: where a video recipe's step spends its time.

For the recipe (``--recipe ucf101 --set data.root=...``, any ``--set``), in one process:

- **decode floor**: the clips' frame windows decoded by PyAV alone (the reader the dataset uses,
  :func:`mmviews.data.video_io.read_video_window`, nothing else), through a DataLoader with each
  worker count of ``--loader-workers``: the fastest the data path could be;
- **data path**: the recipe's own training loader (dataset, augmentations, Farneback flow when
  ``data.options.flow: farneback``, collation and the encoder's host preparation) with the same
  worker counts;
- **model floor**: the recipe's step (:func:`mmviews.train.train_step`: its encoders, views,
  objective, optimiser and precision, ``mixed_precision: auto`` resolved) on one batch already in
  memory, repeated: the fastest the step could be fed;
- **step**: the step fed by the loader (``data.num_workers``), split into **data** (the wait for
  the batch), **flow** (RAFT in the step with ``flow: raft``), **forward** (the encoders),
  **objective** (the loss), **backward** and **optimiser**.

Each figure is clips (samples) per second. The step's rows time ``--steps`` steps after
``--warmup``; the loaders ``--batches`` batches after the first.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default=None,
                        help="time a video recipe's data path and step instead of the built-in cases: the decode "
                        "floor, the data path with each --loader-workers count, the model floor and the step's split "
                        "(mmviews.bench.video_step)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --recipe: override a recipe value (repeatable), e.g. --set data.root=/data/UCF-101")
    parser.add_argument("--loader-workers", default=None,
                        help="with --recipe: loader worker counts to time, comma separated (default: 0 and the "
                        "recipe's data.num_workers)")
    parser.add_argument("--steps", type=int, default=3, help="with --recipe: timed steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="with --recipe: untimed steps first (default 1)")


def _decode_only(dataset: Any) -> Any:
    """A dataset of the same clips' frame windows read by PyAV alone (uint8 arrays)."""
    from torch.utils.data import Dataset

    from mmviews.data.video_io import read_video_window

    class Decoded(Dataset):
        def __len__(self) -> int:
            return len(dataset.clips)

        def __getitem__(self, index: int) -> Any:
            _, rel = dataset.clips[index]
            frames, _, _ = read_video_window(dataset.root / rel, dataset._window, seek=dataset.decode == "seek")
            return frames

    return Decoded()


def _samples_per_s(loader: Any, batches: int, count: Any) -> dict[str, float]:
    it = iter(loader)
    first_start = time.perf_counter()
    next(it)
    first = time.perf_counter() - first_start
    start = time.perf_counter()
    n = sum(count(batch) for batch in itertools.islice(it, batches))
    seconds = time.perf_counter() - start
    return {"first_batch_s": round(first, 3), "samples": n, "seconds": round(seconds, 3),
            "clips_per_s": round(n / seconds, 2) if seconds > 0 else float("nan")}


def _step_rows(parts: Any, steps: int, warmup: int) -> dict[str, Any]:
    """The model floor and the loader-fed step, phase by phase, on one prepared run."""
    from mmviews.bench.common import synchroniser
    from mmviews.bench.train_measure import PHASES, PhaseClock
    from mmviews.train.setup import batches_forever, make_accelerator, prepare_run
    from mmviews.train.step import train_step

    config = parts.config
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-video-") as run_dir:
        accelerator = make_accelerator(config, Path(run_dir))
        p = prepare_run(accelerator, parts)
        p.model.train()
        sync = synchroniser(accelerator.device)
        clock = PhaseClock(sync)
        batch_iter = batches_forever(p, parts)
        grad_norm = config.optimisation.max_grad_norm

        def timed_steps(next_batch: Any) -> dict[str, float]:
            totals = dict.fromkeys(PHASES, 0.0)
            for i in range(warmup + steps):
                clock.start()
                batch = next_batch()
                clock("data")
                train_step(p, batch, grad_norm, clock)
                if i >= warmup:
                    for name, seconds in clock.seconds.items():
                        totals[name] += seconds
            return {name: 1000 * s / steps for name, s in totals.items()}

        fed = timed_steps(lambda: next(batch_iter))
        held = next(batch_iter)
        floor = timed_steps(lambda: held)
        K = parts.sampler.batch_size if hasattr(parts.sampler, "batch_size") else held.num_samples
        rows = {}
        for name, phases in (("model floor", floor), ("step", fed)):
            total = sum(phases.values())
            rows[name] = {"step_ms": round(total, 1), "clips_per_s": round(1000 * K / total, 2),
                          "phase_ms": {k: round(v, 1) for k, v in phases.items()},
                          "phase_share": {k: round(v / total, 3) for k, v in phases.items()}}
        return {"K": K, "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device), **rows}


def run_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the module docstring for ``args.recipe``."""
    from torch.utils.data import DataLoader

    from mmviews.config import load_config, resolve_recipe
    from mmviews.data.loaders import loader_options
    from mmviews.train.build import build_run
    from mmviews.eval.precision import announce_precision, resolve_precision
    from mmviews.train.setup import HostPreparedCollate

    config = load_config(resolve_recipe(args.recipe), list(args.set))
    config, precision = resolve_precision(config)
    announce_precision(precision)
    parts = build_run(config, with_eval=False)
    dataset = parts.datasets["train"]
    if not hasattr(dataset, "clips"):
        raise ValueError(f"bench data --recipe: {args.recipe} reads {type(dataset).__name__}, not a video folder "
                         "(ucf101, hmdb51)")
    workers = ([int(w) for w in args.loader_workers.split(",")] if args.loader_workers
               else sorted({0, config.data.num_workers}))
    K = parts.sampler.batch_size if hasattr(parts.sampler, "batch_size") else config.data.batch_size
    collate = HostPreparedCollate(parts.collator, parts.encoder.host_preparation())
    result: dict[str, Any] = {"recipe": config.name, "K": K, "M": len(parts.view_spec),
                              "flow": (config.data.options or {}).get("flow"), "torch_threads": torch.get_num_threads(),
                              "decode floor": {}, "data path": {}}
    for n in workers:
        decode = DataLoader(_decode_only(dataset), batch_size=K, shuffle=False, collate_fn=list,
                            **loader_options(n, pin_memory=False))
        result["decode floor"][n] = _samples_per_s(decode, args.batches, len)
        loader = DataLoader(dataset, batch_sampler=parts.sampler, collate_fn=collate, **loader_options(n, pin_memory=False))
        result["data path"][n] = _samples_per_s(loader, args.batches, lambda b: b.num_samples)
        del decode, loader
    result.update(_step_rows(parts, args.steps, args.warmup))
    return result


def print_recipe(result: dict[str, Any]) -> None:
    print(f"recipe {result['recipe']}: K = {result['K']}, M = {result['M']}, flow {result['flow']}, "
          f"precision {result['mixed_precision']} on {result['device']}")
    print(f"{'row':<26}{'clips/s':>10}")
    for kind in ("decode floor", "data path"):
        for n, row in result[kind].items():
            print(f"{kind + f' ({n} workers)':<26}{row['clips_per_s']:>10.2f}")
    phases = list(result["step"]["phase_ms"])
    print(f"{'':<26}{'clips/s':>10}{'step ms':>10}" + "".join(f"{p + ' %':>12}" for p in phases))
    for name in ("model floor", "step"):
        row = result[name]
        print(f"{name:<26}{row['clips_per_s']:>10.2f}{row['step_ms']:>10.0f}"
              + "".join(f"{100 * row['phase_share'][p]:>12.1f}" for p in phases))
