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
    MemoryEstimate,
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


@pytest.mark.parametrize("name,guard", [
    ("drop_framework_state", lambda: test_every_part_is_in_the_plain_steps_peak(True)),
    ("drop_allocator_slack", lambda: test_every_part_is_in_the_plain_steps_peak(True)),
    ("cached_peak_without_embeddings", lambda: test_every_part_is_in_the_cached_steps_peak(4, 4)),
    ("chunk_search_stops_below_bound", lambda: test_chunk_search_at_its_exact_bound_and_one_past_it(16)),
])
def test_peak_guards_fail_when_a_part_is_dropped(monkeypatch, name, guard) -> None:
    """Mutation test: a part left out of the peak, or the chunk search's bound moved by one, fails
    the arithmetic guards above (no run built: milliseconds)."""
    from mutations import apply_break

    apply_break(name, monkeypatch.setattr)
    with pytest.raises(AssertionError):
        guard()


# ---------------------------------------------------------------------------------------------
# How the parts add up to the peak: each part given a distinct power of two (so that a part
# dropped, doubled or counted in the wrong phase changes the total by an amount that names it),
# the plain step, the cached step and the evaluation written out here from the module's
# description, not from its code. Pure arithmetic: milliseconds per case.
# ---------------------------------------------------------------------------------------------
MB = 2**20
PARTS = dict(parameters=1 * MB, gradients=2 * MB, optimizer_state=4 * MB, teacher=8 * MB, baseline=16 * MB,
             framework=32 * MB, sample_cache=64 * MB, allocator_slack=128 * MB, objective=256 * MB,
             activation_fixed=512 * MB, activation_per_sample=1024.0, working_fixed=2048 * MB,
             working_per_sample=4096.0, batch_per_sample=8192.0, prefetched_batches=2, evaluation=0)


def _parts(**changes) -> MemoryEstimate:
    fields = dict(samples_per_device=16, num_views=3, embed_dim=8, num_processes=1, chunk_size=None, optimizer="adamw",
                  on_host=True, **PARTS)
    fields.update(changes)
    return MemoryEstimate(**fields)


def _expected_step(e: MemoryEstimate, encoded: int, cached: bool) -> int:
    host = e.baseline + e.framework + e.sample_cache if e.on_host else 0
    weights = e.parameters + e.gradients + e.optimizer_state + e.teacher
    batches = e.batch_per_sample * e.samples_per_device * (1 + e.prefetched_batches)
    encoder = (e.activation_fixed + e.activation_per_sample * encoded + e.working_fixed
               + e.working_per_sample * encoded + e.allocator_slack)
    if not cached:
        return int(host + weights + batches + encoder + e.objective)
    embeddings = 2 * 4 * e.samples_per_device * e.num_views * e.embed_dim  # [K/N, M, d] float32 and its gradient
    return int(host + weights + batches + embeddings + max(encoder, e.objective))


@pytest.mark.parametrize("on_host", [True, False])
def test_every_part_is_in_the_plain_steps_peak(on_host: bool) -> None:
    e = _parts(on_host=on_host)
    assert e.step == e.total == _expected_step(e, 16, cached=False)
    # each part alone: the total moves by exactly that part (host parts only on the host)
    for name in ("parameters", "gradients", "optimizer_state", "teacher", "allocator_slack", "objective",
                 "activation_fixed", "working_fixed", "baseline", "framework", "sample_cache"):
        without = _parts(on_host=on_host, **{name: 0})
        host_part = name in ("baseline", "framework", "sample_cache")
        assert e.total - without.total == (0 if host_part and not on_host else PARTS[name]), name


@pytest.mark.parametrize("chunk,encoded", [(4, 4), (16, 16), (64, 16)])
def test_every_part_is_in_the_cached_steps_peak(chunk: int, encoded: int) -> None:
    """One chunk's activations (min(C, K/N)), the cached embeddings and their gradient beside the
    larger of the encoder's phase and the objective's."""
    e = _parts(chunk_size=chunk)
    assert e.encoded_at_once == encoded and e.cached_embeddings == 2 * 4 * 16 * 3 * 8
    assert e.step == e.total == _expected_step(e, encoded, cached=True)
    # the objective's phase larger than the encoder's: the peak follows the objective
    big_objective = _parts(chunk_size=chunk, objective=2**40)
    assert big_objective.total == _expected_step(big_objective, encoded, cached=True)
    assert big_objective.total - _parts(chunk_size=chunk, objective=2**40, allocator_slack=0).total == 0


def test_the_evaluations_peak_holds_no_gradients() -> None:
    """The evaluation holds the weights, optimiser state, teacher and the extracted embeddings,
    not the gradients; the peak is the larger of it and the step."""
    e = _parts(evaluation=2**40)
    evaluating = (e.baseline + e.framework + e.sample_cache + e.parameters + e.optimizer_state + e.teacher
                  + e.evaluation)
    assert e.evaluating == e.total == evaluating
    assert _parts(evaluation=2**40, gradients=0).total == e.total  # no gradient term in the evaluation's peak
    assert _parts(evaluation=0).total == _expected_step(e, 16, cached=False)


