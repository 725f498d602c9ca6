"""``MultiViewEncoder.from_pretrained`` names ``encoder.json`` by its full path when that file is
missing, not JSON, or not the shape ``save_pretrained`` writes; the other JSON files read from a
user's folder (a sentiment store's ``meta.json``, ``metrics.json`` for ``mmviews compare``, a
video store's ``clip.json``) name themselves the same way (``mmviews.fileio.read_json_object``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmviews.modalities import MultiViewEncoder
from mmviews.modalities.multiview import ENCODER_CONFIG
from mmviews.modalities.presets import tiny_config


@pytest.fixture
def saved_encoder(tmp_path: Path) -> Path:
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}})
    return encoder.save_pretrained(tmp_path / "encoder")


def test_the_saved_folder_loads(saved_encoder: Path) -> None:
    assert list(MultiViewEncoder.from_pretrained(saved_encoder).adapters) == ["image"]


def test_missing_encoder_json_is_named_by_its_path(saved_encoder: Path) -> None:
    config_path = saved_encoder / ENCODER_CONFIG
    config_path.unlink()
    with pytest.raises(FileNotFoundError) as raised:
        MultiViewEncoder.from_pretrained(saved_encoder)
    assert str(config_path) in str(raised.value)


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ('{"modalities": ["image"', "not valid JSON"),  # truncated write
        ("\xff\xfe not text", "not valid JSON"),
        ('["image"]', "expected a JSON object"),
        ('{"adapters": ["image"]}', "missing key 'modalities'"),
        ('{"modalities": "image"}', "non-empty list of modality names"),
        ('{"modalities": []}', "non-empty list of modality names"),
        ('{"modalities": ["../image"]}', "single sub-folder name"),  # would load from outside the folder
        ('{"modalities": ["/tmp"]}', "single sub-folder name"),
        ('{"modalities": [".."]}', "single sub-folder name"),
    ],
)
def test_malformed_encoder_json_is_named_by_its_path(saved_encoder: Path, content: str, complaint: str) -> None:
    config_path = saved_encoder / ENCODER_CONFIG
    config_path.write_bytes(content.encode("latin-1"))
    with pytest.raises(ValueError, match=complaint) as raised:
        MultiViewEncoder.from_pretrained(saved_encoder)
    assert str(config_path) in str(raised.value)


def test_a_modality_name_never_reaches_outside_the_folder(tmp_path: Path) -> None:
    """An adapter saved beside the encoder folder is not loaded through a crafted name."""
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}})
    saved = encoder.save_pretrained(tmp_path / "encoder")
    encoder.adapters["image"].save_pretrained(tmp_path / "outside")
    (saved / ENCODER_CONFIG).write_text(json.dumps({"modalities": ["../outside"]}))
    with pytest.raises(ValueError, match="single sub-folder name"):
        MultiViewEncoder.from_pretrained(saved)


# ---- other JSON files read from a user's folder name themselves when they are corrupt ---------
def test_corrupt_sentiment_store_meta_is_named(tmp_path: Path) -> None:
    from mmviews.data.sentiment import read_store_meta

    meta = tmp_path / "store" / "meta.json"
    meta.parent.mkdir()
    meta.write_text('{"format": ')
    with pytest.raises(ValueError, match="not valid JSON") as raised:
        read_store_meta(meta.parent)
    assert str(meta) in str(raised.value)
    meta.write_text('["not", "an", "object"]')  # used to be an AttributeError deep in the reader
    with pytest.raises(ValueError, match="expected a JSON object") as raised:
        read_store_meta(meta.parent)
    assert str(meta) in str(raised.value)


def test_corrupt_metrics_json_in_compare_is_named(tmp_path: Path) -> None:
    from mmviews.eval.compare import load_run_metrics

    metrics = tmp_path / "run" / "eval" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_bytes(b"\xff\xfe{")  # not UTF-8: used to escape as a UnicodeDecodeError
    with pytest.raises(ValueError, match="not valid JSON") as raised:
        load_run_metrics(tmp_path / "run")
    assert str(metrics) in str(raised.value)


def test_corrupt_clip_entry_of_a_video_store_is_named_and_nothing_deleted(tmp_path: Path) -> None:
    from mmviews.data.video_store import CLIP_ENTRY, CLIPS_DIR, MANIFEST, STORE_KIND, clear_video_store

    store = tmp_path / "store"
    clip = store / CLIPS_DIR / "class_a" / "clip_0"
    clip.mkdir(parents=True)
    (clip / "frame_0.jpg").write_bytes(b"jpeg")
    (clip / CLIP_ENTRY).write_text('{"frames": 1,')
    (store / MANIFEST).write_text(json.dumps({"kind": STORE_KIND, "clips": {}}))
    with pytest.raises(ValueError, match="not valid JSON") as raised:
        clear_video_store(store)
    assert str(clip / CLIP_ENTRY) in str(raised.value)
    assert (clip / "frame_0.jpg").is_file() and (store / MANIFEST).is_file()
