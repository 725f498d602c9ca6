"""The Hugging Face Hub side of a saved encoder (mmviews.hub): which names are taken as Hub
repository ids rather than local paths, which of a repository's files are ever fetched (data
files only: no pickle, no Python module reaches the disk), the error for a repository that is
neither reachable nor cached, and what an upload sends. The network is never used: downloads
run offline against a cache folder of the test's, uploads go to recording stand-ins of
``HfApi``'s two network calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from mmviews import hub


@pytest.mark.parametrize("name", ["bert-base-uncased", "someone/tiny-mmviews", "org_1/model.v2", "a/b", "A9/x-y_z.1"])
def test_repo_ids_are_recognised(name: str) -> None:
    assert hub.is_repo_id(name)


@pytest.mark.parametrize("name", [
    "a..b", "someone/a..b", "../x", "someone/..", "x/../y",  # '..' anywhere: a path's parent
    "./x", "/abs/path", "runs/a/b", "x.", "x-", "someone/x.", "someone/x-", "", "-x", "_x", ".x", "someone/-x",
    "a b", "a/b c", "someone/", "/x",
])
def test_paths_and_invalid_names_are_not_repo_ids(name: str) -> None:
    assert not hub.is_repo_id(name)


# what a repository may hold: the encoder's data files, and files that must never be fetched
DATA_FILES = ["config.json", "mmviews_config.json", "model.safetensors", "text/vocab.txt", "text/merges.txt",
              "text/spiece.model", "text/tokenizer.json", "README.md"]
NEVER_FETCHED = ["pytorch_model.bin", "model.pt", "modeling_mmviews.py", "optimizer.pkl", "weights.ckpt",
                 "setup.sh", "text/custom_tokenizer.py", "flax_model.msgpack", "model.onnx"]


def _offline_snapshot(monkeypatch: pytest.MonkeyPatch, repo_id: str, revision: str | None,
                      cache: Path) -> tuple[Path | BaseException, list[dict[str, Any]]]:
    """``snapshot_folder`` run offline against ``cache``, with huggingface_hub's own
    ``snapshot_download`` recording the arguments it got."""
    calls: list[dict[str, Any]] = []
    real = huggingface_hub.snapshot_download

    def recording(repo: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo, **kwargs})
        return real(repo, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    try:
        return hub.snapshot_folder(repo_id, revision=revision, cache_dir=cache), calls
    except FileNotFoundError as error:
        return error, calls


def test_only_data_files_are_ever_fetched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The patterns snapshot_download is given, applied by huggingface_hub's own filter to a
    repository's listing, keep the data files and nothing else."""
    from test_export import fill_hub_cache

    source = tmp_path / "repo"
    source.mkdir()
    (source / "config.json").write_text("{}")
    snapshot = fill_hub_cache(tmp_path / "cache", "someone/tiny", source)
    folder, calls = _offline_snapshot(monkeypatch, "someone/tiny", None, tmp_path / "cache")
    assert folder == snapshot
    assert len(calls) == 1
    call = calls[0]
    assert call["repo_id"] == "someone/tiny" and call["revision"] is None and call["cache_dir"] == tmp_path / "cache"
    assert "ignore_patterns" not in call
    fetched = list(filter_repo_objects(DATA_FILES + NEVER_FETCHED, allow_patterns=call["allow_patterns"]))
    assert fetched == DATA_FILES
    assert hub.HUB_FILE_PATTERNS == ["*.json", "*.safetensors", "*.txt", "*.model", "README.md"]
    assert hub.MODEL_CARD_FILE == "README.md"


def test_a_revision_is_passed_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from test_export import fill_hub_cache

    source = tmp_path / "repo"
    source.mkdir()
    (source / "config.json").write_text("{}")
    revision = "fedcba9876543210fedcba9876543210fedcba98"
    snapshot = fill_hub_cache(tmp_path / "cache", "someone/tiny", source, revision=revision)
    folder, calls = _offline_snapshot(monkeypatch, "someone/tiny", revision, tmp_path / "cache")
    assert folder == snapshot and calls[0]["revision"] == revision
    assert isinstance(folder, Path)


def test_a_repository_neither_reachable_nor_cached_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    error, _ = _offline_snapshot(monkeypatch, "someone/not-cached", None, tmp_path / "cache")
    assert isinstance(error, FileNotFoundError)
    message = str(error)
    assert message.startswith("'someone/not-cached' is neither a local folder nor a Hub repository that can be "
                              "fetched or found in the cache (HF_HUB_OFFLINE, HF_HUB_CACHE): ")
    assert "\n" not in message  # the first line of huggingface_hub's error only
    assert message.endswith("): Cannot find an appropriate cached snapshot folder for the specified revision on the "
                            "local disk and outgoing traffic has been disabled. To enable repo look-ups and downloads "
                            "online, set 'HF_HUB_OFFLINE=0' as environment variable.")
    assert error.__cause__ is None and error.__suppress_context__


def test_an_invalid_repo_id_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    error, _ = _offline_snapshot(monkeypatch, "a/b/c", None, tmp_path / "cache")
    assert isinstance(error, FileNotFoundError) and str(error).startswith("'a/b/c' is neither a local folder")


def test_upload_creates_the_model_repository_and_uploads_the_folder_as_one_commit(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    calls: list[tuple[str, str | None, dict[str, Any]]] = []

    def create_repo(self: HfApi, repo_id: str, **kwargs: Any) -> None:
        calls.append(("create_repo", self.token, {"repo_id": repo_id, **kwargs}))

    def upload_folder(self: HfApi, **kwargs: Any) -> str:
        calls.append(("upload_folder", self.token, kwargs))
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    result = hub.upload_folder(tmp_path, "someone/tiny", commit_message="first", private=True, token="tok",
                               revision="dev")
    assert result == "commit-info"
    assert calls == [
        ("create_repo", "tok", {"repo_id": "someone/tiny", "repo_type": "model", "private": True, "exist_ok": True}),
        ("upload_folder", "tok", {"repo_id": "someone/tiny", "folder_path": str(tmp_path), "repo_type": "model",
                                  "commit_message": "first", "revision": "dev"}),
    ]


def test_fetch_guard_fails_when_code_is_fetched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mutations import apply_break

    apply_break("hub_fetches_code", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_only_data_files_are_ever_fetched(monkeypatch, tmp_path)
