"""The recipe is resolved once, when it loads: its views, adapters and evaluation tasks become
typed objects (``TrainConfig.view_spec``, ``eval_view_spec``, ``adapter_configs``,
``eval_tasks``) checked by the one validator, so that a wrong adapter key or value is refused at
load like any other key: one line naming the file (or the ``--set``), the key path and the value,
with a did-you-mean hint for a misspelt key or type."""

from __future__ import annotations

import copy

import pytest
import yaml

from mmviews.config import ConfigError, TrainConfig, config_from_dict, load_config, save_config
from mmviews.data.views import ViewSpec
from mmviews.eval.tasks import EvalTask
from mmviews.modalities import MLPConfig, SmallCNNVisionConfig

RAW = {
    "name": "r",
    "views": [{"modality": "image", "copies": 2, "augment": "simclr"}, "x"],
    "adapters": {"image": {"type": "small_cnn", "channels": [8], "head": {"kind": "linear"}},
                 "x": {"type": "mlp", "input_dim": 4, "embed_dim": 8}},
    "encoder": {"embed_dim": 16},
    "evaluation": {"tasks": ["knn:class", {"kind": "retrieval", "ks": [1]}]},
}


def _raw(**changes: object) -> dict:
    """:data:`RAW` with ``changes`` (dotted key -> value) applied."""
    raw = copy.deepcopy(RAW)
    for key, value in changes.items():
        *path, last = key.split(".")
        node = raw
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return raw


def test_loading_resolves_the_sections_into_typed_objects_once():
    config = config_from_dict(_raw(), "r.yaml")
    assert isinstance(config.view_spec, ViewSpec)
    assert [v.name for v in config.view_spec.views] == ["image_0", "image_1", "x_0"]
    assert [v.name for v in config.eval_view_spec.views] == ["image_0", "x_0"]  # one natural view per modality
    image, x = config.adapter_configs["image"], config.adapter_configs["x"]
    assert isinstance(image, SmallCNNVisionConfig) and image.channels == [8] and image.head.kind == "linear"
    assert image.embed_dim == 16 and isinstance(x, MLPConfig) and x.embed_dim == 8  # encoder.embed_dim fills
    assert config.eval_tasks == [EvalTask("knn", "class"), EvalTask("retrieval", params={"ks": [1]})]
    assert config.view_spec is config.view_spec and config.adapter_configs is config.adapter_configs
    # the fields keep the recipe as written: that is what is saved and what --set addresses
    assert config.views == RAW["views"] and config.adapters == RAW["adapters"]
    assert not {"view_spec", "eval_view_spec", "adapter_configs", "eval_tasks"} & set(config.to_dict())


def test_the_smallest_shared_embedding_is_one_dimension():
    """embed_dim 0 is refused at load (a zero-width projection builds and fails later); 1 is a
    real, if small, embedding and loads."""
    config = config_from_dict(_raw(**{"encoder.embed_dim": 1}), "r.yaml")
    assert config.adapter_configs["image"].embed_dim == 1 and config.adapter_configs["x"].embed_dim == 8


def test_a_saved_recipe_loads_to_the_same_objects(tmp_path):
    config = config_from_dict(_raw(**{"evaluation.views": ["x"]}), "r.yaml")
    again = load_config(save_config(config, tmp_path / "config.yaml"))
    assert again == config and again.adapter_configs == config.adapter_configs
    assert again.eval_tasks == config.eval_tasks and [v.name for v in again.eval_view_spec.views] == ["x_0"]


def test_a_config_made_in_python_resolves_at_first_use():
    config = TrainConfig(views=["x"], adapters={"x": {"type": "mlp", "input_dim": 2}}, encoder={"embed_dim": 4})
    assert config.adapter_configs["x"].embed_dim == 4 and config.view_spec.modalities == ["x"]
    assert config.eval_tasks == []
    broken = TrainConfig(views=["x"], adapters={"x": {"type": "mlp", "input_dim": "2"}})
    with pytest.raises(ConfigError, match=r"^recipe: key 'adapters\.x\.input_dim': expected int, got str '2'$"):
        broken.adapter_configs


@pytest.mark.parametrize(("changes", "message"), [
    ({"adapters.image.channels": "8"}, "key 'adapters.image.channels': expected a list, got str '8'"),
    ({"adapters.image.channels": [8, 1.5]}, "key 'adapters.image.channels.1': expected int, got float 1.5"),
    ({"adapters.x.embed_dim": True}, "key 'adapters.x.embed_dim': expected int, got bool True"),
    ({"adapters.image.head": {"kind": "linear", "hidden_dim": "wide"}},
     "key 'adapters.image.head.hidden_dim': expected int, got str 'wide'"),
    ({"adapters.image.finetune": {"mode": "full", "lora": {"r": "8"}}},
     "key 'adapters.image.finetune.lora.r': expected int, got str '8'"),
    ({"encoder.embed_dim": "big"}, "key 'encoder.embed_dim': expected int, got str 'big'"),
    # a zero-width embedding builds, and failed only at the first evaluation
    ({"encoder.embed_dim": 0}, "key 'encoder.embed_dim': must be >= 1 (the size of the shared embedding), got 0"),
    ({"adapters.x.embed_dim": -1}, "key 'adapters.x.embed_dim': must be >= 1 (the size of the shared embedding), "
                                   "got -1"),
    ({"views.0.copies": "2"}, "key 'views.0.copies': expected int, got str '2'"),
    ({"views.0.copies": 0}, "key 'views.0.copies': must be >= 1, got 0"),
    ({"views.1": 3}, "key 'views.1': expected a modality name or a mapping, got 3"),
    ({"views.0": {"copies": 2}}, "key 'views.0': missing 'modality'"),
    ({"evaluation.tasks": ["knn", {"kind": "knn", "k": "many"}]},
     "key 'evaluation.tasks.1.k': expected int, got str 'many'"),
])
def test_a_value_of_the_wrong_type_names_the_file_the_key_path_and_the_value(changes, message):
    with pytest.raises(ConfigError) as caught:
        config_from_dict(_raw(**changes), "r.yaml")
    assert str(caught.value) == f"r.yaml: {message}"


