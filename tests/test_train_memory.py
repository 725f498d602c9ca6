"""``mmviews train RECIPE --check`` estimates the peak memory per device and, with
``--memory-budget-gb``, the ``optimisation.encode_chunk_size`` that fits (mmviews.train.memory)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from crafted_files import cli

from mmviews.config import load_config, resolve_recipe
from mmviews.train import build_run
from mmviews.train.memory import GB, estimate_memory, measure_activations, saved_activation_bytes
from mmviews.train.step import train_step
from mmviews.train.trainer import _accelerator, _prepare

# The quickstart shrunk: 64 samples, K = 32.
SMALL = ["data.batch_size=32", "data.split_options.train.num_samples=64", "cpu=true"]


@pytest.fixture(scope="module")
def small_estimate():
    """The shrunk quickstart's built run (before any training) and its estimate."""
    parts = build_run(load_config(resolve_recipe("quickstart"), SMALL), 1, with_eval=False)
    before = {k: v.clone() for k, v in parts.encoder.state_dict().items()}
    return parts, estimate_memory(parts), before


def test_activation_estimate_matches_a_real_step(tmp_path: Path, small_estimate) -> None:
    """Activations measured on 2 and 4 samples, scaled to K = 32, against the bytes autograd saves
    in one real training step at K = 32 (encoder and objective): within a factor of 1.5."""
    parts, estimate, before = small_estimate
    assert estimate.activation_per_sample > 0 and estimate.samples_per_device == 32
    p = _prepare(_accelerator(parts.config, tmp_path, []), parts)
    for k, v in p.model.state_dict().items():  # the measurement left weights and BatchNorm statistics alone
        assert (v == before[k]).all(), k
    p.model.train()
    params = {q.untyped_storage().data_ptr() for q in p.model.parameters()}
    real = saved_activation_bytes(lambda: train_step(p, next(iter(p.train_loader)), None), params)
    estimated = estimate.activation_fixed + 32 * estimate.activation_per_sample
    assert real / 1.5 <= estimated <= real * 1.5, (real, estimated)


def test_chunks_and_checkpointing_lower_the_estimate(small_estimate) -> None:
    plain = small_estimate[1]
    sizes = [plain.with_chunk(c).total for c in (1, 2, 4, 8, 16, 32)]
    assert sizes == sorted(sizes) and sizes[0] < plain.total  # monotone in the chunk; below the plain step
    assert plain.with_chunk(32).activations > plain.activations  # a chunk of all K adds the cached embeddings
    assert dataclasses.replace(plain, samples_per_device=64).total > plain.total
    checkpointed = load_config(resolve_recipe("quickstart"), [*SMALL, *[f"adapters.{m}.gradient_checkpointing=true"
                                                                       for m in ("text", "audio", "image", "flow")]])
    fixed, per_sample = measure_activations(build_run(checkpointed, 1, with_eval=False))
    assert per_sample < 0.7 * plain.activation_per_sample, (per_sample, plain.activation_per_sample)


def test_suggested_chunk_fits_the_budget_by_its_own_estimate(small_estimate) -> None:
    estimate = small_estimate[1]
    budget = (estimate.with_chunk(4).total + estimate.with_chunk(8).total) / 2  # between chunk 4 and chunk 8
    assert estimate.largest_chunk_within(budget) == 4
    advice = estimate.advice(budget / GB)
    assert "does not fit" in advice and "encode_chunk_size: 4" in advice
    assert estimate.advice(2 * estimate.total / GB).startswith("fits the budget")
    assert "even with optimisation.encode_chunk_size 1" in estimate.advice(estimate.static / 2 / GB)


def test_check_prints_the_estimate_and_the_advice(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "train", "quickstart", "--check", "--memory-budget-gb", "0.01",
                     *[w for s in SMALL for w in ("--set", s)])
    assert rc == 0
    lines = out.splitlines()
    assert lines[1].startswith("estimated peak memory per device (plain step; K = 32 samples, M = 4 views, N = 1")
    for part in ("parameters", "gradients", "optimiser state", "activations", "objective"):
        assert any(line.strip().startswith(part) for line in lines), part
    assert "(adamw)" in out and "MB per sample (measured) x 32" in out
    assert "does not fit the budget of 0.01 GB per device" in out and "optimisation.encode_chunk_size:" in out
    assert "fits the budget of" not in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_bad_budget_is_refused(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as raised:
        cli(capsys, "train", "quickstart", "--check", "--memory-budget-gb", value)
    assert raised.value.code == 2
    assert f"argument --memory-budget-gb: must be a positive number of GB per device, got '{value}'" in capsys.readouterr().err


def test_budget_without_check_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "train", "quickstart", "--memory-budget-gb", "8")
    assert rc == 2 and "--memory-budget-gb applies with --check" in err
