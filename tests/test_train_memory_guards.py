"""Unit guards of mmviews.train.memory, part by part: the report ``mmviews train --check`` prints
(every line, its figures and units), the advice for a budget, the byte counting helpers, the
extrapolations and the readings of the process's memory. Every figure is counted by hand from
inputs chosen so that it is exact (whole MiB or GiB), not copied from a run of the code.
In-process and tiny: well under a second in all, apart from the one tiny run built at the end."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mmviews.train.memory as memory
from mmviews.train.memory import GB, MemoryEstimate

MiB = 2**20


# ---------------------------------------------------------------------------------------------
# Sizes as printed: binary units, GiB from a tenth of a GiB up, MiB below it.
# ---------------------------------------------------------------------------------------------
def test_sizes_print_in_binary_units_switching_at_a_tenth_of_a_gib() -> None:
    assert memory._gb(3 * GB) == "3.00 GiB"
    assert memory._gb(5 * MiB) == "5.0 MiB"
    assert memory._gb(1.5 * MiB) == "1.5 MiB"
    # 0.1 GiB = 107374182.4 bytes: the first whole byte at or above it prints in GiB, the one below in MiB
    assert memory._gb(107374183) == "0.10 GiB"
    assert memory._gb(107374182) == "102.4 MiB"
    assert memory._gb(0) == "0.0 MiB"


# ---------------------------------------------------------------------------------------------
# The report, line by line. Two estimates cover every optional line: a plain step on the host
# (N = 2, sharded, teacher, sample cache, framework state, slack, prefetching workers) and a
# cached step on a device (N = 1, the host parts shown but not counted, an evaluation).
# ---------------------------------------------------------------------------------------------
def _estimate(**fields) -> MemoryEstimate:
    return MemoryEstimate(**fields)


def host_plain_step() -> MemoryEstimate:
    """K = 32 on N = 2 processes, 16 samples each. Host: 16 + 8 + 4 = 28 MiB; weights: 1 + 2 + 4 +
    3 teacher + 6 gathered = 16 MiB; batch 0.25 MiB x 16 x (1 + 2 prefetched) = 12 MiB; encoder:
    2 + 0.5 x 16 = 10 MiB saved, 1 + 0.25 x 16 = 5 MiB working, 5 MiB slack; objective 7 MiB.
    Step 28 + 16 + 12 + 20 + 7 = 83 MiB; the evaluation (nothing extracted) 28 + 16 - 2 = 42 MiB."""
    return _estimate(samples_per_device=16, num_views=3, embed_dim=8, num_processes=2, chunk_size=None,
                     parameters=1 * MiB, gradients=2 * MiB, optimizer_state=4 * MiB, teacher=3 * MiB,
                     activation_fixed=2 * MiB, activation_per_sample=0.5 * MiB, objective=7 * MiB, optimizer="adamw",
                     working_fixed=1 * MiB, working_per_sample=0.25 * MiB, batch_per_sample=0.25 * MiB,
                     prefetched_batches=2, baseline=16 * MiB, sample_cache=4 * MiB, on_host=True,
                     allocator_slack=5 * MiB, framework=8 * MiB, sharded=True, gathered=6 * MiB)


def device_cached_step() -> MemoryEstimate:
    """K = 8 on one device, chunks of 4: [8, 2, 2^16] float32 embeddings and their gradient are
    2 x 4 x 8 x 2 x 2^16 = 8 MiB; one chunk's activations 2 + 1 x 4 = 6 MiB, working 0.5 x 4 =
    2 MiB. Host parts (16 + 4 + 4 MiB) not counted. Step: weights 1 + 2 + 2 = 5, batch 1 x 8 = 8,
    embeddings 8 and the larger of the encoder's 8 and the objective's 3: 29 MiB. Evaluation:
    5 - 2 + 20 extracted + 1 + 2 + 3 for one batch = 29 MiB... + 1: see the figures below."""
    return _estimate(samples_per_device=8, num_views=2, embed_dim=2**16, num_processes=1, chunk_size=4,
                     parameters=1 * MiB, gradients=2 * MiB, optimizer_state=2 * MiB, teacher=0,
                     activation_fixed=2 * MiB, activation_per_sample=1 * MiB, objective=3 * MiB, optimizer="sgd",
                     working_fixed=0.0, working_per_sample=0.5 * MiB, batch_per_sample=1 * MiB, prefetched_batches=0,
                     baseline=16 * MiB, sample_cache=4 * MiB, evaluation=21 * MiB, evaluation_batch=1 * MiB,
                     evaluation_forward=2 * MiB, evaluation_slack=3 * MiB, on_host=False, framework=4 * MiB)


def test_the_report_of_a_plain_step_on_the_host_line_by_line() -> None:
    e = host_plain_step()
    assert (e.step, e.evaluating, e.total) == (83 * MiB, 42 * MiB, 83 * MiB)
    assert e.lines() == [
        "estimated peak memory per device (plain step; K = 32 samples, M = 3 views, N = 2 processes, "
        "16 samples per device; resident set of the process): 83.0 MiB",
        "  process baseline  16.0 MiB (measured: interpreter, libraries, datasets)",
        "  framework state   8.0 MiB (measured: what the process keeps once it has run a step: kernels, their caches)",
        "  sample cache      4.0 MiB (data.cache: every split's samples)",
        "  parameters        1.0 MiB",
        "  gradients         2.0 MiB",
        "  optimiser state   4.0 MiB (adamw)",
        "  gathered units    6.0 MiB (distributed.sharding: fsdp: the parameters, gradients and optimiser state "
        "above are 1/2 each; the largest unit held whole, twice)",
        "  EMA teacher       3.0 MiB",
        "  batch             12.0 MiB (0.250 MiB per sample x 16, and 2 prefetched by the loader's workers)",
        "  activations       10.0 MiB (0.50 MiB per sample (measured) x 16)",
        "  backward working  5.0 MiB (0.25 MiB per sample (measured) x 16)",
        "  objective         7.0 MiB (measured: loss and backward on [K, M, d] embeddings)",
        "  allocator slack   5.0 MiB (measured: a reference step's resident-set growth beyond its tensors)",
    ]


def test_the_report_of_a_cached_step_on_a_device_line_by_line() -> None:
    """Step: 5 + 8 + 8 + max(6 + 2, 3) = 29 MiB; evaluation: 5 - 2 + 21 + (1 + 2 + 3) = 30 MiB, the
    larger: the estimate."""
    e = device_cached_step()
    assert (e.step, e.evaluating, e.total) == (29 * MiB, 30 * MiB, 30 * MiB)
    not_counted = " (host memory, not in the total)"
    assert e.lines() == [
        "estimated peak memory per device (cached step, encode_chunk_size 4; K = 8 samples, M = 2 views, "
        "N = 1 process, 8 samples per device; device memory): 30.0 MiB",
        "  process baseline  16.0 MiB (measured: interpreter, libraries, datasets)" + not_counted,
        "  framework state   4.0 MiB (measured: what the process keeps once it has run a step: kernels, "
        "their caches)" + not_counted,
        "  sample cache      4.0 MiB (data.cache: every split's samples)" + not_counted,
        "  parameters        1.0 MiB",
        "  gradients         2.0 MiB",
        "  optimiser state   2.0 MiB (sgd)",
        "  batch             8.0 MiB (1.000 MiB per sample x 8)",
        "  activations       14.0 MiB (1.00 MiB per sample (measured) x 4 + [K/N, M, d] embeddings and gradient "
        "8.0 MiB)",
        "  backward working  2.0 MiB (0.50 MiB per sample (measured) x 4)",
        "  objective         3.0 MiB (measured: loss and backward on [K, M, d] embeddings)",
        "  evaluation        21.0 MiB extracted embeddings + 6.0 MiB for one evaluation batch encoded (measured); "
        "evaluation peak 30.0 MiB, the training step's 29.0 MiB: the estimate is the larger",
    ]


def test_the_report_ends_with_the_advice_when_a_budget_is_given() -> None:
    e = host_plain_step()
    lines = e.lines(budget_gb=1.0)
    assert lines[:-1] == e.lines() and lines[-1] == "fits the budget of 1 GiB per device (83.0 MiB estimated)"


# ---------------------------------------------------------------------------------------------
# The advice for a budget, on an estimate counted in whole GiB: K/N = 8, host 1 GiB, weights
# 1 + 1 + 2 = 4 GiB, 1 GiB of activations per sample, objective 1 GiB, [8, 2, 2^25] embeddings
# and gradient = 2 x 4 x 8 x 2 x 2^25 bytes = 4 GiB... see budget_estimate.
# ---------------------------------------------------------------------------------------------
def budget_estimate(chunk: int | None = None) -> MemoryEstimate:
    """Plain step: 1 + 4 + 8 x 1 + 1 = 14 GiB. Cached step with chunk C: 1 + 4 + 0.5 (embeddings
    [8, 2, 2^22] and gradient: 2 x 4 x 8 x 2 x 2^22 bytes) + max(C, 1): 6.5, 7.5, 9.5, 13.5 GiB for
    C = 1, 2, 4, 8. The evaluation's peak (1 + 4 - 1 = 4 GiB) never decides."""
    return _estimate(samples_per_device=8, num_views=2, embed_dim=2**22, num_processes=1, chunk_size=chunk,
                     parameters=1 * GB, gradients=1 * GB, optimizer_state=2 * GB, teacher=0, activation_fixed=0.0,
                     activation_per_sample=1.0 * GB, objective=1 * GB, optimizer="adamw", baseline=1 * GB)


