"""The name registry (mmviews.registry.Registry) and the three registries built on it:
datasets, augmentations and adapter types."""

from __future__ import annotations

import pytest

from mmviews.registry import Registry


def test_add_get_names_descriptions_and_membership():
    reg: Registry[object] = Registry("widget")
    first, second = object(), object()
    assert reg.add("zeta", first, "the last one") is first
    reg.add("alpha", second, "the first one")
    assert reg.get("zeta") is first and reg.get("alpha") is second
    assert reg.names() == ["alpha", "zeta"] and list(reg) == ["alpha", "zeta"]
    assert reg.descriptions() == {"alpha": "the first one", "zeta": "the last one"}
    assert "alpha" in reg and "beta" not in reg and len(reg) == 2


def test_duplicate_name_is_rejected_and_keeps_the_first():
    reg: Registry[int] = Registry("widget")
    reg.add("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.add("a", 2)
    assert reg.get("a") == 1 and len(reg) == 1


@pytest.mark.parametrize("name", ["", None, 3])
def test_name_must_be_a_non_empty_string(name):
    with pytest.raises(ValueError, match="non-empty string"):
        Registry("widget").add(name, 1)  # type: ignore[arg-type]


def test_unknown_name_error_lists_the_known_names():
    reg: Registry[int] = Registry("widget")
    with pytest.raises(ValueError, match=r"unknown widget 'x'; known: \(none\)"):
        reg.get("x")
    reg.add("b", 1)
    reg.add("a", 2)
    with pytest.raises(ValueError, match=r"unknown widget 'c'; known: a, b$"):
        reg.get("c")
    with pytest.raises(ValueError, match="unknown widget"):  # unhashable: still a ValueError
        reg.get(["a"])  # type: ignore[arg-type]


def test_decorator_registers_and_returns_the_object_with_docstring_description():
    reg: Registry = Registry("factory")

    @reg.register("double")
    def double(x: int) -> int:
        """Twice x.

        More text that is not part of the description."""
        return 2 * x

    @reg.register("triple", "three times x")
    def triple(x: int) -> int:
        """Ignored: an explicit description wins."""
        return 3 * x

    @reg.register("plain")
    class Plain:
        pass

    assert double(2) == 4 and reg.get("double") is double  # the decorator returns the function itself
    assert reg.descriptions() == {"double": "Twice x.", "plain": "", "triple": "three times x"}
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("double")(triple)


# --------------------------------------------------------------------------- the library's registries


def test_dataset_registry():
    from mmviews.data import build_dataset, list_datasets, register_dataset

    names = list_datasets()
    assert {"synthetic", "gaussian_latents", "mosi", "mosei", "sims", "ucf101", "hmdb51", "hf"} <= set(names)
    assert all(isinstance(d, str) and d for d in names.values())
    assert list(names) == sorted(names)
    with pytest.raises(ValueError, match="dataset 'synthetic' is registered twice"):
        register_dataset("synthetic", "again")(lambda root=None, split="train": None)
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'; known: .*gaussian_latents.*synthetic"):
        build_dataset("nope")


def test_augmentation_registry():
    from mmviews.data import get_augmentation, list_augmentations, register_augmentation

    names = list_augmentations()
    assert names["hflip"] == "Horizontal flip of an image with probability p."  # docstring's first line
    with pytest.raises(ValueError, match="augmentation 'hflip' is registered twice"):
        register_augmentation("hflip")(lambda: (lambda x, g: x))
    with pytest.raises(ValueError, match=r"unknown augmentation 'flip' \(did you mean 'hflip'\?\); known: .*hflip.*simclr"):
        get_augmentation("flip")


def test_adapter_registry():
    from mmviews.modalities import (
        MLPAdapter,
        SmallCNNVisionAdapter,
        adapter_class,
        build_adapter,
        list_adapters,
        register_adapter,
    )
    from mmviews.modalities.presets import ADAPTER_TYPES

    types = list_adapters()
    assert set(ADAPTER_TYPES) | {"mlp"} <= set(types)
    assert all(types.values())  # every adapter class has a docstring
    assert adapter_class("mlp") is MLPAdapter and adapter_class("small_cnn") is SmallCNNVisionAdapter
    assert {"torchvision_video", "hf_video"} <= set(types)  # the spatiotemporal video backbones
    with pytest.raises(ValueError, match="adapter type 'mlp' is registered twice"):
        register_adapter(MLPAdapter)
    with pytest.raises(ValueError, match=r"unknown adapter type 'smell'; known: .*mlp.*small_cnn"):
        build_adapter({"type": "smell"})
    with pytest.raises(ValueError, match="unknown adapter type 'smell'"):
        adapter_class("smell")


def test_registries_are_not_public_module_state():
    import mmviews.data
    import mmviews.modalities

    assert not hasattr(mmviews.modalities, "ADAPTERS")
    assert not any(isinstance(v, Registry) for v in vars(mmviews.modalities).values())
    assert not any(isinstance(v, Registry) for v in vars(mmviews.data).values())
