"""Never delete what mmviews did not write, no silent corruption, one-line errors."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from crafted_files import cli, copy_run, drop_records, one_line_error, rerecord, unwritable_folder
from test_data_pickle import mmsa_split, write
from test_train_utils import tiny_config, write_recipe

from mmviews.config import ConfigError, load_config
from mmviews.data import build_dataset
from mmviews.data.sentiment import SentimentStoreDataset, convert_sentiment_pickle, open_sentiment, read_sentiment_pickle
from mmviews.run import RUN_MANIFEST, list_checkpoints, read_manifest, record_run_outputs
from mmviews.train.run_folder import claim_run_dir
from mmviews.eval.summary import finalise_summary, write_results


# tiny_run: the session fixture of conftest.py (one tiny finished run, copied by each test).


@pytest.fixture()
def recipe(tmp_path) -> Path:
    return write_recipe(tmp_path / "tiny.yaml", tiny_config(num_samples=32, batch_size=16, epochs=1, image=False))


def _user_files(folder: Path) -> dict[str, str]:
    """A user's own encoder/, checkpoints/ and notes, with their contents."""
    files = {"encoder/my_model.txt": "weights I trained elsewhere", "checkpoints/keep.txt": "mine",
             "notes.txt": "experiment notes", "metrics.csv": "my,own\n1,2\n"}
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return files


def _assert_intact(folder: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        assert (folder / rel).read_text() == text, f"{rel} was changed or deleted"


# --------------------------------------------------------------------------- 4. run folders


@pytest.mark.parametrize("overwrite", [False, True])
def test_train_never_writes_into_a_folder_that_is_not_a_run(recipe, tmp_path, capsys, overwrite):
    folder = tmp_path / "mine"
    files = _user_files(folder)
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(folder), *(["--overwrite"] if overwrite else []))
    line = one_line_error(err)
    assert rc == 2 and str(folder) in line and "not an mmviews run folder" in line
    _assert_intact(folder, files)
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", "encoder", "metrics.csv", "notes.txt"]


def test_overwrite_removes_only_what_the_run_wrote(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    manifest = read_manifest(run)
    assert manifest is not None and {"config.yaml", "checkpoints", "encoder", "metrics.csv", "results.json"} <= set(
        manifest["created"])
    (run / "notes.txt").write_text("keep me")
    (run / "plots").mkdir()
    (run / "plots" / "mine.png").write_bytes(b"png")
    rc, _, err = cli(capsys, "train", str(tiny_run.parent / "tiny.yaml"), "--output", str(run))  # no --overwrite
    assert rc == 2 and "--overwrite" in one_line_error(err)
    rc, _, err = cli(capsys, "train", str(tiny_run.parent / "tiny.yaml"), "--output", str(run), "--overwrite")
    assert rc == 0, err
    assert (run / "notes.txt").read_text() == "keep me" and (run / "plots" / "mine.png").read_bytes() == b"png"
    assert set(read_manifest(run)["foreign"]) == {"notes.txt", "plots"}
    assert (run / "encoder" / "encoder.json").is_file()


def test_claim_and_record_outputs_unit(tmp_path):
    run = tmp_path / "run"
    claim_run_dir(run)
    (run / "config.yaml").write_text("x")
    (run / "eval").mkdir()
    record_run_outputs(run)
    (run / "user.txt").write_text("u")  # appears after the last record: still the user's once claimed
    claim_run_dir(run, resume=True)
    assert read_manifest(run)["created"] == ["config.yaml", "eval", "user.txt"]  # resumed: new entries are the run's
    (run / "later.txt").write_text("l")
    manifest = json.loads((run / RUN_MANIFEST).read_text())
    manifest["foreign"] = ["later.txt"]
    (run / RUN_MANIFEST).write_text(json.dumps(manifest))
    claim_run_dir(run)  # what --overwrite does, once decided
    assert sorted(p.name for p in run.iterdir()) == [RUN_MANIFEST, "later.txt"]
    # A run from before manifests: only its known outputs are removed.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("config.yaml", "metrics.csv", "results.json", "mine.txt"):
        (legacy / name).write_text("x")
    (legacy / "eval_epoch_1").mkdir()
    claim_run_dir(legacy)
    assert sorted(p.name for p in legacy.iterdir()) == [RUN_MANIFEST, "mine.txt"]


def test_output_that_is_a_file_or_read_only(recipe, tmp_path, capsys, monkeypatch):
    target = tmp_path / "afile"
    target.write_text("data")
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(target))
    assert rc == 2 and f"{target} is a file" in one_line_error(err)
    assert target.read_text() == "data"
    # A folder the process may not write to: tried for real (see test_fileio.py's unwritable_folder).
    folder = unwritable_folder(tmp_path)
    rc, _, err = cli(capsys, "train", str(recipe), "--output", str(folder / "run"))
    assert rc == 2 and f"cannot write {folder / 'run'}: {folder} refuses new files (" in one_line_error(err)


