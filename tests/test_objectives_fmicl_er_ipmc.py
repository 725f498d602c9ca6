"""f-MICL, Entropy-Reconstruction and IPMC against the slow float64 loop references of
:mod:`mmviews.objectives.reference` (written from the papers' equations and tables, sharing no
code with the objectives), plus their parts: the vMF normaliser, the IPMC memory bank, view
filter and Wasserstein critic, state round trips, numerics and bad inputs.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from mmviews.objectives import get_objective
from mmviews.objectives.er import log_bessel_i, log_vmf_normaliser
from mmviews.objectives.ipmc import ViewFilter
from mmviews.objectives.reference import (
    conjugate_reference as ref_conjugate,
    dot,
    er_reference_terms as ref_er,
    f_prime_reference as ref_f_prime,
    f_star_of_f_prime_reference as ref_f_star_of_f_prime,
    fmicl_reference as ref_fmicl,
    ipmc_reference as ref_ipmc,
    log_vmf_normaliser_reference as ref_log_c,
)

DIVERGENCES = ["kl", "js", "pearson", "sh", "tsallis", "vlc"]
SHAPES = [(3, 2, 4), (4, 3, 5), (5, 4, 3)]  # (K, M, d)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state: its unseeded draws do not depend on
    which tests ran before it (a module-level seed would)."""
    torch.manual_seed(0)


def random_z(K: int, M: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, M, d, generator=g, dtype=torch.float64)


