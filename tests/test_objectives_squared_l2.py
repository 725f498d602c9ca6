"""The squared-L2 critic of ``simclr`` and ``geometric_pvc`` (``critic="squared_l2"``, the critic of
Daunhawer et al. 2023) against the float64 loop references, and the adapters' ``l2_normalize``.

The references (:func:`mmviews.objectives.reference.squared_l2_simclr_reference` and
``geometric_pvc_reference(..., critic="squared_l2")``) sum the squared differences coordinate by
coordinate; the implementation expands the distance into dot products, so agreement checks the
expansion, its anchor term and the exclusion of the anchor's own sample.
"""

from __future__ import annotations

import pytest
import torch

from mmviews.modalities import build_adapter
from mmviews.objectives import get_objective
from mmviews.objectives.reference import geometric_pvc_reference, simclr_reference

VALUE_TOL = dict(rtol=1e-10, atol=1e-10)
GRAD_TOL = dict(rtol=1e-9, atol=1e-10)


def _z(K: int, M: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(K, M, d, generator=g, dtype=torch.float64)).requires_grad_(True)


def _value_and_grad(loss: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad


@pytest.mark.parametrize("K, d, temperature, scale, seed", [(2, 1, 1.0, 1.0, 0), (5, 3, 0.5, 2.0, 1), (7, 5, 1.0, 0.3, 2),
                                                            (4, 2, 0.1, 1.0, 3)])
def test_simclr_squared_l2_matches_reference(K, d, temperature, scale, seed):
    z = _z(K, 2, d, seed, scale)
    loss = get_objective("simclr", temperature=temperature, critic="squared_l2")(z)
    value, grad = _value_and_grad(loss, z)
    ref_value, ref_grad = _value_and_grad(simclr_reference(z, temperature, critic="squared_l2"), z)
    torch.testing.assert_close(value, ref_value, **VALUE_TOL)
    torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)


@pytest.mark.parametrize("K, M, d, temperature, seed", [(3, 3, 2, 1.0, 0), (5, 4, 5, 0.3, 1), (6, 2, 1, 2.0, 2)])
def test_geometric_pvc_squared_l2_matches_reference_with_and_without_mask(K, M, d, temperature, seed):
    z = _z(K, M, d, seed)
    objective = get_objective("geometric_pvc", temperature=temperature, critic="squared_l2")
    for mask in (None, torch.rand(K, M, generator=torch.Generator().manual_seed(seed)) < 0.7):
        if mask is not None:
            mask[0] = True  # at least one sample with two present views
        value, grad = _value_and_grad(objective(z, mask), z)
        ref_value, ref_grad = _value_and_grad(geometric_pvc_reference(z, temperature, mask, critic="squared_l2"), z)
        torch.testing.assert_close(value, ref_value, **VALUE_TOL)
        torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)


def test_squared_l2_scores_the_embeddings_unnormalised():
    """Scaling z changes the squared-L2 loss (the cosine loss is scale-free); translating every
    embedding by one vector leaves it (distances do not change)."""
    z = _z(6, 2, 4, 5).detach()
    l2 = get_objective("simclr", temperature=1.0, critic="squared_l2")
    cosine = get_objective("simclr", temperature=1.0)
    assert not torch.isclose(l2(3 * z), l2(z))
    torch.testing.assert_close(cosine(3 * z), cosine(z))
    torch.testing.assert_close(l2(z + torch.tensor([5.0, -2.0, 0.5, 1.0], dtype=torch.float64)), l2(z), **VALUE_TOL)


def test_on_unit_vectors_squared_l2_is_the_cosine_critic_at_half_the_temperature():
    z = torch.nn.functional.normalize(_z(5, 3, 4, 7).detach(), dim=-1)
    torch.testing.assert_close(get_objective("geometric_pvc", temperature=0.4, critic="squared_l2")(z),
                               get_objective("geometric_pvc", temperature=0.2)(z), **VALUE_TOL)


def test_squared_l2_streamed_equals_unchunked():
    z = _z(7, 3, 3, 9)
    mask = torch.rand(7, 3, generator=torch.Generator().manual_seed(1)) < 0.8
    mask[0] = True
    whole = get_objective("geometric_pvc", temperature=0.5, critic="squared_l2")
    streamed = get_objective("geometric_pvc", temperature=0.5, critic="squared_l2", chunk_size=2)
    value, grad = _value_and_grad(whole(z, mask), z)
    value_s, grad_s = _value_and_grad(streamed(z, mask), z)
    torch.testing.assert_close(value_s, value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_s, grad, rtol=1e-12, atol=1e-12)


def test_squared_l2_float32_matches_float64_reference_at_a_large_scale():
    """The expansion 2<a, b> - ||b||^2 - ||a||^2 in float32 on embeddings of norm ~ 20."""
    z = _z(16, 2, 5, 11, scale=10.0)
    loss = get_objective("simclr", temperature=1.0, critic="squared_l2")(z.detach().float())
    torch.testing.assert_close(loss.double(), simclr_reference(z.detach(), 1.0, critic="squared_l2"), rtol=1e-4, atol=1e-4)


def test_squared_l2_learned_temperature_gets_a_gradient_and_metrics_are_cosines():
    objective = get_objective("simclr", temperature=1.0, critic="squared_l2", learn_temperature=True)
    z = _z(6, 2, 3, 4)
    out = objective.compute(z)
    out.loss.backward()
    assert objective.logit_scale.grad is not None and objective.logit_scale.grad != 0
    torch.testing.assert_close(out.loss.detach(), simclr_reference(z.detach(), 1.0, critic="squared_l2"), **VALUE_TOL)
    u = torch.nn.functional.normalize(z.detach(), dim=-1)
    torch.testing.assert_close(out.metrics["pos_sim"], (u[:, 0] * u[:, 1]).sum(-1).mean(), **VALUE_TOL)
    assert -1.0 <= float(out.metrics["neg_sim"]) <= 1.0


