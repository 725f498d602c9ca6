"""The setup of a training run that the trainer and the benchmarks share
(:mod:`mmviews.train.setup`): the run's length in optimiser steps, the Accelerator a recipe asks
for, the prepared objects, each epoch's loader and the host-prepared collate. Expected values
are counted by hand from the recipe; the run is a tiny one (an MLP on 1-D latents, seconds)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mmviews.config import config_from_dict
from mmviews.train.build import build_run
from mmviews.train.distributed import LAUNCHER_FSDP
from mmviews.train.setup import (HostPreparedCollate, batches_forever, epoch_loader, make_accelerator, planned_steps,
                                 prepare_run)
from mmviews.train.state import TrainState
from test_train_sync import gaussian_config
from test_train_utils import own_accelerate_state


def _config(**optimisation: Any) -> Any:
    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}}, num_samples=64, batch_size=16)
    raw["optimisation"].update(optimisation)
    return config_from_dict(raw)


@pytest.mark.parametrize(("batches", "accum", "epochs", "max_steps", "expected"), [
    (10, 1, 2, None, (20, 10)),
    (10, 3, 2, None, (8, 4)),  # a window of 1 batch at the end of each epoch still steps: ceil(10 / 3)
    (9, 3, 2, None, (6, 3)),
    (10, 3, 2, 5, (5, 4)),  # max_steps ends the run early
    (10, 3, 2, 100, (8, 4)),  # ... and never lengthens it
])
def test_planned_steps_count_optimiser_steps(batches: int, accum: int, epochs: int, max_steps: int | None,
                                             expected: tuple[int, int]) -> None:
    config = _config(grad_accum_steps=accum, epochs=epochs, max_steps=max_steps)
    assert planned_steps(config, batches) == expected


def test_accelerator_is_the_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Global batches split between processes, copied without blocking, the recipe's
    accumulation and precision, no tracker unless asked; the launcher's FSDP request is hidden
    while the Accelerator is made (mmviews shards itself) and put back afterwards."""
    seen: list[str | None] = []
    asked_cpu: list[Any] = []
    import accelerate

    made = accelerate.Accelerator

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(os.environ.get(LAUNCHER_FSDP))
        asked_cpu.append(kwargs.get("cpu", "not given"))
        return made(*args, **kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", recording)
    monkeypatch.setenv(LAUNCHER_FSDP, "true")
    # float32 asked for ("auto" is bf16 on a CPU that computes it natively), in a state of its own
    with own_accelerate_state():
        accelerator = make_accelerator(_config(grad_accum_steps=2, mixed_precision="no"), tmp_path)
        assert seen == [None] and os.environ[LAUNCHER_FSDP] == "true"
        assert asked_cpu == [True]  # the recipe's cpu: true (on a machine with a GPU, it trains on the CPU)
        assert accelerator.split_batches and accelerator.non_blocking
        assert accelerator.gradient_accumulation_steps == 2 and accelerator.mixed_precision == "no"
        assert accelerator.device.type == "cpu" and accelerator.log_with == []
        assert accelerator.project_configuration.logging_dir == str(tmp_path / "logs")  # output.trackers write there


def test_prepare_run_gives_the_loop_its_objects(tmp_path: Path) -> None:
    """Optimiser, schedule, loader and state prepared; the run's length; the objective's own
    input check off (the loop checks the loss at log steps); the collate followed by the host
    preparation, once, also when a run is prepared again."""
    config = _config(grad_accum_steps=2, epochs=3)
    parts = build_run(config, 1, "test")
    p = prepare_run(make_accelerator(config, tmp_path), parts)
    assert (p.batches_per_epoch, p.total_steps) == (4, 6)  # 64 samples / K = 16; ceil(4 / 2) per epoch, 3 epochs
    assert p.teacher is None and p.encode_chunk_size is None and p.dropout_seed is None and p.sharded is False
    assert isinstance(p.state, TrainState) and p.state.step == 0 and p.state.stream is None
    assert p.objective is parts.objective and p.objective.check_inputs is False
    collate = parts.train_loader.collate_fn
    assert isinstance(collate, HostPreparedCollate) and not isinstance(collate.collate, HostPreparedCollate)
    prepare_run(make_accelerator(config, tmp_path), parts)
    assert parts.train_loader.collate_fn is collate  # not wrapped twice
    raw = gaussian_config({"name": "er", "params": {}}, ema_teacher=True)
    raw["optimisation"]["sample_keyed_dropout"] = True
    keyed = config_from_dict(raw)
    teacher = prepare_run(make_accelerator(keyed, tmp_path), build_run(keyed, 1, "test"))
    assert teacher.teacher is not None and teacher.dropout_seed == keyed.seed


def test_epoch_loader_seeds_each_epoch_and_skips_what_a_resumed_run_trained_on() -> None:
    """Every epoch: the loader, sampler and collator told its number and the loader's generator
    reseeded from the run's seed, so that a resumed run draws the same batches; mid-epoch, the
    batches already trained on are skipped."""
    calls: list[tuple[str, int]] = []

    def recorder(name: str) -> Any:
        return SimpleNamespace(set_epoch=lambda epoch: calls.append((name, epoch)))

    prepared_loader = SimpleNamespace(set_epoch=lambda epoch: calls.append(("loader", epoch)))
    skipped = SimpleNamespace(set_epoch=lambda epoch: calls.append(("skipped", epoch)))
    accelerator = SimpleNamespace(skip_first_batches=lambda loader, n: (calls.append(("skip", n)), skipped)[1]
                                  if loader is prepared_loader else None)
    generator = torch.Generator()
    parts = SimpleNamespace(sampler=recorder("sampler"), collator=recorder("collator"), loader_generator=generator,
                            config=SimpleNamespace(seed=7))
    p = SimpleNamespace(train_loader=prepared_loader, accelerator=accelerator, state=TrainState())
    assert epoch_loader(p, parts, 2) is prepared_loader
    assert calls == [("loader", 2), ("sampler", 2), ("collator", 2)]
    assert generator.initial_seed() == 7 * 1_000_003 + 2
    calls.clear()
    p.state.batch_in_epoch = 3
    assert epoch_loader(p, parts, 5) is skipped
    assert calls == [("loader", 5), ("sampler", 5), ("collator", 5), ("skip", 3), ("skipped", 5)]
    assert generator.initial_seed() == 7 * 1_000_003 + 5


def test_batches_forever_go_on_epoch_after_epoch(tmp_path: Path) -> None:
    """More batches than an epoch holds: the next epoch's follow, each epoch reseeded."""
    config = _config()
    parts = build_run(config, 1, "test")
    p = prepare_run(make_accelerator(config, tmp_path), parts)
    batches = batches_forever(p, parts)
    drawn = [next(batches) for _ in range(2 * p.batches_per_epoch + 1)]
    assert all(b.num_samples == 16 for b in drawn)
    assert parts.loader_generator.initial_seed() == config.seed * 1_000_003 + 2  # in the third epoch


def _collate(samples: list[int]) -> Any:
    return SimpleNamespace(num_samples=len(samples), samples=samples, prepared=False)


def _prepare(batch: Any) -> Any:
    return SimpleNamespace(**{**vars(batch), "prepared": True})


def test_host_prepared_collate_prepares_every_batch_but_an_empty_one() -> None:
    collate = HostPreparedCollate(_collate, _prepare)
    assert collate([1, 2]).prepared and collate([1, 2]).samples == [1, 2]
    assert collate([]).prepared is False  # every sample unreadable: nothing to prepare
    again = pickle.loads(pickle.dumps(collate))  # loader workers receive it by pickling
    assert again([3]).prepared and again([3]).samples == [3]


def test_the_accelerator_takes_the_recipes_precision_trackers_and_ddp_setting(tmp_path: Path) -> None:
    from accelerate.utils import LoggerType

    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}})
    raw["optimisation"]["mixed_precision"] = "bf16"
    raw["find_unused_parameters"] = False
    with own_accelerate_state():
        accelerator = make_accelerator(config_from_dict(raw), tmp_path / "run", ["tensorboard"])
        assert accelerator.mixed_precision == "bf16"
        assert accelerator.log_with == [LoggerType.TENSORBOARD]
        assert accelerator.project_configuration.project_dir == str(tmp_path / "run")
        assert accelerator.ddp_handler.find_unused_parameters is False