def value_and_grad(fn, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.clone().requires_grad_(True)
    value = fn(z)
    (grad,) = torch.autograd.grad(value, z)
    return value.detach(), grad


def assert_matches(objective_fn, reference_fn, z: torch.Tensor, rtol: float = 1e-9, atol: float = 1e-10) -> None:
    value, grad = value_and_grad(objective_fn, z)
    ref_value, ref_grad = value_and_grad(reference_fn, z)
    torch.testing.assert_close(value, ref_value, rtol=rtol, atol=atol)
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------
# f-MICL: Table 1 of Lu et al., extended to M views
# --------------------------------------------------------------------------------------------
def test_fmicl_table_composition_is_the_conjugate_of_the_derivative():
    # independent check of the reference's own table: f*(f'(G)) == the composition column
    for divergence in DIVERGENCES:
        for G in torch.linspace(0.05, 1.0, 7, dtype=torch.float64):
            s = ref_f_prime(divergence, G, 3.0)
            torch.testing.assert_close(ref_conjugate(divergence, s, 3.0), ref_f_star_of_f_prime(divergence, G, 3.0))
    G = torch.tensor(1.0, dtype=torch.float64)  # the printed VLC entry 3 - 4/(u+1) fails: f*(f'(1)) = f*(0) = 0
    assert float(ref_conjugate("vlc", ref_f_prime("vlc", G, 3.0), 3.0)) == 0.0 and float(3 - 4 / (G + 1)) == 1.0


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fmicl_gaussian_matches_reference(divergence, shape):
    z = random_z(*shape, seed=100 * DIVERGENCES.index(divergence) + SHAPES.index(shape))  # fixed per case
    for params in ({}, {"sigma": 0.5, "mu": 0.8, "alpha": 3.0}):
        objective = get_objective("fmicl", divergence=divergence, **params)
        assert_matches(objective, lambda x: ref_fmicl(x, divergence, **params), z)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_fmicl_cosine_matches_reference(divergence):
    # js needs temperature > 1/log 2, sh and vlc > 1: cover both sides of the piecewise branches
    temperatures = {"js": [1.5, 3.0], "sh": [1.2, 2.5], "vlc": [0.26, 1.1]}.get(divergence, [0.1, 0.5])
    for shape, temperature in zip(SHAPES[:2], temperatures):
        if divergence == "vlc" and temperature < 1:
            with pytest.raises(ValueError, match="temperature"):
                get_objective("fmicl", divergence=divergence, similarity="cosine", temperature=temperature)
            continue
        z = random_z(*shape, seed=7)
        params = dict(similarity="cosine", temperature=temperature, alpha=2.0)
        objective = get_objective("fmicl", divergence=divergence, **params)
        assert_matches(objective, lambda x: ref_fmicl(x, divergence, **params), z)


def test_fmicl_default_is_the_measured_best_divergence():
    # Gaussian Pearson trained best in recipes/reproduce/fmicl_similarity.py; the paper's KL is a parameter away
    z = random_z(4, 3, 5, seed=4)
    default = get_objective("fmicl")
    assert (default.divergence, default.similarity, default.alpha, default.sigma, default.mu) == ("pearson", "gaussian", 40.0, 0.7071, 1.0)
    assert_matches(default, lambda x: ref_fmicl(x, "pearson"), z)
    assert abs(float(default(z)) - float(get_objective("fmicl", divergence="kl")(z))) > 1e-3


def test_fmicl_tsallis_order_and_mask():
    z = random_z(4, 3, 5, seed=3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    for params in ({"divergence": "tsallis", "q": 1.5}, {"divergence": "js"}, {"divergence": "pearson", "similarity": "cosine", "temperature": 0.3}):
        objective = get_objective("fmicl", **params)
        assert_matches(lambda x: objective(x, mask), lambda x: ref_fmicl(x, mask=mask, **params), z)
        # equal up to summation order (the unmasked path skips building the [K, M, K, M] mask)
        torch.testing.assert_close(objective(z, torch.ones(4, 3, dtype=torch.bool)), objective(z), rtol=1e-13, atol=1e-13)


def test_fmicl_metrics():
    z = random_z(4, 3, 5)
    objective = get_objective("fmicl", divergence="kl", alpha=2.0)
    output = objective.compute(z)
    m = output.metrics
    torch.testing.assert_close(output.loss, -(m["positive_term"] - 2.0 * m["negative_term"]))
    torch.testing.assert_close(m["fmi_bound"], m["positive_term"] - m["negative_term"])


# --------------------------------------------------------------------------------------------
# Entropy-Reconstruction: eqs. 6-9 of Rodriguez-Galvez et al.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["joe", "plugin"])
@pytest.mark.parametrize("shape,temperature", [((3, 2, 4), 0.1), ((4, 3, 5), 0.5), ((5, 4, 3), 0.07)])
def test_er_matches_reference(estimator, shape, temperature):
    z = random_z(*shape, seed=11)
    objective = get_objective("er", temperature=temperature, estimator=estimator)
    assert_matches(objective, lambda x: ref_er(x, temperature, estimator)[0], z)
    output = objective.compute(z)
    _, entropy, rec = ref_er(z, temperature, estimator)
    torch.testing.assert_close(output.metrics["entropy"], entropy)
    torch.testing.assert_close(output.metrics["reconstruction"], rec)


@pytest.mark.parametrize("estimator", ["joe", "plugin"])
def test_er_teacher_and_mask(estimator):
    z = random_z(5, 3, 4, seed=5)
    teacher = random_z(5, 3, 4, seed=6)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    objective = get_objective("er", temperature=0.2, estimator=estimator)
    assert_matches(lambda x: objective(x, teacher=teacher), lambda x: ref_er(x, 0.2, estimator, teacher=teacher)[0], z)
    assert_matches(lambda x: objective(x, mask), lambda x: ref_er(x, 0.2, estimator, mask=mask)[0], z)
    assert_matches(
        lambda x: objective(x, mask, teacher=teacher), lambda x: ref_er(x, 0.2, estimator, mask=mask, teacher=teacher)[0], z
    )
    # the teacher gets no gradient; an all-True mask is the unmasked call
    t = teacher.clone().requires_grad_(True)
    objective(z.clone().requires_grad_(True), teacher=t).backward()
    assert t.grad is None
    torch.testing.assert_close(objective(z, torch.ones(5, 3, dtype=torch.bool)), objective(z), rtol=0, atol=0)


def test_er_vmf_normaliser_in_log_space():
    for d, kappa in [(2, 0.5), (3, 10.0), (16, 10.0), (128, 10.0), (256, 20.0), (1024, 10.0), (4096, 10.0), (64, 300.0)]:
        assert math.isfinite(log_vmf_normaliser(d, kappa))
        assert log_vmf_normaliser(d, kappa) == pytest.approx(ref_log_c(d, kappa), rel=1e-9, abs=1e-8)
    # the power-series fallback agrees with scipy's scaled Bessel where both work
    from mmviews.objectives.er import _log_bessel_i_series

    for nu, x in [(0.5, 3.0), (63.0, 10.0), (10.0, 50.0)]:
        assert _log_bessel_i_series(nu, x) == pytest.approx(log_bessel_i(nu, x), rel=1e-10)


def test_er_high_dimension_is_finite():
    z = torch.randn(8, 3, 256, requires_grad=True)
    for estimator in ("joe", "plugin"):
        output = get_objective("er", temperature=0.1, estimator=estimator).compute(z)
        (grad,) = torch.autograd.grad(output.loss, z)
        assert torch.isfinite(output.loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in output.metrics.values())


# --------------------------------------------------------------------------------------------
# IPMC: eqs. 10-11 of Li et al. (Circle-loss form) over the cross-view pools
# --------------------------------------------------------------------------------------------
IPMC_CASES = [((3, 2, 4), 8.0, 0.35), ((4, 3, 5), 32.0, 0.25), ((5, 4, 3), 64.0, 0.45)]


@pytest.mark.parametrize("shape,gamma,delta", IPMC_CASES)
def test_ipmc_unified_loss_matches_reference_default_attenuated_weights(shape, gamma, delta):
    # the default is the paper's attenuated weights, phi_dec = 6, tau_dec = 1 (sec. 4.3, Fig. 8)
    z = random_z(*shape, seed=21)
    objective = get_objective("ipmc", preset="paper", gamma=gamma, delta=delta, beta=0.0)
    assert (objective.phi_dec, objective.tau_dec, objective.scale, objective.pools) == (6.0, 1.0, 1.0, "sample")
    assert_matches(objective, lambda x: ref_ipmc(x, gamma, delta, phi_dec=6.0, tau_dec=1.0), z)


def test_ipmc_defaults_are_the_measured_best_and_preset_paper_gives_the_papers_values():
    # measured best (recipes/reproduce/ipmc_ablation.py): gamma 4, per-direction pools, scale 16
    z = random_z(5, 4, 3, seed=24)
    default = get_objective("ipmc")
    assert (default.gamma, default.pools, default.scale, default.delta, default.phi_dec, default.tau_dec, default.beta) \
        == (4.0, "direction", 16.0, 0.35, 6.0, 1.0, 0.0)
    assert_matches(default, lambda x: ref_ipmc(x, 4.0, 0.35, phi_dec=6.0, tau_dec=1.0, scale=16.0, pools="direction"), z)
    # the paper's values (Li et al.: gamma 64, one pool per sample, no loss scale)
    paper = get_objective("ipmc", preset="paper")
    assert (paper.gamma, paper.pools, paper.scale, paper.delta, paper.phi_dec) == (64.0, "sample", 1.0, 0.35, 6.0)
    assert_matches(paper, lambda x: ref_ipmc(x, 64.0, 0.35, phi_dec=6.0, tau_dec=1.0), z)
    # an explicit value wins over the preset
    mixed = get_objective("ipmc", preset="paper", gamma=8.0)
    assert (mixed.gamma, mixed.pools, mixed.scale) == (8.0, "sample", 1.0)
    with pytest.raises(ValueError, match="preset"):
        get_objective("ipmc", preset="best")


@pytest.mark.parametrize("shape,gamma,delta", IPMC_CASES)
def test_ipmc_unified_loss_matches_reference_plain_weights(shape, gamma, delta):
    z = random_z(*shape, seed=21)
    objective = get_objective("ipmc", preset="paper", gamma=gamma, delta=delta, beta=0.0, phi_dec=None)
    assert_matches(objective, lambda x: ref_ipmc(x, gamma, delta), z)
    # the two weightings are different losses (the test above would not notice a no-op otherwise)
    attenuated = get_objective("ipmc", preset="paper", gamma=gamma, delta=delta, beta=0.0)
    assert abs(float(objective(z)) - float(attenuated(z))) > 1e-3


@pytest.mark.parametrize("phi_dec,tau_dec", [(3.0, 2.0), (10.0, 0.5)])
def test_ipmc_attenuation_exponent_and_scale_match_reference(phi_dec, tau_dec):
    z = random_z(4, 3, 5, seed=22)
    objective = get_objective("ipmc", preset="paper", gamma=16.0, delta=0.3, phi_dec=phi_dec, tau_dec=tau_dec, scale=16.0)
    assert_matches(objective, lambda x: ref_ipmc(x, 16.0, 0.3, phi_dec=phi_dec, tau_dec=tau_dec, scale=16.0), z)


@pytest.mark.parametrize("phi_dec", [6.0, None])
@pytest.mark.parametrize("shape", [(3, 2, 4), (5, 4, 3)])
def test_ipmc_direction_pools_match_reference(shape, phi_dec):
    z = random_z(*shape, seed=23)
    objective = get_objective("ipmc", preset="paper", gamma=32.0, delta=0.35, phi_dec=phi_dec, pools="direction")
    assert_matches(objective, lambda x: ref_ipmc(x, 32.0, 0.35, phi_dec=phi_dec, pools="direction"), z)
    sample_pools = get_objective("ipmc", preset="paper", gamma=32.0, delta=0.35, phi_dec=phi_dec)
    assert abs(float(objective(z)) - float(sample_pools(z))) > 1e-3


def test_ipmc_memory_bank_negatives():
    K, M, d, size = 4, 3, 5, 10
    objective = get_objective("ipmc", preset="paper", gamma=16.0, memory_bank_size=size, bank_negatives=0)  # attenuated weights
    past = random_z(size, M, d, seed=1)
    objective.on_step_end(past[:6], torch.arange(6))
    z, index = random_z(K, M, d, seed=2), torch.tensor([1, 7, 3, 9])
    bank_entries = [objective.bank.embeddings[j].double() for j in range(6)]  # stored in float32
    torch.testing.assert_close(bank_entries[4], torch.nn.functional.normalize(past[4], dim=-1), rtol=1e-6, atol=1e-7)
    assert_matches(
        lambda x: objective(x, index=index),
        lambda x: ref_ipmc(x, 16.0, 0.35, bank_entries, list(range(6)), index.tolist(), phi_dec=6.0),
        z,
        rtol=1e-6,
        atol=1e-7,
    )
    per_direction = get_objective("ipmc", preset="paper", gamma=16.0, memory_bank_size=size, bank_negatives=0, pools="direction")
    per_direction.load_state_dict(objective.state_dict())
    assert_matches(
        lambda x: per_direction(x, index=index),
        lambda x: ref_ipmc(x, 16.0, 0.35, bank_entries, list(range(6)), index.tolist(), phi_dec=6.0, pools="direction"),
        z,
        rtol=1e-6,
        atol=1e-7,
    )
    # the bank stores normalised, detached rows at the given indices
    objective.on_step_end(z, index)
    torch.testing.assert_close(objective.bank.embeddings[7].double(), torch.nn.functional.normalize(z[1], dim=-1), rtol=1e-6, atol=1e-6)
    assert objective.bank.filled.sum() == 8
    with pytest.raises(ValueError, match="index"):
        objective(z)
    with pytest.raises(ValueError, match="index"):
        objective(z, index=torch.tensor([0, 1, 2, size]))


def test_ipmc_bank_sampling_size():
    objective = get_objective("ipmc", preset="paper", memory_bank_size=50, bank_negatives=8)
    objective.on_step_end(torch.randn(30, 2, 4), torch.arange(30))
    indices, entries, valid = objective.bank.sample(8)
    assert indices.unique().numel() == 8 and bool(objective.bank.filled[indices].all()) and entries.shape == (8, 2, 4)
    assert valid is not None and bool(valid.all())
    # Fewer filled rows than asked for: every filled row once, completed with empty rows marked invalid.
    indices, entries, valid = objective.bank.sample(40)
    assert indices.unique().numel() == 40 and entries.shape == (40, 2, 4)
    assert sorted(indices[valid].tolist()) == list(range(30)) and not bool(objective.bank.filled[indices[~valid]].any())


def test_ipmc_bank_draw_is_uniform_over_filled_rows():
    from mmviews.objectives.ipmc.memory_bank import MemoryBank

    bank = MemoryBank(20, 2, 3)
    bank.update(torch.randn(10, 2, 3), torch.arange(0, 20, 2))  # the even rows
    torch.manual_seed(0)
    counts = torch.zeros(20)
    for _ in range(2000):
        rows, _, valid = bank.sample(3)
        assert bool(valid.all())
        counts[rows] += 1
    assert counts[1::2].sum() == 0
    assert torch.allclose(counts[0::2] / 2000, torch.full((10,), 0.3), atol=0.05)  # 3 of 10 rows per draw


def test_view_filter_window_average():
    f = ViewFilter(size=6, dim=3, k=1, eta=2, warmup_epochs=0)
    history = [random_z(6, 2, 3, seed=s).float() for s in range(3)]
    for epoch, u in enumerate(history):
        if epoch:
            f.next_epoch()
        f.record(u, torch.arange(6))
    # window = the last eta = 2 epochs; similarity = mean over view pairs of cosine similarities
    expected = torch.zeros(6, 6)
    for i in range(6):
        for j in range(6):
            values = []
            for u in history[-2:]:
                un = torch.nn.functional.normalize(u, dim=-1)
                values.append(sum(dot(un[i, a], un[j, b]) for a in range(2) for b in range(2)) / 4)
            expected[i, j] = sum(values) / 2
    torch.testing.assert_close(f.averaged_similarity(torch.arange(6), torch.arange(6)), expected, rtol=1e-5, atol=1e-6)
    unseen = ViewFilter(size=6, dim=3)
    assert torch.isinf(unseen.averaged_similarity(torch.arange(2), torch.arange(2))).all()


def test_ipmc_view_filter_moves_fake_negatives():
    K, M, d = 6, 2, 8
    g = torch.Generator().manual_seed(0)
    base = torch.randn(K, 1, d, generator=g, dtype=torch.float64)
    base[1] = base[0] + 0.01  # samples 0 and 1 are the same "class"; so are 2 and 3
    base[3] = base[2] + 0.01
    params = {"gamma": 16.0, "view_filter_k": 1, "dataset_size": K, "warmup_epochs": 2, "eta": 3}
    objective = get_objective("ipmc", preset="paper", phi_dec=None, **params)  # plain weights here, attenuated below
    index = torch.arange(K)
    for epoch in range(2):
        z = base + 0.05 * torch.randn(K, M, d, generator=g, dtype=torch.float64)
        assert objective.compute(z, index=index).metrics["moved_to_positive"] == 0  # still warming up
        objective.on_step_end(z, index)
        objective.on_epoch_end(epoch)
    z = base + 0.05 * torch.randn(K, M, d, generator=g, dtype=torch.float64)
    similarity = objective.filter.averaged_similarity(index, index).masked_fill(torch.eye(K, dtype=torch.bool), -math.inf)
    moved = [[int(similarity[i].argmax())] for i in range(K)]
    assert moved[0] == [1] and moved[1] == [0] and moved[2] == [3] and moved[3] == [2]
    assert objective.compute(z, index=index).metrics["moved_to_positive"] == K
    assert_matches(lambda x: objective(x, index=index), lambda x: ref_ipmc(x, 16.0, 0.35, moved=moved), z)
    for pools in ("sample", "direction"):
        other = get_objective("ipmc", preset="paper", pools=pools, **params)
        other.load_state_dict(objective.state_dict())
        assert other.compute(z, index=index).metrics["moved_to_positive"] == K
        assert_matches(lambda x: other(x, index=index),
                       lambda x: ref_ipmc(x, 16.0, 0.35, moved=moved, phi_dec=6.0, pools=pools), z)


def separable_views(K: int = 64, d: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = 0.3 * torch.randn(K, 2, d, generator=g)
    z[:, 0, 0] += 2.0  # view 0 around +e0, view 1 around -e0
    z[:, 1, 0] -= 2.0
    return z


@pytest.fixture
def one_thread():
    # the critic's ops are tiny: on a loaded 2-core machine, intra-op threads only add waiting
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_ipmc_critic_learns_and_gradient_penalty_bounds_its_slope(one_thread):
    torch.manual_seed(0)
    objective = get_objective("ipmc", beta=1.0, critic_steps=20, critic_hidden=32, critic_lr=3e-3)
    z = separable_views()
    u = torch.nn.functional.normalize(z, dim=-1)
    objective.build(2, z.shape[-1])
    critic = objective.critic

    def critic_cost():
        u_a, u_b = critic.pair_inputs(u)
        torch.manual_seed(1)
        return float((-critic.distances(u) + 10.0 * critic.gradient_penalty(u_a, u_b)).sum().detach())

    before = critic_cost()
    for _ in range(5):
        metrics = objective.critic_step(z)
    after = critic_cost()
    assert after < before - 0.5, (before, after)
    # W_1 between the two view distributions ~ distance between the clusters (about 1.8 here)
    assert 1.0 < float(metrics["critic_distance"]) < 2.2
    # 1-Lipschitz through the penalty: gradient norms on interpolates close to 1
    u_a, u_b = critic.pair_inputs(u)
    x = (0.5 * u_a + 0.5 * u_b).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x).sum(), x)
    assert (grad.norm(dim=-1) - 1).abs().mean() < 0.2
    # L_DA = sum over ordered pairs a != b of W_ab = 2 W_01, differentiable in z only
    zz = z.clone().requires_grad_(True)
    distribution = objective.distribution_loss(zz)
    with torch.no_grad():
        head = critic(torch.stack([u[:, 0], u[:, 1]], dim=1).transpose(0, 1).reshape(1, -1, z.shape[-1])).view(-1)
        expected = 2 * (head[: len(z)].mean() - head[len(z) :].mean())
    torch.testing.assert_close(distribution, expected)
    output = objective.compute(zz)
    torch.testing.assert_close(output.loss, output.metrics["unified"] + distribution.detach())
    output.loss.backward()
    assert zz.grad is not None and torch.isfinite(zz.grad).all()


def test_ipmc_distribution_loss_leaves_critic_gradients_alone():
    objective = get_objective("ipmc", beta=0.5, critic_steps=1, critic_hidden=8)
    z = torch.randn(6, 3, 4, requires_grad=True)
    objective.critic_step(z)
    # critic_step leaves no gradients behind (another optimiser holding them would re-apply them)
    assert all(p.grad is None for p in objective.critic.parameters())
    objective(z).backward()
    assert all(p.grad is None for p in objective.critic.parameters())
    assert z.grad is not None


def test_ipmc_state_dict_round_trip(one_thread):
    params = dict(beta=0.5, critic_steps=2, critic_hidden=16, memory_bank_size=20, view_filter_k=1, warmup_epochs=1, eta=2)
    torch.manual_seed(0)
    objective = get_objective("ipmc", **params)
    for epoch in range(2):
        z, index = torch.randn(5, 3, 4), torch.randperm(20)[:5]
        objective.critic_step(z)
        objective.on_step_end(z, index)
        objective.on_epoch_end(epoch)
    buffer = io.BytesIO()
    torch.save(objective.state_dict(), buffer)
    buffer.seek(0)
    restored = get_objective("ipmc", **params)  # fresh: nothing built yet
    restored.load_state_dict(torch.load(buffer))
    for (name, a), (_, b) in zip(objective.state_dict().items(), restored.state_dict().items()):
        if name.endswith("_extra_state"):
            continue
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert int(restored.filter.epoch) == 2 and restored.filter.active
    state_a = objective.critic_optimizer.state_dict()["state"]
    state_b = restored.critic_optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys() and len(state_a) > 0
    for key in state_a:
        torch.testing.assert_close(state_a[key]["exp_avg"], state_b[key]["exp_avg"], rtol=0, atol=0)
    # identical state -> identical next critic step and loss
    z, index = torch.randn(5, 3, 4), torch.arange(5)
    torch.manual_seed(3)
    m_a = objective.critic_step(z)
    torch.manual_seed(3)
    m_b = restored.critic_step(z)
    torch.testing.assert_close(m_a["critic_distance"], m_b["critic_distance"], rtol=0, atol=0)
    torch.manual_seed(4)
    loss_a = objective(z, index=index)
    torch.manual_seed(4)
    loss_b = restored(z, index=index)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# gradcheck, numerics, bad inputs
# --------------------------------------------------------------------------------------------
GRADCHECK_CASES = [
    ("fmicl", {"divergence": "kl"}, None),
    ("fmicl", {"divergence": "vlc", "sigma": 0.6}, None),
    ("fmicl", {"divergence": "sh", "similarity": "cosine", "temperature": 1.5}, None),
    ("er", {"estimator": "joe", "temperature": 0.3}, None),
    ("er", {"estimator": "plugin", "temperature": 0.3}, "mask"),
]
# (IPMC is left out: its Circle-loss weights alpha are detached by definition, so its analytic
# gradient is not the numerical derivative of its value; the reference test checks its gradient.)


@pytest.mark.parametrize("name,params,use_mask", GRADCHECK_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GRADCHECK_CASES)])
def test_gradcheck(name, params, use_mask):
    objective = get_objective(name, **params)
    z = random_z(3, 3, 4, seed=31).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]], dtype=torch.bool) if use_mask else None
    assert torch.autograd.gradcheck(lambda x: objective(x, mask), (z,), eps=1e-6, atol=1e-5)


