"""``mmviews embed``: the rows of an absent view are null (never the encoder's output for a view
the sample lacks), every row's ``sample_id`` is the index its batch carries (a split whose samples
are not numbered 0..n-1 keeps its own numbers), and the views embedded are the run's evaluation
views (``evaluation.views``), not one natural view per modality."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crafted_files import cli, untrained_run
from test_eval_extract import Enc, Toy, collate
from test_train_utils import tiny_config, write_recipe
from torch.utils.data import DataLoader, Subset

from mmviews.cli.embed import embedding_table


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
    assert "(image_0, image_1, audio_0; precision no)" in printed
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

