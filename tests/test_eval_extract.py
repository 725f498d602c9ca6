"""Embedding extraction: single process, fusion, and 2 real processes with gather_for_metrics."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.eval import extract_embeddings, fuse_views

VIEWS = [ViewInfo("feat_0", "feat", 0), ViewInfo("feat_1", "feat", 1, natural=False)]


class Toy(Dataset):
    """Sample i has two 4-d views derived from i; view 1 is absent for i % 3 == 0."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 10.0 * i
        return {"x": x, "i": i}


def collate(items) -> ViewBatch:
    x = torch.stack([it["x"] for it in items])  # [K, 2, 4], sample-major below
    idx = torch.tensor([it["i"] for it in items])
    mask = torch.ones(len(items), 2, dtype=torch.bool)
    mask[:, 1] = idx % 3 != 0
    return ViewBatch(
        inputs={"feat": {"values": x.reshape(-1, 4)}},
        views=VIEWS,
        mask=mask,
        labels={"class": idx % 2, "sentiment": idx.double() / 10},
        index=idx,
    )


class Enc(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
            self.lin.bias.zero_()

    def forward(self, batch: ViewBatch):
        z = self.lin(batch.inputs["feat"]["values"]).reshape(batch.num_samples, 2, 3)
        return z, batch.mask


def _reference(n: int) -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32).reshape(1, 2, 4) + 10.0 * torch.arange(n, dtype=torch.float32)[:, None, None]
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10
    return x @ w.T  # [n, 2, 3]


def test_extract_single_process_matches_direct_computation():
    enc = Enc()
    enc.train()
    loader = DataLoader(Toy(7), batch_size=3, collate_fn=collate)
    emb = extract_embeddings(enc, loader, fuse="concat")
    assert enc.training, "train mode must be restored"
    assert emb.views.shape == (7, 2, 3)
    torch.testing.assert_close(emb.views, _reference(7))
    assert emb.mask[:, 1].tolist() == [i % 3 != 0 for i in range(7)]
    assert emb.index.tolist() == list(range(7))
    assert emb.labels["class"].tolist() == [i % 2 for i in range(7)]
    assert emb.view_names == ["feat_0", "feat_1"]
    # concat zeroes the absent view
    expected = _reference(7) * emb.mask[..., None]
    torch.testing.assert_close(emb.fused, expected.flatten(1))
    assert not emb.views.requires_grad


def test_extract_progress_bar_can_be_hidden(capsys):
    loader = DataLoader(Toy(7), batch_size=3, collate_fn=collate)
    extract_embeddings(Enc(), loader, desc="embeddings (probe)")
    assert "embeddings (probe)" in capsys.readouterr().err
    quiet = extract_embeddings(Enc(), loader, desc="embeddings (probe)", progress=False)
    assert "embeddings (probe)" not in capsys.readouterr().err
    torch.testing.assert_close(quiet.views, _reference(7))


def test_fuse_mean_ignores_absent_views():
    v = torch.tensor([[[1.0, 1.0], [3.0, 5.0]], [[2.0, 0.0], [100.0, 100.0]]])
    m = torch.tensor([[True, True], [True, False]])
    torch.testing.assert_close(fuse_views(v, m, "mean"), torch.tensor([[2.0, 3.0], [2.0, 0.0]]))
    with pytest.raises(ValueError, match="fuse"):
        fuse_views(v, m, "max")


def test_encoder_with_wrong_shape_is_rejected():
    loader = DataLoader(Toy(4), batch_size=2, collate_fn=collate)
    with pytest.raises(ValueError, match="encoder must return"):
        extract_embeddings(lambda b: (torch.zeros(2, 3), b.mask), loader)


# Run by 2 processes; it imports the dataset, collate and encoder above from this file (the
# tests folder reaches the workers through PYTHONPATH).
SCRIPT = textwrap.dedent(
    '''
    import json, sys
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from mmviews.eval import evaluate_encoder, extract_embeddings
    from test_eval_extract import Enc, Toy, collate

    acc = Accelerator(cpu=True)
    loader = DataLoader(Toy(7), batch_size=2, collate_fn=collate)
    emb = extract_embeddings(Enc(), loader, accelerator=acc, fuse="mean")
    out = {
        "world": acc.num_processes,
        "n": emb.num_samples,
        "index": emb.index.tolist(),
        "views": emb.views.tolist(),
        "mask": emb.mask.tolist(),
        "class": emb.labels["class"].tolist(),
    }
    out["metrics"] = evaluate_encoder(
        Enc(), DataLoader(Toy(9), batch_size=2, collate_fn=collate), None,
        DataLoader(Toy(7), batch_size=2, collate_fn=collate),
        [{"kind": "knn", "k": 3}, "retrieval"], out_dir=sys.argv[1] + "/report", accelerator=acc,
        meta={"rank_written": acc.process_index},
    )
    with open(sys.argv[1] + f"/rank{acc.process_index}.json", "w") as f:
        json.dump(out, f)
    # Tear the gloo group down before exit: left to interpreter shutdown it can abort
    # ("terminate called without an active exception").
    import torch.distributed as dist
    acc.wait_for_everyone()
    dist.destroy_process_group()
    '''
)


def test_two_processes_gather_counts_each_sample_once(tmp_path: Path):
    from test_train_utils import free_port, started

    script = tmp_path / "extract_ddp.py"
    script.write_text(SCRIPT)
    # The two ranks are started here with the variables a launcher gives them (RANK, WORLD_SIZE,
    # MASTER_ADDR/PORT; Accelerator(cpu=True) then makes a gloo group): `accelerate launch` would
    # add a third process and its seconds of imports. Each in a session of its own, killed with
    # its group when the block ends, so a failed or hung rank leaves no process behind.
    pythonpath = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(started([sys.executable, str(script), str(tmp_path)], cwd=tmp_path,
                                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                             stdout=stack.enter_context(log.open("w")), stderr=subprocess.STDOUT))
                 for rank, log in zip((0, 1), logs)]
        for proc, log in zip(ranks, logs):
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    outs = []
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["world"] == 2
        # 7 samples over 2 processes with batch 2: the last step pads one duplicate
        # sample, which gather_for_metrics must drop.
        assert out["n"] == 7
        assert sorted(out["index"]) == list(range(7))
        order = torch.tensor(out["index"]).argsort()
        torch.testing.assert_close(torch.tensor(out["views"])[order], _reference(7))
        assert torch.tensor(out["mask"])[order][:, 1].tolist() == [i % 3 != 0 for i in range(7)]
        assert torch.tensor(out["class"])[order].tolist() == [i % 2 for i in range(7)]
        outs.append(out)
    # metrics computed once on the main process and broadcast: identical on both ranks
    assert outs[0]["metrics"] == outs[1]["metrics"] and "test/knn/class/top1" in outs[0]["metrics"]
    saved = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert saved["meta"]["rank_written"] == 0 and saved["meta"]["n_test"] == 7 and saved["meta"]["n_train"] == 9
