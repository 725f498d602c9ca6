"""Streamed training from Parquet shards (data.streaming: true): epochs of a known length, a run
killed mid-epoch and resumed ends with the uninterrupted run's weights, two gloo processes draw
disjoint rows covering the epoch, evaluation of streamed splits, damaged shards; a stream resumed
with another shuffle buffer, seed, process count or shard list is refused by key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_data_pickle import mmsa_split, write
from test_data_shards import as_list, prepare
from test_train_resume import SLOW_TRAIN, _assert_identical, _kill_when_held, check_resumed_exactly
from test_train_resume import train_recorded_in_process as recorded_in_process
from test_train_utils import load_weights, read_record, run_ranks, started, train_in_process, write_recipe

from mmviews.data import build_dataset
from mmviews.data.streaming import StreamLoader

ROWS = 48  # train rows: 4 shards of 12


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mosi")
    pkl = folder / "mosi.pkl"
    write(pkl, {"train": mmsa_split(ROWS), "valid": mmsa_split(10), "test": mmsa_split(12)})
    r = prepare("mosi", str(pkl), "--format", "parquet", "--shard-rows", "12", "--output", str(folder / "shards"))
    assert r.returncode == 0, r.stdout + r.stderr
    return folder / "shards"


def recipe(shards: Path, **data: object) -> dict:
    def seq(dim: int) -> dict:
        return {"type": "feature_sequence", "input_dim": dim, "width": 16, "num_layers": 1, "num_heads": 2,
                "dropout": 0.1, "head": {"kind": "linear"}}

    return {
        "name": "streamed", "seed": 0, "cpu": True,
        "data": {"name": "hf", "root": str(shards), "streaming": True, "shuffle_buffer": 16, "batch_size": 8,
                 "eval_batch_size": 7, "val_split": "valid", "test_split": "test", **data},
        "views": [{"modality": "text"}, {"modality": "audio"}, {"modality": "vision"}],
        "encoder": {"embed_dim": 8},
        "adapters": {"text": seq(768), "audio": seq(5), "vision": seq(20)},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        "optimisation": {"optimizer": "adamw", "lr": 3e-3, "epochs": 2, "warmup_steps": 1, "max_grad_norm": 5.0},
        "evaluation": {"tasks": [], "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 3, "keep_last": 3, "progress_bar": False},
    }


def test_epochs_and_shuffling_are_reproducible(shards):
    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    assert len(stream.shards.files) == 4 and len(stream) == ROWS

    def epoch(e: int, workers: int = 0) -> list[int]:
        loader = StreamLoader(stream, 8, as_list, seed=5, shuffle_buffer=16, num_workers=workers)
        loader.set_epoch(e)
        return [s["index"] for b in loader for s in b]

    assert len(StreamLoader(stream, 8, as_list)) == ROWS // 8
    e0, e1 = epoch(0), epoch(1)
    assert sorted(e0) == sorted(e1) == list(range(ROWS))  # every row once per epoch
    assert e0 != e1 and e0 != sorted(e0)  # shuffled, differently each epoch
    assert epoch(0) == e0 and epoch(1, workers=2) == e1  # the same order again, whatever the workers


def test_loader_state_resumes_the_same_batches(shards):
    """The position saved mid-epoch (JSON) gives the rest of the epoch's batches, shuffle buffer included."""
    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    first = StreamLoader(stream, 8, as_list, seed=2, shuffle_buffer=16)
    first.set_epoch(1)
    full, state = [], None
    for k, batch in enumerate(first):
        full.append([s["index"] for s in batch])
        if k == 2:
            state = json.loads(json.dumps(first.state_dict()))
    assert state["batches"] == 3 and state["rows"] == 24 and state["epoch"] == 1 and state["datasets_state"]
    again = StreamLoader(stream, 8, as_list, seed=2, shuffle_buffer=16)
    again.load_state_dict(state)
    assert [[s["index"] for s in b] for b in again] == full[3:]
    other = StreamLoader(stream, 8, as_list, seed=3, shuffle_buffer=16)
    with pytest.raises(ValueError, match="key 'seed' changed"):
        other.load_state_dict(state)


