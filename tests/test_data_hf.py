"""Local HuggingFace datasets: save_to_disk with image/audio/text columns, imagefolder, audiofolder."""

import io

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from mmviews.data import ViewSetCollator, ViewSpec, build_dataset


def png_bytes(value, size=(6, 6)):
    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(n, sr=8000):
    buf = io.BytesIO()
    sf.write(buf, np.linspace(-0.5, 0.5, n).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def disk_dataset(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("hf") / "ds"
    feats = datasets.Features({"img": datasets.Image(), "snd": datasets.Value("binary"), "sentence": datasets.Value("string"),
                               "label": datasets.ClassLabel(names=["neg", "pos"])})
    train = datasets.Dataset.from_dict({"img": [{"bytes": png_bytes(10), "path": None}, {"bytes": png_bytes(200, (4, 8)), "path": None},
                                                {"bytes": b"\x89PNG broken", "path": None}],
                                        "snd": [wav_bytes(800), wav_bytes(400), wav_bytes(100)],
                                        "sentence": ["good film", "bad film", "ok"], "label": [1, 0, 1]}, features=feats)
    datasets.DatasetDict({"train": train}).save_to_disk(str(root))
    return root


def test_disk_dataset_columns_shapes_and_collate(disk_dataset):
    ds = build_dataset("hf", root=disk_dataset, split="train", columns={"image": "img", "text": "sentence", "audio": "snd"},
                       image_size=6, sample_rate=16000)
    x = ds[0]
    assert x["modalities"]["image"].shape == (3, 6, 6)
    assert torch.allclose(x["modalities"]["image"], torch.full((3, 6, 6), 10 / 255), atol=1e-6)
    assert x["modalities"]["text"] == "good film" and x["labels"]["class"] == 1
    assert x["modalities"]["audio"].shape[0] == 1600  # 800 samples at 8 kHz -> 16 kHz
    assert ds[1]["modalities"]["image"].shape == (3, 6, 6)  # resized to a common size
    b = ViewSetCollator.for_dataset(ds, ViewSpec.from_config(["image", "text", "audio"]))([ds[0], ds[1]])
    assert b.inputs["audio"]["lengths"].tolist() == [1600, 800] and b.labels["class"].tolist() == [1, 0]


def test_unreadable_image_raises_or_skips(disk_dataset):
    ds = build_dataset("hf", root=disk_dataset, columns={"image": "img"}, image_size=6)
    with pytest.raises(ValueError, match="row 2, column 'img'.*cannot read image"):
        ds[2]
    ds = build_dataset("hf", root=disk_dataset, columns={"image": "img"}, image_size=6, on_error="skip")
    with pytest.warns(UserWarning, match="row 2"):
        assert ds[2]["modalities"]["image"] is None
    assert ds.num_skipped == 1


def test_missing_column_and_split(disk_dataset):
    with pytest.raises(KeyError, match="'picture'"):
        build_dataset("hf", root=disk_dataset, columns={"image": "picture"})
    with pytest.raises(KeyError, match="no split 'test'"):
        build_dataset("hf", root=disk_dataset, split="test", columns={"image": "img"})


def test_imagefolder_and_audiofolder(tmp_path):
    for c, v in (("cat", 0), ("dog", 255)):
        (tmp_path / "img" / "train" / c).mkdir(parents=True)
        Image.fromarray(np.full((5, 5, 3), v, np.uint8)).save(tmp_path / "img" / "train" / c / "a.png")
    ds = build_dataset("hf", root=tmp_path / "img", split="train", format="imagefolder")
    labels = sorted((int(ds[i]["labels"]["class"]), float(ds[i]["modalities"]["image"].mean())) for i in range(len(ds)))
    assert labels == [(0, 0.0), (1, 1.0)]
    for c in ("yes", "no"):
        (tmp_path / "aud" / "train" / c).mkdir(parents=True)
        sf.write(tmp_path / "aud" / "train" / c / "a.wav", np.zeros(320, np.float32), 16000)
    (tmp_path / "aud" / "train" / "no" / "bad.wav").write_bytes(b"RIFF0000WAVEjunk")
    ds = build_dataset("hf", root=tmp_path / "aud", split="train", format="audiofolder")
    # files in sorted order: no/a.wav, no/bad.wav, yes/a.wav
    assert len(ds) == 3 and ds[0]["modalities"]["audio"].shape == (320,)
    assert [ds[i]["labels"]["class"] for i in (0, 2)] == [0, 1]
    with pytest.raises(ValueError, match="bad.wav.*cannot read audio"):
        ds[1]


def test_empty_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).save_to_disk(
        str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="empty"):  # datasets itself fails with an IndexError here
        build_dataset("hf", root=tmp_path / "empty")
