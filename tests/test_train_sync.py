"""The training loop reads nothing back from the device between log steps (issue: no needless
synchronisation), and still stops on a non-finite loss at the next log step.

On CPU there is no device synchronisation to observe, so the no-sync tests record what would be
one on an accelerator: every read of a tensor's value by Python (``item``, ``bool``, ``int``,
``float``, ``tolist``...) and every value-sized operation (``nonzero``, boolean-mask indexing),
with :class:`mmviews.bench.train.HostReadRecorder`, outside the loader's ``next`` (collation
works on host tensors) and outside log steps and checkpoints."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import mmviews.train.trainer as trainer
from mmviews.bench.train import HostReadRecorder
from mmviews.config import config_from_dict
from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.data.loaders import EpochCollator, loader_options
from mmviews.objectives import ObjectiveOutput, get_objective, objective_class
from mmviews.objectives.ipmc.memory_bank import check_index
from mmviews.train import TrainCallback, train


def gaussian_config(objective: dict[str, Any], *, epochs: int = 1, log_every: int = 1000, num_samples: int = 96,
                    batch_size: int = 16, checkpoint_every: int = 0, ema_teacher: bool = False) -> dict[str, Any]:
    """A recipe of a few seconds: 4 noisy copies of a 1-D latent, an MLP per view."""
    return {
        "name": "sync", "seed": 0,
        "data": {"name": "gaussian_latents", "split_options": {"train": {"num_samples": num_samples}},
                 "batch_size": batch_size, "val_split": None, "test_split": None},
        "views": [{"modality": "x", "copies": 4, "augment": "seq_noise", "params": {"std": 0.03}}],
        "encoder": {"embed_dim": 8},
        "adapters": {"x": {"type": "mlp", "input_dim": 1, "hidden_dim": 16, "head": {"kind": "linear"}}},
        "objective": {**objective, "ema_teacher": ema_teacher},
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": epochs, "max_grad_norm": 5.0},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": log_every, "checkpoint_every": checkpoint_every, "keep_last": 1, "progress_bar": False},
        "cpu": True,
    }


def _train_recording(config: dict[str, Any], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> HostReadRecorder:
    """Train ``config`` recording every host read, each labelled with the optimiser step whose
    batch was fetched last (``"setup"`` before the first); the loader's ``next`` (host-side
    collation, the copy to the device) is not recorded."""
    recorder = HostReadRecorder()
    recorder.step = "setup"
    original = trainer._epoch_batches

    def batches(p: Any, parts: Any, epoch: int) -> Any:
        iterator = iter(original(p, parts, epoch))
        while True:
            with recorder.paused():
                batch = next(iterator, None)
            if batch is None:
                return
            recorder.step = p.state.step + 1  # grad_accum_steps 1: one batch per step
            yield batch

    monkeypatch.setattr(trainer, "_epoch_batches", batches)
    with recorder:
        train(config_from_dict(config), run_dir)
    return recorder


def _reads_outside(recorder: HostReadRecorder, allowed_steps: set[int], ignore_prefix: str | None = None) -> list[str]:
    """The reads made at steps other than ``allowed_steps`` (and setup), except those whose
    source starts with ``ignore_prefix``."""
    return [f"step {r.step}: {r.op} at {r.where}" for r in recorder.reads
            if r.step != "setup" and r.step not in allowed_steps
            and not (ignore_prefix and r.where.startswith(ignore_prefix))]


# The adapters' own input checks (mmviews/modalities: present.all(), finite inputs, lengths) still
# read the device once or more per modality and step; they are listed by
# test_adapter_forward_reads_are_known and excluded here, where the loop itself is under test.
ADAPTERS = "mmviews/modalities/"


@pytest.mark.parametrize("objective", [
    {"name": "mv_dhel", "params": {"temperature": 0.2}},
    {"name": "geometric_pvc", "params": {"temperature": 0.2}},
])
def test_no_host_reads_between_log_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, objective: dict) -> None:
    # 96 samples / K = 16: 6 steps; log_every 1000: the only log step is the last (6).
    recorder = _train_recording(gaussian_config(objective), tmp_path / "run", monkeypatch)
    assert any(r.step == 6 for r in recorder.reads), "the recorder saw nothing at the log step: it is not recording"
    assert _reads_outside(recorder, {6}, ADAPTERS) == []


def test_no_host_reads_between_log_steps_with_teacher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = gaussian_config({"name": "er", "params": {}}, ema_teacher=True)
    recorder = _train_recording(config, tmp_path / "run", monkeypatch)
    assert _reads_outside(recorder, {6}, ADAPTERS) == []


def test_ipmc_hot_path_reads_nothing_once_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Memory bank over the whole dataset and an active view filter: in the first epoch the bank
    # fills (sampling needs nonzero until it is known full, read at the epoch's end); from the
    # second epoch on, no step between log steps reads the device.
    objective = {"name": "ipmc", "params": {"memory_bank_size": 96, "bank_negatives": 32, "view_filter_k": 1,
                                            "warmup_epochs": 0, "eta": 2, "beta": 0.0}}
    recorder = _train_recording(gaussian_config(objective, epochs=2), tmp_path / "run", monkeypatch)
    assert any(r.step in range(1, 7) and "nonzero" in r.op for r in recorder.reads), "expected the bank's nonzero"
    second_epoch = [r for r in recorder.reads if r.step != "setup" and r.step > 6]
    assert second_epoch, "the recorder saw nothing in the second epoch (the last step logs)"
    assert _reads_outside(recorder, set(range(1, 7)) | {12}, ADAPTERS) == []


def test_adapter_forward_reads_are_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder's remaining per-step reads are the adapters' input checks, and only those."""
    recorder = _train_recording(gaussian_config({"name": "mv_dhel", "params": {}}), tmp_path / "run", monkeypatch)
    between = [r for r in recorder.reads if r.step not in {"setup", 6}]
    assert all(r.where.startswith(ADAPTERS) for r in between), [f"{r.op} at {r.where}" for r in between]


