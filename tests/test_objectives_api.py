"""The objectives' API contract: registry, errors on bad input, dtypes under autocast,
finiteness at low temperature and at collapse, metrics, nn.Module behaviour."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

from mmviews.objectives import get_objective, list_objectives, mi_lower_bound
from mmviews.objectives.reference import MASKED, REFERENCES

TEN = (
    "simclr",
    "multi_crop",
    "avg",
    "geometric_pvc",
    "arithmetic_pvc",
    "sufficient_statistics",
    "mv_infonce",
    "mv_dhel",
    "mv_cl1",
    "mv_cl2",
)
# Constructor arguments for listed objectives that need some (objectives added later).
BUILD_PARAMS = {"fmicl": {"divergence": "kl"}}


def _views(name: str) -> int:
    return 2 if name == "simclr" else 4


def _z(K: int, M: int, d: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, M, d, generator=g).to(dtype)


# ---- registry --------------------------------------------------------------------------


def test_list_objectives_has_the_ten_and_each_listed_name_builds():
    names = list_objectives()
    assert all(isinstance(n, str) for n in names)
    assert len(names) == len(set(names))
    missing = set(TEN) - set(names)
    assert not missing, f"missing objectives: {sorted(missing)}"
    for name in names:
        objective = get_objective(name, **BUILD_PARAMS.get(name, {}))
        assert isinstance(objective, nn.Module), name


@pytest.mark.parametrize("name", TEN)
def test_get_objective_builds_a_module_and_uses_its_temperature(name):
    z = _z(5, _views(name), 6, dtype=torch.float64)
    for temperature in (0.07, 0.5):
        objective = get_objective(name, temperature=temperature)
        assert isinstance(objective, nn.Module)
        loss = objective(z)
        assert loss.dim() == 0
        torch.testing.assert_close(loss, REFERENCES[name](z, temperature), rtol=1e-9, atol=1e-9)


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        get_objective("geometric_pcv")
    message = str(info.value)
    assert "geometric_pcv" in message
    for name in TEN:
        assert name in message


def test_unknown_parameter_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="temprature"):
        get_objective("mv_dhel", temprature=0.1)
    # the constructor's "got an unexpected keyword argument" said neither what is wrong nor the fix
    with pytest.raises(ValueError) as info:
        get_objective("mv_dhel", temp=0.2)
    assert str(info.value) == ("objective 'mv_dhel': unknown parameter 'temp' (did you mean 'temperature'?); accepted "
                               "parameters: ['temperature', 'chunk_size', 'score_budget_mb', 'learn_temperature']")
    with pytest.raises(ValueError, match=r"^objective 'mv_dhel': unknown parameter 'zzz'; accepted parameters: \["):
        get_objective("mv_dhel", temperature=0.2, zzz=1)


@pytest.mark.parametrize("word,hint", [
    ("tem", " (did you mean 'temperature'?)"),  # three letters that start one parameter: taken as its abbreviation
    ("te", ""),  # two letters are too few to be read as an abbreviation (or a spelling of anything)
    ("temprature", " (did you mean 'temperature'?)"),  # no parameter starts so: the closest spelling
    ("chunk", " (did you mean 'chunk_size'?)"),
])
def test_an_unknown_parameter_gets_the_abbreviated_or_the_closest_parameter_as_hint(word, hint):
    with pytest.raises(ValueError) as info:
        get_objective("mv_dhel", **{word: 0.2})
    assert str(info.value) == (f"objective 'mv_dhel': unknown parameter {word!r}{hint}; accepted parameters: "
                               "['temperature', 'chunk_size', 'score_budget_mb', 'learn_temperature']")


def test_a_value_the_constructor_refuses_with_a_type_error_names_the_objective():
    # `objective.params: {beta: null}` in a recipe reaches float(None) in the constructor
    with pytest.raises(ValueError) as info:
        get_objective("ipmc", beta=None)
    assert str(info.value).startswith("objective 'ipmc': float() argument must be a string or a real number, not "
                                      "'NoneType'; accepted parameters: ['gamma', 'delta', 'beta',")


@pytest.mark.parametrize("value,shown", [("x", "'x'"), (None, "None"), ("0.1x", "'0.1x'"), (-1, "-1.0"), (0, "0.0"),
                                         (float("inf"), "inf"), (float("nan"), "nan"), ("1e999", "inf")])
def test_a_temperature_that_is_no_positive_number_is_named_with_the_objective(value, shown):
    # a string or null from a recipe gets the sentence a number out of range gets, not float()'s own
    with pytest.raises(ValueError) as info:
        get_objective("mv_dhel", temperature=value)
    assert str(info.value) == f"objective 'mv_dhel': temperature must be a finite number > 0, got {shown}"


@pytest.mark.parametrize("name,params,message", [
    ("fmicl", {"divergence": "zz"}, "fmicl: unknown divergence 'zz'; known: "),
    ("geometric_pvc", {"critic": "zz"}, "objective 'geometric_pvc': critic must be one of "),
])
def test_an_error_that_names_its_objective_is_not_prefixed_twice(name, params, message):
    with pytest.raises(ValueError) as info:
        get_objective(name, **params)
    assert str(info.value).startswith(message) and str(info.value).count(name) == message.count(name)


def test_an_objective_that_takes_keyword_options_gets_every_parameter(monkeypatch):
    """A user's objective with ``**options`` decides itself which parameters it takes."""
    from mmviews.objectives._base import _CLASSES, MultiViewObjective

    class WithOptions(MultiViewObjective):
        def __init__(self, temperature: float = 0.1, **options) -> None:
            super().__init__()
            self.temperature, self.options = temperature, options

        def loss(self, views):  # pragma: no cover - never called
            raise AssertionError

    monkeypatch.setitem(_CLASSES._entries, "api_test_options", (WithOptions, "a user's objective"))
    objective = get_objective("api_test_options", temperature=0.3, margin=2.0)
    assert isinstance(objective, WithOptions) and objective.temperature == 0.3 and objective.options == {"margin": 2.0}


