"""The memory estimate's evaluation: one evaluation batch encoded without gradients, beside the
extracted embeddings; the peak is the larger of the training step's and the evaluation's."""

from __future__ import annotations

import pytest
import torch

from mmviews.config import load_config, resolve_recipe
from mmviews.train import build_run
from mmviews.train.memory import estimate_memory, measure_encoder_step, measure_evaluation_forward

# The quickstart shrunk: 64 training samples, K = 32, evaluation batches of 48 (more than K, as
# the quickstart's 256 against 128).
SMALL = ["data.batch_size=32", "data.split_options.train.num_samples=64", "data.eval_batch_size=48",
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
    return build_run(load_config(resolve_recipe("quickstart"), SMALL), 1)


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
    line = next(line for line in estimate.lines() if line.strip().startswith("evaluation"))
    assert "one evaluation batch encoded (measured)" in line and " GiB" in estimate.lines()[0] + line
