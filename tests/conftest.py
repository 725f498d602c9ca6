"""Test-suite setup shared by every test file.

The ``tests/`` folder is put on ``sys.path`` here, once, so that test files can import their
helper modules (``import dist_worker``, ``from test_eval_extract import Toy``...) without each
file editing ``sys.path`` itself. Subprocesses started by tests do not run this file; they get
the folder through ``PYTHONPATH`` (see :data:`TESTS_DIR`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

#: The folder holding the tests and their helper modules.
TESTS_DIR = Path(__file__).resolve().parent

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# Compiled test modules (pytest's assertion-rewritten ones among them) cached outside the
# checkout, also where the environment asks for no bytecode (PYTHONDONTWRITEBYTECODE, which
# some machines set so that nothing lands in source trees): without a cache every pytest
# process compiles every test module again, measured 36 CPU-s against 12 for collecting the
# suite once, paid by each of the xdist workers.
sys.pycache_prefix = sys.pycache_prefix or os.path.join(tempfile.gettempdir(), f"mmviews-tests-pycache-{getattr(os, 'getuid', lambda: 0)()}")
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n N``), each worker's torch gets its share of the cores: N workers
    each spinning torch's default of one thread per core oversubscribe the machine (measured on
    2 cores: in-process training tests took 2-3x the CPU time). Training subprocesses already
    run on one thread (``OMP_NUM_THREADS=1``, ``test_train_utils.env``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


#: Why a test marked ``cuda`` (pyproject.toml) is skipped on a machine without a CUDA device.
NO_CUDA = "no CUDA device"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip with the reason :data:`NO_CUDA` where torch sees no CUDA
    device (``mmviews bench gpu`` runs them on a GPU: ``pytest -m cuda``)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny finished run (:func:`crafted_files.train_tiny_run`), trained once per session and
    shared by ``test_reliability.py``, ``test_security.py`` and ``test_mutations.py``. Tests
    never change it: each works on a copy (:func:`crafted_files.copy_run`)."""
    from crafted_files import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("tiny_run"))


@pytest.fixture
def block_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records (start, stop) of every streamed block of scores computed (forward and backward),
    for the objectives' memory-bounded paths (``mmviews.objectives._streaming``)."""
    from mmviews.objectives import _streaming

    calls: list[tuple[int, int]] = []
    original = _streaming._block_scores

    def spy(anchors, candidates, start, stop, *args):
        calls.append((start, stop))
        return original(anchors, candidates, start, stop, *args)

    monkeypatch.setattr(_streaming, "_block_scores", spy)
    return calls
