"""``mmviews list {objectives,recipes,datasets}``."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["objectives", "recipes", "datasets"])


def run(args: argparse.Namespace) -> int:
    # Imported by choice, so that listing recipes does not import torch.
    if args.what == "objectives":
        from mmviews.objectives import list_objectives

        names = list_objectives()
    elif args.what == "recipes":
        from mmviews.config import list_recipes

        names = [path.stem for path in list_recipes()]
    else:
        from mmviews.data import list_datasets

        names = list_datasets()
    print("\n".join(names))
    return 0