class _NaNAt:
    """Wraps an objective class's ``compute`` so that its ``n``-th call returns a NaN loss."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def install(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        cls = objective_class(name)
        original = cls.compute

        def compute(objective: Any, *args: Any, **kwargs: Any) -> ObjectiveOutput:
            out = original(objective, *args, **kwargs)
            self.calls += 1
            if self.calls == self.n:
                return ObjectiveOutput(out.loss * float("nan"), out.metrics)
            return out

        monkeypatch.setattr(cls, "compute", compute)


class _Steps(TrainCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, state: Any) -> None:
        self.steps.append(state.step)


def test_nan_loss_stops_at_next_log_step_naming_the_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _NaNAt(6).install(monkeypatch, "mv_dhel")  # step 6 (grad_accum 1)
    steps = _Steps()
    config = gaussian_config({"name": "mv_dhel", "params": {}}, log_every=4, num_samples=256)
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(NaN or inf\) at one of steps 5-8 .*log_every = 4"):
        train(config_from_dict(config), tmp_path / "run", callback=steps)
    # Steps 6 and 7 ran (no host check there); the run stopped at log step 8, before logging it.
    assert steps.steps == [1, 2, 3, 4, 5, 6, 7]
    with (tmp_path / "run" / "metrics.csv").open() as f:
        logged = [int(row["step"]) for row in csv.DictReader(f)]
    assert logged == [4]


def test_nan_loss_is_caught_before_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _NaNAt(2).install(monkeypatch, "mv_dhel")
    config = gaussian_config({"name": "mv_dhel", "params": {}}, log_every=100, checkpoint_every=3, num_samples=256)
    with pytest.raises(FloatingPointError, match=r"one of steps 1-3"):
        train(config_from_dict(config), tmp_path / "run")
    assert not list((tmp_path / "run").glob("checkpoints/*")), "a checkpoint was written after a NaN loss"


def test_nan_loss_at_a_log_step_names_that_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _NaNAt(3).install(monkeypatch, "mv_dhel")
    config = gaussian_config({"name": "mv_dhel", "params": {}}, log_every=1)
    with pytest.raises(FloatingPointError, match=r"at step 3 \(epoch 0"):
        train(config_from_dict(config), tmp_path / "run")


# ---- the objectives' input checks ---------------------------------------------------------
def test_objective_input_check_can_be_turned_off() -> None:
    z = torch.randn(4, 2, 8)
    z[1, 0, 3] = float("nan")
    objective = get_objective("mv_dhel")
    with pytest.raises(ValueError, match=r"non-finite values \(first at index \(1, 0, 3\)\)"):
        objective(z)
    objective.check_inputs = False  # what the trainer does: the NaN reaches the loss instead
    assert not math.isfinite(float(objective(z)))


def test_ipmc_index_check_without_host_read() -> None:
    index = torch.tensor([0, 5, 9])
    with pytest.raises(ValueError, match=r"index values must lie in \[0, 8\), got range \[0, 9\]"):
        check_index(index, 3, 8, "the memory bank")
    with pytest.raises(RuntimeError, match=r"index values must lie in \[0, 8\)"):
        check_index(index, 3, 8, "the memory bank", host_check=False)
    with HostReadRecorder() as recorder:
        check_index(torch.tensor([0, 5, 7]), 3, 8, "the memory bank", host_check=False)
    assert recorder.reads == []


def test_ipmc_bank_sampling_when_full_matches_nonzero() -> None:
    from mmviews.objectives.ipmc.memory_bank import MemoryBank

    bank = MemoryBank(6, 2, 4)
    bank.update(torch.randn(6, 2, 4), torch.arange(6))
    torch.manual_seed(1)
    expected = bank.sample(4)
    bank.note_if_full()
    torch.manual_seed(1)
    with HostReadRecorder() as recorder:
        got = bank.sample(4)
    assert recorder.reads == []
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


# ---- batches and loaders --------------------------------------------------------------------
def _batch(mask: torch.Tensor) -> ViewBatch:
    views = [ViewInfo("x_0", "x", 0), ViewInfo("x_1", "x", 1)]
    return ViewBatch(inputs={"x": {"values": torch.randn(2 * mask.shape[0], 1, 1)}}, views=views, mask=mask,
                     index=torch.arange(mask.shape[0]))


def test_viewbatch_knows_on_the_host_whether_views_are_missing() -> None:
    full, partial = _batch(torch.ones(3, 2, dtype=torch.bool)), _batch(torch.tensor([[1, 1], [1, 0], [1, 1]]).bool())
    moved_full, moved_partial = full.to("cpu", non_blocking=True), partial.to("cpu")
    assert moved_full.all_present is True and moved_partial.all_present is False
    with HostReadRecorder() as recorder:
        assert moved_full.all_views_present() and not moved_partial.all_views_present()
    assert recorder.reads == []
    assert torch.equal(moved_partial.mask, partial.mask) and torch.equal(moved_partial.index, partial.index)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_viewbatch_pin_memory() -> None:  # pragma: no cover - no GPU on the CI machine
    pinned = _batch(torch.ones(2, 2, dtype=torch.bool)).pin_memory()
    assert pinned.mask.is_pinned() and pinned.inputs["x"]["values"].is_pinned() and pinned.all_present is True


class _EpochEcho:
    """A collator stand-in that returns its epoch (what ViewSetCollator seeds augmentations with)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __call__(self, samples: list[Any]) -> int:
        return self.epoch


