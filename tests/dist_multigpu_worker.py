"""Worker of the two-process multi-GPU readiness tests (tests/test_train_multigpu.py): SyncBatchNorm
with missing views, and the objectives' check of the ranks' batch sizes without host reads (then,
in the same processes, the process group's timeout taken from a recipe: :func:`timeout_rank`).

On GPUs with N > 1 processes the trainer converts BatchNorm to SyncBatchNorm, whose training
forward and backward are collectives: every process must run each of them as often as the
others, or the others wait forever (NCCL) for a process that skipped one. torch's SyncBatchNorm
refuses CPU tensors, so here it is replaced by :class:`AllReduceBatchNorm`, a SyncBatchNorm
subclass (so that mmviews treats it as one) whose statistics are all-reduced with gloo, forward
and backward, and which counts the collectives it issues.

Each rank trains a MultiViewEncoder (image: small CNN with BatchNorm2d in the backbone; seq:
transformer; both with BatchNorm in the MLP head), wrapped in DDP as the trainer does, plus an
EMA teacher copy, for a few steps in which the image modality is entirely missing on rank 1
only, then present in a single row on rank 1 only. It records the number of collectives per
step and ends with a barrier. The process group's timeout is short: a rank that waits in a
collective the other never issues fails within seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
K_LOCAL = 4
PG_TIMEOUT_S = 20.0
COUNTS = {"forward": 0, "backward": 0}


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes, forward and backward (the gradient of a sum is the summed gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        COUNTS["forward"] += 1
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        COUNTS["backward"] += 1
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllReduceBatchNorm(nn.SyncBatchNorm):
    """SyncBatchNorm that works on CPU: per-channel sum, sum of squares and count of the rows of
    every process (one all-reduce forward, one backward), for any input ``[N, C, *]``, N >= 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized()):
            return super().forward(x)  # eval: running statistics, no collective (as SyncBatchNorm)
        c = x.shape[1]
        flat = x.transpose(0, 1).reshape(c, -1)  # [C, rows]
        count = torch.full((1,), float(flat.shape[1]), dtype=x.dtype)
        stats = _AllReduceSum.apply(torch.cat([flat.sum(1), (flat * flat).sum(1), count]))
        n = stats[-1].clamp_min(1.0)
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp_min(0.0)
        with torch.no_grad():
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(var.detach() * n / (n - 1).clamp_min(1.0), self.momentum)
            self.num_batches_tracked += 1
        shape = (1, c) + (1,) * (x.dim() - 2)
        y = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + self.eps)
        return y * self.weight.reshape(shape) + self.bias.reshape(shape)


def build_encoder() -> nn.Module:
    from mmviews.modalities import MultiViewEncoder
    from mmviews.modalities.presets import tiny_config

    torch.manual_seed(0)
    return MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {
        "seq": tiny_config("feature_sequence"), "image": tiny_config("small_cnn")}})


def convert_batchnorm(encoder: nn.Module) -> int:
    """Turn every BatchNorm of ``encoder`` into an :class:`AllReduceBatchNorm` in place (the
    trainer's ``convert_sync_batchnorm`` on GPUs; in place because DDP refuses SyncBatchNorm on
    CPU, so the conversion comes after wrapping). Returns how many."""
    converted = 0
    for module in encoder.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.__class__, module.process_group = AllReduceBatchNorm, None
            converted += 1
    return converted


