"""An adapter with no present item on one process still joins every collective its forward and
backward take part in (``Adapter.embed_present`` and ``join_collectives`` of
``mmviews.modalities.base``), on a real gloo group of two: this pytest process (rank 0, no
present item) and a second process it starts (rank 1, every item present), running the same steps
(``dist_adapter_worker.py``) with FSDP2-sharded backbones: one with BatchNorm gets zero rows (its
BatchNorm layers in eval mode for that pass, so that no batch is counted), one without gets its
first row, cut before the head; either way rank 0's output is zero rows connected to the graph and
the gradients are rank 1's averaged over two. A rank that skipped a collective would leave the other
waiting: the group's timeout (30 s) fails the test instead. (SyncBatchNorm runs on GPUs only: its
single-row case in the head is left to the two-GPU runs of test_train_multigpu.py.)"""

from __future__ import annotations

import sys

import torch
from dist_adapter_worker import BATCH, run
from test_train_utils import REPO, free_port, started


def test_a_process_without_present_items_joins_the_collectives_of_the_others(tmp_path):
    port = free_port()
    log = tmp_path / "rank1.log"
    with open(log, "w") as out, started([sys.executable, str(REPO / "tests" / "dist_adapter_worker.py"), str(port)],
                                        stdout=out, stderr=out) as other:
        try:
            results = run(0, port)
        except BaseException:
            print(log.read_text())
            raise
        assert other.wait(timeout=60) == 0, log.read_text()

    bn = results["batch_norm"]
    assert bn["out"].shape == (BATCH, 16) and not bn["out"].any() and bn["requires_grad"]
    assert bn["rows"] == [0]  # zero rows through the backbone
    assert bn["norm_modes"] == [False]  # its BatchNorm layers in eval mode for that pass ...
    assert bn["modes_after"] == [True] * (len(bn["modes_after"]) - 1) + [False]  # ... then back as they were
    assert bn["batches"] == [0] * len(bn["batches"]) and all(not m.any() for m in bn["running_means"])  # no batch counted
    for synced, alone in zip(bn["grads"], bn["alone_grads"], strict=True):
        assert torch.allclose(synced, alone / 2, atol=1e-4)  # backward ran; rank 0 added nothing of its own
    assert sum(float(g.abs().sum()) for g in bn["alone_grads"]) > 0

    sharded = results["sharded"]
    assert sharded["out"].shape == (BATCH, 4) and not sharded["out"].any() and sharded["requires_grad"]
    assert sharded["rows"] == [1, 1]  # the first row, an absent slot's filling (then of a batch of one)
    assert sharded["head_batches"] == 1  # the head ran (on zero rows)
    assert sharded["one_dtype"] == torch.float32  # under autocast too
    for synced, alone in zip(sharded["grads"], sharded["alone_grads"], strict=True):
        assert alone.abs().sum() > 0 and torch.allclose(synced, alone / 2, atol=1e-4)
