"""Embedding extraction (:mod:`mmviews.eval.extract`): in one process and in two real gloo
processes with ``gather_for_metrics``; ``fuse_views`` (its default, its shape check, the dtype it
keeps); and :class:`AutocastEncoder`, which runs the wrapped encoder under the autocast of the run's
precision on the device its parameters live on and hands back float32."""

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
from mmviews.eval import evaluate_encoder, extract_embeddings, fuse_views
from mmviews.eval.extract import AutocastEncoder


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
    from test_train_utils import REPO, free_port, started

    script = tmp_path / "extract_ddp.py"
    script.write_text(SCRIPT)
    # The two ranks are started here with the variables a launcher gives them (RANK, WORLD_SIZE,
    # MASTER_ADDR/PORT; Accelerator(cpu=True) then makes a gloo group): `accelerate launch` would
    # add a third process and its seconds of imports. Each in a session of its own, killed with
    # its group when the block ends, so a failed or hung rank leaves no process behind.
    # The checkout above tests/ first: the ranks import the mmviews these tests belong to (under
    # mutmut, its mutated copy), not whichever one is installed.
    pythonpath = os.pathsep.join(p for p in (str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    with contextlib.ExitStack() as stack:
        # cwd: the checkout (under mutmut, the mutants' folder, whose configuration its hooks read)
        ranks = [stack.enter_context(started([sys.executable, str(script), str(tmp_path)], cwd=REPO,
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
    # metrics computed once on the main process and broadcast: identical on both ranks, and the
    # numbers of one process evaluating the same splits
    assert outs[0]["metrics"] == outs[1]["metrics"] and "test/knn/class/top1" in outs[0]["metrics"]
    single = evaluate_encoder(Enc(), DataLoader(Toy(9), batch_size=2, collate_fn=collate), None,
                              DataLoader(Toy(7), batch_size=2, collate_fn=collate), [{"kind": "knn", "k": 3}, "retrieval"],
                              progress=False)
    assert outs[0]["metrics"] == pytest.approx(single)
    saved = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert saved["meta"]["rank_written"] == 0 and saved["meta"]["n_test"] == 7 and saved["meta"]["n_train"] == 9


# ---------------------------------------------------------------------------------------------
# fuse_views and AutocastEncoder
# ---------------------------------------------------------------------------------------------
def test_fuse_views_concatenates_by_default_with_absent_views_zeroed() -> None:
    views = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2) + 1.0
    mask = torch.tensor([[True, False, True], [False, True, True]])
    fused = fuse_views(views, mask)
    # written out by hand: sample 0 keeps views 0 and 2, sample 1 views 1 and 2
    expected = torch.tensor([[1.0, 2.0, 0.0, 0.0, 5.0, 6.0], [0.0, 0.0, 9.0, 10.0, 11.0, 12.0]])
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["concat", "mean"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fuse_views_keeps_the_embeddings_dtype(how: str, dtype: torch.dtype) -> None:
    """Half-precision embeddings stay half (no silent float32 copy of a large split), float64 stays float64."""
    views = torch.ones(4, 3, 2, dtype=dtype)
    mask = torch.tensor([[True, True, False]] * 4)
    fused = fuse_views(views, mask, how)
    assert fused.dtype == dtype
    expected = torch.ones(4, 2, dtype=dtype) if how == "mean" else torch.tensor([[1.0] * 4 + [0.0] * 2] * 4, dtype=dtype)
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


@pytest.mark.parametrize("views_shape,mask_shape", [((2, 3, 4), (3, 2)), ((2, 3), (2, 3)), ((2, 3, 4), (2, 3, 1))])
def test_fuse_views_names_both_shapes_when_they_do_not_fit(views_shape, mask_shape) -> None:
    """Either fault alone (views not [N, M, d], or a mask that is not views' [N, M]) is refused."""
    views, mask = torch.zeros(views_shape), torch.ones(mask_shape, dtype=torch.bool)
    message = f"views must be [N, M, d] and mask [N, M], got {views_shape} and {mask_shape}"
    with pytest.raises(ValueError) as raised:
        fuse_views(views, mask)
    assert str(raised.value) == message


def test_autocast_encoder_refuses_an_unknown_precision_naming_the_choices() -> None:
    with pytest.raises(ValueError) as raised:
        AutocastEncoder(torch.nn.Linear(2, 2), "fp8")
    assert str(raised.value) == "precision must be one of no, bf16, fp16, got 'fp8'"


class _Recorder(torch.nn.Module):
    """One linear map without bias (a single parameter tensor) that records the autocast state
    its forward runs under: ``(enabled on CPU, CPU autocast dtype, dtype of its output)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3, bias=False)
        self.seen: list[tuple[bool, torch.dtype, torch.dtype]] = []

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.lin(batch)
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), z.dtype))
        return z[:, None, :], torch.ones(z.shape[0], 1, dtype=torch.bool)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_forward_runs_under_the_precisions_autocast_and_returns_float32(precision: str, dtype: torch.dtype) -> None:
    inner = _Recorder()
    x = torch.randn(5, 4)
    z, mask = AutocastEncoder(inner, precision)(x)
    enabled, autocast_dtype, inner_dtype = inner.seen[-1]
    assert (enabled, autocast_dtype, inner_dtype) == (True, dtype, dtype)
    assert z.dtype == torch.float32 and mask.tolist() == [[True]] * 5
    # the reference: the same product computed in that precision by hand, then widened
    expected = (x.to(dtype) @ inner.lin.weight.detach().to(dtype).T).float()[:, None, :]
    torch.testing.assert_close(z, expected, rtol=0, atol=0)


def test_precision_no_runs_the_encoder_as_it_is() -> None:
    inner = _Recorder()
    x = torch.randn(5, 4)
    z, _ = AutocastEncoder(inner, "no")(x)
    assert inner.seen[-1][0] is False and inner.seen[-1][2] == torch.float32
    torch.testing.assert_close(z, (x @ inner.lin.weight.detach().T)[:, None, :], rtol=0, atol=0)


def test_an_encoder_without_parameters_runs_under_cpu_autocast() -> None:
    """A plain function (an encoder need not be a module) has no device of its own: CPU."""
    seen = []

    def encoder(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return (batch @ torch.ones(4, 3))[:, None, :], torch.ones(batch.shape[0], 1, dtype=torch.bool)

    z, _ = AutocastEncoder(encoder, "bf16")(torch.randn(2, 4))
    assert seen == [(True, torch.bfloat16)] and z.dtype == torch.float32


def test_the_autocast_is_the_parameters_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder whose parameters live off the CPU (the meta device stands in for a GPU here)
    gets the autocast of that device: on a CUDA run a CPU autocast would leave every CUDA op in
    float32 and the numbers would not be the run's. The request to ``torch.autocast`` is
    recorded (the meta device has no autocast of its own to run under)."""
    requested = []

    def recording_autocast(device_type: str, dtype: torch.dtype | None = None, **kwargs):
        requested.append((device_type, dtype))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch, "autocast", recording_autocast)

    class OffCpu(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(3, 4, device="meta"))

        def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # nothing computed on the meta device (its first kernel call costs seconds)
            return torch.zeros(batch.shape[0], 1, 3, dtype=torch.float16), torch.ones(batch.shape[0], 1, dtype=torch.bool)

    z, _ = AutocastEncoder(OffCpu(), "fp16")(torch.zeros(2, 4))
    assert requested == [("meta", torch.float16)] and z.dtype == torch.float32
