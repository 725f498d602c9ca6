"""One rank of the two-process adapter checks of ``test_modalities_base_collectives.py``.

Rank 0 runs :func:`run` inside the pytest process (so that mutation testing records the test);
rank 1 runs this file as a script. Both build the same adapters from the same seeds and go
through the same steps; rank 0 has no present item (it must still join every collective the
other rank's forward and backward issue), rank 1 has all of its items. Rank 0 returns what it
saw for the test to check.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmviews.data.batch import PresentItems
from mmviews.modalities import build_adapter
from mmviews.modalities.presets import example_inputs, tiny_config

BATCH = 4
# How long a rank waits in a collective the other never joins: a broken join fails in seconds.
TIMEOUT = timedelta(seconds=30)


def _items(rank: int, total: int = BATCH) -> PresentItems:
    return PresentItems((), total) if rank == 0 else PresentItems(tuple(range(total)), total)


def _rows_seen(module: nn.Module) -> list[int]:
    seen: list[int] = []
    module.register_forward_hook(lambda _module, args, _out: seen.append(int(args[0].shape[0])))
    return seen


def _sharded(adapter: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(adapter.backbone, mesh=init_device_mesh("cpu", (2,)))
    return adapter


def _whole_grads(module: nn.Module) -> list[torch.Tensor]:
    """The sharded gradients, whole (a collective: both ranks ask)."""
    return [p.grad.full_tensor() for p in module.parameters()]


def batch_norm_backbone_step(rank: int) -> dict[str, Any]:
    """A small CNN (plain BatchNorm in its backbone) whose backbone FSDP2 shards over the two
    processes: rank 0 runs zero rows through the backbone, its BatchNorm layers in eval mode for
    that pass (zero rows are no batch). Also: the gradients of rank 1's batch by one process."""
    torch.manual_seed(0)
    adapter = _sharded(build_adapter(tiny_config("small_cnn"))).train()
    torch.manual_seed(0)
    alone = build_adapter(tiny_config("small_cnn")).train()
    inputs = example_inputs("small_cnn", BATCH, seed=1)
    seen = _rows_seen(adapter.backbone)
    norms = [m for m in adapter.backbone.modules() if isinstance(m, nn.BatchNorm2d)]
    # the last one is kept in eval mode (as a user may fix some statistics): it stays so
    for model in (adapter, alone):
        [m for m in model.backbone.modules() if isinstance(m, nn.BatchNorm2d)][-1].eval()
    modes: list[bool] = []
    norms[0].register_forward_pre_hook(lambda module, _args: modes.append(module.training))
    out = adapter.embed_present(inputs, _items(rank))
    out.sum().backward()
    alone(inputs).sum().backward()
    return {"out": out.detach(), "requires_grad": out.requires_grad, "rows": seen, "norm_modes": modes,
            "modes_after": [m.training for m in norms], "batches": [int(m.num_batches_tracked) for m in norms],
            "running_means": [m.running_mean.clone() for m in norms], "grads": _whole_grads(adapter.backbone),
            "alone_grads": [p.grad for p in alone.backbone.parameters()]}


def sharded_backbone_step(rank: int) -> dict[str, Any]:
    """An ``mlp`` adapter (no BatchNorm in its backbone) whose backbone FSDP2 shards over the
    two processes; its head has a plain BatchNorm. Rank 0 runs its first row through the
    backbone and cuts it before the head."""
    config = {"type": "mlp", "input_dim": 3, "hidden_dim": 8, "embed_dim": 4}
    torch.manual_seed(0)
    adapter = _sharded(build_adapter(config)).train()
    torch.manual_seed(0)
    alone = build_adapter(config).train()
    # rank 1's items, all present; rank 0's are absent slots: zero-filled, length 0 (which the input
    # check would refuse for a present item)
    present_inputs = {"values": torch.randn(BATCH, 1, 3, generator=torch.Generator().manual_seed(2)),
                      "lengths": torch.ones(BATCH, dtype=torch.long), "names": list("abcd")}
    absent_inputs = {"values": torch.zeros(BATCH, 1, 3), "lengths": torch.zeros(BATCH, dtype=torch.long),
                     "names": [""] * BATCH}
    seen = _rows_seen(adapter.backbone)
    head_norm = adapter.head.net[1]
    out = adapter.embed_present(absent_inputs if rank == 0 else present_inputs, _items(rank))
    out.sum().backward()
    alone(present_inputs).sum().backward()
    grads = _whole_grads(adapter.backbone)
    head_batches = int(head_norm.num_batches_tracked)
    # a batch of one item, with a list input, under bfloat16 autocast: rank 0 runs its only row, and
    # its zero rows keep the parameters' dtype
    one = {"values": torch.zeros(1, 1, 3), "lengths": torch.tensor([0 if rank == 0 else 1]), "names": ["a"]}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one_out = adapter.embed_present(one, _items(rank, 1))
    one_out.float().sum().backward()
    return {"out": out.detach(), "requires_grad": out.requires_grad, "rows": seen, "one_dtype": one_out.dtype,
            "head_batches": head_batches, "grads": grads,
            "alone_grads": [p.grad for p in alone.backbone.parameters()]}


def run(rank: int, port: int) -> dict[str, Any]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        results = {"batch_norm": batch_norm_backbone_step(rank), "sharded": sharded_backbone_step(rank)}
        dist.barrier()
        return results
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(1, int(sys.argv[1]))
    # Done: skip the interpreter's teardown, where the gloo and FSDP threads' destruction can abort
    # the process ("terminate called without an active exception") after every step has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
