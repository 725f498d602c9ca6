"""Worker of the two-process distributed tests (tests/test_objectives_distributed.py).

Each rank joins a gloo process group, takes its slice of one fixed float64 batch, and records,
for every registered objective (and each of its parameter variants, with and without a view
mask), its loss and the gradient of that loss w.r.t. its local inputs; then the parameter
gradients of a small encoder wrapped in DDP; then the error raised when the ranks hold
different numbers of samples. Results go to ``<out_dir>/rank<r>.pt``; the test process
compares them with single-process runs on the concatenated batch.

The batch, masks and model are built by the functions below from fixed seeds, so the test
process rebuilds exactly the same tensors. Run by hand with ``python tests/dist_worker.py``.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2
K_LOCAL = 4  # samples per rank
M = 3  # views per sample (objectives with exact_views use that many)
D = 5  # embedding dimension
D_IN = 6  # input dimension of the DDP test encoder
TEMPERATURE = 0.3

# Constructor parameters of objectives that need some, and the variants worth covering.
# Objectives not listed are built with their defaults (plus the test temperature).
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "fmicl": [{"divergence": div} for div in ("kl", "js", "pearson", "sh", "tsallis", "vlc")]
    + [{"divergence": "kl", "similarity": "cosine"}],
    "er": [{"estimator": "joe"}, {"estimator": "plugin"}],
    "ipmc": [{"beta": 0.0}],
}


# Streamed score blocks: every objective that takes chunk_size also runs with blocks of this
# many local anchor samples (K_LOCAL = 4: an uneven last block), its local anchors scored
# against the gathered candidates block by block, the candidates' gradient flowing back through
# the gather. (Single-process equality of streamed and unchunked: test_objectives_streaming.py.)
STREAMED_CHUNK = 3


def objective_variants() -> list[tuple[str, str, dict[str, Any]]]:
    """(key, name, params) for every registered objective and each of its variants, plus a
    streamed variant (``chunk_size``) of the first for objectives that take one."""
    import inspect

    from mmviews.objectives import list_objectives, objective_class

    out = []
    for name in list_objectives():
        variants = list(VARIANTS.get(name, [{}]))
        parameters = inspect.signature(objective_class(name).__init__).parameters
        if "chunk_size" in parameters:
            variants.append({**variants[0], "chunk_size": STREAMED_CHUNK})
        if "learn_temperature" in parameters and parameters["learn_temperature"].default is False:
            # the learned temperature's gradient too (siglip learns by default), streamed as well
            variants.append({**variants[0], "learn_temperature": True, "chunk_size": STREAMED_CHUNK})
        for params in variants:
            key = name + "".join(f"[{k}={v}]" for k, v in sorted(params.items()))
            out.append((key, name, params))
    return out


def build_objective(name: str, params: dict[str, Any]):
    """Build with the test temperature when the objective takes one (seeded: some own modules)."""
    import inspect

    from mmviews.objectives import get_objective, objective_class

    params = dict(params)
    if "temperature" in inspect.signature(objective_class(name).__init__).parameters:
        params.setdefault("temperature", TEMPERATURE)
    torch.manual_seed(1234)
    return get_objective(name, **params)


def learned_gradients(objective) -> list[torch.Tensor]:
    """The gradients of the objective's learned parameters (a learned temperature, siglip's
    bias), then cleared; empty for objectives that learn none."""
    grads = [q.grad.detach().clone() for q in objective.trained_parameters()]
    for q in objective.trained_parameters():
        q.grad = None
    return grads


def views_of(name: str) -> int:
    from mmviews.objectives import objective_class

    return objective_class(name).exact_views or M


def supports_mask(name: str) -> bool:
    from mmviews.objectives import objective_class

    return bool(objective_class(name).supports_mask)


def full_batch(num_views: int) -> torch.Tensor:
    """[WORLD * K_LOCAL, num_views, D] float64, the concatenation of the ranks' batches."""
    generator = torch.Generator().manual_seed(100 + num_views)
    return torch.randn(WORLD * K_LOCAL, num_views, D, generator=generator, dtype=torch.float64)


def full_mask(num_views: int) -> torch.Tensor:
    """[WORLD * K_LOCAL, num_views] bool with some views absent on both ranks, one sample with a
    single present view (no anchor term) and one with none."""
    generator = torch.Generator().manual_seed(200 + num_views)
    mask = torch.rand(WORLD * K_LOCAL, num_views, generator=generator) > 0.3
    mask[0] = True
    mask[1] = False
    mask[1, 0] = True  # rank 0: a sample with one view
    mask[K_LOCAL + 1] = False  # rank 1: a sample with no view
    mask[K_LOCAL + 2] = True
    return mask


def full_inputs(num_views: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(300 + num_views)
    return torch.randn(WORLD * K_LOCAL, num_views, D_IN, generator=generator, dtype=torch.float64)


def encoder() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, D)).double()


def local_slice(rank: int) -> slice:
    return slice(rank * K_LOCAL, (rank + 1) * K_LOCAL)