def test_unknown_parameter_through_the_recipe_names_the_set(capsys):
    from crafted_files import cli, one_line_error

    rc, _, err = cli(capsys, "train", "quickstart", "--check", "--set", "objective.params={temp: 0.2}")
    assert rc == 2 and one_line_error(err) == (
        "mmviews train: error: --set 'objective.params={temp: 0.2}': key 'objective.params': objective 'mv_dhel': "
        "unknown parameter 'temp' (did you mean 'temperature'?); accepted parameters: ['temperature', 'chunk_size', "
        "'score_budget_mb', 'learn_temperature']")


# ---- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("name", TEN)
def test_bad_shapes(name):
    objective = get_objective(name)
    with pytest.raises(ValueError, match=re.escape("(4, 8)")):
        objective(torch.randn(4, 8))
    with pytest.raises(ValueError, match=re.escape("(4, 2, 2, 8)")):
        objective(torch.randn(4, 2, 2, 8))
    with pytest.raises(ValueError, match=r"M = 1"):
        objective(torch.randn(4, 1, 8))
    with pytest.raises(ValueError, match=r"K = 1"):
        objective(torch.randn(1, _views(name), 8))


def test_simclr_needs_exactly_two_views():
    with pytest.raises(ValueError, match=r"exactly 2 views.*M = 3"):
        get_objective("simclr")(torch.randn(4, 3, 8))


@pytest.mark.parametrize("name", TEN)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(name, bad):
    z = torch.randn(4, _views(name), 8)
    z[2, 1, 3] = bad
    with pytest.raises(ValueError, match=r"non-finite.*\(2, 1, 3\)"):
        get_objective(name)(z)


@pytest.mark.parametrize("name", TEN)
@pytest.mark.parametrize("temperature", [0.0, -0.1, float("nan")])
def test_bad_temperature(name, temperature):
    with pytest.raises(ValueError, match=r"temperature.*" + re.escape(str(temperature))):
        get_objective(name, temperature=temperature)


@pytest.mark.parametrize("name", MASKED)
def test_mask_of_wrong_shape(name):
    objective = get_objective(name)
    z = torch.randn(4, 3, 8)
    with pytest.raises(ValueError, match=r"mask.*\(4, 3\).*\(4, 2\)"):
        objective(z, torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask.*\(4,\)"):
        objective(z, torch.ones(4, dtype=torch.bool))


def test_mask_given_to_avg():
    with pytest.raises(ValueError, match=r"avg.*mask"):
        get_objective("avg")(torch.randn(4, 3, 8), torch.ones(4, 3, dtype=torch.bool))


def test_mi_lower_bound_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"K = 1"):
        mi_lower_bound(1.0, 1, 3)
    with pytest.raises(ValueError, match=r"M = 1"):
        mi_lower_bound(1.0, 4, 1)


# ---- dtypes and numerics ---------------------------------------------------------------


