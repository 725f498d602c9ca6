"""Equality with open_clip's own losses (``open_clip.loss``), in float64.

- ``siglip`` at M = 2 is ``SigLipLoss``: value and gradients w.r.t. both feature sets, the
  learned log-scale and the bias, unchunked and streamed, one process and two gloo processes
  against each of ``SigLipLoss``'s ``dist_impl`` (gather, bidir, shift, reduce).
- ``mv_cl1`` at M = 2 with a learned temperature is ``ClipLoss`` (CLIP's symmetric
  cross-entropy), with the gradient of ``logit_scale``; also with two processes against
  ``ClipLoss(local_loss=True, gather_with_grad=True)``. ``simclr`` (NT-Xent) is not CLIP's
  loss: its anchors also meet the other samples' views of their own modality, so the two
  differ by more than a factor (checked below, so that the docs' statement stays true).

open_clip takes the features as given and ``exp(logit_scale)``; mmviews takes ``z`` and
normalises it, and holds ``logit_scale`` itself: open_clip is fed ``normalize(z)`` from the
same leaf, and its own log-scale (and bias) leaves with the same values.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dist_open_clip_worker as W  # tests/ is on sys.path (tests/conftest.py)
from dist_worker import launch

open_clip_loss = pytest.importorskip("open_clip.loss")  # a dependency: present wherever mmviews installs

TOLERANCE = dict(rtol=1e-9, atol=1e-10)  # float64; the issue asks 1e-6, the match is to rounding


def _z(K: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(K, 2, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("K,d,scale,bias", [(2, 1, 10.0, -10.0), (7, 5, 10.0, -10.0), (16, 8, 3.0, 0.5), (9, 32, 40.0, -2.0)])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_siglip_equals_open_clip_siglip_loss(K, d, scale, bias, chunk_size):
    z = _z(K, d, seed=K + d)
    W.SCALE, W.BIAS = scale, bias  # module constants the helpers read (restored below)
    try:
        ours = W.mmviews_siglip(z, chunk_size=chunk_size)
        theirs = W.open_clip_siglip(z)
    finally:
        W.SCALE, W.BIAS = 7.0, -4.0
    for key in ("loss", "grad", "scale", "bias"):
        torch.testing.assert_close(ours[key], theirs[key], **TOLERANCE, msg=lambda m, k=key: f"{k}: {m}")
    # both feature sets receive gradient, and the scale and bias gradients are not trivially 0
    assert ours["grad"][:, 0].abs().max() > 0 and ours["grad"][:, 1].abs().max() > 0
    assert ours["scale"] != 0 and ours["bias"] != 0


def test_siglip_defaults_are_the_papers_and_open_clips():
    from mmviews.objectives import get_objective

    objective = get_objective("siglip")
    assert math.isclose(float(objective.logit_scale.detach()), math.log(10.0), rel_tol=1e-15)
    assert float(objective.logit_bias.detach()) == -10.0
    z = _z(6, 4, seed=3)
    theirs = W.open_clip_siglip(z)  # at SCALE 7, BIAS -4: compare at the defaults instead
    u = F.normalize(z, dim=-1)
    expected = open_clip_loss.SigLipLoss()(u[:, 0], u[:, 1], torch.tensor(10.0, dtype=torch.float64), -10.0)
    torch.testing.assert_close(objective(z), expected, **TOLERANCE)
    assert not torch.allclose(theirs["loss"], expected)  # the helper's constants are not the defaults


@pytest.mark.parametrize("K,d,temperature", [(2, 1, 1.0), (8, 6, 0.07), (13, 16, 0.2)])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_mv_cl1_with_a_learned_temperature_equals_open_clip_clip_loss(K, d, temperature, chunk_size):
    from mmviews.objectives import get_objective

    z = _z(K, d, seed=100 + K)
    objective = get_objective("mv_cl1", temperature=temperature, learn_temperature=True, chunk_size=chunk_size)
    leaf = z.clone().requires_grad_(True)
    loss = objective(leaf)
    grad_z, grad_scale = torch.autograd.grad(loss, (leaf, objective.logit_scale))
    leaf2 = z.clone().requires_grad_(True)
    logit_scale = torch.tensor(math.log(1 / temperature), dtype=torch.float64, requires_grad=True)
    u = F.normalize(leaf2, dim=-1)
    expected = open_clip_loss.ClipLoss()(u[:, 0], u[:, 1], logit_scale.exp())
    expected_z, expected_scale = torch.autograd.grad(expected, (leaf2, logit_scale))
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(grad_z, expected_z, **TOLERANCE)
    torch.testing.assert_close(grad_scale, expected_scale, **TOLERANCE)
    assert grad_scale != 0


def test_simclr_is_not_clip_loss():
    """NT-Xent's within-modality negatives make it another loss (documented in docs/objectives.md)."""
    from mmviews.objectives import get_objective

    z = _z(8, 6, seed=5)
    u = F.normalize(z, dim=-1)
    clip = open_clip_loss.ClipLoss()(u[:, 0], u[:, 1], torch.tensor(1 / 0.1, dtype=torch.float64))
    simclr = get_objective("simclr", temperature=0.1)(z)
    mv_cl1 = get_objective("mv_cl1", temperature=0.1)(z)
    torch.testing.assert_close(mv_cl1, clip, **TOLERANCE)
    assert float(simclr) > float(clip) + 0.05


