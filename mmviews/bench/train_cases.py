"""What ``mmviews bench train`` measures: its cases, each built into the pieces of a run.

Cases:

- ``quickstart``: the recipe (``--recipe``, default ``quickstart``, with ``--set``
  overrides) built by :func:`mmviews.train.build_run` and prepared as :func:`mmviews.train.train`
  prepares it, so that it measures what ``mmviews train`` runs, loader workers included. With
  ``data.cache`` the sample cache is filled before timing, as the run's random-baseline
  evaluation of the train split does before its first step (``--cold-cache``: not filled, so
  that first-epoch steps also generate their samples; forked workers inherit a filled cache).
- ``realistic``: the recipe's views, objective and optimiser with full-size adapters of
  random weights (:func:`mmviews.modalities.presets.realistic_config`): bert-base text
  (128 tokens), HuBERT-base audio on 2 s clips at 16 kHz, open_clip ViT-B/32 images at
  224 px, and a CNN on 4 optical-flow frames of 224 px. Inputs are random (a pool of
  generated samples, cycled), K is ``--realistic-K`` (default 8, so that CPU runs take
  minutes; M is the recipe's).
- ``finetune-small``: the shape of the ``finetune`` recipe at small size
  (:func:`finetune_small_config`; no download, no file): its M = 8 views, geometric PVC, AdamW,
  precision (``auto``: bf16 where the hardware has it natively) and its adapters' ``finetune`` (LoRA rank 8 on BERT and the CLIP ViT, HuBERT's
  last 2 layers), ``gradient_checkpointing`` and ``head`` settings, on the tiny random-weight
  BERT, HuBERT and open_clip ViT of :func:`mmviews.modalities.presets.tiny_config` (2 layers
  each), with random text of 8 words, 0.25 s clips at 16 kHz and 32 px images; K = 64 and
  ``encode_chunk_size`` 16 (the cached step), no loader workers (``--set`` changes any key,
  e.g. ``--set data.batch_size=128``).

:func:`build_case` builds a case from the bench's options (``--set`` and the options that set
recipe keys, ``--gradient-checkpointing``); :func:`steps_of` gives its timed and warm-up steps.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from mmviews.config import TrainConfig, config_from_dict, load_config, resolve_recipe
from mmviews.data.loaders import EpochCollator, GlobalBatchSampler, loader_options, pin_memory_default
from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator
from mmviews.modalities.base import adapter_class
from mmviews.modalities.presets import TINY_WORDS, realistic_config, tiny_config
from mmviews.train.build import RunParts, build_encoder, build_objective, build_run
from mmviews.train.host_memory import configure_host_memory

CASES = ("quickstart", "realistic", "finetune-small", "base-sizes")  # base-sizes: mmviews.bench.sharded

# Adapters of the realistic case, per modality of the quickstart's views (random weights).
REALISTIC_ADAPTERS: dict[str, dict[str, Any]] = {
    "text": realistic_config("text"),  # bert-base: 12 layers, 768 wide, 128 tokens
    "audio": realistic_config("hf_audio"),  # HuBERT-base
    "image": realistic_config("open_clip"),  # ViT-B/32 at 224 px
    "flow": realistic_config("flow_cnn"),  # 3-stage CNN per flow frame
}
REALISTIC_INPUTS = {"audio_seconds": 2.0, "sample_rate": 16000, "image_size": 224, "flow_frames": 4, "words": 60}


# ---------------------------------------------------------------------------------------------
# The realistic case's data
# ---------------------------------------------------------------------------------------------
class RandomViews(Dataset):
    """``num_samples`` samples of random text (``words`` words of a small vocabulary), audio
    (``audio_seconds`` at ``sample_rate``), images ``[3, S, S]`` in [0, 1] and optical flow
    ``[T, 2, S, S]`` in pixels, in the datasets' sample format. ``pool`` distinct samples are
    generated up front and cycled, so that data time is the loader's, not the generator's."""

    def __init__(self, num_samples: int, pool: int = 32, seed: int = 0, *, audio_seconds: float = 2.0,
                 sample_rate: int = 16000, image_size: int = 224, flow_frames: int = 4, words: int = 60,
                 modalities: Sequence[str] = ("text", "audio", "image", "flow")) -> None:
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self.image_size, self.flow_frames = image_size, flow_frames
        self.modalities = tuple(modalities)
        g = torch.Generator().manual_seed(seed)
        n_audio = int(round(audio_seconds * sample_rate))
        self._pool = []
        for _ in range(min(pool, num_samples)):
            ids = torch.randint(len(TINY_WORDS), (words,), generator=g).tolist()
            sample = {
                "text": " ".join(TINY_WORDS[i] for i in ids),
                "audio": torch.randn(n_audio, generator=g) * 0.1,
                "image": torch.rand(3, image_size, image_size, generator=g),
                "flow": torch.randn(flow_frames, 2, image_size, image_size, generator=g) * 3,
            }
            self._pool.append({m: sample[m] for m in self.modalities})

    def __len__(self) -> int:
        return self.num_samples

    def modality_info(self) -> dict[str, dict[str, Any]]:
        S, T = self.image_size, self.flow_frames
        info = {
            "text": {"kind": "text"},
            "audio": {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate},
            "image": {"kind": "image", "shape": (3, S, S)},
            "flow": {"kind": "flow", "shape": (T, 2, S, S)},
        }
        return {m: info[m] for m in self.modalities}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "modalities": dict(self._pool[index % len(self._pool)]), "labels": {}}


def realistic_config_of(config: TrainConfig, K: int) -> TrainConfig:
    """``config`` with the realistic adapters for its modalities and batch size ``K``."""
    raw = config.to_dict()
    modalities = config.view_spec.modalities
    unknown = [m for m in modalities if m not in REALISTIC_ADAPTERS]
    if unknown:
        raise ValueError(f"bench train: the realistic case has adapters for {sorted(REALISTIC_ADAPTERS)}, "
                         f"the recipe's views also use {unknown}")
    embed_dim = int(config.encoder.get("embed_dim", 128))
    raw["adapters"] = {m: {**REALISTIC_ADAPTERS[m], "embed_dim": embed_dim} for m in modalities}
    raw["data"]["batch_size"] = K
    raw["evaluation"]["tasks"] = []
    return config_from_dict(raw, f"{config.name} (realistic adapters)")


#: The ``finetune-small`` case: K, chunk and inputs (small random text, 0.25 s clips at 16 kHz, 32 px
#: images, the tiny presets' sizes), and the recipe keys it keeps from each adapter of ``finetune``.
FINETUNE_SMALL_DEFAULTS = ("data.batch_size=64", "optimisation.encode_chunk_size=16", "data.num_workers=0")
FINETUNE_SMALL_INPUTS = {"audio_seconds": 0.25, "sample_rate": 16000, "image_size": 32, "words": 8}
FINETUNE_SMALL_KEPT = ("finetune", "gradient_checkpointing", "head", "pooling", "freeze_feature_encoder", "embed_dim")
_TINY_KIND = {"text": "text", "hf_audio": "hf_audio", "open_clip": "open_clip"}


def finetune_small_config(overrides: Sequence[str] = ()) -> TrainConfig:
    """The ``finetune`` recipe at small size: its views, objective, optimiser, precision and its
    adapters' ``finetune`` (LoRA on text and image, HuBERT's last_n), ``gradient_checkpointing``,
    ``head`` and pooling settings, on the tiny random-weight backbones of
    :func:`mmviews.modalities.presets.tiny_config` (BERT, HuBERT and an open_clip ViT of two
    layers each; nothing downloaded), images of 32 px, K = 64, ``encode_chunk_size`` 16 and no
    loader workers (:data:`FINETUNE_SMALL_DEFAULTS`), then ``overrides`` (``--set``)."""
    base = load_config(resolve_recipe("finetune"), [*FINETUNE_SMALL_DEFAULTS, *overrides])
    raw = base.to_dict()
    for modality, adapter in raw["adapters"].items():
        kind = _TINY_KIND.get(adapter["type"])
        if kind is None:
            raise ValueError(f"bench train finetune-small: no tiny preset for adapters.{modality}.type "
                             f"{adapter['type']!r}")
        tiny = {k: v for k, v in tiny_config(kind).items() if k != "embed_dim"}  # the recipe's encoder.embed_dim
        raw["adapters"][modality] = {**tiny, **{k: adapter[k] for k in FINETUNE_SMALL_KEPT if k in adapter}}
    size = FINETUNE_SMALL_INPUTS["image_size"]
    for view in raw["views"]:  # the recipe's 224 px crops, at the tiny ViT's 32 px
        if "size" in (view.get("params") or {}):
            view["params"]["size"] = size
    raw["evaluation"]["tasks"] = []
    return config_from_dict(raw, f"{base.name} (small: tiny random-weight backbones)")


def realistic_parts(config: TrainConfig, num_samples: int, inputs: dict[str, Any] | None = None) -> RunParts:
    """The pieces :func:`mmviews.train.build_run` makes, over :class:`RandomViews` (``inputs``:
    its sizes, default :data:`REALISTIC_INPUTS`; only the modalities of the views)."""
    from accelerate.utils import set_seed

    spec = config.view_spec
    d = config.data
    dataset = RandomViews(num_samples, seed=config.seed, modalities=spec.modalities,
                          **(REALISTIC_INPUTS if inputs is None else inputs))
    collator = EpochCollator(ViewSetCollator.for_dataset(dataset, spec, seed=config.seed))
    inner = ViewSetBatchSampler(len(dataset), d.batch_size, len(spec), d.batch_mode,
                                reference_views=d.reference_views, shuffle=True, drop_last=True, seed=config.seed)
    batches = GlobalBatchSampler(inner)
    generator = torch.Generator().manual_seed(config.seed)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collator, generator=generator,
                        **loader_options(d.num_workers, pin_memory=pin_memory_default(config.cpu)))
    objective = build_objective(config, len(spec), "realistic case", dataset_size=len(dataset))
    set_seed(config.seed)
    encoder = build_encoder(config, "realistic case")
    return RunParts(config, {"train": dataset}, spec, collator, batches, loader, {}, encoder, objective, generator)


#: The ``base-sizes`` case: K, chunk and image size (the ViT-B/32 takes 224 px).
BASE_SIZES_DEFAULTS = ("data.batch_size=4", "optimisation.encode_chunk_size=2")
BASE_SIZES_IMAGE = 224


def base_sizes_config(overrides: Any = ()) -> Any:
    """``finetune-small`` (:func:`finetune_small_config`) with the full-size
    random-weight backbones of :func:`mmviews.modalities.presets.realistic_config` (BERT-base,
    HuBERT-base, open_clip ViT-B/32 at 224 px), K = 4 and encoder chunks of 2."""
    small = finetune_small_config([*BASE_SIZES_DEFAULTS, *overrides])
    raw = small.to_dict()
    for modality, adapter in raw["adapters"].items():
        full = {k: v for k, v in realistic_config(_TINY_KIND[adapter["type"]]).items() if k != "embed_dim"}
        raw["adapters"][modality] = {**full, **{k: adapter[k] for k in FINETUNE_SMALL_KEPT if k in adapter}}
    for view in raw["views"]:
        if "size" in (view.get("params") or {}):
            view["params"]["size"] = BASE_SIZES_IMAGE
    return config_from_dict(raw, "finetune (base sizes: BERT-base, HuBERT-base, ViT-B/32, random weights)")


def base_sizes_inputs() -> dict[str, Any]:
    return {**FINETUNE_SMALL_INPUTS, "image_size": BASE_SIZES_IMAGE}


def with_gradient_checkpointing(config: TrainConfig) -> TrainConfig:
    """``config`` with ``gradient_checkpointing: true`` for every adapter whose type has it."""
    raw = config.to_dict()
    for adapter in raw["adapters"].values():
        if adapter_class(adapter["type"]).supports_gradient_checkpointing():
            adapter["gradient_checkpointing"] = True
    return config_from_dict(raw, f"{config.name} (gradient checkpointing)")


def _overrides_of(args: argparse.Namespace) -> list[str]:
    """The recipe overrides of ``args``: ``--set``, then the device and the options that set keys."""
    overrides = [*args.set, f"cpu={'true' if args.device == 'cpu' else 'false'}"]
    if args.workers is not None:
        overrides.append(f"data.num_workers={args.workers}")
    if args.mixed_precision is not None:
        overrides.append(f"optimisation.mixed_precision={args.mixed_precision}")
    if args.encode_chunk_size is not None:
        overrides.append(f"optimisation.encode_chunk_size={args.encode_chunk_size}")
    if args.compile:
        overrides.append("optimisation.compile=true")
    return overrides


def _configure_host_memory(config: TrainConfig, args: argparse.Namespace) -> None:
    """The case's ``host_memory`` in this process, as ``mmviews train`` would apply it (measured
    and estimated with the allocator a run of the case has)."""
    configure_host_memory(config.host_memory, owns_process=getattr(args, "owns_process", False),
                          on_cpu=args.device == "cpu")


def build_case(case: str, args: argparse.Namespace, for_check: bool = False) -> RunParts:
    """The run of ``case``, built. ``for_check``: the quickstart as ``mmviews train --check``
    builds it (evaluation splits too, and its checks run: one batch of each split through the
    adapters), else as the measured steps need it (no evaluation)."""
    overrides = _overrides_of(args)
    if case == "quickstart":
        config = load_config(resolve_recipe(args.recipe), overrides)
        if args.gradient_checkpointing:
            config = with_gradient_checkpointing(config)
        _configure_host_memory(config, args)
        if not for_check:
            return build_run(config, 1, f"recipe {args.recipe}", with_eval=False)
        from mmviews.train.preflight import run_checks

        parts = build_run(config, 1, f"recipe {args.recipe}")
        run_checks(parts, f"recipe {args.recipe}")
        return parts
    steps, warmup = steps_of(case, args)
    if case == "finetune-small":
        config, inputs = finetune_small_config(overrides), FINETUNE_SMALL_INPUTS
    elif case == "base-sizes":
        config, inputs = base_sizes_config(overrides), base_sizes_inputs()
    else:
        config = realistic_config_of(load_config(resolve_recipe(args.recipe), overrides), args.realistic_K)
        inputs = REALISTIC_INPUTS
    if args.gradient_checkpointing:
        config = with_gradient_checkpointing(config)
    _configure_host_memory(config, args)
    num_samples = config.data.batch_size * (steps * 3 + warmup + args.count_host_reads + 1)
    return realistic_parts(config, num_samples, inputs)


def has_estimate(case: str) -> bool:
    """Whether ``case`` gets a ``--check`` estimate (not the realistic case: measuring full-size
    encoders on 2, 4 and 128 samples takes many minutes on a CPU)."""
    return case not in ("realistic", "base-sizes")


def steps_of(case: str, args: argparse.Namespace) -> tuple[int, int]:
    """``(steps, warmup)`` of ``case``: the options, else the defaults (fewer for the realistic
    case on CPU, whose steps take about a minute each)."""
    slow = case == "realistic" and args.device == "cpu"
    steps = args.steps if args.steps is not None else (3 if slow else 10)
    warmup = args.warmup if args.warmup is not None else (1 if slow else 2)
    return steps, warmup