def check_resume_refused(shards: Path, change: str) -> None:
    """The guard: a stream resumed with another shuffle buffer, seed, process count or shard list
    would draw other batches than the run it continues: refused with one line naming what changed
    (the recipe key where there is one) and both values; the same state resumes with the same settings."""
    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    first = StreamLoader(stream, 4, as_list, seed=2, shuffle_buffer=16)
    first.set_epoch(1)
    batches = iter(first)
    next(batches)
    state = json.loads(json.dumps(first.state_dict()))
    batches.close()
    settings = {"seed": 2, "shuffle_buffer": 16, "world": 1}
    StreamLoader(stream, 4, as_list, **settings).load_state_dict(state)  # the same settings: accepted
    expected = {"shuffle_buffer": ("key 'data.shuffle_buffer'", "16 -> 17"), "seed": ("key 'seed'", "2 -> 3"),
                "world": ("the number of processes", "1 -> 2"), "shards": ("its shard list", "'train-00003.parquet']")}
    if change == "shards":  # the checkpoint's list lacks the last shard (shards added since)
        state["shards"] = state["shards"][:-1]
    else:
        settings[change] += 1
    try:
        StreamLoader(stream, 4, as_list, **settings).load_state_dict(state)
        message = None
    except ValueError as error:
        message = str(error)
    what, values = expected[change]
    assert message is not None, f"a stream resumed with another {change} was accepted"
    assert f"{what} changed since the checkpoint" in message and values in message and "\n" not in message


@pytest.mark.parametrize("change", ["shuffle_buffer", "seed", "world", "shards"])
def test_resumed_stream_refuses_another_draw(shards, change):
    check_resume_refused(shards, change)


def test_resume_check_fails_when_a_changed_shuffle_buffer_is_accepted(shards, monkeypatch):
    """Mutation test (tests/README.md): the loader's state no longer compares the shuffle buffer."""
    from mutations import apply_break

    apply_break("accept_changed_shuffle_buffer", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="another shuffle_buffer was accepted"):
        check_resume_refused(shards, "shuffle_buffer")


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted streamed run (2 epochs of 6 steps) that also evaluates its streamed splits."""
    folder = tmp_path_factory.mktemp("ref")
    raw = recipe(shards)
    raw["evaluation"] = {"tasks": ["msa:mosi"], "random_baseline": False}
    path = write_recipe(folder / "r.yaml", raw)
    # Through slow_train --record: the per-step counters (reference_rows) of the resume test. In
    # this process, one thread: bitwise equal to a subprocess's run (the resume test's killed run).
    recorded_in_process(folder, str(path), "--output", str(folder / "run"))
    return path, folder / "run"


@pytest.fixture(scope="module")
def reference_rows(reference) -> list[dict]:
    """The uninterrupted streamed run's per-step counters (``slow_train --record``)."""
    return read_record(reference[1].parent / "steps-0.jsonl")


def test_streamed_run_evaluates_its_streamed_splits(reference):
    summary = json.loads((reference[1] / "results.json").read_text())
    assert summary["steps"] == 2 * ROWS // 8 and summary["epochs"] == 2 and summary["samples_seen"] == 2 * ROWS
    assert summary["eval"] and all(torch.isfinite(torch.tensor(v)) for v in summary["eval"].values())
    # every row of each streamed split, its short last batch included (eval_batch_size 7: 10 = 7 + 3
    # validation rows, 12 = 7 + 5 test rows; the probe's training features: 48 = 6 * 7 + 6 rows)
    meta = json.loads((reference[1] / "eval" / "metrics.json").read_text())["meta"]
    assert (meta["n_test"], meta["n_val"], meta["n_train"]) == (12, 10, ROWS)


