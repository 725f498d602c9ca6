"""The training loop reads nothing back from the device between log steps (no needless
synchronisation), adapters included, and still stops on a non-finite loss at the next log step
and on a bad input (checked on the host where batches are collated) with the adapter's error.

On CPU there is no device synchronisation to observe, so the no-sync tests record what would be
one on an accelerator: every read of a tensor's value by Python (``item``, ``bool``, ``int``,
``float``, ``tolist``...) and every value-sized operation (``nonzero``, boolean-mask indexing),
with :class:`mmviews.bench.host_reads.HostReadRecorder`, outside the loader's ``next`` (collation
works on host tensors) and outside log steps and checkpoints."""

from __future__ import annotations

import csv
import dataclasses
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import mmviews.train.trainer as trainer
from mmviews.train.setup import HostPreparedCollate
from mmviews.bench.host_reads import HostReadRecorder
from mmviews.config import config_from_dict
from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.data.gaussian import GaussianLatents
from mmviews.data.loaders import EpochCollator, loader_options
from mmviews.data.synthetic import SyntheticMultimodal
from mmviews.modalities import MultiViewEncoder, build_adapter
from mmviews.modalities.presets import tiny_config
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
        # float32 on every machine (`auto` picks bf16 on a CPU with native bf16)
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": epochs, "max_grad_norm": 5.0,
                         "mixed_precision": "no"},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": log_every, "checkpoint_every": checkpoint_every, "keep_last": 1, "progress_bar": False},
        "cpu": True,
    }


def synthetic_config(adapters: dict[str, Any], views: list[dict[str, Any]], *, missing_rate: float = 0.3,
                     num_samples: int = 64, batch_size: int = 16) -> dict[str, Any]:
    """A recipe of a few seconds on the embedded synthetic data with missing modalities."""
    return {
        "name": "sync-missing", "seed": 0,
        "data": {"name": "synthetic", "options": {"modalities": sorted(adapters), "missing_rate": missing_rate},
                 "split_options": {"train": {"num_samples": num_samples}}, "batch_size": batch_size,
                 "val_split": None, "test_split": None},
        "views": views,
        "encoder": {"embed_dim": 16},
        "adapters": adapters,
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": 1, "max_grad_norm": 5.0, "mixed_precision": "no"},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": 1000, "checkpoint_every": 0, "keep_last": 1, "progress_bar": False},
        "cpu": True,
    }


def _train_recording(config: dict[str, Any], run_dir: Path,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[HostReadRecorder, list[ViewBatch]]:
    """Train ``config`` recording every host read, each labelled with the optimiser step whose
    batch was fetched last (``"setup"`` before the first); the loader's ``next`` (host-side
    collation and input checks, the copy to the device) is not recorded. Also returns the
    batches trained on."""
    recorder = HostReadRecorder()
    recorder.step = "setup"
    original = trainer.epoch_loader
    seen: list[ViewBatch] = []

    def batches(p: Any, parts: Any, epoch: int) -> Any:
        iterator = iter(original(p, parts, epoch))
        while True:
            with recorder.paused():
                batch = next(iterator, None)
            if batch is None:
                return
            recorder.step = p.state.step + 1  # grad_accum_steps 1: one batch per step
            seen.append(batch)
            yield batch

    monkeypatch.setattr(trainer, "epoch_loader", batches)
    with recorder:
        train(config_from_dict(config), run_dir)
    return recorder, seen


def _reads_outside(recorder: HostReadRecorder, allowed_steps: set[int]) -> list[str]:
    """The reads made at steps other than ``allowed_steps`` (and setup)."""
    return [f"step {r.step}: {r.op} at {r.where}" for r in recorder.reads
            if r.step != "setup" and r.step not in allowed_steps]


@pytest.mark.parametrize("objective", [
    {"name": "mv_dhel", "params": {"temperature": 0.2}},
    {"name": "geometric_pvc", "params": {"temperature": 0.2}},
])
def test_no_host_reads_between_log_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, objective: dict) -> None:
    # 96 samples / K = 16: 6 steps; log_every 1000: the only log step is the last (6).
    recorder, batches = _train_recording(gaussian_config(objective), tmp_path / "run", monkeypatch)
    assert any(r.step == 6 for r in recorder.reads), "the recorder saw nothing at the log step: it is not recording"
    assert len(batches) == 6 and all(b.inputs_checked for b in batches), "batches must be checked on the host"
    assert _reads_outside(recorder, {6}) == []


