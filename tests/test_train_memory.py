"""The memory estimate (:mod:`mmviews.train.memory`): ``mmviews train RECIPE --check`` estimates the
peak memory per device and, with ``--memory-budget-gb``, the ``optimisation.encode_chunk_size`` that
fits. Against real steps of a shrunk quickstart (parameters, gradients, optimiser state, activations,
the evaluation batch encoded without gradients); and part by part on tiny inputs: every line of the
report with its figures and units, the advice for a budget, the byte counting, the extrapolations and
what it makes of the process's memory readings (read by mmviews.process_memory), each figure
counted by hand from inputs chosen to be exact."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from crafted_files import cli
from torch import nn

import mmviews.train.memory as memory
from mmviews.config import load_config, resolve_recipe
from mmviews.train import build_run
from mmviews.train.memory import (
    GB,
    MemoryEstimate,
    estimate_memory,
    measure_activations,
    measure_encoder_step,
    measure_evaluation_forward,
    saved_activation_bytes,
)
from mmviews.train.step import train_step
from mmviews.train.setup import make_accelerator, prepare_run


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
    p = prepare_run(make_accelerator(parts.config, tmp_path, []), parts)
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
    p = prepare_run(make_accelerator(parts.config, tmp_path_factory.mktemp("stepped"), []), parts)
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
    p = prepare_run(make_accelerator(parts.config, tmp_path, []), parts)
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
             working_per_sample=4096.0, batch_per_sample=8192.0, prefetched_batches=2, evaluation=0, sampler=4096 * MB)


def _parts(**changes) -> MemoryEstimate:
    fields = dict(samples_per_device=16, num_views=3, embed_dim=8, num_processes=1, chunk_size=None, optimizer="adamw",
                  on_host=True, **PARTS)
    fields.update(changes)
    return MemoryEstimate(**fields)


def _expected_step(e: MemoryEstimate, encoded: int, cached: bool) -> int:
    host = e.baseline + e.framework + e.sample_cache + e.sampler if e.on_host else 0
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
                 "activation_fixed", "working_fixed", "baseline", "framework", "sample_cache", "sampler"):
        without = _parts(on_host=on_host, **{name: 0})
        host_part = name in ("baseline", "framework", "sample_cache", "sampler")
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
    evaluating = (e.baseline + e.framework + e.sample_cache + e.sampler + e.parameters + e.optimizer_state + e.teacher
                  + e.evaluation)
    assert e.evaluating == e.total == evaluating
    assert _parts(evaluation=2**40, gradients=0).total == e.total  # no gradient term in the evaluation's peak
    assert _parts(evaluation=2**40, evaluation_tasks=2**30).total == e.total + 2**30  # a task's kernels add
    assert _parts(evaluation=0).total == _expected_step(e, 16, cached=False)


def test_the_heap_an_evaluation_leaves_is_under_the_steps_after_it() -> None:
    """The evaluation heap (2^36, apart from every other part) lies under the training step of
    the run, not under the evaluation's own peak; the step measured alone (``mmviews bench
    train``'s process, which evaluates nothing) leaves it out; on a device it is host memory."""
    e = _parts(evaluation_kept=2**36)
    assert e.step_alone == _expected_step(e, 16, cached=False)
    assert e.step == e.total == _expected_step(e, 16, cached=False) + 2**36
    assert e.evaluating == _parts().evaluating
    cached = _parts(chunk_size=4, evaluation_kept=2**36)
    assert cached.step == _expected_step(cached, 4, cached=True) + 2**36
    on_device = _parts(on_host=False, evaluation_kept=2**36)
    assert on_device.step == on_device.step_alone == _expected_step(on_device, 16, cached=False)
    line = "  evaluation heap   64.00 GiB (measured: what an evaluation batch leaves in the process once freed; the " \
           "steps after the random-init evaluation run beside it)"
    assert line in e.lines() and not any("evaluation heap" in x for x in _parts().lines() + on_device.lines())


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
# reference steps' resident-set growth beyond their live tensors (the allocator's slack). The
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


@pytest.mark.parametrize("tasks,splits", [
    (["linear:class"], ("train", "val", "test")),  # fits on train, selects on val, scores on test
    (["retrieval", "diagnostics"], ("test",)),  # the evaluated split alone
    (["identifiability"], ("val", "test")),  # fits on val: no training split (2.00 GiB counted)
])
def test_evaluation_part_counts_only_the_splits_the_tasks_embed(tiny_parts, monkeypatch, tasks, splits) -> None:
    """``--check`` on identifiability counted the embeddings of the training split
    (2^24 samples), which that task never extracts. Each split is counted by what the real
    evaluation extracts (evaluate_encoder, its extraction recorded), 24, 8 and 16 samples."""
    import mmviews.eval.evaluate as evaluate
    from mmviews.eval.tasks import parse_tasks

    monkeypatch.setattr(tiny_parts.config.evaluation, "tasks", tasks)
    monkeypatch.setitem(tiny_parts.config.__dict__, "eval_tasks", parse_tasks(tasks))  # the resolved tasks
    real, extracted = evaluate.extract_embeddings, {}

    def recording(encoder, loader, *args, **kwargs):
        extracted[kwargs["desc"]] = real(encoder, loader, *args, **kwargs)
        if len(extracted) == len(splits):
            raise StopIteration  # the extraction is what is compared: no task needs to run
        return extracted[kwargs["desc"]]

    monkeypatch.setattr(evaluate, "extract_embeddings", recording)
    loaders = tiny_parts.eval_loaders
    with pytest.raises(StopIteration):
        evaluate.evaluate_encoder(tiny_parts.encoder, loaders["train"], loaders["val"], loaders["test"], tasks,
                                  progress=False)
    names = {"train": "embeddings (train)", "val": "embeddings (val)", "test": "embeddings (test)"}
    assert list(extracted) == [names[split] for split in splits]
    assert _static_estimate(tiny_parts).evaluation == _storage_bytes(e.views for e in extracted.values()) > 0


def test_the_sampler_order_is_one_int64_per_training_sample(tiny_parts) -> None:
    """The shuffled order the training sampler holds for the epoch (0.6 GB on the
    identifiability recipe's 2^24 samples, then as Python ints, were not in the estimate)."""
    estimate = _static_estimate(tiny_parts)
    assert estimate.sampler == 8 * 24 and estimate.sampler == torch.randperm(24).nbytes
    line = "  sampler order     0.0 MiB (the epoch's shuffled order of the training samples, 8 bytes each)"
    assert line in estimate.lines()


def test_the_identifiability_tasks_kernels_are_counted_on_the_splits_it_fits_and_scores(tiny_parts, monkeypatch):
    from mmviews.eval.identifiability import identifiability_peak_bytes
    from mmviews.eval.tasks import parse_tasks

    for tasks, expected in ((["identifiability"], identifiability_peak_bytes(8, 16)),  # fit on valid, scored on test
                            ([{"kind": "identifiability", "fit_samples": 6}], identifiability_peak_bytes(8, 16, 6)),
                            (["linear:class", "retrieval"], 0)):
        monkeypatch.setattr(tiny_parts.config.evaluation, "tasks", tasks)
        monkeypatch.setitem(tiny_parts.config.__dict__, "eval_tasks", parse_tasks(tasks))
        estimate = _static_estimate(tiny_parts)
        assert estimate.evaluation_tasks == expected
    monkeypatch.setitem(tiny_parts.eval_loaders, "val", None)  # no validation split: the test split's halves
    monkeypatch.setattr(tiny_parts.config.evaluation, "tasks", ["identifiability"])
    monkeypatch.setitem(tiny_parts.config.__dict__, "eval_tasks", parse_tasks(["identifiability"]))
    assert _static_estimate(tiny_parts).evaluation_tasks == identifiability_peak_bytes(8, 8) > 0


