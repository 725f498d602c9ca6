"""What every ``mmviews bench`` verb reports the same way: the environment it measured in, and
its result written as JSON next to the table printed for a reader."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from mmviews.fileio import atomic_write_text


def environment(details: bool = False) -> dict[str, Any]:
    """``torch`` version, intra-op ``threads`` and ``platform`` of this process; with
    ``details``, also the ``python`` version, ``cpu_count`` and, where CUDA is available, the
    ``cuda_device`` name (what a throughput figure needs to be compared across machines)."""
    info: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                            "platform": platform.platform()}
    if details:
        info.update(python=platform.python_version(), cpu_count=os.cpu_count())
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name()
    return info


def write_report(result: dict[str, Any], table: str, out: Path) -> None:
    """Print ``table``, write ``result`` to ``out`` as indented JSON (atomically, so that an
    interrupted benchmark leaves no half-written file) and say where it went."""
    print(table)
    atomic_write_text(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