@pytest.mark.parametrize("name", TEN)
def test_dtypes(name):
    objective = get_objective(name, temperature=0.2)
    z = _z(5, _views(name), 8, seed=1, dtype=torch.float64)
    assert objective(z).dtype == torch.float64
    assert objective(z.float()).dtype == torch.float32
    for low in (torch.bfloat16, torch.float16):
        zl = z.to(low)
        loss = objective(zl)
        assert loss.dtype == torch.float32
        # computed in float32 from the rounded input
        torch.testing.assert_close(loss.double(), REFERENCES[name](zl.double(), 0.2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", TEN)
def test_bf16_autocast_low_temperature_is_finite_float32(name):
    K, M, d = 10, _views(name), 32
    z = _z(K, M, d, seed=2).bfloat16().requires_grad_(True)
    objective = get_objective(name, temperature=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objective(z)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    torch.testing.assert_close(loss.double(), REFERENCES[name](z.detach().double(), 0.05), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", TEN)
def test_bf16_autocast_encoder_training_step(name):
    """Embeddings produced by a layer under autocast (so bf16): loss float32, finite grads."""
    K, M = 8, _views(name)
    encoder = nn.Linear(12, 16)
    x = _z(K, M, 12, seed=3)
    objective = get_objective(name, temperature=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = encoder(x)
        assert z.dtype == torch.bfloat16
        mask = torch.ones(K, M, dtype=torch.bool)
        mask[0, 1:] = False
        loss = objective(z, mask) if name in MASKED else objective(z)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in encoder.parameters())


@pytest.mark.parametrize("name", TEN)
@pytest.mark.parametrize("autocast", [False, True])
def test_total_collapse_is_finite(name, autocast):
    """Every embedding identical: all scores equal 1/tau (20 at tau 0.05)."""
    K, M, d = 6, _views(name), 8
    z = torch.randn(d, generator=torch.Generator().manual_seed(4)).expand(K, M, d).clone()
    z = (z.bfloat16() if autocast else z).requires_grad_(True)
    objective = get_objective(name, temperature=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = objective(z)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(loss.double(), REFERENCES[name](z.detach().double(), 0.05), rtol=1e-5, atol=1e-5)
    if name == "geometric_pvc":  # every candidate ties: CE = log(1 + (K - 1) M)
        assert math.isclose(float(loss.detach()), math.log(1 + (K - 1) * M), rel_tol=1e-5)


# ---- metrics -----------------------------------------------------------------------------


def _hand_built():
    """K = 2, M = 2, d = 2 with unit vectors u00 = (1, 0), u01 = (1, 1)/sqrt2, u10 = (0, 1),
    u11 = (-1, 0) (given unnormalised). Positive cosines: 1/sqrt2 and 0. Negative cosines
    (sample 0 x sample 1): 0, -1, 1/sqrt2, -1/sqrt2."""
    z = torch.tensor([[[3.0, 0.0], [2.0, 2.0]], [[0.0, 0.5], [-4.0, 0.0]]], dtype=torch.float64)
    pos_sim = (1 / math.sqrt(2) + 0.0) / 2
    neg_sim = (0.0 - 1.0 + 1 / math.sqrt(2) - 1 / math.sqrt(2)) / 4
    return z, pos_sim, neg_sim


@pytest.mark.parametrize("name", TEN)
def test_metrics_on_hand_built_example(name):
    z, pos_sim, neg_sim = _hand_built()
    objective = get_objective(name, temperature=0.5)
    output = objective.compute(z)
    torch.testing.assert_close(output.loss, objective(z))
    for key, expected in (("pos_sim", pos_sim), ("neg_sim", neg_sim)):
        assert key in output.metrics, f"{name} has no {key} metric"
        assert math.isclose(float(output.metrics[key]), expected, abs_tol=1e-12), (key, float(output.metrics[key]), expected)
        assert math.isclose(float(objective.last_metrics[key]), expected, abs_tol=1e-12)
        assert not output.metrics[key].requires_grad


@pytest.mark.parametrize("name", MASKED)
def test_metrics_with_mask(name):
    """Add sample 2 with views u20 = (0, -1) and u21 absent: sample 2 has no positive pair;
    its present view adds the negative cosines 0, -1/sqrt2 (with sample 0) and -1, 0 (sample 1)."""
    z, pos_sim, _ = _hand_built()
    z = torch.cat([z, torch.tensor([[[0.0, -2.0], [5.0, 5.0]]], dtype=torch.float64)])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    neg_sim = ((0.0 - 1.0 + 1 / math.sqrt(2) - 1 / math.sqrt(2)) + (0.0 - 1 / math.sqrt(2)) + (-1.0 + 0.0)) / 8
    metrics = get_objective(name, temperature=0.5).compute(z, mask).metrics
    assert math.isclose(float(metrics["pos_sim"]), pos_sim, abs_tol=1e-12)
    assert math.isclose(float(metrics["neg_sim"]), neg_sim, abs_tol=1e-12)


# ---- nn.Module behaviour -------------------------------------------------------------------


@pytest.mark.parametrize("name", TEN)
def test_objective_is_a_module(name):
    objective = get_objective(name, temperature=0.3)
    assert isinstance(objective, nn.Module)
    z = _z(4, _views(name), 5, seed=5, dtype=torch.float64)
    expected = objective(z)
    assert objective.to(torch.float32) is objective
    assert objective.to("cpu") is objective
    torch.testing.assert_close(objective(z), expected)
    clone = copy.deepcopy(objective)
    torch.testing.assert_close(clone(z), expected)
    objective.load_state_dict(objective.state_dict())
    # usable as a submodule
    holder = nn.ModuleDict({"loss": objective}).to(torch.float64)
    torch.testing.assert_close(holder["loss"](z), expected)