def test_the_sample_cache_counts_the_splits_the_run_reads(tiny_parts, monkeypatch) -> None:
    """With data.cache, a split the evaluation never embeds is never read into the cache."""
    from mmviews.eval.tasks import parse_tasks
    from mmviews.train.memory import sample_bytes

    monkeypatch.setattr(tiny_parts.config.data, "cache", True)
    sizes = {role: sample_bytes(loader.dataset) * len(loader.dataset) for role, loader in tiny_parts.eval_loaders.items()}
    for tasks, read in ((["linear:class"], ("train", "val", "test")), (["retrieval"], ("train", "test"))):
        monkeypatch.setattr(tiny_parts.config.evaluation, "tasks", tasks)
        monkeypatch.setitem(tiny_parts.config.__dict__, "eval_tasks", parse_tasks(tasks))
        assert _static_estimate(tiny_parts).sample_cache == int(sum(sizes[role] for role in read))


def test_baseline_and_framework_are_the_processes_readings(tiny_parts, monkeypatch) -> None:
    import mmviews.train.memory as memory

    # before the first step, after the trial steps, after the evaluation batch (below where it started:
    # no evaluation heap; that part has tests of its own)
    readings = iter([900 * MB, 948 * MB, 0])
    monkeypatch.setattr(memory, "resident_bytes", lambda: next(readings))
    estimate = estimate_memory(tiny_parts, measure_slack=False, on_host=True)
    assert estimate.baseline == 900 * MB - estimate.parameters and estimate.framework == 48 * MB
    assert estimate.evaluation_kept == 0
    # no sample cache in this recipe; the sampler's order of its 24 training samples
    assert estimate.host == estimate.baseline + estimate.framework + estimate.sampler and estimate.sampler == 8 * 24
    assert next(readings, None) is None  # every reading used


def test_evaluation_heap_is_the_evaluation_forwards_reading_when_an_evaluation_precedes_the_steps(
        tiny_parts, monkeypatch) -> None:
    """What the measured evaluation batch left (given here: 9 MB) is the estimate's evaluation heap
    when an evaluation runs before the training steps (the random-init one, or every N epochs),
    on the host only."""
    import mmviews.train.memory as memory

    monkeypatch.setattr(memory, "measure_evaluation_forward",
                        lambda parts: memory.EvaluationForwardMeasurement(48, 1 * MB, 2 * MB, 3 * MB, 9 * MB))
    evaluation = tiny_parts.config.evaluation
    assert evaluation.random_baseline and not evaluation.every_epochs
    assert estimate_memory(tiny_parts, measure_slack=False, on_host=True).evaluation_kept == 9 * MB
    assert estimate_memory(tiny_parts, measure_slack=False, on_host=False).evaluation_kept == 0
    monkeypatch.setattr(evaluation, "random_baseline", False)  # the first evaluation is the final one
    assert estimate_memory(tiny_parts, measure_slack=False, on_host=True).evaluation_kept == 0
    monkeypatch.setattr(evaluation, "every_epochs", 2)
    assert estimate_memory(tiny_parts, measure_slack=False, on_host=True).evaluation_kept == 9 * MB


