"""Multi-GPU SyncBatchNorm with missing views, under two gloo processes (see
tests/dist_syncbn_worker.py): every rank takes part in every collective, even a rank whose
micro-batch has no present view of a modality, or a single one (and the EMA teacher's copy too).
A rank that skipped one would leave the other waiting: the process group's short timeout turns
that hang into a failure within seconds."""

from __future__ import annotations

import dist_syncbn_worker as W  # tests/ is on sys.path (tests/conftest.py)
import torch


def test_every_rank_joins_every_batchnorm_collective(tmp_path):
    W.launch(str(tmp_path), timeout=150.0)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(W.WORLD)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    counts = [[(s["forward"], s["backward"]) for s in r["steps"]] for r in results]
    assert counts[0] == counts[1], f"collectives per step differ between ranks: {counts}"
    # Every BatchNorm layer (backbone and head) synchronised forward, the student's also backward.
    forward, backward = counts[0][0]
    assert forward > backward > 0, counts
    assert all(c == counts[0][0] for c in counts[0]), f"a step skipped collectives: {counts}"
    # The statistics are shared: both ranks hold the same running mean.
    torch.testing.assert_close(results[0]["running_mean"], results[1]["running_mean"])
    for result in results:
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in result["steps"])
