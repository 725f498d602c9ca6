"""The ``transformers`` backbone of the adapters that use one (``mmviews.modalities.hf_backbone``),
with a tiny ViT saved in a temporary folder (nothing downloaded): a local checkpoint gives its
weights only when the config is ``pretrained`` and the caller loads weights, else its architecture
with fresh weights; ``backbone_config`` builds its ``model_type`` (the adapter's default type when
it names none) without changing the config; a saved adapter's ``backbone/`` folder gives the
architecture; a missing local path, a local folder without ``config.json``, a bad hub id and a
config naming neither are one line each."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, ViTModel

from mmviews.modalities.hf_backbone import transformers_backbone
from mmviews.modalities.image_backbones import HFVisionConfig

TINY_VIT = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
            "image_size": 8, "patch_size": 4}


def _build(config: HFVisionConfig, load_weights: bool = True, saved_dir=None, default_type: str = "vit"):
    return transformers_backbone(config, load_weights=load_weights, saved_dir=saved_dir, what="vision",
                                 default_type=default_type)


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny ViT saved as a local checkpoint folder, and its weights."""
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.for_model("vit", **TINY_VIT))
    model.save_pretrained(tmp_path / "vit")
    return tmp_path / "vit", model.state_dict()


def _same_weights(model, state) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_a_local_checkpoint_gives_its_weights_when_pretrained_and_loaded(checkpoint):
    folder, state = checkpoint
    torch.manual_seed(1)
    loaded = _build(HFVisionConfig(model=str(folder)))
    assert isinstance(loaded, ViTModel) and _same_weights(loaded, state)
    for config, load_weights in ((HFVisionConfig(model=str(folder), pretrained=False), True),
                                 (HFVisionConfig(model=str(folder)), False)):
        fresh = _build(config, load_weights=load_weights)
        assert fresh.config.hidden_size == 8 and fresh.config.num_hidden_layers == 1  # the architecture
        assert not _same_weights(fresh, state)  # not its weights


def test_a_backbone_config_builds_its_model_type_or_the_default(checkpoint):
    config = HFVisionConfig(backbone_config={"model_type": "vit", **TINY_VIT})
    model = _build(config, default_type="bert")
    assert isinstance(model, ViTModel) and model.config.hidden_size == 8 and model.config.patch_size == 4
    assert config.backbone_config == {"model_type": "vit", **TINY_VIT}  # the config is left as it was
    assert isinstance(_build(HFVisionConfig(backbone_config=dict(TINY_VIT)), default_type="vit"), ViTModel)


def test_a_saved_adapters_backbone_folder_gives_the_architecture(checkpoint, tmp_path):
    folder, state = checkpoint
    saved = tmp_path / "adapter"
    (saved / "backbone").mkdir(parents=True)
    AutoConfig.from_pretrained(folder).save_pretrained(saved / "backbone")
    # the saved folder wins over the config's model and backbone_config
    model = _build(HFVisionConfig(model="./not_there", backbone_config={"model_type": "bert"}), saved_dir=saved)
    assert isinstance(model, ViTModel) and model.config.hidden_size == 8 and not _same_weights(model, state)


def test_a_missing_local_model_or_a_bad_hub_id_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        _build(HFVisionConfig(model="./not_there"))
    assert str(caught.value) == "vision model: local path './not_there' does not exist"
    with pytest.raises(FileNotFoundError) as caught:
        _build(HFVisionConfig(model="bad id!!"))  # refused by the hub's id rules, before any download
    assert str(caught.value).startswith("vision model 'bad id!!': neither a local checkpoint directory nor a "
                                        "reachable hub model (")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("pretrained,load_weights", [(True, True), (False, True), (True, False)])
def test_a_local_folder_without_config_json_is_one_line(checkpoint, tmp_path, pretrained, load_weights):
    """The weights without their config.json: mmviews's error naming the folder and the file, not
    transformers' "Unrecognized model", on every path that reads the folder."""
    folder, _ = checkpoint
    (folder / "config.json").unlink()
    assert any(folder.iterdir())  # the weights are still there
    with pytest.raises(FileNotFoundError) as caught:
        _build(HFVisionConfig(model=str(folder), pretrained=pretrained), load_weights=load_weights)
    assert str(caught.value) == (f"vision model: local folder {str(folder)!r} has no config.json (a transformers "
                                 "checkpoint folder holds the model's config.json beside its weights)")


def test_a_config_naming_no_model_is_refused():
    with pytest.raises(ValueError) as caught:
        _build(HFVisionConfig())
    assert str(caught.value) == "hf_vision adapter needs 'model' (hub name or local dir) or 'backbone_config'"
