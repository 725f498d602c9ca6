"""The setup of a training run, shared by :func:`mmviews.train.train` and ``mmviews bench``.

A run's parts, once built (:func:`~mmviews.train.build.build_run`), go through four steps before
the loop: :func:`make_accelerator` (the Accelerator a recipe asks for), :func:`prepare_run`
(optimiser, schedule, EMA teacher, sharding, ``accelerator.prepare``: a
:class:`~mmviews.train.step.Prepared`), :func:`planned_steps` (the run's length in optimiser
steps) and, every epoch, :func:`epoch_loader`. The trainer and the benchmarks call these same
functions, so that what a benchmark times is set up as ``mmviews train`` sets it up.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from torch import nn

from mmviews.config import TrainConfig
from mmviews.data.batch import ViewBatch
from mmviews.train.build import RunParts, uses_teacher
from mmviews.train.compiled import compile_encoder
from mmviews.train.distributed import process_group_kwargs
from mmviews.train.optim import build_optimizer, build_scheduler
from mmviews.eval.precision import resolve_precision
from mmviews.train.sharding import OBJECTIVE_GROUP, launcher_fsdp_hidden, run_sharding, shard_encoder
from mmviews.train.state import TrainState
from mmviews.train.step import Prepared, warn_batch_norm
from mmviews.train.teacher import EMATeacher
from mmviews.train.trackers import TRACKERS_DIR


class HostPreparedCollate:
    """The training loader's collate function followed by the encoder's host preparation
    (:meth:`~mmviews.modalities.MultiViewEncoder.host_preparation`): each batch is checked and
    its text tokenised while it is in host memory, in the loader's worker processes when there
    are any (reading values there costs no device synchronisation, and tokenising there keeps
    the main process feeding the device), and marked so that the adapters do not check it again
    in the step. The preparation holds no weights: workers receive it by pickling."""

    def __init__(self, collate: Callable[[Any], ViewBatch], prepare: Callable[[ViewBatch], ViewBatch]) -> None:
        self.collate, self.prepare = collate, prepare

    def __call__(self, samples: Any) -> ViewBatch:
        batch = self.collate(samples)
        return batch if batch.num_samples == 0 else self.prepare(batch)  # empty: every sample unreadable


def release_other_precision(mixed_precision: str) -> None:
    """Let this process's next Accelerator use ``mixed_precision`` (``"no"``, ``"bf16"``, ``"fp16"``).

    Accelerate keeps one ``AcceleratorState`` per process and refuses an Accelerator of another
    precision once it exists ("restart your runtime"). Runs one after another in one process (a
    sweep's runs, a notebook's, a float32 run after an ``auto`` one that chose bf16) would stop
    there, so the state of the finished run is dropped when the precision differs. The process
    group and device (Accelerate's ``PartialState``) are kept: a launched run's ranks stay joined."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def make_accelerator(config: TrainConfig, run_dir: Path, trackers: Sequence[str] = ()) -> Any:
    """The Accelerator of a run of ``config`` writing to ``run_dir``, logging to ``trackers``
    (``output.trackers`` once resolved; none for a benchmark). Created without the launcher's
    FSDP request: mmviews shards the encoder itself (:mod:`mmviews.train.sharding`)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, ProjectConfiguration

    config = resolve_precision(config)[0]  # "auto": the run resolved it already, a benchmark may not have
    release_other_precision(config.optimisation.mixed_precision)
    with launcher_fsdp_hidden():
        return Accelerator(
            cpu=config.cpu,
            mixed_precision=config.optimisation.mixed_precision,
            gradient_accumulation_steps=config.optimisation.grad_accum_steps,
            # data.batch_size is the global K; batches (pinned on CUDA, see build_run) are copied
            # to the device without blocking the host.
            dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),
            log_with=list(trackers) or None,  # output.trackers; metrics.csv is written by StepLogger regardless
            project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / TRACKERS_DIR)),
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=config.find_unused_parameters),
                             process_group_kwargs(config)],  # distributed.timeout_s
        )


def planned_steps(config: TrainConfig, batches_per_epoch: int) -> tuple[int, int]:
    """(optimiser steps of the whole run, optimiser steps per epoch)."""
    o = config.optimisation
    steps_per_epoch = math.ceil(batches_per_epoch / o.grad_accum_steps)
    total_steps = o.epochs * steps_per_epoch if o.max_steps is None else min(o.max_steps, o.epochs * steps_per_epoch)
    return total_steps, steps_per_epoch


def prepare_run(accelerator: Any, parts: RunParts) -> Prepared:
    """Optimiser, schedule and EMA teacher; ``accelerator.prepare``; checkpointed state."""
    config, o = parts.config, parts.config.optimisation
    encoder, objective = parts.encoder, parts.objective
    sharded = run_sharding(config, accelerator.num_processes) == "fsdp"
    if accelerator.num_processes > 1 and accelerator.device.type != "cpu":  # sharded or not
        encoder = nn.SyncBatchNorm.convert_sync_batchnorm(encoder)
    # The teacher copies the encoder before it is sharded, then is sharded like it (same units:
    # its EMA update is a lerp of matching shards).
    teacher = (EMATeacher(encoder, config.objective.teacher_momentum, autocast=accelerator.autocast)
               if uses_teacher(config, objective) else None)
    if sharded:  # before the optimiser: fully_shard replaces the parameters by their shards
        shard_encoder(encoder, config, accelerator.device, accelerator.num_processes)
        if teacher is not None:
            shard_encoder(teacher.module, config, accelerator.device, accelerator.num_processes)
    backbone_lr = o.lr if o.backbone_lr is None else o.backbone_lr
    # The objective's learned parameters (a learned temperature, siglip's bias) in a group of
    # their own: objective.lr, never weight decay (open_clip's treatment of logit_scale).
    objective.to(accelerator.device)  # before the optimiser holds its parameters
    groups = encoder.param_groups(backbone_lr, o.lr, o.weight_decay)
    learned = objective.trained_parameters()
    if learned:
        groups.append({"name": OBJECTIVE_GROUP, "params": learned, "lr": o.lr if config.objective.lr is None else config.objective.lr,
                       "weight_decay": 0.0})
    optimizer = build_optimizer(groups, o)
    batches_per_epoch = len(parts.train_loader)
    total_steps, steps_per_epoch = planned_steps(config, batches_per_epoch)
    scheduler = build_scheduler(optimizer, o, total_steps, steps_per_epoch)

    # The objective's own check of z (a host read of isfinite(z).all() per call, i.e. a
    # device synchronisation per step) is replaced by the loop's non-finite-loss check at
    # log steps (the trainer's _check_losses).
    objective.check_inputs = False
    # Likewise the adapters' checks of input values: they run where batches are collated, and
    # so does their preprocessing that needs no weights (tokenising text).
    loader = parts.train_loader
    if not isinstance(loader.collate_fn, HostPreparedCollate):
        loader.collate_fn = HostPreparedCollate(loader.collate_fn, parts.encoder.host_preparation())
    state = TrainState()
    # A sharded encoder gets Accelerate's autocast and float32 outputs but no DDP wrapper
    # (evaluation_mode): FSDP2 reduces its gradients.
    model = accelerator.prepare_model(encoder, evaluation_mode=True) if sharded else encoder
    if getattr(loader, "streamed", False):  # each process reads its own rows (mmviews.data.streaming)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        train_loader = state.stream = loader.to(accelerator.device)
    else:
        model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    # TrainState and the teacher are NOT registered with accelerator.register_for_checkpointing:
    # Accelerate reads such objects back with full unpickling (code from the checkpoint could
    # run). They are saved as JSON and safetensors by mmviews.train.checkpoint instead.
    if teacher is not None and not sharded:  # a sharded one is on the device already
        teacher.to(accelerator.device)
    warn_batch_norm(encoder, o.encode_chunk_size)
    if o.compile:  # after the teacher's copy: the teacher stays eager (it runs without gradients)
        compile_encoder(encoder)
    return Prepared(accelerator, model, objective, optimizer, scheduler, train_loader, teacher, state,
                    total_steps, batches_per_epoch, encode_chunk_size=o.encode_chunk_size,
                    dropout_seed=config.seed if o.sample_keyed_dropout else None, sharded=sharded,
                    device_flow=getattr(parts.encoder, "device_flow", None))


def epoch_loader(p: Prepared, parts: RunParts, epoch: int) -> Any:
    """The loader of ``epoch``, seeded so that a resumed run draws the same batches and
    augmentations, without the batches of this epoch already trained on."""
    # The prepared loader calls set_epoch(its own iteration count) on the sampler when an
    # iterator starts; set it to the true epoch so that a resumed run shuffles the same.
    p.train_loader.set_epoch(epoch)
    parts.sampler.set_epoch(epoch)
    parts.collator.set_epoch(epoch)
    parts.loader_generator.manual_seed(parts.config.seed * 1_000_003 + epoch)
    if p.state.stream is not None:  # a streamed run skips the rows already trained on by itself
        p.train_loader.skip_batches(p.state.batch_in_epoch)
        return p.train_loader
    if p.state.batch_in_epoch == 0:
        return p.train_loader
    loader = p.accelerator.skip_first_batches(p.train_loader, p.state.batch_in_epoch)  # resuming mid-epoch
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    return loader


def batches_forever(p: Prepared, parts: RunParts) -> Iterator[ViewBatch]:
    """Batches epoch after epoch, each epoch's loader as :func:`epoch_loader` gives it to the
    trainer's loop, without end (for a benchmark, which draws as many as it times)."""
    epoch = 0
    while True:
        yield from epoch_loader(p, parts, epoch)
        epoch += 1