def test_the_chunk_estimates_the_advice_chooses_from() -> None:
    assert budget_estimate().total == 14 * GB
    assert [budget_estimate(c).total for c in (1, 2, 4, 8)] == [6.5 * GB, 7.5 * GB, 9.5 * GB, 13.5 * GB]


def test_advice_when_the_estimate_fits_exactly_at_the_budget_and_not_one_byte_below() -> None:
    e = budget_estimate()
    assert e.advice(14) == "fits the budget of 14 GiB per device (14.00 GiB estimated)"
    assert e.advice(15.5) == "fits the budget of 15.5 GiB per device (14.00 GiB estimated)"
    assert e.advice((14 * GB - 1) / GB).startswith("does not fit the budget of 14 GiB per device (14.00 GiB estimated")


def test_advice_names_the_largest_chunk_that_fits_and_the_plain_steps_estimate() -> None:
    """From a cached step of chunk 8 (13.5 GiB) the advice quotes the plain step (14 GiB) apart."""
    assert budget_estimate(8).advice(10) == (
        "does not fit the budget of 10 GiB per device (13.50 GiB estimated; the plain step 14.00 GiB): set "
        "optimisation.encode_chunk_size: 4 (estimated 9.50 GiB; the same K negatives, encoders run twice per step; "
        "adapters' gradient_checkpointing: true lowers the activations per sample further)")
    assert "encode_chunk_size: 1 (estimated 6.50 GiB;" in budget_estimate().advice(6.5)


