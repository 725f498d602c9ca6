"""mutmut's command line with its results files written so that a stop cannot cut them.

    python tests/mutation/mutmut_safe.py run --max-children 1 [mutant names...]

``tests/mutation/run.py`` starts mutmut through this script. mutmut (3.x) rewrites a module's
results file ``mutants/<module>.meta`` in place after every mutant (``open(path, "w")`` and then
``json.dump`` in many small writes). A time limit stops mutmut with SIGINT, and the
KeyboardInterrupt that raises can land in the middle of that rewrite: the file is left as a
prefix of its JSON, mutmut's next run fails to load it, and every result of the module is lost
(this happened to a run of over a thousand mutants). Here the rewrite

* goes to a temporary file beside the results file and replaces it in one ``os.replace``, so
  the results file is always a complete earlier or later version, even under SIGKILL;
* runs with SIGINT blocked, so that a stop asked for during the write takes effect right after
  it and the mutant just recorded is kept.

The statistics file (which test reaches which function) is written with SIGINT blocked too;
mutmut collects it again by itself when it cannot read it, so it needs no more than that.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """SIGINT is held back (not lost) until the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def make_saves_atomic() -> None:
    """Patch mutmut's writers of its results and statistics in this process (and the workers it
    forks from it)."""
    import mutmut.stats
    from mutmut.mutation.data import SourceFileMutationData

    write_meta = SourceFileMutationData.save
    if getattr(write_meta, "atomic", False):
        return

    @functools.wraps(write_meta)
    def save_meta(self: SourceFileMutationData) -> None:
        final = Path(self.meta_path)
        partial = final.with_name(final.name + ".partial")
        with sigint_deferred():
            # mutmut's writer writes wherever meta_path points: the complete file then replaces
            # the old one at once.
            self.meta_path = partial
            try:
                write_meta(self)
            finally:
                self.meta_path = final
            os.replace(partial, final)

    save_meta.atomic = True  # type: ignore[attr-defined]
    SourceFileMutationData.save = save_meta  # type: ignore[method-assign]

    write_stats: Callable[[], None] = mutmut.stats.save_stats

    @functools.wraps(write_stats)
    def save_stats() -> None:
        with sigint_deferred():
            write_stats()

    # Modules that imported the function by name hold their own reference to it.
    for name, module in list(sys.modules.items()):
        if name.startswith("mutmut") and getattr(module, "save_stats", None) is write_stats:
            module.save_stats = save_stats


def main() -> int:
    # Importing mutmut's command line imports every module that saves results.
    from mutmut.__main__ import cli

    make_saves_atomic()
    sys.argv[0] = "mutmut"
    return cli()


if __name__ == "__main__":
    # Python put this script's folder first on the path; mutmut's own script has its bin folder
    # there. Neither holds anything the tests import; drop it so that nothing here can shadow them.
    sys.path.pop(0)
    sys.exit(main())
