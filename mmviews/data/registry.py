"""Dataset registry: ``list_datasets()`` and ``build_dataset(name, root, split, **options)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch.utils.data import Dataset

_BUILDERS: dict[str, tuple[Callable[..., Dataset], str]] = {}

# Seed offsets so that the synthetic splits are disjoint draws of the same distribution.
_SYNTHETIC_SPLIT_OFFSET = {"train": 0, "valid": 1, "test": 2}
SYNTHETIC_DEFAULT_SIZES = {"train": 2048, "valid": 512, "test": 512}


def register_dataset(name: str, description: str) -> Callable[[Callable[..., Dataset]], Callable[..., Dataset]]:
    def deco(fn: Callable[..., Dataset]) -> Callable[..., Dataset]:
        _BUILDERS[name] = (fn, description)
        return fn

    return deco


def list_datasets() -> dict[str, str]:
    """``{name: one-line description}`` of the datasets ``build_dataset`` knows."""
    return {k: v[1] for k, v in sorted(_BUILDERS.items())}


def build_dataset(name: str, root: str | Path | None = None, split: str = "train", **options: Any) -> Dataset:
    """Build a dataset by name. Every dataset yields the sample dicts of :mod:`mmviews.data.views`.

    - ``synthetic``: no root. Options: ``num_samples`` (default 2048 train / 512 valid, test),
      ``seed`` (default 0; splits use seed offsets), ``missing_rate``, ``num_classes``,
      ``modalities``, ``image_size``, ``num_frames``.
    - ``mosi`` / ``mosei`` / ``sims``: root = the ``.pkl`` (converted once to ``<pkl>.mmstore``)
      or a store directory made by ``mmviews prepare``. Options: ``modalities`` (default
      text, audio, vision; also ``text_ids``, ``raw_text``), ``layout``, ``store_dir``.
    - ``ucf101`` / ``hmdb51``: root = the folder of class folders. Options: ``fold``,
      ``splits_dir``, ``num_frames``, ``size``, ``frames_root``, ``flow_root``, ``audio``,
      ``on_error`` (see :class:`mmviews.data.video.VideoFolder`).
    - ``hf``: root = a ``save_to_disk`` folder, or an image/audio folder with
      ``format="imagefolder"|"audiofolder"``; ``columns={modality: column}`` (see
      :class:`mmviews.data.hf.HFDataset`).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[name][0](root=root, split=split, **options)


@register_dataset("synthetic", "embedded text/audio/image/video/flow data sharing a class and a sentiment (no download)")
def _synthetic(root: Any = None, split: str = "train", num_samples: int | None = None, seed: int = 0,
               **options: Any) -> Dataset:
    from mmviews.data.synthetic import SyntheticMultimodal

    if split not in _SYNTHETIC_SPLIT_OFFSET:
        raise ValueError(f"synthetic: unknown split {split!r}; choose from {sorted(_SYNTHETIC_SPLIT_OFFSET)}")
    n = SYNTHETIC_DEFAULT_SIZES[split] if num_samples is None else int(num_samples)
    return SyntheticMultimodal(n, seed=seed * 1000 + _SYNTHETIC_SPLIT_OFFSET[split], **options)


def _sentiment_builder(dataset: str) -> Callable[..., Dataset]:
    def build(root: Any = None, split: str = "train", **options: Any) -> Dataset:
        from mmviews.data.sentiment import open_sentiment

        if root is None:
            raise ValueError(f"{dataset}: pass root= the MMSA/MulT .pkl file or a store made by `mmviews prepare {dataset}`"
                             f" (see data_cards/{dataset}.md)")
        return open_sentiment(root, split=split, dataset=dataset, **options)

    return build


for _name, _desc in (("mosi", "CMU-MOSI features (MMSA or MulT pickle, or a prepared store)"),
                     ("mosei", "CMU-MOSEI features (MMSA or MulT pickle, or a prepared store)"),
                     ("sims", "CH-SIMS features (MMSA pickle or a prepared store)")):
    register_dataset(_name, _desc)(_sentiment_builder(_name))


def _video_builder(dataset: str) -> Callable[..., Dataset]:
    def build(root: Any = None, split: str = "train", **options: Any) -> Dataset:
        from mmviews.data.video import VideoFolder

        if root is None:
            raise ValueError(f"{dataset}: pass root= the folder of class folders (see data_cards/{dataset}.md)")
        return VideoFolder(root, split=split, dataset=dataset, **options)

    return build


register_dataset("ucf101", "UCF-101 video folder with split lists: frames, flow images, audio track")(_video_builder("ucf101"))
register_dataset("hmdb51", "HMDB-51 video folder with split lists: frames, flow images")(_video_builder("hmdb51"))


@register_dataset("hf", "a local HuggingFace dataset (save_to_disk, imagefolder, audiofolder) with a column mapping")
def _hf(root: Any = None, split: str = "train", **options: Any) -> Dataset:
    from mmviews.data.hf import HFDataset

    if root is None:
        raise ValueError("hf: pass root= a local dataset folder")
    return HFDataset(root, split=split, **options)
