"""``mmviews list {objectives,recipes,datasets}``."""

from __future__ import annotations

import argparse
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["objectives", "recipes", "datasets"])


def run(args: argparse.Namespace) -> int:
    if args.what == "objectives":
        from mmviews.objectives import list_objectives

        names = list_objectives()
    elif args.what == "recipes":
        names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    else:
        from mmviews.data import list_datasets

        names = list_datasets()
    print("\n".join(names))
    return 0
