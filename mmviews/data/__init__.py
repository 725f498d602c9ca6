"""Datasets, view specs, augmentations and the view-set collator.

Typical use (what ``mmviews.train`` does with a recipe's ``data`` and ``views`` sections)::

    from torch.utils.data import DataLoader
    from mmviews.data import build_dataset, ViewSpec, ViewSetCollator, ViewSetBatchSampler

    ds = build_dataset("synthetic", split="train", num_samples=1024, seed=0, missing_rate=0.1)
    spec = ViewSpec.from_config([
        {"modality": "text", "copies": 2, "augment": "text_default"},
        {"modality": "audio", "copies": 2, "augment": "audio_default"},
        {"modality": "image", "copies": 2, "augment": "simclr", "params": {"blur_p": 0.0}},
        {"modality": "video", "augment": "video_default", "params": {"seed_group": "clip"}},
        {"modality": "flow", "augment": "flow_default", "params": {"seed_group": "clip"}},
    ])
    collate = ViewSetCollator.for_dataset(ds, spec, seed=0)      # -> ViewBatch
    sampler = ViewSetBatchSampler(len(ds), batch_size=64, num_views=len(spec), mode="growing")
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=2)

Datasets: ``list_datasets()`` (name -> description), ``build_dataset(name, root, split,
**options)``, ``register_dataset(name, description)`` for new ones; ``gaussian_latents`` is the
1-D Gaussian of the poly-view synthetic setting (:mod:`mmviews.data.gaussian`); ``identifiability``
the latent blocks and invertible mixings of the identifiability benchmark
(:mod:`mmviews.data.identifiability`).

Every dataset yields *sample dicts* ``{"index", "modalities": {name: value or None},
"labels": {...}}`` (None = modality absent); the collator stacks them into the
:class:`ViewBatch` of :mod:`mmviews.data.batch` with the ``[K, M]`` presence mask.

Modality names: synthetic ``text`` (str), ``audio`` (16 kHz waveform), ``image``
``[3, 32, 32]``, ``video`` ``[T, 3, H, W]``, ``flow`` ``[T-1, 2, H, W]``; sentiment stores
``text``/``audio``/``vision`` feature sequences ``[L, D]`` (+ ``text_ids`` tokens, ``raw_text``);
video folders ``video``, ``flow``, ``audio``; HF datasets whatever ``columns`` maps.

Data that does not fit one machine: ``mmviews prepare DATASET ROOT --format parquet`` writes Parquet
shards (:mod:`mmviews.data.shards`) that ``build_dataset("hf", root=..., streaming=True)`` streams
through ``datasets`` (:mod:`mmviews.data.streaming`; ``data.streaming: true`` in a recipe).
Both kinds of reader decode stored values (images, audio, JPEG frames, flow images) with
:mod:`mmviews.data.decode`, whose docstring gives each column kind's dtype, shape and range.

Augmentations: ``list_augmentations()``, ``get_augmentation(name, **params)``; each is
``aug(value, generator)``. Pickles: ``safe_load_pickle(path)`` only.
"""

# The dataset modules register their datasets when imported: importing them all here makes
# every name known to build_dataset after ``import mmviews.data``.
from mmviews.data import hf as _hf, identifiability as _identifiability, sentiment as _sentiment, video as _video  # noqa: F401
from mmviews.data.augment import get_augmentation, list_augmentations, register_augmentation
from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.data.gaussian import GaussianLatents
from mmviews.data.registry import build_dataset, list_datasets, register_dataset
from mmviews.data.safe_pickle import CorruptFileError, UnsafePickleError, safe_load_pickle
from mmviews.data.synthetic import SyntheticMultimodal, synthetic_vocabulary, write_vocabulary
from mmviews.data.views import (
    KINDS,
    ViewSetBatchSampler,
    ViewSetCollator,
    ViewSpec,
    batch_size_for,
    infer_kind,
)

__all__ = [
    "KINDS",
    "CorruptFileError",
    "GaussianLatents",
    "SyntheticMultimodal",
    "UnsafePickleError",
    "ViewBatch",
    "ViewInfo",
    "ViewSetBatchSampler",
    "ViewSetCollator",
    "ViewSpec",
    "batch_size_for",
    "build_dataset",
    "get_augmentation",
    "infer_kind",
    "list_augmentations",
    "list_datasets",
    "register_augmentation",
    "register_dataset",
    "safe_load_pickle",
    "synthetic_vocabulary",
    "write_vocabulary",
]
