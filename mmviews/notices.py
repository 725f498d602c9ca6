"""Warnings mmviews gives about the user's data, recipe or run, and how the command line shows them.

Every warning mmviews raises for the user to act on is a :class:`MMViewsWarning` (or a subclass),
so that callers can filter them as one family (``warnings.filterwarnings("error",
category=MMViewsWarning)`` in a test, for example). The ``mmviews`` command shows them as one
line, ``mmviews COMMAND: warning: MESSAGE``: the message names the file, key or value at fault,
and mmviews's own source file and line would only be noise (:func:`one_line_warnings`).
Python callers see ordinary warnings.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Iterator

__all__ = ["MMViewsRuntimeWarning", "MMViewsWarning", "one_line_warnings", "print_warning"]


class MMViewsWarning(UserWarning):
    """A warning about the user's data, recipe or run that they may have to act on."""


class MMViewsRuntimeWarning(MMViewsWarning, RuntimeWarning):
    """An :class:`MMViewsWarning` about a computed value (e.g. a metric that is undefined)."""


# Third-party warnings that say nothing a user of mmviews can act on.
_THIRD_PARTY_NOISE = (
    # mmviews asks DDP for find_unused_parameters on purpose (a view's modality may be absent
    # from a whole batch); torch notes once per process when a step happened to use them all
    # (in C++ on current torch: mmviews.cli silences that through TORCH_CPP_LOG_LEVEL).
    r"find_unused_parameters=True was specified in DDP constructor",
)


def warning_line(prefix: str, message: str) -> str:
    """``PREFIX: warning: MESSAGE``, whitespace folded: the one line a warning of the command
    ``prefix`` (``mmviews train``) takes on its standard error."""
    return f"{prefix}: warning: {' '.join(str(message).split())}"


def print_warning(prefix: str, message: str) -> None:
    """Print :func:`warning_line` to standard error (a command's warnings that it gives itself,
    e.g. the health checks' verdicts at the end of ``mmviews train``)."""
    print(warning_line(prefix, message), file=sys.stderr, flush=True)


@contextlib.contextmanager
def one_line_warnings(prefix: str) -> Iterator[None]:
    """Within the block, format :class:`MMViewsWarning` s as ``PREFIX: warning: MESSAGE`` (one
    line, whitespace folded), and silence the known third-party warnings that need no action.
    Other warnings look as Python shows them. Only the formatting changes (``formatwarning``), so a
    caller that records warnings (``catch_warnings(record=True)``, ``pytest.warns``) still gets
    them. The previous behaviour comes back at the end."""
    previous = warnings.formatwarning

    def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                       line: str | None = None) -> str:
        if issubclass(category, MMViewsWarning):
            return warning_line(prefix, str(message)) + "\n"
        return previous(message, category, filename, lineno, line)

    with warnings.catch_warnings():
        for pattern in _THIRD_PARTY_NOISE:
            warnings.filterwarnings("ignore", message=pattern)
        warnings.formatwarning = format_warning
        try:
            yield
        finally:
            warnings.formatwarning = previous
