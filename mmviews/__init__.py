"""mmviews: multimodal, multi-view representation learning.

``import mmviews`` imports nothing else, so the command line and scripts start fast; the
subpackages load on first use (``mmviews.objectives.get_objective(...)`` works after a bare
``import mmviews``):

- :mod:`mmviews.objectives`: multi-view losses over ``z [K, M, d]`` and their registry;
- :mod:`mmviews.data`: datasets, views, augmentations, the ``ViewBatch`` collator;
- :mod:`mmviews.modalities`: adapters (one view -> the unit sphere) and ``MultiViewEncoder``;
- :mod:`mmviews.eval`: probes, retrieval, diagnostics and reports;
- :mod:`mmviews.export`: a Hub-ready folder, ONNX graphs and their onnxruntime runner
  (:mod:`mmviews.hub`: loading from and uploading to the Hugging Face Hub);
- :mod:`mmviews.config` (recipes), :mod:`mmviews.run` (run folders, ``load_run``),
  :mod:`mmviews.train` (the Accelerate trainer), :mod:`mmviews.cli` (the ``mmviews`` command).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("cli", "config", "data", "eval", "export", "hub", "modalities", "objectives", "resources", "run", "train")

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    # PEP 562: a subpackage is imported when first named, not by ``import mmviews``.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES))