FINITE_CASES = [
    ("fmicl", {"divergence": div}) for div in DIVERGENCES
] + [
    ("fmicl", {"divergence": "kl", "similarity": "cosine"}),
    ("fmicl", {"divergence": "pearson", "similarity": "cosine"}),
    ("fmicl", {"divergence": "tsallis", "similarity": "cosine"}),
    ("er", {"estimator": "joe"}),
    ("er", {"estimator": "plugin"}),
    ("ipmc", {"gamma": 128.0}),
    ("ipmc", {"gamma": 128.0, "phi_dec": None}),
    ("ipmc", {"gamma": 128.0, "pools": "direction", "scale": 16.0}),
    ("ipmc", {"beta": 1.0, "critic_hidden": 8}),
]


@pytest.mark.parametrize("name,params", FINITE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FINITE_CASES)])
def test_finite_under_bf16_autocast_and_at_collapse(name, params):
    temperature = {"temperature": 0.05} if name != "ipmc" else {}
    objective = get_objective(name, **params, **temperature)
    encoder = torch.nn.Linear(16, 32)
    x = torch.randn(64, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = encoder(x)
        assert z.dtype == torch.bfloat16
        loss = objective(z)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in encoder.parameters())
    collapsed = torch.ones(16, 4, 32, requires_grad=True)  # every embedding identical
    loss = objective(collapsed)
    (grad,) = torch.autograd.grad(loss, collapsed)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


