"""``mmviews embed`` (:mod:`mmviews.cli.embed`): the rows of an absent view are null (never the
encoder's output for a view the sample lacks), every row's ``sample_id`` is the index its batch
carries, and the views embedded are the run's evaluation views; its options and defaults, the
``split`` column's names, the progress bar per split, the one-line errors for clashing or changing
columns, and the ONNX path (the options it refuses, a modality without a graph, the rows it writes)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from crafted_files import cli, one_line_error, untrained_run
# (imports open_clip with this module: see there)
from test_cli_eval import check_remote_models_need_the_flag, one_line_help, remote_model_run
from test_eval_extract import VIEWS, Enc, Toy, collate
from test_train_utils import tiny_config
from torch.utils.data import DataLoader, Subset

from mmviews.cli.embed import dataset_split_names, embedding_table
from mmviews.data.batch import ViewBatch, ViewInfo


def test_absent_views_are_null_and_sample_ids_are_the_batches_indices() -> None:
    """Toy sample i has two views, the second absent for i % 3 == 0, where the encoder still
    returns a non-zero vector; the splits hold the samples 5, 7, ..., 17 and 0, 3, 6, 9 (not
    numbered from 0, not contiguous), read in batches of 3."""
    encoder = Enc().eval()
    splits = {"train": [5, 7, 9, 11, 13, 15, 17], "test": [0, 3, 6, 9]}
    loaders = {split: DataLoader(Subset(Toy(20), ids), batch_size=3, collate_fn=collate)
               for split, ids in splits.items()}
    loaders["val"] = None  # a split the recipe lacks: no rows
    columns, view_names = embedding_table(encoder, loaders)
    assert view_names == ["feat_0", "feat_1"]
    assert set(columns) == {"split", "sample_id", "class", "sentiment", "feat_0", "feat_1"}
    ids = [i for split in ("train", "test") for i in splits[split]]
    assert columns["split"] == ["train"] * 7 + ["test"] * 4
    assert columns["sample_id"] == ids
    assert columns["class"] == [i % 2 for i in ids]
    # the reference: sample i's views are x_i = arange(8).reshape(2, 4) + 10 i through the linear map
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10
    for row, i in enumerate(ids):
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 10.0 * i
        expected = x @ weight.T
        torch.testing.assert_close(torch.tensor(columns["feat_0"][row]), expected[0])
        if i % 3 == 0:
            assert columns["feat_1"][row] is None, (row, i)  # absent: null, not the encoder's vector
        else:
            torch.testing.assert_close(torch.tensor(columns["feat_1"][row]), expected[1])
    assert sum(v is None for v in columns["feat_1"]) == sum(i % 3 == 0 for i in ids) == 6
    assert all(len(columns[name]) == len(ids) for name in columns)


def test_no_split_to_embed_is_an_error() -> None:
    with pytest.raises(ValueError, match="names no split to embed"):
        embedding_table(Enc(), {"train": None, "val": None, "test": None})


EVALUATION_VIEWS = [{"modality": "image", "copies": 2}, {"modality": "audio"}]


@pytest.fixture(scope="module")
def run_with_evaluation_views(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder (its recipe as ``config.yaml`` and a freshly initialised ``encoder/``, no
    training needed) whose recipe trains on an image view, its augmented copy and an audio view,
    and evaluates two image views and the audio view; audio is absent from half the samples."""
    raw = tiny_config(text=False, num_samples=12)
    raw["data"]["options"]["missing_rate"] = {"audio": 0.5}
    raw["data"]["eval_batch_size"] = 5
    raw["evaluation"]["views"] = EVALUATION_VIEWS
    return untrained_run(tmp_path_factory.mktemp("embed") / "run", raw)


