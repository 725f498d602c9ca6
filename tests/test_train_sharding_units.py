"""The parts of sharded training (mmviews.train.sharding) in this process, on a process group of
one (gloo): which modules become FSDP2 units and in which order, the mixed-precision policy
(parameters gathered in bf16, gradients reduced in float32, BatchNorm kept float32), the request
read from the recipe and the launcher, and the full optimiser state renumbered as an unsharded
``optimizer.bin`` numbers it (compared index by index with an unsharded optimiser's). (Two
sharded processes against one: test_train_sharding.py.)"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
import torch.distributed as dist
from test_train_utils import free_port

from mmviews.config import ConfigError, TrainConfig
from mmviews.modalities import MultiViewEncoder
from mmviews.train import sharding


@pytest.fixture
def group_of_one(monkeypatch):
    """A gloo process group of this process alone, destroyed after the test."""
    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _encoder() -> MultiViewEncoder:
    torch.manual_seed(0)
    return MultiViewEncoder.from_config({
        "b": {"type": "mlp", "input_dim": 3, "hidden_dim": 8, "embed_dim": 4, "head": {"kind": "mlp", "hidden_dim": 6, "batch_norm": True}},
        "a": {"type": "mlp", "input_dim": 5, "hidden_dim": 8, "embed_dim": 4},
    })


def _config(mixed_precision: str = "no", units: dict | None = None) -> TrainConfig:
    config = TrainConfig(cpu=True, adapters={"a": {}, "b": {}})
    config.optimisation.mixed_precision = mixed_precision
    config.distributed.fsdp_units = units or {}
    return config


def _record_units(monkeypatch) -> list[tuple[torch.nn.Module, object]]:
    """fully_shard (the real one), each call recorded: (module, mp_policy)."""
    import torch.distributed.fsdp as fsdp

    calls = []
    real = fsdp.fully_shard

    def recording(module, **kwargs):
        calls.append((module, kwargs.get("mp_policy")))
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", recording)
    return calls


def test_units_are_sharded_inner_first_by_the_recipes_choice(group_of_one, monkeypatch):
    encoder = _encoder()
    calls = _record_units(monkeypatch)
    sharding.shard_encoder(encoder, _config(units={"a": "adapter"}), torch.device("cpu"), 1)
    b, a = encoder.adapters["b"], encoder.adapters["a"]
    assert [m for m, _ in calls] == [b.backbone, b.head, a, encoder]
    assert sharding.is_sharded(encoder) and not sharding.is_sharded(torch.nn.Linear(2, 2))
    # the units' parameter bytes, as the memory estimate counts them (unsharded modules, same order)
    fresh = _encoder()
    sizes = sharding.unit_parameter_bytes(fresh, {"a": "adapter"})
    fb, fa = fresh.adapters["b"], fresh.adapters["a"]
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert sizes == [nbytes(fb.backbone), nbytes(fb.head), nbytes(fa), 0]
    # a whole-adapter unit first: the adapters after it are still counted
    assert sharding.unit_parameter_bytes(_encoder(), {"b": "adapter"}) == [
        nbytes(fb), nbytes(fa.backbone), nbytes(fa.head), 0]


@pytest.mark.parametrize("native", [True, False])
def test_an_auto_precision_shards_with_the_runs_choice(group_of_one, monkeypatch, native: bool):
    """``auto`` not yet resolved (a benchmark's config): the units gather in bf16 where the CPU
    computes it natively, in float32 elsewhere, as the run's autocast."""
    import mmviews.eval.precision as P

    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: native)
    encoder = _encoder()
    calls = _record_units(monkeypatch)
    sharding.shard_encoder(encoder, _config("auto"), torch.device("cpu"), 1)
    head_policies = {policy.param_dtype for module, policy in calls if not isinstance(module, torch.nn.BatchNorm1d)}
    assert head_policies == {torch.bfloat16 if native else None}


def test_bf16_gathers_parameters_in_bf16_and_reduces_gradients_in_float32(group_of_one, monkeypatch):
    encoder = _encoder()
    calls = _record_units(monkeypatch)
    sharding.shard_encoder(encoder, _config("bf16"), torch.device("cpu"), 1)
    norms = [m for m in encoder.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert norms and [m for m, _ in calls[:len(norms)]] == norms
    for module, policy in calls:
        if isinstance(module, torch.nn.BatchNorm1d):  # float32 weights beside float32 running statistics
            assert policy.param_dtype is None and policy.reduce_dtype is None
        else:
            assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32, module
    assert len(calls) == len(norms) + 5  # b: backbone, head; a: backbone, head; the encoder
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        policy = sharding._policy(precision)
        assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)
    assert (sharding._policy("no").param_dtype, sharding._policy("no").reduce_dtype) == (None, None)


