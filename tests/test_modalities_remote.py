"""Where an adapter's model may come from (``mmviews.modalities.remote``): names that pull a model's
code-free configuration and weights from outside the recipe (``hf-hub:``, ``local-dir:``) are
refused, naming the key, unless ``allow_remote_models`` is in effect, which is scoped to its block
(restored on leaving it, also by an error, and nestable); a name that looks like a local path but
does not exist is told apart from a hub id before any download."""

from __future__ import annotations

import pytest

from mmviews.modalities.remote import allow_remote_models, check_local_or_hub, check_model_folder, check_model_source

REFUSAL = ("{key}={name!r} loads a model configuration and weights from outside the recipe; refused unless asked "
           "for on the command line (--allow-remote-models)")


@pytest.mark.parametrize("name", ["hf-hub:org/model", "local-dir:/models/x"])
def test_an_external_model_name_is_refused_unless_allowed(name):
    with pytest.raises(ValueError) as caught:
        check_model_source(name, "adapters.image.model")
    assert str(caught.value) == REFUSAL.format(key="adapters.image.model", name=name)
    with allow_remote_models():
        check_model_source(name, "adapters.image.model")
    with pytest.raises(ValueError):
        check_model_source(name, "adapters.image.model")  # the permission ended with the block


@pytest.mark.parametrize("name", ["ViT-B-32", "org/hf-hub:x", "hf-hub", "local-dir"])
def test_other_names_need_no_permission(name):
    check_model_source(name, "model")


def test_the_permission_nests_restores_and_can_be_withheld():
    with allow_remote_models():
        with allow_remote_models(False):
            with pytest.raises(ValueError):
                check_model_source("hf-hub:a/b", "model")
        check_model_source("hf-hub:a/b", "model")  # the outer block's permission is back
        with allow_remote_models(1):  # truthy values count as allowed
            check_model_source("hf-hub:a/b", "model")
        check_model_source("hf-hub:a/b", "model")
    with pytest.raises(RuntimeError), allow_remote_models():
        raise RuntimeError("a failure inside the block")
    with pytest.raises(ValueError):
        check_model_source("hf-hub:a/b", "model")  # restored by the error too


@pytest.mark.parametrize("name", ["./missing", "../missing", "~/missing_mmviews_model", "a/b/c", ".hidden"])
def test_a_missing_local_looking_path_is_named(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as caught:
        check_local_or_hub(name, "text model")
    assert str(caught.value) == f"text model: local path {name!r} does not exist"


def test_an_absolute_missing_path_is_named_and_existing_paths_and_hub_ids_pass(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"^text model: local path '.*nowhere' does not exist$"):
        check_local_or_hub(str(tmp_path / "nowhere"), "text model")
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (str(tmp_path / "a"), "./a", "a/b", "~/a", "~"):
        check_local_or_hub(name, "text model")
    for hub_id in ("bert-base-uncased", "org/name", "missing_single_name"):
        check_local_or_hub(hub_id, "text model")  # a hub id (one '/' at most): looked up on the hub later


def test_a_model_folder_must_hold_its_config_json(tmp_path, monkeypatch):
    """An existing folder without config.json is named (after the user's ``~`` is expanded);
    one with it, a hub id, and a missing path (the local-or-hub check's error) behave as
    :func:`check_local_or_hub` says."""
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    for name in (str(model), "~/model"):
        with pytest.raises(FileNotFoundError) as caught:
            check_model_folder(name, "audio model")
        assert str(caught.value) == (f"audio model: local folder {name!r} has no config.json (a transformers "
                                     "checkpoint folder holds the model's config.json beside its weights)")
    (model / "config.json").mkdir()  # a folder of that name is not the file
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_folder(str(model), "audio model")
    (model / "config.json").rmdir()
    (model / "config.json").write_text("{}")
    check_model_folder(str(model), "audio model")
    check_model_folder("~/model", "audio model")
    check_model_folder("org/name", "audio model")  # a hub id: nothing local to check
    (tmp_path / "file.bin").write_text("x")
    check_model_folder(str(tmp_path / "file.bin"), "audio model")  # a file is not a folder: transformers decides
    with pytest.raises(FileNotFoundError, match=r"^audio model: local path '.*nowhere' does not exist$"):
        check_model_folder(str(tmp_path / "nowhere"), "audio model")
