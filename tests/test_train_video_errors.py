"""Training on video folders with bad clips: never a late crash, never silently less.

One UCF-101-style folder of small clips written with PyAV (MPEG-4 and H.264), none with an
audio track, holds clips `mmviews prepare` finds unreadable (zero-byte, text renamed .avi,
truncated H.264 mp4: recorded in the store's manifest as ``failed``), a clip added after the
prepare that is not a video, and a prepared clip truncated afterwards. Two training runs share it, started together:
``on_error: skip`` (finishes; the known-bad clips are left out with one line per split, the
others dropped from their batches; every count in results.json, report.md and the model card;
the audio view absent everywhere said in one line) and ``on_error: raise`` (one line naming the
file, rc 2, the latest checkpoint kept).
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import av
import pytest
import torch
from mutations import apply_break
from test_data_video import write_clip
from test_train_utils import env, train_command, write_recipe
from torch.utils.data import DataLoader, Dataset

import mmviews.cli as cli
from mmviews.cli import error_message, main
from mmviews.data import ViewSetCollator
from mmviews.data.video import VideoFolder
from mmviews.data.video_store import MANIFEST, prepare_video_store
from mmviews.run import list_checkpoints

KNOWN_BAD = {"train": ["Jump/v_Jump_zero.avi", "Run/v_Run_text.avi"], "test": ["Run/v_Run_trunc.mp4"]}
NOT_PREPARED = "Jump/v_Jump_late.mp4"  # added after the prepare: not a video
DAMAGED_LATER = "Run/v_Run_g04_c01.mp4"  # prepared, then truncated


def write_h264(path: Path, n_frames: int, shade: int) -> None:
    """A small H.264 clip in an mp4 container (libx264), as most downloaded copies are."""
    import numpy as np

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for i in range(n_frames):
            img = np.full((16, 16, 3), (shade + 20 * i) % 255, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video") / "UCF"
    splits: dict[str, list[str]] = {"train": [], "test": []}
    for c, cls in enumerate(("Jump", "Run")):
        (root / cls).mkdir(parents=True)
        for k in range(5):
            rel = f"{cls}/v_{cls}_g0{k}_c01.mp4"
            if k < 3:  # training clips MPEG-4 Part 2, test clips H.264
                write_clip(root / rel, n_frames=4, audio=False, size=(16, 16), shade=40 * k + 120 * c)
            else:
                write_h264(root / rel, 4, shade=40 * k + 120 * c)
            splits["train" if k < 3 else "test"].append(rel)
    (root / KNOWN_BAD["train"][0]).write_bytes(b"")
    (root / KNOWN_BAD["train"][1]).write_text("a text file renamed .avi\n")
    write_h264(root / KNOWN_BAD["test"][0], 4, shade=0)
    _truncate(root / KNOWN_BAD["test"][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prepare warns about each unreadable clip
        prepared = prepare_video_store(root, workers=0, size=16, flow=None, progress=False)
    assert sorted(prepared["failed"]) == sorted(KNOWN_BAD["train"] + KNOWN_BAD["test"])
    (root / NOT_PREPARED).write_text("not prepared, and not a video\n")
    _truncate(root / DAMAGED_LATER)
    lists = root / "ucfTrainTestlist"
    lists.mkdir()
    (lists / "classInd.txt").write_text("1 Jump\n2 Run\n")
    train = splits["train"] + KNOWN_BAD["train"] + [NOT_PREPARED]
    (lists / "trainlist01.txt").write_text("".join(f"{r} {1 + r.startswith('Run')}\n" for r in train))
    (lists / "testlist01.txt").write_text("".join(f"{r}\n" for r in splits["test"] + KNOWN_BAD["test"]))
    return root


def video_recipe(root: Path, on_error: str) -> dict:
    """Two natural video views and an audio view (no clip has audio), tiny CNNs, 2 epochs of one
    batch of 4 (the clip added after the prepare is drawn in the second epoch), one loader worker."""
    return {
        "name": "tinyvideo", "seed": 0,
        "data": {"name": "ucf101", "root": str(root),
                 "options": {"num_frames": 2, "size": 16, "audio": True, "on_error": on_error},
                 "train_split": "train", "val_split": None, "test_split": "test",
                 "batch_size": 4, "num_workers": 1, "eval_batch_size": 8},
        "views": [{"modality": "video", "copies": 2}, {"modality": "audio"}],
        "encoder": {"embed_dim": 8},
        "adapters": {"video": {"type": "small_cnn", "channels": [4], "head": {"kind": "linear"}},
                     "audio": {"type": "audio_cnn", "channels": [4], "head": {"kind": "linear"}}},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": 2, "warmup_steps": 1},
        "evaluation": {"tasks": ["linear:class"], "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 1, "keep_last": 2, "progress_bar": False},
    }


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root.parent)): p.read_bytes() for p in sorted(root.parent.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(folder, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The skip and the raise run, started together (two processes: half the wall time)."""
    before = _snapshot(folder)
    base = tmp_path_factory.mktemp("runs")
    started = {}
    for mode in ("skip", "raise"):
        recipe = write_recipe(base / f"{mode}.yaml", video_recipe(folder, mode))
        started[mode] = (subprocess.Popen(train_command(str(recipe), "--output", str(base / mode)), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env()), base / mode)
    out = {}
    try:
        for mode, (proc, run) in started.items():
            stdout, stderr = proc.communicate(timeout=300)
            out[mode] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), run)
    finally:  # a run that hangs is not left behind
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert _snapshot(folder) == before, "training changed or deleted a file of the dataset or its store"
    return out


