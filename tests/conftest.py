"""Test-suite setup shared by every test file.

The ``tests/`` folder is put on ``sys.path`` here, once, so that test files can import their
helper modules (``import dist_worker``, ``from test_eval_extract import Toy``...) without each
file editing ``sys.path`` itself. Subprocesses started by tests do not run this file; they get
the folder through ``PYTHONPATH`` (see :data:`TESTS_DIR`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

#: The folder holding the tests and their helper modules.
TESTS_DIR = Path(__file__).resolve().parent

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny finished run (:func:`crafted_files.train_tiny_run`), trained once per session and
    shared by ``test_reliability.py``, ``test_security.py`` and ``test_mutations.py``. Tests
    never change it: each works on a copy (:func:`crafted_files.copy_run`)."""
    from crafted_files import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("tiny_run"))
