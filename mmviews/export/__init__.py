"""Taking a trained encoder out of its run folder: a Hugging Face Hub-ready folder
(:mod:`mmviews.export.hf`) and ONNX graphs (:mod:`mmviews.export.onnx`) that
:mod:`mmviews.export.onnx_runtime` runs with onnxruntime and numpy alone."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["OnnxEncoder", "export_hf", "export_onnx"]

# Loaded when first named: the ONNX runtime path must not import torch, the exporters do.
_HOMES = {"OnnxEncoder": "mmviews.export.onnx_runtime", "export_hf": "mmviews.export.hf",
          "export_onnx": "mmviews.export.onnx"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