def test_no_host_reads_between_log_steps_with_teacher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = gaussian_config({"name": "er", "params": {}}, ema_teacher=True)
    recorder, _ = _train_recording(config, tmp_path / "run", monkeypatch)
    assert _reads_outside(recorder, {6}) == []


@pytest.mark.parametrize("pools", ["sample", "direction"])
def test_ipmc_hot_path_reads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pools: str) -> None:
    # Memory bank larger than the dataset (never full: sampling must not need nonzero) and an
    # active view filter: no step reads the device but the first (the lazy build of bank, filter
    # and critic), the 6th (then the epoch ends: the filter's epoch and the bank's fullness are
    # read) and the last (a log step).
    objective = {"name": "ipmc", "params": {"memory_bank_size": 128, "bank_negatives": 32, "view_filter_k": 1,
                                            "warmup_epochs": 0, "eta": 2, "beta": 0.0, "pools": pools}}
    recorder, _ = _train_recording(gaussian_config(objective, epochs=2), tmp_path / "run", monkeypatch)
    second_epoch = [r for r in recorder.reads if r.step != "setup" and r.step > 6]
    assert second_epoch, "the recorder saw nothing in the second epoch (the last step logs)"
    assert _reads_outside(recorder, {1, 6, 12}) == [], "\n".join(_reads_outside(recorder, {1, 6, 12}))


def test_no_host_reads_with_missing_views_text_and_audio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing modalities (only their present items reach the adapters), tokenised text (BERT,
    sdpa attention) and two audio views: nothing read between log steps either."""
    adapters = {"text": {**tiny_config("text"), "vocab": "synthetic"}, "audio": tiny_config("audio_cnn"),
                "image": tiny_config("small_cnn")}
    views = [{"modality": "text"}, {"modality": "audio", "copies": 2}, {"modality": "image"}]
    recorder, batches = _train_recording(synthetic_config(adapters, views), tmp_path / "run", monkeypatch)
    # 64 samples / K = 16: 4 steps, the last one logs.
    partial = [m for b in batches for m in ("text", "audio", "image")
               if not b.present_items(m).all and not b.present_items(m).none]
    assert len(batches) == 4 and len(partial) >= 4, "expected modalities missing from some but not all samples"
    assert any(r.step == 4 for r in recorder.reads), "the recorder saw nothing at the log step"
    assert _reads_outside(recorder, {4}) == []


# ---- bad inputs stop the run with the adapter's error --------------------------------------
def _poison_gaussian(monkeypatch: pytest.MonkeyPatch, value: torch.Tensor, index: int = 10) -> None:
    """Item ``index`` of the gaussian_latents data holds ``value`` instead of its latent."""
    original = GaussianLatents.__getitem__

    def getitem(self: GaussianLatents, i: int) -> dict[str, Any]:
        item = original(self, i)
        if i == index:
            item["modalities"]["x"] = value
        return item

    monkeypatch.setattr(GaussianLatents, "__getitem__", getitem)


@pytest.mark.parametrize("workers", [0, 1])
def test_nan_input_stops_training_naming_modality_and_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          workers: int) -> None:
    _poison_gaussian(monkeypatch, torch.full((1, 1), float("nan")))
    steps = _Steps()
    config = gaussian_config({"name": "mv_dhel", "params": {}})
    config["data"]["num_workers"] = workers
    # The item's 4 noisy copies (seq_noise) are all NaN; K = 16 samples x 4 views are stacked.
    with pytest.raises(ValueError, match=r"modality 'x': mlp adapter: 4 non-finite value\(s\) \(NaN/inf\) "
                                         r"in inputs\['values'\] of shape \(64, 1, 1\)"):
        train(config_from_dict(config), tmp_path / "run", callback=steps)
    assert len(steps.steps) < 6, "the run went on after the bad batch"
    assert not (tmp_path / "run" / "encoder").exists()


def test_zero_length_input_stops_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _poison_gaussian(monkeypatch, torch.zeros(0, 1))  # a present view with no step to read
    with pytest.raises(ValueError, match=r"modality 'x': mlp adapter: zero-length sequence at batch position\(s\) "
                                         r"\[([\d, ]+)\] of present views") as caught:
        train(config_from_dict(gaussian_config({"name": "mv_dhel", "params": {}})), tmp_path / "run")
    # The 4 views of the item, stacked sample-major: items 4k .. 4k + 3.
    found = re.search(r"\[([\d, ]+)\]", str(caught.value))
    assert found is not None
    positions = [int(v) for v in found.group(1).split(", ")]
    assert positions[0] % 4 == 0 and positions == list(range(positions[0], positions[0] + 4))


def test_empty_waveform_of_a_present_view_stops_training_with_missing_views(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With missing audio (zero-filled slots of length 0, which are fine), a present waveform of
    length 0 is refused, at the stacked positions of its two views."""
    original = SyntheticMultimodal.__getitem__
    emptied: list[int] = []

    def getitem(self: SyntheticMultimodal, i: int) -> dict[str, Any]:
        item = original(self, i)
        if i % 5 == 0 and item["modalities"]["audio"] is not None:
            item["modalities"]["audio"] = torch.zeros(0)
            emptied.append(i)
        return item

    monkeypatch.setattr(SyntheticMultimodal, "__getitem__", getitem)
    adapters = {"audio": tiny_config("audio_cnn"), "image": tiny_config("small_cnn")}
    config = synthetic_config(adapters, [{"modality": "audio", "copies": 2}, {"modality": "image"}], missing_rate=0.4)
    with pytest.raises(ValueError, match=r"modality 'audio': audio_cnn adapter: zero-length waveform at batch "
                                         r"position\(s\) \[(\d+), \d+(, \d+, \d+)*\] of present views"):
        train(config_from_dict(config), tmp_path / "run")
    assert emptied


