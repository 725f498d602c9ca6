"""Uneven data: shards of unequal sizes split between processes, and rows that do not divide the
batch. Every process runs the same number of steps (no DDP hang), and that number is the one in
the progress bar, ``metrics.csv`` and ``results.json``.

The data: 38 MOSI-shaped rows that ``mmviews prepare --format parquet --shard-rows 12`` writes
as shards of 12, 12, 12 and 2 rows (the short last shard), at K = 8 on 2 gloo processes
(one launch of 2 ranks for the module's runs, shared by the assertions):

- streamed: a process reads 2 of the 4 shards, so it gets 24 or 14 rows; the process given 14
  can fill floor(14 / 4) = 3 batches of K / N = 4 rows, so every process runs 3 steps per epoch
  (4 would leave one process without a batch while the other waits in a collective);
- map-style (the same shards, ``data.streaming: false``): 38 rows make floor(38 / 8) = 4 global
  batches per epoch, each split between the 2 processes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from mutations import apply_break
from test_data_pickle import mmsa_split, write
from test_data_shards import as_list, prepare
from test_train_streaming import recipe
from test_train_utils import read_record, run_ranks, write_recipe

from mmviews.data import build_dataset
from mmviews.data.streaming import StreamLoader

TRAIN_SERIES = Path(__file__).resolve().parent / "train_series.py"
ROWS, SHARD_ROWS, K, PROCESSES, EPOCHS = 38, 12, 8, 2, 2
# Worked out by hand (see the module docstring), not by the code under test.
STREAMED_STEPS_PER_EPOCH = 3  # floor(min(12 + 12, 12 + 2) / (8 / 2))
MAPPED_STEPS_PER_EPOCH = 4  # floor(38 / 8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("uneven")
    pkl = folder / "mosi.pkl"
    write(pkl, {"train": mmsa_split(ROWS), "valid": mmsa_split(4), "test": mmsa_split(4)})
    r = prepare("mosi", str(pkl), "--format", "parquet", "--shard-rows", str(SHARD_ROWS), "--output", str(folder / "shards"),
                "--splits", "train")
    assert r.returncode == 0, r.stdout + r.stderr
    written = json.loads((folder / "shards" / "mmviews_shards.json").read_text())["splits"]["train"]["shards"]
    assert [s["rows"] for s in written] == [12, 12, 12, 2]  # the short last shard prepare writes
    return folder / "shards"


def uneven_recipe(shards: Path, folder: Path, *, streaming: bool) -> Path:
    """The process group keeps its default timeout of an hour (``distributed.timeout_s``): a
    process left waiting for its peer would make the launch time out (:data:`LAUNCH_TIMEOUT_S`)
    instead of failing at once (see :func:`test_two_process_run_fails_fast_when_the_stream_epoch_is_rounded_up`).
    Every recipe of the launch says so: ``tests/train_series.py`` keeps the first run's group."""
    raw = recipe(shards, streaming=streaming, batch_size=K, val_split=None, test_split=None)
    raw["optimisation"]["epochs"] = EPOCHS
    raw["output"].update(progress_bar=True, checkpoint_every=0)
    raw["distributed"] = {"timeout_s": 3600}
    return write_recipe(folder / ("streamed.yaml" if streaming else "mapped.yaml"), raw)


LAUNCH_TIMEOUT_S = 180
STATUS = r"^train_series: rank (\d+): run (\d+) of \d+: exit status (-?\d+)$"  # tests/train_series.py