def test_the_full_optimiser_state_is_numbered_as_an_unsharded_one(group_of_one):
    """The same AdamW step, sharded (on one process: the same numbers) and not; the sharded
    state renumbered by optimizer_state_by_index equals the unsharded optimiser's state_dict
    index by index. The parameter groups list the parameters in another order than the
    encoder's own (and than their names' sorted order)."""
    plain = _encoder()
    sharded = sharding.shard_encoder(copy.deepcopy(plain), _config(), torch.device("cpu"), 1)

    def groups(model):
        params = dict(model.named_parameters())
        heads = [n for n in params if ".head." in n][::-1]
        return [{"params": [params[n] for n in heads], "lr": 0.01},
                {"params": [params[n] for n in params if n not in heads], "lr": 0.02}]

    inputs = {"a": {"values": torch.randn(6, 1, 5)}, "b": {"values": torch.randn(6, 1, 3)}}
    optimisers = []
    for model in (plain, sharded):
        optimiser = torch.optim.AdamW(groups(model))
        loss = sum((model.adapters[m](inputs[m]) * torch.arange(4.0)).sum() for m in ("a", "b"))
        loss.backward()
        optimiser.step()
        optimisers.append(optimiser)
    reference = optimisers[0].state_dict()
    full = sharding.full_optimizer_state(sharded, optimisers[1])
    by_index = sharding.optimizer_state_by_index(full)
    assert [g["params"] for g in by_index["param_groups"]] == [g["params"] for g in reference["param_groups"]]
    assert [g["lr"] for g in by_index["param_groups"]] == [0.01, 0.02]
    assert sorted(by_index["state"]) == sorted(reference["state"])
    for index, state in reference["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(by_index["state"][index][key], value, rtol=0, atol=1e-7, msg=f"{index} {key}")
    # and back: the names of this run's optimiser, as full_optimizer_state names them
    back = sharding.optimizer_state_by_name(by_index, sharded, optimisers[1])
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in full["param_groups"]]
    assert sorted(back["state"]) == sorted(full["state"])
    with pytest.raises(ValueError, match="^the optimiser state has 2 parameters, this run's optimiser 14$"):
        sharding.optimizer_state_by_name({"state": {}, "param_groups": [{"params": [0, 1]}]}, sharded, optimisers[1])


def test_full_model_state_round_trips_into_the_shards(group_of_one):
    plain = _encoder()
    sharded = sharding.shard_encoder(copy.deepcopy(plain), _config(), torch.device("cpu"), 1)
    state = sharding.full_model_state(sharded)
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    changed = {k: v + 1 if v.is_floating_point() else v.clone() for k, v in state.items()}
    expected = {k: v.clone() for k, v in changed.items()}
    sharding.load_full_model_state(sharded, changed)
    again = sharding.full_model_state(sharded)
    assert all(torch.equal(again[k], v) for k, v in expected.items())
    missing = {k: v for k, v in expected.items() if k != "adapters.a.head.net.0.weight"}
    with pytest.raises(RuntimeError, match="adapters.a.head.net.0.weight"):  # every key must match
        sharding.load_full_model_state(sharded, missing)


def test_the_request_comes_from_the_recipe_or_the_launcher(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    config = _config()
    assert sharding.requested_sharding(config) == "none"
    config.distributed.sharding = "fsdp"
    assert sharding.requested_sharding(config) == "fsdp" and sharding.run_sharding(config, 2) == "fsdp"
    assert sharding.run_sharding(config, 1) == "none"
    config.distributed.fsdp_units = ["a"]
    with pytest.raises(ConfigError, match=r"^key 'distributed.fsdp_units': a mapping of modality to one of "
                                          r"\['backbone', 'layers', 'adapter'\], got \['a'\]$"):
        sharding.requested_sharding(config)
    config.distributed.fsdp_units = {"a": "blocks"}
    with pytest.raises(ConfigError, match=r"^key 'distributed.fsdp_units.a': 'blocks' is not one of "
                                          r"\['backbone', 'layers', 'adapter'\]$"):
        sharding.requested_sharding(config)
    config.distributed.fsdp_units = {"c": "layers"}
    with pytest.raises(ConfigError, match=r"^key 'distributed.fsdp_units.c': no adapter for modality 'c' "
                                          r"\(adapters: \['a', 'b'\]\)$"):
        sharding.requested_sharding(config)


def test_fsdp1_from_the_launcher_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError) as raised:
        sharding.requested_sharding(_config())
    assert str(raised.value) == ("accelerate launch --use_fsdp with FSDP_VERSION=1: mmviews shards with FSDP2 only; "
                                 "launch with --fsdp_version 2")