# --------------------------------------------------------------------------- 5. stores


def _pkl(tmp_path: Path) -> Path:
    return write(tmp_path / "x.pkl", {"train": mmsa_split(3), "valid": mmsa_split(2), "test": mmsa_split(2)})


def test_store_dir_never_wipes_a_foreign_folder(tmp_path, capsys):
    pkl = _pkl(tmp_path)
    folder = tmp_path / "important"
    files = _user_files(folder)
    with pytest.raises(FileExistsError, match=f"{folder} is not empty and is not an mmviews sentiment store"):
        build_dataset("mosi", root=pkl, store_dir=str(folder))
    _assert_intact(folder, files)
    with pytest.raises(FileExistsError, match="not an mmviews sentiment store"):
        convert_sentiment_pickle(pkl, folder, overwrite=True, progress=False)
    _assert_intact(folder, files)
    rc, _, err = cli(capsys, "prepare", "mosi", str(pkl), "--out", str(folder), "--overwrite")
    assert rc == 2 and str(folder) in one_line_error(err)
    _assert_intact(folder, files)
    # A folder named like the temporary one but not left by mmviews is not deleted either.
    partial = tmp_path / "store.partial"
    partial.mkdir()
    (partial / "x.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="store.partial"):
        convert_sentiment_pickle(pkl, tmp_path / "store", progress=False)
    assert (partial / "x.txt").read_text() == "mine"


def test_a_store_and_an_empty_folder_are_replaced(tmp_path):
    pkl = _pkl(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_sentiment_pickle(pkl, empty, overwrite=True, progress=False)
    convert_sentiment_pickle(pkl, empty, overwrite=True, progress=False)  # an mmviews store: replaced
    assert len(SentimentStoreDataset(empty, "train")) == 3
    # A stale store next to a pickle is rebuilt (store_dir of an mmviews store).
    ds = open_sentiment(pkl, "valid", store_dir=empty)
    assert len(ds) == 2


# --------------------------------------------------------------------------- 6. names


@pytest.mark.parametrize("key, value", [("name", "../escape"), ("name", "/tmp/abs"), ("name", "a/b"), ("name", ".."),
                                        ("output.dir", "../../elsewhere"), ("output.dir", "/abs/run")])
def test_name_and_output_dir_are_one_path_component(recipe, tmp_path, capsys, monkeypatch, key, value):
    with pytest.raises(ConfigError, match=f"key '{key}': must be a single folder name"):
        load_config(recipe, [f"{key}={value}"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    rc, _, err = cli(capsys, "train", str(recipe), "--set", f"{key}={value}")
    assert rc == 2 and key in one_line_error(err)
    assert list((tmp_path / "runs").iterdir()) == [] and not (tmp_path / "escape").exists()


# --------------------------------------------------------------------------- 7. RNG states


def test_damaged_rng_state_stops_resume_or_warns_with_flag(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    shutil.rmtree(run / "encoder")
    first, last = list_checkpoints(run)
    rng = last / "random_states_0.pkl"
    # Replaced by another checkpoint's (valid) RNG file: caught by the recorded checksum.
    shutil.copy(first / "random_states_0.pkl", rng)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and str(rng) in line and "--resume-ignore-rng" in line
    # Truncated, in a checkpoint without records (Accelerate alone would ignore it).
    rng.write_bytes(rng.read_bytes()[:100])
    drop_records(last)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and str(rng) in line and "truncated or corrupt" in line
    assert not (run / "encoder").exists()
    # With the flag: the run continues and says that reproducibility is lost.
    with pytest.warns(UserWarning, match="will not reproduce"):
        rc, _, err = cli(capsys, "train", "--resume", str(run), "--resume-ignore-rng")
    assert rc == 0, err
    assert (run / "encoder" / "encoder.json").is_file()


def test_rng_file_with_wrong_content_is_named(tiny_run, tmp_path, capsys):
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    (run / "results.json").unlink()  # stopped before its end: --resume reads the checkpoint (a finished run: nothing)
    checkpoint = list_checkpoints(run)[-1]
    torch.save({"step": 0, "random_state": (1, 2)}, checkpoint / "random_states_0.pkl")
    rerecord(checkpoint)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    assert rc == 2 and "random_states_0.pkl: not Accelerate's RNG states" in one_line_error(err)


# --------------------------------------------------------------------------- 8. results.json


def _strict_json(path: Path) -> dict:
    def refuse(token: str) -> None:
        raise ValueError(f"{path} holds {token}: not valid JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_results_json_is_valid_with_nan_and_marks_failure(tmp_path):
    summary = {"name": "x", "objective": "o", "steps": 0, "epochs": 0, "samples_seen": 0, "final_loss": float("nan"),
               "wall_time_s": 1.0, "num_processes": 1, "device": "cpu", "eval": {"test/acc": float("inf")},
               "eval_random": None}
    write_results(tmp_path, summary)
    data = _strict_json(tmp_path / "results.json")
    assert data["final_loss"] is None and data["eval"]["test/acc"] is None
    assert data["status"] == "failed" and "final_loss" in data["reason"] and "eval.test/acc" in data["reason"]
    assert "failed" in (tmp_path / "report.md").read_text()
    assert finalise_summary({"final_loss": 1.5})["status"] == "ok"


def test_resume_after_the_last_checkpoint_reports_the_logged_loss(tiny_run, tmp_path, capsys):
    """Killed after the last checkpoint, before the encoder was saved: the resumed run has no
    step left; its results.json still holds the last logged loss (not NaN) and status ok."""
    run = copy_run(tiny_run, tmp_path / "run")
    shutil.rmtree(run / "encoder")
    (run / "results.json").unlink()
    rc, out, err = cli(capsys, "train", "--resume", str(run))
    assert rc == 0, err
    assert f"mmviews train: warning: resumed from {list_checkpoints(run)[-1]} at step 4 of 4" in err  # restored, no step left
    data = _strict_json(run / "results.json")
    assert data["steps"] == 4
    last = list(csv.DictReader((run / "metrics.csv").open()))[-1]
    assert data["status"] == "ok" and math.isclose(data["final_loss"], float(last["loss"]), rel_tol=1e-5)


def test_two_processes_resume_after_the_last_checkpoint_end_as_one_does(tmp_path):
    """Two processes resuming a run whose last checkpoint is its last step (no step left):
    every process exits 0, the run's status is ok with the logged loss, and stderr says
    nothing. (Only the main process reads metrics.csv; the others once ended with a NaN loss,
    a "failed" status and exit status 1.)"""
    import sys

    from test_train_utils import run_ranks

    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_config(num_samples=32, batch_size=16, epochs=2, image=False,
                                                               text=False))
    run = tmp_path / "run"
    train = [sys.executable, "-m", "mmviews.cli", "train", str(recipe), "--output", str(run), "--set", "cpu=true",
             "--set", "evaluation.plots=false"]
    trained = run_ranks(train, tmp_path)
    assert [r.returncode for r in trained] == [0, 0], [r.stderr[-2000:] for r in trained]
    for r in trained:  # nothing to act on: no warning (DDP's C++ find_unused_parameters note included)
        assert "warning" not in r.stderr.lower() and "find_unused_parameters" not in r.stderr, r.stderr[-2000:]
    (run / "results.json").unlink()  # as if stopped after its last checkpoint
    ranks = run_ranks([sys.executable, "-m", "mmviews.cli", "train", "--resume", str(run)], tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert f"mmviews train: warning: resumed from {list_checkpoints(run)[-1]} at step 4 of 4" in ranks[0].stderr
    data = _strict_json(run / "results.json")
    last = list(csv.DictReader((run / "metrics.csv").open()))[-1]
    assert data["status"] == "ok" and math.isclose(data["final_loss"], float(last["loss"]), rel_tol=1e-5)
    assert data["num_processes"] == 2
    # each rank is the mmviews program's own process, training on the CPU: host_memory auto keeps the heap
    from mmviews.train.host_memory import allocator_set_by_environment, is_glibc

    expected = "system" if not is_glibc() else "environment" if allocator_set_by_environment() else "heap"
    assert data["host_memory"] == expected
    for r in ranks:  # the resume line (rank 0's, above) and nothing else
        others = [ln for ln in r.stderr.splitlines() if "resumed from" not in ln]
        assert "Traceback" not in r.stderr and "warning" not in "\n".join(others).lower(), r.stderr[-2000:]
    assert "resumed from" not in ranks[1].stderr  # said once, by the main process


# --------------------------------------------------------------------------- 9. messages


@pytest.mark.parametrize("override, expected", [
    ("data.name=nope", ["data.name", "'nope'", "synthetic"]),
    ("data.val_split=nosuch", ["'nosuch'", "choose from", "valid"]),
    ("data.options.colour=1", ["data.options", "colour"]),
])
def test_unknown_dataset_split_or_option_is_one_line(recipe, tmp_path, capsys, override, expected):
    rc, _, err = cli(capsys, "train", str(recipe), "--set", override, "--output", str(tmp_path / "run"))
    line = one_line_error(err)
    assert rc == 2 and all(e in line for e in expected), line


def test_debug_shows_the_traceback(recipe, tmp_path):
    from mmviews.cli import main

    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        main(["train", str(recipe), "--set", "data.name=nope", "--output", str(tmp_path / "run"), "--debug"])


def _image_folder(root: Path, splits: tuple[str, ...]) -> Path:
    from PIL import Image

    for split in splits:
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(root / split / label / f"{i}.png")
    return root


def test_hf_valid_folder_renamed_by_datasets_is_explained(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    root = _image_folder(tmp_path / "img", ("train", "valid"))
    with pytest.raises(KeyError) as info:
        build_dataset("hf", root=root, split="valid", format="imagefolder")
    message = info.value.args[0]
    assert "no split 'valid'" in message and "the folder valid/ split 'validation'" in message
    assert len(build_dataset("hf", root=root, split="validation", format="imagefolder")) == 4
    raw = tiny_config(image=False)
    raw["data"] = {"name": "hf", "root": str(root), "options": {"format": "imagefolder", "image_size": 8},
                   "batch_size": 4, "test_split": None}
    raw["views"] = [{"modality": "image"}, {"modality": "image"}]
    raw["adapters"] = {"image": {"type": "small_cnn", "channels": [4]}}
    rc, _, err = cli(capsys, "train", str(write_recipe(tmp_path / "hf.yaml", raw)), "--check")
    line = one_line_error(err)
    assert rc == 2 and "data.val_split=validation" in line


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


_DAMAGED = {  # checkpoint file -> how it is damaged
    "train_state.json": lambda p: p.write_text('{"epoch": 1, "step":'),
    "model.safetensors": _truncate,
    "optimizer.bin": lambda p: _truncate(p, 200),
    "scheduler.bin": lambda p: p.write_bytes(b"not a torch file"),
}


@pytest.mark.parametrize("name, records", [("train_state.json", "kept")] + [
    (name, records) for name in ("model.safetensors", "optimizer.bin", "scheduler.bin")
    for records in ("kept", "rewritten", "absent")])
def test_corrupt_checkpoint_files_are_named(tiny_run, tmp_path, capsys, name, records):
    """Each damaged file is named, whether the checksums catch it (records kept), or the
    loaders do (records rewritten to match, or a checkpoint from before records)."""
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "results.json").unlink()  # stopped before its end: --resume reads the checkpoint (a finished run: nothing)
    checkpoint = list_checkpoints(run)[-1]
    _DAMAGED[name](checkpoint / name)
    if records == "rewritten":
        rerecord(checkpoint)
    elif records == "absent":
        drop_records(checkpoint)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2 and str(checkpoint / name) in line, line


def test_truncated_data_pickle_in_train_is_one_line(tmp_path, capsys):
    pkl = write(tmp_path / "mosi.pkl", {"train": mmsa_split(3), "valid": mmsa_split(2), "test": mmsa_split(2)})
    _truncate(pkl)
    rc, _, err = cli(capsys, "train", "mosi", "--set", f"data.root={pkl}", "--output", str(tmp_path / "run"))
    line = one_line_error(err)
    assert rc == 2 and str(pkl) in line and "truncated" in line


def test_eval_failures_are_one_line(tiny_run, tmp_path, capsys):
    rc, _, err = cli(capsys, "eval", str(tmp_path / "nowhere"))
    assert rc == 2 and "nowhere" in one_line_error(err)
    (tmp_path / "empty").mkdir()
    rc, _, err = cli(capsys, "eval", str(tmp_path / "empty"))
    assert rc == 2 and "config.yaml" in one_line_error(err)
    run = copy_run(tiny_run, tmp_path / "run")
    weights = run / "encoder" / "text" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    rc, _, err = cli(capsys, "eval", str(run))
    assert rc == 2 and str(weights) in one_line_error(err)
    checkpoint = list_checkpoints(run)[-1]
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 16)
    rc, _, err = cli(capsys, "eval", str(checkpoint))
    assert rc == 2 and str(checkpoint / "model.safetensors") in one_line_error(err)
    (run / "encoder" / "text" / "config.json").write_text("{not json")
    rc, _, err = cli(capsys, "eval", str(run))
    assert rc == 2 and "config.json" in one_line_error(err)


# --------------------------------------------------------------------------- 10. labels


def test_nan_label_is_named_with_split_and_row(tmp_path, capsys):
    valid = mmsa_split(3)
    valid["regression_labels"][1] = np.nan
    pkl = write(tmp_path / "mosi.pkl", {"train": mmsa_split(3), "valid": valid, "test": mmsa_split(2)})
    with pytest.raises(ValueError, match=r"\[valid\]: label 'sentiment' is not finite \(nan\) at row 1 \(id 'vid\$_\$1'\)"):
        read_sentiment_pickle(pkl)
    rc, _, err = cli(capsys, "prepare", "mosi", str(pkl), "--out", str(tmp_path / "store"))
    assert rc == 2 and "[valid]: label 'sentiment' is not finite (nan) at row 1" in one_line_error(err)
    rc, _, err = cli(capsys, "train", "mosi", "--set", f"data.root={pkl}", "--output", str(tmp_path / "run"))
    assert rc == 2 and "at row 1" in one_line_error(err)
    # A store that already holds a NaN label (written before the check, or edited).
    good = write(tmp_path / "good.pkl", {"train": mmsa_split(3), "valid": mmsa_split(2), "test": mmsa_split(2)})
    store = tmp_path / "good.mmstore"
    convert_sentiment_pickle(good, store, progress=False)
    labels = np.load(store / "test" / "label_sentiment.npy")
    labels[0] = np.inf
    np.save(store / "test" / "label_sentiment.npy", labels)
    with pytest.raises(ValueError, match=r"\[test\]: label 'sentiment' is not finite \(inf\) at row 0"):
        SentimentStoreDataset(store, "test")


def test_nan_label_in_a_hf_dataset_is_named(tmp_path):
    import datasets

    root = tmp_path / "ds"
    datasets.Dataset.from_dict({"x": [[0.0, 1.0]] * 3, "score": [0.5, float("nan"), 1.0]}).save_to_disk(str(root))
    with pytest.raises(ValueError, match=r"split 'train'\]: label 'score' \(column 'score'\) is not finite \(nan\) at row 1"):
        build_dataset("hf", root=root, split="train", columns={"x": "x"}, labels={"score": "score"})



def test_every_file_and_folder_of_a_run_follows_the_umask(tiny_run):
    """the checkpoints' model.safetensors (written by safetensors) were 0600 while the
    run's other files were 0644: a colleague on a shared cluster could not read the weights."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)  # the umask the run's process inherited from this one
    modes = {str(p.relative_to(tiny_run)): stat.S_IMODE(p.stat().st_mode) for p in tiny_run.rglob("*")}
    assert any(name.endswith("model.safetensors") and "checkpoint" in name for name in modes)
    expected = {name: (0o777 if (tiny_run / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == expected
