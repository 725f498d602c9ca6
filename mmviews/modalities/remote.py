"""Where an adapter's model may come from: the remote-model policy and the check of local paths.

A recipe or a saved encoder names its backbones; names that pull a model's architecture and
weights from outside the recipe (open_clip's ``hf-hub:`` and ``local-dir:``) are refused unless
the command line allowed them for the process (``--allow-remote-models``), and a name that looks
like a missing local folder is told apart from a hub id before any download is tried.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

# Model names whose architecture and weights come from outside the recipe (open_clip's
# "hf-hub:ORG/NAME" and "local-dir:PATH"): refused unless the user allowed them for this
# process (``--allow-remote-models``), since a saved encoder's or a recipe's config must not
# be able to pull them in on its own.
EXTERNAL_MODEL_PREFIXES = ("hf-hub:", "local-dir:")
_external_models_allowed = False


@contextlib.contextmanager
def allow_remote_models(allowed: bool = True) -> Iterator[None]:
    """Within the block, adapters may build models named ``hf-hub:...`` / ``local-dir:...``
    (the command line's ``--allow-remote-models``)."""
    global _external_models_allowed
    previous, _external_models_allowed = _external_models_allowed, bool(allowed)
    try:
        yield
    finally:
        _external_models_allowed = previous


def check_model_source(name: str, key: str) -> None:
    """Raise ``ValueError`` naming ``key`` when ``name`` is an external model name and
    :func:`allow_remote_models` is not in effect."""
    if name.startswith(EXTERNAL_MODEL_PREFIXES) and not _external_models_allowed:
        raise ValueError(f"{key}={name!r} loads a model configuration and weights from outside the recipe; "
                         "refused unless asked for on the command line (--allow-remote-models)")


def check_local_or_hub(name: str, what: str) -> None:
    """Raise FileNotFoundError when ``name`` looks like a filesystem path that does not
    exist (absolute, ``./``, ``../``, ``~``, or more than one ``/``, which no hub id has).
    Other strings are hub ids (``org/name``)."""
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(f"{what}: local path {name!r} does not exist")


def check_model_folder(name: str, what: str) -> None:
    """:func:`check_local_or_hub` for a transformers model, and when ``name`` is an existing
    folder, that it holds the model's ``config.json`` (else transformers answers "Unrecognized
    model", which does not say what is missing). ``what`` names the model in the error."""
    check_local_or_hub(name, what)
    folder = os.path.expanduser(name)
    if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{what}: local folder {name!r} has no config.json (a transformers checkpoint folder "
                                "holds the model's config.json beside its weights)")
