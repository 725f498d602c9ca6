"""The pieces of ``mmviews bench data --recipe`` (mmviews.bench.video_step) in this process: the
decode floor's dataset (PyAV alone, the dataset's own frame window), the loader timing (the
first batch apart, the next ``batches`` counted, on a fake clock), the printed table, the
options' defaults and a recipe that is not a video folder. (The whole command on real clips,
Farneback and RAFT: test_video_smoke.py.)"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.utils.data as torch_data
from video_clips import make_ucf101

from mmviews.bench import video_step
from mmviews.data.video_io import read_video_window


def test_the_options_and_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    video_step.add_recipe_arguments(parser)
    args = parser.parse_args([])
    assert (args.recipe, args.set, args.loader_workers, args.steps, args.warmup) == (None, [], None, 3, 1)
    args = parser.parse_args(["--recipe", "ucf101", "--set", "a=1", "--set", "b=2", "--loader-workers", "0,4",
                              "--steps", "2", "--warmup", "0"])
    assert (args.recipe, args.set, args.loader_workers, args.steps, args.warmup) == ("ucf101", ["a=1", "b=2"], "0,4", 2, 0)


@pytest.mark.parametrize("decode", ["seek", "sequential"])
def test_the_decode_floor_reads_the_datasets_own_windows_with_pyav(tmp_path: Path, decode: str, monkeypatch) -> None:
    """The same frames as the reader, read as the dataset reads them (seeking to the window's
    keyframe, or decoding from the start: the two cost differently, which is what is timed)."""
    from mmviews.data import video_io

    seeks: list[bool] = []
    real = video_io.read_video_window

    def spy(path, select, seek=True, stats=None):
        seeks.append(seek)
        return real(path, select, seek=seek, stats=stats)

    monkeypatch.setattr(video_io, "read_video_window", spy)
    root = make_ucf101(tmp_path / "ucf", classes=2, train_per_class=1, test_per_class=0, n_frames=12, size=(16, 24),
                       audio=False)
    clips = [(0, "ActionA/v_ActionA_g01_c01.avi"), (1, "ActionB/v_ActionB_g01_c01.avi")]
    window = lambda n: np.arange(2, 10, 2)  # noqa: E731  (frames 2, 4, 6, 8 of each clip)
    dataset = SimpleNamespace(clips=clips, root=root, _window=window, decode=decode)
    decoded = video_step._decode_only(dataset)
    assert len(decoded) == 2
    for i, (_, rel) in enumerate(clips):
        expected, idx, _ = read_video_window(root / rel, window, seek=decode == "seek")
        assert idx.tolist() == [2, 4, 6, 8]
        assert decoded[i].shape == (4, 16, 24, 3) and np.array_equal(decoded[i], expected)
    assert not np.array_equal(decoded[0], decoded[1])  # each index its own clip
    assert seeks and set(seeks) == {decode == "seek"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_loader_throughput_leaves_the_first_batch_out_and_counts_the_next(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(video_step, "time", clock)

    def loader(costs, sizes):
        for cost, size in zip(costs, sizes):
            clock.now += cost
            yield list(range(size))

    # the first batch takes 5 s (workers starting), the next 0.5 s each; only 3 of the 5 left are timed
    odd = 0.5 + 2 ** -11  # 0.50048828125 s: the rounding of the seconds shows
    row = video_step._samples_per_s(loader([5 + odd, odd, odd, odd, 9.0, 9.0], [8, 8, 8, 4, 8, 8]), 3, len)
    assert row == {"first_batch_s": 5.5, "samples": 20, "seconds": 1.501, "clips_per_s": 13.32}
    row = video_step._samples_per_s(loader([1.0, 0.0], [2, 2]), 1, len)  # no time measured: not a rate
    assert row["samples"] == 2 and row["seconds"] == 0 and math.isnan(row["clips_per_s"])


def _row(clips: float, ms: float, shares: dict[str, float]) -> dict:
    return {"clips_per_s": clips, "step_ms": ms, "phase_share": shares, "phase_ms": {k: v * ms for k, v in shares.items()}}


def test_the_printed_table(capsys) -> None:
    shares = {"data": 0.001, "flow": 0.5, "forward": 0.25, "objective": 0.0, "backward": 0.2345, "optimiser": 0.0144}
    result = {"recipe": "ucf101_smoke", "K": 8, "M": 5, "flow": "raft", "mixed_precision": "no", "device": "cpu",
              "decode floor": {0: {"clips_per_s": 13.7}, 2: {"clips_per_s": 20.456}},
              "data path": {0: {"clips_per_s": 1.5}, 2: {"clips_per_s": 5.87}},
              "model floor": _row(0.081, 98765.4, shares), "step": _row(0.11, 72000.0, {**shares, "data": 0.02})}
    video_step.print_recipe(result)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "recipe ucf101_smoke: K = 8, M = 5, flow raft, precision no on cpu"
    assert lines[1] == f"{'row':<26}{'clips/s':>10}"
    assert lines[2:6] == [f"{'decode floor (0 workers)':<26}{13.7:>10.2f}", f"{'decode floor (2 workers)':<26}{'20.46':>10}",
                          f"{'data path (0 workers)':<26}{'1.50':>10}", f"{'data path (2 workers)':<26}{'5.87':>10}"]
    assert lines[6] == " " * 26 + f"{'clips/s':>10}{'step ms':>10}" + "".join(
        f"{p + ' %':>12}" for p in ("data", "flow", "forward", "objective", "backward", "optimiser"))
    assert lines[7] == f"{'model floor':<26}{'0.08':>10}{'98765':>10}" + "".join(
        f"{v:>12}" for v in ("0.1", "50.0", "25.0", "0.0", "23.4", "1.4"))
    assert lines[8] == f"{'step':<26}{'0.11':>10}{'72000':>10}" + "".join(
        f"{v:>12}" for v in ("2.0", "50.0", "25.0", "0.0", "23.4", "1.4"))
    assert len(lines) == 9


def test_a_recipe_without_a_video_folder_is_refused_in_one_line() -> None:
    parser = argparse.ArgumentParser()
    video_step.add_recipe_arguments(parser)
    args = parser.parse_args(["--recipe", "identifiability", "--set", "data.split_options.train.num_samples=16",
                              "--set", "data.batch_size=8"])
    with pytest.raises(ValueError, match=r"^bench data --recipe: identifiability reads \w+, not a video folder "
                                         r"\(ucf101, hmdb51\)$"):
        video_step.run_recipe(args)


def test_the_step_rows_time_the_steps_after_the_warm_up_phase_by_phase(monkeypatch, tmp_path: Path) -> None:
    """The model floor repeats one batch already drawn, the step draws each batch from the loader;
    both time ``steps`` steps after ``warmup`` (the warm-up's 10x costs left out), per phase in ms a
    step, with clips/s = K / the step's time and each phase's share (on a fake clock; the step's
    phases are charged by train_step's phase_end callback, as the trainer's are)."""
    import torch

    from mmviews.bench import train_measure
    from mmviews.train import setup, step

    clock = FakeClock()
    monkeypatch.setattr(train_measure, "time", clock)
    calls: list[tuple[object, object]] = []
    folders: list[Path] = []

    def batches(p, parts):
        for i in range(10):
            clock.now += 5.0 if i == 0 else 0.5  # the loader's wait for each batch
            yield f"b{i}"

    def fake_step(p, batch, max_grad_norm, phase_end):
        scale = 10.0 if len(calls) in (0, 3) else 1.0  # each loop's warm-up step
        calls.append((batch, max_grad_norm))
        for phase, seconds in (("forward", 1.03125), ("objective", 0.5), ("backward", 2.0), ("optimiser", 0.125)):
            clock.now += scale * seconds
            phase_end(phase)

    def accelerator(config, run_dir):
        assert run_dir.is_dir() and not any(run_dir.iterdir())
        folders.append(run_dir)
        return SimpleNamespace(device=torch.device("cpu"), mixed_precision="no")

    model = SimpleNamespace(train=lambda: None)
    monkeypatch.setattr(setup, "make_accelerator", accelerator)
    monkeypatch.setattr(setup, "prepare_run", lambda acc, parts: SimpleNamespace(model=model))
    monkeypatch.setattr(setup, "batches_forever", batches)
    monkeypatch.setattr(step, "train_step", fake_step)
    parts = SimpleNamespace(config=SimpleNamespace(optimisation=SimpleNamespace(max_grad_norm=0.5)),
                            sampler=SimpleNamespace(batch_size=4))
    rows = video_step._step_rows(parts, steps=2, warmup=1)
    assert calls == [("b0", 0.5), ("b1", 0.5), ("b2", 0.5), ("b3", 0.5), ("b3", 0.5), ("b3", 0.5)]
    assert len(folders) == 1 and not folders[0].exists()  # a temporary run folder, removed
    assert (rows["K"], rows["mixed_precision"], rows["device"]) == (4, "no", "cpu")
    # the step: 0.5 s waiting for its batch, 4.15625 s in all
    assert rows["step"] == {
        "step_ms": 4156.2, "clips_per_s": 0.96,
        "phase_ms": {"data": 500.0, "flow": 0.0, "forward": 1031.2, "objective": 500.0, "backward": 2000.0,
                     "optimiser": 125.0},
        "phase_share": {"data": 0.12, "flow": 0.0, "forward": 0.248, "objective": 0.12, "backward": 0.481,
                        "optimiser": 0.03}}
    # the model floor: no wait, 3.65625 s
    assert rows["model floor"] == {
        "step_ms": 3656.2, "clips_per_s": 1.09,
        "phase_ms": {"data": 0.0, "flow": 0.0, "forward": 1031.2, "objective": 500.0, "backward": 2000.0,
                     "optimiser": 125.0},
        "phase_share": {"data": 0.0, "flow": 0.0, "forward": 0.282, "objective": 0.137, "backward": 0.547,
                        "optimiser": 0.034}}
    calls.clear()
    no_size = SimpleNamespace(config=parts.config, sampler=object())  # K from the batch when the sampler has none
    monkeypatch.setattr(setup, "batches_forever", lambda p, parts: iter([SimpleNamespace(num_samples=6)] * 10))
    assert video_step._step_rows(no_size, steps=1, warmup=0)["K"] == 6


# --- run_recipe with the recipe's build replaced by small stand-ins (the real build: test_video_smoke.py)

class _Clips(torch_data.Dataset):
    """The training dataset build_run gives a video recipe: ``clips`` lists (label, file)."""

    def __init__(self, n: int) -> None:
        self.clips = [(i % 2, f"A/v_{i}.avi") for i in range(n)]

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> int:
        return index


class _Windows(torch_data.Dataset):
    """The decode floor's stand-in: frame windows of clips of different sizes (as HMDB-51's are),
    which a DataLoader's default collation could not stack."""

    def __init__(self, dataset: _Clips) -> None:
        self.n = len(dataset.clips)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.zeros((4, 8 + index, 8, 3), np.uint8)


