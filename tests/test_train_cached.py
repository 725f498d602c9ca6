"""Cached-embedding steps (``optimisation.encode_chunk_size``, :mod:`mmviews.train.step`):
the same training as the plain step, with the encoder's activations of one chunk at a time.

Equality with the plain step is checked on whole runs (several optimiser steps: weights and the
logged per-step losses) for a stateless, a poly-view and two stateful objectives, with missing
modalities, gradient accumulation and clipping, two gloo processes, and kill + ``--resume``;
chunk sizes that do not divide the batch, so that the last chunk is shorter."""

from __future__ import annotations

import csv
import json
import shutil
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_resume import SLOW_TRAIN, _kill_when_held, check_resumed_exactly
from test_train_resume import train_recorded_in_process as recorded_in_process
from test_train_utils import load_weights, own_accelerate_state, run_ranks, started, write_recipe
from torch import nn

import mmviews.train.trainer as trainer
from mmviews.bench.host_reads import HostReadRecorder
from mmviews.config import ConfigError, config_from_dict
from mmviews.data.batch import PresentItems, ViewBatch, ViewInfo
from mmviews.modalities.presets import TINY_BERT, tiny_config
from mmviews.run import list_checkpoints
from mmviews.train import train
from mmviews.train.step import chunk_bounds, encode_without_graph