# Two fresh processes with mmviews train's allocator (host_memory: heap) on the quickstart shrunk to
# evaluation batches of 64 samples (every split a multiple of it, as the quickstart's of its 256),
# every split's samples read first (the sample cache is its own
# part): one reads what one evaluation batch leaves (the estimate's measurement), the other runs the
# real random-init evaluation (every split embedded, the probes fitted, the report written).
_HEAP_LEFT = """
import sys, tempfile
from pathlib import Path
from mmviews.config import load_config, resolve_recipe
from mmviews.train import build_run
from mmviews.train.host_memory import configure_host_memory
from mmviews.train import memory
configure_host_memory("heap", owns_process=True, on_cpu=True)
parts = build_run(load_config(resolve_recipe("quickstart"), sys.argv[2:]), 1)
for loader in parts.eval_loaders.values():
    for i in range(len(loader.dataset)):
        loader.dataset[i]
if sys.argv[1] == "estimate":
    print(memory.measure_evaluation_forward(parts).kept)
else:
    from mmviews.train.evaluation import run_evaluation
    memory.trim_host_memory()
    before = memory.resident_bytes()
    with tempfile.TemporaryDirectory() as folder:
        run_evaluation(parts.encoder, parts, Path(folder) / "eval_random", None)
    print(memory.resident_bytes() - before)
"""
EVAL_64 = ["data.batch_size=32", "data.split_options.train.num_samples=128", "data.eval_batch_size=64",
            "data.split_options.valid.num_samples=64", "data.split_options.test.num_samples=64", "cpu=true",
            "output.progress_bar=false", "optimisation.mixed_precision=no"]  # both roles in float32


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident-set readings")
def test_evaluation_heap_matches_what_a_real_evaluation_leaves() -> None:
    """The estimate's one evaluation batch against the whole random-init evaluation, each in a
    fresh process (the allocator's state is the process's history). Measured (one torch thread):
    135 MiB against 138 and 206 MiB in two runs of the real one, which varies from run to run and
    also keeps what its probes and report leave (26 MiB after ``malloc_trim``): hence the wide
    band. The part dropped (0) or counted for every batch fails it. About 60 s on a busy 2-core
    machine (two processes started together): the only check of the part against a real
    evaluation."""
    import subprocess
    import sys

    from test_train_utils import REPO, env

    procs = {role: subprocess.Popen([sys.executable, "-c", _HEAP_LEFT, role, *EVAL_64], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
             for role in ("estimate", "real")}
    left = {}
    for role, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        left[role] = int(out.split()[-1])
    assert left["real"] > 64 * MB, left  # the evaluation's heap is a part worth estimating
    assert 0.5 * left["real"] <= left["estimate"] <= 1.5 * left["real"], {k: v / MB for k, v in left.items()}


def test_allocator_slack_is_the_reference_steps_growth_beyond_their_tensors(tiny_parts, monkeypatch) -> None:
    """The reference steps (all K/N = 8 samples, three of them one after another, measured for
    real on the tiny run) with the resident set's growth given: 7 MB beyond the largest step's
    live tensors and the first batch by the last step."""
    import mmviews.train.memory as memory

    measure = memory.measure_encoder_step
    seen = []

    def with_known_growth(parts, sizes=(2, 4), consecutive=False):
        steps = measure(parts, sizes, consecutive)
        if sizes != (2, 4):
            held = max(s.peak for s in steps) + max(steps[0].batch, steps[0].batch_growth or 0)
            steps = [dataclasses.replace(s, resident_growth=held + (i + 5) * MB) for i, s in enumerate(steps)]
        seen.append((sizes, consecutive))
        return steps

    monkeypatch.setattr(memory, "measure_encoder_step", with_known_growth)
    estimate = estimate_memory(tiny_parts, on_host=True)
    assert seen == [((2, 4), False), ((8, 8, 8), True)]
    assert estimate.allocator_slack == 7 * MB
    assert estimate_memory(tiny_parts, on_host=True, measure_slack=False).allocator_slack == 0


# The quickstart shrunk: 64 training samples, K = 32, evaluation batches of 48 (more than K, as
# the quickstart's 256 against 128).
# ---------------------------------------------------------------------------------------------
# The evaluation's part: one evaluation batch encoded without gradients
# ---------------------------------------------------------------------------------------------
SMALL_WITH_EVAL = ["data.batch_size=32", "data.split_options.train.num_samples=64", "data.eval_batch_size=48",
         "data.split_options.valid.num_samples=48", "data.split_options.test.num_samples=48", "cpu=true"]


def _bytes(value: object) -> int:
    """Bytes of every tensor in a (nested) batch, each storage once (the reference, written apart)."""
    seen: dict[int, int] = {}

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif hasattr(v, "__dict__"):
            walk(vars(v))

    walk(value)
    return sum(seen.values())


def small_run():
    return build_run(load_config(resolve_recipe("quickstart"), SMALL_WITH_EVAL), 1)


def test_evaluation_batch_is_measured_and_counted_in_the_evaluation_peak() -> None:
    check_evaluation_estimate(small_run())


def test_evaluation_check_fails_when_the_evaluation_is_measured_with_gradients(monkeypatch) -> None:
    """Mutation test: the evaluation batch encoded with autograd on (``torch.no_grad`` does nothing)."""
    from mutations import apply_break

    parts = small_run()  # built intact (its weights are initialised in place under no_grad)
    apply_break("evaluation_forward_with_gradients", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        check_evaluation_estimate(parts)


def check_evaluation_estimate(parts) -> None:
    """The guard's check, on the shrunk quickstart's built run."""
    forward = measure_evaluation_forward(parts)
    assert forward is not None and forward.samples == 48
    # the batch: the evaluation loader's collator on 48 samples, as the encoder's host preparation leaves it
    rows = [parts.datasets["train"][i] for i in range(48)]
    batch = parts.encoder.host_preparation()(parts.eval_loaders["test"].collate_fn(rows))
    assert forward.batch == _bytes(batch)
    # without gradients the forward holds a layer's tensors at a time, not every activation a training
    # forward saves for backward (measured: 36 MB against 126 MB saved; with gradients 127 MB), and at
    # least the embeddings [48, 4, 64]
    (trained,) = measure_encoder_step(parts, (48,))
    assert 48 * 4 * 64 * 4 <= forward.peak < trained.saved / 2, (forward.peak, trained.saved)
    estimate = estimate_memory(parts, measure_slack=False)
    assert estimate.evaluation_forward > 0 and estimate.evaluation_batch > 0
    assert estimate.evaluating == (estimate.host + estimate.static - estimate.gradients + estimate.evaluation
                                   + estimate.evaluation_batch + estimate.evaluation_forward
                                   + estimate.evaluation_slack)
    assert estimate.total == max(estimate.step, estimate.evaluating)
    line = next(line for line in estimate.lines() if line.strip().startswith("evaluation  "))
    assert "one evaluation batch encoded (measured)" in line and " GiB" in estimate.lines()[0] + line


# ---------------------------------------------------------------------------------------------
# Part by part on tiny inputs: the report's lines, the advice, byte counts, readings
# ---------------------------------------------------------------------------------------------
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
    5 - 2 + 21 extracted + 1 + 2 + 3 for one batch = 30 MiB."""
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
        "  sample cache      4.0 MiB (data.cache: the samples of the splits the run reads)",
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
        "  allocator slack   5.0 MiB (measured: the resident set's growth over 3 reference steps in a row beyond their "
        "tensors)",
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
        "  sample cache      4.0 MiB (data.cache: the samples of the splits the run reads)" + not_counted,
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
# 1 + 1 + 2 = 4 GiB, 1 GiB of activations per sample, objective 1 GiB (see budget_estimate).
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


def test_live_tensor_bytes_counts_each_new_output_of_an_op_beside_its_views() -> None:
    """An op's outputs one by one: one on an input's storage (a view) counts nothing, and the
    new ones after it still count (the op here: a view of its input, then a new tensor)."""
    x, new = torch.zeros(4), torch.zeros(8)  # 16 and 32 bytes
    live = memory.LiveTensorBytes()
    out = live.__torch_dispatch__(lambda a: (a.view(2, 2), new), (), (x,), {})
    assert out[1] is new and (live.live, live.peak) == (32, 32)


def test_live_tensor_bytes_of_a_block_that_allocates_nothing_is_zero() -> None:
    made_before = torch.zeros(8)
    live = memory.LiveTensorBytes()
    with live:
        made_before.add_(1)  # in place: no allocation
        made_before[:4].mul_(2)  # a view, in place
    assert (live.peak, live.live) == (0, 0)


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

    objective = _Scores()

    def peak(measured, K, M, d):
        assert measured is objective and (M, d) == (2, 8)  # the objective and the shapes asked about
        asked.append(K)
        return 24 * K + 40 * K * K

    monkeypatch.setattr(memory, "_objective_peak", peak)
    assert memory.OBJECTIVE_MEASURED_K == 512
    for K, measured in ((512, [512]), (100, [100]), (513, [128, 256]), (1024, [256, 512]), (3000, [187, 375])):
        asked.clear()
        assert memory.measure_objective_bytes(objective, K, 2, 8) == 24 * K + 40 * K * K, K
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


@pytest.mark.parametrize("K,counted", [
    (8, 2 * 4 * 8 * 2 * 8 + 2 * 100),  # embeddings and gradient; two score blocks of its 100-byte budget
    (1024, 2 * 4 * 1024 * 2 * 8 + 2 * 100),
])
def test_objective_that_cannot_run_on_random_inputs_is_counted_instead(K: int, counted: int) -> None:
    assert memory.measure_objective_bytes(_Failing(100 / MiB), K, 2, 8) == counted


# The process's memory is read by mmviews.process_memory (tests/test_process_memory.py); here,
# what the estimate makes of its readings.
def test_reset_peak_is_none_when_the_peak_reads_unknown(monkeypatch) -> None:
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: 0)
    assert memory._reset_resident_peak() is None


def test_reset_peak_is_none_where_the_mark_cannot_be_reset(monkeypatch) -> None:
    """No /proc/self/clear_refs: the mark is not the resident set now, so no reading is given."""
    monkeypatch.setattr(memory, "reset_resident_peak", lambda: False)
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: 1000)
    assert memory._reset_resident_peak() is None
    monkeypatch.setattr(memory, "reset_resident_peak", lambda: True)
    assert memory._reset_resident_peak() == 1000


# ---------------------------------------------------------------------------------------------
# Samples, splits, loaders, processes.
# ---------------------------------------------------------------------------------------------
def test_sample_bytes_is_the_mean_of_the_first_samples_tensors_and_utf8_text() -> None:
    """Sample i: i + 1 float32 (4 (i + 1) bytes, one storage shared by two views of it) and i
    two-byte characters. First 4: (4 + 8 + 12 + 16 + 2 (0 + 1 + 2 + 3)) / 4 = 13 bytes."""
    def sample(i: int) -> dict:
        x = torch.zeros(i + 1)
        return {"x": x, "same": x[:1], "text": "é" * i}

    data = [sample(i) for i in range(6)]
    assert memory.sample_bytes(data) == 13.0
    assert memory.sample_bytes(data, count=2) == (4 + 8 + 2) / 2
    assert memory.sample_bytes(data[:1], count=4) == 4.0  # fewer samples than asked: those there
    assert memory.sample_bytes([]) == 0.0


def test_split_datasets_are_the_training_split_and_each_evaluated_split_once() -> None:
    from mmviews.eval.tasks import parse_tasks

    def parts(tasks, test):
        config = SimpleNamespace(evaluation=SimpleNamespace(tasks=tasks), eval_tasks=parse_tasks(tasks) if tasks else [])
        return SimpleNamespace(config=config, datasets={"train": train}, eval_loaders={
            "train": SimpleNamespace(dataset=train), "val": SimpleNamespace(dataset=valid), "test": test})

    train, valid, test = ["train"], ["valid"], ["test"]
    found = memory._split_datasets(parts(["linear:class"], SimpleNamespace(dataset=valid)))  # valid twice: once
    assert len(found) == 2 and found[0] is train and found[1] is valid
    found = memory._split_datasets(parts(["retrieval"], SimpleNamespace(dataset=test)))  # valid is not embedded
    assert len(found) == 2 and found[0] is train and found[1] is test
    assert memory._split_datasets(parts([], SimpleNamespace(dataset=test))) == [train]  # no evaluation


@pytest.mark.parametrize("workers,batches", [(0, 0), (1, 2), (3, 6)])
def test_each_loader_worker_prefetches_two_batches(workers: int, batches: int) -> None:
    assert memory._prefetched_batches(SimpleNamespace(data=SimpleNamespace(num_workers=workers))) == batches


@pytest.mark.parametrize("value,processes", [(None, 1), ("4", 4), ("1", 1), ("0", 1), ("-3", 1), ("two", 1)])
def test_processes_come_from_the_launchers_world_size(monkeypatch, value: str | None, processes: int) -> None:
    if value is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", value)
    assert memory.processes_from_environment() == processes


# ---------------------------------------------------------------------------------------------
# estimate_memory on a tiny built run (K = 8; three training views, two evaluation views; splits
# of 24, 8 and 16 samples; a linear probe): each part from its source, with the measurements
# given where the point is the arithmetic around them.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    from test_train_utils import tiny_config, write_recipe

    from mmviews.config import load_config
    from mmviews.train import build_run

    raw = tiny_config(text=False, batch_size=8, tasks=["linear:class"])
    raw["data"]["split_options"] = {"train": {"num_samples": 24}, "valid": {"num_samples": 8},
                                    "test": {"num_samples": 16}}
    raw["data"]["val_split"] = "valid"
    return build_run(load_config(write_recipe(tmp_path_factory.mktemp("tiny") / "r.yaml", raw)), 1)


def _not_measured(*args, **kwargs):
    raise AssertionError("measured although the activations were given")


def _given(run, monkeypatch, num_processes: int = 1, chunk: int | None = None, **kwargs) -> MemoryEstimate:
    """The estimate with the activations given: nothing of the encoder's step is measured."""
    monkeypatch.setattr(memory, "measure_encoder_step", _not_measured)
    monkeypatch.setattr(memory, "measure_evaluation_forward", _not_measured)
    return memory.estimate_memory(run, num_processes, chunk, activations=(1000.0, 10.0), **kwargs)


def test_estimate_takes_the_runs_shapes_weights_and_objective(run, monkeypatch) -> None:
    e = _given(run, monkeypatch, 2, 3, on_host=True)
    d = run.encoder.embed_dim
    assert e.lines()[0].startswith("estimated peak memory per device (cached step, encode_chunk_size 3; K = 8 samples, "
                                   "M = 3 views, N = 2 processes, 4 samples per device; resident set of the process): ")
    assert (e.samples_per_device, e.num_processes, e.chunk_size, e.num_views, e.embed_dim) == (4, 2, 3, 3, d)
    assert (e.activation_fixed, e.activation_per_sample, e.working_fixed, e.working_per_sample) == (1000, 10, 0, 0)
    assert (e.batch_per_sample, e.prefetched_batches, e.teacher, e.sharded, e.gathered) == (0, 0, 0, False, 0)
    assert e.parameters == _storage_bytes([*run.encoder.parameters(), *run.encoder.buffers(),
                                           *run.objective.parameters()])
    assert e.optimizer == "adamw" and e.optimizer_state == 2 * e.gradients > 0
    # the objective runs on the embeddings gathered from every process: all K = 8
    assert e.objective == memory._objective_peak(run.objective, 8, 3, d) > 0
    # float32 embeddings of the evaluation's 2 views, of every split (24 + 8 + 16 samples)
    assert e.evaluation == 4 * (24 + 8 + 16) * 2 * d
    assert (e.evaluation_batch, e.evaluation_forward, e.evaluation_slack) == (0, 0, 0)


def test_the_device_is_the_host_unless_told_otherwise(run, monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("decides by the absence of a CUDA device")
    monkeypatch.setattr(run.config, "cpu", False)
    assert _given(run, monkeypatch).on_host is True  # no CUDA device: the host
    assert _given(run, monkeypatch, on_host=False).on_host is False


def test_sample_cache_holds_every_splits_samples(run, monkeypatch) -> None:
    """data.cache: each of the three splits' samples, as many as the split holds, at the mean
    size of its first four (counted here with a walker of our own)."""

    assert _given(run, monkeypatch).sample_cache == 0
    monkeypatch.setattr(run.config.data, "cache", True)
    splits = memory._split_datasets(run)
    assert [len(ds) for ds in splits] == [24, 8, 16]
    held = sum(len(ds) * sum(_bytes(ds[i]) for i in range(4)) / 4 for ds in splits)
    assert _given(run, monkeypatch).sample_cache == int(held) > 0


@pytest.mark.parametrize("optimizer,momentum,copies", [("sgd", 0.0, 0), ("sgd", 0.9, 1), ("lars", 0.9, 1)])
def test_optimizer_state_follows_the_recipes_optimizer(run, monkeypatch, optimizer, momentum, copies) -> None:
    monkeypatch.setattr(run.config.optimisation, "optimizer", optimizer)
    monkeypatch.setattr(run.config.optimisation, "momentum", momentum)
    monkeypatch.setattr(run.config.data, "num_workers", 3)
    e = _given(run, monkeypatch)
    assert e.optimizer == optimizer and e.optimizer_state == copies * e.gradients and e.prefetched_batches == 6


def test_sharded_parts_are_one_processes_share(run, monkeypatch) -> None:
    """fsdp on 2 processes: the encoder's parameters, gradients, optimiser state and teacher
    halved (rounded up); buffers and the objective's parameters whole; the largest unit gathered
    twice. On one process nothing is sharded."""
    from mmviews.train.sharding import unit_parameter_bytes

    monkeypatch.setattr(run.config.objective, "ema_teacher", True)
    whole = _given(run, monkeypatch, 2)
    monkeypatch.setattr(run.config.distributed, "sharding", "fsdp")
    assert _given(run, monkeypatch, 1).sharded is False
    e = _given(run, monkeypatch, 2)
    kept = _storage_bytes([*run.encoder.buffers(), *run.objective.parameters()])
    encoder_weights = whole.parameters - kept
    assert encoder_weights % 2 == 0 and whole.teacher == encoder_weights + _storage_bytes([*run.encoder.buffers()])
    assert e.sharded and e.parameters == kept + encoder_weights // 2
    assert e.gradients == whole.gradients // 2 and e.optimizer_state == 2 * e.gradients
    assert e.teacher == -(-whole.teacher // 2)
    units = unit_parameter_bytes(run.encoder, run.config.distributed.fsdp_units)
    assert e.gathered == 2 * max(units) > 0 and e.gathered < 2 * encoder_weights
    # on 5 processes the shares do not divide evenly: each process holds the larger, whole share
    five = _given(run, monkeypatch, 5)
    assert [x % 5 > 0 for x in (encoder_weights, whole.gradients, whole.teacher)] == [True, True, True]
    assert five.parameters == kept + math.ceil(encoder_weights / 5)
    assert five.gradients == math.ceil(whole.gradients / 5) and five.teacher == math.ceil(whole.teacher / 5)


def _step(samples: int, saved: int, peak: int, batch: int, growth: int | None = None,
          batch_growth: int | None = None) -> memory.EncoderStepMeasurement:
    return memory.EncoderStepMeasurement(samples, saved, peak, batch, growth, batch_growth)


def _measured(run, monkeypatch, steps, reference=None, forward=None, **kwargs):
    """The estimate from given step measurements (2 and 4 samples), the reference step's (asked
    sizes recorded) and the evaluation forward's."""
    asked = []

    def measure(parts, sizes=(2, 4), consecutive=False):
        assert parts is run and all(type(n) is int for n in sizes), sizes  # whole samples of the run
        asked.append(tuple(sizes))
        # the trial steps each after a trim; the reference steps one after another, as a run's
        assert consecutive == (tuple(sizes) != (2, 4)), (sizes, consecutive)
        if tuple(sizes) == (2, 4):
            return steps
        if isinstance(reference, list):  # each consecutive pass's own measurement
            assert len(sizes) == len(reference)
            return [dataclasses.replace(r, samples=n) for r, n in zip(reference, sizes)]
        return [dataclasses.replace(reference, samples=n) for n in sizes]

    def evaluation_forward(parts):
        assert parts is run
        return forward

    monkeypatch.setattr(memory, "measure_encoder_step", measure)
    monkeypatch.setattr(memory, "measure_evaluation_forward", evaluation_forward)
    return memory.estimate_memory(run, **kwargs), asked


STEPS = [_step(2, saved=100, peak=150, batch=20), _step(4, saved=160, peak=260, batch=36)]


def test_measured_steps_give_fixed_and_per_sample_costs(run, monkeypatch) -> None:
    """Saved: 100 and 160 bytes -> 40 + 30 per sample; beyond them at the peak: 50 and 100 ->
    0 + 25 per sample; the batch 20 and 36 -> 8 per sample. K/N = 4 on 2 processes: no
    reference step (it would not be larger than the trial's 4 samples)."""
    e, asked = _measured(run, monkeypatch, STEPS, num_processes=2, on_host=True)
    assert asked == [(2, 4)]
    assert (e.activation_fixed, e.activation_per_sample) == (40, 30)
    assert (e.working_fixed, e.working_per_sample, e.batch_per_sample) == (0, 25, 8)
    assert e.allocator_slack == 0
    # beyond the saved tensors 70 and 90 bytes at the peak: 50 fixed + 10 per sample
    beyond = [_step(2, saved=100, peak=170, batch=20), _step(4, saved=160, peak=250, batch=36)]
    e, _ = _measured(run, monkeypatch, beyond, num_processes=2, on_host=True)
    assert (e.working_fixed, e.working_per_sample) == (50, 10)
    # peaks no higher than what is saved (the saved tensors are the peak): no working memory at all
    flat = [_step(2, saved=100, peak=100, batch=20), _step(4, saved=160, peak=150, batch=36)]
    e, _ = _measured(run, monkeypatch, flat, num_processes=2, on_host=True)
    assert (e.working_fixed, e.working_per_sample) == (0, 0)


def test_reference_step_gives_the_slack_and_the_collating_copies(run, monkeypatch) -> None:
    """K/N = 8 samples: three reference steps of 8 one after another; the resident set grew 700
    bytes by the last, beyond a peak of 500 of live tensors and the 96 bytes that collating the
    first batch grew it (slack 104; 12 bytes per sample for the batch > 8)."""
    reference = _step(0, saved=0, peak=500, batch=0, growth=700, batch_growth=96)
    e, asked = _measured(run, monkeypatch, STEPS, reference, on_host=True)
    assert asked == [(2, 4), (8, 8, 8)]
    assert e.allocator_slack == 104 and e.batch_per_sample == 12
    # growth below the live tensors: no slack, and the trial's batch cost stays when collating grew less
    reference = _step(0, saved=0, peak=500, batch=0, growth=300, batch_growth=40)
    e, _ = _measured(run, monkeypatch, STEPS, reference, on_host=True)
    assert e.allocator_slack == 0 and e.batch_per_sample == 8
    # no reading of the resident set (not Linux): neither
    e, _ = _measured(run, monkeypatch, STEPS, _step(0, 0, 500, 0), on_host=True)
    assert e.allocator_slack == 0 and e.batch_per_sample == 8


def test_slack_is_the_heaps_growth_over_the_consecutive_reference_steps(run, monkeypatch) -> None:
    """The high-water mark since the first reference step, 600, 900 and 1000 bytes by each of the
    three: the last (the heap the steps grew to) less the largest step's live tensors (500) and
    the first batch as collating grew it (50 > its 40 bytes of tensors): slack 450. The batch per
    sample is the first batch's growth (50 / 8 < the trial's 8: the trial's stays)."""
    passes = [_step(0, saved=0, peak=300, batch=40, growth=600, batch_growth=50),
              _step(0, saved=0, peak=500, batch=40, growth=900, batch_growth=700),
              _step(0, saved=0, peak=400, batch=40, growth=1000, batch_growth=950)]
    e, asked = _measured(run, monkeypatch, STEPS, passes, on_host=True)
    assert asked == [(2, 4), (8, 8, 8)]
    assert e.allocator_slack == 450 and e.batch_per_sample == 8
    # the tensors of the batch, when more than collating grew the resident set, are what is left out
    passes[0] = dataclasses.replace(passes[0], batch=80, batch_growth=None)
    e, _ = _measured(run, monkeypatch, STEPS, passes, on_host=True)
    assert e.allocator_slack == 1000 - 500 - 80 and e.batch_per_sample == 8
    # no reading of the resident set by the last step: no slack
    passes[2] = dataclasses.replace(passes[2], resident_growth=None)
    e, _ = _measured(run, monkeypatch, STEPS, passes, on_host=True)
    assert e.allocator_slack == 0


def test_reference_slack_runs_its_steps_one_after_another(monkeypatch) -> None:
    """reference_slack asks measure_encoder_step for ``steps`` consecutive passes of ``samples``
    (SLACK_REFERENCE_STEPS = 3 by default) and reads the first batch's growth per sample."""
    asked = []

    def measure(parts, sizes=(2, 4), consecutive=False):
        asked.append((tuple(sizes), consecutive))
        return [_step(n, 0, peak=10 * (i + 1), batch=4, growth=100 * (i + 1), batch_growth=16) for i, n in enumerate(sizes)]

    monkeypatch.setattr(memory, "measure_encoder_step", measure)
    assert memory.reference_slack("parts", 8) == (300 - 30 - 16, 2.0) and asked == [((8, 8, 8), True)]
    assert memory.reference_slack("parts", 4, steps=2) == (200 - 20 - 16, 4.0) and asked[-1] == ((4, 4), True)
    assert memory.SLACK_REFERENCE_STEPS == 3


def test_the_evaluation_batch_is_measured_before_the_reference_steps(run, monkeypatch) -> None:
    """The evaluation batch's left-over heap is read on the heap the trial steps left, before the
    three reference steps fragment it (measured on the quickstart: 0.13-0.14 GiB then; 0.20-0.40
    GiB read after them)."""
    order = []

    def measure(parts, sizes=(2, 4), consecutive=False):
        order.append("reference" if consecutive else "trial")
        return [_step(n, 0, peak=500, batch=0, growth=700) for n in sizes] if consecutive else STEPS

    def forward(parts):
        order.append("evaluation")
        return memory.EvaluationForwardMeasurement(samples=8, batch=100, peak=200, resident_growth=260)

    monkeypatch.setattr(memory, "measure_encoder_step", measure)
    monkeypatch.setattr(memory, "measure_evaluation_forward", forward)
    memory.estimate_memory(run, on_host=True)
    assert order == ["trial", "evaluation", "reference"]


@pytest.mark.parametrize("kwargs,sizes", [
    (dict(chunk_size=5), [(2, 4), (5, 5, 5)]),  # one chunk of 5 is what the step encodes at once
    (dict(chunk_size=4), [(2, 4)]),  # no larger than the trial step: not measured again
    (dict(chunk_size=16), [(2, 4), (8, 8, 8)]),  # a chunk larger than K/N: K/N
    (dict(measure_slack=False), [(2, 4)]),
    (dict(on_host=False), [(2, 4)]),  # a device's allocator: not the host's resident set
])
def test_reference_step_size(run, monkeypatch, kwargs: dict, sizes: list) -> None:
    reference = _step(0, saved=0, peak=500, batch=0, growth=700)
    e, asked = _measured(run, monkeypatch, STEPS, reference, **{"on_host": True, **kwargs})
    assert asked == sizes
    assert e.allocator_slack == (200 if len(sizes) == 2 else 0)


def test_reference_step_stays_within_a_gib_of_activations(run, monkeypatch) -> None:
    """At 200 MiB saved per sample (and none beyond), 1 GiB holds 5 samples: the reference step
    encodes 5 of the 8, not more; at 128 MiB, 8 fit."""
    # 150 MiB saved and 50 MiB beyond them per sample: 200 MiB, 5 samples in 1 GiB
    steps = [_step(2, saved=300 * MiB, peak=400 * MiB, batch=0), _step(4, saved=600 * MiB, peak=800 * MiB, batch=0)]
    _, asked = _measured(run, monkeypatch, steps, _step(0, 0, 0, 0), on_host=True)
    assert asked == [(2, 4), (5, 5, 5)]
    # 96 + 32 = 128 MiB per sample: 8
    steps = [_step(2, saved=192 * MiB, peak=256 * MiB, batch=0), _step(4, saved=384 * MiB, peak=512 * MiB, batch=0)]
    _, asked = _measured(run, monkeypatch, steps, _step(0, 0, 0, 0), on_host=True)
    assert asked == [(2, 4), (8, 8, 8)]
    # nothing per sample (the trial steps measured alike): no bound from the bytes, K/N = 8
    steps = [_step(2, saved=64, peak=96, batch=0), _step(4, saved=64, peak=96, batch=0)]
    _, asked = _measured(run, monkeypatch, steps, _step(0, 0, 0, 0), on_host=True)
    assert asked == [(2, 4), (8, 8, 8)]


def test_evaluation_forward_parts(run, monkeypatch) -> None:
    """The evaluation batch's measurement: the batch, the forward's live tensors, and on the host
    the resident set's growth beyond them as slack (none below them, none on a device)."""
    forward = memory.EvaluationForwardMeasurement(samples=8, batch=100, peak=200, resident_growth=260)
    e, _ = _measured(run, monkeypatch, STEPS, forward=forward, on_host=True, measure_slack=False)
    assert (e.evaluation_batch, e.evaluation_forward, e.evaluation_slack) == (100, 200, 60)
    e, _ = _measured(run, monkeypatch, STEPS, forward=forward, on_host=False)
    assert (e.evaluation_batch, e.evaluation_forward, e.evaluation_slack) == (100, 200, 0)
    lower = dataclasses.replace(forward, resident_growth=150)
    e, _ = _measured(run, monkeypatch, STEPS, forward=lower, on_host=True, measure_slack=False)
    assert e.evaluation_slack == 0
    unknown = dataclasses.replace(forward, resident_growth=None)
    e, _ = _measured(run, monkeypatch, STEPS, forward=unknown, on_host=True, measure_slack=False)
    assert (e.evaluation_batch, e.evaluation_slack) == (100, 0)
    monkeypatch.setattr(run.config.evaluation, "tasks", [])  # no evaluation: nothing measured for it
    e, _ = _measured(run, monkeypatch, STEPS, forward=forward, on_host=True, measure_slack=False)
    assert (e.evaluation, e.evaluation_batch, e.evaluation_forward) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------
# The measurements themselves, on the tiny run's encoder (milliseconds per pass).
# ---------------------------------------------------------------------------------------------
def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in module.state_dict().items()) and all(
        p.grad is None for p in module.parameters())


@pytest.mark.parametrize("training", [True, False])
def test_encoder_step_measurement_leaves_the_encoder_as_it_was(run, training: bool) -> None:
    """Weights and BatchNorm statistics as they were, no gradient left, the mode put back."""
    encoder = run.encoder
    encoder.train(training)
    before = _state(encoder)
    assert any("running_mean" in k for k in before)  # BatchNorm: a training forward would move them
    memory.measure_encoder_step(run, (2,))
    assert encoder.training is training and _unchanged(encoder, before)
    memory.gradient_bytes(run)
    assert encoder.training is training and _unchanged(encoder, before)
    memory.measure_evaluation_forward(run, 2)
    assert encoder.training is training and _unchanged(encoder, before)
    encoder.train()


def _prepared_batch(run, samples: int, collate) -> object:
    rows = [run.datasets["train"][i] for i in range(samples)]
    return run.encoder.host_preparation()(collate(rows))


def test_encoder_step_measures_its_batch_and_what_autograd_saves(run) -> None:

    steps = memory.measure_encoder_step(run, (2, 4))
    assert [s.samples for s in steps] == [2, 4]
    for s in steps:
        assert s.batch == _bytes(_prepared_batch(run, s.samples, run.collator)) > 0
        # the same forward and backward here, in training mode as the step measures it
        batch = _prepared_batch(run, s.samples, run.collator)
        params = {p.untyped_storage().data_ptr() for p in run.encoder.parameters()}

        def step() -> None:
            z, _ = run.encoder(batch)
            z.float().square().sum().backward()

        before = _state(run.encoder)
        saved = memory.saved_activation_bytes(step, params)
        run.encoder.load_state_dict(before)
        run.encoder.zero_grad(set_to_none=True)
        assert s.saved == saved > 0
        assert s.peak >= s.saved  # what is saved is alive at the peak
        assert s.resident_growth is not None and s.batch_growth is not None  # Linux: read
    assert steps[1].saved > steps[0].saved and steps[1].batch > steps[0].batch


def test_consecutive_passes_take_the_next_samples_and_reset_the_mark_once(monkeypatch) -> None:
    """Consecutive passes (the reference steps) read the split's samples window after window,
    from the start again where it runs out (4 samples: 0 1, 2 3, 0 1), and trim and reset the
    high-water mark once, before the first: each growth is the mark's rise since then (readings
    given: reset at 1000, the mark read 1100, 1200, ... after each batch and each pass). Passes
    that are not consecutive reset it before each batch and each pass."""
    parts = _two_layer_parts()
    index = {id(x): i for i, x in enumerate(parts.datasets["train"])}
    collated = []

    def collate(rows):
        collated.append([index[id(r)] for r in rows])
        return torch.stack(rows)

    parts.collator = collate
    resets = []
    monkeypatch.setattr(memory, "_reset_resident_peak", lambda: resets.append(1) or 1000)
    readings = iter(range(1100, 2000, 100))
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: next(readings))
    steps = memory.measure_encoder_step(parts, (2, 2, 2), consecutive=True)
    assert collated == [[0, 1], [2, 3], [0, 1]] and len(resets) == 1
    assert [(s.batch_growth, s.resident_growth) for s in steps] == [(100, 200), (300, 400), (500, 600)]
    assert all(p.grad is None for p in parts.encoder.parameters())
    collated.clear()
    resets.clear()
    readings = iter(range(1100, 2000, 100))
    steps = memory.measure_encoder_step(parts, (2, 3))
    assert collated == [[0, 1], [0, 1, 2]] and len(resets) == 4
    assert [(s.batch_growth, s.resident_growth) for s in steps] == [(100, 200), (300, 400)]
    with pytest.raises(ValueError) as raised:  # a pass larger than the split: refused before any
        memory.measure_encoder_step(parts, (2, 5), consecutive=True)
    assert str(raised.value) == "the training split has 4 samples; measuring activations needs 5"


def test_sample_windows_follow_each_other_and_wrap_around() -> None:
    rows = [{"i": i} for i in range(5)]
    assert memory._sample_windows(rows, (2, 2, 2)) == [[rows[0], rows[1]], [rows[2], rows[3]], [rows[4], rows[0]]]
    assert memory._sample_windows(rows, (3,)) == [rows[:3]]
    assert memory._sample_windows(rows, (4, 4)) == [rows[:4], [rows[4], *rows[:3]]]


def test_encoder_step_needs_enough_samples() -> None:
    parts = _two_layer_parts()  # 4 samples
    assert memory.measure_encoder_step(parts, (4,))[0].samples == 4  # the whole split: enough
    with pytest.raises(ValueError) as raised:
        memory.measure_encoder_step(parts, (2, 5))
    assert str(raised.value) == "the training split has 4 samples; measuring activations needs 5"


def test_measure_activations_is_the_line_through_the_asked_sizes(run, monkeypatch) -> None:
    asked = []

    def measure(parts, sizes=(2, 4)):
        assert parts is run  # the run's own encoder and training split
        asked.append(tuple(sizes))
        return [_step(n, saved=7 + 10 * n, peak=0, batch=0) for n in sizes]

    monkeypatch.setattr(memory, "measure_encoder_step", measure)
    assert memory.measure_activations(run, (3, 5)) == (7.0, 10.0) and asked == [(3, 5)]
    assert memory.measure_activations(run) == (7.0, 10.0) and asked[-1] == (2, 4)


def test_gradients_are_those_of_the_parameters_one_backward_reaches(run) -> None:
    """Every trainable parameter of the tiny encoder is used: all get a gradient; one frozen
    adapter's parameters get none."""
    trainable = _storage_bytes([p for p in run.encoder.parameters() if p.requires_grad])
    assert memory.gradient_bytes(run) == trainable > 0
    frozen = list(run.encoder.adapters["audio"].parameters())
    try:
        for p in frozen:
            p.requires_grad_(False)
            p.grad = torch.zeros_like(p)  # stale gradients from before the freeze are not this backward's
        assert memory.gradient_bytes(run) == trainable - _storage_bytes(frozen)
        assert memory.gradient_bytes(run, samples=4) == trainable - _storage_bytes(frozen)
    finally:
        for p in frozen:
            p.requires_grad_(True)


def test_evaluation_forward_is_one_evaluation_batch_without_gradients(run) -> None:
    """data.eval_batch_size samples (or as asked) of the training split, collated with the
    evaluation's views (2, not the training's 3), encoded in eval mode without autograd."""
    loader = run.eval_loaders["train"]
    forward = memory.measure_evaluation_forward(run, 6)
    assert forward.samples == 6
    assert forward.batch == _bytes_of(_prepared_batch(run, 6, loader.collate_fn)) > 0
    assert forward.batch < _bytes_of(_prepared_batch(run, 6, run.collator))  # 2 views, not 3
    assert forward.resident_growth is not None and forward.peak > 0
    d = run.encoder.embed_dim
    assert forward.peak >= 6 * 2 * d * 4  # the embeddings at least
    default = memory.measure_evaluation_forward(run)
    assert default.samples == min(run.config.data.eval_batch_size or run.config.data.batch_size, 24)
    assert memory.measure_evaluation_forward(run, 100).samples == 24  # no more than the split holds


def _bytes_of(batch) -> int:

    return _bytes(batch)


def test_no_evaluation_loader_no_evaluation_forward(run, monkeypatch) -> None:
    monkeypatch.setattr(run, "eval_loaders", {"train": None})
    assert memory.measure_evaluation_forward(run) is None
    monkeypatch.setattr(run, "eval_loaders", {})
    assert memory.measure_evaluation_forward(run) is None


class _Recording(nn.Module):
    """An objective that records its inputs, moves its own state (a memory bank, a gradient) and
    keeps a 4 MiB tensor alive until its output goes."""

    def __init__(self, takes_extras: bool) -> None:
        super().__init__()
        self.takes_index = self.takes_teacher = takes_extras
        self.register_buffer("bank", torch.zeros(4))
        self.weight = nn.Parameter(torch.ones(1))
        self.seen: list[dict] = []

    def compute(self, z, mask, index=None, teacher=None):
        self.seen.append(dict(z=z.detach().clone(), grad=z.requires_grad, mask=mask, index=index, teacher=teacher,
                              teacher_storage=None if teacher is None else teacher.untyped_storage().data_ptr(),
                              z_storage=z.untyped_storage().data_ptr()))
        self.bank.add_(1)
        return SimpleNamespace(loss=(z.square() * self.weight).sum(), held=torch.ones(MiB))


@pytest.mark.parametrize("takes_extras", [True, False])
def test_objective_peak_runs_on_unit_embeddings_and_puts_the_state_back(takes_extras: bool) -> None:
    """K = 4, M = 2, d = 8: the embeddings (128 bytes) and their gradient are alive with the
    objective's 4 MiB; the rest (norms, index, teacher, scalars) is well under 64 KiB."""
    objective = _Recording(takes_extras)
    peak = memory._objective_peak(objective, 4, 2, 8)
    assert 4 * MiB + 2 * 4 * 4 * 2 * 8 <= peak <= 4 * MiB + 64 * 1024
    (seen,) = objective.seen
    z = seen["z"]
    assert z.shape == (4, 2, 8) and seen["grad"] and seen["mask"] is None
    assert torch.allclose(z.norm(dim=-1), torch.ones(4, 2))
    if takes_extras:
        assert torch.equal(seen["index"], torch.arange(4))
        assert torch.equal(seen["teacher"], z) and not seen["teacher"].requires_grad
        assert seen["teacher_storage"] != seen["z_storage"]  # a copy, not the embeddings themselves
    else:
        assert seen["index"] is None and seen["teacher"] is None
    assert torch.equal(objective.bank, torch.zeros(4)) and objective.weight.grad is None
    memory._objective_peak(objective, 4, 2, 8)
    assert torch.equal(objective.seen[1]["z"], z)  # the same random embeddings each time


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_encoder_step_is_measured_under_the_recipes_mixed_precision(run, monkeypatch, precision: str) -> None:
    """Under autocast the convolutions keep 2-byte activations for backward: about half of what
    the float32 step saves."""
    (full,) = memory.measure_encoder_step(run, (4,))
    monkeypatch.setattr(run.config.optimisation, "mixed_precision", precision)
    (half,) = memory.measure_encoder_step(run, (4,))
    assert 0.4 * full.saved < half.saved < 0.6 * full.saved, (half.saved, full.saved)


# ---------------------------------------------------------------------------------------------
# Live tensors of a step counted by hand: two 512 x 512 linear layers (1 MiB of weights each)
# on 2 samples of 512 float32 features (4 KiB per activation).
# ---------------------------------------------------------------------------------------------
class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(512, 512), nn.Linear(512, 512)

    def host_preparation(self):
        return lambda batch: batch

    def forward(self, x: torch.Tensor):
        return self.second(self.first(x)), None


def _two_layer_parts() -> SimpleNamespace:
    torch.manual_seed(0)
    config = SimpleNamespace(optimisation=SimpleNamespace(mixed_precision="no"))
    return SimpleNamespace(encoder=_TwoLayers(), datasets={"train": [torch.randn(512) for _ in range(4)]},
                           collator=torch.stack, config=config)


def test_live_tensors_leave_out_parameter_views_and_gradients_accumulated_in_place() -> None:
    """Forward: the layers' transposed weights are views of the parameters (nothing allocated).
    Backward into existing .grad tensors: each weight's gradient (1 MiB) is made, added in place
    and freed before the next layer's; the peak holds one of them, not two, nor the weights."""
    model = _TwoLayers()
    x = torch.randn(2, 512)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    live = memory.LiveTensorBytes()
    with live:
        z, _ = model(x)
        z.square().sum().backward()
        del z
    assert MiB <= live.peak < MiB + 64 * 1024, live.peak
    assert live.live == 0  # the gradients went into the .grad tensors made before


def test_encoder_step_counts_by_hand() -> None:
    """Saved for backward: the input and the first layer's output (each [2, 512] float32, 4 KiB)
    and the embeddings the square keeps (4 KiB); the weights, also saved, are left out. The
    batch: 4 KiB. At the peak: one weight's gradient (1 MiB, the .grad tensors exist before the
    pass) beside those. The gradients gone afterwards."""
    parts = _two_layer_parts()
    (step,) = memory.measure_encoder_step(parts, (2,))
    assert (step.samples, step.saved, step.batch) == (2, 3 * 4096, 4096)
    assert MiB <= step.peak < MiB + 64 * 1024, step.peak
    assert all(p.grad is None for p in parts.encoder.parameters())
    assert memory.gradient_bytes(parts) == 2 * (512 * 512 + 512) * 4


def test_baseline_and_framework_are_never_negative(run, monkeypatch) -> None:
    """Readings below the parameters' bytes (baseline) and a resident set that shrank after the
    trial steps (framework): both 0, not negative."""
    readings = iter([1000, 900])
    monkeypatch.setattr(memory, "resident_bytes", lambda: next(readings))
    e = _given(run, monkeypatch)
    assert e.parameters > 1000 and (e.baseline, e.framework) == (0, 0)


def test_resident_readings_become_the_steps_growths(monkeypatch) -> None:
    """With the readings given (reset at 1000 bytes each time), the growths are the high-water
    mark's rise above them: exact, never negative, None where the mark cannot be reset."""
    parts = _two_layer_parts()
    monkeypatch.setattr(memory, "_reset_resident_peak", lambda: 1000)
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: 1700)
    (step,) = memory.measure_encoder_step(parts, (2,))
    assert (step.resident_growth, step.batch_growth) == (700, 700)
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: 900)
    (step,) = memory.measure_encoder_step(parts, (2,))
    assert (step.resident_growth, step.batch_growth) == (0, 0)
    monkeypatch.setattr(memory, "_reset_resident_peak", lambda: None)
    (step,) = memory.measure_encoder_step(parts, (2,))
    assert (step.resident_growth, step.batch_growth) == (None, None)