def test_unknown_critic_is_a_clear_error_and_repr_names_the_critic():
    with pytest.raises(ValueError, match=r"objective 'simclr': critic must be one of cosine, squared_l2, got 'l2'"):
        get_objective("simclr", critic="l2")
    assert repr(get_objective("simclr", critic="squared_l2")) == "SimCLR(temperature=0.1, critic='squared_l2')"
    assert repr(get_objective("geometric_pvc")) == "GeometricPVC(temperature=0.1)"


@pytest.mark.parametrize("name", ["simclr", "geometric_pvc"])
def test_the_constructor_keeps_its_defaults_and_passes_the_streaming_parameters_on(name):
    """Adding ``critic`` to the constructor keeps the others' defaults (temperature 0.1, fixed)
    and hands chunk_size / learn_temperature to the base class."""
    plain = get_objective(name)
    assert plain.temperature == 0.1 and plain.trained_parameters() == [] and plain.chunk_size is None
    assert plain.critic == "cosine" and plain.normalise_inputs
    tuned = get_objective(name, temperature=0.5, critic="squared_l2", chunk_size=3, learn_temperature=True)
    assert tuned.chunk_size == 3 and len(tuned.trained_parameters()) == 1 and not tuned.normalise_inputs
    assert float(tuned.temperature.detach()) == pytest.approx(0.5)


ADAPTER = {"type": "mlp", "input_dim": 3, "hidden_dim": 8, "embed_dim": 4, "head": {"kind": "linear"}}


def test_adapter_l2_normalize_false_returns_the_heads_output():
    torch.manual_seed(0)
    unit = build_adapter(ADAPTER).eval()
    raw = build_adapter(dict(ADAPTER, l2_normalize=False)).eval()
    raw.load_state_dict(unit.state_dict())
    assert unit.config.l2_normalize is True and raw.config.l2_normalize is False
    values = torch.randn(5, 1, 3)
    z, u = raw({"values": values}), unit({"values": values})
    torch.testing.assert_close(z, raw.head(raw.features({"values": values})))
    assert not torch.allclose(z.norm(dim=-1), torch.ones(5))
    torch.testing.assert_close(torch.nn.functional.normalize(z, dim=-1), u)
    # per-frame features [B, T, F]: the mean of the frames' head outputs, not normalised
    frames = torch.randn(2, 3, 8)
    torch.testing.assert_close(raw.project(frames), raw.head(frames.reshape(6, 8)).reshape(2, 3, 4).mean(1))
    unit_frames = torch.nn.functional.normalize(unit.head(frames.reshape(6, 8)), dim=-1).reshape(2, 3, 4).mean(1)
    torch.testing.assert_close(unit.project(frames), torch.nn.functional.normalize(unit_frames, dim=-1))


def test_adapter_l2_normalize_round_trips_and_rejects_a_non_bool(tmp_path):
    from mmviews.modalities import Adapter

    raw = build_adapter(dict(ADAPTER, l2_normalize=False))
    raw.save_pretrained(tmp_path / "enc")
    assert Adapter.from_pretrained(tmp_path / "enc").config.l2_normalize is False
    with pytest.raises(ValueError, match="l2_normalize"):
        build_adapter(dict(ADAPTER, l2_normalize="no"))


@pytest.mark.parametrize("critic", ["cosine", "squared_l2"])
def test_bad_embeddings_are_refused_naming_the_objective_whatever_the_critic(critic):
    objective = get_objective("simclr", critic=critic)
    with pytest.raises(ValueError, match=r"^objective 'simclr': z must have shape \[K, M, d\] \(3 dims\), got shape \(4, 2\)"):
        objective(torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"^objective 'simclr': embedding dimension d must be >= 1, got 0$"):
        objective(torch.randn(4, 2, 0))
    with pytest.raises(ValueError, match=r"^objective 'simclr': z has non-finite values \(first at index \(1, 0, 2\)\)"):
        z = torch.randn(4, 2, 3)
        z[1, 0, 2] = float("nan")
        objective(z)


@pytest.mark.parametrize("critic", ["cosine", "squared_l2"])
def test_a_bad_mask_is_refused_naming_its_shape_or_type(critic):
    objective = get_objective("geometric_pvc", critic=critic)
    z = torch.randn(4, 2, 3)
    with pytest.raises(ValueError, match=r"^objective 'geometric_pvc': mask must have shape \[K, M\] = \(4, 2\), got list$"):
        objective(z, [[True, True]] * 4)
    with pytest.raises(ValueError, match=r"got \(4, 3\)$"):
        objective(z, torch.ones(4, 3, dtype=torch.bool))


@pytest.mark.parametrize("critic", ["cosine", "squared_l2"])
def test_a_zero_one_integer_mask_counts_as_the_bool_mask(critic):
    objective = get_objective("geometric_pvc", critic=critic)
    z = _z(5, 3, 2, 13).detach()
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(objective(z, mask), objective(z, mask.bool()))
    torch.testing.assert_close(objective(z, mask.double()), objective(z, mask.bool()))


def test_squared_l2_scores_half_precision_embeddings_in_float32():
    """The unnormalised path keeps prepare's precision rule: bf16 z is scored in float32."""
    z = _z(6, 2, 3, 17).detach().to(torch.bfloat16)
    loss = get_objective("simclr", temperature=1.0, critic="squared_l2")(z)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, get_objective("simclr", temperature=1.0, critic="squared_l2")(z.float()))