@pytest.mark.parametrize("samples_per_device", [8, 16, 24])
def test_chunk_search_at_its_exact_bound_and_one_past_it(samples_per_device: int) -> None:
    """The budget exactly at a chunk's estimate fits it, one byte less does not; the largest chunk
    tried is the largest power of two <= K/N (K/N itself when it is one), never beyond."""
    e = _parts(samples_per_device=samples_per_device, objective=0)  # the encoder's phase decides: monotone in C
    top = 2 ** (samples_per_device.bit_length() - 1)  # largest power of two <= K/N
    for c in (1, 2, top):
        fits = e.with_chunk(c).total
        assert e.largest_chunk_within(fits) == c
        assert e.largest_chunk_within(fits - 1) == (c // 2 or None)
    assert e.largest_chunk_within(10**15) == top


# ---------------------------------------------------------------------------------------------
# The measured host parts reach the estimate: the process's resident set read before the first
# step (baseline, less the parameters) and after the trial steps (the framework state), and the
# reference step's resident-set growth beyond its live tensors (the allocator's slack). The
# readings are given here (the process's own depend on what ran before in it), so each figure is
# known exactly.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory: pytest.TempPathFactory):
    """A tiny run at K = 8 (its reference step, 8 samples, is larger than the trial steps of 2 and
    4: the slack is measured): three training views (image, its augmented copy, audio) and two
    evaluation views (one natural view per modality); splits of 24, 8 and 16 samples, a probe."""
    from test_train_utils import tiny_config, write_recipe

    raw = tiny_config(text=False, batch_size=8, tasks=["linear:class"])
    raw["data"]["split_options"] = {"train": {"num_samples": 24}, "valid": {"num_samples": 8},
                                    "test": {"num_samples": 16}}
    raw["data"]["val_split"] = "valid"
    return build_run(load_config(write_recipe(tmp_path_factory.mktemp("tiny") / "r.yaml", raw)), 1)


def test_evaluation_part_is_the_embeddings_extracted_from_every_split(tiny_parts, monkeypatch) -> None:
    """The evaluation's part is the float32 embeddings ``mmviews train`` extracts from each split:
    compared with the bytes of the real extraction (extract_embeddings on each evaluation
    loader). A split dropped or counted twice shows (24, 8 and 16 samples), and so do the
    training views counted for the evaluation's (3 for 2)."""
    from mmviews.eval.extract import extract_embeddings

    estimate = _static_estimate(tiny_parts)
    extracted = [extract_embeddings(tiny_parts.encoder, loader, progress=False).views
                 for loader in tiny_parts.eval_loaders.values() if loader is not None]
    assert [e.shape[:2] for e in extracted] == [(24, 2), (8, 2), (16, 2)]
    assert estimate.num_views == 3 and estimate.evaluation == _storage_bytes(extracted) > 0
    monkeypatch.setattr(tiny_parts.config.evaluation, "tasks", [])  # no evaluation: nothing extracted
    assert _static_estimate(tiny_parts).evaluation == 0


def test_baseline_and_framework_are_the_processes_readings(tiny_parts, monkeypatch) -> None:
    import mmviews.train.memory as memory

    readings = iter([900 * MB, 948 * MB])  # before the first step, after the trial steps
    monkeypatch.setattr(memory, "resident_bytes", lambda: next(readings))
    estimate = estimate_memory(tiny_parts, measure_slack=False, on_host=True)
    assert estimate.baseline == 900 * MB - estimate.parameters and estimate.framework == 48 * MB
    assert estimate.host == estimate.baseline + estimate.framework  # no sample cache in this recipe
    assert next(readings, None) is None  # both readings used


def test_allocator_slack_is_the_reference_steps_growth_beyond_its_tensors(tiny_parts, monkeypatch) -> None:
    import mmviews.train.memory as memory

    measure = memory.measure_encoder_step
    seen = []

    def with_known_growth(parts, sizes=(2, 4)):
        steps = measure(parts, sizes)
        if sizes != (2, 4):  # the reference step: its resident set grew 7 MB beyond its live tensors
            steps = [dataclasses.replace(s, resident_growth=s.peak + 7 * MB) for s in steps]
        seen.append((sizes, steps))
        return steps

    monkeypatch.setattr(memory, "measure_encoder_step", with_known_growth)
    estimate = estimate_memory(tiny_parts, on_host=True)
    assert [sizes for sizes, _ in seen] == [(2, 4), (8,)]  # the reference step: all K/N = 8 samples
    assert estimate.allocator_slack == 7 * MB
    assert estimate_memory(tiny_parts, on_host=True, measure_slack=False).allocator_slack == 0