def test_advice_when_not_even_a_chunk_of_one_fits() -> None:
    """Chunk 1 is 6.5 GiB; the process and the weights alone 1 + 4 = 5 GiB."""
    assert budget_estimate().advice(6) == (
        "does not fit the budget of 6 GiB per device: even with optimisation.encode_chunk_size 1 the estimate is "
        "6.50 GiB (the process, weights, gradients and optimiser state alone take 5.00 GiB); fine-tune fewer "
        "parameters (finetune.mode, LoRA), use more devices, or a smaller K")


def test_chunk_search_tries_powers_of_two_from_one_up_to_k_over_n() -> None:
    e = budget_estimate()
    assert e.largest_chunk_within(6.5 * GB) == 1 and e.largest_chunk_within(6.5 * GB - 1) is None
    assert e.largest_chunk_within(13.5 * GB) == 8 and e.largest_chunk_within(10**15) == 8  # never past K/N
    assert e.largest_chunk_within(9.5 * GB) == 4 and e.largest_chunk_within(9.5 * GB - 1) == 2
    # K/N = 1: the only chunk is 1
    assert dataclasses.replace(e, samples_per_device=1).largest_chunk_within(10**15) == 1


# ---------------------------------------------------------------------------------------------
# Counting bytes.
# ---------------------------------------------------------------------------------------------
def test_tensor_bytes_counts_each_storage_once_and_whole() -> None:
    weights = torch.zeros(10)  # 40 bytes
    other = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    assert memory.tensor_bytes([weights, weights[2:5], weights.view(2, 5), other]) == 64
    assert memory.tensor_bytes([weights[2:5]]) == 40  # a slice holds its whole storage
    assert memory.tensor_bytes([]) == 0