TESTS = Path(__file__).resolve().parent
# bf16 runs: the cached and plain steps differ by < 1e-4 here; bf16 and float32 runs by ~1e-3 (losses).
BF16_ATOL = 3e-4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """This module's in-process runs on one torch thread, as the subprocesses
    (``OMP_NUM_THREADS=1``). On a busy 2-core machine (CI: two pytest-xdist workers and their
    subprocesses) the default two OpenMP threads per run spin against each other and cost several
    times the work (measured on this file's in-process tests, load 6-10: 60-150 s wall and 32-58 s
    CPU with the default, 19-24 s and 9.5 s with one thread). Each comparison runs both of its
    sides here, so both get the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gaussian_config(objective: dict[str, Any], *, chunk: int | None, ema_teacher: bool = False, epochs: int = 1,
                    head: dict[str, Any] | None = None, hidden_dim: int = 16, batch_size: int = 16,
                    num_samples: int = 96, **optimisation: Any) -> dict[str, Any]:
    """A recipe of a few seconds: 4 noisy copies of a 1-D latent, an MLP per view."""
    return {
        "name": "cached", "seed": 0,
        "data": {"name": "gaussian_latents", "split_options": {"train": {"num_samples": num_samples}},
                 "batch_size": batch_size, "val_split": None, "test_split": None},
        "views": [{"modality": "x", "copies": 4, "augment": "seq_noise", "params": {"std": 0.03}}],
        "encoder": {"embed_dim": 8},
        "adapters": {"x": {"type": "mlp", "input_dim": 1, "hidden_dim": hidden_dim,
                           "head": head or {"kind": "linear"}}},
        "objective": {**objective, "ema_teacher": ema_teacher},
        # float32: `auto` picks bf16 on a CPU with native bf16, where "equal" would not hold
        "optimisation": {"optimizer": "adamw", "lr": 1e-2, "epochs": epochs, "max_grad_norm": 5.0,
                         "encode_chunk_size": chunk, "mixed_precision": "no", **optimisation},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 0, "keep_last": 1, "progress_bar": False},
        "cpu": True,
    }


def with_chunk(config: dict[str, Any], chunk: int | None) -> dict[str, Any]:
    return {**config, "optimisation": {**config["optimisation"], "encode_chunk_size": chunk}}


def losses(run: Path) -> list[float]:
    return [float(row["loss"]) for row in csv.DictReader((run / "metrics.csv").open())]


def train_in_process(config: dict[str, Any], run: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    train(config_from_dict(config), run)
    return load_weights(run / "encoder"), losses(run)


def assert_same_training(a: tuple[dict[str, torch.Tensor], list[float]],
                         b: tuple[dict[str, torch.Tensor], list[float]], atol: float = 1e-5) -> None:
    (wa, la), (wb, lb) = a, b
    assert len(la) == len(lb) >= 4
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=0, atol=atol)
    assert wa.keys() == wb.keys()
    for k in wa:
        # Looser than the losses: Adam's normalised steps carry the gradients' float-rounding
        # differences (summation order of the chunks) into the weights, step after step.
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=5 * atol, msg=lambda m, k=k: f"{k}: {m}")


# ---- ViewBatch.sample_range ------------------------------------------------------------------
def _batch() -> ViewBatch:
    """K = 5 samples: modality "a" with two views (stacked sample-major, a list input and a
    scalar), "b" with one view absent from samples 1-3."""
    views = [ViewInfo("a_0", "a", 0), ViewInfo("b_0", "b", 0), ViewInfo("a_1", "a", 1)]
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[1:4, 1] = False
    mask[0, 2] = False
    inputs = {"a": {"values": torch.arange(10.0).reshape(10, 1), "lengths": list(range(10)), "sample_rate": 16000},
              "b": {"values": torch.arange(5.0).reshape(5, 1) + 100}}
    return ViewBatch(inputs, views, mask, labels={"class": torch.arange(5) * 10}, index=torch.arange(5) + 50)


@pytest.mark.parametrize("moved", [False, True])
def test_sample_range_slices_every_input_and_the_host_presence(moved: bool) -> None:
    batch = _batch()
    if moved:  # presence recorded on the host, as for the trainer's batches
        batch = batch.to("cpu")
        assert batch.presence is not None
    part = batch.sample_range(1, 4)
    assert part.num_samples == 3 and [v.name for v in part.views] == ["a_0", "b_0", "a_1"]
    assert part.inputs["a"]["values"].flatten().tolist() == [2, 3, 4, 5, 6, 7]  # items k * 2 + v
    assert part.inputs["a"]["lengths"] == [2, 3, 4, 5, 6, 7] and part.inputs["a"]["sample_rate"] == 16000
    assert part.inputs["b"]["values"].flatten().tolist() == [101, 102, 103]
    assert torch.equal(part.mask, batch.mask[1:4]) and part.labels["class"].tolist() == [10, 20, 30]
    assert part.index.tolist() == [51, 52, 53]
    assert part.inputs["a"]["values"].data_ptr() == batch.inputs["a"]["values"][2:].data_ptr()  # a view
    # What the chunk knows on the host equals what its own mask says.
    for modality in ("a", "b"):
        expected = PresentItems.from_mask(part.modality_mask(modality))
        got = part.present_items(modality)
        assert (got.positions, got.total) == (expected.positions, expected.total)
        assert (got.index is None) == (expected.index is None)
        if got.index is not None:
            assert torch.equal(got.index, expected.index)
    assert part.present_items("b").none  # a chunk with none of a modality
    assert part.all_views_present() is False
    if moved:
        assert part.presence is not None and part.all_present is False  # known without reading the mask
    first = batch.sample_range(0, 1)
    assert first.present_items("a").positions == (0,) and first.present_items("a").index.tolist() == [0]
    assert batch.sample_range(4, 5).all_views_present()
    with pytest.raises(ValueError, match="sample_range"):
        batch.sample_range(3, 3)


def test_chunk_bounds_cover_the_batch() -> None:
    assert chunk_bounds(16, 5) == [(0, 5), (5, 10), (10, 15), (15, 16)]
    assert chunk_bounds(4, 8) == [(0, 4)]


def test_encode_chunk_size_is_validated() -> None:
    config = gaussian_config({"name": "mv_infonce"}, chunk=0)
    with pytest.raises(ConfigError, match="optimisation.encode_chunk_size.*>= 1.*got 0"):
        config_from_dict(config)
    with pytest.raises(ConfigError, match="optimisation.encode_chunk_size"):
        config_from_dict(with_chunk(config, "all"))
    assert config_from_dict(with_chunk(config, None)).optimisation.encode_chunk_size is None


# ---- equal to the plain step -----------------------------------------------------------------
@pytest.mark.parametrize("objective,ema_teacher", [
    ({"name": "mv_infonce", "params": {"temperature": 0.2}}, False),  # stateless
    ({"name": "geometric_pvc", "params": {"temperature": 0.2}}, False),  # poly-view
    # IPMC: memory bank, view filter after a warm-up epoch, critic with its own optimiser
    ({"name": "ipmc", "params": {"beta": 0.1, "view_filter_k": 1, "warmup_epochs": 1, "memory_bank_size": 64,
                                 "bank_negatives": 32, "critic_steps": 2}}, False),
    ({"name": "er", "params": {"temperature": 0.2}, "teacher_momentum": 0.9}, True),  # EMA teacher
])
def test_cached_step_trains_like_the_plain_step(tmp_path: Path, objective: dict, ema_teacher: bool) -> None:
    config = gaussian_config(objective, chunk=None, ema_teacher=ema_teacher, epochs=2, num_samples=48)
    plain = train_in_process(config, tmp_path / "plain")
    cached = train_in_process(with_chunk(config, 5), tmp_path / "cached")  # 16 = 5 + 5 + 5 + 1
    assert_same_training(plain, cached)
    if objective["name"] == "ipmc":  # the critic and the filter were active
        rows = list(csv.DictReader((tmp_path / "cached" / "metrics.csv").open()))
        assert float(rows[-1]["critic_distance"]) != 0 and float(rows[-1]["moved_to_positive"]) > 0


def test_cached_step_with_grad_accumulation_and_clipping(tmp_path: Path) -> None:
    # 12 micro-batches, 2 per optimiser step; a norm bound small enough to clip every step.
    config = gaussian_config({"name": "geometric_pvc", "params": {"temperature": 0.2}}, chunk=None, epochs=2,
                             grad_accum_steps=2, max_grad_norm=0.05)
    plain = train_in_process(config, tmp_path / "plain")
    assert_same_training(plain, train_in_process(with_chunk(config, 3), tmp_path / "cached"))
    unclipped = train_in_process({**config, "optimisation": {**config["optimisation"], "max_grad_norm": None}},
                                 tmp_path / "unclipped")
    assert not torch.allclose(unclipped[0]["x/head.net.weight"], plain[0]["x/head.net.weight"])  # it clipped


def test_cached_step_under_bf16_autocast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 autocast (Accelerate's wrapper of the encoder's forward, which pass 1's call of the
    unwrapped encoder keeps): the cached step follows the plain one to bf16 rounding."""
    config = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=None, num_samples=64,
                             mixed_precision="bf16")
    precisions, make_accelerator = [], trainer.make_accelerator

    def recording(*args: Any, **kwargs: Any) -> Any:
        accelerator = make_accelerator(*args, **kwargs)
        precisions.append((accelerator.mixed_precision, accelerator.native_amp))
        return accelerator

    monkeypatch.setattr(trainer, "make_accelerator", recording)
    with own_accelerate_state():
        plain = train_in_process(config, tmp_path / "plain")
        cached = train_in_process(with_chunk(config, 5), tmp_path / "cached")
    assert precisions == [("bf16", True)] * 2  # both runs under Accelerate's bf16 autocast
    assert_same_training(plain, cached, atol=BF16_ATOL)


