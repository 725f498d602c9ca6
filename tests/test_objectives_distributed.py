"""Distributed objectives, checked with two real processes (gloo on CPU).

Contract: with the batch split over W ranks,

- the mean of the ranks' losses equals the single-process loss on the concatenated batch;
- the gradient that reaches rank r's inputs is the gradient of the SUM of the ranks' losses
  w.r.t. those inputs, i.e. W times the single-process gradient of that slice (every rank's
  loss depends on every rank's embeddings through the gather); DDP's averaging over ranks
  then divides by W, so
- an encoder wrapped in DDP receives exactly the single-process parameter gradients.

Covers every name in ``list_objectives()`` (with the parameter variants of
``dist_worker.VARIANTS``), with and without a view mask for those that support one. The two
processes are started once per session (see ``dist_worker.launch``) and run every case.
"""

from __future__ import annotations

import pytest
import torch

import dist_worker as W  # tests/ is on sys.path (tests/conftest.py)

TOLERANCE = dict(rtol=1e-9, atol=1e-11)  # float64 throughout; only summation order differs
CASES = W.objective_variants()
# (case, masked): the masked run only for objectives that accept a view mask.
MASK_CASES = [(*case, masked) for case in CASES for masked in (False, True) if not masked or W.supports_mask(case[1])]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dist")
    W.launch(str(out_dir), timeout=300.0)  # a hang guard only; ~10 s on an idle 2-core machine
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(W.WORLD)]


def _single_process(name: str, params: dict, masked: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    objective = W.build_objective(name, params)
    num_views = W.views_of(name)
    z = W.full_batch(num_views).clone().requires_grad_(True)
    loss = objective(z, W.full_mask(num_views) if masked else None)
    loss.backward()
    return loss.detach(), z.grad.detach(), W.learned_gradients(objective)


def _errors(results: list[dict], key: str) -> None:
    for rank, res in enumerate(results):
        if f"{key}|error" in res:
            pytest.fail(f"rank {rank} failed on {key}:\n{res[f'{key}|error']}")


@pytest.mark.parametrize(
    "key,name,params,masked", MASK_CASES, ids=[f"{c[0]}-{'mask' if c[3] else 'nomask'}" for c in MASK_CASES]
)
def test_loss_and_input_gradient_match_single_process(rank_results, key, name, params, masked):
    _errors(rank_results, key)
    loss, grad, param_grads = _single_process(name, params, masked)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    per_rank = [res[f"{key}|mask={masked}"] for res in rank_results]
    mean_loss = torch.stack([r["loss"] for r in per_rank]).mean()
    torch.testing.assert_close(mean_loss, loss, **TOLERANCE)
    # The ranks' losses differ (different anchors): a rank that silently returned the global
    # loss, or ignored the other rank's candidates, is caught by the gradient check below.
    gathered_grad = torch.cat([r["grad"] for r in per_rank])
    torch.testing.assert_close(gathered_grad, W.WORLD * grad, **TOLERANCE)
    assert grad.abs().max() > 0
    # Learned parameters (a learned temperature, siglip's bias) are replicated: the trainer
    # averages their gradients over ranks, and that mean is the single-process gradient.
    assert len(param_grads) == len(per_rank[0]["param_grads"]) == (2 if name == "siglip" else int("learn_temperature" in params))
    for index, expected in enumerate(param_grads):
        mean = torch.stack([r["param_grads"][index] for r in per_rank]).mean(dim=0)
        torch.testing.assert_close(mean, expected, **TOLERANCE)
        assert expected.abs().max() > 0


@pytest.mark.parametrize("key,name,params", CASES, ids=[c[0] for c in CASES])
def test_ddp_parameter_gradients_match_single_process(rank_results, key, name, params):
    _errors(rank_results, key)
    model = W.encoder()
    objective = W.build_objective(name, params)
    loss = objective(model(W.full_inputs(W.views_of(name))))
    loss.backward()
    expected = [p.grad for p in model.parameters()]
    per_rank = [res[f"{key}|ddp"] for res in rank_results]
    torch.testing.assert_close(torch.stack([r["loss"] for r in per_rank]).mean(), loss.detach(), **TOLERANCE)
    for rank, res in enumerate(per_rank):
        assert len(res["grads"]) == len(expected)
        for got, want in zip(res["grads"], expected):
            # DDP all-reduces, so every rank holds the same (single-process) gradient.
            torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m: f"rank {rank}: {m}")
    assert max(float(g.abs().max()) for g in expected) > 0


def test_stateful_ipmc_matches_single_process_step_by_step(rank_results):
    """IPMC with beta > 0 (critic), a memory bank and the view filter: over steps that fill the
    bank, end the filter's warm-up and train the critic, every step's mean loss and input
    gradients equal one process's on the whole batches (bank, filter history and critic stay
    identical replicas)."""
    _errors(rank_results, "ipmc_stateful")
    # The critic holds float32 weights (its term is computed in float32): float32 rounding.
    tolerance = dict(rtol=1e-5, atol=1e-7)
    single = W.ipmc_sequence(None)
    per_rank = [res["ipmc_stateful"] for res in rank_results]
    for step, expected in enumerate(single):
        got = [r[step] for r in per_rank]
        torch.testing.assert_close(torch.stack([g["loss"] for g in got]).mean(), expected["loss"], **tolerance,
                                   msg=lambda m, s=step: f"step {s}: loss: {m}")
        torch.testing.assert_close(torch.cat([g["grad"] for g in got]), W.WORLD * expected["grad"], **tolerance,
                                   msg=lambda m, s=step: f"step {s}: input gradient: {m}")
        # Every rank's critic trains on the gathered batch, as the one process's does on the
        # whole batch: each rank's estimate is the one-process estimate (not only their mean).
        for rank, g in enumerate(got):
            torch.testing.assert_close(g["critic_distance"], expected["critic_distance"], **tolerance,
                                       msg=lambda m, s=step, r=rank: f"step {s}: rank {r}: critic: {m}")
    # Every tier was exercised: the critic's term, the bank (from step 1) and the filter's moves.
    assert all(float(s["distribution"]) != 0 for s in single)
    assert float(single[-1]["moved_to_positive"]) > 0, [float(s["moved_to_positive"]) for s in single]


def test_ranks_with_different_batch_sizes_raise(rank_results):
    for rank, res in enumerate(rank_results):
        message = res["unequal_K"]
        assert message is not None, f"rank {rank} accepted different K on the two ranks"
        assert "same number of samples" in message and str([W.K_LOCAL, W.K_LOCAL + 1]) in message


def test_every_registered_objective_is_covered():
    from mmviews.objectives import list_objectives

    assert {name for _, name, _ in CASES} == set(list_objectives())
    assert len(CASES) >= 10
