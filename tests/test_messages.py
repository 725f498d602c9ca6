"""Messages that name the culprit (each one line, exit status 2, before any work), and the
run's stderr holding only what a user must act on: mmviews's warnings as one line without its
source paths, no progress bars of the ``datasets`` library's internals."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from crafted_files import cli, copy_run, one_line_error
from test_train_utils import tiny_config, write_recipe

from mmviews.config import ConfigError, load_config
from mmviews.data.views import ViewSetCollator, ViewSpec
from mmviews.notices import MMViewsWarning, one_line_warnings
from mmviews.train.build import build_run


def _hf_disk(root: Path, *, test_labels: bool) -> Path:
    import datasets

    def split(n: int, labels: bool) -> datasets.Dataset:
        rows = {"text": [f"word{i % 4} w{i}" for i in range(n)]}
        if labels:
            rows["label"] = [i % 2 for i in range(n)]
        return datasets.Dataset.from_dict(rows)

    datasets.DatasetDict({"train": split(8, True), "test": split(4, test_labels)}).save_to_disk(str(root))
    return root


def test_a_split_without_the_label_column_is_named(tmp_path: Path) -> None:
    from mmviews.data.hf import HFDataset

    root = _hf_disk(tmp_path / "data", test_labels=False)
    HFDataset(root, "train", labels={"class": "label"})  # the training split has it
    with pytest.raises(KeyError, match="split 'test' has no column 'label' \\(for 'class'\\)"):
        HFDataset(root, "test", labels={"class": "label"})


def test_mixed_image_sizes_name_the_resize_option() -> None:
    collate = ViewSetCollator(ViewSpec.from_config([{"modality": "image"}]), modality_info={"image": {"kind": "image"}})
    samples = [{"modalities": {"image": torch.rand(3, 8, 8)}, "labels": {}, "index": 0},
               {"modalities": {"image": torch.rand(3, 10, 8)}, "labels": {}, "index": 1}]
    with pytest.raises(ValueError, match="data.options.image_size"):
        collate(samples)


def test_a_misspelt_view_modality_is_the_views_fault(tmp_path: Path) -> None:
    raw = tiny_config(image=True, text=False)
    raw["views"] = [dict(v) for v in raw["views"]]
    index = next(i for i, v in enumerate(raw["views"]) if v["modality"] == "image")
    raw["views"][index]["modality"] = "imgae"
    config = load_config(write_recipe(tmp_path / "typo.yaml", raw))
    with pytest.raises(ConfigError, match=f"key 'views.{index}.modality': 'imgae' has no adapter "
                                          "\\(did you mean 'image'\\?\\)"):
        build_run(config, source="typo.yaml", with_eval=False)


def test_a_view_without_any_close_adapter_names_both_keys(tmp_path: Path) -> None:
    raw = tiny_config(image=True, text=False)
    raw["adapters"] = {("picture" if k == "image" else k): v for k, v in raw["adapters"].items()}
    config = load_config(write_recipe(tmp_path / "noadapter.yaml", raw))
    with pytest.raises(ConfigError, match="key 'adapters': no adapter for modality 'image' of 'views.\\d.modality'"):
        build_run(config, source="noadapter.yaml", with_eval=False)


def test_embed_with_data_of_other_modalities_stops_before_any_work(tiny_run: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = write_recipe(tmp_path / "gauss.yaml", {
        "name": "gauss", "data": {"name": "gaussian_latents", "split_options": {"train": {"num_samples": 8},
                                                                                "test": {"num_samples": 8}},
                                  "train_split": "train", "val_split": None, "test_split": "test"},
        "views": [{"modality": "x"}], "adapters": {"x": {"type": "mlp", "input_dim": 1}}})
    rc, out, err = cli(capsys, "embed", str(tiny_run), str(data), "--output", str(tmp_path / "e.parquet"))
    line = one_line_error(err)
    assert rc == 2 and f"{data}: the train split has the modalities ['x']" in line and "missing [" in line, line
    assert "embeddings (" not in err  # no extraction started
    assert not (tmp_path / "e.parquet").exists()


def test_compare_with_a_missing_run_folder_says_it_is_missing(tiny_run: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    rc, _, err = cli(capsys, "compare", str(missing), str(tiny_run))
    line = one_line_error(err)
    assert rc == 2 and f"{missing}: no such run folder" in line and "mmviews eval" not in line, line


def test_check_on_a_folder_train_would_refuse_checks_everything_then_says_why(
        tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = copy_run(tiny_run, tmp_path / "run")
    recipe = str(run / "config.yaml")
    # a recipe error is found although the folder holds a run
    rc, out, err = cli(capsys, "train", recipe, "--output", str(run), "--check", "--set", "data.batch_size=1")
    assert rc == 2 and "data.batch_size" in one_line_error(err) and "already holds" not in err
    # a sound recipe: OK, the estimate, then one note naming both ways to train there
    rc, out, err = cli(capsys, "train", recipe, "--output", str(run), "--check")
    assert rc == 0 and ": OK (" in out and "estimated peak memory" in out and not err, err
    notes = [line for line in out.splitlines() if "already holds a run" in line]
    assert notes == [f"note: {run} already holds a run: training there needs --resume {run} (continue it) or "
                     "--overwrite (replace what it wrote)"]
    # with --overwrite there is nothing to note; nothing was written by either check
    before = sorted(p.name for p in run.iterdir())
    rc, out, _ = cli(capsys, "train", recipe, "--output", str(run), "--check", "--overwrite")
    assert rc == 0 and ": OK (" in out and "already holds" not in out
    assert sorted(p.name for p in run.iterdir()) == before
    # a folder training can never use: the checks run, then the folder's error (exit status 2)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    rc, out, err = cli(capsys, "train", recipe, "--output", str(foreign), "--check")
    assert rc == 2 and ": OK (" in out and "not empty and not an mmviews run folder" in one_line_error(err)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_mmviews_warnings_are_one_line_without_source_paths() -> None:
    with one_line_warnings("mmviews train"):
        ours = warnings.formatwarning("data/x.png row 3: cannot decode;\n  marked absent", MMViewsWarning,
                                      "/site-packages/mmviews/data/streaming.py", 463)
        theirs = warnings.formatwarning("something else", UserWarning, "/site-packages/lib/mod.py", 7)
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn("find_unused_parameters=True was specified in DDP constructor, but ...", UserWarning)
            warnings.warn("kept", MMViewsWarning)
    assert ours == "mmviews train: warning: data/x.png row 3: cannot decode; marked absent\n"
    assert "/site-packages/lib/mod.py:7" in theirs
    assert [str(w.message) for w in seen] == ["kept"]  # the known noise is silenced, ours recorded as usual
    assert "mmviews train" not in warnings.formatwarning("x", MMViewsWarning, "f.py", 1)  # restored at the end


def test_a_command_prints_mmviews_warnings_as_one_line(tmp_path: Path) -> None:
    """In a process of its own (no test harness recording warnings): the command's warning is
    one line naming the file at fault, without mmviews's source path."""
    import subprocess
    import sys

    script = ("import warnings, sys\n"
              "from mmviews.cli import main\n"
              "from mmviews.notices import MMViewsWarning\n"
              "import mmviews.cli.list as listing\n"
              "def run(args):\n"
              "    warnings.warn('clip.mp4: cannot decode frame 3; marked absent', MMViewsWarning, stacklevel=2)\n"
              "    return 0\n"
              "listing.run = run\n"
              "sys.exit(main(['list', 'objectives']))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "mmviews list: warning: clip.mp4: cannot decode frame 3; marked absent\n", r.stderr
