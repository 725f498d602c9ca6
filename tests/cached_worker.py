"""Worker of tests/test_train_cached.py's two-process test: ``python cached_worker.py RECIPE RUN``
as each rank of a torch.distributed job (``accelerate launch``, or the ranks started by
``test_train_utils.run_ranks``) is ``mmviews train RECIPE --output RUN`` with a DDP communication hook
that counts the gradient reductions (bucket all-reduces); rank 0 writes the count and the
optimiser steps to ``RUN/reductions.json``.

``python cached_worker.py RECIPE RUN --then-break NAME RUN2`` then applies the break NAME of
``tests/mutations.py`` (for good) and trains the recipe again into RUN2, in the same processes:
the mutation test's broken run without a second launch."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mutations import apply_break

import mmviews.train.trainer as trainer
from mmviews.config import load_config


def main(recipe: str, run: str, *then_break: str) -> int:
    reductions = [0]
    prepare = trainer.prepare_run

    def counting_prepare(accelerator: Any, parts: Any) -> Any:
        p = prepare(accelerator, parts)

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
            reductions[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        p.model.register_comm_hook(None, hook)
        return p

    trainer.prepare_run = counting_prepare
    summary = trainer.train(load_config(recipe), run)
    if dist.get_rank() == 0:
        (Path(run) / "reductions.json").write_text(json.dumps({"reductions": reductions[0], "steps": summary["steps"]}))
    if then_break:
        flag, name, broken_run = then_break
        assert flag == "--then-break", then_break
        apply_break(name)
        trainer.train(load_config(recipe), broken_run)
    # Leave together, with the process group closed, as `mmviews train` does: a rank that exits
    # while its peer (rank 0, still writing the run's files) holds the gloo connection can abort it.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
