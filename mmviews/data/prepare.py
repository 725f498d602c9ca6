"""``mmviews prepare DATASET PATH``: check a user's copy against its data card and convert it.

A dataset copy that is incomplete, of another release or damaged should say so before any
training, in lines naming the file, flag or key at fault; and decoding pickles, videos or images
for every sample of every epoch is slow. So this command reads a copy the way training will, reports
what it found, and writes once the fast form training then reads: the memory-mapped store of the
sentiment pickles, the frame/flow store of video folders (:mod:`mmviews.data.video_store`), or
Parquet shards (:mod:`mmviews.data.shards`). Exit status 0 when the copy is usable, 1 when it is
not, 2 on an error that stops the command. What each dataset does and every option are in
``docs/prepare.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

from mmviews.fileio import atomic_write_text

SENTIMENT = ("mosi", "mosei", "sims")
_NAMED_IN_OUTPUT = 5  # clips named per problem in the printed summary (all of them in the report file)
VIDEO = ("ucf101", "hmdb51")
# Clip counts from the data cards.
VIDEO_CLIPS = {"ucf101": 13320, "hmdb51": 6766}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=sorted(SENTIMENT + VIDEO + ("hf", "synthetic")), help="dataset name (see data_cards/)")
    parser.add_argument("path", nargs="?", default=None,
                        help="the .pkl file (mosi/mosei/sims), the video folder, or your dataset folder (hf)")
    parser.add_argument("--output", "--out", "-o", dest="out", default=None,
                        help="where to write the store, index or Parquet shard folder (default: next to PATH)")
    parser.add_argument("--layout", default="auto", choices=["auto", "mmsa", "mult"], help="pickle layout (default %(default)s: read from the keys)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing store (video: removes only the outputs its manifest lists)")
    parser.add_argument("--fold", type=int, default=1, help="video split fold to check (1-3; default %(default)s)")
    parser.add_argument("--splits-dir", default=None,
                        help="video: the folder of the split lists (default: found beside PATH; the recipe key is "
                             "data.options.splits_dir)")
    video = parser.add_argument_group("video (ucf101, hmdb51)")
    video.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                       help="worker processes extracting clips (default: one per CPU; 0: in this process)")
    video.add_argument("--size", type=int, default=128, help="short side of the stored frames in px (default %(default)s; 0: as decoded)")
    video.add_argument("--format", default="jpeg", choices=["jpeg", "npy", "parquet"],
                       help="frames and flow as JPEG files or uint8 .npy arrays (default %(default)s); parquet: sharded "
                            "Parquet files for streaming (any dataset; the video store is made first, as JPEG)")
    video.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality (1-100; default %(default)s)")
    video.add_argument("--flow", default="farneback", choices=["farneback", "none"], help="optical flow to store (default %(default)s)")
    video.add_argument("--on-error", default="skip", choices=["skip", "raise"],
                       help="an unreadable video: report it and go on (skip) or stop (raise); default %(default)s")
    video.add_argument("--check-only", action="store_true", help="only check the folder and write its index (no store)")
    video.add_argument("--num-frames", type=int, default=8,
                       help="frames one view needs (the recipe's data.options.num_frames): clips with fewer are "
                            "listed as short (default %(default)s)")
    shards = parser.add_argument_group("parquet shards (--format parquet)")
    shards.add_argument("--shard-size-mb", type=float, default=256.0, help="target size of one shard in MB (default %(default)s)")
    shards.add_argument("--shard-rows", type=int, default=None,
                        help="at most this many rows per shard (equal shards split evenly between processes)")
    shards.add_argument("--columns", default=None,
                        help="hf: modality=column pairs to write, comma-separated (default: image, audio, text columns)")
    shards.add_argument("--labels", default=None, help="hf: label=column pairs, comma-separated (default: class=label)")
    shards.add_argument("--splits", default=None,
                        help="comma-separated splits to write (default: train,test for video; every split otherwise)")
    hf = parser.add_argument_group("hf (your own dataset)")
    hf.add_argument("--recipe", default=None,
                    help="read the data options (columns, labels, format, splits) from this recipe (with --format parquet: "
                         "the columns, labels and splits written; --columns/--labels/--splits win over it)")
    hf.add_argument("--samples", type=int, default=8, help="rows decoded per split (default %(default)s; 0: every row)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    _print_mapping(summary, "")


def _print_mapping(mapping: dict[str, Any], indent: str) -> None:
    for k, v in mapping.items():
        if isinstance(v, dict) and v:
            print(f"{indent}{k}:")
            _print_mapping(v, indent + "  ")
        elif isinstance(v, list) and not indent:
            print(f"{k}: {getattr(v, 'total', len(v))}")
            for item in v[:10]:
                print(f"  - {item}")
        else:
            print(f"{indent}{k}: {v}")


def _prepare_sentiment(args: argparse.Namespace) -> dict[str, Any]:
    from mmviews.data.sentiment import convert_sentiment_pickle

    path = Path(args.path)
    out = Path(args.out) if args.out else path.with_name(path.name + ".mmstore")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = convert_sentiment_pickle(path, out, dataset=args.dataset, layout=args.layout, overwrite=args.overwrite,
                                        progress=True)
    summary: dict[str, Any] = {"dataset": args.dataset, "source": str(path), "store": str(out), "layout": meta["layout"],
                               "split variant": meta["variant"] or "unknown"}
    for split, sm in meta["splits"].items():
        shapes = ", ".join(f"{m} {tuple(v['shape'][1:])}" for m, v in sm["modalities"].items())
        nonfinite = sum(sm["nonfinite_set_to_zero"].values())
        summary[split] = f"{sm['num_samples']} samples; {shapes}; labels {sm['labels']}; non-finite set to 0: {nonfinite}"
    summary["warnings"] = [str(w.message) for w in caught]
    return summary


class _Named(list):  # type: ignore[type-arg]
    """The first few of a longer list of clips (``total`` of them), printed with their count."""

    total: int


def _named(items: list[str], total: int, where: str) -> list[str]:
    """The first few of ``items`` for the printed summary, and where the others are."""
    shown = _Named(items[:_NAMED_IN_OUTPUT])
    if total > len(shown):
        shown.append(f"... and {total - len(shown)} more: all in {where}")
    shown.total = total
    return shown


def _prepare_video(args: argparse.Namespace) -> dict[str, Any]:
    from mmviews.data.video import VideoFolder, scan_video_folder
    from mmviews.data.video_store import REPORT_FILE, default_store_path, prepare_video_store

    root = Path(args.path)
    summary: dict[str, Any] = {"dataset": args.dataset, "root": str(root)}
    splits: dict[str, Any] = {}
    splits_dir: Path | None = None
    for split in ("train", "test"):
        ds = VideoFolder(root, split=split, dataset=args.dataset, fold=args.fold, splits_dir=args.splits_dir,
                         audio=False, store=False)
        splits_dir = ds.splits_dir
        missing = [rel for _, rel in ds.clips if not (root / rel).is_file()]
        splits[split] = {"clips": len(ds.clips), "missing": missing}
        summary[f"{split} (fold {args.fold})"] = f"{len(ds.clips)} clips listed, {len(missing)} missing"
    summary["split lists"] = str(splits_dir)
    expected = VIDEO_CLIPS[args.dataset]
    missing_problems = [f"{s}: {len(v['missing'])} listed clips missing" for s, v in splits.items() if v["missing"]]
    all_missing = [f"{s}: {rel}" for s, v in splits.items() for rel in v["missing"]]
    if not args.check_only:
        store = Path(args.out) if args.out else default_store_path(root)
        res = prepare_video_store(root, store, dataset=args.dataset,
                                  image_format=args.format, size=args.size, flow=None if args.flow == "none" else args.flow,
                                  jpeg_quality=args.jpeg_quality, workers=args.workers, on_error=args.on_error,
                                  overwrite=args.overwrite, min_frames=args.num_frames)
        report_path = store / REPORT_FILE
        report = {"dataset": args.dataset, "root": str(root.resolve()), "splits_dir": str(splits_dir),
                  "fold": args.fold, "store": res["store"], "missing": {s: v["missing"] for s, v in splits.items()},
                  "failed": res["failed"], "truncated": res["truncated"], "short": res["short"],
                  "num_frames": args.num_frames}
        atomic_write_text(report_path, json.dumps(report, indent=1))
        summary["clips on disk"] = f"{res['clips']} (card: {expected})"
        summary["store"] = res["store"]
        summary["prepared now"] = res["prepared"]
        summary["already in the store"] = res["already_done"]
        summary["clips with an audio track"] = res["with_audio"]
        summary["missing (listed, not on disk)"] = _named(all_missing, len(all_missing), str(report_path))
        summary["unreadable (skipped)"] = _named(list(res["failed"].values()), len(res["failed"]), str(report_path))
        summary["truncated (stored as decoded)"] = _named(
            [f"{rel}: {t['decoded']} of {t['declared']} frames decode" for rel, t in res["truncated"].items()],
            len(res["truncated"]), str(report_path))
        summary[f"short (fewer than --num-frames {args.num_frames} frames)"] = _named(
            [f"{rel}: {t['decoded']} frames" for rel, t in res["short"].items()], len(res["short"]), str(report_path))
        summary["report"] = str(report_path)
        summary["seconds"] = res["seconds"]
        summary["problems"] = (missing_problems + ([f"{len(res['failed'])} unreadable clips"] if res["failed"] else [])
                               + ([f"{len(res['truncated'])} truncated clips"] if res["truncated"] else []))
        return summary
    scan = scan_video_folder(root)
    summary["clips on disk"] = f"{scan['clips']} in {scan['classes']} classes (card: {expected})"
    summary["clips with an audio track"] = scan["with_audio"]
    out = Path(args.out) if args.out else root.with_name(root.name + ".mmviews-index.json")
    summary["missing (listed, not on disk)"] = _named(all_missing, len(all_missing), str(out))
    summary["unreadable"] = _named(scan["unreadable"], len(scan["unreadable"]), str(out))
    index = {"dataset": args.dataset, "fold": args.fold, "splits_dir": str(splits_dir), "splits": splits, "scan": scan}
    atomic_write_text(out, json.dumps(index, indent=1))
    summary["index"] = str(out)
    summary["problems"] = missing_problems + ([f"{len(scan['unreadable'])} unreadable clips"] if scan["unreadable"] else [])
    return summary


def _pairs(text: str | None, option: str) -> dict[str, str] | None:
    """``"a=b,c=d"`` -> ``{"a": "b", "c": "d"}`` (None stays None)."""
    if text is None:
        return None
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise ValueError(f"{option} takes name=column pairs separated by commas, got {text!r}")
    return {k.strip(): v.strip() for k, v in pairs}


def _in_flags(error: Exception, args: argparse.Namespace, from_recipe: set[str]) -> Exception:
    """An error of the hf reader, tagged with the option at fault (``dataset_error``), said in
    the command's terms: the flag that sets that option, or the recipe key it came from."""
    option = getattr(error, "option", None)
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    flags = {"columns": "--columns MODALITY=COLUMN,...", "labels": "--labels NAME=COLUMN,...", "split": "--splits"}
    if option in from_recipe or (option == "split" and not args.splits and args.recipe):
        key = {"split": "data.train_split/val_split/test_split"}.get(option, f"data.options.{option}")
        where = f"key {key!r} of {args.recipe}" + (f" (or {flags[option]})" if option in flags else "")
    elif option in flags:
        where = flags[option]
    else:
        return error
    out = type(error)(f"{where}: {message}")
    out.option = option  # type: ignore[attr-defined]
    return out