@dataclasses.dataclass
class _Batch:
    values: torch.Tensor
    names: list[str]


def test_leaves_are_found_in_mappings_sequences_and_dataclasses() -> None:
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    obj = {"x": a, "nested": [b, ("text", c)], "batch": _Batch(d, ["one", "two"]), "kind": _Batch, "n": 3}
    assert [t.numel() for t in memory.tensors_in(obj)] == [1, 2, 3, 4]  # the dataclass type itself is not walked
    assert list(memory.leaves_in(obj, str)) == ["text", "one", "two"]
    assert list(memory.leaves_in("alone", str)) == ["alone"]


@pytest.mark.parametrize("optimizer,momentum,copies", [
    ("adamw", 0.0, 2), ("adamw", 0.9, 2), ("lars", 0.0, 1), ("lars", 0.9, 1), ("sgd", 0.9, 1), ("sgd", 0.01, 1),
    ("sgd", 0.0, 0), ("other", 0.9, 0)])
def test_optimizer_state_is_two_moments_for_adamw_one_buffer_for_momentum(optimizer: str, momentum: float,
                                                                         copies: int) -> None:
    assert memory.optimizer_state_bytes(optimizer, 1000, momentum) == copies * 1000


def test_saved_activations_are_distinct_storages_without_the_excluded() -> None:
    x = torch.ones(4, requires_grad=True)  # 16 bytes
    # exp saves its output (16 bytes); x * x saves x twice (one storage)
    assert memory.saved_activation_bytes(lambda: x.exp().sum().backward(), set()) == 16
    assert memory.saved_activation_bytes(lambda: (x * x).sum().backward(), set()) == 16
    excluded = {x.untyped_storage().data_ptr()}
    assert memory.saved_activation_bytes(lambda: (x * x).sum().backward(), excluded) == 0
    assert memory.saved_activation_bytes(lambda: (x * x.exp()).sum().backward(), excluded) == 16


def test_live_tensor_bytes_follows_allocations_and_frees() -> None:
    before = torch.zeros(1000)  # made before: not counted
    live = memory.LiveTensorBytes()
    with live:
        a = torch.zeros(256)  # 1024 bytes
        b = torch.zeros(512)  # 2048
        b.add_(1)  # in place: the same storage
        view = b[:10]  # a view: no new storage
        del a
        c = torch.zeros(128)  # 512 after 1024 went
        doubled = before * 2  # 4000: a new tensor from one made before
        assert live.live == 2048 + 512 + 4000
        del doubled
    assert live.peak == 2048 + 512 + 4000 and live.live == 2048 + 512
    del view, b, c
    assert live.live == 0  # released when the last tensor of each storage goes


def test_live_tensor_bytes_leaves_meta_tensors_out() -> None:
    live = memory.LiveTensorBytes()
    with live:
        torch.empty(10**6, device="meta").add_(1)
        kept = torch.zeros(4)
    assert live.peak == 16 and kept.numel() == 4


