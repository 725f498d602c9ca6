"""Dataset registry: ``register_dataset``, ``build_dataset(name, root, split, **options)`` and
``list_datasets()``.

Each dataset is registered under its name by the module that defines it (``synthetic.py``,
``sentiment.py``, ``video.py``, ``hf.py``, ``gaussian.py``, ``identifiability.py``); ``mmviews.data`` imports all of
them, so after ``import mmviews.data`` every name below is known.
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from torch.utils.data import Dataset

from mmviews.registry import Registry

DatasetBuilder = Callable[..., Dataset]

# name -> builder(root=..., split=..., **options); private: use the functions below.
_DATASETS: Registry[DatasetBuilder] = Registry("dataset")


def dataset_error(error_type: type[Exception], message: str, option: str) -> Exception:
    """``error_type(message)`` tagged with the builder argument at fault (``option``: an option
    name such as ``"columns"``, or ``"split"`` / ``"root"``), so that a recipe's loader can name
    the key the user must change (``data.options.columns``, ``data.train_split``, ``data.root``)
    rather than guess. Raise the returned error."""
    error = error_type(message)
    error.option = option  # type: ignore[attr-defined]
    return error


def dataset_folder(root: str | os.PathLike[str], expected: str) -> Path:
    """``root`` as a path, for a dataset that reads a folder (``expected`` says which kind, e.g.
    ``"a folder of class folders of videos"``): a file there is a ``ValueError`` tagged ``root``
    saying it is a file, not the folder the dataset reads (a missing root is the caller's)."""
    path = Path(root)
    if path.is_file():
        raise dataset_error(ValueError, f"{path} is a file ({path.suffix or 'no extension'}), not a folder: this dataset "
                            f"reads {expected}; give the folder that holds the data", "root")
    return path


def register_dataset(name: str, description: str = "",
                     options_from: Sequence[Callable[..., Any] | str] = ()) -> Callable[[DatasetBuilder], DatasetBuilder]:
    """Decorator: register ``builder(root=None, split="train", **options) -> Dataset`` as
    ``name`` (``description`` defaults to the first line of the builder's docstring).
    ``options_from``: the callables a builder's ``**options`` are passed on to (a dataset class,
    or ``"module:name"`` for one imported only when needed), whose annotated keyword parameters
    type the recipe's ``data.options`` (:func:`dataset_option_types`). A name registered twice
    raises ``ValueError``."""
    _OPTIONS_FROM[name] = tuple(options_from)
    return _DATASETS.register(name, description)


# name -> the callables its builder's **options go to (register_dataset's options_from)
_OPTIONS_FROM: dict[str, tuple[Callable[..., Any] | str, ...]] = {}
# builder arguments that a recipe sets through its own keys (data.root, data.*_split, data.streaming)
_NOT_OPTIONS = ("root", "split", "streaming", "return")


def _annotations(function: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of ``function``'s parameters (a class: of its ``__init__``; a
    ``functools.partial``: of its function), without those it takes by position only or as
    ``*args``/``**kwargs``; empty when they cannot be resolved."""
    target = getattr(function, "func", function)  # functools.partial
    target = target.__init__ if isinstance(target, type) else target
    try:
        hints = typing.get_type_hints(target)
        parameters = inspect.signature(target).parameters
    except (NameError, TypeError, ValueError):  # an annotation naming what is not importable here
        return {}
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: hints[name] for name, p in parameters.items()
            if p.kind in keyword and name in hints and name not in _NOT_OPTIONS}


def _takes_any_keyword(function: Callable[..., Any]) -> bool:
    """Whether ``function`` (a class: its ``__init__``) takes ``**kwargs`` (unknown: as if it did)."""
    target = getattr(function, "func", function)
    target = target.__init__ if isinstance(target, type) else target
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return True


def dataset_takes_other_options(name: str) -> bool:
    """Whether dataset ``name`` may take options beyond :func:`dataset_option_types` (a builder or
    a target of its ``options_from`` that takes ``**options`` and passes them on unseen): then an
    option not among them cannot be called unknown before the dataset is built."""
    builder = _DATASETS.get(name)
    if not _takes_any_keyword(builder):
        return False
    targets = _OPTIONS_FROM.get(name, ())
    if not targets:
        return True
    return any(_takes_any_keyword(_resolved(target)) for target in targets)


def _resolved(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """An ``options_from`` entry as the callable it names (``"module:name"`` imported now)."""
    if isinstance(target, str):
        module, _, attribute = target.partition(":")
        return getattr(importlib.import_module(module), attribute)
    return target


def dataset_option_types(name: str) -> dict[str, Any]:
    """``{option: annotation}`` of dataset ``name``'s options: its builder's own keyword
    parameters, and those of the callables its ``**options`` go to (``options_from``; an option
    several of them take, with different annotations, is typed by their union)."""
    own = _annotations(_DATASETS.get(name))
    passed: dict[str, list[Any]] = {}
    for target in _OPTIONS_FROM.get(name, ()):
        for option, annotation in _annotations(_resolved(target)).items():
            if option not in own and annotation not in passed.setdefault(option, []):
                passed[option].append(annotation)
    return {**own, **{option: typing.Union[tuple(types)] for option, types in passed.items()}}


def list_datasets() -> dict[str, str]:
    """``{name: one-line description}`` of the datasets ``build_dataset`` knows, sorted by name."""
    return _DATASETS.descriptions()


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
      ``on_error``, ``decode`` (``"seek"``: only the clip's frames; ``"full"``), ``store``
      (the frame/flow store of ``mmviews prepare``, used by default when ``<root>.mmstore``
      exists) (see :class:`mmviews.data.video.VideoFolder`).
    - ``hf``: root = a ``save_to_disk`` folder, or an image/audio folder with
      ``format="imagefolder"|"audiofolder"``; ``columns={modality: column}`` (see
      :class:`mmviews.data.hf.HFDataset`); or a folder (or fsspec URL) of Parquet shards
      (``format="parquet"``, detected by ``"auto"``), map-style or with ``streaming=True``
      (recipe key ``data.streaming``) streamed (:mod:`mmviews.data.streaming`).
    - ``gaussian_latents``: no root. Options: ``num_samples`` (default 65536 train, 4096
      valid / test), ``sigma0``, ``seed`` (see :mod:`mmviews.data.gaussian`).
    - ``identifiability``: no root. Options: ``num_samples`` (default 2^24 train, 4096 valid /
      test), ``seed`` (fixes the mixing functions), ``num_modalities``, ``content_dim``,
      ``style_dim``, ``specific_dim``, ``style_change_prob``, ``statistical_dependence``,
      ``content_dependent_style``, ``mixing_layers`` (see :mod:`mmviews.data.identifiability`).

    An unknown ``name`` raises ``ValueError`` listing the known ones.
    """
    return _DATASETS.get(name)(root=root, split=split, **options)
