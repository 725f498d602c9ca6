"""Helpers of the security and reliability tests: hostile files, a tiny trained run, and the
command line run in-process. (No tests here.)"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_utils import tiny_config, train_in_process, write_recipe

from mmviews.cli import main
from mmviews.run import TRAIN_STATE_FILE, checkpoint_file_records


class CreatesFile:
    """Unpickling this object calls ``open(path, "w")``: the file appears iff the pickle was
    loaded with full unpickling (code from the file ran)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def hostile_torch_file(path: Path, marker: Path) -> Path:
    """A ``torch.save`` file (what Accelerate and mmviews write) whose payload creates ``marker``."""
    torch.save({"state": CreatesFile(marker), "step": 1}, path)
    return path


def hostile_pickle(path: Path, marker: Path, payload: Any = None) -> Path:
    """A plain pickle whose payload (inside ``payload``'s dict, if given) creates ``marker``."""
    obj = CreatesFile(marker) if payload is None else {**payload, "x": CreatesFile(marker)}
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)
    return path


def rerecord(checkpoint: Path) -> None:
    """Rewrite the file records of ``train_state.json`` for the files as they are now, as an
    attacker who edits a checkpoint would (so the checksum check cannot be what stops them)."""
    path = checkpoint / TRAIN_STATE_FILE
    state = json.loads(path.read_text())
    state["files"] = checkpoint_file_records(checkpoint)
    path.write_text(json.dumps(state))


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder in which this process really cannot create a file: a read-only folder under
    ``tmp_path`` for an ordinary user; for root (who writes into any folder of an ordinary file
    system whatever its mode) ``/sys``, which takes no new file from anyone. Skips the test
    where neither holds."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    folder = Path("/sys")
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return folder
    os.close(fd)
    os.unlink(probe)
    pytest.skip("no folder here refuses root's writes")


def drop_records(checkpoint: Path) -> None:
    """Make ``train_state.json`` look like one written before file records existed."""
    path = checkpoint / TRAIN_STATE_FILE
    state = json.loads(path.read_text())
    state.pop("files", None)
    path.write_text(json.dumps(state))


def train_tiny_run(folder: Path, **changes: Any) -> Path:
    """Train a tiny run (2 epochs x 2 steps, a checkpoint every 2 steps) in this process
    (:func:`train_in_process`: a subprocess would pay ~3.5 CPU-s of imports for a fixture);
    ``changes`` update the recipe's top-level sections. Returns the run folder."""
    raw = tiny_config(num_samples=32, batch_size=16, epochs=2, image=False)
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    folder.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(folder / "tiny.yaml", raw)
    run = folder / "run"
    r = train_in_process(str(recipe), "--output", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def untrained_run(run: Path, raw: dict[str, Any]) -> Path:
    """A run folder as ``mmviews train`` lays it out, without a step of training (for commands
    that read a run, in a moment): its manifest, the recipe ``raw`` as ``config.yaml`` and the
    recipe's freshly initialised ``encoder/``. Returns ``run``."""
    from mmviews.config import load_config
    from mmviews.run import build_encoder, record_run_outputs
    from mmviews.train.run_folder import claim_run_dir

    claim_run_dir(run)
    config = load_config(write_recipe(run / "config.yaml", raw))
    build_encoder(config).save_pretrained(run / "encoder")
    record_run_outputs(run)
    return run


def copy_run(run: Path, dest: Path, *, unfinished: bool = False) -> Path:
    """A copy of ``run``; ``unfinished``: without ``results.json``, as a run stopped before its
    end (``--resume`` of a finished run changes nothing and reads no checkpoint file)."""
    shutil.copytree(run, dest)
    if unfinished:
        (dest / "results.json").unlink()
    return dest


def cli(capsys: Any, *args: str) -> tuple[int, str, str]:
    """``mmviews ARGS`` in this process: ``(exit status, stdout, stderr)``."""
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(err: str) -> str:
    """The single ``mmviews ...: error: ...`` line of ``err`` (asserting there is exactly one
    line apart from warnings, and no traceback)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mmviews ") and ": warning: " not in ln]
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]
