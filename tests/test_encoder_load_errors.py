"""``MultiViewEncoder.from_pretrained`` names ``encoder.json`` by its full path when that file is
missing, not JSON, or not the shape ``save_pretrained`` writes."""

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