def test_skip_run_finishes_and_counts_every_clip_left_out(runs, folder):
    r, run = runs["skip"]
    assert r.returncode == 0, r.stderr[-3000:]
    store_list = f"{folder.parent / 'UCF.mmstore' / MANIFEST}"
    # Known-bad clips: left out before training, one line per split naming where the list is.
    assert f"mmviews train: left out 2 sample(s) of split 'train' known to be unreadable (listed in {store_list})" in r.stdout
    assert f"mmviews train: left out 1 sample(s) of split 'test' known to be unreadable (listed in {store_list})" in r.stdout
    # No clip has an audio track: said once, naming the modality and the recipe key.
    absent = [line for line in r.stdout.splitlines() if "modality 'audio' is absent from every sample" in line]
    assert len(absent) == 1 and "'views'" in absent[0] and "audio_0" in absent[0]
    results = json.loads((run / "results.json").read_text())
    losses = results["data_losses"]
    assert {role: {k: v for k, v in rec.items() if k not in ("examples", "excluded_list")} for role, rec in losses.items()} == {
        # train: the clip added after the prepare is dropped from its batch in epoch 2 and from
        # the evaluation's embeddings; test: the clip truncated after the prepare.
        "train": {"split": "train", "excluded": 2, "skipped_in_training": 1, "skipped_in_evaluation": 1},
        "test": {"split": "test", "excluded": 1, "skipped_in_training": 0, "skipped_in_evaluation": 1},
    }
    assert losses["train"]["excluded_list"] == store_list
    examples = " ".join(losses["train"]["examples"] + losses["test"]["examples"])
    assert all(Path(rel).name in examples for rel in KNOWN_BAD["train"] + KNOWN_BAD["test"] + [NOT_PREPARED])
    assert "audio" in results["absent_modalities"]
    # Test accuracy is computed on the 3 readable test clips (of 4 listed after the exclusion),
    # the linear probe trained on the 6 readable training clips: no phantom sample.
    meta = json.loads((run / "eval" / "metrics.json").read_text())["meta"]
    assert (meta["n_test"], meta["n_train"]) == (3, 6)
    # The same counts in the log, the report and the model card.
    for text in (r.stdout, (run / "report.md").read_text(), (run / "encoder" / "README.md").read_text()):
        assert ("split 'train' (train): 2 left out before training (known unreadable, listed in "
                f"{store_list}); 1 dropped from training batches (unreadable when read); 1 missing from the final "
                "evaluation (unreadable when read)") in text
        assert "split 'test' (test): 1 left out before training" in text and "modality 'audio' is absent" in text
    # The skipped clip is named (a warning of the loader worker), at every read.
    assert f"{folder / NOT_PREPARED}: cannot read (InvalidDataError" in r.stderr


def test_raise_run_stops_with_one_line_and_keeps_its_checkpoint(runs, folder):
    r, run = runs["raise"]
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]  # not torch's traceback from the DataLoader worker
    assert lines[0].startswith(f"mmviews train: error: {folder / NOT_PREPARED}: cannot read (InvalidDataError"), lines[0]
    assert "DataLoader worker" not in lines[0] and "Traceback" not in lines[0] and len(lines[0]) < 600
    # Epoch 1 trained and checkpointed; the bad clip is drawn in epoch 2: that checkpoint is kept, whole.
    checkpoints = list_checkpoints(run)
    assert [c.name for c in checkpoints] == ["checkpoint-00000001"], r.stdout
    state = json.loads((checkpoints[-1] / "train_state.json").read_text())
    assert all((checkpoints[-1] / name).is_file() for name in state["files"])
    assert f"the latest checkpoint is kept ({checkpoints[-1]})" in lines[0] and f"--resume {run}" in lines[0]
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / "results.json").exists()


def test_check_says_what_the_data_lacks(folder, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "check.yaml", video_recipe(folder, "skip"))
    assert main(["train", str(recipe), "--check"]) == 0
    out = capsys.readouterr().err  # mmviews's warnings: one line each on stderr
    assert "mmviews train: warning: left out 2 sample(s) of split 'train' known to be unreadable" in out
    assert "mmviews train: warning: left out 1 sample(s) of split 'test' known to be unreadable" in out
    assert "mmviews train: warning: modality 'audio' is absent from every sample of split 'train'" in out