def test_adapters_still_check_direct_calls_and_unchecked_batches() -> None:
    adapter = build_adapter({"type": "mlp", "input_dim": 1, "embed_dim": 4, "head": {"kind": "linear"}})
    values = torch.randn(3, 1, 1)
    values[1] = float("nan")
    with pytest.raises(ValueError, match=r"mlp adapter: 1 non-finite value\(s\) \(NaN/inf\) in inputs\['values'\] "
                                         r"of shape \(3, 1, 1\)"):
        adapter({"values": values})
    with pytest.raises(ValueError, match=r"mlp adapter: zero-length sequence at batch position\(s\) \[2\]"):
        adapter({"values": torch.randn(3, 1, 1), "lengths": torch.tensor([1, 1, 0])})
    assert not torch.isfinite(adapter({"values": values}, check_inputs=False)).all()  # asked not to check
    adapter.check_inputs = False
    assert not torch.isfinite(adapter({"values": values})).all()

    encoder = MultiViewEncoder({"x": build_adapter({"type": "mlp", "input_dim": 1, "embed_dim": 4})})
    views = [ViewInfo("x_0", "x", 0), ViewInfo("x_1", "x", 1)]
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    batch = ViewBatch(inputs={"x": {"values": torch.randn(6, 1, 1)}}, views=views, mask=mask)
    batch.inputs["x"]["values"][4] = float("inf")
    with pytest.raises(ValueError, match=r"modality 'x': mlp adapter: 1 non-finite value\(s\)"):
        encoder(batch)  # a batch nobody checked: the adapter checks it
    with pytest.raises(ValueError, match=r"modality 'x': mlp adapter: 1 non-finite value\(s\)"):
        encoder.input_check()(batch)  # the trainer's check on the host
    assert not batch.inputs_checked
    z, _ = encoder(dataclasses.replace(batch, inputs_checked=True))  # checked already: not again
    assert not torch.isfinite(z).all()


def test_checked_batches_encode_without_host_reads() -> None:
    """Text (tokenised here), audio with an absent view, and images: once checked and moved, the
    encoder reads nothing back, whichever views are missing."""
    torch.manual_seed(0)
    encoder = MultiViewEncoder({m: build_adapter(tiny_config(kind)) for m, kind in
                                (("text", "text"), ("audio", "audio_cnn"), ("image", "small_cnn"))}).train()
    views = [ViewInfo("audio_0", "audio", 0), ViewInfo("text_0", "text", 0), ViewInfo("image_0", "image", 0),
             ViewInfo("audio_1", "audio", 1)]  # modalities interleaved
    mask = torch.tensor([[True, True, True, True], [False, True, True, False], [True, False, True, True]])
    inputs = {"text": {"text": ["the cat sat", "a dog", ""]},
              "audio": {"values": torch.randn(6, 3200), "lengths": torch.tensor([3200, 1600, 0, 0, 2400, 3200]),
                        "sample_rate": 16000},
              "image": {"values": torch.rand(3, 3, 32, 32)}}
    batch = encoder.input_check()(ViewBatch(inputs=inputs, views=views, mask=mask)).to("cpu", non_blocking=True)
    audio = batch.present_items("audio")
    assert batch.inputs_checked and audio.positions == (0, 1, 4, 5) and audio.total == 6
    assert audio.index is not None and audio.index.tolist() == [0, 1, 4, 5]
    torch.manual_seed(1)  # the same dropout masks in both passes
    with HostReadRecorder() as recorder:
        z, _ = encoder(batch)
        z.sum().backward()
    assert recorder.reads == [], [f"{r.op} at {r.where}" for r in recorder.reads]
    torch.manual_seed(1)
    expected, _ = encoder(dataclasses.replace(batch, presence=None, inputs_checked=False))
    assert torch.allclose(z, expected, atol=1e-5) and torch.all(z[1, 0] == 0) and torch.all(z[2, 1] == 0)