def launch_two(runs: dict[str, tuple[Path, tuple[str, ...]]], folder: Path) -> dict[str, dict[str, Any]]:
    """``runs``: {name: (recipe, options of tests/slow_train.py, e.g. a break)}: ``mmviews train
    RECIPE`` for each, one after the other, on the same 2 gloo processes (one launch of
    ``tests/train_series.py`` on 2 ranks, :func:`run_ranks`; a break applies to its run only), with
    ``--record``: rank 0's optimiser steps, ``--marker``: each rank's last step. A run that fails
    ends the launch (the other rank is killed, as the launcher does): put it last. After
    :data:`LAUNCH_TIMEOUT_S` the ranks are killed (no process is left behind). Returns {name: the
    run's result}; ``rc``: 0 if every rank says the run ended with exit status 0, else a rank's
    nonzero exit status (-1 if none); ``stderr``: the ranks' output of the run (rank 0's, then
    rank 1's); ``timed_out``: whether the ranks were killed after the timeout."""
    argv: list[str] = []
    for name, (recipe_path, slow_train_options) in runs.items():
        argv += ["--record", str(folder / name / "steps.txt"), "--marker", str(folder / name / "step-marker"),
                 *slow_train_options, "--", str(recipe_path), "--output", str(folder / name / "run"), ":::"]
        (folder / name).mkdir()
    try:
        exit_codes = [r.returncode for r in run_ranks([sys.executable, str(TRAIN_SERIES), *argv[:-1]], folder,
                                                      PROCESSES, timeout=LAUNCH_TIMEOUT_S)]
        timed_out = False
    except pytest.fail.Exception:  # the timeout: the runs that ended before are still checked
        exit_codes, timed_out = [], True
    failed = next((code for code in exit_codes if code), -1)
    errs = [(folder / f"rank{r}.err").read_text() for r in range(PROCESSES)]
    statuses: dict[int, dict[int, int]] = {}
    for rank, number, status in re.findall(STATUS, "\n".join(errs), flags=re.M):
        statuses.setdefault(int(number), {})[int(rank)] = int(status)
    # Each rank ends its output of run I with its status line: each run's part of each rank's stderr.
    parts = [re.split(STATUS.replace("(", "(?:"), err, flags=re.M) for err in errs]
    results = {}
    for number, name in enumerate(runs, 1):
        ranks = {r: folder / name / f"step-marker.rank{r}" for r in range(PROCESSES)}
        results[name] = {
            "rc": 0 if statuses.get(number) == {r: 0 for r in range(PROCESSES)} else failed, "timed_out": timed_out,
            "stderr": "".join(p[number - 1] for p in parts if number <= len(p)), "run": folder / name / "run",
            "recorded": [row["step"] for row in read_record(folder / name / "steps.txt")],  # a JSON row per step
            "last_step": {r: int(p.read_text().split()[0]) if p.is_file() else None for r, p in ranks.items()}}
    return results


def check_uneven_run(result: dict[str, Any], steps_per_epoch: int) -> None:
    """The guard: the run ended well, every rank ran ``EPOCHS * steps_per_epoch`` steps, and the
    progress bar, ``metrics.csv`` and ``results.json`` say the same."""
    assert result["rc"] == 0, result["stderr"][-4000:]
    total = EPOCHS * steps_per_epoch
    assert result["recorded"] == list(range(1, total + 1))  # rank 0's optimiser steps, in order
    assert result["last_step"] == {r: total for r in range(PROCESSES)}  # every rank, the same count
    summary = json.loads((result["run"] / "results.json").read_text())
    assert (summary["steps"], summary["epochs"], summary["samples_seen"]) == (total, EPOCHS, total * K)
    assert summary["num_processes"] == PROCESSES and summary["status"] == "ok"
    bar = re.findall(r"train: +\d+%\|[^|]*\| (\d+)/(\d+) ", result["stderr"])  # tqdm: "train: 100%|###| 6/6 [..."
    assert bar and bar[-1] == (str(total), str(total)), bar[-3:]
    rows = (result["run"] / "metrics.csv").read_text().splitlines()[1:]
    epochs = [float(r.split(",")[1]) for r in rows]  # step, epoch (fractional), loss, ...
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, total + 1))
    assert epochs == pytest.approx([s / steps_per_epoch for s in range(1, total + 1)], abs=1e-5)


