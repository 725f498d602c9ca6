"""Whether an adapter's forward takes part in collectives (``mmviews.modalities.collectives``), on
real gloo process groups: without a group, on a group of one process and on a group of two (this
process and a second one started here, which only joins the group's set-up and waits): only a
SyncBatchNorm in training mode on a group of more than one process, or an FSDP2-sharded module on
one, makes a forward collective; and the zeros made to mix with sharded parameters are plain
tensors of the parameter's dtype. (What an adapter does with the answer, with two processes
training: test_train_multigpu.py.)"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_train_utils import free_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmviews.modalities.collectives import plain_zeros_like, runs_collectives, syncs_batch_norm

# The second process of a group of two: it makes the same groups as the test (new_group and the
# mesh are set-ups every process of the group joins), then waits at a barrier until the test is done.
SECOND_RANK = """
import os
import sys
from datetime import timedelta
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2,
                        timeout=timedelta(seconds=120))
dist.new_group([0])
fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # skip the interpreter's teardown, where the gloo threads' destruction can abort the process
"""


def _group(world_size: int):
    """A gloo group of ``world_size`` with this process as rank 0 (the other rank, if any, in a
    subprocess); returns the subprocess or None."""
    assert not dist.is_initialized()
    port = free_port()
    other = None
    if world_size == 2:
        other = subprocess.Popen([sys.executable, "-c", SECOND_RANK, str(port)])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world_size,
                            timeout=timedelta(seconds=120))
    return other


def _sharded(world_size: int) -> nn.Module:
    module = nn.Linear(4, 4)
    fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    return module


def _sync_bn(group=None, training: bool = True) -> nn.Module:
    module = nn.Sequential(nn.Linear(3, 3), nn.SyncBatchNorm(3, process_group=group))
    return module.train(training)


def test_without_a_process_group_nothing_is_collective():
    assert not dist.is_initialized()
    for module in (_sync_bn(), nn.Sequential(nn.BatchNorm1d(3)), nn.Linear(2, 2)):
        assert not syncs_batch_norm(module) and not runs_collectives(module)


def test_on_a_group_of_one_nothing_is_collective():
    _group(1)
    try:
        sharded = _sharded(1)
        for module in (_sync_bn(), sharded, nn.Sequential(sharded, _sync_bn())):
            assert not syncs_batch_norm(module) and not runs_collectives(module)
    finally:
        dist.destroy_process_group()


def test_on_a_group_of_two_sync_batch_norm_in_training_and_sharded_modules_are_collective():
    other = _group(2)
    assert other is not None
    try:
        alone = dist.new_group([0])
        sharded = _sharded(2)
        # SyncBatchNorm in training mode on the default group: its forward shares batch statistics
        assert syncs_batch_norm(_sync_bn()) and runs_collectives(_sync_bn())
        assert syncs_batch_norm(nn.Sequential(nn.Linear(3, 3), _sync_bn()))  # found at any depth
        # ... not in eval mode, nor on a group of this process alone, nor a plain BatchNorm
        assert not syncs_batch_norm(_sync_bn(training=False)) and not runs_collectives(_sync_bn(training=False))
        assert not syncs_batch_norm(_sync_bn(alone)) and not runs_collectives(_sync_bn(alone))
        plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()
        assert not syncs_batch_norm(plain) and not runs_collectives(plain)
        # a sharded module is collective in any mode; holding one makes its parent collective
        assert runs_collectives(sharded) and runs_collectives(sharded.eval())
        assert runs_collectives(nn.Sequential(nn.Linear(4, 4), sharded)) and not syncs_batch_norm(sharded)
        assert not runs_collectives(nn.Linear(4, 4))
        # zeros to mix with a sharded parameter (a DTensor outside a forward) are a plain tensor
        weight = sharded.weight
        assert isinstance(weight, DTensor)
        zeros = plain_zeros_like(weight, 2, 3)
        assert type(zeros) is torch.Tensor and zeros.shape == (2, 3) and zeros.dtype == weight.dtype
        assert not zeros.any() and zeros.device == weight.device
        dist.barrier()
    except BaseException:
        other.kill()  # it would wait at the barrier until the group's timeout
        other.wait()
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    assert other.wait(timeout=120) == 0


def test_plain_zeros_take_the_parameters_dtype_and_device():
    parameter = nn.Parameter(torch.ones(3, dtype=torch.float64))
    zeros = plain_zeros_like(parameter, 4, 2)
    assert type(zeros) is torch.Tensor and zeros.shape == (4, 2) and zeros.dtype == torch.float64
    assert not zeros.requires_grad and not zeros.any() and zeros.device == parameter.device
    assert plain_zeros_like(parameter).shape == ()
    on_meta = nn.Parameter(torch.empty(3, dtype=torch.bfloat16, device="meta"))  # made where the parameter is
    assert plain_zeros_like(on_meta, 2).device.type == "meta" and plain_zeros_like(on_meta, 2).dtype == torch.bfloat16
    assert plain_zeros_like(parameter, 0, 5).shape == (0, 5)