def _two_layer_eval_parts(precision: str = "no") -> SimpleNamespace:
    parts = _two_layer_parts()
    parts.config = SimpleNamespace(optimisation=SimpleNamespace(mixed_precision=precision),
                                   data=SimpleNamespace(eval_batch_size=2, batch_size=4))
    parts.eval_loaders = {"train": None, "test": SimpleNamespace(collate_fn=torch.stack)}
    return parts


def test_evaluation_forward_counts_by_hand(monkeypatch) -> None:
    """data.eval_batch_size = 2 samples: the batch 4 KiB; without gradients each layer's output
    (4 KiB) is alive while the next is computed: 8 KiB at the peak. The resident set's rise
    beyond the batch (readings given: reset at 1000, mark at 1000 + 4096 + 300) is the growth."""
    parts = _two_layer_eval_parts()
    forward = memory.measure_evaluation_forward(parts)
    assert (forward.samples, forward.batch, forward.peak) == (2, 4096, 2 * 4096)
    assert memory.measure_evaluation_forward(parts, 1).samples == 1
    monkeypatch.setattr(memory, "_reset_resident_peak", lambda: 1000)
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: 1000 + 4096 + 300)
    assert memory.measure_evaluation_forward(parts).resident_growth == 300
    monkeypatch.setattr(memory, "resident_peak_bytes", lambda: 1000)
    assert memory.measure_evaluation_forward(parts).resident_growth == 0
    # what the batch leaves once freed: the resident set after it, above the reading before
    monkeypatch.setattr(memory, "resident_bytes", lambda: 1000 + 700)
    assert memory.measure_evaluation_forward(parts).kept == 700
    monkeypatch.setattr(memory, "resident_bytes", lambda: 900)
    assert memory.measure_evaluation_forward(parts).kept == 0  # never negative
    monkeypatch.setattr(memory, "_reset_resident_peak", lambda: None)
    forward = memory.measure_evaluation_forward(parts)
    assert forward.resident_growth is None and forward.kept is None