class _Sampler:
    """A batch sampler yielding ``batches`` full batches of K indices, with or without ``batch_size``."""

    def __init__(self, K: int, batches: int, sized: bool = True) -> None:
        self.batches = [list(range(b * K, (b + 1) * K)) for b in range(batches)]
        if sized:
            self.batch_size = K

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _Table:
    """A dataset that is not a video folder (no ``clips``)."""


def _run_with_fakes(monkeypatch, argv: list[str], dataset=None, sampler=None):
    """run_recipe on the real recipe and its --set overrides, with build_run, the decode floor's
    reader and the step's rows replaced; returns the result, build_run's calls, the loaders made
    (in order) and the _step_rows calls."""
    from mmviews.bench import data as bench_data
    from mmviews.train import build

    builds: list[tuple[object, dict]] = []
    loaders: list[SimpleNamespace] = []
    step_calls: list[tuple[object, int, int]] = []
    dataset = _Clips(40) if dataset is None else dataset
    sampler = _Sampler(4, 6) if sampler is None else sampler
    parts = SimpleNamespace(datasets={"train": dataset}, sampler=sampler, view_spec=["video", "flow", "audio"],
                            collator=lambda samples: SimpleNamespace(num_samples=len(samples)),
                            encoder=SimpleNamespace(host_preparation=lambda: (lambda batch: batch)))

    def fake_build(config, *args, **kwargs):
        builds.append((config, {"args": args, **kwargs}))
        parts.config = config
        return parts

    class Recorded(torch_data.DataLoader):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # what the loader is, kept without the loader (run_recipe ends each one's workers itself)
            loaders.append(SimpleNamespace(**{name: getattr(self, name) for name in (
                "dataset", "num_workers", "pin_memory", "persistent_workers", "batch_size", "sampler", "batch_sampler",
                "collate_fn")}))

    def fake_step_rows(p, steps, warmup):
        step_calls.append((p, steps, warmup))
        row = {"step_ms": 1.0, "clips_per_s": 4000.0, "phase_ms": {"data": 1.0}, "phase_share": {"data": 1.0}}
        return {"K": 4, "mixed_precision": "no", "device": "cpu", "model floor": row, "step": row}

    monkeypatch.setattr(build, "build_run", fake_build)
    monkeypatch.setattr(torch_data, "DataLoader", Recorded)
    monkeypatch.setattr(video_step, "_decode_only", _Windows)
    monkeypatch.setattr(video_step, "_step_rows", fake_step_rows)
    parser = argparse.ArgumentParser()
    bench_data.add_arguments(parser)
    result = video_step.run_recipe(parser.parse_args(argv))
    return result, builds, loaders, step_calls, parts


