"""``mmviews train RECIPE --check`` estimates the peak memory per device and, with
``--memory-budget-gb``, the ``optimisation.encode_chunk_size`` that fits (mmviews.train.memory)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from crafted_files import cli

from mmviews.config import load_config, resolve_recipe
from mmviews.train import build_run
from mmviews.train.memory import (
    GB,
    estimate_memory,
    measure_activations,
    measure_encoder_step,
    saved_activation_bytes,
)
from mmviews.train.step import train_step
from mmviews.train.trainer import _accelerator, _prepare

# The quickstart shrunk: 64 samples, K = 32.
SMALL = ["data.batch_size=32", "data.split_options.train.num_samples=64", "cpu=true"]


@pytest.fixture(scope="module")
def small_estimate():
    """The shrunk quickstart's built run (before any training) and its estimate."""
    parts = build_run(load_config(resolve_recipe("quickstart"), SMALL), 1, with_eval=False)
    before = {k: v.clone() for k, v in parts.encoder.state_dict().items()}
    return parts, estimate_memory(parts, measure_slack=False), before


def test_activation_estimate_matches_a_real_step(tmp_path: Path, small_estimate) -> None:
    """Activations measured on 2 and 4 samples, scaled to K = 32, against the bytes autograd saves
    in one real training step at K = 32 (encoder and objective): within 25 %."""
    parts, estimate, before = small_estimate
    assert estimate.activation_per_sample > 0 and estimate.samples_per_device == 32
    p = _prepare(_accelerator(parts.config, tmp_path, []), parts)
    for k, v in p.model.state_dict().items():  # the measurement left weights and BatchNorm statistics alone
        assert (v == before[k]).all(), k
    p.model.train()
    params = {q.untyped_storage().data_ptr() for q in p.model.parameters()}
    real = saved_activation_bytes(lambda: train_step(p, next(iter(p.train_loader)), None), params)
    estimated = estimate.activations  # the plain step: K/N = 32 samples' activations
    assert real / 1.25 <= estimated <= real * 1.25, (real, estimated)


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
    assert "(adamw)" in out and "MiB per sample (measured) x 32" in out
    # 10 MB: less than the process itself (the measured baseline)
    assert "does not fit the budget of 0.01 GiB per device: even with optimisation.encode_chunk_size 1" in out
    assert "process baseline" in out
    assert "fits the budget of" not in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_bad_budget_is_refused(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as raised:
        cli(capsys, "train", "quickstart", "--check", "--memory-budget-gb", value)
    assert raised.value.code == 2
    assert f"argument --memory-budget-gb: must be a positive number of GiB per device, got '{value}'" in capsys.readouterr().err


def test_budget_without_check_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "train", "quickstart", "--memory-budget-gb", "8")
    assert rc == 2 and "--memory-budget-gb applies with --check" in err


# ---------------------------------------------------------------------------------------------
# Each part of the estimate against a figure measured or counted on the real objects (not a
# formula rebuilt here): the parameters and gradients of the model, the optimiser's state after a
# real step, the cached step's embeddings and their gradient, the EMA teacher the trainer keeps.
# The guards take the run and recompute the estimate, so that the breaks of tests/mutations.py
# (applied before the call) reach them.
# ---------------------------------------------------------------------------------------------
def _storage_bytes(tensors) -> int:
    """Bytes of distinct storages, counted here (numel x element size of each storage's tensor)."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _static_estimate(parts, chunk=None):
    """The estimate without measuring activations (its static parts are counted)."""
    return estimate_memory(parts, 1, chunk, activations=(0.0, 0.0))


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """The shrunk quickstart (a run of its own) prepared as the trainer prepares it, after one real
    AdamW step, with the gradients of a real backward on the first batch (counted before the
    optimiser clears them)."""
    parts = build_run(load_config(resolve_recipe("quickstart"), SMALL), 1, with_eval=False)
    p = _prepare(_accelerator(parts.config, tmp_path_factory.mktemp("stepped"), []), parts)
    p.model.train()
    batch = next(iter(p.train_loader))
    z, mask = p.model(batch)
    p.objective.compute(z, mask).loss.backward()
    grads = _storage_bytes([q.grad for q in p.model.parameters() if q.grad is not None])
    p.optimizer.zero_grad(set_to_none=True)
    train_step(p, batch, None)
    return parts, p, grads


def check_parameters_and_gradients(parts, p, grads: int) -> None:
    estimate = _static_estimate(parts)
    model = p.accelerator.unwrap_model(p.model)
    assert estimate.parameters == _storage_bytes([*model.parameters(), *model.buffers()])
    assert estimate.gradients == grads > 0


def test_parameters_and_gradients_are_the_models(stepped) -> None:
    check_parameters_and_gradients(*stepped)


def check_optimizer_state(parts, p) -> None:
    """AdamW's exp_avg and exp_avg_sq after a real step (its 0-d step counters are 4 bytes each)."""
    held = _storage_bytes([t for state in p.optimizer.state.values() for t in state.values()
                           if isinstance(t, torch.Tensor) and t.ndim > 0])
    assert held > 0 and _static_estimate(parts).optimizer_state == held


