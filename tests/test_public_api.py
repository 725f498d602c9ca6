"""The public surface: every subpackage lists its public names in ``__all__`` (and they all
exist), and importing mmviews stays light: ``import mmviews`` (and the command line's entry
module) imports no torch, and no subpackage imports the heavy optional stacks at import time
(they load inside the functions that need them)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import mmviews

SUBPACKAGES = sorted(f"mmviews.{m.name}" for m in pkgutil.iter_modules(mmviews.__path__) if m.ispkg)
# Imported lazily, by the code paths that need them: a bare import must not pay for these.
HEAVY = ("transformers", "open_clip", "accelerate", "datasets", "matplotlib", "scipy", "sklearn", "tensorboard",
         "peft", "av", "cv2", "pandas")


def test_there_are_subpackages():
    assert {"mmviews.objectives", "mmviews.data", "mmviews.modalities", "mmviews.eval", "mmviews.train",
            "mmviews.cli"} <= set(SUBPACKAGES)


@pytest.mark.parametrize("name", ["mmviews", *SUBPACKAGES])
def test_all_lists_existing_names(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__ list"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return {m.split(".")[0] for m in out.split()}


def test_import_mmviews_is_light():
    loaded = _imported_after("import mmviews, mmviews.cli, mmviews.config, mmviews.resources")
    assert not {"torch", *HEAVY} & loaded, sorted({"torch", *HEAVY} & loaded)


def test_subpackages_import_no_heavy_stack():
    loaded = _imported_after("import " + ", ".join(SUBPACKAGES))
    assert not set(HEAVY) & loaded, sorted(set(HEAVY) & loaded)