def test_input_checks_travel_to_workers_without_weights() -> None:
    """What HostPreparedCollate sends to loader workers started by spawn/forkserver: the checks'
    parameters, not the models, and they still catch what the adapters would."""
    encoder = MultiViewEncoder({"text": build_adapter(tiny_config("text")),
                                "audio": build_adapter(tiny_config("hf_audio"))})
    payload = pickle.dumps(HostPreparedCollate(_collate_stub, encoder.input_check()))
    assert len(payload) < 2000, f"{len(payload)} bytes: the checks must not carry weights"
    check = pickle.loads(payload).prepare
    views = [ViewInfo("text_0", "text", 0), ViewInfo("audio_0", "audio", 0)]
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    inputs = {"text": {"text": ["the cat", "a dog", "the sky"]},
              "audio": {"values": torch.randn(3, 4000), "lengths": torch.tensor([4000, 0, 30]), "sample_rate": 16000}}
    # HuBERT's tiny conv front end needs 45 samples for one frame: the present third waveform has 30.
    with pytest.raises(ValueError, match=r"modality 'audio': hf_audio adapter: waveform\(s\) at position\(s\) \[2\] "
                                         r"too short to give one frame \(fewer than 45 samples at 16000 Hz\)"):
        check(ViewBatch(inputs=inputs, views=views, mask=mask))
    inputs["audio"]["lengths"] = torch.tensor([4000, 0, 3000])
    inputs["text"]["text"][1] = "  "
    with pytest.raises(ValueError, match=r"modality 'text': text adapter: empty string\(s\) at batch "
                                         r"position\(s\) \[1\]"):
        check(ViewBatch(inputs=inputs, views=views, mask=mask))
    inputs["text"]["text"][1] = "a dog"
    assert check(ViewBatch(inputs=inputs, views=views, mask=mask)).inputs_checked


def _collate_stub(samples: Any) -> Any:
    return samples


def test_bench_train_step_reads_nothing_with_missing_views() -> None:
    """``mmviews bench train --count-host-reads``: the step it mirrors (quickstart: text, audio,
    image and flow adapters, here with missing modalities) reads nothing from the device."""
    from mmviews.bench.train_measure import measure
    from mmviews.config import load_config, resolve_recipe
    from mmviews.train import build_run

    overrides = ["data.batch_size=16", "data.split_options.train.num_samples=48", "data.options.missing_rate=0.3",
                 "cpu=true"]
    from test_train_utils import own_accelerate_state

    parts = build_run(load_config(resolve_recipe("quickstart"), overrides), 1, with_eval=False)
    with own_accelerate_state():  # the recipe's auto: bf16 on a CPU with native bf16, beside float32 runs
        row = measure(parts, case="quickstart", device="cpu", steps=1, warmup=0, count_host_reads=2)
    assert row["host_reads"] == {"steps": 2, "per_step": 0.0, "by_origin": {}}


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


def test_ipmc_bank_sampling_reads_nothing_full_or_not() -> None:
    from mmviews.objectives.ipmc.memory_bank import MemoryBank

    bank = MemoryBank(6, 2, 4)
    bank.update(torch.randn(3, 2, 4), torch.arange(3))
    with HostReadRecorder() as recorder:
        rows, _, valid = bank.sample(4)
    assert recorder.reads == [] and bank.has_entries()
    assert int(valid.sum()) == 3 and sorted(rows[valid].tolist()) == [0, 1, 2]
    bank.update(torch.randn(3, 2, 4), torch.arange(3, 6))
    bank.note_if_full()
    torch.manual_seed(1)
    with HostReadRecorder() as recorder:
        rows, _, valid = bank.sample(4)
    assert recorder.reads == [] and valid is None
    torch.manual_seed(1)
    assert torch.equal(rows, torch.randperm(6)[:4])