# IPMC with every stateful part on (memory bank, view filter after a 1-epoch warm-up, Wasserstein
# critic with beta > 0), over IPMC_STEPS steps of a 2-step epoch on a dataset of IPMC_DATASET
# samples. gp_weight = 0 and bank_negatives = 0 (the whole bank) leave out the two random draws
# (the gradient penalty's interpolates and the bank's subsample): with them the replicas draw
# other numbers than one process would, and the runs agree only in distribution.
IPMC_STATEFUL = {"beta": 0.5, "memory_bank_size": 16, "bank_negatives": 0, "view_filter_k": 1, "warmup_epochs": 1,
                 "eta": 2, "dataset_size": 16, "critic_steps": 2, "critic_hidden": 8, "gp_weight": 0.0,
                 "critic_lr": 0.05, "gamma": 4.0}
IPMC_STEPS = 5
IPMC_DATASET = 16


def ipmc_sequence(rank: int | None) -> list[dict[str, torch.Tensor]]:
    """The trainer's calls on a stateful IPMC over IPMC_STEPS steps (critic step, loss, backward,
    on_step_end; on_epoch_end every 2 steps): per step the loss, the gradient w.r.t. this
    process's embeddings and the metrics. ``rank`` None: one process on the whole batches;
    else this rank's slice of them, under the running process group."""
    objective = build_objective("ipmc", IPMC_STATEFUL)
    part = slice(None) if rank is None else local_slice(rank)
    out = []
    for step in range(IPMC_STEPS):
        generator = torch.Generator().manual_seed(400 + step)
        batch = torch.randn(WORLD * K_LOCAL, M, D, generator=generator, dtype=torch.float64)
        # 2 steps per epoch: batch b of the epoch holds dataset samples 8b .. 8b + 7, in an order that changes
        first = (step % 2) * WORLD * K_LOCAL
        index = first + torch.randperm(WORLD * K_LOCAL, generator=generator)
        z = batch[part].clone().requires_grad_(True)
        critic = objective.critic_step(z.detach())
        result = objective.compute(z, None, index=index[part])
        result.loss.backward()
        objective.on_step_end(z.detach(), index[part])
        if step % 2 == 1:
            objective.on_epoch_end(step // 2)
        out.append({"loss": result.loss.detach(), "grad": z.grad.detach(),
                    **{k: v.detach() for k, v in {**critic, **result.metrics}.items()}})
    return out


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180)
    )
    from torch.nn.parallel import DistributedDataParallel

    results: dict[str, Any] = {}
    part = local_slice(rank)
    for key, name, params in objective_variants():
        try:
            objective = build_objective(name, params)
            num_views = views_of(name)
            for masked in (False, True) if objective.supports_mask else (False,):
                z = full_batch(num_views)[part].clone().requires_grad_(True)
                mask = full_mask(num_views)[part] if masked else None
                loss = objective(z, mask)
                loss.backward()
                results[f"{key}|mask={masked}"] = {"loss": loss.detach(), "grad": z.grad.detach(),
                                                   "param_grads": learned_gradients(objective)}

            # DDP: every rank encodes its inputs; DDP averages the parameter gradients.
            model = DistributedDataParallel(encoder())
            objective = build_objective(name, params)
            loss = objective(model(full_inputs(num_views)[part]))
            loss.backward()
            results[f"{key}|ddp"] = {
                "loss": loss.detach(),
                "grads": [p.grad.detach().clone() for p in model.module.parameters()],
            }
        except Exception:  # reported per objective by the test
            results[f"{key}|error"] = traceback.format_exc()

    try:
        results["ipmc_stateful"] = ipmc_sequence(rank)
    except Exception:
        results["ipmc_stateful|error"] = traceback.format_exc()

    # Ranks with different K: a clear ValueError on every rank (no hang, no silent mis-slicing).
    try:
        objective = build_objective("geometric_pvc", {})
        objective(full_batch(M)[: K_LOCAL + rank])
        results["unequal_K"] = None
    except ValueError as error:
        results["unequal_K"] = str(error)

    path = Path(out_dir) / f"rank{rank}.pt"
    torch.save(results, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


def launch(out_dir: str, timeout: float = 300.0, target: Any = None) -> None:
    """Run ``target(rank, world, init_file, out_dir)`` (default :func:`run_rank`) in ``WORLD``
    spawned processes; raise if one fails or hangs."""
    import torch.multiprocessing as mp

    init_file = os.path.join(out_dir, "store")
    context = mp.start_processes(
        target or run_rank, args=(WORLD, init_file, out_dir), nprocs=WORLD, join=False, start_method="spawn"
    )
    import time

    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed workers did not finish within {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        launch(tmp)
        for r in range(WORLD):
            res = torch.load(Path(tmp) / f"rank{r}.pt")
            errors = [k for k in res if k.endswith("|error")]
            print(f"rank {r}: {len(res)} results, errors: {errors}")
            for k in errors:
                print(res[k])
    sys.exit(0)
