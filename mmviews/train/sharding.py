"""Sharded training: parameters, gradients and optimiser state split over the processes with
torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), inside Accelerate's multi-process state.

Why mmviews shards the encoder itself: Accelerate's FSDP state does not come up on CPU, and on GPU
it would shard the model by its own wrap policy. So :func:`launcher_fsdp_hidden` hides the
launcher's FSDP request from Accelerate, which sets up the ordinary multi-process state (gloo or
NCCL) and leaves the model alone, and :func:`shard_encoder` applies ``fully_shard`` per adapter
unit: one code path on CPU and GPU. FSDP1 is refused because it flattens parameters, which the
per-adapter parameter groups and the EMA teacher do not survive. Checkpoints hold full tensors
(:func:`full_model_state`, :func:`full_optimizer_state`), so a run resumes on any process count.
The recipe keys, the units, mixed precision and what works sharded are in
``docs/distributed.md`` ("Sharding").
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import nn

from mmviews.config import FSDP_FP16_REFUSAL, ConfigError, TrainConfig
from mmviews.eval.precision import resolve_precision
from mmviews.train.distributed import LAUNCHER_FSDP, fsdp_requested_by_launcher

SHARDINGS = ("none", "fsdp")
UNITS = ("backbone", "layers", "adapter")


def requested_sharding(config: TrainConfig) -> str:
    """``"fsdp"`` or ``"none"``: the recipe's ``distributed.sharding``, or ``"fsdp"`` when the
    launcher asked for FSDP version 2; a :class:`ConfigError` for anything else."""
    d = config.distributed
    if d.sharding not in SHARDINGS:
        raise ConfigError(f"key 'distributed.sharding': {d.sharding!r} is not one of {list(SHARDINGS)}")
    if not isinstance(d.fsdp_units, dict):
        raise ConfigError(f"key 'distributed.fsdp_units': a mapping of modality to one of {list(UNITS)}, "
                          f"got {d.fsdp_units!r}")
    for modality, unit in d.fsdp_units.items():
        if modality not in config.adapters:
            raise ConfigError(f"key 'distributed.fsdp_units.{modality}': no adapter for modality {modality!r} "
                              f"(adapters: {sorted(config.adapters)})")
        if unit not in UNITS:
            raise ConfigError(f"key 'distributed.fsdp_units.{modality}': {unit!r} is not one of {list(UNITS)}")
    version = fsdp_requested_by_launcher()
    if version is not None:
        if version != "2":
            raise ConfigError(f"accelerate launch --use_fsdp with FSDP_VERSION={version}: mmviews shards with FSDP2 "
                              "only; launch with --fsdp_version 2")
        return "fsdp"
    return d.sharding


def run_sharding(config: TrainConfig, num_processes: int) -> str:
    """The sharding this run uses: :func:`requested_sharding`, ``"none"`` on one process."""
    asked = requested_sharding(config)
    if num_processes < 2:
        return "none"
    if asked == "fsdp" and config.optimisation.mixed_precision == "fp16":
        # Accelerate's GradScaler unscales whole gradients; sharded ones need FSDP's own scaler.
        raise ConfigError(f"key 'optimisation.mixed_precision': {FSDP_FP16_REFUSAL}")
    return asked


@contextlib.contextmanager
def launcher_fsdp_hidden() -> Iterator[None]:
    """Accelerate's state created without the launcher's FSDP request (see the module
    docstring): the ordinary multi-process state, the model left to :func:`shard_encoder`."""
    saved = os.environ.pop(LAUNCHER_FSDP, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[LAUNCHER_FSDP] = saved


def _policy(mixed_precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _shard_units(encoder: nn.Module, units: dict[str, str], shard: Any) -> None:
    for modality, adapter in encoder.adapters.items():
        unit = units.get(modality, "backbone")
        backbone = getattr(adapter, "backbone", None)
        if unit == "adapter" or backbone is None or not any(True for _ in backbone.parameters()):
            shard(adapter)
            continue
        if unit == "layers":
            try:
                blocks = adapter.backbone_blocks()
            except NotImplementedError as error:
                raise ConfigError(f"key 'distributed.fsdp_units.{modality}': 'layers' needs the adapter's repeated "
                                  f"blocks ({error}); use 'backbone'") from None
            for block in blocks:
                shard(block)
        shard(backbone)
        shard(adapter.head)
    shard(encoder)


def shard_encoder(encoder: nn.Module, config: TrainConfig, device: torch.device, num_processes: int) -> nn.Module:
    """``fully_shard`` the encoder (in place) over the ``num_processes`` processes of the
    process group, by the recipe's units (``distributed.fsdp_units``) and mixed precision."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    encoder.to(device)
    mesh = init_device_mesh(device.type, (num_processes,))
    # `auto` as the run resolves it (a benchmark's config may not be resolved yet)
    policy = _policy(resolve_precision(config)[1].used)

    def shard(module: nn.Module) -> None:
        fully_shard(module, mesh=mesh, mp_policy=policy)

    if policy.param_dtype is not None:
        # BatchNorm keeps float32 weights (units of their own, no cast): its running statistics
        # are float32 buffers, which a bf16 weight cannot be combined with; autocast then
        # handles it as without sharding.
        for norm in [m for m in encoder.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
            fully_shard(norm, mesh=mesh, mp_policy=_policy("no"))
    _shard_units(encoder, config.distributed.fsdp_units, shard)
    return encoder


def shard_like(copy: nn.Module, config: TrainConfig, device: torch.device, num_processes: int) -> nn.Module:
    """A copy of the encoder (the EMA teacher's) sharded with the same units."""
    return shard_encoder(copy, config, device, num_processes)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full (gathered) state dict of a sharded module, on the CPU, on rank 0 (empty on the
    other processes). Collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(cpu_offload=True))


