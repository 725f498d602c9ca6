"""Dataset splits and loaders as a training run uses them.

- :func:`build_dataset_split`: one split of a registered dataset, its options merged from the
  dataset-wide and the per-split ones, optionally memoised (:class:`CachedDataset`).
- :class:`GlobalBatchSampler`: a :class:`~mmviews.data.views.ViewSetBatchSampler` seen by
  Accelerate as a batch sampler of ``batch_size`` = K, so that each global batch of K indices
  is split between the processes.
- :func:`eval_view_config` / :func:`build_eval_loaders`: unshuffled, un-augmented loaders of
  the train, validation and test splits for the probes.

The functions read a recipe's ``data`` section through the small :class:`DataSource` protocol
(``mmviews.config.DataConfig`` has these fields), so this layer does not depend on the recipe
schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

from torch.utils.data import DataLoader, Dataset, Sampler

from mmviews.data.registry import build_dataset
from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator, ViewSpec


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
    dataset's card, before the dataset module tries to read it."""
    if data.root is not None and not Path(data.root).expanduser().exists():
        raise FileNotFoundError(f"dataset {data.name!r} not found at {data.root}, see data_cards/{data.name}.md "
                                f"(set data.root, e.g. --set data.root=/path/to/{data.name})")
    kwargs = {**data.options, **data.split_options.get(split, {})}
    if data.root is not None:
        kwargs["root"] = str(Path(data.root).expanduser())
    dataset = build_dataset(data.name, split=split, **kwargs)
    return CachedDataset(dataset) if data.cache else dataset


def eval_view_config(train_views: Sequence[Any], eval_views: Sequence[Any] | None = None) -> list[Any]:
    """Views of the evaluation loaders: ``eval_views``, else one natural (un-augmented) view
    per modality of ``train_views`` (in order of first appearance)."""
    if eval_views is not None:
        return list(eval_views)
    return [{"modality": m} for m in ViewSpec.from_config(train_views).modalities]


def build_eval_loaders(data: DataSource, view_config: Sequence[Any], seed: int,
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
        loaders[key] = DataLoader(dataset, batch_size=data.eval_batch_size, shuffle=False, collate_fn=collator,
                                  num_workers=data.num_workers)
    return loaders