@pytest.fixture(scope="module")
def two_process_runs(shards, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The module's 2-process runs, in one launch: streamed, map-style, then streamed with the
    break ``round_stream_epoch_up`` (it fails: last)."""
    folder = tmp_path_factory.mktemp("uneven-runs")
    streamed = uneven_recipe(shards, folder, streaming=True)
    return launch_two({"streamed": (streamed, ()), "mapped": (uneven_recipe(shards, folder, streaming=False), ()),
                       "streamed-rounded-up": (streamed, ("--break", "round_stream_epoch_up"))}, folder)


def test_uneven_streamed_shards_run_the_same_steps_on_every_process(two_process_runs):
    check_uneven_run(two_process_runs["streamed"], STREAMED_STEPS_PER_EPOCH)


def test_map_style_rows_that_do_not_divide_the_batch(two_process_runs):
    check_uneven_run(two_process_runs["mapped"], MAPPED_STEPS_PER_EPOCH)


# ------------------------------------------------------------------ the loader, in this process


def rows_given(shards: Path, epoch: int, rank: int) -> list[int]:
    """The rows ``datasets`` gives process ``rank`` of 2 in ``epoch``, read with ``datasets``
    directly (its Parquet builder; seeded shuffle, split by node, epoch, as the streamed loader
    sets them up). Which rows, not their order: the buffer reads one shard at a time here, which
    leaves the shards each process gets unchanged and avoids the builder's 5 s stall per pass."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    files = sorted(str(p) for p in (shards / "train").glob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)
    ds = split_dataset_by_node(ds.shuffle(seed=0, buffer_size=16, max_buffer_input_shards=1), rank=rank,
                               world_size=PROCESSES)
    ds.set_epoch(epoch)
    return [row["mmviews_index"] for row in ds]


def check_stream_epochs(shards: Path, epochs: int = 3) -> None:
    """The guard of the loader: in every epoch, each of the 2 processes' loaders says and gives
    ``STREAMED_STEPS_PER_EPOCH`` full batches of K / N rows, disjoint between processes, and that
    is the most every process can fill (one process is given only 14 rows)."""
    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    for epoch in range(epochs):
        given = [rows_given(shards, epoch, r) for r in range(PROCESSES)]
        assert sorted(len(g) for g in given) == [14, 24]  # a process holds the short shard and one other
        drawn = []
        for rank in range(PROCESSES):
            loader = StreamLoader(stream, K // PROCESSES, as_list, seed=0, shuffle_buffer=16, rank=rank, world=PROCESSES)
            loader.set_epoch(epoch)
            assert len(loader) == STREAMED_STEPS_PER_EPOCH, f"epoch {epoch}, process {rank}: len {len(loader)}"
            batches = [[s["index"] for s in b] for b in loader]
            assert len(batches) == STREAMED_STEPS_PER_EPOCH and all(len(b) == K // PROCESSES for b in batches)
            assert {i for b in batches for i in b} <= set(given[rank])
            drawn.append({i for b in batches for i in b})
        assert not drawn[0] & drawn[1]


def test_every_process_draws_the_epoch_length_in_every_epoch(shards):
    check_stream_epochs(shards)


@pytest.mark.parametrize("break_name", ["round_stream_epoch_up", "average_rows_per_process"])
def test_stream_epoch_check_fails_when_the_epoch_length_is_broken(shards, monkeypatch, break_name):
    """Mutation tests (tests/README.md): the epoch length rounded up, or taken from the mean
    rows per process instead of the fewest: 4 batches, which the process given 14 rows cannot fill."""
    apply_break(break_name, monkeypatch.setattr)
    with pytest.raises(AssertionError, match="len 4"):
        check_stream_epochs(shards, epochs=1)


def test_a_stream_shorter_than_its_epoch_is_an_error_naming_the_process(shards, monkeypatch):
    """A process whose rows run out before the epoch's batches (shards changed under the run, or a
    wrong epoch length) stops with an error naming it, instead of ending its epoch early while
    the other processes wait for it."""
    apply_break("round_stream_epoch_up", monkeypatch.setattr)
    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    short = min(range(PROCESSES), key=lambda r: len(rows_given(shards, 0, r)))
    loader = StreamLoader(stream, K // PROCESSES, as_list, seed=0, shuffle_buffer=16, rank=short, world=PROCESSES)
    with pytest.raises(ValueError, match=rf"process {short} of 2, epoch 0: the stream ended after 3 full batches of 4 "
                                         r"rows \(and 2 rows\), 4 expected") as info:
        list(loader)
    assert "\n" not in str(info.value)


def test_data_too_small_for_one_step_is_refused(shards, tmp_path, capsys):
    """No run that ends with 0 steps: 14 rows for one of 2 processes cannot fill a batch of 16
    (streamed, K = 32), and 38 rows cannot fill K = 40 (map-style: one line, exit status 2)."""
    from crafted_files import cli, one_line_error

    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    with pytest.raises(ValueError, match="14 rows for the process given the fewest cannot fill one batch of 16 rows"):
        StreamLoader(stream, 16, as_list, rank=0, world=PROCESSES)
    raw = recipe(shards, streaming=False, batch_size=40, val_split=None, test_split=None)
    rc, _, err = cli(capsys, "train", str(write_recipe(tmp_path / "big.yaml", raw)), "--output", str(tmp_path / "run"))
    assert rc == 2 and "38 samples, fewer than one batch of K = 40" in one_line_error(err)
    assert not (tmp_path / "run" / "results.json").exists()


def test_map_style_epoch_check_fails_when_the_epoch_length_is_rounded_up(shards, monkeypatch):
    """Mutation test: the map-style batch count rounded up (5 batches of 38 rows at K = 8, 4 given):
    the loader's length is wrong, and a run with it stops at the end of the first epoch with an
    error naming both counts (not a shorter run, nor epochs: 0, with exit status 0)."""
    from mmviews.config import load_config
    from mmviews.train import build_run
    from mmviews.train.state import TrainState
    from mmviews.train.trainer import check_epoch_complete

    config = load_config(uneven_recipe(shards, shards.parent, streaming=False))
    assert len(build_run(config, PROCESSES, with_eval=False).train_loader) == MAPPED_STEPS_PER_EPOCH
    apply_break("round_map_epoch_up", monkeypatch.setattr)
    loader = build_run(config, PROCESSES, with_eval=False).train_loader
    assert len(loader) == 5 and sum(1 for _ in loader.batch_sampler) == MAPPED_STEPS_PER_EPOCH
    state = TrainState()
    state.batch_in_epoch = MAPPED_STEPS_PER_EPOCH
    with pytest.raises(RuntimeError, match="epoch 0: the training loader gave 4 batches, 5 expected"):
        check_epoch_complete(state, len(loader), 0)


def test_two_process_run_fails_fast_when_the_stream_epoch_is_rounded_up(two_process_runs):
    """Mutation test (tests/README.md): with the streamed epoch length rounded up the 2-process
    run's guard fails, and the run stops with the process that ran short named, at once: the
    process group keeps its default timeout of an hour here, so a process left waiting for its
    peer (a barrier after the error) would make the launch time out (180 s) instead. (The last
    run of the module's launch; the two before it run intact code.)"""
    result = two_process_runs["streamed-rounded-up"]
    with pytest.raises(AssertionError):
        check_uneven_run(result, STREAMED_STEPS_PER_EPOCH)
    assert not result["timed_out"], f"the launch did not end within {LAUNCH_TIMEOUT_S} s"
    assert result["rc"] != 0 and "the stream ended after 3 full batches of 4 rows" in result["stderr"]
    assert result["recorded"] == [1, 2, 3]  # the first epoch's 3 steps, then the error


# ------------------------------------------------------------------ no fixed cost per streamed epoch


def check_no_stall(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard of the streamed speed: two epochs of a training loader (1 and 2 processes) and
    the evaluation pass call no ``time.sleep``. (Read through ``datasets``' Parquet builder, the
    default shuffle buffer of 10 shards at once slept 5 s at the end of every pass: that made a
    small streamed run 3.5x slower than map-style.) Sleeps are recorded here, not slept."""
    import threading
    import time

    slept: list[float] = []
    real_sleep = time.sleep
    # threads that earlier tests left in this process (a watcher polling every second): theirs
    # are not the stream's sleeps, and they sleep for real (unslept, a polling loop would spin)
    earlier_threads = set(threading.enumerate()) - {threading.main_thread()}

    def record(seconds: float) -> None:
        if threading.current_thread() in earlier_threads:
            return real_sleep(seconds)
        if len(slept) < 100:  # unslept, a loop that polls with sleep spins: keep its first calls
            slept.append(seconds)

    monkeypatch.setattr(time, "sleep", record)
    stream = build_dataset("hf", root=str(shards), split="train", streaming=True)
    for world in (1, 2):
        loader = StreamLoader(stream, K // world, as_list, seed=0, shuffle_buffer=16, rank=0, world=world)
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(len(b) for b in loader) == len(loader) * (K // world)
    assert sum(len(b) for b in StreamLoader(stream, K, as_list, drop_last=False)) == ROWS
    assert not slept, f"sleeps of {slept[:10]} s while streaming"


def test_streamed_epochs_have_no_fixed_stall(shards, monkeypatch):
    check_no_stall(shards, monkeypatch)


def test_stall_check_fails_when_rows_are_read_by_the_parquet_builder(shards, monkeypatch):
    """Mutation test (tests/README.md): the rows read through ``datasets``' Parquet builder, whose
    interleaved passes end with a sleep."""
    apply_break("read_rows_with_parquet_builder", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="sleeps of"):
        check_no_stall(shards, monkeypatch)


def test_bench_streamed_images_case_reads_the_same_samples():
    """``mmviews bench data --cases streamed``'s map-style vs streamed comparison, tiny."""
    import argparse

    from mmviews.bench.data import _stream_images_case

    result = _stream_images_case(argparse.Namespace(stream_images=24, batch_size=8, stream_epochs=2))
    assert result["map-style"]["samples"] == result["streamed"]["samples"] == 2 * (24 // 6) * 6  # K = 24 // 4
    assert result["streamed_vs_map_time"] > 0
