"""Unit guards of mmviews.data.registry: the options reach the builder, an error names the
option at fault, and a registered dataset's description (given, or the docstring's first line)."""

from __future__ import annotations

import pytest

import mmviews.data  # noqa: F401  (registers the library's datasets)
from mmviews.data import registry
from mmviews.registry import Registry


def test_build_dataset_passes_the_options_to_the_builder():
    # 'valid' is 512 samples by default: a size of 7 is only there if num_samples arrived.
    dataset = registry.build_dataset("synthetic", split="valid", num_samples=7)
    assert len(dataset) == 7


def test_dataset_error_is_the_given_type_with_the_message_and_the_option():
    error = registry.dataset_error(KeyError, "no column 'text'", "columns")
    assert type(error) is KeyError and error.args == ("no column 'text'",)
    assert error.option == "columns"


def test_a_builder_error_carries_the_option_the_recipe_loader_names():
    with pytest.raises(ValueError, match=r"^num_samples must be >= 0, got -1$") as caught:
        registry.build_dataset("synthetic", num_samples=-1)
    assert caught.value.option == "num_samples"


@pytest.fixture
def empty_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The module's registry swapped for an empty one, so that test names do not leak."""
    fresh: Registry = Registry("dataset")
    monkeypatch.setattr(registry, "_DATASETS", fresh)
    return fresh


def test_register_dataset_without_a_description_takes_the_docstrings_first_line(empty_registry):
    @registry.register_dataset("toy")
    def build_toy(root=None, split="train", size=3):
        """A toy dataset of a few items.

        Not part of the description."""
        return list(range(size))

    assert registry.list_datasets() == {"toy": "A toy dataset of a few items."}
    assert registry.build_dataset("toy", size=4) == [0, 1, 2, 3]


def test_register_dataset_with_a_description_keeps_it(empty_registry):
    @registry.register_dataset("toy", "given here")
    def build_toy(root=None, split="train"):
        """The docstring, not used."""
        return []

    assert registry.list_datasets() == {"toy": "given here"}
    with pytest.raises(ValueError, match="dataset 'toy' is registered twice"):
        registry.register_dataset("toy")(build_toy)


class _ToyData:
    def __init__(self, size: int, *, scale: float = 1.0, name: str = "toy", shape: tuple[int, int] = (1, 1)) -> None:
        self.size, self.scale = size, scale


class _OtherToyData:
    def __init__(self, *, scale: str = "log", depth: int = 2, **rest: object) -> None:
        pass


def test_dataset_option_types_are_the_builders_own_then_those_its_options_go_to(empty_registry):
    @registry.register_dataset("toy", "t", options_from=[_ToyData, f"{__name__}:_OtherToyData"])
    def build_toy(root=None, split: str = "train", size: int | None = None, **options):
        return _ToyData(size or 3, **options)

    types = registry.dataset_option_types("toy")
    # the builder's own parameters win over the targets' (size), root and split are the recipe's keys,
    # an option two targets type differently is typed by the union, **rest is no option
    assert types == {"size": int | None, "scale": float | str, "name": str, "shape": tuple[int, int], "depth": int}


def test_dataset_option_types_without_targets_or_annotations(empty_registry):
    @registry.register_dataset("bare")
    def build_bare(root=None, split="train", size=3, **options):
        """Bare."""
        return []

    assert registry.dataset_option_types("bare") == {}


def test_whether_a_dataset_takes_options_beyond_its_annotated_ones(empty_registry):
    @registry.register_dataset("closed", "c", options_from=[_ToyData])
    def build_closed(root=None, split="train", **options):
        return _ToyData(3, **options)

    @registry.register_dataset("open", "o", options_from=[_ToyData, _OtherToyData])  # _OtherToyData takes **rest
    def build_open(root=None, split="train", **options):
        return []

    @registry.register_dataset("unsaid", "u")  # **options going nobody knows where
    def build_unsaid(root=None, split="train", **options):
        return []

    @registry.register_dataset("plain", "p")
    def build_plain(root=None, split="train", size: int = 3):
        return []

    assert [registry.dataset_takes_other_options(n) for n in ("closed", "open", "unsaid", "plain")] == [
        False, True, True, False]


def test_option_types_through_a_partial_an_unreadable_target_and_a_name_added_directly(empty_registry):
    """A builder made with functools.partial is read through its function (the sentiment datasets'),
    a target whose signature cannot be read may take anything, and a name registered on the
    registry itself (without register_dataset) has its builder's options only."""
    import functools

    def build(kind: str, root=None, split="train", *, size: int = 3, **options):
        return []

    empty_registry.add("direct", functools.partial(build, "x"), "d")
    assert registry.dataset_option_types("direct") == {"kind": str, "size": int}
    assert registry.dataset_takes_other_options("direct")  # **options, going nowhere named

    @registry.register_dataset("closed_partial", "c", options_from=[functools.partial(_ToyData, 3)])
    def build_closed(root=None, split="train", **options):
        return _ToyData(3, **options)

    assert registry.dataset_option_types("closed_partial")["scale"] is float
    assert not registry.dataset_takes_other_options("closed_partial")
    assert registry._takes_any_keyword(3)  # not a callable: nothing is known of it