# ---- two processes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dist_open_clip")
    launch(str(out_dir), timeout=300.0, target=W.run_rank)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(W.WORLD)]


def _ranks(results: list[dict], key: str) -> list[dict]:
    for rank, res in enumerate(results):
        if f"{key}|error" in res:
            pytest.fail(f"rank {rank} failed on {key}:\n{res[f'{key}|error']}")
    return [res[key] for res in results]


def _combined(per_rank: list[dict], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """What training sees: the mean of the ranks' losses, the embeddings' gradients of every
    rank side by side (each the gradient of the sum of the ranks' losses w.r.t. that rank's
    slice), and the replicated parameters' gradients averaged over ranks (as DDP does)."""
    out = {"loss": torch.stack([r["loss"] for r in per_rank]).mean(), "grad": torch.cat([r["grad"] for r in per_rank])}
    for key in keys:
        out[key] = torch.stack([r[key] for r in per_rank]).mean()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ours", ["siglip", "siglip[chunk_size=2]"])
@pytest.mark.parametrize("impl", W.SIGLIP_IMPLS)
def test_two_process_siglip_equals_open_clip_siglip_loss(rank_results, ours, impl):
    got = _combined(_ranks(rank_results, ours), ("scale", "bias"))
    expected = _combined(_ranks(rank_results, f"open_clip[{impl}]"), ("scale", "bias"))
    single = W.open_clip_siglip(W.full_batch())
    for key in ("loss", "grad", "scale", "bias"):
        torch.testing.assert_close(got[key], expected[key], **TOLERANCE, msg=lambda m, k=key: f"{k} vs open_clip: {m}")
    # and both are one process's on the whole batch (the embeddings' gradient W times its own)
    torch.testing.assert_close(got["loss"], single["loss"], **TOLERANCE)
    torch.testing.assert_close(got["grad"], W.WORLD * single["grad"], **TOLERANCE)
    torch.testing.assert_close(got["scale"], single["scale"], **TOLERANCE)
    torch.testing.assert_close(got["bias"], single["bias"], **TOLERANCE)


@pytest.mark.slow
def test_two_process_mv_cl1_equals_open_clip_clip_loss(rank_results):
    got = _combined(_ranks(rank_results, "mv_cl1"), ("scale",))
    expected = _combined(_ranks(rank_results, "open_clip_clip"), ("scale",))
    single = W.mmviews_mv_cl1(W.full_batch())
    for key in ("loss", "grad", "scale"):
        torch.testing.assert_close(got[key], expected[key], **TOLERANCE, msg=lambda m, k=key: f"{k} vs open_clip: {m}")
    torch.testing.assert_close(got["loss"], single["loss"], **TOLERANCE)
    torch.testing.assert_close(got["grad"], W.WORLD * single["grad"], **TOLERANCE)
    torch.testing.assert_close(got["scale"], single["scale"], **TOLERANCE)
