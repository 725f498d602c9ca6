"""The open_clip image tower an adapter builds (:func:`mmviews.modalities.vision.create_open_clip_visual`):
what it checks before open_clip runs (the model's source, tag or checkpoint file, model name), what
it passes on (image size, weights-only reading), and the pretrained checkpoint's ``logit_scale`` /
``logit_bias`` it keeps on the tower for ``temperature: pretrained``. Tiny towers (2-layer ViT on
32 px) from checkpoints written here; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mmviews.modalities import build_adapter
from mmviews.modalities.presets import TINY_CLIP_OVERRIDES, tiny_config
from mmviews.modalities.remote import allow_remote_models
from mmviews.modalities.vision import OpenCLIPVisionConfig, create_open_clip_visual
from test_train_learned_temperature import _open_clip_checkpoint


def _config(**changes: Any) -> OpenCLIPVisionConfig:
    return dataclasses.replace(OpenCLIPVisionConfig.from_dict(tiny_config("open_clip")), **changes)


def test_the_checkpoints_logit_scale_and_bias_are_kept_on_the_tower(tmp_path: Path) -> None:
    """A SigLIP-style checkpoint: both values (as float32 stores them); a CLIP one: the scale, no
    bias; a scale of shape [1] (``nonscalar_logit_scale``) reads the same."""
    siglip = _open_clip_checkpoint(tmp_path / "siglip.pt", math.log(30.0), -7.25)
    tower = create_open_clip_visual(_config(pretrained=str(siglip),
                                            model_overrides={**TINY_CLIP_OVERRIDES, "init_logit_bias": 0.0}), True)
    assert tower.pretrained_logit_scale == float(torch.tensor(math.log(30.0), dtype=torch.float32))
    assert tower.pretrained_logit_bias == -7.25
    nonscalar = {**TINY_CLIP_OVERRIDES, "nonscalar_logit_scale": True}
    clip = _open_clip_checkpoint(tmp_path / "clip.pt", math.log(12.0), None, nonscalar_logit_scale=True)
    adapter = build_adapter(tiny_config("open_clip", pretrained=str(clip), model_overrides=nonscalar))
    assert adapter.pretrained_logit_scale == float(torch.tensor(math.log(12.0), dtype=torch.float32))
    assert adapter.pretrained_logit_bias is None and adapter.backbone.pretrained_logit_bias is None


def test_without_weights_the_tower_has_no_pretrained_values(tmp_path: Path) -> None:
    """Random weights, or a checkpoint named but not read (``load_weights=False``: a saved adapter
    whose weights come from its own folder, where the recipe's file need not exist any more)."""
    random = build_adapter(tiny_config("open_clip"))
    assert random.pretrained_logit_scale is None and random.pretrained_logit_bias is None
    missing = str(tmp_path / "gone.pt")
    tower = create_open_clip_visual(_config(pretrained=missing), False)
    assert not hasattr(tower, "pretrained_logit_scale") and not hasattr(tower, "pretrained_logit_bias")
    with pytest.raises(FileNotFoundError):
        create_open_clip_visual(_config(pretrained=missing), True)


def test_a_pretrained_value_that_is_neither_tag_nor_file_is_named_with_the_models_tags(tmp_path: Path) -> None:
    import open_clip

    missing = str(tmp_path / "missing.pt")
    tags = open_clip.list_pretrained_tags_by_model("ViT-B-32")
    assert len(tags) > 5  # the message shows the first five
    with pytest.raises(FileNotFoundError) as caught:
        create_open_clip_visual(_config(pretrained=missing), True)
    assert str(caught.value) == (f"open_clip pretrained={missing!r} is neither a tag of 'ViT-B-32' ({tags[:5]}...) "
                                 "nor an existing checkpoint file")


def test_a_checkpoint_under_the_home_folder_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    _open_clip_checkpoint(tmp_path / "clip.pt", math.log(25.0))
    tower = create_open_clip_visual(_config(pretrained="~/clip.pt"), True)
    assert tower.pretrained_logit_scale == float(torch.tensor(math.log(25.0), dtype=torch.float32))


def test_model_names_are_checked_before_open_clip_runs(tmp_path: Path) -> None:
    """An unknown name is refused by name; an external one (``hf-hub:``, ``local-dir:``) needs the
    command line's permission, naming the key, and with it reaches open_clip (which here finds
    no such folder)."""
    with pytest.raises(ValueError) as caught:
        create_open_clip_visual(_config(model="ViT-Nope-1", model_overrides={}), True)
    assert str(caught.value) == "unknown open_clip model 'ViT-Nope-1'; see open_clip.list_models()"
    folder = tmp_path / "no-such-model"
    with pytest.raises(ValueError) as caught:
        create_open_clip_visual(_config(model=f"local-dir:{folder}", model_overrides={}), True)
    assert str(caught.value) == (f"model='local-dir:{folder}' loads a model configuration and weights from outside "
                                 "the recipe; refused unless asked for on the command line (--allow-remote-models)")
    with allow_remote_models(), pytest.raises(FileNotFoundError, match="local-dir"):
        create_open_clip_visual(_config(model=f"local-dir:{folder}", model_overrides={}), True)


def test_an_hf_hub_name_with_permission_reaches_open_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline (no request leaves this machine): open_clip's own failure to fetch the config."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with allow_remote_models(), pytest.raises(RuntimeError, match="HF Hub"):
        create_open_clip_visual(_config(model="hf-hub:mmviews-test/no-such-model", model_overrides={}), True)


def test_the_image_size_is_forced() -> None:
    """``image_size`` resizes the tower's input (here the default ViT-B/32 tower at 64 px, with a
    tiny text tower, which is dropped)."""
    text = {"text_cfg": TINY_CLIP_OVERRIDES["text_cfg"]}
    tower = create_open_clip_visual(_config(model_overrides=text, image_size=64), True)
    assert tuple(tower.image_size) == (64, 64)
    assert tower(torch.rand(1, 3, 64, 64)).shape == (1, 512)


def test_checkpoints_are_read_weights_only_even_when_the_environment_turns_torchs_default_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD makes torch.load unpickle whatever a call does not ask
    weights-only explicitly: a hostile checkpoint named by a recipe still runs no code."""
    from crafted_files import hostile_torch_file

    marker = tmp_path / "ran"
    hostile = hostile_torch_file(tmp_path / "hostile.pt", marker)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        create_open_clip_visual(_config(pretrained=str(hostile)), True)
    assert not marker.exists()
