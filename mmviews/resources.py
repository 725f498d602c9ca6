"""Where the files that ship with mmviews are: the recipes and the dataset cards.

The repository keeps them at its top level (``recipes/``, ``data_cards/``). An installed wheel
carries them inside the package, as ``mmviews/_resources/recipes`` and
``mmviews/_resources/data_cards`` (``setup.py`` maps the folders there at build time). An
editable install or a source checkout has no ``_resources`` folder and uses the checkout's
top-level folders. This module only answers "which folder"; it imports nothing of mmviews, so
any layer may use it (a leaf, like :mod:`mmviews.fileio`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = ["ResourceKind", "data_card", "resource_dir"]

ResourceKind = Literal["recipes", "data_cards"]

_PACKAGE_DIR = Path(__file__).resolve().parent
#: Inside an installed wheel: ``site-packages/mmviews/_resources/<kind>``.
PACKAGED_ROOT = _PACKAGE_DIR / "_resources"
#: A source checkout (editable install, or ``PYTHONPATH`` pointing at the repository).
CHECKOUT_ROOT = _PACKAGE_DIR.parent


def resource_dir(kind: ResourceKind) -> tuple[Path, str] | None:
    """``(folder, origin)`` of the shipped ``kind`` folder, ``origin`` being ``"packaged"``
    (the wheel's copy) or ``"checkout"`` (the repository's top-level folder); None when this
    installation has neither (e.g. a wheel built without them)."""
    if kind not in ("recipes", "data_cards"):
        raise ValueError(f"unknown resource kind {kind!r}; expected 'recipes' or 'data_cards'")
    packaged = PACKAGED_ROOT / kind
    if packaged.is_dir():
        return packaged, "packaged"
    # A checkout is recognised by its pyproject.toml beside the package, so that a stray
    # ``recipes`` folder next to site-packages is not mistaken for ours.
    checkout = CHECKOUT_ROOT / kind
    if checkout.is_dir() and (CHECKOUT_ROOT / "pyproject.toml").is_file():
        return checkout, "checkout"
    return None


def data_card(dataset: str) -> Path | None:
    """The card of ``dataset`` (``<data_cards>/<dataset>.md``: layout, splits, metrics,
    pitfalls), or None if there is none."""
    found = resource_dir("data_cards")
    if found is None:
        return None
    path = found[0] / f"{dataset}.md"
    return path if path.is_file() else None
