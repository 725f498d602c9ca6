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


# What users depend on beyond the happy paths: every refusal names the folder, the split or the
# column and the option at fault (``error.option``: the recipe key the CLI names); the column
# kinds (what ``prepare`` writes into the shards' manifest and the collator reads); the labels.


def test_split_defaults_to_train_and_a_missing_folder_or_a_file_is_named(disk_dataset, tmp_path):
    from mmviews.data.hf import HFDataset

    assert len(HFDataset(disk_dataset, columns={"text": "sentence"})) == 3  # the DatasetDict's "train"
    with pytest.raises(FileNotFoundError) as info:
        HFDataset(tmp_path / "nowhere")
    assert str(info.value) == f"no such dataset folder: {tmp_path / 'nowhere'}"
    (tmp_path / "data.arrow").write_bytes(b"x")
    with pytest.raises(ValueError) as info:
        HFDataset(tmp_path / "data.arrow")
    assert str(info.value) == (f"{tmp_path / 'data.arrow'} is a file (.arrow), not a folder: this dataset reads a save_to_disk "
                               "folder, an image or audio folder, or a folder of Parquet shards; give the folder that holds "
                               "the data") and info.value.option == "root"


def test_wrong_options_are_refused_naming_the_option(disk_dataset):
    from mmviews.data.hf import HFDataset

    with pytest.raises(ValueError) as info:
        HFDataset(disk_dataset, on_error="ignore")
    assert str(info.value) == "on_error must be 'raise' or 'skip', got 'ignore'" and info.value.option == "on_error"
    with pytest.raises(ValueError) as info:
        HFDataset(disk_dataset, format="csv")
    assert str(info.value) == "format must be auto, disk, imagefolder or audiofolder, got 'csv'"
    assert info.value.option == "format"


def test_no_modality_column_is_refused_listing_the_columns(tmp_path):
    import datasets

    from mmviews.data.hf import HFDataset

    datasets.Dataset.from_dict({"words": ["a"], "label": [0]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError) as info:
        HFDataset(tmp_path / "ds")
    assert str(info.value) == (f"{tmp_path / 'ds'}: no modality columns (no column is named image, audio or text): name the "
                               "columns to read, modality -> column (columns: ['label', 'words'])")
    assert info.value.option == "columns"


def test_an_unreadable_save_and_an_empty_split_are_named(tmp_path):
    import datasets

    from mmviews.data.hf import HFDataset

    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})).save_to_disk(
        str(tmp_path / "empty"))
    with pytest.raises(ValueError) as info:
        HFDataset(tmp_path / "empty")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'empty'}: cannot load the saved dataset (IndexError: ")
    assert message.endswith("; it may be empty or incompletely written")
    # a split folder without a file (the audio folder's own listing; datasets refuses to save an empty split)
    (tmp_path / "aud" / "train").mkdir(parents=True)
    (tmp_path / "aud" / "test" / "x").mkdir(parents=True)
    sf.write(tmp_path / "aud" / "test" / "x" / "a.wav", np.zeros(16, np.float32), 16000)
    with pytest.raises(ValueError) as info:
        HFDataset(tmp_path / "aud", split="train", format="audiofolder")
    assert str(info.value) == f"{tmp_path / 'aud'}: split 'train' is empty" and info.value.option == "split"
    assert len(HFDataset(tmp_path / "aud", split="test", format="audiofolder")) == 1  # one file is not empty


def test_an_image_folders_missing_split_is_named_with_those_there(tmp_path):
    from mmviews.data.hf import HFDataset

    for split in ("train", "valid"):
        (tmp_path / "img" / split / "cat").mkdir(parents=True)
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "img" / split / "cat" / "a.png")
    with pytest.raises(KeyError) as info:
        HFDataset(tmp_path / "img", split="test", format="imagefolder")
    assert info.value.args[0] == f"{tmp_path / 'img'}: no split 'test'; available: ['train', 'validation']"
    assert info.value.option == "split"
    with pytest.raises(KeyError) as info:
        HFDataset(tmp_path / "img", split="valid", format="imagefolder")
    assert info.value.args[0] == (f"{tmp_path / 'img'}: no split 'valid'; available: ['train', 'validation']; datasets "
                                  "names the folder valid/ split 'validation': ask for split 'validation' "
                                  "(e.g. --set data.val_split=validation)")