def test_evaluation_forward_of_an_empty_split_is_none() -> None:
    parts = _two_layer_eval_parts()
    parts.datasets = {"train": []}
    assert memory.measure_evaluation_forward(parts) is None


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_evaluation_forward_is_measured_under_the_recipes_mixed_precision(precision: str) -> None:
    """Under autocast the layers run on 2-byte copies of their weights (512 KiB each): the
    float32 forward's 8 KiB peak becomes more than one such copy."""
    forward = memory.measure_evaluation_forward(_two_layer_eval_parts(precision))
    assert forward.peak > 512 * 1024


@pytest.mark.parametrize("native", [True, False])
def test_an_auto_precision_is_measured_as_the_run_resolves_it(native: bool, monkeypatch) -> None:
    """A config whose ``auto`` no run has resolved yet (a benchmark's, a test's): measured under
    bf16 where the CPU computes it natively (the 2-byte weight copies), in float32 elsewhere, as
    the run will train; both passes, training and evaluation."""
    import mmviews.eval.precision as P

    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: native)
    parts = _two_layer_eval_parts("auto")
    parts.config.cpu = True
    forward = memory.measure_evaluation_forward(parts)
    assert (forward.peak > 512 * 1024) is native, forward.peak
    (step,) = memory.measure_encoder_step(parts, (2,))
    (float32,) = memory.measure_encoder_step(_two_layer_parts(), (2,))
    assert (step.saved != float32.saved) is native, (step.saved, float32.saved)