def test_ipmc_bank_known_full_survives_a_checkpoint() -> None:
    """Sampling draws differently once the bank is known full: a resumed run must know it too."""
    from mmviews.objectives.ipmc.memory_bank import MemoryBank

    bank = MemoryBank(4, 2, 3)
    bank.update(torch.randn(4, 2, 3), torch.arange(4))
    restored = MemoryBank(4, 2, 3)
    restored.load_state_dict(bank.state_dict())
    assert restored.has_entries() and restored.sample(2)[2] is not None  # full, but not yet known to be
    bank.note_if_full()
    restored.load_state_dict(bank.state_dict())
    assert restored.sample(2)[2] is None
    state = bank.state_dict()
    del state["known_full"]  # a checkpoint from before the flag
    restored.load_state_dict(state)
    assert restored.sample(2)[2] is not None


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
        full_x, partial_x = moved_full.present_items("x"), moved_partial.present_items("x")
    assert recorder.reads == []
    assert torch.equal(moved_partial.mask, partial.mask) and torch.equal(moved_partial.index, partial.index)
    # Per modality, in the stacked order k * V + v: sample 1's second view (item 3) is missing.
    assert full_x.all and full_x.index is None and (full_x.positions, full_x.total) == ((0, 1, 2, 3, 4, 5), 6)
    assert not partial_x.all and not partial_x.none and partial_x.positions == (0, 1, 2, 4, 5)
    assert partial_x.index is not None and partial_x.index.tolist() == [0, 1, 2, 4, 5]
    checked = dataclasses.replace(partial, inputs_checked=True).to("cpu")
    assert checked.inputs_checked and not moved_partial.inputs_checked


@pytest.mark.cuda  # pinned memory needs CUDA
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


# ---- text tokenised where batches are collated ----------------------------------------------
def _text_and_audio_batch() -> tuple[MultiViewEncoder, ViewBatch]:
    """An encoder (text, audio) and a batch with interleaved modalities and missing views; the
    longest text belongs to an absent view, so that the token ids made for every item are wider
    than those of the present ones."""
    torch.manual_seed(0)
    encoder = MultiViewEncoder({"text": build_adapter(tiny_config("text")),
                                "audio": build_adapter(tiny_config("audio_cnn"))}).train()
    views = [ViewInfo("text_0", "text", 0), ViewInfo("audio_0", "audio", 0), ViewInfo("text_1", "text", 1)]
    mask = torch.tensor([[True, True, True], [True, False, False], [False, True, True], [True, True, True]])
    texts = ["the cat sat", "a dog ran", "the bird flew", "the man reads a book under the tree on the mat",
             "", "a red car", "the child plays", "music"]
    inputs = {"text": {"text": texts},
              "audio": {"values": torch.randn(4, 3200), "lengths": torch.tensor([3200, 0, 1600, 2400]),
                        "sample_rate": 16000}}
    return encoder, ViewBatch(inputs=inputs, views=views, mask=mask, index=torch.arange(4))


def _with_own_inputs(batch: ViewBatch) -> ViewBatch:
    """``batch`` with its own input dicts, which the host preparation may replace."""
    return dataclasses.replace(batch, inputs={modality: dict(inputs) for modality, inputs in batch.inputs.items()})


def test_text_tokenised_in_collation_encodes_like_raw_text_without_host_reads() -> None:
    encoder, raw = _text_and_audio_batch()
    prepared = encoder.host_preparation()(_with_own_inputs(raw))
    assert prepared.inputs_checked and "text" not in prepared.inputs["text"]
    assert prepared.inputs["text"]["lengths"] == [5, 5, 5, 13, 2, 5, 5, 3]
    prepared = prepared.to("cpu", non_blocking=True)
    torch.manual_seed(1)  # the same dropout masks in both passes
    with HostReadRecorder() as recorder:
        z, _ = encoder(prepared)
    assert recorder.reads == [], [f"{r.op} at {r.where}" for r in recorder.reads]
    torch.manual_seed(1)
    expected, _ = encoder(raw)  # tokenised in forward
    assert torch.equal(z, expected)