def test_epoch_reaches_persistent_workers() -> None:
    collator = EpochCollator(_EpochEcho())  # type: ignore[arg-type]
    options = loader_options(1)
    assert options["persistent_workers"] is True
    loader = DataLoader(list(range(4)), batch_size=2, collate_fn=collator, **options)
    seen = []
    for epoch in range(3):
        collator.set_epoch(epoch)
        seen.append(list(loader))
    assert seen == [[0, 0], [1, 1], [2, 2]]
    # Without the shared epoch the persistent worker keeps the collator it started with.
    plain = _EpochEcho()
    loader = DataLoader(list(range(4)), batch_size=2, collate_fn=plain, **options)
    stale = []
    for epoch in range(2):
        plain.set_epoch(epoch)
        stale.append(list(loader))
    assert stale == [[0, 0], [0, 0]]


def test_persistent_workers_train_like_the_main_process(tmp_path: Path) -> None:
    """Augmentations (seq_noise, seeded by epoch and index) reach persistent workers each epoch:
    a run with a loader worker logs the same losses as one without."""
    losses = []
    for workers in (0, 1):
        config = gaussian_config({"name": "mv_dhel", "params": {}}, epochs=3, log_every=1, num_samples=48)
        config["data"]["num_workers"] = workers
        train(config_from_dict(config), tmp_path / f"run{workers}")
        with (tmp_path / f"run{workers}" / "metrics.csv").open() as f:
            losses.append([row["loss"] for row in csv.DictReader(f)])
    assert len(losses[0]) == 9 and losses[0] == losses[1]
