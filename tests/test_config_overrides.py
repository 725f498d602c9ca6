"""``--set KEY=VALUE`` overrides (``mmviews.config.parse_override``, ``apply_overrides``) and how an
error is told as the ``--set`` at fault (``load_config``, ``name_the_override``): the key split at
the first ``=`` only, values read as YAML scalars, list items addressed by index (negative ones
too, out of range refused), keys checked against the schema before anything is built, the
recipe given to ``apply_overrides`` left unchanged, and every error one line quoting the
``--set`` as typed."""

from __future__ import annotations

import copy

import pytest
import yaml

from mmviews.config import ConfigError, TrainConfig, apply_overrides, dotted_keys, load_config, parse_override


def _error(callable_, *args) -> str:
    with pytest.raises(ConfigError) as caught:
        callable_(*args)
    return str(caught.value)


def test_the_key_ends_at_the_first_equals_sign():
    assert parse_override("name=a=b") == (["name"], "a=b")
    assert parse_override(" optimisation.lr = 3e-4") == (["optimisation", "lr"], 3e-4)  # YAML would keep a string
    assert parse_override("data.options.x=[1, 2]") == (["data", "options", "x"], [1, 2])


@pytest.mark.parametrize("blank", ["", "  ", "\t"])
def test_a_blank_value_is_null(blank):
    """Whitespace alone is null (a tab is not valid YAML: it is not read as YAML at all)."""
    assert parse_override(f"optimisation.max_steps={blank}") == (["optimisation", "max_steps"], None)


@pytest.mark.parametrize(("text", "message"), [
    ("optimisation.lr", "--set 'optimisation.lr': expected KEY=VALUE (e.g. optimisation.lr=3e-4)"),
    ("=1", "--set '=1': empty key component in ''"),
    ("a..b=1", "--set 'a..b=1': empty key component in 'a..b'"),
    (".a=1", "--set '.a=1': empty key component in '.a'"),
    ("a.=1", "--set 'a.=1': empty key component in 'a.'"),
])
def test_a_malformed_set_is_named(text, message):
    assert _error(parse_override, text) == message


def test_a_value_that_is_not_yaml_is_named():
    message = _error(parse_override, "views=[x")
    assert message.startswith("--set 'views=[x': value is not valid YAML: ") and "\n" in message  # YAML's own report


def test_the_recipe_given_is_not_changed():
    raw = {"data": {"options": {"n": 1}}, "views": [{"modality": "x", "copies": 1}]}
    before = copy.deepcopy(raw)
    out = apply_overrides(raw, ["data.options.n=2", "views.0.copies=3"])
    assert raw == before
    assert out == {"data": {"options": {"n": 2}}, "views": [{"modality": "x", "copies": 3}]}


def test_list_items_are_addressed_by_index_anywhere_in_the_key():
    raw = {"views": [{"modality": "x", "params": {"p": 0.1}}, "y"]}
    assert apply_overrides(raw, ["views.0.params.p=0.5"])["views"][0] == {"modality": "x", "params": {"p": 0.5}}
    assert apply_overrides(raw, ["views.-2.params.p=0.5"])["views"][0]["params"] == {"p": 0.5}
    assert apply_overrides(raw, ["views.1=z"])["views"] == raw["views"][:1] + ["z"]
    assert apply_overrides(raw, ["views.-1=z"])["views"][1] == "z"
    assert apply_overrides(raw, ["views.-2=z"])["views"] == ["z", "y"]
    # a missing section is created on the way
    assert apply_overrides({}, ["data.options.n=2"]) == {"data": {"options": {"n": 2}}}


@pytest.mark.parametrize(("text", "message"), [
    ("views.2=z", "index 2 out of range for a list of 2"),
    ("views.-3=z", "index -3 out of range for a list of 2"),
    ("views.2.copies=1", "index 2 out of range for a list of 2"),
    ("views.-3.copies=1", "index -3 out of range for a list of 2"),
    ("views.first=z", "'first' must be a list index"),
    ("views.first.copies=1", "'first' must be a list index"),
    ("seed.x=1", "'seed' is not a mapping"),
    ("seed.x.y=1", "'seed' is not a mapping"),
    ("data.name.x=1", "'data.name' is not a mapping"),
    ("data.name.x.y=1", "'data.name' is not a mapping"),
])
def test_a_path_through_a_scalar_or_past_a_list_is_refused(text, message):
    raw = {"seed": 0, "data": {"name": "synthetic"}, "views": ["x", "y"]}
    assert _error(apply_overrides, raw, [text]) == f"--set {text!r}: {message}"


