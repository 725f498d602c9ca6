"""Dataset splits and loaders as a training run uses them.

- :func:`build_dataset_split`: one split of a registered dataset, its options merged from the
  dataset-wide and the per-split ones, optionally memoised (:class:`CachedDataset`).
- :class:`GlobalBatchSampler`: a :class:`~mmviews.data.views.ViewSetBatchSampler` seen by
  Accelerate as a batch sampler of ``batch_size`` = K, so that each global batch of K indices
  is split between the processes.
- :func:`eval_view_config` / :func:`build_eval_loaders`: unshuffled, un-augmented loaders of
  the train, validation and test splits for the probes.
- :func:`loader_options` / :class:`EpochCollator`: how the loaders feed an accelerator
  (pinned memory, persistent workers that still see each epoch's augmentation seeds).

The functions read a recipe's ``data`` section through the small :class:`DataSource` protocol
(``mmviews.config.DataConfig`` has these fields), so this layer does not depend on the recipe
schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mmviews.data.registry import build_dataset, dataset_option_types, dataset_takes_other_options, list_datasets
from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator, ViewSpec
from mmviews.registry import did_you_mean
from mmviews.schema import ConfigError, coerce


class DataSource(Protocol):
    """What the loaders read of a recipe's ``data`` section."""

    @property
    def name(self) -> str: ...  # registry name of build_dataset
    @property
    def root(self) -> str | None: ...  # dataset folder or file; None for generated data
    @property
    def options(self) -> Mapping[str, Any]: ...  # keyword arguments of build_dataset
    @property
    def split_options(self) -> Mapping[str, Mapping[str, Any]]: ...  # per split, over ``options``
    @property
    def cache(self) -> bool: ...
    @property
    def train_split(self) -> str: ...
    @property
    def val_split(self) -> str | None: ...
    @property
    def test_split(self) -> str | None: ...
    @property
    def eval_batch_size(self) -> int: ...
    @property
    def num_workers(self) -> int: ...