RECIPE = ["--recipe", "ucf101", "--set", "data.root=/data/UCF-101", "--set", "data.num_workers=2", "--batches", "2"]


def test_run_recipe_times_each_worker_count_with_the_recipes_loader_and_reports_every_key(monkeypatch) -> None:
    """By default the worker counts are 0 and the recipe's data.num_workers; each decode-floor loader
    reads the clips in order in batches of K, as lists (clips of different sizes), each data-path
    loader is the recipe's batch sampler and collation; both with that many (persistent) workers, no
    pinned memory; ``--batches`` batches counted after the first; the test split never built."""
    from torch.utils.data import SequentialSampler

    from mmviews.train.setup import HostPreparedCollate

    result, builds, loaders, step_calls, parts = _run_with_fakes(monkeypatch, RECIPE)
    assert len(builds) == 1
    config, kwargs = builds[0]
    assert str(config.data.root) == "/data/UCF-101" and config.data.num_workers == 2  # the --set overrides
    assert not kwargs.get("with_eval", True)  # the eval loaders (test split) are not built
    assert set(result) == {"recipe", "K", "M", "flow", "torch_threads", "decode floor", "data path", "mixed_precision",
                           "device", "model floor", "step"}  # the JSON's keys, no other
    assert (result["recipe"], result["K"], result["M"], result["flow"]) == ("ucf101", 4, 3, "farneback")
    assert result["torch_threads"] == torch.get_num_threads()
    assert list(result["decode floor"]) == list(result["data path"]) == [0, 2]
    for n in (0, 2):
        for kind in ("decode floor", "data path"):
            row = result[kind][n]
            assert row["samples"] == 2 * 4, (kind, n)  # 2 batches of K = 4 after the first (5 were left)
    assert len(loaders) == 4
    for (decode, loader), n in zip((loaders[0:2], loaders[2:4]), (0, 2)):
        for made in (decode, loader):
            assert made.num_workers == n and not made.pin_memory and made.persistent_workers == (n > 0)
        assert isinstance(decode.sampler, SequentialSampler) and decode.batch_size == 4
        assert isinstance(decode.dataset, _Windows) and decode.collate_fn is list
        assert loader.dataset is parts.datasets["train"] and loader.batch_sampler is parts.sampler
        assert isinstance(loader.collate_fn, HostPreparedCollate)
    assert step_calls == [(parts, 3, 1)]  # --steps, --warmup defaults


