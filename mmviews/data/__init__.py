"""Datasets, view specs, augmentations and the view-set collator.

Every dataset yields sample dicts whose absent modalities are None; a :class:`ViewSpec` names the
M views made from them (natural, or augmented copies) and the :class:`ViewSetCollator` stacks a
batch into a :class:`~mmviews.data.batch.ViewBatch` with its ``[K, M]`` presence mask, so the
encoders and objectives see one shape whatever the source. Datasets are built by name
(:func:`build_dataset`, :func:`register_dataset`); data that does not fit one machine is written as
Parquet shards (:mod:`mmviews.data.shards`) and streamed (:mod:`mmviews.data.streaming`). The
Python API, the sample dicts and the modality names are in ``docs/data.md``; each dataset's card
is in ``data_cards/``.
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