def test_embed_writes_the_runs_evaluation_views(run_with_evaluation_views: Path, tmp_path: Path, capsys) -> None:
    import datasets

    from mmviews.config import load_config
    from mmviews.data.loaders import build_eval_loaders
    from mmviews.modalities.multiview import MultiViewEncoder

    run = run_with_evaluation_views
    out = tmp_path / "emb.parquet"
    rc, printed, err = cli(capsys, "embed", str(run), str(run / "config.yaml"), "--output", str(out))
    assert rc == 0, err
    assert "(image_0, image_1, audio_0; precision float32)" in printed  # not "precision no"
    table = datasets.Dataset.from_parquet(str(out))
    assert table.column_names[:2] == ["split", "sample_id"]
    assert {"image_0", "image_1", "audio_0"} <= set(table.column_names) and "image_aug_1" not in table.column_names
    # the reference: the saved encoder on loaders of the recipe's evaluation views, built here
    config = load_config(run / "config.yaml")
    encoder = MultiViewEncoder.from_pretrained(run / "encoder").eval()
    loaders = build_eval_loaders(config.data, EVALUATION_VIEWS, config.seed)
    # the split column names each split as the dataset does (data.*_split)
    named = {"train": config.data.train_split, "val": config.data.val_split, "test": config.data.test_split}
    row = 0
    absent = 0
    with torch.no_grad():
        for split, loader in loaders.items():
            if loader is None:
                continue
            for batch in loader:
                z, mask = encoder(batch)
                for k in range(batch.num_samples):
                    got = table[row]
                    assert (got["split"], got["sample_id"]) == (named[split], int(batch.index[k]))
                    for m, name in enumerate(("image_0", "image_1", "audio_0")):
                        if mask[k, m]:
                            torch.testing.assert_close(torch.tensor(got[name]), z[k, m], rtol=0, atol=1e-6)
                        else:
                            assert got[name] is None, (split, k, name)
                            absent += 1
                    row += 1
    assert row == table.num_rows and absent > 0  # some samples lack audio: their audio_0 is null


# ---------------------------------------------------------------------------------------------
# Unit guards, in this process: options, split names, progress, column errors, the ONNX path
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from mmviews.cli.embed import add_arguments

    parser = argparse.ArgumentParser(prog="mmviews embed")
    add_arguments(parser)
    return parser


def test_options_and_their_defaults() -> None:
    args = _parser().parse_args(["RUN", "DATA", "-o", "e.parquet"])
    assert vars(args) == {"run": "RUN", "data": "DATA", "output": "e.parquet", "overwrite": False, "precision": "run",
                          "device": None, "allow_remote_models": False}
    args = _parser().parse_args(["RUN", "DATA", "--output", "e.parquet", "--overwrite", "--precision", "bf16",
                                 "--device", "cpu", "--allow-remote-models"])
    assert vars(args) == {"run": "RUN", "data": "DATA", "output": "e.parquet", "overwrite": True, "precision": "bf16",
                          "device": "cpu", "allow_remote_models": True}


