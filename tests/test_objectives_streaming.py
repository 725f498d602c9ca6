"""Streamed (chunked) score blocks: the same loss and gradients as the unchunked path, and
memory that does not keep the scores.

For every objective that builds a large score block, the loss and the gradient w.r.t. ``z``
with ``chunk_size`` set (1, a prime, more than K*M) equal those of the unchunked path
(``score_budget_mb=inf``): in float64 to 1e-12, with and without a view mask, in float32
under bf16 autocast. A spy on the block loop proves the streamed code ran (the equality
would be vacuous otherwise). Memory: the bytes autograd saves for backward are O(K M d), not
the K M N M scores the unchunked path saves, and the peak of live tensors is a small fraction
of the score matrix. Distributed runs are in test_objectives_distributed.py (the ``chunk_size``
variants of dist_worker.VARIANTS).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmviews.objectives import _streaming, get_objective, objective_class
from mmviews.objectives._streaming import DEFAULT_SCORE_BUDGET_MB, plan_block

K, M, D = 11, 3, 5
# (case id, name, params): every objective with a streamed block, and the variants whose
# reduction differs (f-MICL's divergences and critic, ER's estimators, IPMC's pools).
CASES = [
    ("geometric_pvc", "geometric_pvc", {}),
    ("arithmetic_pvc", "arithmetic_pvc", {}),
    ("sufficient_statistics", "sufficient_statistics", {}),
    ("simclr", "simclr", {}),
    ("mv_infonce", "mv_infonce", {}),
    ("mv_cl1", "mv_cl1", {}),
    ("multi_crop", "multi_crop", {}),
    ("avg", "avg", {}),
    ("mv_dhel", "mv_dhel", {}),
    ("mv_cl2", "mv_cl2", {}),
    ("siglip", "siglip", {}),
    ("siglip-fixed", "siglip", {"learn_temperature": False, "learn_bias": False, "bias": -1.0}),
    ("er-joe", "er", {"estimator": "joe"}),
    ("er-plugin", "er", {"estimator": "plugin"}),
    ("fmicl-kl", "fmicl", {"divergence": "kl"}),
    ("fmicl-js", "fmicl", {"divergence": "js"}),
    ("fmicl-vlc", "fmicl", {"divergence": "vlc"}),
    ("fmicl-cosine", "fmicl", {"divergence": "pearson", "similarity": "cosine"}),
    ("ipmc-sample", "ipmc", {"beta": 0.0, "pools": "sample"}),
    ("ipmc-direction", "ipmc", {"beta": 0.0, "pools": "direction"}),
]
CHUNKS = [1, 3, 7, K * M + 1]  # one sample per block, primes (uneven last block), more than K*M
MASK_CASES = [(c, masked) for c in CASES for masked in (False, True) if not masked or objective_class(c[1]).supports_mask]


def _views(name: str, default: int = M) -> int:
    return objective_class(name).exact_views or default


def _build(name: str, params: dict, **streaming) -> torch.nn.Module:
    torch.manual_seed(0)  # objectives with own modules (ipmc's critic) are built alike
    return get_objective(name, **params, **streaming)


def _z(
    name: str, samples: int = K, dim: int = D, dtype: torch.dtype = torch.float64, seed: int = 0, views: int = M
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, _views(name, views), dim, generator=generator, dtype=torch.float64).to(dtype)


def _mask(name: str, samples: int = K) -> torch.Tensor:
    """Some views absent, one sample with a single view, one with none."""
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(samples, _views(name), generator=generator) > 0.3
    mask[0] = True
    mask[1] = False
    mask[1, 0] = True
    mask[2] = False
    return mask


def _loss_and_grad(objective, z: torch.Tensor, mask: torch.Tensor | None, autocast: bool = False):
    z = z.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = objective(z, mask)
    loss.backward()  # outside the autocast region, as torch recommends (and Accelerate does)
    return loss.detach(), z.grad.detach()


# block_spy (conftest.py): the (start, stop) of every streamed block computed


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("case,masked", MASK_CASES, ids=[f"{c[0]}-{'mask' if m else 'nomask'}" for c, m in MASK_CASES])
def test_streamed_equals_unchunked_float64(case, masked, chunk, block_spy):
    _, name, params = case
    z = _z(name)
    mask = _mask(name) if masked else None
    want_loss, want_grad = _loss_and_grad(_build(name, params, score_budget_mb=math.inf), z, mask)
    assert not block_spy, "score_budget_mb=inf must take the unchunked path"
    got_loss, got_grad = _loss_and_grad(_build(name, params, chunk_size=chunk), z, mask)
    # every block was computed, forward and backward: ceil(K / chunk) blocks, twice per streamed call
    blocks = math.ceil(K / chunk)
    assert len(block_spy) >= 2 * blocks and len(block_spy) % blocks == 0
    assert {stop for _, stop in block_spy} >= {K} and all(stop - start <= chunk for start, stop in block_spy)
    assert torch.isfinite(want_loss) and torch.isfinite(want_grad).all() and want_grad.abs().max() > 0
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case,masked", MASK_CASES, ids=[f"{c[0]}-{'mask' if m else 'nomask'}" for c, m in MASK_CASES])
def test_streamed_equals_unchunked_float32_under_bf16_autocast(case, masked, block_spy):
    _, name, params = case
    z = _z(name, samples=40, dim=16, dtype=torch.bfloat16)
    mask = _mask(name, samples=40) if masked else None
    want_loss, want_grad = _loss_and_grad(_build(name, params, score_budget_mb=math.inf), z, mask, autocast=True)
    got_loss, got_grad = _loss_and_grad(_build(name, params, chunk_size=6), z, mask, autocast=True)
    assert block_spy
    # the objectives compute in float32 under autocast; bf16 scores would miss these bounds by far
    assert got_loss.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-4)  # grad rounded to bf16


@pytest.mark.parametrize("name", ["geometric_pvc", "mv_infonce", "multi_crop", "mv_dhel", "er", "fmicl"])
def test_streamed_equals_unchunked_float32(name, block_spy):
    z = _z(name, samples=64, dim=32, dtype=torch.float32)
    want_loss, want_grad = _loss_and_grad(_build(name, {}, score_budget_mb=math.inf), z, None)
    got_loss, got_grad = _loss_and_grad(_build(name, {}, chunk_size=5), z, None)
    assert block_spy
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["geometric_pvc", "mv_infonce", "mv_dhel", "er", "fmicl"])
def test_rows_without_any_candidate(name, block_spy):
    """Only sample 0 has views: its anchors have no negative at all (an empty log-sum-exp).
    Both paths give the same finite loss and gradient (no NaN from the empty rows)."""
    z = _z(name, samples=6)
    mask = torch.zeros(6, _views(name), dtype=torch.bool)
    mask[0] = True
    want_loss, want_grad = _loss_and_grad(_build(name, {}, score_budget_mb=math.inf), z, mask)
    got_loss, got_grad = _loss_and_grad(_build(name, {}, chunk_size=4), z, mask)
    assert block_spy
    assert torch.isfinite(got_loss) and torch.isfinite(got_grad).all()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_ipmc_with_memory_bank_streams_against_detached_bank_entries(block_spy):
    params = {"beta": 0.0, "memory_bank_size": 32, "bank_negatives": 9}
    index = torch.arange(K)
    results = []
    for streaming in ({"score_budget_mb": math.inf}, {"chunk_size": 4}):
        objective = _build("ipmc", params, **streaming)
        objective.on_step_end(_z("ipmc", seed=5), index + 11)  # fill part of the bank
        torch.manual_seed(3)  # the bank's sample of negatives
        z = _z("ipmc").requires_grad_(True)
        loss = objective(z, index=index)
        loss.backward()
        results.append((loss.detach(), z.grad))
    assert block_spy
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-10, atol=1e-12)


# ---- automatic choice ---------------------------------------------------------------------------
def test_plan_block():
    # whole block within the budget: unchunked; beyond: the largest block within the budget (CUDA)
    # or within STREAM_BLOCK_MB (CPU); an explicit chunk always streams
    assert plan_block(100, 1000, 4, None, 1.0, "cuda") is None  # 400 kB <= 1 MB
    assert plan_block(1000, 1000, 4, None, 1.0, "cuda") == 262  # floor(2**20 / 4000)
    assert plan_block(10**7, 1000, 4, None, 1e4, "cuda") == int(1e4 * 2**20 // 4000)
    cpu_block = plan_block(10**7, 1000, 4, None, 1e4, "cpu")
    assert cpu_block == int(_streaming.STREAM_BLOCK_MB["cpu"] * 2**20 // 4000)
    assert plan_block(10, 10**9, 4, None, 1.0, "cuda") == 1  # one sample over budget: blocks of 1
    # on CPU at least MIN_BLOCK_ROWS anchor rows (here 256 / 8 rows per sample = 32 samples of
    # 4 MB), unless the budget is smaller
    assert _streaming.MIN_BLOCK_ROWS == 256
    assert plan_block(10**4, 10**6, 4, None, 1e4, "cpu", rows_per_sample=8) == 32
    assert plan_block(10**4, 10**6, 4, None, 64.0, "cpu", rows_per_sample=8) == 16
    assert plan_block(100, 1000, 4, 7, 1.0, "cpu") == 7 and plan_block(3, 1000, 4, 50, 1.0, "cpu") == 50


def test_defaults_pick_unchunked_at_small_sizes_and_stream_beyond_the_budget(block_spy):
    z = _z("geometric_pvc", samples=64, dim=8, dtype=torch.float32).requires_grad_(True)
    default = get_objective("geometric_pvc")
    assert default.chunk_size is None and default.score_budget_mb == DEFAULT_SCORE_BUDGET_MB
    default(z).backward()
    assert not block_spy
    # [64*3, 64*3] float32 scores = 147 kB > 0.1 MB: streamed, blocks within 0.1 MB (of 2.3 kB per sample)
    small_budget = get_objective("geometric_pvc", score_budget_mb=0.1)
    small_budget(z).backward()
    per_sample = 3 * 64 * 3 * 4
    assert block_spy and max(stop - start for start, stop in block_spy) == int(0.1 * 2**20 // per_sample)


@pytest.mark.parametrize("name", ["geometric_pvc", "fmicl", "er", "ipmc", "avg"])
@pytest.mark.parametrize("bad", [{"chunk_size": 0}, {"chunk_size": 2.5}, {"chunk_size": True}, {"score_budget_mb": 0}, {"score_budget_mb": float("nan")}])
def test_invalid_streaming_parameters_are_named(name, bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        get_objective(name, **bad)


def test_streaming_parameters_are_recipe_keys():
    """Every objective with a large score block takes chunk_size and score_budget_mb."""
    import inspect

    for name in ["geometric_pvc", "arithmetic_pvc", "sufficient_statistics", "simclr", "mv_infonce", "mv_cl1",
                 "multi_crop", "avg", "mv_dhel", "mv_cl2", "er", "fmicl", "ipmc"]:
        parameters = inspect.signature(objective_class(name).__init__).parameters
        assert parameters["chunk_size"].default is None, name
        assert parameters["score_budget_mb"].default == DEFAULT_SCORE_BUDGET_MB, name
        objective = get_objective(name, chunk_size=16, score_budget_mb=64)
        assert (objective.chunk_size, objective.score_budget_mb) == (16, 64.0), name


# ---- memory ----------------------------------------------------------------------------------
MEMORY_K, MEMORY_M, MEMORY_D = 128, 8, 16  # K*M = 1024: a [1024, 1024] float32 score matrix, 4 MiB
SCORE_BYTES = (MEMORY_K * MEMORY_M) ** 2 * 4


def _saved_bytes(objective, z: torch.Tensor) -> int:
    """Total bytes of the tensors autograd saves for backward during ``objective(z)`` (each
    storage counted once)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = objective(z)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["geometric_pvc", "mv_infonce", "mv_cl1", "multi_crop", "sufficient_statistics", "fmicl", "ipmc", "siglip"])