@pytest.mark.parametrize(("changes", "start"), [
    ({"adapters.image.chanels": [8]}, "unknown key 'adapters.image.chanels' (did you mean 'channels'?); "
                                      "allowed keys in 'adapters.image': "),
    ({"adapters.image.head": {"knd": "mlp"}}, "unknown key 'adapters.image.head.knd' (did you mean 'kind'?); "
                                              "allowed keys in 'adapters.image.head': kind, hidden_dim"),
    ({"adapters.image.type": "smal_cnn"}, "key 'adapters.image.type': unknown adapter type 'smal_cnn' "
                                          "(did you mean 'small_cnn'?); known: "),
    ({"encoder.embd_dim": 8}, "unknown key 'encoder.embd_dim' (did you mean 'embed_dim'?); allowed keys in "
                              "'encoder': embed_dim"),
    ({"views.0.copise": 2}, "unknown key 'views.0.copise' (did you mean 'copies'?); allowed keys in 'views.0': "),
    ({"evaluation.tasks": ["knn", "retreival"]}, "key 'evaluation.tasks.1': unknown evaluation task 'retreival' "
                                                 "(did you mean 'retrieval'?)"),
])
def test_a_misspelt_key_or_name_gets_a_hint(changes, start):
    with pytest.raises(ConfigError) as caught:
        config_from_dict(_raw(**changes), "r.yaml")
    assert str(caught.value).startswith(f"r.yaml: {start}")


def test_a_bad_override_of_an_adapter_key_names_the_set(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RAW))
    with pytest.raises(ConfigError, match=r"^--set 'adapters\.image\.channels=\[x\]': key 'adapters\.image\."
                                          r"channels\.0': expected int, got str 'x'$"):
        load_config(path, ["adapters.image.channels=[x]"])
    with pytest.raises(ConfigError, match=r"^--set 'adapters\.x\.hiden_dim=3': unknown key 'adapters\.x\.hiden_dim' "
                                          r"\(did you mean 'hidden_dim'\?\)"):
        load_config(path, ["adapters.x.hiden_dim=3"])
    assert load_config(path, ["adapters.x.hidden_dim=3"]).adapter_configs["x"].hidden_dim == 3


def test_a_recipe_whose_encoder_mmviews_does_not_build_loads_without_its_adapter_types():
    """An ONNX export's recipe: its adapters are graphs, their types' code need not be installed."""
    raw = _raw(**{"adapters.x.type": "plugin_not_installed"})
    config = config_from_dict(raw, "r.yaml", adapters=False)
    assert config.view_spec.modalities == ["image", "x"] and len(config.eval_tasks) == 2
    with pytest.raises(ConfigError, match=r"^recipe: key 'adapters\.x\.type': unknown adapter type "
                                          r"'plugin_not_installed'"):
        config.adapter_configs
    with pytest.raises(ConfigError, match=r"^r\.yaml: key 'adapters\.x\.type'"):
        config_from_dict(raw, "r.yaml")


def test_the_objects_are_made_when_the_recipe_loads_and_errors_name_its_file(tmp_path):
    config = config_from_dict(_raw(), "r.yaml")
    assert {"view_spec", "eval_view_spec", "adapter_configs", "eval_tasks"} <= vars(config).keys()  # not at first use
    for changes, message in [
        ({"evaluation.views": [{"modality": "x", "copise": 1}]}, "r.yaml: unknown key 'evaluation.views.0.copise'"),
        ({"data": {"batch_size": 1}}, "r.yaml: key 'data.batch_size': must be >= 2"),
    ]:
        with pytest.raises(ConfigError) as caught:
            config_from_dict(_raw(**changes), "r.yaml")
        assert str(caught.value).startswith(message), str(caught.value)
    with pytest.raises(ConfigError, match=r"^r\.yaml: a recipe must be a YAML mapping, got list$"):
        config_from_dict([], "r.yaml")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_raw(**{"adapters.x.type": "plugin_not_installed"})))
    assert load_config(path, adapters=False).view_spec.modalities == ["image", "x"]
    with pytest.raises(ConfigError, match=r"^.*r\.yaml \(with --set overrides\): key 'adapters\.x\.type'"):
        load_config(path, ["seed=3"])  # the error is the file's, not the --set's