class CachedDataset(Dataset):
    """Memoises ``dataset[i]`` (``data.cache``); other attributes are the wrapped dataset's.

    The cache is per process and per loader worker; augmentations run in the collator, so
    they still differ on every use."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._items: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self._items.get(index)
        if item is None:
            item = self._items[index] = self.dataset[index]
        return item

    def __getattr__(self, name: str) -> Any:  # modality_info() and friends
        if name in ("dataset", "_items"):  # not yet set (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


class GlobalBatchSampler(Sampler[list[int]]):
    """Exposes ``batch_size`` (= K) of a :class:`ViewSetBatchSampler` so that Accelerate
    (``split_batches=True``) can split each global batch of K indices between processes."""

    def __init__(self, inner: ViewSetBatchSampler) -> None:
        self.inner = inner
        self.batch_size = int(inner.K)
        self.drop_last = True

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def build_dataset_split(data: DataSource, split: str) -> Dataset:
    """Split ``split`` of dataset ``data.name`` with ``{**data.options,
    **data.split_options[split]}``, wrapped in :class:`CachedDataset` when ``data.cache``.

    A ``data.root`` that does not exist is a ``FileNotFoundError`` naming the path and the
    dataset's card, before the dataset module tries to read it; an unknown ``data.name`` or
    option is a ``ValueError`` naming the key. A ``ValueError``/``KeyError`` of the dataset
    itself is raised again, same type, with the recipe key the user must change in front of
    its message: the option the dataset tagged (:func:`mmviews.data.registry.dataset_error`;
    ``data.options.columns``, or ``data.split_options.SPLIT.OPTION`` when set there),
    ``data.root``, or, for an unknown or empty split, the key(s) that chose it
    (``data.train_split``, ``data.val_split``, ``data.test_split``); an untagged error (a
    damaged file, a bad row) gets the dataset and split instead."""
    known = list_datasets()
    if data.name not in known:
        raise ValueError(f"key 'data.name': unknown dataset {data.name!r}; known: {', '.join(known)}")
    if data.streaming and data.cache:
        raise ValueError("keys 'data.streaming'/'data.cache': a streamed split is not kept in memory; set data.cache: false")
    if data.root is not None and "://" not in str(data.root) and not Path(data.root).expanduser().exists():
        raise FileNotFoundError(f"dataset {data.name!r} not found at {data.root}, see data_cards/{data.name}.md "
                                f"(set data.root, e.g. --set data.root=/path/to/{data.name})")
    kwargs = {**data.options, **data.split_options.get(split, {})}
    kwargs.update(_typed_options(data, split, kwargs))  # the recipe's options only (root, streaming are mmviews's)
    if data.root is not None:
        kwargs["root"] = str(data.root) if "://" in str(data.root) else str(Path(data.root).expanduser())
    if data.streaming:
        if data.name != "hf":
            raise ValueError(f"key 'data.streaming': streaming reads Parquet shards through data.name: hf, not "
                             f"{data.name!r}; write them with `mmviews prepare {data.name} ROOT --format parquet`")
        kwargs["streaming"] = True
    try:
        dataset = build_dataset(data.name, split=split, **kwargs)
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):
            raise
        # The builder's signature is the list of its options (see build_dataset's docstring).
        raise ValueError(f"keys 'data.options'/'data.split_options.{split}': dataset {data.name!r} has no such option "
                         f"({error})") from None
    except (ValueError, KeyError) as error:
        if type(error) not in (ValueError, KeyError):  # subclasses may take other arguments
            raise
        # The dataset names what is wrong and tags the argument at fault (dataset_error); only
        # the recipe knows which key set it: an option, the root, or the split key(s).
        option = getattr(error, "option", None)
        message = error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else str(error)
        if option == "root":
            prefix = f"key 'data.root' = {data.root!r}: "
        elif option is not None and option != "split":
            where = f"data.split_options.{split}" if option in data.split_options.get(split, {}) else "data.options"
            prefix = f"key '{where}.{option}': "
        else:
            keys = _split_keys(data, split)
            if option == "split" and keys:
                prefix = f"{'keys' if len(keys) > 1 else 'key'} {'/'.join(repr(k) for k in keys)} = {split!r}: "
            else:  # about the data itself (a file, a row): no key to blame, but say which split was read
                prefix = f"dataset {data.name!r}, split {split!r}: "
        raise type(error)(prefix + message) from None
    return CachedDataset(dataset) if data.cache else dataset


def _typed_options(data: DataSource, split: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked against the annotations of dataset ``data.name``'s options
    (:func:`mmviews.data.registry.dataset_option_types`), as a recipe section is checked: a
    ``ValueError`` naming the key (``data.options.OPTION``, or ``data.split_options.SPLIT.OPTION``
    when set there), the type expected and the value, before the dataset sees it (where a wrong
    type fails deep inside it). The values as checked (``1e-3`` read as a number). An option of
    an annotation the recipe validator does not type (a tuple, a path object) is left to the dataset."""
    types, others = dataset_option_types(data.name), dataset_takes_other_options(data.name)
    checked = {}
    for option, value in options.items():
        per_split = option in data.split_options.get(split, {})
        key = f"data.split_options.{split}.{option}" if per_split else f"data.options.{option}"
        if option not in types and not others:
            # e.g. the quickstart's synthetic num_samples kept after --set data.name=hf
            section = f"data.split_options.{split}" if per_split else "data.options"
            owners = [name for name in list_datasets() if name != data.name and option in dataset_option_types(name)]
            drop = (f" (an option of {', '.join(map(repr, owners))}: left from the recipe's dataset?); drop it: remove "
                    f"it from the recipe, or replace the section, --set {section}={{...}} ({{}} for none)" if owners
                    else did_you_mean(option, types))
            raise ValueError(f"key '{key}': dataset {data.name!r} has no option {option!r}{drop}; the options of "
                             f"{data.name!r}: {', '.join(sorted(types))}")
        if option not in types:
            continue  # the dataset's own (an option it does not take is refused when it is called)
        try:
            checked[option] = coerce(value, types[option], key, _CHECKED)
        except ConfigError as error:
            raise ValueError(str(error).removeprefix(f"{_CHECKED}: ")) from None
        except TypeError:  # an annotation beyond the recipe types (coerce's own refusal)
            continue
    return checked


# the source given to mmviews.schema.coerce, removed from its message (the caller names the recipe)
_CHECKED = "<data options>"


def _split_keys(data: DataSource, split: str) -> list[str]:
    """The recipe keys among ``data.train_split``, ``data.val_split`` and ``data.test_split``
    whose value is ``split``."""
    return [f"data.{field}" for field in ("train_split", "val_split", "test_split") if getattr(data, field) == split]


def eval_view_config(train_views: ViewSpec, eval_views: Sequence[Any] | None = None) -> list[Any]:
    """Views of the evaluation loaders: ``eval_views``, else one natural (un-augmented) view
    per modality of ``train_views`` (in order of first appearance). A recipe's are resolved when
    it loads (:attr:`mmviews.config.TrainConfig.eval_view_spec`)."""
    if eval_views is not None:
        return list(eval_views)
    return [{"modality": m} for m in train_views.modalities]