BAD = [
    ("fmicl", {"divergence": "hellinger"}, "divergence"),
    ("fmicl", {"similarity": "dot"}, "similarity"),
    ("fmicl", {"divergence": "tsallis", "q": 1.0}, "q"),
    ("fmicl", {"mu": 0.0}, "mu"),
    ("fmicl", {"sigma": -1.0}, "sigma"),
    ("fmicl", {"alpha": 0.0}, "alpha"),
    ("fmicl", {"divergence": "js", "similarity": "cosine", "temperature": 0.1}, "temperature > 1.44"),
    ("fmicl", {"divergence": "sh", "similarity": "cosine", "temperature": 1.0}, "temperature > 1.0"),
    ("fmicl", {"divergence": "sh", "sigma": 0.05}, "overflow"),
    ("fmicl", {"similarity": "cosine", "temperature": 0.0}, "temperature"),
    ("er", {"estimator": "kde"}, "estimator"),
    ("er", {"temperature": -0.1}, "temperature"),
    ("ipmc", {"gamma": 0.0}, "gamma"),
    ("ipmc", {"delta": 1.0}, "delta"),
    ("ipmc", {"eta": 0}, "eta"),
    ("ipmc", {"view_filter_k": 1}, "dataset_size"),
    ("ipmc", {"phi_dec": 0.0}, "phi_dec"),
    ("ipmc", {"tau_dec": -1.0}, "tau_dec"),
    ("ipmc", {"scale": 0.0}, "scale"),
    ("ipmc", {"pools": "pairs"}, "pools"),
]


@pytest.mark.parametrize("name,params,match", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_bad_parameters_raise(name, params, match):
    with pytest.raises(ValueError, match=match):
        get_objective(name, **params)


def test_bad_call_inputs_raise():
    z = torch.randn(4, 3, 5)
    with pytest.raises(ValueError, match="teacher"):
        get_objective("er")(z, teacher=torch.randn(4, 2, 5))
    with pytest.raises(ValueError, match="mask"):
        get_objective("ipmc")(z, torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        get_objective("er")(z, torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-finite"):
        get_objective("fmicl")(torch.full((4, 3, 5), float("nan")))
    with pytest.raises(ValueError, match="M = 1"):
        get_objective("er")(torch.randn(4, 1, 5))
    objective = get_objective("ipmc", beta=1.0, critic_hidden=8)
    objective(z)
    with pytest.raises(ValueError, match="built for"):
        objective(torch.randn(4, 2, 5))
