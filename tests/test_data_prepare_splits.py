"""``mmviews prepare`` covers every split of a copy unless ``--splits`` names some: the sentiment
store and its Parquet shards (train, valid, test), a video folder's check, store and shards
(train, test), an hf folder's check and shards (every split of a DatasetDict or of its recipe,
every split folder of an image folder). Each split is counted in what the command prints and written where it says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_data_hf import png_bytes
from test_data_pickle import mmsa_split, write
from test_data_shards import prepare
from test_data_video_prepare import write_ucf_lists
from test_data_video_store import make_folder

from mmviews.data.sentiment import read_store_meta
from mmviews.data.shards import SHARDS_META

SENTIMENT_SIZES = {"train": 5, "valid": 3, "test": 4}  # a different size per split: a split read twice shows


def shard_rows(out: Path) -> dict[str, int]:
    """``{split: rows}`` of a shard folder, as its record says and as its Parquet files hold."""
    import pyarrow.parquet as pq

    meta = json.loads((out / SHARDS_META).read_text())
    on_disk = {split.name: sum(pq.read_metadata(f).num_rows for f in split.glob("*.parquet"))
               for split in out.iterdir() if split.is_dir()}
    recorded = {split: info["rows"] for split, info in meta["splits"].items() if info["complete"]}
    assert recorded == on_disk, (recorded, on_disk)
    return recorded


@pytest.fixture(scope="module")
def sentiment_pickle(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sentiment")
    return write(folder / "mosi.pkl", {s: mmsa_split(n) for s, n in SENTIMENT_SIZES.items()})


def test_sentiment_store_has_every_split(sentiment_pickle, tmp_path):
    r = prepare("mosi", str(sentiment_pickle), "--out", str(tmp_path / "store"))
    assert r.returncode == 0, r.stdout + r.stderr
    splits = read_store_meta(tmp_path / "store")["splits"]
    assert {s: m["num_samples"] for s, m in splits.items()} == SENTIMENT_SIZES
    for split, n in SENTIMENT_SIZES.items():
        assert f"{split}: {n} samples" in r.stdout


def test_sentiment_shards_have_every_split_or_the_ones_asked(sentiment_pickle, tmp_path):
    r = prepare("mosi", str(sentiment_pickle), "--format", "parquet", "--shard-rows", "2",
                "--output", str(tmp_path / "all"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert shard_rows(tmp_path / "all") == SENTIMENT_SIZES
    for split, n in SENTIMENT_SIZES.items():
        assert f"{split}: {n} rows in {-(-n // 2)} shards" in r.stdout
    r = prepare("mosi", str(sentiment_pickle), "--format", "parquet", "--splits", "valid,test",
                "--output", str(tmp_path / "two"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert shard_rows(tmp_path / "two") == {"valid": 3, "test": 4}


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory) -> Path:
    """A UCF-101 layout: 2 training clips, 1 test clip (3 frames each), fold 1."""
    data = tmp_path_factory.mktemp("video")
    root = make_folder(data / "UCF-101", {"Jump": [3, 3, 3]})
    write_ucf_lists(data / "ucfTrainTestlist", ["Jump/v_Jump_0.avi", "Jump/v_Jump_1.avi"], ["Jump/v_Jump_2.avi"],
                    ["Jump"])
    return root


def test_video_check_store_and_shards_have_every_split(video_folder, tmp_path):
    r = prepare("ucf101", str(video_folder), "--check-only", "--out", str(tmp_path / "index.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train (fold 1): 2 clips listed" in r.stdout and "test (fold 1): 1 clips listed" in r.stdout
    index = json.loads((tmp_path / "index.json").read_text())
    assert {s: v["clips"] for s, v in index["splits"].items()} == {"train": 2, "test": 1}
    r = prepare("ucf101", str(video_folder), "--out", str(tmp_path / "store"), "--workers", "0", "--size", "16",
                "--flow", "none")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train (fold 1): 2 clips listed" in r.stdout and "test (fold 1): 1 clips listed" in r.stdout
    r = prepare("ucf101", str(video_folder), "--format", "parquet", "--workers", "0", "--size", "16", "--flow", "none",
                "--output", str(tmp_path / "shards"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert shard_rows(tmp_path / "shards") == {"train": 2, "test": 1}


def hf_split(n: int, offset: int):
    import datasets

    return datasets.Dataset.from_dict(
        {"image": [{"bytes": png_bytes(offset + i, (4, 5)), "path": None} for i in range(n)],
         "label": [i % 2 for i in range(n)]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}))


HF_SIZES = {"train": 4, "validation": 2, "test": 3}


def test_hf_check_and_shards_have_every_split(tmp_path):
    import datasets

    root = tmp_path / "dict"
    datasets.DatasetDict({s: hf_split(n, 10 * k) for k, (s, n) in enumerate(HF_SIZES.items())}).save_to_disk(str(root))
    r = prepare("hf", str(root), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert {s: summary[f"split {s}"]["rows"] for s in HF_SIZES} == HF_SIZES
    r = prepare("hf", str(root), "--format", "parquet", "--output", str(tmp_path / "shards"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert shard_rows(tmp_path / "shards") == HF_SIZES
    # with a recipe: every split it names (train, val and test splits), checked and written
    recipe = {"name": "r", "data": {"name": "hf", "root": str(root), "train_split": "train", "val_split": "validation",
                                    "test_split": "test", "options": {"columns": {"image": "image"},
                                                                      "labels": {"class": "label"}}},
              "views": [{"modality": "image"}, {"modality": "image"}], "encoder": {"embed_dim": 8},
              "adapters": {"image": {"type": "small_cnn", "channels": [4]}}, "objective": {"name": "mv_dhel"}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    r = prepare("hf", str(root), "--recipe", str(path), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert {s: summary[f"split {s}"]["rows"] for s in HF_SIZES} == HF_SIZES
    r = prepare("hf", str(root), "--format", "parquet", "--recipe", str(path), "--output", str(tmp_path / "recipe"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert shard_rows(tmp_path / "recipe") == HF_SIZES


def test_image_folder_shards_have_every_split_folder(tmp_path):
    from PIL import Image

    root = tmp_path / "images"
    for split, n in (("train", 3), ("test", 2)):
        for i in range(n):
            folder = root / split / ("cat" if i % 2 else "dog")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((4, 5, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
    r = prepare("hf", str(root), "--format", "parquet", "--output", str(tmp_path / "shards"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert shard_rows(tmp_path / "shards") == {"train": 3, "test": 2}