def _missing_modalities_config(chunk: int | None, adapters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Text and image views, each modality absent from 40% of the samples. Default adapters:
    tiny BERT and tiny ViT (LayerNorm backbones), heads without BatchNorm, no dropout."""
    head = {"kind": "mlp", "hidden_dim": 16, "batch_norm": False}
    bert = {**TINY_BERT, "num_hidden_layers": 1, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    adapters = adapters or {"text": {**tiny_config("text", bert_config=bert), "vocab": "synthetic", "head": head},
                            "image": {**tiny_config("open_clip"), "head": head}}
    return {
        "name": "cached-missing", "seed": 0,
        "data": {"name": "synthetic", "options": {"modalities": sorted(adapters), "missing_rate": 0.4},
                 "split_options": {"train": {"num_samples": 36}}, "batch_size": 12, "val_split": None,
                 "test_split": None},
        "views": [{"modality": m, "copies": 2} for m in sorted(adapters)],
        "encoder": {"embed_dim": 16},
        "adapters": adapters,
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        # SGD: Adam would blow rounding noise up to lr-sized steps in weights whose gradient is
        # zero in exact arithmetic (attention key biases), making "equal" untestable.
        "optimisation": {"optimizer": "sgd", "lr": 0.1, "epochs": 1, "encode_chunk_size": chunk,
                         "mixed_precision": "no"},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 0, "keep_last": 1, "progress_bar": False},
        "cpu": True,
    }


def _record_batches(monkeypatch: pytest.MonkeyPatch, recorder: HostReadRecorder | None = None) -> list[ViewBatch]:
    """Collect the batches the loop trains on (and label ``recorder``'s reads with their step;
    the loader's ``next`` is not recorded)."""
    original, seen = trainer.epoch_loader, []

    def batches(p: Any, parts: Any, epoch: int) -> Any:
        iterator = iter(original(p, parts, epoch))
        while True:
            if recorder is not None:
                with recorder.paused():
                    batch = next(iterator, None)
            else:
                batch = next(iterator, None)
            if batch is None:
                return
            if recorder is not None:
                recorder.step = p.state.step + 1
            seen.append(batch)
            yield batch

    monkeypatch.setattr(trainer, "epoch_loader", batches)
    return seen


def _assert_chunks_miss_modalities(batches: list[ViewBatch], chunk: int, modalities: tuple[str, ...]) -> None:
    """Some chunk has none of a modality, some has part of one."""
    chunks = [b.sample_range(s, e) for b in batches for s, e in chunk_bounds(b.num_samples, chunk)]
    assert any(c.present_items(m).none for c in chunks for m in modalities)
    assert any(not c.present_items(m).none and not c.present_items(m).all for c in chunks for m in modalities)


def test_cached_step_with_missing_modalities_trains_like_the_plain_step(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _record_batches(monkeypatch)
    plain = train_in_process(_missing_modalities_config(None), tmp_path / "plain")
    _assert_chunks_miss_modalities(seen, 2, ("text", "image"))
    cached = train_in_process(_missing_modalities_config(2), tmp_path / "cached")
    (wa, la), (wb, lb) = plain, cached
    assert len(la) == len(lb) == 3
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=0, atol=1e-5)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_cached_step_reads_nothing_back_with_missing_modalities(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks find which of their items are present on the host (a device would not wait)."""
    recorder = HostReadRecorder()
    recorder.step = "setup"
    seen = _record_batches(monkeypatch, recorder)
    config = _missing_modalities_config(2, {"audio": tiny_config("audio_cnn"), "image": tiny_config("small_cnn")})
    config["output"]["log_every"] = 1000
    with pytest.warns(UserWarning, match="BatchNorm"), recorder:
        train(config_from_dict(config), tmp_path / "cached")
    _assert_chunks_miss_modalities(seen, 2, ("audio", "image"))
    # The only log step is the last, step 3: nothing read back before it.
    assert any(r.step == 3 for r in recorder.reads), "the recorder saw nothing at the log step"
    assert [f"step {r.step}: {r.op} at {r.where}" for r in recorder.reads if r.step not in ("setup", 3)] == []


# ---- RNG replay, memory, BatchNorm ----------------------------------------------------------
def _encoder_outputs(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """The encoder's outputs during training, by whether gradients were on ("grad": pass 2, and
    the plain step) or off ("no_grad": pass 1); and for each pass-1 call, the output of the same
    call in eval mode ("eval": no dropout, same weights; it draws nothing from the RNG)."""
    from mmviews.modalities import MultiViewEncoder

    outputs: dict[str, list[torch.Tensor]] = {"grad": [], "no_grad": [], "eval": []}
    original = MultiViewEncoder.forward

    def forward(self: Any, batch: ViewBatch) -> Any:
        z, mask = original(self, batch)
        outputs["grad" if torch.is_grad_enabled() else "no_grad"].append(z.detach().clone())
        if not torch.is_grad_enabled() and self.training:
            self.eval()
            try:
                outputs["eval"].append(original(self, batch)[0].detach().clone())
            finally:
                self.train()
        return z, mask

    monkeypatch.setattr(MultiViewEncoder, "forward", forward)
    return outputs


def _train_recording_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    head = {"kind": "mlp", "hidden_dim": 32, "batch_norm": False, "dropout": 0.5}
    config = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=5, head=head,
                             num_samples=48)
    outputs = _encoder_outputs(monkeypatch)
    train(config_from_dict(config), tmp_path / "run")
    return outputs


def check_pass_2_replays_pass_1(outputs: dict[str, list[torch.Tensor]]) -> None:
    pass_1, pass_2, undropped = outputs["no_grad"], outputs["grad"], outputs["eval"]
    assert len(pass_1) == len(pass_2) == len(undropped) == 3 * 4  # 3 steps of 4 chunks
    for i, (a, b) in enumerate(zip(pass_1, pass_2)):
        assert torch.equal(a, b), f"chunk {i}: pass 2 drew other dropout masks than pass 1"
    # Dropout was drawing (else the equality above says nothing): every chunk's pass-1 embeddings
    # differ from those of the same chunk and weights without dropout.
    for i, (a, e) in enumerate(zip(pass_1, undropped)):
        assert not torch.allclose(a, e, atol=1e-3), f"chunk {i}: dropout dropped nothing"


def test_pass_2_replays_the_random_draws_of_pass_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ordinary dropout on, the embeddings backpropagated in pass 2 are those the loss saw
    in pass 1, chunk by chunk, bit for bit: each chunk's RNG states are restored.
    (That the random stream then goes on as after a plain step is checked by the IPMC case of
    test_cached_step_trains_like_the_plain_step: its critic and bank draw from it.)"""
    check_pass_2_replays_pass_1(_train_recording_outputs(tmp_path, monkeypatch))


@pytest.mark.parametrize("broken,message", [("cached_no_rng_replay", "pass 2 drew other dropout masks"),
                                            ("dropout_draws_nothing", "dropout dropped nothing")])
def test_rng_replay_check_fails_on_the_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str,
                                            message: str) -> None:
    """Mutation tests (tests/README.md): pass 2 without pass 1's RNG states; dropout that draws
    nothing (the replay check would then hold trivially)."""
    from mutations import apply_break

    apply_break(broken, monkeypatch.setattr)
    outputs = _train_recording_outputs(tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match=message):
        check_pass_2_replays_pass_1(outputs)


def test_cached_step_with_sample_keyed_dropout_trains_like_the_plain_step(tmp_path: Path) -> None:
    """Dropout on, keyed by sample (optimisation.sample_keyed_dropout): the chunks draw the masks
    the whole batch draws, so the cached step equals the plain one with dropout on too; with
    ER's EMA teacher, whose copy drops too (masks of its own)."""
    head = {"kind": "mlp", "hidden_dim": 32, "batch_norm": False, "dropout": 0.3}
    config = gaussian_config({"name": "er", "params": {"temperature": 0.2}, "teacher_momentum": 0.9}, chunk=None,
                             ema_teacher=True, head=head, num_samples=64, sample_keyed_dropout=True)
    plain = train_in_process(config, tmp_path / "plain")
    assert_same_training(plain, train_in_process(with_chunk(config, 5), tmp_path / "cached"))
    # The dropout was on: without it the run differs.
    off = {**config, "adapters": {"x": {**config["adapters"]["x"], "head": {**head, "dropout": 0.0}}}}
    assert not torch.allclose(train_in_process(off, tmp_path / "off")[0]["x/head.net.0.weight"],
                              plain[0]["x/head.net.0.weight"])


def _live_saved_bytes(run: Any) -> int:
    """The peak of the bytes held for backward (saved tensors, parameters excepted) while
    ``run()`` trains."""
    live, peak = [0], [0]

    class Held:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def release(n: int) -> None:
        live[0] -= n

    def pack(tensor: torch.Tensor) -> Any:
        held = Held(tensor)
        if not isinstance(tensor, nn.Parameter):
            n = tensor.numel() * tensor.element_size()
            live[0] += n
            peak[0] = max(peak[0], live[0])
            weakref.finalize(held, release, n)
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        run()
    return peak[0]


def test_pass_1_keeps_no_activations(tmp_path: Path) -> None:
    """Peak bytes saved for backward over a step: a wide MLP encoder whose activations dominate;
    K = 64 in chunks of 8. Pass 1 saves nothing at all."""
    config = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=None, hidden_dim=512,
                             batch_size=64, num_samples=64)
    peak = {chunk: _live_saved_bytes(lambda chunk=chunk: train(config_from_dict(with_chunk(config, chunk)),
                                                               tmp_path / f"run{chunk}"))
            for chunk in (None, 8)}
    assert peak[8] < 0.3 * peak[None], peak

    # Pass 1 on its own, on a prepared run: nothing saved.
    from accelerate import PartialState

    parts = trainer.build_run(config_from_dict(with_chunk(config, 8)), PartialState(cpu=True).num_processes, "test")
    p = trainer.prepare_run(trainer.make_accelerator(parts.config, tmp_path / "p", []), parts)
    batch = next(iter(p.train_loader))
    saved = _live_saved_bytes(lambda: encode_without_graph(p, [batch.sample_range(s, e) for s, e in
                                                               chunk_bounds(batch.num_samples, 8)]))
    assert saved == 0