def _prepared(tmp_path: Path, raw: dict[str, Any]) -> tuple[Any, Any]:
    config = config_from_dict(raw)
    parts = build_run(config, 1, "test")
    return prepare_run(make_accelerator(config, tmp_path), parts), parts


def test_the_prepared_objects_train(tmp_path: Path) -> None:
    """The prepared model is the encoder (one process: no wrapper), the optimiser holds the
    recipe's learning rates (backbone and heads apart) and weight decay, and one step with them
    changes the weights and moves the schedule."""
    from mmviews.train.step import train_step

    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}})
    raw["optimisation"].update(lr=0.01, backbone_lr=0.001, weight_decay=0.05, schedule="cosine", warmup_steps=0)
    raw["optimisation"]["encode_chunk_size"] = 8
    p, parts = _prepared(tmp_path, raw)
    assert p.accelerator.unwrap_model(p.model) is parts.encoder and p.encode_chunk_size == 8
    groups = {g["name"].rsplit(".", 1)[-1]: (g["initial_lr"], g["weight_decay"]) for g in p.optimizer.param_groups}
    assert groups == {"backbone": (0.001, 0.05), "backbone_no_decay": (0.001, 0.0), "head": (0.01, 0.05),
                      "head_no_decay": (0.01, 0.0)}
    before = {k: v.clone() for k, v in parts.encoder.state_dict().items()}
    lr = p.scheduler.get_last_lr()
    train_step(p, next(batches_forever(p, parts)), 5.0)
    assert any(not torch.equal(before[k], v) for k, v in parts.encoder.state_dict().items())
    assert p.scheduler.get_last_lr() != lr and p.nonfinite is not None