def _prepare_parquet(args: argparse.Namespace, recipe_data: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``--format parquet``: the source's splits as Parquet shards (:mod:`mmviews.data.shards`).
    ``recipe_data``: reads ``--recipe`` (hf: its columns, labels, source format and splits)."""
    from mmviews.data import shards

    path = Path(args.path)
    out = Path(args.out or shards.default_shards_path(path))  # --output (default: <PATH>-parquet beside PATH)
    wanted = args.splits.split(",") if args.splits else None
    shapes: dict[str, list[int | None]] = {}  # the shapes of an hf source's array columns
    if args.dataset in VIDEO:
        from mmviews.data.video_store import VideoStore, default_store_path, prepare_video_store

        store_path = default_store_path(path)
        res = prepare_video_store(path, store_path, dataset=args.dataset, image_format="jpeg", size=args.size,
                                  flow=None if args.flow == "none" else args.flow, jpeg_quality=args.jpeg_quality,
                                  workers=args.workers, on_error=args.on_error)
        store = VideoStore(store_path)
        rows = {s: shards.video_split_rows(path, s, args.fold, store, dataset=args.dataset,
                                                splits_dir=args.splits_dir) for s in (wanted or ["train", "test"])}
        columns = {"frames": "jpeg_frames", "flow_x": "flow_images", "flow_y": "flow_images", "audio": "flac_track"}
        kind, labels, options = "video", {"class": "class"}, {"fold": args.fold, **store.options}
        extra = {"store": str(store_path), "unreadable (skipped)": list(res["failed"].values()),
                 "problems": [f"{len(res['failed'])} unreadable clips"] if res["failed"] else []}
    elif args.dataset in SENTIMENT:
        from mmviews.data.sentiment import SEQUENCE_MODALITIES, open_sentiment

        names = wanted or ["train", "valid", "test"]
        first = open_sentiment(path, names[0], dataset=args.dataset, layout=args.layout, progress=True)
        mods = [m for m in (*SEQUENCE_MODALITIES, "text_ids", "raw_text")
                if m in first.smeta["modalities"] or (m == "text_ids" and first.smeta["has_text_ids"])
                or (m == "raw_text" and first.smeta["has_raw_text"])]
        rows = {s: shards.sentiment_split_rows(open_sentiment(path, s, dataset=args.dataset, layout=args.layout,
                                                              modalities=mods)) for s in names}
        info = rows[names[0]].features
        columns = {m: ("tokens" if m == "text_ids" else "text" if m == "raw_text" else "sequence") for m in mods}
        kind, options, extra = "sentiment", {"layout": args.layout}, {}
        labels = {c: c for c in info if c not in columns and c not in (shards.INDEX_COLUMN, "id")}
    else:
        from mmviews.data.hf import HFDataset

        recipe: dict[str, Any] = {"options": {}, "splits": []}
        if args.recipe is not None:
            if recipe_data is None:
                raise ValueError("--recipe is read by the command line (mmviews.cli.prepare)")
            recipe = recipe_data(args.recipe)
        wanted = wanted or recipe["splits"] or None
        if wanted is None:
            if (path / "dataset_dict.json").is_file():
                wanted = sorted(json.loads((path / "dataset_dict.json").read_text())["splits"])
            else:
                wanted = [p.name for p in sorted(path.iterdir()) if p.is_dir()] or ["train"]
        hf_options = dict(recipe["options"])
        for key in ("columns", "labels"):  # the flags win over the recipe
            given = _pairs(getattr(args, key), f"--{key}")
            if given is not None:
                hf_options[key] = given
        from_recipe = {k for k in recipe["options"] if k == "format" or getattr(args, k) is None}
        try:
            parts = {s: HFDataset(path, split=s, **hf_options) for s in wanted}
        except (ValueError, KeyError) as err:
            if type(err) not in (ValueError, KeyError):
                raise
            raise _in_flags(err, args, from_recipe) from None
        rows = {s: shards.hf_split_rows(d) for s, d in parts.items()}
        first = next(iter(parts.values()))
        columns = {col: first.kinds[m] for m, col in first.columns.items()}
        labels = dict(first.label_columns)
        kind, options, extra = "hf", {"columns": first.columns, "labels": first.label_columns}, {}
        shapes = rows[wanted[0]].shapes
        for split, split_rows in rows.items():
            if split_rows.shapes != shapes:
                raise ValueError(f"{path}: split {split!r} stores its array columns with the shapes {split_rows.shapes}, "
                                 f"split {wanted[0]!r} with {shapes}: write the splits to separate --output folders")
    res = shards.write_shards(out, rows, source={"dataset": args.dataset, "root": str(path.resolve()), "kind": kind,
                                                 "options": options},
                              columns=columns, labels=labels, shard_size_mb=args.shard_size_mb,
                              shard_rows=args.shard_rows, overwrite=args.overwrite, shapes=shapes)
    summary: dict[str, Any] = {"dataset": args.dataset, "source": str(path), "shards": res["out"], **extra}
    for split, sm in res["splits"].items():
        summary[split] = f"{sm['rows']} rows in {sm['shards']} shards ({sm['skipped']} samples skipped)"
    summary["written now"] = res["written"]
    summary["seconds"] = res["seconds"]
    return summary


def run(args: argparse.Namespace, check_hf: Callable[[argparse.Namespace], dict[str, Any]] | None = None,
        recipe_data: Callable[[str], dict[str, Any]] | None = None) -> int:
    """``mmviews prepare``. ``check_hf``: the check of an ``hf`` dataset against its recipe
    (:func:`mmviews.cli.prepare.check_hf_dataset`: reading a recipe is a layer above the data);
    ``recipe_data``: the data options of ``--recipe`` that ``--format parquet`` writes with
    (:func:`mmviews.cli.prepare.recipe_data_options`)."""
    try:
        if getattr(args, "recipe", None) is not None and args.dataset != "hf":
            raise ValueError(f"--recipe reads the data options of an hf recipe (mmviews prepare hf ROOT --recipe R); "
                             f"{args.dataset} takes its options as flags (mmviews prepare --help)")
        if args.dataset == "synthetic":
            from mmviews.data.synthetic import SyntheticMultimodal

            info = SyntheticMultimodal(1).modality_info()
            _print_summary({"dataset": "synthetic", "note": "generated on the fly; nothing to prepare",
                            "modalities": {k: v.get("shape", v["kind"]) for k, v in info.items()}}, args.json)
            return 0
        if args.path is None:
            print(f"mmviews prepare: error: {args.dataset} needs PATH (see data_cards/{args.dataset}.md)", file=sys.stderr)
            return 2
        if not Path(args.path).exists():
            print(f"mmviews prepare: error: {args.path} does not exist (see data_cards/{args.dataset}.md for how to obtain it)",
                  file=sys.stderr)
            return 2
        if getattr(args, "format", None) == "parquet":
            summary = _prepare_parquet(args, recipe_data)
        elif args.dataset == "hf":
            if check_hf is None:
                raise ValueError("mmviews prepare hf checks a dataset through the command line (mmviews.cli.prepare)")
            summary = check_hf(args)
        else:
            summary = _prepare_sentiment(args) if args.dataset in SENTIMENT else _prepare_video(args)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, pickle.UnpicklingError) as err:
        # The message names the file, split or key at fault (a KeyError's without str()'s quotes).
        print(f"mmviews prepare: error: {err.args[0] if isinstance(err, KeyError) and err.args else err}",
              file=sys.stderr)
        return 2
    _print_summary(summary, args.json)
    return 1 if summary.get("problems") else 0
