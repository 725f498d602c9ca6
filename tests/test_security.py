"""No code from a run folder, a saved encoder, a recipe or a data file ever runs: every hostile
file is refused with one line naming it, and its payload (creating a marker file) never executes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from crafted_files import (
    cli,
    copy_run,
    drop_records,
    hostile_pickle,
    hostile_torch_file,
    one_line_error,
    rerecord,
    train_tiny_run,
)
from test_train_utils import tiny_config, write_recipe

from mmviews.modalities import MultiViewEncoder
from mmviews.modalities.remote import allow_remote_models
from mmviews.modalities.presets import TINY_CLIP_OVERRIDES
from mmviews.run import list_checkpoints


# tiny_run: the session fixture of conftest.py (one tiny finished run, copied by each test).


# --------------------------------------------------------------------------- 1. resume


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin", "scheduler.bin", "objective.pt"])
def test_resume_refuses_a_hostile_pickle_in_the_checkpoint(tiny_run, tmp_path, capsys, name):
    """Each pickled checkpoint file replaced by one whose payload would create a file: the
    resume stops with one line naming that file, and the payload never runs, even when the
    attacker also rewrote the checksums of train_state.json."""
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    marker = tmp_path / "PWNED"
    checkpoint = list_checkpoints(run)[-1]
    hostile_torch_file(checkpoint / name, marker)
    rerecord(checkpoint)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    line = one_line_error(err)
    assert rc == 2
    assert str(checkpoint / name) in line and "refused" in line
    assert not marker.exists(), "code from the checkpoint ran"


def test_resume_of_a_finished_run_with_a_hostile_checkpoint_runs_nothing(tiny_run, tmp_path, capsys):
    """A finished run (``results.json`` written) is not trained again by ``--resume``: it says so
    and reads no checkpoint file, so a hostile one there stays unread."""
    run = copy_run(tiny_run, tmp_path / "run")
    marker = tmp_path / "PWNED"
    checkpoint = list_checkpoints(run)[-1]
    hostile_torch_file(checkpoint / "optimizer.bin", marker)
    rerecord(checkpoint)
    rc, out, _ = cli(capsys, "train", "--resume", str(run))
    assert rc == 0 and "has already finished" in out
    assert not marker.exists(), "code from the checkpoint ran"


def test_resume_without_checksums_still_loads_pickles_weights_only(tiny_run, tmp_path, capsys):
    """A checkpoint without file records (as written before them) gets the same protection."""
    run = copy_run(tiny_run, tmp_path / "run", unfinished=True)
    marker = tmp_path / "PWNED"
    checkpoint = list_checkpoints(run)[-1]
    hostile_torch_file(checkpoint / "optimizer.bin", marker)
    drop_records(checkpoint)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    assert rc == 2 and "optimizer.bin" in one_line_error(err)
    assert not marker.exists()


def test_planted_custom_checkpoint_is_never_loaded(tiny_run, tmp_path, capsys):
    """The audit's exploit: Accelerate's custom_checkpoint_0.pkl (full unpickling in
    load_state) replaced by a payload. mmviews registers nothing with Accelerate and shows its
    load_state only the model/optimiser/scheduler files, so the resume completes and nothing runs."""
    run = copy_run(tiny_run, tmp_path / "run")
    marker = tmp_path / "PWNED"
    checkpoint = list_checkpoints(run)[-1]
    assert not list(checkpoint.glob("custom_checkpoint_*.pkl")), "mmviews should no longer write custom checkpoints"
    hostile_torch_file(checkpoint / "custom_checkpoint_0.pkl", marker)
    shutil.rmtree(run / "encoder")
    rc, out, err = cli(capsys, "train", "--resume", str(run))
    assert rc == 0, err
    assert not marker.exists(), "code from custom_checkpoint_0.pkl ran"
    assert f"mmviews train: warning: resumed from {checkpoint} at step 4 of 4" in err  # the checkpoint was really restored
    assert (run / "encoder" / "encoder.json").is_file()


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> Path:
    """A run with an EMA teacher (ER's distillation form)."""
    return train_tiny_run(tmp_path_factory.mktemp("teacher"),
                          objective={"name": "er", "params": {"temperature": 0.2}, "ema_teacher": True})


def test_teacher_is_checkpointed_as_safetensors_and_legacy_pickle_is_weights_only(teacher_run, tmp_path, capsys):
    checkpoint = list_checkpoints(teacher_run)[-1]
    assert (checkpoint / "teacher.safetensors").is_file()
    # A checkpoint in the old layout (teacher in Accelerate's custom_checkpoint_1.pkl, no
    # records) whose teacher pickle is hostile: refused by name, payload not run.
    run = copy_run(teacher_run, tmp_path / "run", unfinished=True)
    checkpoint = list_checkpoints(run)[-1]
    (checkpoint / "teacher.safetensors").unlink()
    marker = tmp_path / "PWNED"
    hostile_torch_file(checkpoint / "custom_checkpoint_1.pkl", marker)
    drop_records(checkpoint)
    rc, _, err = cli(capsys, "train", "--resume", str(run))
    assert rc == 2 and "custom_checkpoint_1.pkl" in one_line_error(err)
    assert not marker.exists()


# --------------------------------------------------------------------------- 2. adapter configs


def _open_clip_encoder_dir(tmp_path: Path, kind: str = "open_clip") -> Path:
    encoder = MultiViewEncoder.from_config(
        {"embed_dim": 16, "modalities": {"image": {"type": kind, "model": "ViT-B-32",
                                                   "model_overrides": TINY_CLIP_OVERRIDES}}})
    return encoder.save_pretrained(tmp_path / "encoder")


def _make_hostile(encoder_dir: Path, marker: Path) -> Path:
    """Edit the saved open_clip adapter config so that open_clip would torch.load a hostile
    file with weights_only=False (what model_overrides could switch on before)."""
    evil = hostile_torch_file(encoder_dir.parent / "weights.pt", marker)
    config_path = encoder_dir / "image" / "config.json"
    config = json.loads(config_path.read_text())
    config["model_overrides"] = {**config["model_overrides"], "pretrained_image_path": str(evil), "weights_only": False}
    config_path.write_text(json.dumps(config))
    return config_path


@pytest.mark.parametrize("kind", ["open_clip", "flow_clip"])
def test_from_pretrained_refuses_unsafe_model_overrides(tmp_path, kind):
    encoder_dir = _open_clip_encoder_dir(tmp_path, kind)
    MultiViewEncoder.from_pretrained(encoder_dir)  # the untouched folder loads
    marker = tmp_path / "PWNED"
    config_path = _make_hostile(encoder_dir, marker)
    with pytest.raises(ValueError, match=r"config\.json.*model_overrides key 'pretrained_image_path' is not allowed"):
        MultiViewEncoder.from_pretrained(encoder_dir)
    assert not marker.exists(), "open_clip unpickled the file named by the config"
    assert str(config_path) in str(pytest.raises(ValueError, MultiViewEncoder.from_pretrained, encoder_dir).value)


def test_eval_refuses_a_run_whose_encoder_config_is_unsafe(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_recipe(run / "config.yaml", tiny_config(image=False))
    encoder_dir = _open_clip_encoder_dir(run)
    marker = tmp_path / "PWNED"
    config_path = _make_hostile(encoder_dir, marker)
    rc, _, err = cli(capsys, "eval", str(run))
    line = one_line_error(err)
    assert rc == 2 and str(config_path) in line and "pretrained_image_path" in line
    assert not marker.exists()


def _open_clip_recipe(tmp_path: Path, image_adapter: dict) -> Path:
    raw = tiny_config(image=True)
    raw["adapters"]["image"] = image_adapter
    return write_recipe(tmp_path / "clip.yaml", raw)


def test_train_check_refuses_unsafe_model_overrides(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    evil = hostile_torch_file(tmp_path / "weights.pt", marker)
    recipe = _open_clip_recipe(tmp_path, {
        "type": "open_clip", "model": "ViT-B-32", "head": {"kind": "linear"},
        "model_overrides": {**TINY_CLIP_OVERRIDES, "pretrained_image_path": str(evil), "weights_only": False}})
    rc, out, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "OK" not in out
    assert "pretrained_image_path" in line and str(recipe) in line
    assert not marker.exists()


def test_tower_keys_that_fetch_weights_are_refused(tmp_path, capsys):
    overrides = {**TINY_CLIP_OVERRIDES, "vision_cfg": {**TINY_CLIP_OVERRIDES["vision_cfg"], "timm_model_pretrained": True}}
    recipe = _open_clip_recipe(tmp_path, {"type": "open_clip", "model": "ViT-B-32", "model_overrides": overrides})
    rc, _, err = cli(capsys, "train", str(recipe), "--check")
    assert rc == 2 and "model_overrides.vision_cfg.timm_model_pretrained" in one_line_error(err)


def test_external_open_clip_names_need_the_command_line_flag(tmp_path, capsys):
    missing = tmp_path / "no_such_model_dir"
    recipe = _open_clip_recipe(tmp_path, {"type": "open_clip", "model": f"local-dir:{missing}",
                                          "model_overrides": TINY_CLIP_OVERRIDES})
    rc, _, err = cli(capsys, "train", str(recipe), "--check")
    line = one_line_error(err)
    assert rc == 2 and "--allow-remote-models" in line and "local-dir:" in line
    # With the flag the name reaches open_clip (which then finds no such folder).
    rc, _, err = cli(capsys, "train", str(recipe), "--check", "--allow-remote-models")
    line = one_line_error(err)
    assert rc == 2 and "--allow-remote-models" not in line and "no_such_model_dir" in line
    # The permission is scoped to the command.
    from mmviews.modalities.remote import check_model_source

    with pytest.raises(ValueError, match="allow-remote-models"):
        check_model_source("hf-hub:org/name", "model")
    with allow_remote_models():
        check_model_source("hf-hub:org/name", "model")


# --------------------------------------------------------------------------- 3. data pickles


def test_train_on_a_hostile_data_pickle_is_one_line(tmp_path, capsys):
    """The MMSA pickle refused by `prepare` is refused by `train` with the same message, in one line."""
    marker = tmp_path / "PWNED"
    pkl = hostile_pickle(tmp_path / "mosi.pkl", marker, {"train": {"audio": np.zeros(2)}})
    rc, _, err = cli(capsys, "train", "mosi", "--set", f"data.root={pkl}", "--output", str(tmp_path / "run"))
    line = one_line_error(err)
    assert rc == 2 and str(pkl) in line and "refused to load global" in line
    assert not marker.exists()
    rc, _, err = cli(capsys, "prepare", "mosi", str(pkl), "--out", str(tmp_path / "store"))
    assert rc == 2
    prepare_message = next(ln for ln in err.splitlines() if ln.startswith("mmviews prepare: error: ")).partition(
        "error: ")[2]
    assert line.endswith(prepare_message)
    assert not marker.exists()


def test_the_payload_runs_under_full_unpickling(tmp_path):
    """The payload of these tests does run when a file is fully unpickled, so a test that finds
    no marker shows that the file was refused, not that the payload is inert."""
    import pickle

    import torch

    marker = tmp_path / "PWNED"
    with open(hostile_pickle(tmp_path / "p.pkl", marker), "rb") as f:
        pickle.load(f)
    assert marker.exists()
    marker.unlink()
    torch.load(hostile_torch_file(tmp_path / "t.pt", marker), weights_only=False)
    assert marker.exists()