def test_the_teacher_follows_the_recipe_and_the_accelerator(tmp_path: Path) -> None:
    raw = gaussian_config({"name": "er", "params": {}}, ema_teacher=True)
    raw["objective"]["teacher_momentum"] = 0.9
    p, parts = _prepared(tmp_path, raw)
    assert p.teacher.momentum == 0.9 and p.teacher.autocast == p.accelerator.autocast
    assert p.teacher.module is not parts.encoder and p.sharded is False


def test_batch_norm_under_chunks_warns_and_compile_compiles_the_encoder(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mmviews.notices import MMViewsWarning
    from mmviews.train import setup

    compiled: list[Any] = []
    monkeypatch.setattr(setup, "compile_encoder", compiled.append)
    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}})
    raw["adapters"]["x"]["head"] = {"kind": "mlp", "hidden_dim": 8, "batch_norm": True}
    raw["optimisation"].update(encode_chunk_size=4, compile=True)
    with pytest.warns(MMViewsWarning, match="encode_chunk_size = 4 with BatchNorm"):
        p, parts = _prepared(tmp_path, raw)
    assert compiled == [parts.encoder]


class _StreamedLoader:
    """What prepare_run needs of a streamed loader (mmviews.data.streaming.StreamLoader)."""

    streamed = True

    def __init__(self, inner: Any) -> None:
        self.collate_fn, self.inner, self.moved_to = inner.collate_fn, inner, None

    def __len__(self) -> int:
        return len(self.inner)

    def to(self, device: Any) -> "_StreamedLoader":
        self.moved_to = device
        return self


def test_a_streamed_loader_is_not_prepared_by_accelerate(tmp_path: Path) -> None:
    """Each process reads its own rows: the loader is moved to the device, kept as the state's
    stream (its position is checkpointed), and the rest is prepared as usual."""
    config = _config()
    parts = build_run(config, 1, "test")
    parts.train_loader = _StreamedLoader(parts.train_loader)
    p = prepare_run(make_accelerator(config, tmp_path), parts)
    assert p.train_loader is parts.train_loader and p.state.stream is parts.train_loader
    assert parts.train_loader.moved_to == p.accelerator.device
    assert isinstance(parts.train_loader.collate_fn, HostPreparedCollate)
    assert p.accelerator.unwrap_model(p.model) is parts.encoder and p.scheduler is not None
    assert p.optimizer.optimizer is not None and p.batches_per_epoch == 4