def test_backward_does_not_keep_the_all_pairs_scores(name):
    z = _z(name, samples=MEMORY_K, dim=MEMORY_D, dtype=torch.float32, views=MEMORY_M)
    params = {"beta": 0.0} if name == "ipmc" else {}
    views = _views(name, MEMORY_M)
    entries = MEMORY_K * views * MEMORY_K * views
    unchunked = _saved_bytes(_build(name, params, score_budget_mb=math.inf), z.clone().requires_grad_(True))
    streamed = _saved_bytes(_build(name, params, chunk_size=8), z.clone().requires_grad_(True))
    # the measurement sees the scores when they are kept (else this test could not fail) ...
    assert unchunked >= entries * 4
    # ... and the streamed path keeps O(K M d) (the embeddings, their norms, per-row values):
    # 4 to 8 copies of z here, against 64 for the scores
    embeddings = MEMORY_K * views * MEMORY_D * 4
    assert streamed <= 10 * embeddings < entries * 4 / 4, (streamed, embeddings, entries * 4)


@pytest.mark.parametrize("name", ["mv_dhel", "er", "mv_cl2", "avg"])
def test_backward_does_not_keep_the_within_view_scores(name):
    samples, dim = 512, 8  # the [M, K, N] block is 64 times z here
    z = _z(name, samples=samples, dim=dim, dtype=torch.float32, views=MEMORY_M)
    # within-view [M, K, N]; avg's [M, 2, K, 2, N] (each view against the others' mean)
    entries = MEMORY_M * samples * samples * (4 if name == "avg" else 1)
    unchunked = _saved_bytes(_build(name, {}, score_budget_mb=math.inf), z.clone().requires_grad_(True))
    streamed = _saved_bytes(_build(name, {}, chunk_size=8), z.clone().requires_grad_(True))
    assert unchunked >= entries * 4
    embeddings = samples * MEMORY_M * dim * 4
    assert streamed <= 10 * embeddings < entries * 4 / 4, (streamed, embeddings, entries * 4)


