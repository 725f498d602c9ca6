"""Learned temperatures (``learn_temperature``) of the softmax objectives, and ``siglip``'s
learned scale and bias, against the float64 loop references of :mod:`mmviews.objectives.reference`.

The references take the temperature (and SigLIP's bias) as 0-dim tensors, so that autograd
through the loops gives the reference gradient w.r.t. the temperature; the objective's
parameter is ``logit_scale = log(1 / temperature)``, whose gradient is therefore
``dL/dtau * (-tau)``. Also: the bound at 100, the optimiser-step clamp, the metrics, the
state dict, and the errors for bad values.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmviews.objectives import get_objective, list_objectives, objective_class
from mmviews.objectives._base import MAX_LOGIT_SCALE, ContrastiveObjective
from mmviews.objectives.reference import MASKED, REFERENCES, siglip_reference

SOFTMAX = tuple(name for name in list_objectives() if issubclass(objective_class(name), ContrastiveObjective))
TOLERANCE = dict(rtol=1e-9, atol=1e-10)


def _z(K: int, M: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(K, M, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_(True)


def _mask(K: int, M: int) -> torch.Tensor:
    """Some views absent, a sample with a single present view and one with none; every view
    present in at least two samples (mv_dhel's within-view negatives are then never empty)."""
    mask = torch.ones(K, M, dtype=torch.bool)
    mask[0, 1:] = False
    mask[1] = False
    mask[2, 0] = False
    mask[3, M - 1] = False
    return mask


def _views(name: str, M: int) -> int:
    return objective_class(name).exact_views or M


def test_every_softmax_objective_takes_learn_temperature_and_the_others_refuse_it():
    assert set(SOFTMAX) >= {"simclr", "multi_crop", "avg", "geometric_pvc", "arithmetic_pvc", "sufficient_statistics",
                            "mv_infonce", "mv_dhel", "mv_cl1", "mv_cl2", "siglip"}
    for name in sorted(set(list_objectives()) - set(SOFTMAX)):
        params = {"divergence": "kl"} if name == "fmicl" else {}
        with pytest.raises(ValueError, match="learn_temperature"):
            get_objective(name, learn_temperature=True, **params)


# (name, masked): the masked case for the objectives that take a mask (simclr and avg take none)
MASK_CASES = [(name, masked) for name in SOFTMAX for masked in (False, True) if not masked or name in MASKED]


@pytest.mark.parametrize("name,masked", MASK_CASES)
@pytest.mark.parametrize("M,temperature,chunk_size", [(3, 0.2, None), (4, 0.07, 2)])
def test_learned_temperature_value_and_gradients_match_the_reference(name, masked, M, temperature, chunk_size):
    M = _views(name, M)
    K = 6
    z = _z(K, M, 5, seed=M * 7 + int(masked))
    mask = _mask(K, M) if masked else None
    objective = get_objective(name, temperature=temperature, learn_temperature=True, chunk_size=chunk_size)
    loss = objective(z, mask) if masked else objective(z)
    grad_z, grad_scale = torch.autograd.grad(loss, (z, objective.logit_scale))
    tau = torch.tensor(temperature, dtype=torch.float64, requires_grad=True)
    reference = REFERENCES[name](z, tau, mask) if masked else REFERENCES[name](z, tau)
    ref_z, ref_tau = torch.autograd.grad(reference, (z, tau))
    torch.testing.assert_close(loss, reference, **TOLERANCE)
    torch.testing.assert_close(grad_z, ref_z, **TOLERANCE)
    torch.testing.assert_close(grad_scale, -temperature * ref_tau, **TOLERANCE)
    assert grad_scale != 0
    # the learned temperature starts at the fixed one's value
    fixed = get_objective(name, temperature=temperature, chunk_size=chunk_size, learn_temperature=False)
    assert fixed.logit_scale is None and "logit_scale" not in dict(fixed.named_parameters())
    torch.testing.assert_close((fixed(z, mask) if masked else fixed(z)), loss, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("name", ["geometric_pvc", "mv_dhel", "siglip"])
def test_the_bound_at_100_in_the_loss_and_after_an_optimiser_step(name):
    z = _z(5, 3, 4, seed=1)
    objective = get_objective(name, temperature=0.1, learn_temperature=True)
    with torch.no_grad():
        objective.logit_scale.fill_(math.log(250.0))
    loss = objective(z)
    params = {"learn_bias": False} if name == "siglip" else {}
    at_bound = get_objective(name, temperature=0.01, **params)
    torch.testing.assert_close(loss, at_bound(z), rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, objective.logit_scale)
    assert float(grad) == 0.0  # above the bound the scale does not move the loss
    objective.on_optimizer_step()
    assert float(objective.logit_scale.detach()) == pytest.approx(MAX_LOGIT_SCALE, abs=1e-15)
    assert math.isclose(MAX_LOGIT_SCALE, math.log(100.0))
    # at the bound, the gradient flows again (a clamp that zeroed it would leave it stuck)
    (grad,) = torch.autograd.grad(objective(z), objective.logit_scale)
    assert float(grad) != 0.0
    # below the bound the clamp leaves the value alone
    with torch.no_grad():
        objective.logit_scale.fill_(1.5)
    objective.on_optimizer_step()
    assert float(objective.logit_scale.detach()) == 1.5


def test_metrics_report_the_learned_temperature_only():
    z = _z(6, 3, 4, seed=2).detach()
    learned = get_objective("mv_dhel", temperature=0.25, learn_temperature=True)
    learned(z)
    assert float(learned.last_metrics["temperature"]) == pytest.approx(0.25, rel=1e-14)
    assert not learned.last_metrics["temperature"].requires_grad
    out = learned.compute(z)
    assert float(out.metrics["temperature"]) == pytest.approx(0.25, rel=1e-14)
    fixed = get_objective("mv_dhel", temperature=0.25)
    fixed(z)
    assert "temperature" not in fixed.last_metrics
    siglip = get_objective("siglip")
    siglip(z)
    assert float(siglip.last_metrics["temperature"]) == pytest.approx(0.1, rel=1e-14)
    assert float(siglip.last_metrics["bias"]) == -10.0


def test_state_dict_holds_the_learned_parameters_and_loads_back():
    objective = get_objective("geometric_pvc", temperature=0.07, learn_temperature=True)
    with torch.no_grad():
        objective.logit_scale.add_(0.123)
    state = objective.state_dict()
    assert set(state) == {"logit_scale"} and state["logit_scale"].dtype == torch.float64
    other = get_objective("geometric_pvc", temperature=0.5, learn_temperature=True)
    other.load_state_dict(state)
    assert float(other.logit_scale.detach()) == float(objective.logit_scale.detach())
    siglip = get_objective("siglip")
    assert set(siglip.state_dict()) == {"logit_scale", "logit_bias"}
    assert [n for n, _ in get_objective("siglip", learn_temperature=False, learn_bias=False).named_parameters()] == []
    assert get_objective("geometric_pvc").state_dict() == {}


def test_set_temperature_starts_the_learned_or_fixed_value():
    objective = get_objective("mv_cl1", temperature=0.1, learn_temperature=True)
    objective.set_temperature(1 / 42.0)
    assert float(objective.logit_scale.detach()) == pytest.approx(math.log(42.0), rel=1e-15)
    fixed = get_objective("mv_cl1", temperature=0.1)
    fixed.set_temperature(0.3)
    assert fixed.temperature == 0.3
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fixed.set_temperature(0.0)
    siglip = get_objective("siglip")
    siglip.set_bias(-3.5)
    assert float(siglip.logit_bias.detach()) == -3.5


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_learn_flags_must_be_booleans(bad):
    with pytest.raises(ValueError, match=r"learn_temperature must be true or false, got"):
        get_objective("geometric_pvc", learn_temperature=bad)
    with pytest.raises(ValueError, match=r"'siglip': learn_bias must be true or false, got"):
        get_objective("siglip", learn_bias=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "-10", True])
def test_siglip_bias_must_be_a_finite_number(bad):
    with pytest.raises(ValueError, match=r"'siglip': bias must be a finite number, got"):
        get_objective("siglip", bias=bad)


# ---- siglip's scale and bias against the loop reference ------------------------------------


@pytest.mark.parametrize("K,M,d,temperature,bias", [(4, 3, 5, 0.1, -10.0), (6, 4, 3, 0.3, -2.0), (5, 4, 8, 0.05, 1.0)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_siglip_scale_and_bias_gradients_match_the_reference(K, M, d, temperature, bias, masked, chunk_size):
    z = _z(K, M, d, seed=K * M + d)
    mask = _mask(K, M) if masked else None
    objective = get_objective("siglip", temperature=temperature, bias=bias, chunk_size=chunk_size)
    loss = objective(z, mask)
    grads = torch.autograd.grad(loss, (z, objective.logit_scale, objective.logit_bias))
    tau = torch.tensor(temperature, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    reference = siglip_reference(z, tau, mask, b)
    ref_z, ref_tau, ref_b = torch.autograd.grad(reference, (z, tau, b))
    torch.testing.assert_close(loss, reference, **TOLERANCE)
    torch.testing.assert_close(grads[0], ref_z, **TOLERANCE)
    torch.testing.assert_close(grads[1], -temperature * ref_tau, **TOLERANCE)
    torch.testing.assert_close(grads[2], ref_b, **TOLERANCE)
    if masked:
        assert torch.all(grads[0][~mask] == 0)


def test_siglip_counts_a_single_view_sample_as_negatives_only():
    """A sample with one present view has no positive pair but its view is every other
    sample's negative: dropping it changes the loss (unlike the softmax objectives' anchors)."""
    z = _z(5, 3, 4, seed=9).detach()
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[2, 1:] = False
    objective = get_objective("siglip", temperature=0.2, bias=-1.0)
    with_single = objective(z, mask)
    without = objective(z[[0, 1, 3, 4]])
    assert not torch.allclose(with_single, without)
    torch.testing.assert_close(with_single, siglip_reference(z, 0.2, mask, -1.0), **TOLERANCE)


def test_siglip_without_any_positive_pair_is_a_finite_zero_gradient_loss():
    z = _z(4, 3, 4, seed=10)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[:, 0] = True  # one view per sample, and all the same view index: nothing is scored
    objective = get_objective("siglip")
    loss = objective(z, mask)
    (grad,) = torch.autograd.grad(loss, z)
    assert float(loss.detach()) == 0.0 and torch.all(grad == 0)
    # views of different indices but one per sample: negatives only, their sum undivided
    views = torch.tensor([0, 1, 2, 0])
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[torch.arange(4), views] = True
    loss = objective(z, mask)
    u = torch.nn.functional.normalize(z.detach(), dim=-1)
    expected = sum(torch.nn.functional.softplus(10.0 * (u[i, views[i]] @ u[j, views[j]]) - 10.0)
                   for i in range(4) for j in range(4) if i != j and views[i] != views[j])
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-12)


def test_siglip_float32_scores_under_bf16_autocast():
    z = _z(8, 3, 16, seed=11).detach()
    objective = get_objective("siglip")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objective(z.float())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), siglip_reference(z, 0.1), rtol=1e-5, atol=1e-5)


def test_learned_values_and_repr_name_what_is_learned():
    siglip = get_objective("siglip", temperature=0.25, bias=-3.0)
    values = siglip.learned_values()
    assert values == {"temperature": pytest.approx(0.25, rel=1e-14), "logit_scale": pytest.approx(math.log(4.0), rel=1e-14),
                      "bias": -3.0}
    assert repr(siglip) == "SigLIP(temperature=0.25, learn_temperature=True, bias=-3.0)"
    fixed_bias = get_objective("siglip", temperature=0.25, bias=-3.0, learn_bias=False)
    assert set(fixed_bias.learned_values()) == {"temperature", "logit_scale"}
    assert repr(fixed_bias) == "SigLIP(temperature=0.25, learn_temperature=True, bias=-3.0, learn_bias=False)"
    nothing = get_objective("siglip", learn_temperature=False, learn_bias=False)
    assert nothing.learned_values() == {} and nothing.trained_parameters() == []
    assert repr(nothing) == "SigLIP(temperature=0.1, bias=-10.0, learn_bias=False)"
    learned = get_objective("mv_dhel", temperature=0.5, learn_temperature=True)
    with torch.no_grad():
        learned.logit_scale.fill_(10.0)  # above the bound: reported at it, as the loss uses it
    assert learned.learned_values() == {"temperature": pytest.approx(0.01, rel=1e-14), "logit_scale": MAX_LOGIT_SCALE}
    assert learned.trained_parameters() == [learned.logit_scale]
    assert repr(learned) == "MVDHEL(temperature=0.5, learn_temperature=True)"
    assert get_objective("mv_dhel").learned_values() == {} and get_objective("mv_dhel").trained_parameters() == []
    assert get_objective("er").learned_values() == {} and get_objective("er").trained_parameters() == []


def test_trained_parameters_and_the_repr_of_the_streaming_settings():
    siglip = get_objective("siglip")
    assert siglip.trained_parameters() == [siglip.logit_scale, siglip.logit_bias]
    only_bias = get_objective("siglip", learn_temperature=False)
    assert only_bias.trained_parameters() == [only_bias.logit_bias]
    assert repr(get_objective("mv_dhel", chunk_size=3, score_budget_mb=64)) == \
        "MVDHEL(temperature=0.1, chunk_size=3, score_budget_mb=64.0)"
    assert repr(get_objective("mv_dhel", score_budget_mb=64)) == "MVDHEL(temperature=0.1, score_budget_mb=64.0)"
    assert repr(get_objective("mv_dhel", chunk_size=3)) == "MVDHEL(temperature=0.1, chunk_size=3)"


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_pairs_reduce_scores_with_the_temperature_or_the_given_anchors(chunk_size, temperature):
    """ViewSet.pairs_reduce: the all-pairs scores ``<u_ia, u_jb> / temperature`` by default, and
    ``anchors . candidates`` when both are given (siglip's extra bias coordinate), whole or in blocks."""
    from mmviews.objectives._base import ViewSet

    z = _z(5, 3, 4, seed=21).detach()
    u = torch.nn.functional.normalize(z, dim=-1)
    present = torch.ones(5, 3, dtype=torch.bool)
    views = ViewSet(u=u, present=present, U=u, present_all=present, offset=0, world=1, masked=False, chunk_size=chunk_size)

    def per_sample(scores, start, stop):  # [k, M, C, M] -> [k]: a reduction that sees every score
        return (scores * torch.arange(1.0, scores[0].numel() + 1, dtype=scores.dtype).view(scores.shape[1:])).sum((1, 2, 3))

    expected = per_sample(torch.einsum("iad,jbd->iajb", u / temperature, u), 0, 5)
    torch.testing.assert_close(views.pairs_reduce(per_sample, temperature), expected, rtol=1e-12, atol=1e-12)
    if temperature == 1.0:  # the default
        torch.testing.assert_close(views.pairs_reduce(per_sample), expected, rtol=1e-12, atol=1e-12)
    anchors = torch.cat([u / temperature, torch.full((5, 3, 1), -2.0, dtype=u.dtype)], dim=-1)
    candidates = torch.cat([u, torch.ones(5, 3, 1, dtype=u.dtype)], dim=-1)
    shifted = per_sample(torch.einsum("iad,jbd->iajb", u / temperature, u) - 2.0, 0, 5)
    torch.testing.assert_close(views.pairs_reduce(per_sample, anchors=anchors, candidates=candidates), shifted,
                               rtol=1e-12, atol=1e-12)


def test_siglip_streams_in_blocks_sized_by_the_budget(block_spy):
    """Beyond ``score_budget_mb`` the all-pairs block is streamed, in blocks of as many anchor
    samples as fit the budget with the reduction's 4 working copies (float64: 8 bytes a score)."""
    calls = block_spy
    K, M = 11, 3
    per_sample = M * K * M * 4 * 8  # scores of one anchor sample x working copies x bytes
    z = _z(K, M, 4, seed=22)
    objective = get_objective("siglip", score_budget_mb=4 * per_sample / 2**20)
    streamed = objective(z)
    assert calls[:3] == [(0, 4), (4, 8), (8, 11)], calls
    whole = get_objective("siglip", score_budget_mb=math.inf)(z)
    torch.testing.assert_close(streamed, whole, rtol=1e-12, atol=1e-12)


def test_the_default_temperature_is_the_documented_one():
    assert get_objective("mv_dhel").temperature == 0.1  # ContrastiveObjective's (SimCLR's and CMC's)
    assert get_objective("geometric_pvc", learn_temperature=True).learned_values()["temperature"] == pytest.approx(0.1, rel=1e-14)