def test_a_sharded_run_shards_encoder_and_teacher_before_the_optimiser(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """distributed.sharding: fsdp on several processes (here said so by run_sharding; the real
    sharding is tests/test_train_sharding.py's, on two gloo processes): the encoder and the
    teacher are each sharded once, with the run's config, device and process count."""
    from mmviews.train import setup

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(setup, "run_sharding", lambda config, processes: "fsdp")
    monkeypatch.setattr(setup, "shard_encoder", lambda *args: calls.append(args))
    raw = gaussian_config({"name": "er", "params": {}}, ema_teacher=True)
    p, parts = _prepared(tmp_path, raw)
    assert p.sharded is True
    device = p.accelerator.device
    assert calls == [(parts.encoder, parts.config, device, 1), (p.teacher.module, parts.config, device, 1)]


def test_epoch_loader_of_a_streamed_run_skips_in_the_stream() -> None:
    skipped: list[int] = []
    stream = SimpleNamespace(set_epoch=lambda epoch: None, skip_batches=skipped.append)
    state = TrainState()
    state.stream, state.batch_in_epoch = stream, 3
    parts = SimpleNamespace(sampler=SimpleNamespace(set_epoch=lambda e: None), loader_generator=torch.Generator(),
                            collator=SimpleNamespace(set_epoch=lambda e: None), config=SimpleNamespace(seed=0))
    p = SimpleNamespace(train_loader=stream, state=state, accelerator=None)
    assert epoch_loader(p, parts, 1) is stream and skipped == [3]


def test_runs_of_two_precisions_train_one_after_the_other_in_one_process(tmp_path: Path) -> None:
    """A bf16 run, then a float32 one, then bf16 again, in one process (a sweep's runs, a
    notebook's): Accelerate's per-process state would refuse the second precision; each run
    trains in its own, and the process's device state (PartialState) is the same object throughout."""
    import json

    from accelerate.state import PartialState
    from test_train_utils import own_accelerate_state, tiny_config, write_recipe

    from mmviews.cli import main

    raw = tiny_config(text=False, num_samples=16, batch_size=8, epochs=1)
    raw["cpu"] = True
    raw["output"]["checkpoint_every"] = 0
    recipe = str(write_recipe(tmp_path / "r.yaml", raw))
    with own_accelerate_state():
        partial = []
        for i, precision in enumerate(("bf16", "no", "bf16")):
            run = tmp_path / f"run{i}"
            argv = ["train", recipe, "--set", f"optimisation.mixed_precision={precision}", "--output", str(run)]
            assert main(argv) == 0, precision
            assert json.loads((run / "results.json").read_text())["mixed_precision"] == precision
            partial.append(dict(PartialState._shared_state))
        assert partial[0] == partial[1] == partial[2] and partial[0]


def test_the_state_of_another_precision_is_released_and_the_same_one_kept() -> None:
    from accelerate.state import AcceleratorState
    from test_train_utils import own_accelerate_state

    from mmviews.train.setup import release_other_precision

    from accelerate.state import PartialState

    with own_accelerate_state():
        release_other_precision("bf16")  # nothing made yet: nothing to release
        assert AcceleratorState._shared_state == {}
        import accelerate

        accelerate.Accelerator(cpu=True, mixed_precision="no")
        kept = dict(AcceleratorState._shared_state)
        release_other_precision("no")
        assert AcceleratorState._shared_state == kept
        PartialState._shared_state["marker"] = "the process group's state"  # kept: a launched run's ranks
        release_other_precision("bf16")
        assert AcceleratorState._shared_state == {}
        assert PartialState._shared_state["marker"] == "the process group's state"


def test_a_run_of_the_same_precision_keeps_the_accelerator_state(tmp_path: Path) -> None:
    """make_accelerator releases the state only for another precision: a second Accelerator of
    the same one shares the first's state (a marker put into it stays), one of another starts afresh."""
    from accelerate.state import AcceleratorState
    from test_train_utils import own_accelerate_state

    with own_accelerate_state():
        make_accelerator(_config(mixed_precision="no"), tmp_path)
        AcceleratorState._shared_state["marker"] = 1
        make_accelerator(_config(mixed_precision="no"), tmp_path)
        assert AcceleratorState._shared_state.get("marker") == 1
        make_accelerator(_config(mixed_precision="bf16"), tmp_path)
        assert "marker" not in AcceleratorState._shared_state
class _SeenAs:
    """A real Accelerator of one process that reports another process count and device, and
    records how ``prepare_model`` is called (then calls it). This machine has one process and
    no accelerator device; ``meta`` stands for one (a device that is not the CPU: what moves
    there is seen by its tensors' device). Real multi-process runs: tests/test_train_sharding.py."""

    def __init__(self, accelerator: Any, num_processes: int, device: torch.device) -> None:
        self._real, self.num_processes, self.device = accelerator, num_processes, device
        self.prepared_models: list[tuple[Any, Any]] = []

    def prepare_model(self, model: Any, **kwargs: Any) -> Any:
        self.prepared_models.append((model, kwargs.get("evaluation_mode", "not given")))
        return self._real.prepare_model(model, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _batch_norm_config() -> Any:
    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}})
    raw["adapters"]["x"]["head"] = {"kind": "mlp", "hidden_dim": 8, "batch_norm": True}
    return config_from_dict(raw)


