"""The Hugging Face Hub side of a saved :class:`~mmviews.modalities.MultiViewEncoder`: fetching
a repository's files through ``huggingface_hub``'s cache, and uploading a folder.

Only data files are fetched (:data:`HUB_FILE_PATTERNS`: JSON configs, safetensors weights,
tokenizer vocabularies, the model card): a repository's Python files or pickles never reach the
disk, and loading reads JSON and safetensors alone, so nothing in a repository runs.
``huggingface_hub`` decides where the cache is (``HF_HUB_CACHE``, ``HF_HOME``) and whether the
network is used: with ``HF_HUB_OFFLINE=1`` a repository already in the cache loads without
a connection, and one that is not is an error naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

__all__ = ["HUB_FILE_PATTERNS", "MODEL_CARD_FILE", "is_repo_id", "snapshot_folder", "upload_folder"]

#: The model card of an encoder folder (what the Hub shows as the repository's page).
MODEL_CARD_FILE = "README.md"
#: What a saved encoder is made of: configs, weights, tokenizer and feature-extractor files
#: (``vocab.txt``, ``merges.txt``, sentencepiece ``*.model``), the model card.
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", MODEL_CARD_FILE]

# "name" or "owner/name": letters, digits, '-', '_', '.' (the Hub's rule), no '..' and no path start.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def is_repo_id(name: str) -> bool:
    """Whether ``name`` can be a Hub repository id (``owner/name``) rather than a local path."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def snapshot_folder(repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local folder of ``repo_id`` at ``revision`` (default: ``main``) in the Hub cache,
    downloaded first unless offline (only :data:`HUB_FILE_PATTERNS`). Raises ``FileNotFoundError``
    naming the repository when it is neither reachable nor cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=HUB_FILE_PATTERNS)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError) as error:
        raise FileNotFoundError(f"{repo_id!r} is neither a local folder nor a Hub repository that can be fetched or "
                                f"found in the cache (HF_HUB_OFFLINE, HF_HUB_CACHE): "
                                f"{str(error).splitlines()[0]}") from None
    return Path(folder)


def upload_folder(folder: str | os.PathLike[str], repo_id: str, *, commit_message: str, private: bool | None = None,
                  token: str | None = None, revision: str | None = None) -> Any:
    """Create ``repo_id`` (a model repository) if needed and upload ``folder`` to it as one
    commit, with ``huggingface_hub.HfApi``; returns the commit's information."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                             commit_message=commit_message, revision=revision)