def test_run_recipe_takes_the_workers_given_and_k_from_the_recipe_without_a_sized_sampler(monkeypatch) -> None:
    argv = RECIPE + ["--set", "data.batch_size=6", "--loader-workers", "1,0", "--steps", "2", "--warmup", "0"]
    result, _, loaders, step_calls, parts = _run_with_fakes(monkeypatch, argv, sampler=_Sampler(6, 4, sized=False))
    assert list(result["decode floor"]) == list(result["data path"]) == [1, 0]  # in the order given
    assert [made.num_workers for made in loaders] == [1, 1, 0, 0]
    assert loaders[0].batch_size == loaders[2].batch_size == 6  # the recipe's data.batch_size
    assert result["decode floor"][0]["samples"] == result["data path"][0]["samples"] == 2 * 6
    assert step_calls == [(parts, 2, 0)]


def test_run_recipe_names_the_dataset_class_that_is_not_a_video_folder(monkeypatch) -> None:
    with pytest.raises(ValueError) as error:
        _run_with_fakes(monkeypatch, RECIPE, dataset=_Table())
    assert str(error.value) == "bench data --recipe: ucf101 reads _Table, not a video folder (ucf101, hmdb51)"


# --- what ``mmviews bench data --help`` says of the recipe options

def _bench_data_help(monkeypatch) -> tuple[argparse.ArgumentParser, dict[str, tuple[str, str]]]:
    """The bench data parser and each option's entry of its --help: invocation and help text."""
    from mmviews.bench import data as bench_data

    monkeypatch.setenv("COLUMNS", "400")
    parser = argparse.ArgumentParser(prog="mmviews bench data")
    bench_data.add_arguments(parser)
    options = parser.format_help().split("\noptions:\n", 1)[1]
    entries = {}
    for entry in re.split(r"\n(?=  -)", options):
        invocation, *text = re.split(r"\s{2,}", entry.strip(), maxsplit=1)  # help beside or below
        entries[invocation.split()[0].rstrip(",")] = (invocation, " ".join(" ".join(text).split()))
    return parser, entries


