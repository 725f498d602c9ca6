"""Unit guards of ``mmviews embed`` (:mod:`mmviews.cli.embed`) beyond its end-to-end tests: the
``split`` column's names, rows of a loader whose batches carry no index, the progress bar per
split, the one-line errors for clashing or changing columns, and the ONNX path run in this
process (the options it refuses, a modality without a graph, and the rows it writes)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from crafted_files import cli, one_line_error, untrained_run
from test_eval_extract import VIEWS, Enc, Toy, collate
from test_train_utils import tiny_config
from torch.utils.data import DataLoader, Subset

from mmviews.cli.embed import dataset_split_names, embedding_table
from mmviews.data.batch import ViewBatch, ViewInfo


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
    views; 10 samples, 4 with audio missing), its ONNX export whose recipe evaluates the image
    view only, and an export made where the audio adapter had no ONNX export."""
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
    recipe["evaluation"]["views"] = [{"modality": "image"}]
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


@pytest.mark.parametrize("options", [(), ("--precision", "no", "--device", "cpu")])
def test_onnx_embeds_the_exports_evaluation_views(onnx_exports, tmp_path: Path, capsys, options) -> None:
    """The export's own recipe says which views (image only, although the data has audio); the
    data comes from the dataset folder or recipe given; the vectors are the torch encoder's."""
    import datasets

    from mmviews.config import load_config
    from mmviews.data.loaders import build_eval_loaders
    from mmviews.modalities.multiview import MultiViewEncoder

    run, export, _ = onnx_exports
    out = tmp_path / "e.parquet"
    rc, printed, err = cli(capsys, "embed", str(export), str(run / "config.yaml"), "--output", str(out), *options)
    assert rc == 0, err
    table = datasets.Dataset.from_parquet(str(out))
    assert printed.splitlines()[-1] == (f"wrote {table.num_rows} samples x 1 views (image_0; onnxruntime, float32) "
                                        f"to {out}")
    views = [name for name in table.column_names if name.startswith(("image", "audio"))]
    assert views == ["image_0"]  # not the data's audio, not the training's augmented copy
    config = load_config(run / "config.yaml")
    encoder = MultiViewEncoder.from_pretrained(run / "encoder").eval()
    loaders = build_eval_loaders(config.data, [{"modality": "image"}], config.seed)
    names = {"train": config.data.train_split, "val": config.data.val_split, "test": config.data.test_split}
    row = 0
    with torch.no_grad():
        for key, loader in loaders.items():
            for batch in loader or []:
                z, _ = encoder(batch)
                for k in range(batch.num_samples):
                    assert (table[row]["split"], table[row]["sample_id"]) == (names[key], int(batch.index[k]))
                    torch.testing.assert_close(torch.tensor(table[row]["image_0"]), z[k, 0], rtol=0, atol=1e-4)
                    row += 1
    assert row == table.num_rows > 0
