"""Unit guards of :mod:`mmviews.data.prepare` (``mmviews prepare``), in this process.

What a user relies on, part by part: the options and their defaults (the reference page
``docs/prepare.md`` shows ``mmviews prepare --help`` as it prints), the ``--columns``/``--labels``
pairs, an hf reader's error said in the command's terms (the flag or the recipe key), the printed
summary (nested keys indented, long lists cut to their first items with a count), the one-line
errors with exit status 2, and what the sentiment, video and Parquet paths print and write.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_data_sentiment import small_split, write_pickle

from mmviews.cli import command_parser
from mmviews.data import prepare

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    return parser.parse_args(list(argv))


def run(capsys, *argv: str, **hooks) -> tuple[int, str, str]:
    rc = prepare.run(parse(*argv), **hooks)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# --------------------------------------------------------------------------- options


def test_the_options_page_shows_what_prepare_help_prints(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    _, parser = command_parser("prepare")
    printed = parser.format_help()
    shown = printed[printed.index("positional arguments:"):]
    page = (ROOT / "docs" / "prepare.md").read_text()
    block = re.search(r"^## Options\n.*?^```\n(.*?)^```", page, re.S | re.M)
    assert block is not None, "docs/prepare.md: no ``` block under '## Options'"
    assert block.group(1) == shown


def test_defaults_without_flags():
    args = parse("ucf101", "data/UCF-101")
    assert (args.dataset, args.path, args.out, args.layout, args.overwrite, args.fold, args.splits_dir) == (
        "ucf101", "data/UCF-101", None, "auto", False, 1, None)
    assert (args.workers, args.size, args.format, args.jpeg_quality, args.flow, args.on_error, args.check_only,
            args.num_frames) == (os.cpu_count() or 1, 128, "jpeg", 90, "farneback", "skip", False, 8)
    assert (args.shard_size_mb, args.shard_rows, args.columns, args.labels, args.splits, args.recipe, args.samples,
            args.json) == (256.0, None, None, None, None, None, 8, False)
    assert parse("synthetic").path is None
    # every spelling of the output flag
    assert parse("mosi", "a.pkl", "-o", "x").out == parse("mosi", "a.pkl", "--out", "x").out == \
        parse("mosi", "a.pkl", "--output", "x").out == "x"


def test_every_choice_is_accepted_and_others_refused(capsys):
    for dataset in ("hf", "hmdb51", "mosei", "mosi", "sims", "synthetic", "ucf101"):
        assert parse(dataset).dataset == dataset
    for flag, values in (("--layout", ("auto", "mmsa", "mult")), ("--format", ("jpeg", "npy", "parquet")),
                         ("--flow", ("farneback", "none")), ("--on-error", ("skip", "raise"))):
        for value in values:
            assert getattr(parse("ucf101", flag, value), flag[2:].replace("-", "_")) == value
        with pytest.raises(SystemExit):
            parse("ucf101", flag, "other")
    with pytest.raises(SystemExit):
        parse("imagenet")
    typed = parse("ucf101", "--fold", "2", "--workers", "0", "--size", "0", "--jpeg-quality", "75", "--num-frames", "16",
                  "--shard-size-mb", "0.5", "--shard-rows", "3", "--samples", "0", "--overwrite", "--check-only",
                  "--json", "--splits-dir", "lists", "--columns", "image=img", "--labels", "class=y", "--splits",
                  "train", "--recipe", "r.yaml")
    assert (typed.fold, typed.workers, typed.size, typed.jpeg_quality, typed.num_frames, typed.shard_size_mb,
            typed.shard_rows, typed.samples) == (2, 0, 0, 75, 16, 0.5, 3, 0)
    assert (typed.overwrite, typed.check_only, typed.json, typed.splits_dir, typed.columns, typed.labels,
            typed.splits, typed.recipe) == (True, True, True, "lists", "image=img", "class=y", "train", "r.yaml")
    capsys.readouterr()


# --------------------------------------------------------------------------- --columns / --labels pairs


def test_pairs_are_name_column_with_spaces_and_empty_parts_ignored():
    assert prepare._pairs(None, "--columns") is None
    assert prepare._pairs(" image = img ,, audio=wav,", "--columns") == {"image": "img", "audio": "wav"}
    assert prepare._pairs("text=a=b", "--columns") == {"text": "a=b"}  # split at the first '='


@pytest.mark.parametrize("text", ["image", "=img", "image=", " =img", "image= ", "a=b,c"])
def test_a_pair_without_both_names_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError) as info:
        prepare._pairs(text, "--labels")
    assert str(info.value) == f"--labels takes name=column pairs separated by commas, got {text!r}"


# --------------------------------------------------------------------------- hf errors in the command's terms


def tagged(error: Exception, option: str | None) -> Exception:
    error.option = option  # type: ignore[attr-defined]
    return error


def hf_args(**given) -> argparse.Namespace:
    args = parse("hf", "data/mine")
    for key, value in given.items():
        setattr(args, key, value)
    return args


def test_an_hf_error_names_the_flag_that_sets_its_option():
    for option, flag in (("columns", "--columns MODALITY=COLUMN,..."), ("labels", "--labels NAME=COLUMN,..."),
                         ("split", "--splits")):
        out = prepare._in_flags(tagged(ValueError("no column 'x'"), option), hf_args(), set())
        assert type(out) is ValueError and str(out) == f"{flag}: no column 'x'" and out.option == option
    # a split given by --splits is the flag's even with a recipe
    out = prepare._in_flags(tagged(KeyError("no split 'dev'"), "split"), hf_args(splits="dev", recipe="r.yaml"), set())
    assert type(out) is KeyError and out.args[0] == "--splits: no split 'dev'"


def test_an_hf_error_of_a_recipe_option_names_the_recipe_key():
    args = hf_args(recipe="r.yaml")
    out = prepare._in_flags(tagged(ValueError("no column 'x'"), "columns"), args, {"columns", "format"})
    assert str(out) == "key 'data.options.columns' of r.yaml (or --columns MODALITY=COLUMN,...): no column 'x'"
    assert out.option == "columns"
    out = prepare._in_flags(tagged(ValueError("not an image folder"), "format"), args, {"format"})
    assert str(out) == "key 'data.options.format' of r.yaml: not an image folder"
    out = prepare._in_flags(tagged(KeyError("no split 'dev'"), "split"), args, set())
    assert out.args[0] == "key 'data.train_split/val_split/test_split' of r.yaml (or --splits): no split 'dev'"
    # the recipe's option overridden by the flag: the flag is named
    out = prepare._in_flags(tagged(ValueError("no column 'x'"), "labels"), args, {"columns"})
    assert str(out) == "--labels NAME=COLUMN,...: no column 'x'"


def test_an_hf_error_of_no_flag_or_key_is_left_as_it_is():
    for option in (None, "root", "image_size"):
        error = tagged(ValueError("bad"), option)
        assert prepare._in_flags(error, hf_args(recipe="r.yaml"), set()) is error
    for error in (ValueError("untagged"), ValueError(), KeyError()):  # with or without a message
        assert prepare._in_flags(error, hf_args(), set()) is error


# --------------------------------------------------------------------------- the printed summary


def test_long_lists_show_their_first_five_and_where_the_rest_are():
    shown = prepare._named([f"c{i}" for i in range(7)], 7, "r.json")
    assert list(shown) == ["c0", "c1", "c2", "c3", "c4", "... and 2 more: all in r.json"] and shown.total == 7
    shown = prepare._named([f"c{i}" for i in range(5)], 5, "r.json")
    assert list(shown) == ["c0", "c1", "c2", "c3", "c4"] and shown.total == 5
    shown = prepare._named(["c0"], 40, "r.json")  # fewer items given than counted
    assert list(shown) == ["c0", "... and 39 more: all in r.json"] and shown.total == 40


def test_the_summary_prints_nested_keys_indented_and_lists_with_their_count(capsys):
    summary = {"dataset": "x", "nested": {"a": 1, "deeper": {"b": [1, 2]}, "empty": {}}, "empty": {},
               "named": prepare._named([f"c{i}" for i in range(8)], 8, "r.json"), "plain": list(range(12)),
               "none": []}
    prepare._print_summary(summary, as_json=False)
    assert capsys.readouterr().out.splitlines() == [
        "dataset: x", "nested:", "  a: 1", "  deeper:", "    b: [1, 2]", "  empty: {}", "empty: {}",
        "named: 8", "  - c0", "  - c1", "  - c2", "  - c3", "  - c4", "  - ... and 3 more: all in r.json",
        "plain: 12", *[f"  - {i}" for i in range(10)], "none: 0"]


def test_json_summary_is_indented_and_prints_paths_as_text(capsys):
    summary = {"store": Path("/data/x.mmstore"), "counts": {"train": 2}}
    prepare._print_summary(summary, as_json=True)
    out = capsys.readouterr().out
    assert out == json.dumps({"store": "/data/x.mmstore", "counts": {"train": 2}}, indent=2) + "\n"


# --------------------------------------------------------------------------- run: errors and synthetic


def test_synthetic_prints_its_shapes_and_needs_nothing(capsys):
    from mmviews.data.synthetic import SyntheticMultimodal

    info = SyntheticMultimodal(1).modality_info()
    rc, out, err = run(capsys, "synthetic", "--json")
    assert rc == 0 and err == ""
    assert json.loads(out) == {"dataset": "synthetic", "note": "generated on the fly; nothing to prepare",
                               "modalities": {m: list(v["shape"]) if "shape" in v else v["kind"]
                                              for m, v in info.items()}}
    assert json.loads(out)["modalities"]["text"] == "text"  # no shape: its kind
    rc, out, _ = run(capsys, "synthetic")
    assert rc == 0 and out.splitlines()[:3] == ["dataset: synthetic", "note: generated on the fly; nothing to prepare",
                                                "modalities:"]
    # a namespace without the optional flags (a caller's own) is enough
    assert prepare.run(argparse.Namespace(dataset="synthetic", json=True)) == 0
    assert json.loads(capsys.readouterr().out)["dataset"] == "synthetic"


def test_hf_is_checked_by_the_command_lines_check_and_its_problems_set_the_status(capsys, tmp_path):
    seen: list[argparse.Namespace] = []

    def check_hf(args: argparse.Namespace) -> dict:
        seen.append(args)
        return {"dataset": "hf", "root": args.path, "problems": problems}

    for problems, status in (([], 0), (["split 'test' row 0: unreadable"], 1)):
        rc, out, err = run(capsys, "hf", str(tmp_path), "--samples", "3", "--json", check_hf=check_hf)
        assert (rc, err) == (status, "") and json.loads(out) == {"dataset": "hf", "root": str(tmp_path),
                                                                 "problems": problems}
    assert [(a.path, a.samples) for a in seen] == [(str(tmp_path), 3)] * 2


def test_a_callers_namespace_needs_only_the_options_its_dataset_reads(capsys, tmp_path):
    pkl = write_pickle(tmp_path / "mosi.pkl", {s: tiny_sentiment(2) for s in ("train", "valid", "test")})
    args = argparse.Namespace(dataset="mosi", path=str(pkl), out=str(tmp_path / "st"), layout="auto", overwrite=False,
                              json=True)  # no --format, --recipe
    assert prepare.run(args) == 0
    assert json.loads(capsys.readouterr().out)["store"] == str(tmp_path / "st")


@pytest.mark.parametrize("argv, message", [
    (("mosi",), "mosi needs PATH (see data_cards/mosi.md)"),
    (("ucf101", "{tmp}/absent"), "{tmp}/absent does not exist (see data_cards/ucf101.md for how to obtain it)"),
    (("mosi", "{tmp}", "--recipe", "r.yaml"),
     "--recipe reads the data options of an hf recipe (mmviews prepare hf ROOT --recipe R); mosi takes its options "
     "as flags (mmviews prepare --help)"),
    (("hf", "{tmp}"), "mmviews prepare hf checks a dataset through the command line (mmviews.cli.prepare)"),
    (("hf", "{tmp}", "--format", "parquet", "--recipe", "r.yaml"),
     "--recipe is read by the command line (mmviews.cli.prepare)"),
    (("hf", "{tmp}", "--format", "parquet", "--columns", "image"),
     "--columns takes name=column pairs separated by commas, got 'image'"),
])
def test_an_error_is_one_line_with_status_2(capsys, tmp_path, argv, message):
    rc, out, err = run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert (rc, out, err) == (2, "", f"mmviews prepare: error: {message.format(tmp=tmp_path)}\n")


# --------------------------------------------------------------------------- sentiment


def tiny_sentiment(n: int) -> dict:
    """A split of ``n`` samples of one step and one feature per modality (MMSA keys)."""
    ones = np.ones((n, 1, 1))
    return {"text": ones, "audio": ones, "vision": ones, "regression_labels": np.zeros(n)}


def test_sentiment_prints_each_split_and_the_warnings_of_its_card(capsys, tmp_path):
    data = {s: small_split(n, seed=k) for k, (s, n) in enumerate((("train", 3), ("valid", 2), ("test", 2)))}
    data["train"]["audio"][0, 0, 0] = np.nan
    pkl = write_pickle(tmp_path / "mosi.pkl", data)
    rc, out, err = run(capsys, "mosi", str(pkl), "--json")
    assert rc == 0 and "converting mosi.pkl" in err  # the conversion's progress bar
    store = f"{pkl}.mmstore"
    shapes = "text (4, 3), audio (5, 2), vision (6, 2)"
    assert json.loads(out) == {
        "dataset": "mosi", "source": str(pkl), "store": store, "layout": "mmsa", "split variant": "unknown",
        "train": f"3 samples; {shapes}; labels ['sentiment']; non-finite set to 0: 1",
        "valid": f"2 samples; {shapes}; labels ['sentiment']; non-finite set to 0: 0",
        "test": f"2 samples; {shapes}; labels ['sentiment']; non-finite set to 0: 0",
        "warnings": [f"{pkl}: split sizes (train, valid, test) = (3, 2, 2) match no published mosi file "
                     "(mmsa: (1284, 229, 686)); the copy may be incomplete or a different release",
                     f"{pkl}: feature dims (text, audio, vision) = (3, 2, 2), the card lists (768, 5, 20) for the MMSA "
                     "mosi files (a different feature extraction?)"]}
    assert Path(store, "meta.json").is_file()
    # the store exists: replaced only with --overwrite
    rc, out, err = run(capsys, "mosi", str(pkl))
    assert (rc, out, err) == (2, "", f"mmviews prepare: error: {store} exists; pass overwrite=True (--overwrite) to "
                                     "replace it\n")
    rc, _, err = run(capsys, "mosi", str(pkl), "--overwrite")
    assert rc == 0, err
    # --layout reaches the reader; a KeyError's message is printed without quotes
    rc, out, err = run(capsys, "mosi", str(pkl), "--layout", "mult", "--out", str(tmp_path / "m"))
    keys = "['audio', 'audio_lengths', 'id', 'raw_text', 'regression_labels', 'text', 'text_bert', 'vision', " \
           "'vision_lengths']"
    assert (rc, out, err) == (2, "", f"mmviews prepare: error: {pkl} [train]: missing key 'labels'; keys present: "
                                     f"{keys}\n")


def test_sentiment_names_the_published_split_it_matches(capsys, tmp_path):
    sizes = {"train": 1284, "valid": 229, "test": 686}
    pkl = write_pickle(tmp_path / "mosi.pkl", {s: tiny_sentiment(n) for s, n in sizes.items()})
    rc, out, err = run(capsys, "mosi", str(pkl), "--out", str(tmp_path / "st"), "--json")
    summary = json.loads(out)
    assert rc == 0 and summary["split variant"] == "mmsa" and summary["store"] == str(tmp_path / "st")
    assert [w for w in summary["warnings"] if "split sizes" in w] == []


# --------------------------------------------------------------------------- video


MISSING = [f"Jump/v_Jump_{k}.avi" for k in range(4, 10)]  # listed for training, not on disk


@pytest.fixture(scope="module")
def ucf(tmp_path_factory) -> tuple[Path, Path]:
    """``(UCF-101 folder, its split lists)``: class Jump with 3 clips of 3 frames and an unreadable
    ``v_Jump_bad.avi``; the lists in a folder of another name (found only through
    ``--splits-dir``). Fold 1: clips 0, 1 and 6 missing ones for training, clip 2 for test; fold 2:
    clip 2 for training, clips 0 and 1 for test; fold 3: clip 0, and the unreadable one for test.
    Tests that make the store beside the folder make it with ``--size 16 --jpeg-quality 50``."""
    from test_data_video_prepare import write_ucf_lists
    from test_data_video_store import make_folder

    data = tmp_path_factory.mktemp("ucf")
    root = make_folder(data / "UCF-101", {"Jump": [3, 3, 3]}, bad="Jump/v_Jump_bad.avi")
    lists = data / "my-lists"
    write_ucf_lists(lists, ["Jump/v_Jump_0.avi", "Jump/v_Jump_1.avi", *MISSING], ["Jump/v_Jump_2.avi"], ["Jump"])
    (lists / "trainlist02.txt").write_text("Jump/v_Jump_2.avi 1\n")
    (lists / "testlist02.txt").write_text("Jump/v_Jump_0.avi\nJump/v_Jump_1.avi\n")
    (lists / "trainlist03.txt").write_text("Jump/v_Jump_0.avi 1\n")
    (lists / "testlist03.txt").write_text("Jump/v_Jump_bad.avi\n")
    return root, lists


def test_video_check_only_prints_and_indexes_every_split_of_the_fold(capsys, tmp_path, ucf):
    root, lists = ucf
    index = tmp_path / "index.json"
    rc, out, err = run(capsys, "ucf101", str(root), "--splits-dir", str(lists), "--check-only", "--out", str(index),
                       "--json")
    assert rc == 1, err  # missing and unreadable clips: problems
    summary = json.loads(out)
    written = json.loads(index.read_text())
    unreadable = written["scan"]["unreadable"]
    assert len(unreadable) == 1 and unreadable[0].startswith(f"{root / 'Jump' / 'v_Jump_bad.avi'}: ")
    assert summary == {
        "dataset": "ucf101", "root": str(root), "train (fold 1)": "8 clips listed, 6 missing",
        "test (fold 1)": "1 clips listed, 0 missing", "split lists": str(lists),
        "clips on disk": "4 in 1 classes (card: 13320)", "clips with an audio track": 0,
        "missing (listed, not on disk)": [f"train: {rel}" for rel in MISSING[:5]] + [f"... and 1 more: all in {index}"],
        "unreadable": unreadable, "index": str(index),
        "problems": ["train: 6 listed clips missing", "1 unreadable clips"]}
    assert written["dataset"] == "ucf101" and written["fold"] == 1 and written["splits_dir"] == str(lists)
    assert written["splits"] == {"train": {"clips": 8, "missing": MISSING}, "test": {"clips": 1, "missing": []}}
    assert written["scan"] == {"classes": 1, "clips": 4, "with_audio": 0, "unreadable": unreadable}
    # another fold, and the default index beside the folder (nothing written inside it)
    rc, out, err = run(capsys, "ucf101", str(root), "--splits-dir", str(lists), "--check-only", "--fold", "2", "--json")
    default = root.with_name("UCF-101.mmviews-index.json")
    summary = json.loads(out)
    assert rc == 1 and summary["index"] == str(default) and summary["problems"] == ["1 unreadable clips"]
    assert (summary["train (fold 2)"], summary["test (fold 2)"]) == ("1 clips listed, 0 missing",
                                                                     "2 clips listed, 0 missing")
    assert json.loads(default.read_text())["fold"] == 2 and sorted(p.name for p in root.iterdir()) == ["Jump"]
    default.unlink()


@contextlib.contextmanager
def clips_prepared_here() -> Iterator[list[str]]:
    """The relative paths of the clips prepared in this process (``--workers 0``) while inside."""
    from mmviews.data import video_store

    prepare_clip, prepared = video_store._prepare_clip, []

    def record(root: str, rel: str, *args, **kwargs):
        prepared.append(rel)
        return prepare_clip(root, rel, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(video_store, "_prepare_clip", record)
        yield prepared


def test_video_store_prints_and_reports_everything_it_left_out(capsys, tmp_path, ucf):
    from mmviews.data.video_store import REPORT_FILE, read_manifest

    root, lists = ucf
    store = tmp_path / "store"
    common = ("ucf101", str(root), "--splits-dir", str(lists), "--out", str(store), "--workers", "0", "--size", "16",
              "--num-frames", "4")
    with clips_prepared_here() as in_this_process:
        rc, out, err = run(capsys, *common, "--jpeg-quality", "50", "--json")
    assert rc == 1, err
    assert sorted(in_this_process) == ["Jump/v_Jump_0.avi", "Jump/v_Jump_1.avi", "Jump/v_Jump_2.avi",
                                       "Jump/v_Jump_bad.avi"]  # --workers 0: no worker process
    assert read_manifest(store)["dataset"] == "ucf101"
    report_path = store / REPORT_FILE
    report = json.loads(report_path.read_text())
    bad = "Jump/v_Jump_bad.avi"
    failed = report["failed"]
    assert list(failed) == [bad] and failed[bad].startswith(f"{root / bad}: ")
    clips = [f"Jump/v_Jump_{k}.avi" for k in range(3)]
    assert report == {"dataset": "ucf101", "root": str(root.resolve()), "splits_dir": str(lists), "fold": 1,
                      "store": str(store), "missing": {"train": MISSING, "test": []}, "failed": failed,
                      "truncated": {}, "short": {rel: {"decoded": 3, "needed": 4} for rel in clips}, "num_frames": 4}
    summary = json.loads(out)
    assert isinstance(summary.pop("seconds"), float)
    assert summary == {
        "dataset": "ucf101", "root": str(root), "train (fold 1)": "8 clips listed, 6 missing",
        "test (fold 1)": "1 clips listed, 0 missing", "split lists": str(lists), "clips on disk": "4 (card: 13320)",
        "store": str(store), "prepared now": 3, "already in the store": 0, "clips with an audio track": 0,
        "missing (listed, not on disk)": [f"train: {rel}" for rel in MISSING[:5]] + [f"... and 1 more: all in {report_path}"],
        "unreadable (skipped)": [failed[bad]], "truncated (stored as decoded)": [],
        "short (fewer than --num-frames 4 frames)": [f"{rel}: 3 frames" for rel in clips],
        "report": str(report_path), "problems": ["train: 6 listed clips missing", "1 unreadable clips"]}
    assert read_manifest(store)["options"] == {"format": "jpeg", "size": 16, "flow": "farneback", "jpeg_quality": 50}
    # a rerun resumes: nothing prepared again
    rc, out, _ = run(capsys, *common, "--jpeg-quality", "50", "--json")
    assert (json.loads(out)["prepared now"], json.loads(out)["already in the store"]) == (0, 3)
    # --overwrite starts over with the new options
    rc, out, err = run(capsys, *common, "--overwrite", "--format", "npy", "--flow", "none", "--json")
    assert rc == 1 and json.loads(out)["prepared now"] == 3, err
    assert read_manifest(store)["options"] == {"format": "npy", "size": 16, "flow": None, "jpeg_quality": None}
    # --on-error raise: the unreadable clip stops the command with one line naming it
    rc, out, err = run(capsys, *common, "--overwrite", "--on-error", "raise", "--flow", "none")
    last = err.splitlines()[-1] + "\n"  # after the progress bar
    assert rc == 2 and out == "" and last.startswith(f"mmviews prepare: error: cannot read {root / bad}: ")
    assert last.endswith("(prepare stopped: on_error='raise'; finished clips are kept, a rerun resumes)\n")


def test_video_check_counts_the_clips_a_store_beside_the_folder_marks_unreadable(capsys, tmp_path, ucf):
    root, lists = ucf
    common = ("ucf101", str(root), "--splits-dir", str(lists), "--fold", "3", "--json")
    rc, _, err = run(capsys, *common, "--workers", "0", "--size", "16", "--jpeg-quality", "50")  # the store, beside
    assert rc == 1 and root.with_name("UCF-101.mmstore").is_dir(), err
    rc, out, err = run(capsys, *common, "--check-only", "--out", str(tmp_path / "index.json"))
    assert rc == 1, err  # the unreadable clip
    assert json.loads(out)["test (fold 3)"] == "1 clips listed, 0 missing"  # listed, not left out as in training


def test_video_store_without_out_goes_beside_the_folder(capsys, tmp_path):
    from test_data_video_prepare import write_ucf_lists
    from test_data_video_store import make_folder

    root = make_folder(tmp_path / "UCF-101", {"Run": [2, 2]})
    write_ucf_lists(tmp_path / "ucfTrainTestlist", ["Run/v_Run_0.avi"], ["Run/v_Run_1.avi"], ["Run"])
    rc, out, err = run(capsys, "ucf101", str(root), "--workers", "0", "--size", "8", "--flow", "none",
                       "--num-frames", "2", "--json")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["store"] == str(tmp_path / "UCF-101.mmstore") and summary["problems"] == []
    assert summary["short (fewer than --num-frames 2 frames)"] == []  # 2 frames: enough
    assert summary["split lists"] == str(tmp_path / "ucfTrainTestlist")


# --------------------------------------------------------------------------- Parquet shards


def shards_record(out: Path) -> dict:
    from mmviews.data.shards import SHARDS_META

    record = json.loads((out / SHARDS_META).read_text())
    return {k: record[k] for k in ("source", "columns", "labels", *(["shapes"] if "shapes" in record else []))}


def summary_of(out: str) -> dict:
    summary = json.loads(out)
    assert isinstance(summary.pop("seconds"), float)
    return summary


def test_sentiment_shards_hold_every_modality_and_label_of_the_copy(capsys, tmp_path):
    data = {s: small_split(n, seed=k) for k, (s, n) in enumerate((("train", 3), ("valid", 2), ("test", 2)))}
    pkl = write_pickle(tmp_path / "mosi.pkl", data)
    from mmviews.data import sentiment

    conversions: list[str | None] = []

    def count(path, out, dataset=None, **kwargs):
        conversions.append(dataset)
        return convert(path, out, dataset=dataset, **kwargs)

    convert = sentiment.convert_sentiment_pickle
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sentiment, "convert_sentiment_pickle", count)
        rc, out, err = run(capsys, "mosi", str(pkl), "--format", "parquet", "--shard-rows", "2", "--json")
    assert rc == 0 and "converting mosi.pkl" in err, err  # the pickle's conversion shows its progress
    assert conversions == ["mosi"]  # once, as the dataset named
    default = tmp_path / "mosi.pkl-parquet"  # beside the pickle
    assert summary_of(out) == {"dataset": "mosi", "source": str(pkl), "shards": str(default),
                               "train": "3 rows in 2 shards (0 samples skipped)",
                               "valid": "2 rows in 1 shards (0 samples skipped)",
                               "test": "2 rows in 1 shards (0 samples skipped)", "written now": 7}
    assert shards_record(default) == {
        "source": {"dataset": "mosi", "root": str(pkl.resolve()), "kind": "sentiment", "options": {"layout": "auto"}},
        "columns": {"text": "sequence", "audio": "sequence", "vision": "sequence", "text_ids": "tokens",
                    "raw_text": "text"},
        "labels": {"sentiment": "sentiment", "class": "class"}}
    import pyarrow.parquet as pq

    stored = pq.read_schema(default / "train" / "train-00000.parquet").names
    assert {"text", "audio", "vision", "text_ids", "raw_text", "sentiment", "class"} <= set(stored)
    # a copy without token ids or raw text, with CH-SIMS' per-modality labels: only what it has, the
    # splits asked (the first of them opened first), each row its own shard at a tiny --shard-size-mb
    data = {s: small_split(2, text_bert=False, raw_text=False, seed=k) for k, s in enumerate(("train", "valid", "test"))}
    for split in data.values():
        split["regression_labels_T"] = np.zeros(2)
    pkl = write_pickle(tmp_path / "sims.pkl", data)
    out_dir = tmp_path / "sims-shards"
    rc, out, err = run(capsys, "sims", str(pkl), "--format", "parquet", "--splits", "test,valid", "--shard-size-mb",
                       "0.000001", "--output", str(out_dir), "--json")
    assert rc == 0, err
    assert summary_of(out) == {"dataset": "sims", "source": str(pkl), "shards": str(out_dir),
                               "test": "2 rows in 2 shards (0 samples skipped)",
                               "valid": "2 rows in 2 shards (0 samples skipped)", "written now": 4}
    record = shards_record(out_dir)
    assert record["columns"] == {"text": "sequence", "audio": "sequence", "vision": "sequence"}
    assert record["labels"] == {"sentiment": "sentiment", "sentiment_T": "sentiment_T", "class": "class"}
    # one split asked: its own modalities (this copy has raw text in its test split only)
    data["test"]["raw_text"] = ["a", "b"]
    pkl = write_pickle(tmp_path / "uneven.pkl", data)
    rc, out, err = run(capsys, "sims", str(pkl), "--format", "parquet", "--splits", "test", "--output",
                       str(tmp_path / "test-only"))
    assert rc == 0, err
    assert shards_record(tmp_path / "test-only")["columns"] == {"text": "sequence", "audio": "sequence",
                                                                "vision": "sequence", "raw_text": "text"}
    # another source into the same folder: refused unless --overwrite
    first = str(tmp_path / "mosi.pkl")
    rc, _, err = run(capsys, "mosi", first, "--format", "parquet", "--output", str(out_dir))
    assert rc == 2 and f"{out_dir} holds shards of another source or options" in err
    rc, _, err = run(capsys, "mosi", first, "--format", "parquet", "--output", str(out_dir), "--overwrite")
    assert rc == 0, err
    assert shards_record(out_dir)["source"]["dataset"] == "mosi"
    # --layout reaches the reader (of a pickle not converted yet)
    fresh = write_pickle(tmp_path / "fresh.pkl", data)
    rc, _, err = run(capsys, "sims", str(fresh), "--format", "parquet", "--layout", "mult", "--output", str(tmp_path / "m"))
    assert rc == 2 and "[train]: missing key 'labels'" in err


def test_video_shards_are_made_from_the_store_beside_the_folder(capsys, tmp_path, ucf):
    from mmviews.data.video_store import default_store_path, read_manifest

    root, lists = ucf
    shutil.rmtree(default_store_path(root), ignore_errors=True)  # another test's store: every clip is prepared here
    out_dir = tmp_path / "shards"
    with clips_prepared_here() as in_this_process:
        rc, out, err = run(capsys, "ucf101", str(root), "--format", "parquet", "--splits-dir", str(lists), "--fold",
                           "2", "--workers", "0", "--size", "16", "--jpeg-quality", "50", "--output", str(out_dir),
                           "--json")
    assert rc == 1, err  # the unreadable clip is a problem
    assert len(in_this_process) == 4  # --workers 0: every clip in this process
    store = default_store_path(root)
    summary = summary_of(out)
    unreadable = summary["unreadable (skipped)"]
    assert len(unreadable) == 1 and unreadable[0].startswith(f"{root / 'Jump' / 'v_Jump_bad.avi'}: ")
    assert summary == {"dataset": "ucf101", "source": str(root), "shards": str(out_dir), "store": str(store),
                       "unreadable (skipped)": unreadable, "problems": ["1 unreadable clips"],
                       "train": "1 rows in 1 shards (0 samples skipped)",
                       "test": "2 rows in 1 shards (0 samples skipped)", "written now": 3}
    options = {"format": "jpeg", "size": 16, "flow": "farneback", "jpeg_quality": 50}
    assert read_manifest(store)["options"] == options and read_manifest(store)["dataset"] == "ucf101"
    assert shards_record(out_dir) == {
        "source": {"dataset": "ucf101", "root": str(root.resolve()), "kind": "video", "options": {"fold": 2, **options}},
        "columns": {"frames": "jpeg_frames", "flow_x": "flow_images", "flow_y": "flow_images", "audio": "flac_track"},
        "labels": {"class": "class"}}
    # the splits asked only; --on-error raise reaches the store
    rc, out, err = run(capsys, "ucf101", str(root), "--format", "parquet", "--splits-dir", str(lists), "--fold", "2",
                       "--workers", "0", "--size", "16", "--jpeg-quality", "50", "--splits", "test",
                       "--output", str(tmp_path / "test-only"), "--json")
    assert rc == 1 and [k for k in json.loads(out) if "rows in" in str(json.loads(out)[k])] == ["test"], err
    rc, out, err = run(capsys, "ucf101", str(root), "--format", "parquet", "--splits-dir", str(lists), "--fold", "2",
                       "--workers", "0", "--size", "16", "--jpeg-quality", "50", "--on-error", "raise", "--output",
                       str(tmp_path / "raise"))
    assert rc == 2 and "cannot read" in err and "v_Jump_bad.avi" in err
    # the store's options are the flags': other ones are refused
    rc, out, err = run(capsys, "ucf101", str(root), "--format", "parquet", "--splits-dir", str(lists), "--fold", "2",
                       "--workers", "0", "--size", "16", "--flow", "none", "--output", str(tmp_path / "other"))
    assert rc == 2 and f"{store} was prepared with options" in err


def image_dict(root: Path, sizes: dict[str, int]) -> Path:
    import datasets
    from test_data_prepare_splits import hf_split

    datasets.DatasetDict({s: hf_split(n, 10 * k) for k, (s, n) in enumerate(sizes.items())}).save_to_disk(str(root))
    return root


def test_hf_shards_take_the_folders_splits_and_the_flags_over_the_recipe(capsys, tmp_path):
    root = image_dict(tmp_path / "dict", {"validation": 2, "train": 3})
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--json")
    assert rc == 0, err
    default = tmp_path / "dict-parquet"
    assert summary_of(out) == {"dataset": "hf", "source": str(root), "shards": str(default),
                               "train": "3 rows in 1 shards (0 samples skipped)",  # the DatasetDict's, sorted
                               "validation": "2 rows in 1 shards (0 samples skipped)", "written now": 5}
    assert shards_record(default) == {
        "source": {"dataset": "hf", "root": str(root.resolve()), "kind": "hf",
                   "options": {"columns": {"image": "image"}, "labels": {"class": "label"}}},
        "columns": {"image": "image"}, "labels": {"class": "label"}}
    # the recipe's splits and options, the flags winning over them
    asked: list[str] = []

    def recipe_data(recipe: str) -> dict:
        asked.append(recipe)
        return {"options": {"columns": {"image": "nope"}, "labels": {"class": "label"}}, "splits": ["validation"]}

    out_dir = tmp_path / "recipe"
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--recipe", "r.yaml", "--columns", "image=image",
                       "--labels", "y=label", "--output", str(out_dir), "--json", recipe_data=recipe_data)
    assert rc == 0 and asked == ["r.yaml"], err
    assert [k for k in summary_of(out) if k in ("train", "validation")] == ["validation"]
    assert shards_record(out_dir)["labels"] == {"y": "label"}
    # a recipe option the flags leave alone is named by its key
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--recipe", "r.yaml", "--output", str(out_dir),
                       recipe_data=recipe_data)
    assert (rc, out) == (2, "") and err == (
        f"mmviews prepare: error: key 'data.options.columns' of r.yaml (or --columns MODALITY=COLUMN,...): {root}: "
        "split 'validation' has no column 'nope' (for 'image'); columns: ['image', 'label']\n")
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--recipe", "r.yaml", "--splits", "dev",
                       "--columns", "image=image", "--output", str(out_dir), recipe_data=recipe_data)
    assert rc == 2 and err.startswith(f"mmviews prepare: error: --splits: {root}: no split 'dev'; available: "
                                      "['train', 'validation']")


def test_a_source_format_from_the_recipe_is_named_by_its_key(capsys, tmp_path):
    root = image_dict(tmp_path / "dict", {"train": 2})
    capsys.readouterr()
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--recipe", "r.yaml", "--output",
                       str(tmp_path / "o"), recipe_data=lambda recipe: {"options": {"format": "tiff"}, "splits": []})
    assert (rc, out, err) == (2, "", "mmviews prepare: error: key 'data.options.format' of r.yaml: format must be auto, "
                                     "disk, imagefolder or audiofolder, got 'tiff'\n")


def test_hf_shards_of_a_flat_image_folder_are_one_train_split(capsys, tmp_path):
    from PIL import Image

    root = tmp_path / "flat"
    root.mkdir()
    for i in range(2):
        Image.fromarray(np.full((4, 5, 3), 40 * i, np.uint8)).save(root / f"{i}.png")
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--labels", "", "--json")
    assert rc == 0, err
    assert summary_of(out)["train"] == "2 rows in 1 shards (0 samples skipped)"


def test_hf_splits_whose_arrays_differ_in_shape_are_refused(capsys, tmp_path):
    import datasets

    def split(width: int) -> datasets.Dataset:
        features = datasets.Features({"emb": datasets.List(datasets.Value("float32"), length=width),
                                      "label": datasets.Value("int64")})
        return datasets.Dataset.from_dict({"emb": [[1.0] * width] * 2, "label": [0, 1]}, features=features)

    root = tmp_path / "arrays"
    datasets.DatasetDict({"train": split(3), "test": split(2)}).save_to_disk(str(root))
    capsys.readouterr()  # the library's own progress bars
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--columns", "features=emb", "--splits",
                       "train,test", "--output", str(tmp_path / "o"))
    assert (rc, out) == (2, "") and err == (
        f"mmviews prepare: error: {root}: split 'test' stores its array columns with the shapes {{'emb': [2]}}, "
        "split 'train' with {'emb': [3]}: write the splits to separate --output folders\n")
    rc, out, err = run(capsys, "hf", str(root), "--format", "parquet", "--columns", "features=emb", "--splits", "train",
                       "--output", str(tmp_path / "one"))
    assert rc == 0, err
    assert shards_record(tmp_path / "one")["shapes"] == {"emb": [3]}


def test_more_than_five_problems_of_a_kind_point_at_the_file_that_lists_them_all(capsys, tmp_path):
    from test_data_video_prepare import write_ucf_lists
    from test_data_video_store import make_folder

    root = make_folder(tmp_path / "UCF-101", {"Run": [2] * 6})
    for k in range(6):
        (root / "Run" / f"v_Run_bad{k}.avi").write_bytes(b"not a video")
    write_ucf_lists(tmp_path / "ucfTrainTestlist", ["Run/v_Run_0.avi"], ["Run/v_Run_1.avi"], ["Run"])
    index = tmp_path / "index.json"
    rc, out, err = run(capsys, "ucf101", str(root), "--check-only", "--out", str(index), "--json")
    assert rc == 1, err
    assert json.loads(out)["unreadable"][-1] == f"... and 1 more: all in {index}"
    rc, out, err = run(capsys, "ucf101", str(root), "--out", str(tmp_path / "store"), "--workers", "0", "--size", "8",
                       "--flow", "none", "--num-frames", "3", "--json")
    summary = json.loads(out)
    report = tmp_path / "store" / "prepare-report.json"
    assert rc == 1 and summary["problems"] == ["6 unreadable clips"], err
    assert summary["unreadable (skipped)"][-1] == f"... and 1 more: all in {report}"
    assert summary["short (fewer than --num-frames 3 frames)"] == [
        *(f"Run/v_Run_{k}.avi: 2 frames" for k in range(5)), f"... and 1 more: all in {report}"]