def test_batch_norm_running_statistics_update_once_per_chunk(tmp_path: Path) -> None:
    head = {"kind": "mlp", "hidden_dim": 16, "batch_norm": True}
    config = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=5, head=head,
                             num_samples=32, max_steps=1)
    with pytest.warns(UserWarning, match="encode_chunk_size = 5 with BatchNorm"):
        train(config_from_dict(config), tmp_path / "run")
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "run" / "encoder" / "x" / "model.safetensors"))
    counts = [v.item() for k, v in weights.items() if k.endswith("num_batches_tracked")]
    # One optimiser step, K = 16 in 4 chunks (5, 5, 5 and 1 samples of 4 views): the running
    # statistics are updated once per chunk (in pass 2), not twice.
    assert counts == [4]


# ---- processes and resume --------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process with the plain step ("one"), and two gloo processes with cached steps (8
    samples each, chunks of 3): intact ("two"), then, in the same processes, with the break
    ``cached_scale_by_processes`` of tests/mutations.py ("broken"; its mutation test below).
    Plain SGD without clipping (AdamW would cancel a constant factor on the gradient, a clip
    would replace its norm), 2 micro-batches per optimiser step."""
    folder = tmp_path_factory.mktemp("cached-two")
    config = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=None, num_samples=128,
                             grad_accum_steps=2, optimizer="sgd", lr=0.5, momentum=0.0, max_grad_norm=None)
    train_in_process(config, folder / "one")
    recipe = write_recipe(folder / "cached.yaml", with_chunk(config, 3))
    # The two ranks started by the test (torchrun's environment), no launcher process.
    ranks = run_ranks([sys.executable, str(TESTS / "cached_worker.py"), str(recipe), str(folder / "two"),
                       "--then-break", "cached_scale_by_processes", str(folder / "broken")], folder)
    assert all(r.returncode == 0 for r in ranks), "\n".join(  # a rank the test killed (rc -9) after another failed
        f"rank {rank} (rc {r.returncode}): {r.stderr[-3000:]}" for rank, r in enumerate(ranks))
    return {name: folder / name for name in ("one", "two", "broken")}


def _trained(run: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    return load_weights(run / "encoder"), losses(run)


def test_two_processes_cached_match_one_process_plain_with_one_reduction_per_step(
        two_process_runs: dict[str, Path]) -> None:
    """Two gloo processes with cached steps reach the weights of one process with the plain step
    (under SGD: the gradients' scale too); DDP reduces gradients once per optimiser step, not per
    chunk (counted with a communication hook, ``tests/cached_worker.py``)."""
    two = two_process_runs["two"]
    assert json.loads((two / "results.json").read_text())["num_processes"] == 2
    assert_same_training(_trained(two_process_runs["one"]), _trained(two))
    # 8 micro-batches of 16, 2 per optimiser step: 4 steps, one bucket reduced in each.
    assert json.loads((two / "reductions.json").read_text()) == {"reductions": 4, "steps": 4}


def test_two_process_cached_check_fails_when_dz_is_scaled_by_the_processes(two_process_runs: dict[str, Path]) -> None:
    """Mutation test (tests/README.md): the cached backward multiplies dL/dz by the number of
    processes; the two-process comparison reports it."""
    broken = two_process_runs["broken"]
    assert json.loads((broken / "results.json").read_text())["num_processes"] == 2
    with pytest.raises(AssertionError, match="not close"):
        assert_same_training(_trained(two_process_runs["one"]), _trained(broken))


def test_kill_and_resume_a_cached_run_gives_the_uninterrupted_weights(tmp_path: Path) -> None:
    """SIGKILLed after step 7 (mid-epoch 2, one step past the checkpoint of step 6), the cached
    run resumes: it says so, runs steps 7-12 with the uninterrupted run's counters (samples,
    epoch, scheduler), and ends with its weights and losses. A resume that restores nothing
    (break ``skip_restore``: the same seed reaches the same weights from step 0) fails that check."""
    # Dropout on: the resumed run must continue the random stream as the uninterrupted one does.
    head = {"kind": "mlp", "hidden_dim": 16, "batch_norm": False, "dropout": 0.2}
    config = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, chunk=5, head=head, epochs=2)
    config["output"].update(checkpoint_every=2, keep_last=2)
    recipe = write_recipe(tmp_path / "cached.yaml", config)
    # The uninterrupted run and the resume in this process, one thread (bitwise equal to the
    # subprocesses' runs); only the run that is killed needs a process of its own.
    _, reference_rows = recorded_in_process(tmp_path, str(recipe), "--output", str(tmp_path / "full"))

    run, held = tmp_path / "run", tmp_path / "held"
    with started([sys.executable, str(SLOW_TRAIN), "--hold-after-step", "7", "--hold-marker", str(held), "--",
                  str(recipe), "--output", str(run)]) as proc:
        _kill_when_held(proc, held, "step 7")
    assert not (run / "encoder").exists()
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "checkpoint-00000006"
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    stdout, rows = recorded_in_process(tmp_path, "--resume", str(run))
    check_resumed_exactly(stdout, rows, checkpoint, 12, reference_rows)
    full, resumed = load_weights(tmp_path / "full" / "encoder"), load_weights(run / "encoder")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), f"{k} differs after resume"
    assert losses(run) == losses(tmp_path / "full")

    # The mutation test of the check above, in this process (the check reads no weights); the
    # first step is enough to show it (the run restarts at step 0).
    stdout, rows = recorded_in_process(tmp_path, "--resume", str(copy),
                                       options=("--break", "skip_restore", "--stop-after-step", "1"))
    assert [row["step"] for row in rows] == [1] and "at step 0 of 12" in stdout  # the break did what it says
    with pytest.raises(AssertionError):
        check_resumed_exactly(stdout, rows, copy / "checkpoints" / checkpoint.name, 12, reference_rows)