def batch(rank: int, step: int):
    """Step 0: every view present on both ranks. Step 1: no image view on rank 1 (a modality
    missing on one rank only). Step 2: exactly one present image view on rank 1."""
    from mmviews.data.batch import ViewBatch, ViewInfo

    g = torch.Generator().manual_seed(10 * step + rank)
    views = [ViewInfo("seq_0", "seq", 0), ViewInfo("image_0", "image", 0), ViewInfo("image_1", "image", 1)]
    mask = torch.ones(K_LOCAL, 3, dtype=torch.bool)
    if rank == 1 and step == 1:
        mask[:, 1:] = False
    if rank == 1 and step == 2:
        mask[:, 1:] = False
        mask[0, 1] = True
    inputs = {"seq": {"values": torch.randn(K_LOCAL, 12, 6, generator=g)},
              "image": {"values": torch.rand(K_LOCAL * 2, 3, 32, 32, generator=g)}}
    return ViewBatch(inputs=inputs, views=views, mask=mask)


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    from torch.nn.parallel import DistributedDataParallel

    from mmviews.objectives import get_objective
    from mmviews.train.teacher import EMATeacher

    result: dict[str, Any] = {"steps": []}
    try:
        encoder = build_encoder()
        model = DistributedDataParallel(encoder, find_unused_parameters=True)
        result["batchnorm_layers"] = convert_batchnorm(encoder)
        teacher = EMATeacher(encoder, 0.9)  # copied after the conversion, as in the trainer
        objective = get_objective("mv_dhel", temperature=0.5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            before = dict(COUNTS)
            b = batch(rank, step)
            z, mask = model(b)
            z_teacher, _ = teacher(b)
            loss = objective(z, mask) + (z * z_teacher).sum() * 1e-3
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            teacher.update(model.module)
            result["steps"].append({k: COUNTS[k] - before[k] for k in COUNTS} | {"loss": float(loss)})
        result["running_mean"] = model.module.adapters["image"].head.net[1].running_mean.clone()
        dist.barrier()
    except Exception:
        result["error"] = traceback.format_exc()
    if "error" not in result:
        result.update(batch_size_checks(rank))
    path = Path(out_dir) / f"rank{rank}.pt"
    torch.save(result, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    dist.destroy_process_group()


def batch_size_checks(rank: int) -> dict[str, Any]:
    """The objectives' check that every rank holds the same K, as in training (``check_inputs``
    off): host reads per call (only the first call per K reads), and the errors when the ranks'
    K differ, one of them new to this process (K = 4 was seen, K = 5 was not)."""
    from mmviews.bench.host_reads import HostReadRecorder
    from mmviews.objectives import get_objective

    out: dict[str, Any] = {}
    objective = get_objective("mv_dhel", temperature=0.5)
    objective.check_inputs = False
    reads = []
    for call in range(3):
        z = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(call))  # K = 6: new to this process
        with HostReadRecorder() as recorder:
            objective(z)
        reads.append([f"{r.op} at {r.where}" for r in recorder.reads])
    out["reads_per_call"] = reads
    try:
        objective(torch.randn(K_LOCAL + rank, 3, 8))
        out["unequal_K"] = None
    except (ValueError, RuntimeError) as error:
        out["unequal_K"] = f"{type(error).__name__}: {error}"
    return out


def run_rank_then_timeout(rank: int, world: int, init_file: str, out_dir: str, port: int,
                          recipe: dict[str, Any]) -> None:
    """:func:`run_rank`, then :func:`timeout_rank` in the same process (one interpreter start for
    both); an error of the latter is recorded in its ``timeout<rank>.pt`` (as ``error``)."""
    run_rank(rank, world, init_file, out_dir)
    try:
        timeout_rank(rank, world, port, out_dir, recipe)
    except Exception:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"timeout{rank}.pt")


def launch(out_dir: str, timeout: float = 120.0, then_timeout: tuple[int, dict[str, Any]] | None = None) -> None:
    """Run :func:`run_rank` in ``WORLD`` spawned processes; ``TimeoutError`` if they do not end
    within ``timeout`` seconds (then they are terminated). ``then_timeout`` = ``(port, recipe)``:
    each process then runs :func:`timeout_rank` with them (:func:`run_rank_then_timeout`)."""
    import time

    import torch.multiprocessing as mp

    store = os.path.join(out_dir, "store")
    if then_timeout is None:
        context = mp.start_processes(run_rank, args=(WORLD, store, out_dir), nprocs=WORLD, join=False,
                                     start_method="spawn")
    else:
        context = mp.start_processes(run_rank_then_timeout, args=(WORLD, store, out_dir, *then_timeout), nprocs=WORLD,
                                     join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"SyncBatchNorm workers did not finish within {timeout} s")
    except mp.ProcessExitedException as error:  # gloo aborts on collectives of different sizes
        raise AssertionError(f"a rank died ({error}): the ranks' collectives were out of step (under NCCL, a "
                             "hang)") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


def timeout_rank(rank: int, world: int, port: int, out_dir: str, recipe: dict[str, Any]) -> None:
    """Join the process group as ``accelerate launch`` would start this process (environment
    variables), through mmviews' :func:`~mmviews.train.distributed.process_state` with ``recipe``
    (its ``distributed.timeout_s`` set to 77), and record the group's timeout."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from mmviews.config import config_from_dict
    from mmviews.train.distributed import process_state

    config = config_from_dict({**recipe, "cpu": True, "distributed": {"timeout_s": 77}})
    state = process_state(config)
    group = dist.distributed_c10d._get_default_group()
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    torch.save({"num_processes": state.num_processes, "timeout_s": timeout.total_seconds()},
               Path(out_dir) / f"timeout{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