def test_text_tokenised_in_collation_encodes_like_raw_text_through_the_feature_cache(tmp_path: Path) -> None:
    """A frozen text backbone with a feature cache computes the missing rows on a subset of the
    collated token ids: the same features as from the raw texts of that subset."""
    encoder, raw = _text_and_audio_batch()
    encoder.adapters["text"].backbone.requires_grad_(False)
    prepared = encoder.host_preparation()(_with_own_inputs(raw))
    outputs = []
    for name, batch in (("raw", raw), ("prepared", prepared)):
        encoder.enable_cache(tmp_path / name, modalities=["text"])  # an empty cache for each
        torch.manual_seed(1)
        outputs.append(encoder(batch)[0])
        assert encoder.caches["text"].misses == 6
    assert torch.equal(outputs[0], outputs[1])


def test_text_preparation_travels_to_workers_without_weights() -> None:
    """The trainer's collation step with the text adapter's tokenizer (the synthetic data's 134
    words) pickles small, and tokenises in a worker as in the main process."""
    encoder = MultiViewEncoder({"text": build_adapter({**tiny_config("text"), "vocab": "synthetic"}),
                                "audio": build_adapter(tiny_config("audio_cnn"))})
    payload = pickle.dumps(HostPreparedCollate(_collate_stub, encoder.host_preparation()))
    assert len(payload) < 10_000, f"{len(payload)} bytes: the tokenizer and checks must not carry weights"
    _, batch = _text_and_audio_batch()
    copy = pickle.loads(payload).prepare(_with_own_inputs(batch))
    own = encoder.host_preparation()(batch)
    assert copy.inputs["text"]["lengths"] == own.inputs["text"]["lengths"]
    assert torch.equal(copy.inputs["text"]["input_ids"], own.inputs["text"]["input_ids"])
    inputs = {"text": {"text": ["the cat", "  "]}, "audio": {"values": torch.randn(2, 3200)}}
    views = [ViewInfo("text_0", "text", 0), ViewInfo("audio_0", "audio", 0)]
    with pytest.raises(ValueError, match=r"modality 'text': text adapter: empty string\(s\) at batch "
                                         r"position\(s\) \[1\]"):
        pickle.loads(payload).prepare(ViewBatch(inputs=inputs, views=views, mask=torch.ones(2, 2, dtype=torch.bool)))


def _train_text_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch, *, workers: int = 0
                    ) -> tuple[list[str], dict[str, torch.Tensor], list[ViewBatch]]:
    """A short run (4 steps) on synthetic text and images, some samples without text: its losses
    at every step, its final encoder weights and its batches."""
    seen: list[ViewBatch] = []
    original = trainer.epoch_loader

    def batches(p: Any, parts: Any, epoch: int) -> Any:
        for batch in original(p, parts, epoch):
            seen.append(batch)
            yield batch

    monkeypatch.setattr(trainer, "epoch_loader", batches)
    adapters = {"text": {**tiny_config("text"), "vocab": "synthetic", "max_length": 24},
                "image": tiny_config("small_cnn")}
    config = synthetic_config(adapters, [{"modality": "text"}, {"modality": "image"}])
    config["output"]["log_every"] = 1
    config["data"]["num_workers"] = workers
    train(config_from_dict(config), run_dir)
    with (run_dir / "metrics.csv").open() as f:
        losses = [row["loss"] for row in csv.DictReader(f)]
    weights = MultiViewEncoder.from_pretrained(run_dir / "encoder").state_dict()
    return losses, weights, seen


def test_training_on_text_tokenised_in_collation_matches_tokenising_in_forward(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    losses, weights, batches = _train_text_run(tmp_path / "collated", monkeypatch)
    assert all(set(b.inputs["text"]) == {"input_ids", "attention_mask", "lengths"} for b in batches)
    assert any(not b.present_items("text").all for b in batches), "expected samples without text"
    in_worker = _train_text_run(tmp_path / "worker", monkeypatch, workers=1)
    # The reference: the trainer's collation checks the raw text only; forward tokenises it.
    monkeypatch.setattr(MultiViewEncoder, "host_preparation", MultiViewEncoder.input_check)
    ref_losses, ref_weights, ref_batches = _train_text_run(tmp_path / "forward", monkeypatch)
    assert all(set(b.inputs["text"]) == {"text"} for b in ref_batches)
    assert len(losses) == 4 and losses == ref_losses == in_worker[0]
    assert weights.keys() == ref_weights.keys() == in_worker[1].keys()
    assert all(torch.equal(weights[k], ref_weights[k]) and torch.equal(weights[k], in_worker[1][k]) for k in weights)