def test_an_audio_folder_is_found_by_its_files_whatever_the_case_of_their_suffix(tmp_path):
    from mmviews.data.hf import HFDataset

    for c in ("no", "yes"):
        (tmp_path / "aud" / "train" / c).mkdir(parents=True)
    sf.write(tmp_path / "aud" / "train" / "no" / "a.WAV", np.zeros(320, np.float32), 16000, format="WAV")
    sf.write(tmp_path / "aud" / "train" / "yes" / "b.wav", np.ones(160, np.float32) * 0.5, 16000)
    ds = HFDataset(tmp_path / "aud")  # format "auto"
    assert ds.kinds == {"audio": "waveform"} and len(ds) == 2
    assert [ds[i]["labels"]["class"] for i in range(2)] == [0, 1]
    assert ds[1]["modalities"]["audio"].shape == (160,)
    upper = tmp_path / "upper" / "train" / "x"
    upper.mkdir(parents=True)
    sf.write(upper / "a.FLAC", np.zeros(80, np.float32), 16000, format="FLAC")
    assert HFDataset(tmp_path / "upper").kinds == {"audio": "waveform"}  # an upper-case suffix alone is audio too


def test_column_kinds_labels_and_sizes(tmp_path):
    """Each column's kind (what ``prepare`` records for the shards and the collator batches), the
    default columns, ``image_size`` and ``sample_rate`` as given, labels of any type kept as they are."""
    import datasets

    from mmviews.data.hf import HFDataset

    feats = datasets.Features({
        "image": datasets.Image(), "text": datasets.Value("string"), "audio": datasets.Value("string"),
        "speech": datasets.Value("binary"), "big_speech": datasets.Value("large_binary"), "words": datasets.Value("large_string"),
        "vec": datasets.List(datasets.Value("float32")), "label": datasets.ClassLabel(names=["a", "b"]),
        "name": datasets.Value("string"), "count": datasets.Value("int64"), "score": datasets.Value("float32")})
    (tmp_path / "a.wav").parent.mkdir(exist_ok=True)
    sf.write(tmp_path / "a.wav", np.zeros(100, np.float32), 8000)
    rows = {"image": [{"bytes": png_bytes(30), "path": None}] * 2, "text": ["hi", "ho"], "audio": [str(tmp_path / "a.wav")] * 2,
            "speech": [wav_bytes(50)] * 2, "big_speech": [wav_bytes(60)] * 2, "words": ["x", "y"],
            "vec": [[1.0, 2.0], [3.0, 4.0]], "label": [1, 0], "name": ["p", "q"], "count": [3, 4], "score": [0.5, -1.5]}
    datasets.Dataset.from_dict(rows, features=feats).save_to_disk(str(tmp_path / "ds"))
    ds = HFDataset(tmp_path / "ds")
    assert ds.columns == {"image": "image", "audio": "audio", "text": "text"}  # the defaults
    assert ds.label_columns == {"class": "label"} and ds.label_note is None
    assert ds.kinds == {"image": "image", "audio": "waveform", "text": "text"}
    assert ds.modality_info() == {"image": {"kind": "image"}, "audio": {"kind": "waveform", "shape": (None,), "sample_rate": 16000},
                                  "text": {"kind": "text"}}
    assert ds.image_size is None and ds[0]["modalities"]["image"].shape == (3, 6, 6)  # its own size
    assert ds[0]["modalities"]["audio"].shape == (200,)  # 100 samples at 8 kHz, resampled to 16 kHz
    columns = {"speech": "speech", "big": "big_speech", "words": "words", "vec": "vec", "caption": "text", "image": "image"}
    labels = {"name": "name", "count": "count", "score": "score"}
    ds = HFDataset(tmp_path / "ds", columns=columns, labels=labels, image_size=(4, 2), sample_rate=8000)
    assert ds.kinds == {"speech": "waveform", "big": "waveform", "words": "text", "vec": "array", "caption": "text",
                        "image": "image"}
    assert ds.columns == columns and ds.label_columns == labels and ds.sample_rate == 8000
    assert ds.modality_info()["speech"] == {"kind": "waveform", "shape": (None,), "sample_rate": 8000}
    assert ds.modality_info()["image"] == {"kind": "image", "shape": (3, 4, 2)}
    x = ds[1]
    assert x["modalities"]["speech"].shape == (50,) and x["modalities"]["big"].shape == (60,)
    assert x["modalities"]["words"] == "y" and x["modalities"]["image"].shape == (3, 4, 2)
    assert torch.equal(x["modalities"]["vec"], torch.tensor([3.0, 4.0]))
    assert x["labels"] == {"name": "q", "count": 4, "score": -1.5}
    assert HFDataset(tmp_path / "ds", columns={"image": "image"}, image_size=5).image_size == (5, 5)