@pytest.mark.parametrize(("processes", "device", "synced"), [
    (2, "meta", True),  # several processes on an accelerator device: BatchNorm statistics over all of them
    (2, "cpu", False),  # gloo on CPUs: left as it is
    (1, "meta", False),  # one process: nothing to synchronise
])
def test_batch_norm_is_synchronised_only_over_several_processes_on_a_device(tmp_path: Path, processes: int,
                                                                           device: str, synced: bool) -> None:
    config = _batch_norm_config()
    parts = build_run(config, 1, "test")
    seen = _SeenAs(make_accelerator(config, tmp_path), processes, torch.device(device))
    p = prepare_run(seen, parts)
    kinds = {type(m) for m in p.model.modules()}
    assert (torch.nn.SyncBatchNorm in kinds) is synced
    assert (torch.nn.BatchNorm1d in kinds) is not synced
    assert p.accelerator is seen and seen.prepared_models == []  # not sharded: accelerator.prepare wraps it


def test_the_objectives_learned_parameters_get_a_group_of_their_own(tmp_path: Path) -> None:
    """siglip's scale and bias: one optimiser group named ``objective`` with objective.lr (else
    the run's lr) and no weight decay, beside the encoder's decayed groups; moved to the run's
    device before the optimiser takes them (its group holds the moved tensors)."""
    for objective_lr, expected_lr in [(0.25, 0.25), (None, 0.01)]:
        raw = gaussian_config({"name": "siglip", "params": {"temperature": 0.2, "bias": -2.0}})
        raw["objective"]["lr"] = objective_lr
        raw["optimisation"].update(lr=0.01, weight_decay=0.3, schedule="constant", warmup_steps=0)
        config = config_from_dict(raw)
        parts = build_run(config, 1, "test")
        seen = _SeenAs(make_accelerator(config, tmp_path), 1, torch.device("meta"))
        p = prepare_run(seen, parts)
        groups = {g["name"].rsplit(".", 1)[-1]: g for g in p.optimizer.param_groups}
        assert p.optimizer.param_groups[-1]["name"] == "objective"
        learned = groups["objective"]
        assert learned["params"] == [parts.objective.logit_scale, parts.objective.logit_bias]
        assert all(q is r for q, r in zip(learned["params"], parts.objective.trained_parameters()))
        assert all(q.device.type == "meta" for q in learned["params"])
        assert learned["initial_lr"] == expected_lr and learned["weight_decay"] == 0.0
        assert groups["head"]["weight_decay"] == 0.3 and groups["head"]["initial_lr"] == 0.01
        others = {id(q) for name, g in groups.items() if name != "objective" for q in g["params"]}
        assert others and not others & {id(q) for q in learned["params"]}
    fixed = _config()  # nothing learned: no such group
    p = prepare_run(make_accelerator(fixed, tmp_path), build_run(fixed, 1, "test"))
    assert "objective" not in {g["name"] for g in p.optimizer.param_groups}


def test_the_teacher_is_moved_to_the_device_unless_it_was_sharded_there(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsharded run moves its EMA teacher to the run's device; a sharded run's teacher is put
    there by its sharding (here left in place by a recording shard_encoder) and not moved again,
    and its encoder is prepared without Accelerate's DDP wrapper (``evaluation_mode``)."""
    from mmviews.train import setup

    config = config_from_dict(gaussian_config({"name": "er", "params": {}}, ema_teacher=True))
    seen = _SeenAs(make_accelerator(config, tmp_path), 1, torch.device("meta"))
    p = prepare_run(seen, build_run(config, 1, "test"))
    assert {q.device.type for q in p.teacher.module.parameters()} == {"meta"}
    assert seen.prepared_models == []
    sharded: list[Any] = []
    monkeypatch.setattr(setup, "run_sharding", lambda config, processes: "fsdp")
    monkeypatch.setattr(setup, "shard_encoder", lambda module, *args: sharded.append(module))
    seen = _SeenAs(make_accelerator(config, tmp_path), 1, torch.device("meta"))
    parts = build_run(config, 1, "test")
    p = prepare_run(seen, parts)
    assert sharded == [parts.encoder, p.teacher.module]
    assert {q.device.type for q in p.teacher.module.parameters()} == {"cpu"}
    assert seen.prepared_models == [(parts.encoder, True)] and p.model is parts.encoder


def test_the_step_gets_the_encoders_device_flow(tmp_path: Path) -> None:
    """The frames-to-flow model the encoder holds (``data.options.flow: raft``) is the one the
    step converts batches with; none when the encoder holds none."""
    config = _config()
    parts = build_run(config, 1, "test")
    assert prepare_run(make_accelerator(config, tmp_path), parts).device_flow is None
    flow = SimpleNamespace(convert=lambda batch: batch)
    parts.encoder.device_flow = flow
    assert prepare_run(make_accelerator(config, tmp_path), parts).device_flow is flow
