"""The recipe's range and consistency checks (``mmviews.config._check_values``): a value the types
allow but the training cannot use is refused when the recipe loads, with one line naming the file,
the key and the value; the boundary value on the allowed side loads. Each check is probed on both
sides of its boundary (``0`` vs ``1``, ``<`` vs ``<=``), so a check that is dropped, loosened or
tightened by one fails here."""

from __future__ import annotations

import copy

import pytest

from mmviews.config import FSDP_FP16_REFUSAL, ConfigError, TrainConfig, config_from_dict

BASE = {"views": ["x"], "adapters": {"x": {"type": "mlp", "input_dim": 4}}}


def _raw(**changes: object) -> dict:
    """:data:`BASE` with ``changes`` applied (``section__key`` -> value; ``name`` at the top)."""
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


def _refusal(**changes: object) -> str:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(_raw(**changes), "r.yaml")
    return str(caught.value)


# (dotted key, refused value, the message's text after "key '<key>': ", accepted boundary values)
RANGES = [
    ("data.batch_size", 1, "must be >= 2 (negatives come from other samples), got 1", [2]),
    ("data.batch_size", 0, "must be >= 2 (negatives come from other samples), got 0", [3]),
    ("data.reference_views", 0, "must be >= 1, got 0", [1]),
    ("data.num_workers", -1, "must be >= 0, got -1", [0]),
    ("data.eval_batch_size", 0, "must be >= 1, got 0", [1]),
    ("optimisation.lr", 0.0, "must be > 0, got 0.0", [1e-12]),
    ("optimisation.lr", -1e-3, "must be > 0, got -0.001", [1.0]),
    ("optimisation.backbone_lr", -1e-6, "must be >= 0, got -1e-06", [0.0, None]),
    ("optimisation.weight_decay", -0.5, "must be >= 0, got -0.5", [0.0]),
    ("optimisation.betas", [0.9, 1.0], "must be two numbers in [0, 1), got [0.9, 1.0]", [[0.0, 0.999]]),
    ("optimisation.betas", [-0.1, 0.9], "must be two numbers in [0, 1), got [-0.1, 0.9]", [[0.5, 0.0]]),
    ("optimisation.betas", [1.0, 0.9], "must be two numbers in [0, 1), got [1.0, 0.9]", [[0.999, 0.5]]),
    ("optimisation.betas", [0.9], "must be two numbers in [0, 1), got [0.9]", []),
    ("optimisation.betas", [0.9, 0.9, 0.9], "must be two numbers in [0, 1), got [0.9, 0.9, 0.9]", []),
    ("optimisation.momentum", 1.0, "must be in [0, 1), got 1.0", [0.0, 0.999]),
    ("optimisation.momentum", -0.1, "must be in [0, 1), got -0.1", []),
    ("optimisation.lars_eta", 0.0, "must be > 0, got 0.0", [1e-9]),
    ("optimisation.epochs", 0, "must be >= 1, got 0", [1]),
    ("optimisation.max_steps", 0, "must be >= 1, got 0", [1, None]),
    ("optimisation.warmup_steps", -1, "must be >= 0, got -1", [0]),
    ("optimisation.warmup_epochs", -0.5, "must be >= 0, got -0.5", [0.0]),
    ("optimisation.grad_accum_steps", 0, "must be >= 1, got 0", [1]),
    ("optimisation.max_grad_norm", 0.0, "must be > 0, got 0.0", [1e-9, None]),
    ("optimisation.encode_chunk_size", 0,
     "must be a number of samples >= 1 (or null: no chunking), got 0", [1, None]),
    # the learned temperature's (and siglip's) own learning rate: 0 keeps them fixed, null is optimisation.lr
    ("objective.lr", -1e-3, "must be >= 0, got -0.001", [0.0, 0.5, None]),
    ("objective.teacher_momentum", 1.0, "must be in [0, 1), got 1.0", [0.0, 0.999]),
    ("objective.teacher_momentum", -0.25, "must be in [0, 1), got -0.25", []),
    ("evaluation.every_epochs", -1, "must be >= 0, got -1", [0]),
    ("output.log_every", 0, "must be >= 1, got 0", [1]),
    ("output.checkpoint_every", -1, "must be >= 0, got -1", [0]),
    ("output.keep_last", 0, "must be >= 1, got 0", [1]),
]


