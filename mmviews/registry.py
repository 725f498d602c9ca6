"""One small name registry, used for objectives, augmentations, datasets and adapters.

A :class:`Registry` maps a name to an object (a class or a factory function) and a one-line
description. Registering a name twice is an error (two modules claiming one name is a bug,
not an override); looking up an unknown name raises a ``ValueError`` that lists the known
names, so a typo in a recipe is a one-line fix::

    AUGMENTATIONS = Registry("augmentation")

    @AUGMENTATIONS.register("hflip", "horizontal flip with probability p")
    def hflip(p: float = 0.5): ...

    AUGMENTATIONS.get("hflip")        # the function
    AUGMENTATIONS.names()             # ["hflip", ...], sorted
    AUGMENTATIONS.descriptions()      # {"hflip": "horizontal flip with probability p", ...}

Modules own their registry and expose functions over it (``get_objective``,
``list_datasets``...); nothing outside a registry's module reaches into its entries.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'X'?)"`` for the choice closest to a mistyped ``word`` (difflib), or ``""``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Registry(Generic[T]):
    """Names -> objects of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, tuple[T, str]] = {}

    def add(self, name: str, obj: T, description: str = "") -> T:
        """Register ``obj`` as ``name``; a name already taken raises ``ValueError``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        if not description:
            doc = (getattr(obj, "__doc__", None) or "").strip()
            description = doc.splitlines()[0].strip() if doc else ""
        self._entries[name] = (obj, description)
        return obj

    def register(self, name: str, description: str = "") -> Callable[[T], T]:
        """Decorator form of :meth:`add`. Without a description the first line of the
        object's docstring is used."""

        def wrap(obj: T) -> T:
            return self.add(name, obj, description)

        return wrap

    def get(self, name: str) -> T:
        """The object registered as ``name``; an unknown name raises ``ValueError`` listing the known ones."""
        try:
            return self._entries[name][0]
        except (KeyError, TypeError):
            known = ", ".join(self.names()) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; known: {known}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def descriptions(self) -> dict[str, str]:
        """``{name: one-line description}``, sorted by name."""
        return {name: self._entries[name][1] for name in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