def test_optimizer_state_is_what_the_optimizer_holds(stepped) -> None:
    check_optimizer_state(*stepped[:2])


def check_cached_embeddings(parts, p, chunk: int = 32) -> None:
    """The cached step's ``z`` (the objective's input, a leaf) and its gradient, taken from a real
    cached-embedding step (one chunk of all K = 32 samples: the shapes the plain step already ran,
    so no new kernels to set up; the embeddings do not depend on the chunk)."""
    from mmviews.train.step import cached_train_step

    held = []
    compute = p.objective.compute

    def spy(z, *args, **kwargs):
        held.append(z)
        return compute(z, *args, **kwargs)

    p.objective.compute = spy
    try:
        cached_train_step(p, next(iter(p.train_loader)), None, chunk)
    finally:
        del p.objective.compute
    (z,) = held
    assert z.grad is not None
    assert _static_estimate(parts, chunk).cached_embeddings == _storage_bytes([z, z.grad]) > 0


def test_cached_embeddings_are_the_cached_steps(stepped) -> None:
    check_cached_embeddings(*stepped[:2])


def test_teacher_is_the_trainers_copy(tmp_path: Path) -> None:
    config = load_config(resolve_recipe("quickstart"), [*SMALL, "objective.name=er", "objective.ema_teacher=true",
                                                        "objective.params={}"])
    parts = build_run(config, 1, with_eval=False)
    p = _prepare(_accelerator(parts.config, tmp_path, []), parts)
    assert p.teacher is not None
    assert _static_estimate(parts).teacher == _storage_bytes([*p.teacher.parameters(), *p.teacher.buffers()]) > 0


def check_working_memory(parts, estimate) -> None:
    """The step's peak of live tensors measured on 6 samples against the estimate's activations and
    working memory from 2 and 4 samples (what lives at the peak: saved tensors and the rest)."""
    (six,) = measure_encoder_step(parts, (6,))
    at_six = dataclasses.replace(estimate, samples_per_device=6)
    predicted = at_six.saved_activations + at_six.working
    assert six.peak / 1.1 <= predicted <= six.peak * 1.1, (six.peak, predicted)
    assert six.saved / 1.1 <= at_six.saved_activations <= six.saved * 1.1


def test_working_memory_extrapolates(small_estimate) -> None:
    check_working_memory(*small_estimate[:2])


# mutation tests: each break of tests/mutations.py makes its guard fail
@pytest.mark.parametrize("name,guard", [
    ("drop_optimizer_state", lambda stepped, small: check_optimizer_state(*stepped[:2])),
    ("halve_cached_embeddings", lambda stepped, small: check_cached_embeddings(*stepped[:2])),
    ("double_activations", lambda stepped, small: check_working_memory(*small[:2])),
])
def test_memory_guards_fail_when_a_part_is_broken(monkeypatch, stepped, small_estimate, name, guard) -> None:
    from mutations import apply_break

    apply_break(name, monkeypatch.setattr)
    with pytest.raises(AssertionError, match="assert"):
        guard(stepped, small_estimate)
