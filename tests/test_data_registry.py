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