@pytest.mark.parametrize(("key", "bad", "message", "good"), RANGES, ids=[f"{r[0]}={r[1]}" for r in RANGES])
def test_a_value_out_of_range_is_refused_by_key_and_value_and_its_boundary_loads(key, bad, message, good):
    change = key.replace(".", "__")
    assert _refusal(**{change: bad}) == f"r.yaml: key '{key}': {message}"
    section, field_name = key.split(".")
    for value in good:
        config = config_from_dict(_raw(**{change: value}), "r.yaml")
        assert getattr(getattr(config, section), field_name) == value


def test_the_defaults_pass_every_check():
    """Each section's defaults are inside its ranges (a recipe need only name views and adapters)."""
    config = config_from_dict(_raw(), "r.yaml")
    assert config.to_dict() == TrainConfig(views=["x"], adapters=BASE["adapters"]).to_dict()


def test_a_recipe_needs_views_and_adapters():
    assert _refusal(views=[]) == "r.yaml: key 'views': at least one view entry is needed"
    assert _refusal(adapters={}) == "r.yaml: key 'adapters': at least one modality adapter is needed"
    assert _refusal(adapters={"x": {"input_dim": 4}}) == "r.yaml: key 'adapters.x.type': every adapter needs a 'type'"
    # the first adapter without a type is named, the ones before it pass
    two = {"x": {"type": "mlp", "input_dim": 4}, "y": {"input_dim": 4}}
    assert _refusal(adapters=two) == "r.yaml: key 'adapters.y.type': every adapter needs a 'type'"


COMPILE_REFUSAL = ("r.yaml: key 'optimisation.compile': cannot be combined with gradient_checkpointing (adapters {}) "
                   "under optimisation.sample_keyed_dropout: torch.compile rejects the context that replays the "
                   "sample keys in the recomputation; turn one of the three off")


def test_compile_with_checkpointing_under_sample_keyed_dropout_is_refused_naming_the_adapters():
    adapters = {"y": {"type": "mlp", "input_dim": 4, "gradient_checkpointing": True},
                "z": {"type": "mlp", "input_dim": 4},
                "x": {"type": "mlp", "input_dim": 4, "gradient_checkpointing": True}}
    all_three = {"views": ["x", "y", "z"], "adapters": adapters,
                 "optimisation": {"compile": True, "sample_keyed_dropout": True}}
    with pytest.raises(ConfigError) as caught:
        config_from_dict(all_three, "r.yaml")
    assert str(caught.value) == COMPILE_REFUSAL.format("x, y")  # the checkpointed ones, sorted
    # any two of the three load
    for off in ({"optimisation": {"compile": False, "sample_keyed_dropout": True}},
                {"optimisation": {"compile": True, "sample_keyed_dropout": False}},
                {"adapters": {m: {**a, "gradient_checkpointing": False} for m, a in adapters.items()}}):
        config = config_from_dict({**all_three, **off}, "r.yaml")
        assert config.adapter_configs["x"].type == "mlp"


def test_fsdp_with_fp16_is_refused_with_the_shared_reason():
    assert _refusal(distributed__sharding="fsdp", optimisation__mixed_precision="fp16") == (
        f"r.yaml: key 'optimisation.mixed_precision': {FSDP_FP16_REFUSAL}")
    assert config_from_dict(_raw(distributed__sharding="fsdp", optimisation__mixed_precision="bf16"), "r.yaml")
    assert config_from_dict(_raw(distributed__sharding="none", optimisation__mixed_precision="fp16"), "r.yaml")


@pytest.mark.parametrize("name", ["a/b", "..", "/abs", "a\\b", "."])
def test_the_run_name_and_output_dir_must_be_one_folder_name(name):
    assert _refusal(name=name) == (
        f"r.yaml: key 'name': must be a single folder name (no '/', '\\', '..' or absolute path), got {name!r}; "
        "choose a run folder elsewhere with --output")
    assert _refusal(output__dir=name) == (
        f"r.yaml: key 'output.dir': must be a single folder name (no '/', '\\', '..' or absolute path), got {name!r}; "
        "choose a run folder elsewhere with --output")


def test_a_plain_run_name_and_output_dir_load():
    config = config_from_dict(_raw(name="run-1", output__dir="out_2"), "r.yaml")
    assert (config.name, config.output.dir) == ("run-1", "out_2")
    assert config_from_dict(_raw(output__dir=None), "r.yaml").output.dir is None