# ---------------------------------------------------------------------------------------------
# Lines through measurements.
# ---------------------------------------------------------------------------------------------
def test_linear_goes_through_the_first_and_last_points() -> None:
    assert memory._linear([(2, 100.0), (4, 160.0)]) == (40.0, 30.0)
    assert memory._linear([(2, 100.0), (3, 1000.0), (4, 160.0)]) == (40.0, 30.0)  # the middle one ignored
    assert memory._linear([(2, 100.0), (6, 60.0)]) == (100.0, 0.0)  # never a negative cost per sample
    assert memory._linear([(2, 10.0), (4, 60.0)]) == (0.0, 25.0)  # nor a negative fixed cost


class _Scores(nn.Module):
    def __init__(self, score_budget_mb: float | None = None) -> None:
        super().__init__()
        if score_budget_mb is not None:
            self.score_budget_mb = score_budget_mb


def test_objective_bytes_counted_from_shapes() -> None:
    """K = 4, M = 2, d = 8: embeddings and gradient 2 x 4 x 64 = 512 bytes; scores 4 x 8^2 = 256
    bytes each, two blocks, capped by score_budget_mb when it is less."""
    assert memory.objective_bytes(_Scores(), 4, 2, 8) == 512 + 2 * 256
    assert memory.objective_bytes(_Scores(float("inf")), 4, 2, 8) == 512 + 2 * 256
    assert memory.objective_bytes(_Scores(100 / MiB), 4, 2, 8) == 512 + 2 * 100
    assert memory.objective_bytes(_Scores(256 / MiB), 4, 2, 8) == 512 + 2 * 256
    assert memory.objective_bytes(_Scores(1.0), 4, 2, 8) == 512 + 2 * 256


def test_objective_beyond_the_measured_size_is_extrapolated_from_two_smaller_ones(monkeypatch) -> None:
    """A peak that is exactly b K + c K^2 (b = 24, c = 40) is extrapolated exactly, from the
    largest K / 2^j <= 512 and half of it; at 512 and below, measured at K itself."""
    asked = []

    def peak(objective, K, M, d):
        asked.append(K)
        return 24 * K + 40 * K * K

    monkeypatch.setattr(memory, "_objective_peak", peak)
    assert memory.OBJECTIVE_MEASURED_K == 512
    for K, measured in ((512, [512]), (100, [100]), (513, [128, 256]), (1024, [256, 512]), (3000, [187, 375])):
        asked.clear()
        assert memory.measure_objective_bytes(_Scores(), K, 2, 8) == 24 * K + 40 * K * K, K
        assert asked == measured, K


def test_objective_extrapolation_never_goes_negative(monkeypatch) -> None:
    """A peak falling with K (a measurement's noise) gives no negative growth: c = 0, and the
    cost per sample of the larger point (4000 / 512) carries on linearly."""
    monkeypatch.setattr(memory, "_objective_peak", lambda o, K, M, d: 8000 if K == 256 else 4000)
    assert memory.measure_objective_bytes(_Scores(), 1024, 2, 8) == int((8000 / 256) * 1024)
    monkeypatch.setattr(memory, "_objective_peak", lambda o, K, M, d: K * K if K == 256 else 10 * K * K)
    # c = (10 x 512 - 256) / 256 = 19; b = 256 / 256 ... = 1 - 19 x 256 < 0: 0
    assert memory.measure_objective_bytes(_Scores(), 1024, 2, 8) == 19 * 1024 * 1024


class _Failing(_Scores):
    def compute(self, z, mask, index=None, teacher=None):
        raise RuntimeError("needs real inputs")


@pytest.mark.parametrize("K", [8, 1024])
def test_objective_that_cannot_run_on_random_inputs_is_counted_instead(K: int) -> None:
    assert memory.measure_objective_bytes(_Failing(), K, 2, 8) == memory.objective_bytes(_Failing(), K, 2, 8)