@pytest.mark.parametrize("argv,message", [
    (["RUN", "DATA"], "the following arguments are required: --output/-o"),
    (["RUN", "DATA", "-o", "e.parquet", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
])
def test_a_missing_output_or_unknown_precision_is_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parser().parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_help_says_what_each_option_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mmviews embed --help``."""
    text = one_line_help(_parser(), monkeypatch)
    for said in ("run run folder or checkpoint folder",
                 "DATA_OR_RECIPE a recipe (YAML path or name in recipes/) whose data section to embed, or a dataset "
                 "folder read with the run's data section",
                 "--output FILE, -o FILE Parquet file to write (.parquet)",
                 "--overwrite replace FILE if it exists",
                 "--precision {run,no,bf16,fp16} autocast of the encoder's forward (default: the run's "
                 "optimisation.mixed_precision)",
                 "--device DEVICE where the encoder runs (default: the run's)",
                 "--allow-remote-models allow adapters to build open_clip models named 'hf-hub:...' or "
                 "'local-dir:...'"):
        assert said in text, said


def _loader(ids: list[int], collate_fn=collate) -> DataLoader:
    return DataLoader(Subset(Toy(20), ids), batch_size=2, collate_fn=collate_fn)


def test_the_split_column_holds_the_datasets_names_of_the_splits() -> None:
    data = SimpleNamespace(train_split="fit", val_split=None, test_split="heldout")
    names = dataset_split_names(data)
    assert names == {"train": "fit", "val": None, "test": "heldout"}
    loaders = {"train": _loader([1, 2]), "val": _loader([3]), "test": _loader([4])}
    columns, _ = embedding_table(Enc(), loaders, names)
    # a split without a name of its own (None) keeps its key
    assert columns["split"] == ["fit", "fit", "val", "heldout"]


def test_no_split_at_all_is_named() -> None:
    with pytest.raises(ValueError) as refused:
        embedding_table(Enc(), {"train": None, "val": None, "test": None})
    assert str(refused.value) == "the data section names no split to embed (train_split, val_split, test_split)"


def test_a_missing_split_before_others_leaves_the_others_rows() -> None:
    columns, _ = embedding_table(Enc(), {"train": None, "val": None, "test": _loader([2, 4, 6])})
    assert columns["split"] == ["test"] * 3 and columns["sample_id"] == [2, 4, 6]


def _without_index(items) -> ViewBatch:
    batch = collate(items)
    return ViewBatch(inputs=batch.inputs, views=batch.views, mask=batch.mask, labels=batch.labels, index=None)


def test_without_indices_the_sample_ids_count_each_split_from_zero() -> None:
    loaders = {"train": _loader([7, 8, 9], _without_index), "test": _loader([3, 4], _without_index)}
    columns, _ = embedding_table(Enc(), loaders)
    assert columns["sample_id"] == [0, 1, 2, 0, 1]
    assert columns["class"] == [1, 0, 1, 1, 0]  # the samples' own labels, in order


def test_each_split_has_its_progress_bar(capsys) -> None:
    embedding_table(Enc(), {"train": _loader([1]), "test": _loader([2])}, {"train": "fit", "test": "heldout"})
    err = capsys.readouterr().err
    assert "embeddings (fit)" in err and "embeddings (heldout)" in err


def _labelled(extra: dict[str, torch.Tensor | None]):
    def collate_with(items) -> ViewBatch:
        batch = collate(items)
        labels = {**batch.labels, **extra}
        return ViewBatch(inputs=batch.inputs, views=batch.views, mask=batch.mask,
                         labels={k: v[: batch.num_samples] for k, v in labels.items() if v is not None},
                         index=batch.index)
    return collate_with


@pytest.mark.parametrize("label,clash", [("split", "['split']"), ("feat_1", "['feat_1']")])
def test_a_label_named_like_a_column_or_a_view_is_refused(label: str, clash: str) -> None:
    """A label called ``split`` (a column of its own) or like a view (``feat_1``) would overwrite it."""
    loaders = {"train": _loader([1, 2], _labelled({label: torch.zeros(2)}))}
    with pytest.raises(ValueError) as refused:
        embedding_table(Enc(), loaders)
    assert str(refused.value) == (f"label or view names {clash} clash with the columns split, sample_id or each "
                                  "other: rename them in the recipe")


def _renamed_views(items) -> ViewBatch:
    batch = collate(items)
    views = [ViewInfo("feat_0", "feat", 0), ViewInfo("other_1", "feat", 1, natural=False)]
    return ViewBatch(inputs=batch.inputs, views=views, mask=batch.mask, labels=batch.labels, index=batch.index)


def test_a_split_with_other_views_is_refused() -> None:
    loaders = {"train": _loader([1]), "test": _loader([2], _renamed_views)}
    with pytest.raises(ValueError) as refused:
        embedding_table(Enc(), loaders)
    assert str(refused.value) == ("split 'test' has views ['feat_0', 'other_1'] and labels ['class', 'sentiment']; "
                                  "the first split had ['feat_0', 'feat_1'] and ['class', 'sentiment']")
    assert [v.name for v in VIEWS] == ["feat_0", "feat_1"]


def test_a_split_with_other_labels_is_refused() -> None:
    loaders = {"train": _loader([1]), "test": _loader([2], _labelled({"extra": torch.zeros(2)}))}
    with pytest.raises(ValueError) as refused:
        embedding_table(Enc(), loaders)
    assert str(refused.value) == ("split 'test' has views ['feat_0', 'feat_1'] and labels ['class', 'extra', "
                                  "'sentiment']; the first split had ['feat_0', 'feat_1'] and ['class', 'sentiment']")


# ---------------------------------------------------------------- the ONNX path, in this process


@pytest.fixture(scope="module")
def onnx_exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``(run, export, export_without_audio)``: an untrained run (image, augmented image and audio
    views; 10 samples, 4 with audio missing), its ONNX export whose recipe evaluates two image
    views only, and an export made where the audio adapter had no ONNX export."""
    pytest.importorskip("onnxruntime")
    import mmviews.export.onnx as onnx_export
    from mmviews.cli import main

    tmp = tmp_path_factory.mktemp("onnx")
    raw = tiny_config(text=False, num_samples=10)
    raw["data"]["options"]["missing_rate"] = {"audio": 0.4}
    raw["data"]["eval_batch_size"] = 4
    run = untrained_run(tmp / "run", raw)
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(onnx_export._SPECS, "audio_cnn")
        assert main(["export", str(run), "--format", "onnx", "--output", str(tmp / "no-audio")]) == 0
    image_only = shutil.copytree(tmp / "no-audio", tmp / "image-only")
    recipe = yaml.safe_load((image_only / "config.yaml").read_text())
    recipe["evaluation"]["views"] = [{"modality": "image", "copies": 2}]
    (image_only / "config.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return run, image_only, tmp / "no-audio"


@pytest.mark.parametrize("option,message", [
    (("--precision", "bf16"), "--precision bf16: an ONNX export runs in float32 (give 'no' or leave it out)"),
    (("--precision", "fp16"), "--precision fp16: an ONNX export runs in float32 (give 'no' or leave it out)"),
    (("--device", "cuda"), "--device cuda: an ONNX export runs on onnxruntime's CPU provider (give 'cpu')"),
])
def test_onnx_refuses_what_it_cannot_run(onnx_exports, tmp_path: Path, capsys, option, message) -> None:
    run, export, _ = onnx_exports
    out = tmp_path / "e.parquet"
    rc, _, err = cli(capsys, "embed", str(export), str(run / "config.yaml"), "--output", str(out), *option)
    assert rc == 2 and one_line_error(err) == f"mmviews embed: error: {message}" and not out.exists()


def test_onnx_names_the_modality_without_a_graph(onnx_exports, tmp_path: Path, capsys) -> None:
    run, _, no_audio = onnx_exports
    rc, _, err = cli(capsys, "embed", str(no_audio), str(run / "config.yaml"), "--output", str(tmp_path / "e.parquet"))
    assert rc == 2
    assert one_line_error(err) == (
        f"mmviews embed: error: {no_audio}: the views need modalities ['audio'] that have no ONNX graph "
        "(audio: no ONNX export is defined for adapter type 'audio_cnn')")


def test_onnx_names_each_modality_without_a_graph_with_its_reason(onnx_exports, tmp_path: Path, capsys) -> None:
    """audio was left out with a reason; video (a view the recipe was changed to evaluate) was never exported."""
    run, _, no_audio = onnx_exports
    export = shutil.copytree(no_audio, tmp_path / "export")
    recipe = yaml.safe_load((export / "config.yaml").read_text())
    recipe["adapters"]["video"] = {"type": "small_cnn", "channels": [8]}
    recipe["evaluation"]["views"] = [{"modality": "image"}, {"modality": "video"}, {"modality": "audio"}]
    (export / "config.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    rc, _, err = cli(capsys, "embed", str(export), str(run / "config.yaml"), "--output", str(tmp_path / "e.parquet"))
    assert rc == 2
    assert one_line_error(err) == (
        f"mmviews embed: error: {export}: the views need modalities ['audio', 'video'] that have no ONNX graph "
        "(audio: no ONNX export is defined for adapter type 'audio_cnn'; video: not in the export)")


@pytest.mark.parametrize("options,data_folder", [((), False), (("--precision", "no", "--device", "cpu"), True)])
def test_onnx_embeds_the_exports_evaluation_views(onnx_exports, tmp_path: Path, capsys, options,
                                                  data_folder: bool) -> None:
    """The export's own recipe says which views (image only, although the data has audio); the
    data comes from the recipe given, or from a dataset folder read with the export's own data
    section (the synthetic data reads nothing from its folder: the same rows); the vectors are
    the torch encoder's."""
    import datasets

    from mmviews.config import load_config
    from mmviews.data.loaders import build_eval_loaders
    from mmviews.modalities.multiview import MultiViewEncoder

    run, export, _ = onnx_exports
    out = tmp_path / "e.parquet"
    data = tmp_path if data_folder else run / "config.yaml"
    rc, printed, err = cli(capsys, "embed", str(export), str(data), "--output", str(out), *options)
    assert rc == 0, err
    table = datasets.Dataset.from_parquet(str(out))
    assert printed.splitlines()[-1] == (f"wrote {table.num_rows} samples x 2 views (image_0, image_1; onnxruntime, "
                                        f"float32) to {out}")
    views = [name for name in table.column_names if name.startswith(("image", "audio"))]
    assert views == ["image_0", "image_1"]  # not the data's audio, not the training's augmented copy
    config = load_config(run / "config.yaml")
    encoder = MultiViewEncoder.from_pretrained(run / "encoder").eval()
    loaders = build_eval_loaders(config.data, [{"modality": "image", "copies": 2}], config.seed)
    names = {"train": config.data.train_split, "val": config.data.val_split, "test": config.data.test_split}
    row = 0
    with torch.no_grad():
        for key, loader in loaders.items():
            for batch in loader or []:
                z, _ = encoder(batch)
                for k in range(batch.num_samples):
                    assert (table[row]["split"], table[row]["sample_id"]) == (names[key], int(batch.index[k]))
                    for m, name in enumerate(views):
                        torch.testing.assert_close(torch.tensor(table[row][name]), z[k, m], rtol=0, atol=1e-4)
                    row += 1
    assert row == table.num_rows > 0


# ---------------------------------------------------------------- the torch path's checks and its line


@pytest.fixture(scope="module")
def bf16_untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained run (image, augmented image and audio views; 8 samples) whose recipe sets bf16
    autocast and CPU, and has no validation split."""
    raw = tiny_config(text=False, num_samples=8)
    raw["optimisation"]["mixed_precision"] = "bf16"
    raw["cpu"] = True
    raw["data"]["val_split"] = None  # a split the recipe lacks: no loader, no rows
    return untrained_run(tmp_path_factory.mktemp("embed-bf16") / "run", raw)


@pytest.mark.parametrize("output,message", [
    ("e.csv", "--output {tmp}/e.csv: give a .parquet file"),
    ("taken.parquet", "--output {tmp}/taken.parquet exists: choose another file, or --overwrite to replace it"),
    ("no/e.parquet", "--output {tmp}/no/e.parquet: folder {tmp}/no does not exist"),
])
def test_the_output_is_checked_first(tmp_path: Path, capsys, output: str, message: str) -> None:
    """Before the run is even looked at (here there is none)."""
    (tmp_path / "taken.parquet").write_text("mine")
    rc, _, err = cli(capsys, "embed", str(tmp_path / "missing"), "quickstart", "--output", str(tmp_path / output))
    assert rc == 2 and one_line_error(err) == "mmviews embed: error: " + message.format(tmp=tmp_path)
    assert (tmp_path / "taken.parquet").read_text() == "mine"


def test_a_missing_run_is_named(tmp_path: Path, capsys) -> None:
    rc, _, err = cli(capsys, "embed", str(tmp_path / "missing"), "quickstart", "--output", str(tmp_path / "e.parquet"))
    assert rc == 2 and one_line_error(err) == (f"mmviews embed: error: {tmp_path / 'missing'} does not exist: give a "
                                               "run folder, a checkpoint folder or an ONNX export")


def test_a_bad_device_is_named_before_the_run_is_loaded(tmp_path: Path, capsys) -> None:
    """An empty folder is no run; the device is named first (loading takes seconds)."""
    rc, _, err = cli(capsys, "embed", str(tmp_path), "quickstart", "--output", str(tmp_path / "e.parquet"),
                     "--device", "nowhere")
    assert rc == 2 and one_line_error(err) == ("mmviews embed: error: --device 'nowhere' is not a device (e.g. cpu, "
                                               "cuda, cuda:1)")


@pytest.mark.parametrize("split", ["train", "test"])
def test_data_without_a_modality_of_the_views_is_named(bf16_untrained: Path, tmp_path: Path, capsys, split) -> None:
    """The same data without its audio, in every split or (after a split the recipe lacks) in the test split only."""
    recipe = yaml.safe_load((bf16_untrained / "config.yaml").read_text())
    if split == "train":
        recipe["data"]["options"]["modalities"] = ["image"]
    else:
        recipe["data"]["val_split"] = None
        recipe["data"].setdefault("split_options", {}).setdefault("test", {})["modalities"] = ["image"]
    data = tmp_path / "image-only.yaml"
    data.write_text(yaml.safe_dump(recipe, sort_keys=False))
    rc, _, err = cli(capsys, "embed", str(bf16_untrained), str(data), "--output", str(tmp_path / "e.parquet"))
    assert rc == 2 and one_line_error(err) == (
        f"mmviews embed: error: {data}: the {split} split has the modalities ['image'], but the run's views read "
        "['image', 'audio'] (missing ['audio']): give data with the modalities the run was trained on")
    assert "embeddings (" not in err and not (tmp_path / "e.parquet").exists()


@pytest.mark.parametrize("options,precision,data_folder", [((), "bf16", False), (("--precision", "no"), "no", True)])
def test_the_runs_precision_unless_told_and_the_line_printed(bf16_untrained: Path, tmp_path: Path, capsys,
                                                             options, precision: str, data_folder: bool) -> None:
    """The vectors are the encoder's under that autocast (bf16 differs from float32 in the 3rd
    digit); the file's vectors are float32; the printed line says what was written. The data:
    the run's recipe, or a dataset folder read with the run's data section (the synthetic data
    reads nothing from it: the same rows)."""
    import datasets

    from mmviews.config import load_config
    from mmviews.data.loaders import build_eval_loaders, eval_view_config
    from mmviews.modalities.multiview import MultiViewEncoder

    out = tmp_path / "e.parquet"
    out.write_text("replaced with --overwrite")
    data = tmp_path if data_folder else bf16_untrained / "config.yaml"
    rc, printed, err = cli(capsys, "embed", str(bf16_untrained), str(data), "--output", str(out), "--overwrite",
                           *options)
    assert rc == 0, err
    table = datasets.Dataset.from_parquet(str(out))
    printed_precision = "float32" if precision == "no" else precision  # "precision no" read as a refusal
    assert printed.splitlines()[-1] == (f"wrote {table.num_rows} samples x 2 views (image_0, audio_0; precision "
                                        f"{printed_precision}) to {out}")
    assert table.features["image_0"] == datasets.List(datasets.Value("float32"))
    config = load_config(bf16_untrained / "config.yaml")
    encoder = MultiViewEncoder.from_pretrained(bf16_untrained / "encoder").eval()
    batch = next(iter(build_eval_loaders(config.data, eval_view_config(config.view_spec), config.seed)["train"]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        z, _ = encoder(batch)
    got = torch.tensor(table[: batch.num_samples]["image_0"])
    torch.testing.assert_close(got, z[:, 0].float(), rtol=0, atol=1e-6)
    if precision == "bf16":
        with torch.no_grad():
            full, _ = encoder(batch)
        assert (got - full[:, 0]).abs().max() > 1e-4  # the autocast did change the numbers


def test_a_model_from_outside_the_recipe_needs_the_flag(tmp_path: Path, capsys) -> None:
    run, missing = remote_model_run(tmp_path)
    check_remote_models_need_the_flag(capsys, "embed", run, missing, "quickstart", "--output",
                                      str(tmp_path / "e.parquet"))
    assert not (tmp_path / "e.parquet").exists()


def test_the_data_section_of_a_dataset_folder_or_of_a_recipe(tmp_path: Path) -> None:
    """A folder is read with the run's own data section, its root replaced; a recipe (a name in
    recipes/ here) gives its own data section."""
    from mmviews.cli.embed import _data_section
    from mmviews.config import load_config

    run = untrained_run(tmp_path / "run", tiny_config(text=False, num_samples=8))
    config = load_config(run / "config.yaml")
    data = _data_section(str(tmp_path), config)
    assert data.root == str(tmp_path)
    assert (data.name, data.options["num_samples"], data.eval_batch_size) == ("synthetic", 8, 64)
    quickstart = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "quickstart.yaml").read_text())["data"]
    data = _data_section("quickstart", config)
    assert (data.name, data.options["modalities"], data.val_split) == (
        "synthetic", quickstart["options"]["modalities"], quickstart["val_split"])


def test_the_encoder_stays_on_the_cpu_asked_for_where_cuda_is_present(bf16_untrained: Path, onnx_exports,
                                                                       tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's ``cpu: true``, or ``--device cpu``, keeps the encoder on the CPU although
    torch reports CUDA (told so here: this machine has none, so a move to CUDA would fail)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, _, err = cli(capsys, "embed", str(bf16_untrained), str(bf16_untrained / "config.yaml"),
                     "--output", str(tmp_path / "a.parquet"))
    assert rc == 0, err
    run, _, _ = onnx_exports  # its recipe leaves cpu unset
    rc, _, err = cli(capsys, "embed", str(run), str(run / "config.yaml"), "--output", str(tmp_path / "b.parquet"),
                     "--device", "cpu")
    assert rc == 0, err