def build_eval_loaders(data: DataSource, view_config: ViewSpec | Sequence[Any], seed: int,
                       train_dataset: Dataset | None = None) -> dict[str, DataLoader | None]:
    """``{"train", "val", "test"}``: unshuffled loaders of ``data.train_split``,
    ``data.val_split`` and ``data.test_split`` with the views ``view_config`` (None where the
    recipe has no such split). ``train_dataset``, when given, is reused for the train split
    instead of being built again."""
    loaders: dict[str, DataLoader | None] = {}
    for key, split in (("train", data.train_split), ("val", data.val_split), ("test", data.test_split)):
        if split is None:
            loaders[key] = None
            continue
        dataset = train_dataset if key == "train" and train_dataset is not None else build_dataset_split(data, split)
        collator = ViewSetCollator.for_dataset(dataset, view_config, seed=seed)
        if getattr(dataset, "streamed", False):
            from mmviews.data.streaming import StreamLoader

            # One pass over every row, in shard order, by every process (extraction needs no length).
            loaders[key] = StreamLoader(dataset, data.eval_batch_size, collator, drop_last=False,
                                        num_workers=data.num_workers)
            continue
        loaders[key] = DataLoader(dataset, batch_size=data.eval_batch_size, shuffle=False, collate_fn=collator,
                                  num_workers=data.num_workers)
    return loaders


def pin_memory_default(cpu: bool = False) -> bool:
    """Whether loaders should pin their batches: only when training runs on a CUDA device
    (``cpu`` False and CUDA available). Pinned (page-locked) host memory is what lets the copy
    to the device run asynchronously (``ViewBatch.to(device, non_blocking=True)``); on CPU it
    would only cost a copy."""
    return not cpu and torch.cuda.is_available()


def loader_options(num_workers: int, *, pin_memory: bool = False, prefetch_factor: int | None = None) -> dict[str, Any]:
    """``DataLoader`` keyword arguments for ``num_workers`` worker processes.

    With workers, they are persistent (started once, not at every epoch, and a
    :class:`CachedDataset` keeps its memo across epochs) and each prefetches
    ``prefetch_factor`` batches (torch's default of 2 when None). A training loader with
    persistent workers must get each epoch's augmentation seed through an
    :class:`EpochCollator`: workers keep the collator they were started with."""
    if num_workers < 0:
        raise ValueError(f"key 'data.num_workers': must be >= 0, got {num_workers}")
    options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        options["persistent_workers"] = True
        if prefetch_factor is not None:
            options["prefetch_factor"] = prefetch_factor
    return options


class EpochCollator:
    """A :class:`ViewSetCollator` whose epoch reaches persistent DataLoader workers.

    Workers hold a copy of the collate function made when they start; with
    ``persistent_workers=True`` they live for the whole run, so ``collator.set_epoch(e)`` in the
    main process would never reach them and every epoch would repeat the first epoch's
    augmentations. The epoch is kept here in a one-element shared-memory tensor instead (torch
    passes it to the workers by reference, whatever the start method); each call copies it into
    the worker's collator before collating. :meth:`set_epoch` must be called before the
    epoch's iterator is created (the loader has no batch of the previous epoch in flight then)."""

    def __init__(self, collator: ViewSetCollator) -> None:
        self.collator = collator
        self._epoch = torch.full((), int(collator.epoch), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))
        self.collator.set_epoch(epoch)

    def __call__(self, samples: Sequence[Any]) -> Any:
        epoch = int(self._epoch)  # a host tensor: no device synchronisation
        if self.collator.epoch != epoch:
            self.collator.set_epoch(epoch)
        return self.collator(samples)

    def __getattr__(self, name: str) -> Any:  # view_spec, seed, ... of the wrapped collator
        if name in ("collator", "_epoch"):  # not yet set (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.collator, name)


def data_left_out(splits: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What ``on_error: skip`` left out of each split in this process (only the splits that left
    something out): the damaged Parquet shards and row groups with their rows
    (:meth:`mmviews.data.streaming.ShardSource.skipped_data`), and the values that could not
    be decoded and were marked absent (``num_skipped``, counted where they were decoded: values
    decoded in loader workers are warned about there, not counted here). Datasets wrapped by
    :class:`CachedDataset` are read through it."""
    out: dict[str, dict[str, Any]] = {}
    for split, dataset in splits.items():
        if dataset is None:
            continue
        if hasattr(dataset, "skipped_data"):
            info = dict(dataset.skipped_data())
        else:
            info = {"values_marked_absent": int(getattr(dataset, "num_skipped", 0) or 0)}
        if any(info.values()):
            out[split] = info
    return out


def merge_data_left_out(per_process: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """:func:`data_left_out` of every process as one record: shards and row groups by name (a
    row group left out by several processes counts once), values marked absent summed."""
    out: dict[str, dict[str, Any]] = {}
    for record in per_process:
        for split, info in record.items():
            merged = out.setdefault(split, {})
            for key, value in info.items():
                if isinstance(value, dict):
                    merged[key] = {**merged.get(key, {}), **value}
                elif isinstance(value, list):
                    merged[key] = sorted({*merged.get(key, []), *value})
                else:
                    merged[key] = merged.get(key, 0) + value
    for info in out.values():
        if "row_groups" in info:  # rows of the distinct row groups, not per process
            info["rows_in_skipped_row_groups"] = sum(info["row_groups"].values())
    return out
