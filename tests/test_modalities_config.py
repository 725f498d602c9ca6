"""The adapters' configuration dataclasses (``mmviews.modalities.config``): ``to_dict`` puts the type
first and holds every field (what ``config.json`` of a saved adapter holds), ``from_dict`` reads it
back, nested sections included; a mapping of another type is refused naming both types; key errors
name the adapter type (or the recipe's file when given) and the key path; the defaults are the
documented ones."""

from __future__ import annotations

import json

import pytest

from mmviews.modalities.config import AdapterConfig, FinetuneConfig, HeadConfig, LoRAConfig
from mmviews.modalities.mlp import MLPConfig


def test_to_dict_starts_with_the_type_and_holds_every_field():
    config = MLPConfig(input_dim=3, embed_dim=16, head=HeadConfig(kind="linear"),
                       finetune=FinetuneConfig(mode="frozen", lora=LoRAConfig(r=4)))
    data = config.to_dict()
    assert list(data)[0] == "type" and data["type"] == "mlp"
    assert data["embed_dim"] == 16 and data["head"]["kind"] == "linear" and data["finetune"]["lora"]["r"] == 4
    again = MLPConfig.from_dict(json.loads(json.dumps(data)))  # as config.json stores it
    assert again == config and isinstance(again.finetune.lora, LoRAConfig)


def test_from_dict_takes_a_mapping_with_or_without_its_type():
    data = {"input_dim": 3}
    assert MLPConfig.from_dict(data) == MLPConfig(input_dim=3)
    assert MLPConfig.from_dict({"type": "mlp", "input_dim": 3}) == MLPConfig(input_dim=3)
    assert data == {"input_dim": 3}  # the caller's mapping is not changed
    given = {"type": "mlp", "input_dim": 3}
    MLPConfig.from_dict(given)
    assert given == {"type": "mlp", "input_dim": 3}


def test_a_mapping_of_another_type_is_refused():
    with pytest.raises(ValueError) as caught:
        MLPConfig.from_dict({"type": "text", "input_dim": 3})
    assert str(caught.value) == "config of type 'text' given to MLPConfig (type 'mlp')"


def test_key_errors_name_the_type_or_the_source_and_the_key_path():
    with pytest.raises(ValueError) as caught:
        MLPConfig.from_dict({"input_dim": "three"})
    assert str(caught.value) == "'mlp' adapter config: key 'input_dim': expected int, got str 'three'"
    with pytest.raises(ValueError) as caught:
        MLPConfig.from_dict({"head": {"num_layers": "two"}}, "adapters.x", "r.yaml")
    assert str(caught.value) == "r.yaml: key 'adapters.x.head.num_layers': expected int, got str 'two'"


def test_the_defaults_are_the_documented_ones():
    config = AdapterConfig()
    assert (config.type, config.embed_dim, config.gradient_checkpointing) == ("", 128, False)
    assert config.head == HeadConfig(kind="mlp", hidden_dim=None, num_layers=2, batch_norm=True, activation="relu",
                                     dropout=0.0)
    assert config.finetune == FinetuneConfig(mode="full", last_n=0, lora=None)
    assert LoRAConfig() == LoRAConfig(r=8, alpha=16, dropout=0.0, target_modules=None)