def test_streamed_reads_keep_the_short_last_batch(shards):
    """Reading a streamed split whole (evaluation, the checks' first samples: ``drop_last=False``)
    keeps the short last batch: 10 validation rows in batches of 4 are 4, 4 and 2, in shard order;
    the first 16 samples of a 10-row split are its 10 rows (what ``mmviews train --check`` and
    ``mmviews prepare hf --recipe`` decode), the first 3 its first 3."""
    from mmviews.data.streaming import first_samples

    valid = build_dataset("hf", root=str(shards), split="valid", streaming=True)
    loader = StreamLoader(valid, 4, as_list, drop_last=False)
    batches = [[s["index"] for s in b] for b in loader]
    assert [len(b) for b in batches] == [4, 4, 2] and len(loader) == 3
    assert sum(batches, []) == list(range(10))
    assert [s["index"] for s in first_samples(valid, 16)] == list(range(10))
    assert [s["index"] for s in first_samples(valid, 10)] == list(range(10))
    assert [s["index"] for s in first_samples(valid, 3)] == [0, 1, 2]


def test_kill_mid_epoch_and_resume_equals_uninterrupted(reference, reference_rows, tmp_path):
    """Killed after step 4, resumed from the checkpoint of step 3 (mid-epoch 0, the loader's
    position saved as data): the process says so, runs steps 4-12 with the uninterrupted run's
    counters (samples, epoch, scheduler) and ends with its weights. A resume that restores
    nothing (break ``skip_restore``: the same seed reaches the same weights from step 0) fails
    that check."""
    path, ref = reference
    run = tmp_path / "run"
    held = tmp_path / "held"
    with started([sys.executable, str(SLOW_TRAIN), "--hold-after-step", "4", "--hold-marker", str(held), "--",
                  str(path), "--output", str(run), "--set", "evaluation.at_end=false"],
                 stdout=subprocess.DEVNULL) as proc:
        _kill_when_held(proc, held, "step 4")  # checkpoint-3: mid-epoch 0 (6 batches)
    checkpoint = run / "checkpoints" / "checkpoint-00000003"
    state = json.loads((checkpoint / "train_state.json").read_text())
    assert state["batch_in_epoch"] == 3 and state["stream"]["batches"] == 3 and state["stream"]["rows"] == 24
    assert state["stream"]["shards"] == [f"train-{i:05d}.parquet" for i in range(4)]
    copy, other_buffer = tmp_path / "copy", tmp_path / "other-buffer"
    shutil.copytree(run, copy)
    shutil.copytree(run, other_buffer)
    stdout, rows = recorded_in_process(tmp_path, "--resume", str(run))  # only the killed run needs a process
    check_resumed_exactly(stdout, rows, checkpoint, 2 * ROWS // 8, reference_rows)
    _assert_identical(load_weights(ref / "encoder"), load_weights(run / "encoder"))

    # The mutation test of the check above, in this process (the check reads no weights); the
    # first step is enough to show it (the run restarts at step 0).
    stdout, rows = recorded_in_process(tmp_path, "--resume", str(copy),
                                       options=("--break", "skip_restore", "--stop-after-step", "1"))
    assert [row["step"] for row in rows] == [1] and "at step 0 of 12" in stdout  # the break did what it says
    with pytest.raises(AssertionError):
        check_resumed_exactly(stdout, rows, copy / "checkpoints" / checkpoint.name, 2 * ROWS // 8, reference_rows)

    # Resumed with another shuffle buffer, the stream would draw other batches: refused before any
    # step, with one line naming the key (exit status 2).
    r = train_in_process("--resume", str(other_buffer), "--set", "data.shuffle_buffer=8")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "key 'data.shuffle_buffer' changed since the checkpoint (16 -> 8)" in r.stderr


WORKER = """
import json, sys, torch.distributed as dist
from accelerate import PartialState
from mmviews.config import load_config
from mmviews.train.build import build_run
state = PartialState(cpu=True)
results = []
for recipe in sys.argv[1:]:
    parts = build_run(load_config(recipe), state.num_processes, with_eval=False)
    parts.train_loader.set_epoch(1)
    seen = [b.index.tolist() for b in parts.train_loader]
    out = [None] * state.num_processes
    dist.all_gather_object(out, {"rank": state.process_index, "batches": seen, "len": len(parts.train_loader)})
    results.append(out)
if state.is_main_process:
    print("RESULT" + json.dumps(results), flush=True)
# leave together, with the process group closed: a rank exiting while its peer still holds the
# gloo connection can abort ("terminate called without an active exception")
dist.barrier()
dist.destroy_process_group()
"""


def test_two_gloo_processes_draw_disjoint_rows(shards, tmp_path):
    """4 shards of 12 rows: each process reads 2 shards, the epoch covers every row once. 3 shards of
    16 (not a multiple of 2 processes): every process reads every shard and keeps one row in two,
    floor(48 / 2) = 24 rows each: the epoch covers every row once too."""
    three = tmp_path / "shards3"
    r = prepare("mosi", str(shards.parent / "mosi.pkl"), "--format", "parquet", "--shard-rows", "16",
                "--output", str(three), "--splits", "train")
    assert r.returncode == 0, r.stdout + r.stderr
    recipes = [str(write_recipe(tmp_path / f"r{k}.yaml", recipe(folder, val_split=None, test_split=None)))
               for k, folder in enumerate((shards, three))]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # Two ranks started by the test (torchrun's environment, no launcher process); a failed
    # launch leaves no rank behind.
    ranks = run_ranks([sys.executable, str(script), *recipes], tmp_path)
    assert all(r.returncode == 0 for r in ranks), "\n".join(  # a rank the test killed (rc -9) after another failed
        f"rank {rank} (rc {r.returncode}): {r.stderr[-3000:]}" for rank, r in enumerate(ranks))
    for out in json.loads(ranks[0].stdout.split("RESULT", 1)[1]):
        rows = [sorted(i for b in o["batches"] for i in b) for o in out]
        assert out[0]["len"] == out[1]["len"] == len(out[0]["batches"]) == len(out[1]["batches"]) == 6  # same steps
        assert all(len(b) == 4 for o in out for b in o["batches"])  # K / N rows per process
        assert not set(rows[0]) & set(rows[1])
        assert sorted(rows[0] + rows[1]) == list(range(ROWS))


def test_damaged_shard_named_or_skipped(shards, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(shards, folder)
    bad = folder / "train" / "train-00002.parquet"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated: no footer
    with pytest.raises(ValueError) as info:
        build_dataset("hf", root=str(folder), split="train", streaming=True)
    message = str(info.value)
    assert str(bad) in message and "\n" not in message and "data.options.on_error: skip" in message
    with pytest.warns(UserWarning, match="train-00002.parquet"):
        stream = build_dataset("hf", root=str(folder), split="train", streaming=True, on_error="skip")
    assert stream.num_skipped_shards == 1 and len(stream) == ROWS - 12
    seen = [s["index"] for b in StreamLoader(stream, 4, as_list, drop_last=False) for s in b]
    assert sorted(seen) == [i for i in range(ROWS) if not 24 <= i < 36]


def test_streamed_accumulation_needs_whole_windows_per_epoch(shards, tmp_path):
    """A streamed loader is not prepared by Accelerate, which closes an accumulation window at the
    end of the loaders it prepares: an epoch of 6 batches with grad_accum_steps 4 is refused by
    key, 3 is accepted."""
    from mmviews.config import ConfigError, load_config
    from mmviews.train import build_run

    raw = recipe(shards)
    for accumulate, ok in ((4, False), (3, True)):
        raw["optimisation"]["grad_accum_steps"] = accumulate
        config = load_config(write_recipe(tmp_path / f"r{accumulate}.yaml", raw))
        if ok:
            assert len(build_run(config, with_eval=False).train_loader) == 6
        else:
            with pytest.raises(ConfigError, match=r"optimisation.grad_accum_steps.*6 batches"):
                build_run(config, with_eval=False)