class _FailingSecondLayer(_TwoLayers):
    def forward(self, x: torch.Tensor):
        raise RuntimeError("out of memory")


def test_a_failed_measurement_leaves_no_gradient_behind() -> None:
    """The pass fails after its zero gradients were made: they are cleared all the same, and the
    encoder is back in its mode."""
    parts = _two_layer_parts()
    parts.encoder = _FailingSecondLayer().eval()
    with pytest.raises(RuntimeError, match="out of memory"):
        memory.measure_encoder_step(parts, (2,))
    assert all(p.grad is None for p in parts.encoder.parameters()) and not parts.encoder.training


def test_reference_step_stays_within_its_sample_cap(run, monkeypatch) -> None:
    """SLACK_REFERENCE_SAMPLES caps the reference step (128; set to 6 here, below K/N = 8)."""
    monkeypatch.setattr(memory, "SLACK_REFERENCE_SAMPLES", 6)
    _, asked = _measured(run, monkeypatch, STEPS, _step(0, 0, 0, 0), on_host=True)
    assert asked == [(2, 4), (6, 6, 6)]


def test_a_run_without_evaluation_loaders(run, monkeypatch) -> None:
    """A run built without its evaluation (build_run(..., with_eval=False)): no loader, no
    evaluation part, nothing measured for it."""
    monkeypatch.setattr(run, "eval_loaders", {})
    e = _given(run, monkeypatch)
    assert (e.evaluation, e.evaluation_batch, e.evaluation_forward) == (0, 0, 0) and e.num_views == 3