def test_an_unknown_section_key_is_refused_before_the_recipe_is_built():
    assert _error(apply_overrides, {}, ["optimisation.lrr=1"]) == (
        "--set 'optimisation.lrr=1': unknown key 'optimisation.lrr' (did you mean 'lr'?); allowed keys here: "
        "optimizer, lr, backbone_lr, weight_decay, betas, momentum, nesterov, lars_eta, epochs, max_steps, "
        "warmup_steps, warmup_epochs, schedule, grad_accum_steps, sample_keyed_dropout, max_grad_norm, "
        "encode_chunk_size, mixed_precision, compile")
    # the path named ends at the unknown key, however deep the --set goes
    assert _error(apply_overrides, {}, ["output.dirr.x=1"]).startswith(
        "--set 'output.dirr.x=1': unknown key 'output.dirr' (did you mean 'dir'?); allowed keys here: dir, log_every")
    assert _error(apply_overrides, {}, ["sead=1"]).startswith(
        "--set 'sead=1': unknown key 'sead' (did you mean 'seed'?); allowed keys here: name, description, seed, data")
    # below a typed leaf (a free-form mapping, a list) the owning layer checks the keys
    assert apply_overrides({}, ["objective.params.anything=1", "encoder.whatever=2", "adapters.x.y.z=3"]) == {
        "objective": {"params": {"anything": 1}}, "encoder": {"whatever": 2}, "adapters": {"x": {"y": {"z": 3}}}}


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"views": ["x"], "adapters": {"x": {"type": "mlp", "input_dim": 4}}}))
    return path


def test_an_error_in_the_file_names_the_file_alone(recipe, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text() + "seed: many\n")
    assert _error(load_config, bad) == f"{bad}: key 'seed': expected int, got str 'many'"
    assert _error(load_config, bad, ["name=x"]) == (
        f"{bad} (with --set overrides): key 'seed': expected int, got str 'many'")


def test_an_error_in_a_set_value_names_that_set_as_typed(recipe):
    assert _error(load_config, recipe, ["name=a/b=c"]) == (
        "--set 'name=a/b=c': key 'name': must be a single folder name (no '/', '\\', '..' or absolute path), got "
        "'a/b=c'; choose a run folder elsewhere with --output")
    # the last --set of the key is at fault; the recipe's name inside a value is not touched
    source = f"{recipe} (with --set overrides)"
    text = f"name=x/{source}"
    assert _error(load_config, recipe, ["name=a/b", text]) == (
        f"--set {text!r}: key 'name': must be a single folder name (no '/', '\\', '..' or absolute path), got "
        f"'x/{source}'; choose a run folder elsewhere with --output")
    # a --set of a section above the key, or of a key below it, is named too
    assert _error(load_config, recipe, ["data={batch_size: 1}"]).startswith(
        "--set 'data={batch_size: 1}': key 'data.batch_size': must be >= 2")
    assert _error(load_config, recipe, ["views=[]"]) == "--set 'views=[]': key 'views': at least one view entry is needed"


def test_a_recipes_leaves_are_named_by_their_dotted_keys():
    nested = {"a": {"b": 1, "c": {}, "d": {"e": None}}, "f": [1, {"g": 2}], 3: "x"}
    assert dotted_keys(nested) == {"a.b": 1, "a.c": {}, "a.d.e": None, "f": [1, {"g": 2}], "3": "x"}
    assert dotted_keys({"b": {"c": 1}}, "a") == {"a.b.c": 1}
    assert dotted_keys(5) == {"": 5} and dotted_keys({}) == {"": {}} and dotted_keys([1]) == {"": [1]}


def test_every_dotted_key_of_a_recipe_is_one_set_can_name():
    keys = dotted_keys(TrainConfig().to_dict())
    assert {"optimisation.lr", "data.options", "output.trackers", "distributed.fsdp_units"} <= keys.keys()
    for key in keys:
        assert dotted_keys(apply_overrides({}, [f"{key}=null"])) == {key: None}