def load_full_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Full tensors (every process holds them) into the shards of ``module``; every key must match
    (a ``RuntimeError`` naming the keys missing and unexpected otherwise)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # torch 2.11's set_model_state_dict with full_state_dict accepts a state with keys missing
    # (those parameters silently keep their values), strict or not: the keys are compared here.
    names = set(module.state_dict())
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise RuntimeError(f"the model state does not match the encoder: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    set_model_state_dict(module, state, options=_options(strict=True))


#: The optimiser group of the objective's learned parameters (:func:`mmviews.train.setup.prepare_run`):
#: replicated plain tensors outside the sharded encoder, which torch's sharded state-dict functions
#: cannot name. Their state is written beside the encoder's as ``objective.<k>`` (k: their order).
OBJECTIVE_GROUP = "objective"


def _outside_parameters(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the optimiser's parameters outside the sharded module, in group order."""
    params = [q for group in optimizer.param_groups if group.get("name") == OBJECTIVE_GROUP for q in group["params"]]
    return [(f"{OBJECTIVE_GROUP}.{k}", q) for k, q in enumerate(params)]


@contextlib.contextmanager
def _module_groups_only(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimiser as if it held the sharded module's parameters alone: its objective group
    and that group's state set aside, and put back on leaving."""
    groups = optimizer.param_groups
    if not any(g.get("name") == OBJECTIVE_GROUP for g in groups):
        yield
        return
    outside = [q for _, q in _outside_parameters(optimizer)]
    saved = {q: optimizer.state.pop(q) for q in outside if q in optimizer.state}
    optimizer.param_groups = [g for g in groups if g.get("name") != OBJECTIVE_GROUP]
    try:
        yield
    finally:
        # the module's groups as they are now (a load replaces them, with the checkpoint's
        # hyperparameters), the objective's where they were
        current = iter(optimizer.param_groups)
        optimizer.param_groups = [g if g.get("name") == OBJECTIVE_GROUP else next(current) for g in groups]
        optimizer.state.update(saved)


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser's state with full tensors, keyed by parameter name, on rank 0 (empty on the
    others). Collective. The objective's learned parameters (replicated) come last, as
    ``objective.<k>``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _module_groups_only(optimizer):
        state = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))
    outside = _outside_parameters(optimizer)
    if state and outside:
        for group in optimizer.param_groups:
            if group.get("name") == OBJECTIVE_GROUP:
                ids = {id(q) for q in group["params"]}
                state["param_groups"].append({**{k: v for k, v in group.items() if k != "params"},
                                              "params": [name for name, q in outside if id(q) in ids]})
        for name, q in outside:
            if q in optimizer.state:
                state["state"][name] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                                        for k, v in optimizer.state[q].items()}
    return state


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A state written by :func:`full_optimizer_state` (every process holds it) into the optimiser."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    outside = dict(_outside_parameters(optimizer))
    module_state = {"state": {k: v for k, v in state["state"].items() if k not in outside},
                    "param_groups": [g for g in state["param_groups"] if g.get("name") != OBJECTIVE_GROUP]}
    # Not strict: a parameter that never had a gradient (e.g. BERT's pooler under mean pooling)
    # has no state in an unsharded run's checkpoint, and starts without one, as it would there.
    with _module_groups_only(optimizer):
        set_optimizer_state_dict(module, optimizer, module_state, options=_options(strict=False))
    for name, q in outside.items():
        if name in state["state"]:  # "step" stays on the CPU, as torch.optim keeps it
            optimizer.state[q] = {k: v.to(q.device, q.dtype) if isinstance(v, torch.Tensor) and k != "step" else v
                                  for k, v in state["state"][name].items()}
    saved_groups = [g for g in state["param_groups"] if g.get("name") == OBJECTIVE_GROUP]
    for group, saved in zip([g for g in optimizer.param_groups if g.get("name") == OBJECTIVE_GROUP], saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


@contextlib.contextmanager
def accelerate_state_without(accelerator: Any, model: nn.Module) -> Iterator[None]:
    """Accelerate's ``save_state``/``load_state`` without the sharded model and its optimiser:
    they would pickle the local shards (DTensors) from rank 0 only; mmviews writes and reads
    their full tensors itself (:mod:`mmviews.train.checkpoint`). The scheduler, the gradient
    scaler and the RNG states stay Accelerate's."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in models if m is not model]
    accelerator._optimizers = []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def whole_encoder(config: TrainConfig, state: dict[str, torch.Tensor], source: str = "recipe") -> nn.Module:
    """An unsharded encoder of the recipe holding the full tensors ``state`` (from
    :func:`full_model_state`), e.g. to write ``encoder/``; the training RNG streams are left as
    they were (building initialises weights)."""
    from mmviews.run import build_encoder

    with torch.random.fork_rng(devices=[]):
        encoder = build_encoder(config, source)
    encoder.load_state_dict(state, strict=True)
    return encoder


def optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimiser state keyed by parameter name (:func:`full_optimizer_state`) in
    ``torch.optim``'s own layout (parameters numbered in the order of the groups), the one an
    unsharded run's ``optimizer.bin`` has: checkpoints resume sharded or not."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The reverse of :func:`optimizer_state_by_index` for ``optimizer`` over ``module``'s parameters."""
    name_of = {id(param): name for name, param in module.named_parameters()}
    name_of.update({id(param): name for name, param in _outside_parameters(optimizer)})
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    groups = state["param_groups"]
    if sum(len(group["params"]) for group in groups) != len(names):
        raise ValueError(f"the optimiser state has {sum(len(g['params']) for g in groups)} parameters, this run's "
                         f"optimiser {len(names)}")
    by_name = [{**group, "params": [names[i] for i in group["params"]]} for group in groups]
    return {"state": {names[int(i)]: value for i, value in state["state"].items()}, "param_groups": by_name}


def unit_parameter_bytes(encoder: nn.Module, units: dict[str, str]) -> list[int]:
    """Bytes of the parameters of each sharding unit :func:`shard_encoder` would make (unsharded
    modules): what one process gathers in full while that unit computes."""
    sizes: list[int] = []
    claimed: set[int] = set()

    def unit(module: nn.Module) -> None:
        params = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        sizes.append(sum(p.numel() * p.element_size() for p in params))

    def visit(module: nn.Module) -> None:  # the order fully_shard is applied in: inner units first
        unit(module)

    for modality, adapter in encoder.adapters.items():
        kind = units.get(modality, "backbone")
        backbone = getattr(adapter, "backbone", None)
        if kind == "adapter" or backbone is None:
            visit(adapter)
            continue
        if kind == "layers":
            for block in adapter.backbone_blocks():
                visit(block)
        visit(backbone)
        visit(adapter.head)
    visit(encoder)
    return sizes
