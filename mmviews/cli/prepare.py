"""``mmviews prepare``: the converters of :mod:`mmviews.data.prepare`, and the check of a user's
``hf`` dataset against its recipe (:func:`check_hf_dataset`), which reads the recipe with
:mod:`mmviews.config`, a layer above the data."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mmviews.data import prepare as data_prepare
from mmviews.data.prepare import add_arguments

__all__ = ["add_arguments", "check_hf_dataset", "hf_split_names", "recipe_data_options", "run"]


def run(args: argparse.Namespace) -> int:
    return data_prepare.run(args, check_hf=check_hf_dataset, recipe_data=recipe_data_options)


def recipe_data_options(recipe: str) -> dict[str, Any]:
    """What ``mmviews prepare hf ROOT --format parquet --recipe RECIPE`` writes with:
    ``{"options": the recipe's data.options columns, labels and format, "splits": the splits it
    names}``. A ``format: parquet`` is the recipe's reading of the shards, not the source's
    format, and is left out (the source's is detected)."""
    from mmviews.config import load_config

    data = load_config(recipe, adapters=False).data  # its data section only
    if data.name != "hf":
        raise ValueError(f"{recipe}: key 'data.name' is {data.name!r}; `mmviews prepare hf --recipe` reads 'hf' recipes")
    options = {k: data.options[k] for k in ("columns", "labels", "format") if k in data.options}
    if options.get("format") == "parquet":
        del options["format"]
    splits = [s for s in dict.fromkeys((data.train_split, data.val_split, data.test_split)) if s is not None]
    return {"options": options, "splits": splits}


def check_hf_dataset(args: argparse.Namespace) -> dict[str, Any]:
    """``mmviews prepare hf ROOT [--recipe R] [--samples N]``: open every split of a user's
    dataset as training will (with the recipe's data options), decode its first rows, and
    report the columns, modalities and labels found, and every problem by recipe key."""
    from mmviews.config import DataConfig, load_config
    from mmviews.data.loaders import build_dataset_split
    from mmviews.data.streaming import first_samples

    if args.recipe is not None:
        data = load_config(args.recipe, adapters=False).data  # its data section only
        if data.name != "hf":
            raise ValueError(f"{args.recipe}: key 'data.name' is {data.name!r}; `mmviews prepare hf` checks 'hf' datasets")
        data.root = str(args.path)
        splits = [s for s in (data.train_split, data.val_split, data.test_split) if s is not None]
    else:
        data = DataConfig(name="hf", root=str(args.path), options={})
        splits = []
    summary: dict[str, Any] = {"dataset": "hf", "root": str(args.path), "recipe": args.recipe or "none (default options)",
                               "options": data.options}
    problems: list[str] = []
    if not splits:  # no recipe: every split the folder has
        splits = hf_split_names(Path(args.path), data.options.get("format", "auto"))
    for split in dict.fromkeys(splits):
        try:
            ds = build_dataset_split(data, split)
        except (ValueError, KeyError, FileNotFoundError) as err:
            problems.append(str(err.args[0] if isinstance(err, KeyError) and err.args else err))
            continue
        n = len(ds)
        count = n if args.samples <= 0 else min(n, args.samples)
        decoded = 0
        if getattr(ds, "streamed", False):  # not indexable: the first rows read through the stream
            try:
                decoded = len(first_samples(ds, count))
            except (ValueError, OSError) as err:
                problems.append(f"split {split!r} (streamed): {err}")
        for i in range(0 if getattr(ds, "streamed", False) else count):
            try:
                ds[i]
                decoded += 1
            except (ValueError, OSError) as err:
                problems.append(f"split {split!r} row {i}: {err}")
                break
        features = ds.features if hasattr(ds, "features") else ds.ds.features  # shard readers: their Parquet schema
        labels = {}
        for name, column in ds.label_columns.items():
            feature = features[column]
            names = getattr(feature, "names", None)
            labels[name] = f"column {column!r}" + (f", {len(names)} classes" if names else f", {feature}")
        summary[f"split {split}"] = {
            "rows": n,
            "columns": sorted(features),
            "modalities": {m: f"column {c!r}, {ds.kinds[m]}" for m, c in ds.columns.items()},
            "labels": labels or "none (probes need one: options.labels)",
            "decoded": f"{decoded} of the first {count} rows" + (" (read through the stream)" if data.streaming else ""),
        }
    summary["next"] = ("mmviews train RECIPE --check (views, adapters, objective), then mmviews train RECIPE"
                       if args.recipe else "write a recipe (data_cards/hf.md), then: mmviews prepare hf ROOT --recipe RECIPE")
    summary["problems"] = problems
    return summary


def hf_split_names(root: Path, format: str) -> list[str]:
    """The splits of a dataset folder: a DatasetDict's, or the split sub-folders of an
    image/audio folder (``train`` when it has none)."""
    dict_file = root / "dataset_dict.json"
    if format in ("auto", "disk") and dict_file.is_file():
        from mmviews.fileio import read_json_object

        return [str(s) for s in read_json_object(dict_file).get("splits", [])] or ["train"]
    if format in ("auto", "disk") and (root / "dataset_info.json").is_file():
        return ["train"]
    from mmviews.data.hf import SPLIT_FOLDER_NAMES

    found = [p.name for p in sorted(root.iterdir()) if p.is_dir() and p.name in SPLIT_FOLDER_NAMES]
    # datasets' folder builders call a valid/val/dev folder "validation"
    return [("validation" if name in ("valid", "val", "dev") else name) for name in found] or ["train"]