def test_an_audio_feature_column_is_decoded_by_mmviews(tmp_path):
    """A ``datasets.Audio`` column is read with datasets' decoding off (it needs torchcodec,
    which mmviews does not require) and decoded by soundfile."""
    import datasets

    raw = datasets.Dataset.from_dict({"sound": [{"bytes": wav_bytes(80), "path": None}], "text": ["hi"]})
    raw.cast_column("sound", datasets.Audio()).save_to_disk(str(tmp_path / "ds"))
    from mmviews.data.hf import HFDataset

    ds = HFDataset(tmp_path / "ds", columns={"voice": "sound", "text": "text"}, sample_rate=8000)
    assert ds.kinds == {"voice": "waveform", "text": "text"}
    assert torch.allclose(ds[0]["modalities"]["voice"], torch.linspace(-0.5, 0.5, 80), atol=1e-4)


def test_a_non_finite_float_label_is_refused_naming_its_row_and_count(tmp_path):
    import datasets

    from mmviews.data.hf import HFDataset

    feats = datasets.Features({"text": datasets.Value("string"), "y": datasets.Value("float32"), "z": datasets.Value("float64")})
    datasets.Dataset.from_dict({"text": ["a", "b", "c"], "y": [0.5, 1.0, -2.0], "z": [0.0, float("nan"), float("-inf")]},
                               features=feats).save_to_disk(str(tmp_path / "ds"))
    ds = HFDataset(tmp_path / "ds", labels={"target": "y"})
    assert [ds[i]["labels"]["target"] for i in range(3)] == [0.5, 1.0, -2.0]
    with pytest.raises(ValueError) as info:
        HFDataset(tmp_path / "ds", labels={"target": "y", "other": "z"})
    assert str(info.value) == (f"{tmp_path / 'ds'} [split 'train']: label 'other' (column 'z') is not finite (nan) at row 1; "
                               "2 of 3 labels are non-finite: fix or drop those rows")
    # a missing value (None) of a float label column is refused as not finite, naming its row
    datasets.Dataset.from_dict({"text": ["a", "b"], "y": [0.5, None]}, features=datasets.Features(
        {"text": datasets.Value("string"), "y": datasets.Value("float32")})).save_to_disk(str(tmp_path / "gap"))
    with pytest.raises(ValueError) as info:
        HFDataset(tmp_path / "gap", labels={"target": "y"})
    assert str(info.value) == (f"{tmp_path / 'gap'} [split 'train']: label 'target' (column 'y') is not finite (nan) at "
                               "row 1; 1 of 2 labels are non-finite: fix or drop those rows")