def _peak_live_bytes(objective, z: torch.Tensor) -> int:
    """Peak of live tensor bytes during forward + backward (torch's memory profiler timeline)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
            objective(z).backward()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return int(max(sum(row) for row in sizes))


@pytest.mark.parametrize("name", ["geometric_pvc", "fmicl", "mv_dhel", "siglip"])
def test_peak_memory_is_a_few_blocks_not_the_score_matrix(name):
    """Forward + backward of a mid-size case: the unchunked peak holds the whole score block,
    the streamed one a few blocks of 8 anchor samples plus O(K M d)."""
    within_view = name == "mv_dhel"
    samples, dim = (512, 8) if within_view else (256, 16)  # the score block is 64 or 128 times z
    z = _z(name, samples=samples, dim=dim, dtype=torch.float32, views=MEMORY_M)
    unchunked = _peak_live_bytes(_build(name, {}, score_budget_mb=math.inf), z.clone().requires_grad_(True))
    streamed = _peak_live_bytes(_build(name, {}, chunk_size=8), z.clone().requires_grad_(True))
    per_sample = MEMORY_M * samples * (1 if within_view else MEMORY_M) * 4
    scores, block, embeddings = samples * per_sample, 8 * per_sample, z.numel() * 4
    assert unchunked >= scores
    # f-MICL's critic holds ~4 block-sized temporaries and their gradients
    assert streamed <= 8 * block + 12 * embeddings < scores / 2, (streamed, block, embeddings, scores)


# ---- the benchmark ------------------------------------------------------------------------
def test_bench_scale_runs_both_paths_and_reports_targets(tmp_path):
    from mmviews.cli import main

    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--objectives", "geometric_pvc", "mv_dhel", "--sizes", "32", "64", "--M", "4",
                 "--d", "8", "--repeats", "1", "--unchunked-max", "32", "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["objective"], r["KM"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(n, s, m) for n in ("geometric_pvc", "mv_dhel") for s, m in ((32, "unchunked"), (32, "streamed"), (64, "streamed"))}
    for key, row in rows.items():
        assert "error" not in row, (key, row.get("error"))
        assert row["time_s"] > 0 and row["peak_bytes"] is not None and row["ns_per_entry"] > 0, key
        assert (row["streaming"] == {"score_budget_mb": math.inf}) == (row["mode"] == "unchunked")
    assert rows[("geometric_pvc", 64, "streamed")]["entries"] == 64 * 64
    assert rows[("mv_dhel", 64, "streamed")]["entries"] == 4 * 16 * 16


def test_reduce_tiles_per_device():
    """On CPU the streamed reduction runs on cache-sized tiles; on devices not listed in
    TILE_ELEMENTS (CUDA) on whole blocks: one reduce call per block, with the same result."""
    assert _streaming.tile_samples("cpu", 1000, block=4096) == 2**18 // 1000
    assert _streaming.tile_samples("cpu", 2**20, block=64) == 1  # at least one sample
    assert _streaming.tile_samples("cuda", 1000, block=4096) == 4096

    g = torch.Generator().manual_seed(0)
    anchors = torch.randn(1, 40, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    candidates = torch.randn(1, 4000, 8, generator=g, dtype=torch.float64, requires_grad=True)
    calls: list[tuple[int, int]] = []

    def reduce(scores, start, stop):
        calls.append((start, stop))
        return torch.logsumexp(scores * 1.5, dim=3)

    def run():
        calls.clear()
        out = _streaming.streamed_reduce(anchors, candidates, reduce, (4000,), block=16)
        (out.sin().sum()).backward()
        grads = anchors.grad.clone(), candidates.grad.clone()
        anchors.grad = candidates.grad = None
        return out.detach(), grads, list(calls)

    saved = dict(_streaming.TILE_ELEMENTS)
    try:
        _streaming.TILE_ELEMENTS["cpu"] = 8000 * 4  # 8,000 scores per sample: tiles of 4 samples
        tiled, tiled_grads, tiled_calls = run()
        _streaming.TILE_ELEMENTS.clear()  # as on a device not listed
        whole, whole_grads, whole_calls = run()
    finally:
        _streaming.TILE_ELEMENTS.clear()
        _streaming.TILE_ELEMENTS.update(saved)
    assert len(tiled_calls) == 2 * (4 + 4 + 2)  # forward and backward, blocks of 16, 16 and 8 samples
    assert whole_calls == [(0, 16), (16, 32), (32, 40)] * 2
    torch.testing.assert_close(whole, tiled)
    for a, b in zip(whole_grads, tiled_grads):
        torch.testing.assert_close(a, b)
