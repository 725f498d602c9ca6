"""The vectorised objectives against the slow loop references of :mod:`mmviews.objectives.reference`.

Values and gradients in float64 on random inputs (several K, M, d, temperatures), with and
without view masks; the M = 2 reductions to SimCLR; invariance to permuting samples and
views; consistency of masks with dropping samples/views; ``gradcheck``; ``mi_lower_bound``.
The references are written from the equations and share no code with the implementations.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmviews.objectives import get_objective, mi_lower_bound
from mmviews.objectives.reference import MASKED, REFERENCES, mi_lower_bound_reference

ALL = tuple(REFERENCES)
POLY_M2 = ("geometric_pvc", "arithmetic_pvc", "sufficient_statistics", "multi_crop", "avg")

# (K, M, d, temperature): K in 2..9, M in 2..5, d in 1..16, temperature in 0.05..1.0
CONFIGS = [
    (2, 2, 1, 1.0),
    (3, 3, 4, 0.5),
    (5, 4, 8, 0.1),
    (9, 5, 16, 0.05),
    (4, 5, 3, 0.2),
    (2, 4, 2, 0.3),
    (6, 3, 1, 0.07),
    (7, 2, 16, 0.05),
]
SIMCLR_CONFIGS = [(2, 2, 1, 1.0), (3, 2, 4, 0.5), (7, 2, 16, 0.05), (9, 2, 8, 0.1), (5, 2, 1, 0.2)]

# float64 tolerances. Values agree to ~1e-15 except where the implementation uses
# F.softplus, whose linear branch above 20 drops exp(-20) ~ 2e-9 per term.
VALUE_TOL = dict(rtol=1e-9, atol=1e-9)
GRAD_TOL = dict(rtol=1e-8, atol=1e-9)


def _z(K: int, M: int, d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, M, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)


def _random_mask(K: int, M: int, seed: int) -> torch.Tensor:
    """A mask with a sample with no present view, one with a single present view, and
    random others. Every view is present in 0 or >= 2 samples, so that every within-view
    negative set of mv_dhel/mv_cl2 is non-empty (the empty case is tested separately),
    and at least one sample has >= 2 present views."""
    g = torch.Generator().manual_seed(seed)
    while True:
        mask = torch.rand(K, M, generator=g) < 0.65
        mask[0] = False
        mask[1] = False
        mask[1, int(torch.randint(M, (1,), generator=g))] = True
        per_view = mask.sum(0)
        if ((per_view == 0) | (per_view >= 2)).all() and (mask.sum(1) >= 2).sum() >= 2:
            perm = torch.randperm(K, generator=g)  # the special samples anywhere in the batch
            return mask[perm]


def _value_and_grad(fn, z: torch.Tensor):
    loss = fn(z)
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad


def _safe_d(name: str, M: int, d: int) -> int:
    """d = 1 makes u = +-1, so sufficient_statistics' mean of the other views can be exactly
    0 and normalise(0) is undefined: use d = 2 there (a zero mean then has probability 0)."""
    return 2 if name == "sufficient_statistics" and M > 2 and d == 1 else d


def _configs(name: str):
    return SIMCLR_CONFIGS if name == "simclr" else CONFIGS


def _cases():
    for name in ALL:
        for index, config in enumerate(_configs(name)):
            config = (config[0], config[1], _safe_d(name, config[1], config[2]), config[3])
            yield pytest.param(name, *config, index, id=f"{name}-K{config[0]}M{config[1]}d{config[2]}t{config[3]}")


@pytest.mark.parametrize("name,K,M,d,temperature,seed", list(_cases()))
def test_value_and_gradient_match_reference(name, K, M, d, temperature, seed):
    z = _z(K, M, d, seed=100 + seed)
    objective = get_objective(name, temperature=temperature)
    loss, grad = _value_and_grad(objective, z)
    ref_loss, ref_grad = _value_and_grad(lambda x: REFERENCES[name](x, temperature), z)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, **VALUE_TOL)
    torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)


@pytest.mark.parametrize("name", ALL)
def test_float32_matches_float64_reference_at_low_temperature(name):
    """float32 inputs at temperature 0.05, with positives close together (small losses
    where cancellation would show): the float32 result stays close to the float64 reference."""
    M = 2 if name == "simclr" else 4
    z64 = _z(8, M, 16, seed=7).detach()
    z64 = (z64[:, :1] + 0.1 * z64).requires_grad_(True)
    z32 = z64.detach().float().requires_grad_(True)
    loss, grad = _value_and_grad(get_objective(name, temperature=0.05), z32)
    ref_loss, ref_grad = _value_and_grad(lambda x: REFERENCES[name](x, 0.05), z64)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", MASKED)
@pytest.mark.parametrize("K,M,d,temperature,seed", [(5, 3, 4, 0.5, 0), (7, 4, 8, 0.1, 1), (9, 5, 16, 0.05, 2), (6, 5, 1, 1.0, 3), (4, 2, 3, 0.2, 4)])
def test_masked_value_and_gradient_match_reference(name, K, M, d, temperature, seed):
    d = _safe_d(name, M, d)
    z = _z(K, M, d, seed=200 + seed)
    mask = _random_mask(K, M, seed=300 + seed)
    assert (mask.sum(1) == 0).any() and (mask.sum(1) == 1).any()
    objective = get_objective(name, temperature=temperature)
    loss, grad = _value_and_grad(lambda x: objective(x, mask), z)
    ref_loss, ref_grad = _value_and_grad(lambda x: REFERENCES[name](x, temperature, mask), z)
    torch.testing.assert_close(loss, ref_loss, **VALUE_TOL)
    torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)
    # absent views receive no gradient
    assert torch.all(grad[~mask] == 0)


@pytest.mark.parametrize("name", MASKED)
def test_all_true_mask_equals_no_mask(name):
    z = _z(6, 4, 5, seed=11)
    objective = get_objective(name, temperature=0.2)
    loss, grad = _value_and_grad(objective, z)
    mask = torch.ones(6, 4, dtype=torch.bool)
    masked_loss, masked_grad = _value_and_grad(lambda x: objective(x, mask), z)
    torch.testing.assert_close(masked_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(masked_grad, grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", MASKED)
def test_mask_equals_dropping_absent_samples_and_views(name):
    """A view absent from every sample is the same as a batch without that view; a sample
    with no present view is the same as a batch without that sample."""
    z = _z(7, 4, 6, seed=12)
    objective = get_objective(name, temperature=0.25)
    mask = torch.ones(7, 4, dtype=torch.bool)
    mask[:, 2] = False
    mask[3] = False
    keep_samples = [0, 1, 2, 4, 5, 6]
    keep_views = [0, 1, 3]
    masked = objective(z, mask)
    smaller = objective(z[keep_samples][:, keep_views])
    torch.testing.assert_close(masked, smaller, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", POLY_M2)
@pytest.mark.parametrize("K,d,temperature", [(2, 1, 1.0), (5, 8, 0.1), (9, 16, 0.05), (4, 3, 0.5)])
def test_m2_reduces_to_simclr(name, K, d, temperature):
    z = _z(K, 2, d, seed=K * 31 + d)
    loss, grad = _value_and_grad(get_objective(name, temperature=temperature), z)
    simclr_loss, simclr_grad = _value_and_grad(get_objective("simclr", temperature=temperature), z)
    torch.testing.assert_close(loss, simclr_loss, **VALUE_TOL)
    torch.testing.assert_close(grad, simclr_grad, **GRAD_TOL)


@pytest.mark.parametrize("name", ALL)
def test_invariant_to_permuting_samples_and_views(name):
    K, M = (6, 2) if name == "simclr" else (6, 4)
    z = _z(K, M, 5, seed=13).detach()
    objective = get_objective(name, temperature=0.15)
    loss = objective(z)
    sample_perm = torch.randperm(K, generator=torch.Generator().manual_seed(0))
    view_perm = torch.arange(M).flip(0)
    torch.testing.assert_close(objective(z[sample_perm]), loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(objective(z[:, view_perm]), loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(objective(z[sample_perm][:, view_perm]), loss, rtol=1e-12, atol=1e-12)
    # and the value does depend on which views belong together
    mixed = z.clone()
    mixed[:, 0] = z[:, 0].roll(1, dims=0)
    assert not torch.allclose(objective(mixed), loss)


@pytest.mark.parametrize("name", MASKED)
def test_masked_invariant_to_permuting_samples_and_views(name):
    K, M = 7, 4
    z = _z(K, M, 5, seed=14).detach()
    mask = _random_mask(K, M, seed=15)
    objective = get_objective(name, temperature=0.15)
    loss = objective(z, mask)
    sample_perm = torch.randperm(K, generator=torch.Generator().manual_seed(1))
    view_perm = torch.tensor([2, 0, 3, 1])
    permuted = objective(z[sample_perm][:, view_perm], mask[sample_perm][:, view_perm])
    torch.testing.assert_close(permuted, loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_gradcheck(name):
    M = 2 if name == "simclr" else 3
    z = _z(3, M, 4, seed=16)
    objective = get_objective(name, temperature=0.5)
    assert torch.autograd.gradcheck(lambda x: objective(x), (z,), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", MASKED)
def test_gradcheck_masked(name):
    mask = torch.tensor([[True, True, False], [True, False, True], [True, True, True], [False, True, False], [False, False, False]])
    z = _z(5, 3, 3, seed=17)
    objective = get_objective(name, temperature=0.5)
    assert torch.autograd.gradcheck(lambda x: objective(x, mask), (z,), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["mv_dhel", "mv_cl2"])
def test_view_present_in_a_single_sample(name):
    """View 2 is present only in sample 0: its within-view uniformity LSE_{j != 0} has no
    candidate. The loss must stay finite; the reference skips the empty term (proposed
    convention: an empty candidate set adds no term, as an empty negative set adds 0 to a
    cross-entropy elsewhere)."""
    z = _z(4, 3, 5, seed=18)
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[1:, 2] = False
    objective = get_objective(name, temperature=0.1)
    loss, grad = _value_and_grad(lambda x: objective(x, mask), z)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    ref_loss, ref_grad = _value_and_grad(lambda x: REFERENCES[name](x, 0.1, mask, skip_empty=True), z)
    torch.testing.assert_close(loss, ref_loss, **VALUE_TOL)
    torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)


def test_mi_lower_bound_formula():
    for K, M, loss in [(2, 2, 0.3), (256, 8, 5.1), (7, 3, 0.0)]:
        expected = mi_lower_bound_reference(loss, K, M)
        assert math.isclose(float(mi_lower_bound(loss, K, M)), expected, rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(expected, math.log(K * M - M + 1) - loss)
    # a tensor loss stays differentiable: d(bound)/d(loss) = -1
    loss = torch.tensor(1.25, dtype=torch.float64, requires_grad=True)
    bound = mi_lower_bound(loss, 16, 4)
    assert isinstance(bound, torch.Tensor)
    torch.testing.assert_close(bound.detach(), torch.tensor(math.log(61) - 1.25, dtype=torch.float64))
    (grad,) = torch.autograd.grad(bound, loss)
    assert float(grad) == -1.0
    # geometric PVC loss is a non-negative mean of cross-entropies: the bound never exceeds c(B, M)
    z = _z(8, 4, 6, seed=19).detach()
    pvc = get_objective("geometric_pvc", temperature=0.1)(z)
    assert float(mi_lower_bound(pvc, 8, 4)) <= math.log(8 * 4 - 4 + 1)