RECIPE_OPTIONS = ("--recipe", "--set", "--loader-workers", "--steps", "--warmup")


def test_help_documents_each_recipe_option(monkeypatch) -> None:
    parser, entries = _bench_data_help(monkeypatch)
    for option in RECIPE_OPTIONS:
        assert entries[option][1], option  # a help text, not a bare option
    for option in RECIPE_OPTIONS[1:]:
        assert "with --recipe" in entries[option][1], option  # says it applies to the recipe run only
    # every option a help text names is one the parser takes (options are case-sensitive)
    known = {s for action in parser._actions for s in action.option_strings}
    for option in RECIPE_OPTIONS:
        for named in re.findall(r"--[A-Za-z][\w-]*", entries[option][1]):
            assert named in known, (option, named)


def test_help_states_the_defaults_the_parser_and_run_recipe_use(monkeypatch) -> None:
    from mmviews.config import load_config, resolve_recipe

    parser, entries = _bench_data_help(monkeypatch)
    defaults = parser.parse_args([])
    for option, dest in (("--steps", "steps"), ("--warmup", "warmup")):
        stated = re.search(r"\(default (\d+)\)", entries[option][1])
        assert stated and int(stated.group(1)) == getattr(defaults, dest), option
    # the worker counts' default, as run_recipe applies it (tested above): 0 and a recipe key
    stated = re.search(r"\(default: (\d+) and the recipe's ([\w.]+)\)", entries["--loader-workers"][1])
    assert stated and stated.group(1) == "0" and stated.group(2) == "data.num_workers"
    config = load_config(resolve_recipe("ucf101"), [f"{stated.group(2)}=3"])
    assert config.data.num_workers == 3


def test_help_shows_the_form_of_set_and_a_working_example(monkeypatch) -> None:
    from mmviews.config import load_config, resolve_recipe

    _, entries = _bench_data_help(monkeypatch)
    invocation, text = entries["--set"]
    assert invocation == "--set KEY=VALUE"
    example = re.search(r"e\.g\. --set (\S+)", text)
    assert example, text
    key, value = example.group(1).split("=", 1)
    config = load_config(resolve_recipe("ucf101"), [example.group(1)])  # a key of the video recipes
    assert key == "data.root" and str(config.data.root) == value


def test_help_of_recipe_names_the_rows_it_prints_and_the_module_that_explains_them(monkeypatch, capsys) -> None:
    import importlib

    _, entries = _bench_data_help(monkeypatch)
    text = entries["--recipe"][1]
    for row in ("decode floor", "data path", "model floor", "step"):  # print_recipe's row names
        assert row in text, row
    assert "--loader-workers" in text
    module = re.search(r"\((mmviews[\w.]*)\)", text)
    assert module, text
    doc = importlib.import_module(module.group(1)).__doc__
    assert all(row in doc for row in ("decode floor", "data path", "model floor"))