def test_the_launchers_fsdp_request_is_hidden_from_accelerate_and_put_back(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with sharding.launcher_fsdp_hidden():
        assert "ACCELERATE_USE_FSDP" not in os.environ
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with sharding.launcher_fsdp_hidden():
        pass
    assert "ACCELERATE_USE_FSDP" not in os.environ


@pytest.mark.parametrize("name, guard", [
    ("shards_reduced_in_bf16", test_bf16_gathers_parameters_in_bf16_and_reduces_gradients_in_float32),
    ("sharded_optimizer_state_by_sorted_name", test_the_full_optimiser_state_is_numbered_as_an_unsharded_one),
])
def test_sharding_guards_fail_when_broken(group_of_one, monkeypatch, name: str, guard) -> None:
    from mutations import apply_break

    apply_break(name, monkeypatch.setattr)
    with pytest.raises(AssertionError):
        guard(group_of_one, monkeypatch) if "monkeypatch" in guard.__code__.co_varnames[:2] else guard(group_of_one)


def test_layer_units_shard_each_block_then_the_backbone_and_the_head(group_of_one, monkeypatch):
    encoder = _encoder()
    a = encoder.adapters["a"]
    blocks = [a.backbone[0], a.backbone[1]]
    monkeypatch.setattr(a, "backbone_blocks", lambda: blocks)
    calls = _record_units(monkeypatch)
    sharding.shard_encoder(encoder, _config(units={"a": "layers"}), torch.device("cpu"), 1)
    b = encoder.adapters["b"]
    assert [m for m, _ in calls] == [b.backbone, b.head, *blocks, a.backbone, a.head, encoder]
    fresh = _encoder()
    monkeypatch.setattr(fresh.adapters["a"], "backbone_blocks", lambda: [fresh.adapters["a"].backbone[0]])
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    fa, fb = fresh.adapters["a"], fresh.adapters["b"]
    assert sharding.unit_parameter_bytes(fresh, {"a": "layers"}) == [
        nbytes(fb.backbone), nbytes(fb.head), nbytes(fa.backbone[0]), 0, nbytes(fa.head), 0]


def test_layer_units_need_the_adapters_blocks(group_of_one):
    with pytest.raises(ConfigError, match=r"^key 'distributed.fsdp_units.a': 'layers' needs the adapter's repeated "
                                          r"blocks \(MLPAdapter does not support finetune.mode='last_n'\); use 'backbone'$"):
        sharding.shard_encoder(_encoder(), _config(units={"a": "layers"}), torch.device("cpu"), 1)


def test_an_adapter_whose_backbone_holds_no_parameters_is_one_unit(group_of_one, monkeypatch):
    encoder = _encoder()
    a = encoder.adapters["a"]
    for p in list(a.backbone.parameters()):
        p.requires_grad_(False)
    a.backbone = torch.nn.Sequential(torch.nn.GELU())  # parameter-free
    calls = _record_units(monkeypatch)
    sharding.shard_like(encoder, _config(), torch.device("cpu"), 1)
    b = encoder.adapters["b"]
    assert [m for m, _ in calls] == [b.backbone, b.head, a, encoder]
    fresh = _encoder()
    del fresh.adapters["a"].backbone  # an adapter without a backbone: one unit
    sizes = sharding.unit_parameter_bytes(fresh, {})
    assert len(sizes) == 4 and sizes[2] == sum(p.numel() * p.element_size() for p in fresh.adapters["a"].parameters())


def test_fp16_is_refused_for_sharded_runs_only(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    config = _config("fp16")
    config.distributed.sharding = "fsdp"
    with pytest.raises(ConfigError, match=r"^key 'optimisation.mixed_precision': fp16 is not supported with "
                                          r"distributed.sharding: fsdp \(Accelerate's gradient scaler does not handle sharded "
                                          r"gradients\); use bf16$"):
        sharding.run_sharding(config, 2)
    assert sharding.run_sharding(config, 1) == "none"
    config.distributed.sharding = "none"
    assert sharding.run_sharding(config, 2) == "none"
    config.distributed.sharding = "zero"
    with pytest.raises(ConfigError, match=r"^key 'distributed.sharding': 'zero' is not one of \['none', 'fsdp'\]$"):
        sharding.requested_sharding(config)


def test_a_full_optimiser_state_loads_into_a_sharded_optimiser(group_of_one):
    model = sharding.shard_encoder(_encoder(), _config(), torch.device("cpu"), 1)
    optimiser = torch.optim.AdamW(model.parameters(), lr=0.01)
    inputs = {"a": {"values": torch.randn(4, 1, 5)}, "b": {"values": torch.randn(4, 1, 3)}}
    sum(model.adapters[m](inputs[m]).sum() for m in ("a", "b")).backward()
    optimiser.step()
    state = sharding.full_optimizer_state(model, optimiser)
    other = sharding.shard_encoder(_encoder(), _config(), torch.device("cpu"), 1)
    fresh = torch.optim.AdamW(other.parameters(), lr=0.5)
    sharding.load_full_optimizer_state(other, fresh, state)
    again = sharding.full_optimizer_state(other, fresh)
    assert again["param_groups"][0]["lr"] == 0.01
    for name, values in state["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(again["state"][name][key], value, rtol=0, atol=0)


def test_accelerates_state_is_saved_without_the_sharded_model_and_its_optimisers():
    class Accelerator:
        def __init__(self, models: list, optimizers: list) -> None:
            self._models, self._optimizers = models, optimizers

    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    accelerator = Accelerator([model, other], ["opt"])
    with sharding.accelerate_state_without(accelerator, model):
        assert accelerator._models == [other] and accelerator._optimizers == []
    assert accelerator._models == [model, other] and accelerator._optimizers == ["opt"]
    with pytest.raises(KeyError):
        with sharding.accelerate_state_without(accelerator, model):
            raise KeyError("stop")
    assert accelerator._models == [model, other] and accelerator._optimizers == ["opt"]


def test_the_whole_encoder_is_the_recipes_with_the_full_tensors_and_leaves_the_rng_alone():
    config = TrainConfig(cpu=True, adapters={"a": {"type": "mlp", "input_dim": 5, "hidden_dim": 8, "embed_dim": 4}})
    from mmviews.run import build_encoder

    torch.manual_seed(3)
    state = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in build_encoder(config).state_dict().items()}
    torch.manual_seed(4)
    expected_next = torch.rand(3)
    torch.manual_seed(4)
    encoder = sharding.whole_encoder(config, state)
    assert torch.equal(torch.rand(3), expected_next)  # building the encoder drew nothing from the training stream
    assert all(torch.equal(encoder.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(RuntimeError):
        sharding.whole_encoder(config, {k: v for k, v in list(state.items())[1:]})
    bad = TrainConfig(cpu=True, adapters={"a": {"type": "no_such_adapter"}})
    with pytest.raises(ConfigError, match=r"^recipe: keys 'adapters'/'encoder': "):
        sharding.whole_encoder(bad, {})


def _sharded_with_objective(lr: float, objective_lr: float):
    """A sharded encoder and siglip's learned scale and bias in the optimiser's last group, the
    ``objective`` group prepare_run adds (its own lr, no weight decay)."""
    from mmviews.objectives import get_objective

    model = sharding.shard_encoder(_encoder(), _config(), torch.device("cpu"), 1)
    objective = get_objective("siglip", temperature=0.1, bias=-10.0)
    optimiser = torch.optim.AdamW([{"params": list(model.parameters()), "lr": lr, "weight_decay": 0.1},
                                   {"name": sharding.OBJECTIVE_GROUP, "params": objective.trained_parameters(),
                                    "lr": objective_lr, "weight_decay": 0.0}])
    return model, objective, optimiser


def _adamw_step(model, objective, optimiser, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = {"a": {"values": torch.randn(4, 1, 5, generator=generator)},
              "b": {"values": torch.randn(4, 1, 3, generator=generator)}}
    scale, bias = objective.trained_parameters()
    torch.manual_seed(seed)  # the same dropout masks in both runs
    loss = sum(model.adapters[m](inputs[m]).sum() for m in ("a", "b")) * scale.float() + 3 * bias.float()
    loss.backward()
    optimiser.step()
    optimiser.zero_grad(set_to_none=True)


def test_the_objectives_learned_parameters_state_is_saved_and_resumed_with_the_sharded_one(group_of_one):
    """A sharded run whose optimiser also trains siglip's scale and bias (replicated, outside the
    sharded encoder): the full state holds their AdamW state as ``objective.0``/``objective.1``
    and their group (lr, no weight decay), the optimiser is left as it was, the names round-trip
    through the unsharded numbering, and a fresh run loaded from it takes the same next step as
    the run that saved it (encoder, scale and bias alike)."""
    model, objective, optimiser = _sharded_with_objective(0.01, 0.3)
    groups_before = [g for g in optimiser.param_groups]
    _adamw_step(model, objective, optimiser, 0)
    scale, bias = objective.trained_parameters()
    full = sharding.full_optimizer_state(model, optimiser)
    assert [g for g in optimiser.param_groups] == groups_before  # the same group objects, in order
    assert scale in optimiser.state and bias in optimiser.state
    (group,) = [g for g in full["param_groups"] if g.get("name") == sharding.OBJECTIVE_GROUP]
    assert group["params"] == ["objective.0", "objective.1"] and full["param_groups"][-1] is group
    assert group["lr"] == 0.3 and group["weight_decay"] == 0.0
    assert [g["lr"] for g in full["param_groups"]] == [0.01, 0.3]
    for name, q in (("objective.0", scale), ("objective.1", bias)):
        saved = full["state"][name]
        assert sorted(saved) == sorted(optimiser.state[q])
        for key, value in optimiser.state[q].items():
            assert saved[key].device.type == "cpu" and saved[key] is not value
            torch.testing.assert_close(saved[key], value, rtol=0, atol=0)
    n_module = len(list(model.parameters()))
    assert len(full["state"]) == n_module + 2

    by_index = sharding.optimizer_state_by_index(full)
    assert by_index["param_groups"][-1]["params"] == [n_module, n_module + 1]
    back = sharding.optimizer_state_by_name(by_index, model, optimiser)
    assert back["param_groups"][-1]["params"] == ["objective.0", "objective.1"]
    assert sorted(back["state"]) == sorted(full["state"])

    other_model, other_objective, fresh = _sharded_with_objective(0.5, 0.9)
    with torch.no_grad():  # the saved run's weights (the model state travels separately)
        for q, saved in zip([*other_model.parameters(), *other_objective.trained_parameters()],
                            [*model.parameters(), *objective.trained_parameters()]):
            q.copy_(saved)
    other_groups = [g for g in fresh.param_groups]
    # through a file, as a checkpoint: on CPU the encoder's full state shares the live moments' storage
    buffer = io.BytesIO()
    torch.save(full, buffer)
    buffer.seek(0)
    sharding.load_full_optimizer_state(other_model, fresh, torch.load(buffer, weights_only=True))
    assert [g for g in fresh.param_groups][-1] is other_groups[-1]
    assert [g["lr"] for g in fresh.param_groups] == [0.01, 0.3]
    assert fresh.param_groups[-1]["weight_decay"] == 0.0 and fresh.param_groups[0]["weight_decay"] == 0.1
    for q, saved_q in zip(other_objective.trained_parameters(), objective.trained_parameters()):
        for key, value in optimiser.state[saved_q].items():
            loaded = fresh.state[q][key]
            torch.testing.assert_close(loaded, value, rtol=0, atol=0)
            if key != "step":  # moments on the parameter's device and dtype; torch keeps "step" as it was
                assert loaded.dtype == q.dtype and loaded.device == q.device
    _adamw_step(model, objective, optimiser, 1)
    _adamw_step(other_model, other_objective, fresh, 1)
    for a, b in zip([*model.parameters(), *objective.trained_parameters()],
                    [*other_model.parameters(), *other_objective.trained_parameters()]):
        torch.testing.assert_close(b.full_tensor() if hasattr(b, "full_tensor") else b,
                                   a.full_tensor() if hasattr(a, "full_tensor") else a, rtol=0, atol=0)


def test_an_objective_group_without_state_yet_saves_and_loads_its_group_only(group_of_one):
    """Before the first step the objective's parameters have no optimiser state: the full state
    holds their group and no entry for them, and loading it gives them none (and no error)."""
    model, objective, optimiser = _sharded_with_objective(0.01, 0.3)
    full = sharding.full_optimizer_state(model, optimiser)
    assert not any(k.startswith("objective.") for k in full["state"])
    assert full["param_groups"][-1]["params"] == ["objective.0", "objective.1"]
    other_model, other_objective, fresh = _sharded_with_objective(0.5, 0.9)
    sharding.load_full_optimizer_state(other_model, fresh, full)
    assert all(q not in fresh.state for q in other_objective.trained_parameters())
    assert [g["lr"] for g in fresh.param_groups] == [0.01, 0.3]