def test_task_working_bytes_fit_on_valid_else_on_the_halves_of_the_evaluated_split():
    """identifiability fits on valid and scores on test; with one of the two, it fits and scores on
    the halves of that one (the larger half scored); no evaluated split, or no such task, counts 0."""
    from mmviews.eval.identifiability import identifiability_peak_bytes
    from mmviews.eval.tasks import parse_tasks

    def split(n: int) -> SimpleNamespace:
        return SimpleNamespace(dataset=list(range(n)))

    task = parse_tasks([{"kind": "identifiability", "fit_samples": 1000}])
    both = memory.task_working_bytes(task, {"val": split(30), "test": split(50), "train": split(9)})
    assert both == identifiability_peak_bytes(30, 50, 1000)
    # 7 samples: 3 fitted and 4 scored (the fit's kernels weigh most with 1000 fit samples, the
    # scoring's with 2)
    small = parse_tasks([{"kind": "identifiability", "fit_samples": 2}])
    for role in ("val", "test"):
        assert memory.task_working_bytes(task, {role: split(7)}) == identifiability_peak_bytes(3, 4, 1000), role
        assert memory.task_working_bytes(small, {role: split(7)}) == identifiability_peak_bytes(3, 4, 2), role
    assert memory.task_working_bytes(task, {"train": split(8)}) == 0  # nothing evaluated
    assert memory.task_working_bytes(parse_tasks(["retrieval"]), {"test": split(7)}) == 0


def test_the_evaluation_line_counts_the_tasks_kernels_when_there_are_any():
    with_kernels = "\n".join(_parts(evaluation=3 * MB, evaluation_tasks=5 * MB).lines())
    assert " extracted embeddings + " in with_kernels and " + 5.0 MiB for its tasks' kernels; evaluation peak " in with_kernels
    assert "for its tasks' kernels" not in "\n".join(_parts(evaluation=3 * MB).lines())


def test_without_evaluation_tasks_no_task_working_memory_is_counted(tiny_parts, monkeypatch):
    monkeypatch.setattr(tiny_parts.config.evaluation, "tasks", [])
    monkeypatch.setitem(tiny_parts.config.__dict__, "eval_tasks", [])
    estimate = _static_estimate(tiny_parts)
    assert estimate.evaluation_tasks == 0 and estimate.evaluation == 0
    assert isinstance(estimate.evaluating, int)
