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


def test_the_objectives_learned_values_round_trip_through_encoder_json(tmp_path: Path) -> None:
    """The training objective's learned values (a run's temperature, siglip's bias) are written
    into encoder.json as saved and read back as they were; an encoder without them writes no
    entry and loads with none."""
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}})
    assert encoder.objective_info is None
    plain = encoder.save_pretrained(tmp_path / "plain")
    assert "objective" not in json.loads((plain / ENCODER_CONFIG).read_text())
    assert MultiViewEncoder.from_pretrained(plain).objective_info is None
    info = {"name": "siglip", "temperature": 0.0731, "bias": -9.5, "steps": 3}
    encoder.objective_info = info
    folder = encoder.save_pretrained(tmp_path / "learned")
    assert json.loads((folder / ENCODER_CONFIG).read_text()) == {"modalities": ["image"], "objective": info}
    loaded = MultiViewEncoder.from_pretrained(folder).objective_info
    assert loaded == info and loaded is not info


@pytest.mark.parametrize(
    ("entry", "complaint"),
    [
        ({"temperature": 0.1}, "'objective' must be an object with a string 'name', got {'temperature': 0.1}"),
        ({"name": 3, "temperature": 0.1}, "'objective' must be an object with a string 'name', got {'name': 3, 'temperature': 0.1}"),
        ("siglip", "'objective' must be an object with a string 'name', got 'siglip'"),
        ([{"name": "siglip"}], "'objective' must be an object with a string 'name', got [{'name': 'siglip'}]"),
        ({"name": "siglip", "temperature": "0.1"}, "'objective.temperature' must be a finite number, got '0.1'"),
        ({"name": "siglip", "bias": True}, "'objective.bias' must be a finite number, got True"),
        ({"name": "siglip", "bias": None}, "'objective.bias' must be a finite number, got None"),
        ({"name": "mv_dhel", "temperature": float("nan")}, "'objective.temperature' must be a finite number, got nan"),
        ({"name": "mv_dhel", "temperature": float("inf")}, "'objective.temperature' must be a finite number, got inf"),
        ({"name": "mv_dhel", "temperature": -float("inf")}, "'objective.temperature' must be a finite number, got -inf"),
    ],
)
def test_a_malformed_objective_entry_is_named_with_its_key(saved_encoder: Path, entry: object, complaint: str) -> None:
    """encoder.json's ``objective`` entry is checked on loading: a one-line error naming the
    file and the key, never a non-number carried into a user's model (a NaN temperature)."""
    config_path = saved_encoder / ENCODER_CONFIG
    config_path.write_text(json.dumps({"modalities": ["image"], "objective": entry}))
    with pytest.raises(ValueError) as raised:
        MultiViewEncoder.from_pretrained(saved_encoder)
    assert str(raised.value) == f"{config_path}: {complaint}"


def test_integer_and_negative_learned_values_are_numbers(saved_encoder: Path) -> None:
    config_path = saved_encoder / ENCODER_CONFIG
    config_path.write_text(json.dumps({"modalities": ["image"], "objective": {"name": "siglip", "temperature": 1,
                                                                              "bias": -10}}))
    assert MultiViewEncoder.from_pretrained(saved_encoder).objective_info == {"name": "siglip", "temperature": 1,
                                                                               "bias": -10}


def test_save_pretrained_makes_missing_parent_folders_and_saves_again_over_its_own_folder(tmp_path: Path) -> None:
    """A new nested folder is made with its parents; saving again into the same folder (a later
    checkpoint's export) replaces the saved encoder instead of failing."""
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}})
    folder = encoder.save_pretrained(tmp_path / "a" / "b" / "encoder")
    assert folder == tmp_path / "a" / "b" / "encoder" and (folder / ENCODER_CONFIG).is_file()
    encoder.objective_info = {"name": "mv_dhel", "temperature": 0.25}
    assert encoder.save_pretrained(folder) == folder
    assert MultiViewEncoder.from_pretrained(folder).objective_info == {"name": "mv_dhel", "temperature": 0.25}


def test_encoder_json_is_written_readable(tmp_path: Path) -> None:
    """Two-space indented JSON (a file people open), the modalities in the adapters' order."""
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn"),
                                                                           "flow": tiny_config("flow_cnn")}})
    encoder.objective_info = {"name": "mv_dhel", "temperature": 0.25}
    folder = encoder.save_pretrained(tmp_path / "encoder")
    expected = {"modalities": ["image", "flow"], "objective": {"name": "mv_dhel", "temperature": 0.25}}
    assert (folder / ENCODER_CONFIG).read_text() == json.dumps(expected, indent=2)


def test_a_top_level_that_is_no_object_is_named_with_what_was_expected(saved_encoder: Path) -> None:
    config_path = saved_encoder / ENCODER_CONFIG
    config_path.write_text('["image"]')
    with pytest.raises(ValueError) as raised:
        MultiViewEncoder.from_pretrained(saved_encoder)
    assert str(raised.value) == f"{config_path}: expected a JSON object, got list (expected an object with key 'modalities')"


def test_an_encoder_needs_an_adapter_and_starts_without_a_device_flow() -> None:
    with pytest.raises(ValueError) as raised:
        MultiViewEncoder({})
    assert str(raised.value) == "MultiViewEncoder needs at least one adapter"
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}})
    assert encoder.device_flow is None and encoder.objective_info is None


def _hub_cache(cache: Path, repo_id: str, snapshots: dict[str, Path], main: str) -> None:
    """huggingface_hub's cache layout: snapshots/<revision>/ per revision, refs/main naming ``main``."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for revision, folder in snapshots.items():
        shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)


def test_a_hub_repo_id_loads_from_the_given_cache_at_the_given_revision(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, from a cache holding two revisions of one repository: ``revision`` picks the
    snapshot, else the one ``main`` names; ``cache_dir`` is the cache read. An existing local
    folder whose path looks like a repository id is the folder, never a Hub look-up."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    encoder = MultiViewEncoder.from_config({"embed_dim": 8, "modalities": {"image": tiny_config("small_cnn")}})
    encoder.objective_info = {"name": "mv_dhel", "temperature": 0.5}
    old = encoder.save_pretrained(tmp_path / "old")
    encoder.objective_info = {"name": "mv_dhel", "temperature": 0.25}
    new = encoder.save_pretrained(tmp_path / "new")
    first, second = "1" * 40, "2" * 40
    cache = tmp_path / "cache"
    _hub_cache(cache, "someone/tiny", {first: old, second: new}, main=second)
    at_main = MultiViewEncoder.from_pretrained("someone/tiny", cache_dir=cache)
    assert at_main.objective_info == {"name": "mv_dhel", "temperature": 0.25} and list(at_main.adapters) == ["image"]
    pinned = MultiViewEncoder.from_pretrained("someone/tiny", revision=first, cache_dir=cache)
    assert pinned.objective_info == {"name": "mv_dhel", "temperature": 0.5}
    with pytest.raises(FileNotFoundError, match="'someone/tiny' is neither a local folder nor a Hub repository"):
        MultiViewEncoder.from_pretrained("someone/tiny", cache_dir=tmp_path / "empty-cache")
    monkeypatch.chdir(tmp_path)
    encoder.objective_info = {"name": "mv_dhel", "temperature": 0.125}
    encoder.save_pretrained(tmp_path / "someone" / "tiny")
    local = MultiViewEncoder.from_pretrained("someone/tiny", cache_dir=cache)
    assert local.objective_info == {"name": "mv_dhel", "temperature": 0.125}