def test_skip_on_several_processes_is_refused_before_any_work(folder):
    from mmviews.config import ConfigError, config_from_dict
    from mmviews.train import build_run

    with pytest.raises(ConfigError, match="key 'data.options.on_error'.*2 processes"):
        build_run(config_from_dict(video_recipe(folder, "skip")), num_processes=2)


# --------------------------------------------------------------------------- the guards, in one process


def test_known_bad_clips_left_out_of_their_split(folder):
    train = VideoFolder(folder, split="train", num_frames=2, size=16, audio=False)
    assert sorted(train.excluded) == sorted(KNOWN_BAD["train"]) and train.excluded_list.endswith(MANIFEST)
    assert len(train) == 7 and not {rel for _, rel in train.clips} & set(KNOWN_BAD["train"])
    # file times say nothing (a copy with `cp -r` renews them): a known-bad clip stays out until a prepare retries it
    import os
    import time

    os.utime(folder / KNOWN_BAD["train"][0], (time.time() + 1000, time.time() + 1000))  # newer than the manifest
    assert sorted(VideoFolder(folder, split="train", num_frames=2, size=16, audio=False).excluded) == sorted(KNOWN_BAD["train"])
    # without the store nothing is known: every listed clip is there
    assert len(VideoFolder(folder, split="train", num_frames=2, size=16, audio=False, store=False)) == 9


def test_unreadable_sample_never_reaches_a_batch(folder):
    test = VideoFolder(folder, split="test", num_frames=2, size=16, audio=False, on_error="skip")
    collate = ViewSetCollator.for_dataset(test, ["video"])
    with pytest.warns(UserWarning, match=DAMAGED_LATER):
        batch = next(iter(DataLoader(test, batch_size=8, collate_fn=collate)))
    bad = next(i for i, (_, rel) in enumerate(test.clips) if rel == DAMAGED_LATER)
    # sizes first: pytest would print the batch's tensors when a bare attribute comparison fails
    sizes = (len(test), batch.num_samples, tuple(batch.labels["class"].shape), bad in batch.index.tolist())
    assert sizes == (4, 3, (3,), False) and bool(batch.mask.all())
    assert len(batch.dropped) == 1 and DAMAGED_LATER in batch.dropped[0]
    with pytest.warns(UserWarning, match=DAMAGED_LATER):
        empty = collate([test[bad]])  # the last evaluation batch can hold only unreadable clips
    assert (empty.num_samples, len(empty.dropped)) == (0, 1)
    from mmviews.eval.extract import extract_embeddings

    encoder = lambda b: (torch.zeros(b.num_samples, 1, 2), b.mask)  # noqa: E731
    embeddings = extract_embeddings(encoder, [batch, empty], progress=False)
    assert embeddings.num_samples == 3 and embeddings.labels["class"].tolist() == batch.labels["class"].tolist()


class _Unreadable(Dataset):
    """Raises in a DataLoader worker what PyAV raises on a damaged file (an error type torch cannot rebuild)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> None:
        raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input", "/data/Run/v_bad.avi")


def test_worker_error_is_the_workers_own_one_line():
    batches = iter(DataLoader(_Unreadable(), batch_size=2, num_workers=1))
    try:
        with pytest.raises(Exception) as caught:
            next(batches)
    finally:
        batches._shutdown_workers()  # now, not when the traceback that holds the iterator is freed
    assert "DataLoader worker process 0" in str(caught.value)  # torch's re-raise, traceback and all
    error = cli.worker_error(caught.value)
    assert isinstance(error, ValueError)  # a user error: one line, exit status 2
    assert error_message(error) == ("InvalidDataError: [Errno 1094995529] Invalid data found when processing input: "
                                    "'/data/Run/v_bad.avi'")
    plain = ValueError("not from a worker")
    assert cli.worker_error(plain) is plain
    # torch's text for a chained error whose message runs over indented lines (as torch builds it)
    import traceback

    try:
        try:
            raise OSError("first")
        except OSError as first:
            raise ValueError("/data/Run/v_bad.avi: cannot read\n    (truncated)") from first
    except ValueError as chained:
        text = "".join(traceback.format_exception(chained))
    rebuilt = cli.worker_error(ValueError(f"Caught ValueError in DataLoader worker process 3.\nOriginal {text}"))
    assert error_message(rebuilt) == "/data/Run/v_bad.avi: cannot read (truncated)"


# --------------------------------------------------------------------------- the guards fail when broken


@pytest.mark.parametrize("name, guard", [
    ("keep_unreadable_samples", "test_unreadable_sample_never_reaches_a_batch"),
    ("forget_known_bad_clips", "test_known_bad_clips_left_out_of_their_split"),
])
def test_video_guards_fail_when_broken(monkeypatch, folder, name, guard):
    apply_break(name, monkeypatch.setattr)
    with pytest.raises(AssertionError):
        globals()[guard](folder)


def test_worker_error_guard_fails_when_tracebacks_are_kept(monkeypatch):
    apply_break("keep_worker_tracebacks", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_worker_error_is_the_workers_own_one_line()
