"""Run assembly: datasets, views, loaders, encoder and objective from a recipe, checked to fit
together before any training work (``mmviews train --check`` stops here).

Global batches: ``data.batch_size`` is the number of samples K per micro-batch across all
processes. The training loader yields global batches of K indices (:class:`GlobalBatchSampler`)
that Accelerate splits between the N processes (``split_batches=True``), so K must be a
multiple of N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mmviews.config import ConfigError, TrainConfig
from mmviews.registry import did_you_mean
from mmviews.data.loaders import (
    EpochCollator,
    GlobalBatchSampler,
    build_dataset_split,
    loader_options,
    pin_memory_default,
)
from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator, ViewSpec
from mmviews.modalities.dropout import enable_sample_keyed_dropout
from mmviews.objectives import MultiViewObjective, get_objective, list_objectives, objective_class
from mmviews.run import build_encoder, eval_loaders

__all__ = ["RunParts", "build_encoder", "build_objective", "build_run", "start_from_pretrained", "uses_teacher"]


@dataclass
class RunParts:
    """Everything a run needs, built and checked before any training work."""

    config: TrainConfig
    datasets: dict[str, Any]
    view_spec: ViewSpec
    collator: EpochCollator  # the training collator; set_epoch reaches persistent workers too
    sampler: GlobalBatchSampler  # the StreamLoader itself in a streamed run (data.streaming)
    train_loader: DataLoader  # or a mmviews.data.streaming.StreamLoader
    eval_loaders: dict[str, DataLoader | None]
    encoder: nn.Module
    objective: MultiViewObjective
    loader_generator: torch.Generator = field(default_factory=torch.Generator)


def uses_teacher(config: TrainConfig, objective: MultiViewObjective) -> bool:
    """An EMA teacher is kept when the recipe asks (``objective.ema_teacher``) or the objective
    needs one (``needs_teacher``)."""
    return bool(config.objective.ema_teacher or objective.needs_teacher)


def build_objective(config: TrainConfig, num_views: int, source: str = "recipe",
                    dataset_size: int | None = None) -> MultiViewObjective:
    """The objective, checked against the view set (e.g. ``simclr`` needs M = 2).

    ``dataset_size`` fills the constructor's ``dataset_size`` (IPMC's view-filter memory) for
    objectives that take one (``takes_dataset_size``) when the recipe leaves it out."""
    name = config.objective.name
    params = dict(config.objective.params)
    if params.get("temperature") == PRETRAINED:  # a placeholder until the encoder is built (start_from_pretrained)
        params["temperature"] = 1.0
    if (dataset_size is not None and "dataset_size" not in params and name in list_objectives()
            and objective_class(name).takes_dataset_size):
        params["dataset_size"] = dataset_size
    try:
        objective = get_objective(name, **params)
    except (ValueError, TypeError) as error:
        key = "objective.name" if name not in list_objectives() else "objective.params"
        raise ConfigError(f"{source}: key '{key}': {error}") from error
    try:
        objective.check_views(num_views)
    except ValueError as error:
        raise ConfigError(f"{source}: key 'objective.name': {error}; the recipe's views give M = {num_views}") from error
    if uses_teacher(config, objective) and not objective.takes_teacher:
        raise ConfigError(f"{source}: key 'objective.ema_teacher': objective {name!r} takes no teacher "
                          "embeddings (its loss has no 'teacher' argument)")
    return objective


#: ``objective.params.temperature: pretrained``: start from the pretrained open_clip model's value.
PRETRAINED = "pretrained"


def start_from_pretrained(config: TrainConfig, objective: MultiViewObjective, encoder: nn.Module,
                          source: str = "recipe") -> None:
    """``objective.params.temperature: pretrained``: the objective starts from the learned
    ``logit_scale`` of the open_clip checkpoint an adapter was loaded from (``adapters.<m>.pretrained``),
    and ``siglip`` also from its ``logit_bias`` when the checkpoint has one (a SigLIP model).
    Learned or fixed as ``learn_temperature`` says. A ``ConfigError`` when no adapter has such a
    checkpoint, or two have different values."""
    if config.objective.params.get("temperature") != PRETRAINED:
        return
    key = f"{source}: key 'objective.params.temperature'"
    if not hasattr(objective, "set_temperature"):
        raise ConfigError(f"{key}: 'pretrained' needs an objective with a temperature; {objective.name!r} has none")
    found = {name: (adapter.pretrained_logit_scale, adapter.pretrained_logit_bias)
             for name, adapter in encoder.adapters.items() if getattr(adapter, "pretrained_logit_scale", None) is not None}
    if not found:
        raise ConfigError(f"{key}: 'pretrained' starts from a pretrained open_clip model's logit_scale, but no adapter "
                          f"was loaded from an open_clip checkpoint (adapters: {sorted(encoder.adapters)}; set "
                          "adapters.<modality>.pretrained of an open_clip adapter, or give a number)")
    if len(set(found.values())) > 1:
        raise ConfigError(f"{key}: 'pretrained' is ambiguous: the open_clip adapters' checkpoints disagree "
                          f"(logit_scale, logit_bias by modality: {found}); give a number")
    logit_scale, logit_bias = next(iter(found.values()))
    objective.set_temperature(math.exp(-logit_scale))
    if logit_bias is not None and hasattr(objective, "set_bias"):
        objective.set_bias(logit_bias)


def stream_loader(dataset: Any, K: int, num_processes: int, collator: Any, config: TrainConfig) -> Any:
    """The training :class:`~mmviews.data.streaming.StreamLoader` of this process (K / N rows per batch)."""
    from accelerate import PartialState

    from mmviews.data.streaming import StreamLoader

    rank = PartialState(cpu=config.cpu).process_index if num_processes > 1 else 0
    try:
        return StreamLoader(dataset, K // num_processes, collator, seed=config.seed, shuffle_buffer=config.data.shuffle_buffer,
                            rank=rank, world=num_processes, num_workers=config.data.num_workers,
                            pin_memory=pin_memory_default(config.cpu))
    except ValueError as error:
        raise ConfigError(f"key 'data.batch_size': {error}") from error


def _missing_adapter_message(config: TrainConfig, modality: str, source: str) -> str:
    """Name the key at fault for a view whose modality has no adapter: a view's misspelt
    modality (an adapter of a close name exists) is the view's fault, not the adapters'."""
    index = next(i for i, raw in enumerate(config.views)
                 if (raw if isinstance(raw, str) else raw.get("modality")) == modality)
    hint = did_you_mean(modality, config.adapters)
    if hint:
        return (f"{source}: key 'views.{index}.modality': {modality!r} has no adapter{hint}; "
                f"adapters given: {sorted(config.adapters)}")
    return (f"{source}: key 'adapters': no adapter for modality {modality!r} of 'views.{index}.modality' "
            f"(adapters given: {sorted(config.adapters)}); add 'adapters.{modality}' or fix the view's modality")


def build_run(config: TrainConfig, num_processes: int = 1, source: str = "recipe", *,
              with_eval: bool = True) -> RunParts:
    """Build datasets, views, loaders, encoder and objective, checking that they fit
    together. Every recipe error surfaces here, before any training step."""
    from accelerate.utils import set_seed

    spec = config.view_spec
    missing = [m for m in spec.modalities if m not in config.adapters]
    if missing:
        raise ConfigError(_missing_adapter_message(config, missing[0], source))
    M = len(spec)
    d = config.data
    sampler = ViewSetBatchSampler(1, d.batch_size, M, d.batch_mode, reference_views=d.reference_views)
    if sampler.K < 2:
        raise ConfigError(f"{source}: key 'data.batch_size': the batch has K = {sampler.K} samples with M = {M} views "
                          f"(batch_mode {d.batch_mode!r}); K must be >= 2")
    if sampler.K % num_processes:
        raise ConfigError(f"{source}: key 'data.batch_size': K = {sampler.K} samples per batch cannot be split evenly "
                          f"between {num_processes} processes")

    train_dataset = build_dataset_split(d, d.train_split)
    if num_processes > 1 and getattr(train_dataset, "drops_unreadable_samples", False):
        # A dropped sample leaves one process with fewer samples than the others: the objective
        # would stop at that step (it gathers equal shares). Refused now rather than then.
        raise ConfigError(f"{source}: key 'data.options.on_error': 'skip' drops unreadable samples from their batch, "
                          f"which would leave the {num_processes} processes with unequal shares of it; train with "
                          "data.options.on_error: raise on several processes (clips the store lists as unreadable are still left "
                          "out), or on one process")
    objective = build_objective(config, M, source, dataset_size=len(train_dataset))
    if len(train_dataset) < sampler.K:
        raise ConfigError(f"{source}: key 'data.batch_size': the {d.train_split!r} split has {len(train_dataset)} samples, "
                          f"fewer than one batch of K = {sampler.K}")
    loaders = eval_loaders(config, train_dataset) if with_eval else {}
    try:
        collator = ViewSetCollator.for_dataset(train_dataset, spec, seed=config.seed)
    except (ValueError, KeyError) as error:
        raise ConfigError(f"{source}: key 'views': {error}") from error
    inner = ViewSetBatchSampler(len(train_dataset), d.batch_size, M, d.batch_mode,
                                reference_views=d.reference_views, shuffle=True, drop_last=True, seed=config.seed)
    batches = GlobalBatchSampler(inner)
    generator = torch.Generator()
    generator.manual_seed(config.seed)
    # The loader draws its worker base seed from its own generator, not the global RNG, so
    # that resuming mid-epoch (a new iterator) leaves the training RNG stream unchanged.
    # Workers (if any) are persistent, so the epoch's augmentation seed goes through the
    # EpochCollator; batches are pinned when training on CUDA so that the trainer's copy to
    # the device (non_blocking) overlaps with the previous step's kernels.
    collator = EpochCollator(collator)
    if getattr(train_dataset, "streamed", False):
        # Parquet shards read through datasets' IterableDataset (mmviews.data.streaming): each process
        # draws its own K / N rows per batch; the loader also takes the sampler's set_epoch.
        train_loader = stream_loader(train_dataset, sampler.K, num_processes, collator, config)
        batches = train_loader
        accumulate = config.optimisation.grad_accum_steps
        if accumulate > 1 and len(train_loader) % accumulate:
            # Accelerate closes an accumulation window at the end of the loaders it prepares;
            # a streamed loader is not prepared, so an epoch must hold whole windows.
            raise ConfigError(f"{source}: key 'optimisation.grad_accum_steps': a streamed epoch has "
                              f"{len(train_loader)} batches, not a multiple of grad_accum_steps = {accumulate}; "
                              "choose a divisor, or data.batch_size so that it divides the epoch")
    else:
        train_loader = DataLoader(train_dataset, batch_sampler=batches, collate_fn=collator, generator=generator,
                                  **loader_options(d.num_workers, pin_memory=pin_memory_default(config.cpu)))
    set_seed(config.seed)  # identical initial weights on every process and every run
    encoder = build_encoder(config, source)
    start_from_pretrained(config, objective, encoder, source)
    if config.optimisation.sample_keyed_dropout:
        try:
            enable_sample_keyed_dropout(encoder)
        except ValueError as error:
            raise ConfigError(f"{source}: key 'optimisation.sample_keyed_dropout': {error}") from error
    return RunParts(config, {"train": train_dataset}, spec, collator, batches, train_loader, loaders,
                    encoder, objective, generator)
