"""``mmviews list {objectives,recipes,datasets}``.

``recipes`` prints one line per recipe name: the name, where the file comes from and its path.
The origins, in lookup order (the first folder holding a name wins, see
:func:`mmviews.config.recipe_sources`): ``MMVIEWS_RECIPES`` (the folder named by that
variable), ``local`` (``./recipes``), ``packaged`` (shipped inside the installed wheel) or
``checkout`` (the top-level ``recipes/`` of a source checkout / editable install). ``datasets``
prints each dataset with the path of its card (layout, splits, metrics) where it has one.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["objectives", "recipes", "datasets"])


def _table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns, two spaces apart (the last column is not padded)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    # Imported by choice, so that listing recipes does not import torch.
    if args.what == "objectives":
        from mmviews.objectives import list_objectives

        print("\n".join(list_objectives()))
    elif args.what == "recipes":
        from mmviews.config import list_recipes, recipe_origin

        print(_table([(path.stem, recipe_origin(path), str(path)) for path in list_recipes()]))
    else:
        from mmviews.data import list_datasets
        from mmviews.resources import data_card

        rows = []
        for name in list_datasets():
            card = data_card(name)
            rows.append((name, f"card: {card}" if card is not None else ""))
        print(_table(rows))
    return 0
