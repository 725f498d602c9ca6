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


def machine(device: torch.device) -> dict[str, Any]:
    """The ``machine`` entry of the verbs that print their rows as they measure them
    (``adapters``, ``dropout``): ``platform``, ``cpus``, ``torch_threads``, ``device`` and the
    ``load_average`` while they ran (their ratios are only as good as the machine was quiet)."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device), "load_average": list(os.getloadavg())}


def print_header(header: str) -> None:
    """Print a table's ``header`` line and a rule of dashes as long as it under it."""
    print(header)
    print("-" * len(header))


def write_report(result: dict[str, Any], table: str | None, out: str | Path) -> None:
    """Print ``table``, write ``result`` to ``out`` as indented JSON (atomically, so that an
    interrupted benchmark leaves no half-written file) and say where it went. ``table`` None:
    the rows were printed as they came, and a blank line parts them from where it went."""
    print(table if table is not None else "")
    written = atomic_write_text(out, json.dumps(result, indent=2))
    print(f"wrote {written}")
