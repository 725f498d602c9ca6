"""What ``mmviews export`` writes and when (mmviews.export.hf, mmviews.cli.export): the model
card of a finished run (its own text, the Hub's front matter replaced) or of a checkpoint
(rendered anew: a checkpoint is not the finished run), the folder written under a temporary
name beside ``--output`` and renamed only when complete (checked mid-write), nothing left behind
by an export that fails, and ``--license`` refused where it cannot go. (The exported folders'
contents and loading: test_export.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_export import make_run

from mmviews.cli import main
from mmviews.config import load_config
from mmviews.export import hf

FINISHED_BODY = "This card was written by the finished run, after its last evaluation.\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished run (results.json, its own card) with a checkpoint folder inside."""
    folder = make_run(tmp_path_factory.mktemp("export") / "run", {"x": "mlp"})
    (folder / "results.json").write_text(json.dumps({"steps": 8, "final_loss": 1.5,
                                                     "eval": {"test/linear/class/acc": 0.75}}))
    (folder / "encoder" / "README.md").write_text("---\nlibrary_name: old\n---\n" + FINISHED_BODY)
    checkpoint = folder / "checkpoints" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text("{}")
    return folder


def _front(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:card.index("\n---\n", 4)])


def test_a_finished_runs_card_keeps_its_text_under_the_hubs_front_matter(run: Path):
    config = load_config(run / "config.yaml")
    card = hf.hub_model_card(run, config, "mit")
    assert card.endswith(FINISHED_BODY)
    front = _front(card)
    assert front["library_name"] == "mmviews" and front["license"] == "mit"
    assert "license" not in _front(hf.hub_model_card(run, config, None))


def test_a_checkpoints_card_is_rendered_from_the_recipe_not_taken_from_the_finished_run(run: Path):
    from mmviews.train.model_card import render_model_card

    config = load_config(run / "config.yaml")
    checkpoint = run / "checkpoints" / "checkpoint-4"
    card = hf.hub_model_card(checkpoint, config, "apache-2.0")
    assert FINISHED_BODY not in card
    summary = json.loads((run / "results.json").read_text())
    assert card == render_model_card(config, summary, None, None, "apache-2.0")
    assert _front(card)["license"] == "apache-2.0"


def _watch_the_write(monkeypatch, owner, name: str, output: Path, seen: list) -> None:
    """Wraps ``owner.name`` (a step of the export that writes into its folder) to record, at
    that moment, the folder it writes into and whether ``output`` exists yet."""
    real = getattr(owner, name)

    def watched(*args, **kwargs):
        target = next(Path(a) for a in (*args, *kwargs.values()) if isinstance(a, (str, Path)))
        seen.append((target, output.exists(), sorted(p.name for p in output.parent.iterdir())))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, watched)


@pytest.mark.parametrize("fmt", ["hf", "onnx"])
def test_the_export_is_written_beside_output_and_renamed_when_complete(run: Path, tmp_path: Path, monkeypatch,
                                                                       fmt: str, capsys):
    from mmviews.modalities.multiview import MultiViewEncoder

    output = tmp_path / "out"
    seen: list = []
    if fmt == "hf":
        _watch_the_write(monkeypatch, MultiViewEncoder, "save_pretrained", output, seen)
        seen_target = lambda t: t  # noqa: E731
    else:
        import mmviews.export.onnx as onnx_export

        _watch_the_write(monkeypatch, onnx_export, "export_adapter", output, seen)
        seen_target = lambda t: t.parent  # noqa: E731  (the adapter's sub-folder)
    assert main(["export", str(run), "--format", fmt, "--output", str(output)]) == 0
    assert len(seen) == 1
    target, output_existed, beside = seen[0]
    target = seen_target(target)
    assert not output_existed  # nothing under --output until the export is complete
    assert target.parent == tmp_path and target.name.startswith(".out.tmp-") and beside == [target.name]
    assert output.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # renamed, nothing else left
    assert capsys.readouterr().out.count("\n") == 1


def test_an_export_that_fails_leaves_nothing(run: Path, tmp_path: Path, monkeypatch, capsys):
    from mmviews.modalities.multiview import MultiViewEncoder

    def fail(self, folder, *args, **kwargs):
        (Path(folder) / "half-written").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MultiViewEncoder, "save_pretrained", fail)
    assert main(["export", str(run), "--format", "hf", "--output", str(tmp_path / "out")]) != 0
    assert list(tmp_path.iterdir()) == []
    capsys.readouterr()


@pytest.mark.parametrize("format", ["hf", "onnx"])
def test_a_full_disk_during_an_export_is_one_line_with_the_bytes(format: str, run: Path, tmp_path: Path, monkeypatch,
                                                                 capsys):
    """A writer failing with its own words (no errno) while the device is short of the export's
    bytes: one line naming the folder, the bytes needed and free, exit status 2, nothing left."""
    import mmviews.fileio as fileio
    from mmviews.export import onnx
    from mmviews.modalities.multiview import MultiViewEncoder

    def fail(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(*((MultiViewEncoder, "save_pretrained", fail) if format == "hf" else
                          (onnx, "export_adapter", fail)))
    monkeypatch.setattr(fileio, "free_bytes", lambda folder: 10)
    assert main(["export", str(run), "--format", format, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmviews export: error: {tmp_path}: no space left while writing the export out/: it needs "
                          "about ") and err.endswith(", 10 bytes are free; nothing partial was left there\n"), err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_output_must_be_a_new_folder_in_an_existing_one(tmp_path: Path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match=rf"^--output {tmp_path / 'taken'} exists: give a new folder$"):
        hf.prepare_output_folder(tmp_path / "taken")
    with pytest.raises(FileNotFoundError, match=rf"^--output {tmp_path / 'no' / 'out'}: folder {tmp_path / 'no'} "
                                                 r"does not exist$"):
        hf.prepare_output_folder(tmp_path / "no" / "out")
    first, second = hf.prepare_output_folder(tmp_path / "out"), hf.prepare_output_folder(tmp_path / "out")
    assert first != second and first.parent == second.parent == tmp_path and first.is_dir()
    (first / "f").write_text("x")
    assert hf.finish_output_folder(first, tmp_path / "out") == tmp_path / "out"
    assert (tmp_path / "out" / "f").read_text() == "x" and not first.exists()


def test_license_is_refused_with_onnx(run: Path, tmp_path: Path, capsys):
    assert main(["export", str(run), "--format", "onnx", "--license", "mit", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--license is for --format hf (an ONNX folder has no model card)" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_mid_write_guard_fails_when_the_export_is_written_in_place(run: Path, tmp_path: Path, monkeypatch, capsys):
    from mutations import apply_break

    apply_break("export_in_place", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_the_export_is_written_beside_output_and_renamed_when_complete(run, tmp_path, monkeypatch, "hf", capsys)


def test_the_license_given_reaches_the_exported_card(run: Path, tmp_path: Path, capsys):
    assert main(["export", str(run), "--format", "hf", "--license", "cc-by-4.0", "--output", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    card = (tmp_path / "o" / "README.md").read_text()
    assert _front(card)["license"] == "cc-by-4.0" and card.endswith(FINISHED_BODY)


def test_a_checkpoint_of_a_run_without_results_gets_a_card_of_its_recipe(tmp_path: Path):
    from mmviews.train.model_card import render_model_card

    folder = make_run(tmp_path / "run", {"x": "mlp"})
    checkpoint = folder / "checkpoints" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text("{}")
    config = load_config(folder / "config.yaml")
    assert hf.hub_model_card(checkpoint, config, None) == render_model_card(config, {}, None, None, None)
