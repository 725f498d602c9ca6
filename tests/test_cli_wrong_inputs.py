"""Something of another kind given where a command expects a run, a recipe or a dataset root is
named as what it is, with the command that takes it: an ONNX or Hub export given to ``mmviews
eval`` / ``embed`` as a run, a data file given to ``mmviews embed`` as DATA_OR_RECIPE, a file
given as ``data.root`` of a dataset that reads a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from crafted_files import cli, one_line_error


@pytest.fixture(scope="module")
def exports(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny run exported both ways, by the command a user runs."""
    from mmviews.cli import main

    folder = tmp_path_factory.mktemp("exports")
    for kind in ("onnx", "hf"):
        assert main(["export", str(tiny_run), "--format", kind, "--output", str(folder / kind)]) == 0
    return {kind: folder / kind for kind in ("onnx", "hf")}


def test_eval_of_an_onnx_export_points_to_embed(exports: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    onnx = exports["onnx"]
    rc, _, err = cli(capsys, "eval", str(onnx))
    line = one_line_error(err)
    assert rc == 2 and f"{onnx} is an ONNX export (mmviews export --format onnx), not a run" in line, line
    assert f"mmviews embed {onnx} DATA_OR_RECIPE --output FILE.parquet" in line and "checkpoint-N" not in line


@pytest.mark.parametrize("command", [["eval"], ["embed", "{recipe}", "--output", "{tmp}/e.parquet"]])
def test_a_hub_export_given_as_a_run_is_named_an_encoder_folder(command: list[str], exports: dict[str, Path],
                                                                tiny_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    hf = exports["hf"]
    argv = [command[0], str(hf), *(a.format(recipe=tiny_run / "config.yaml", tmp=tmp_path) for a in command[1:])]
    rc, _, err = cli(capsys, *argv)
    line = one_line_error(err)
    assert rc == 2 and f"{hf} is an encoder folder (mmviews export --format hf, or a run's encoder/), not a run" in line
    assert "MultiViewEncoder.from_pretrained" in line and "missing" not in line, line


@pytest.mark.parametrize("run_kind", ["run", "onnx"])
def test_embed_of_a_data_file_says_it_is_one(run_kind: str, exports: dict[str, Path], tiny_run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "afile.txt"
    data.write_text("hello\n")
    run = tiny_run if run_kind == "run" else exports["onnx"]
    rc, _, err = cli(capsys, "embed", str(run), str(data), "--output", str(tmp_path / "e.parquet"))
    line = one_line_error(err)
    assert rc == 2 and f"{data} is a data file (.txt), not a recipe (.yaml, or a name in recipes/) or a dataset folder" \
        in line, line
    assert "generates its data ('synthetic')" in line and "YAML mapping" not in line, line
    assert not (tmp_path / "e.parquet").exists()


@pytest.mark.parametrize("name, reads", [("hf", "a save_to_disk folder"), ("ucf101", "a folder of class folders")])
def test_a_file_as_the_root_of_a_folder_dataset_is_named_a_file(name: str, reads: str, tiny_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "afile.txt"
    data.write_text("hello\n")
    rc, _, err = cli(capsys, "train", str(tiny_run / "config.yaml"), "--check", "--output", str(tmp_path / "run"),
                     "--set", f"data.name={name}", "--set", f"data.root={data}", "--set", "data.options={}")
    line = one_line_error(err)
    assert rc == 2 and f"key 'data.root' = '{data}': {data} is a file (.txt), not a folder: this dataset reads {reads}" \
        in line, line
