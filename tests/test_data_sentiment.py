"""Unit guards of :mod:`mmviews.data.sentiment` (MOSI / MOSEI / CH-SIMS pickles and their store).

Each test reads one part of the module's contract on tiny hand-made splits whose expected values
follow from how they were built: which layout a pickle is, the published split sizes and dims
each dataset checks, the one-line errors naming the file, split, key and sample at fault, the
lengths recovered from padding, what a store holds on disk, when a pickle's store is converted
again, and what one sample of a store is.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mmviews.data import build_dataset
from mmviews.data import sentiment as S
from mmviews.notices import MMViewsWarning



def outside_the_module(filename: str) -> bool:
    """A warning is reported at its caller's line, not inside mmviews/data/sentiment.py (the exact
    caller is not checked: under mutmut a trampoline frame sits between the two)."""
    return not filename.endswith(os.path.join("data", "sentiment.py"))


def small_split(n: int = 3, steps: int = 4, *, text_bert: bool = True, lengths: bool = True, ids: bool = True,
                raw_text: bool = True, seed: int = 0) -> dict:
    """An MMSA split of ``n`` samples: text (n, steps, 3), audio (n, steps + 1, 2), vision
    (n, steps + 2, 2), all entries in [1, 2] (no zero, so nothing looks like padding); labels
    ``-1 + i`` (sample 1's sentiment is exactly 0); text mask of sample i: its first i + 1 steps."""
    rng = np.random.default_rng(seed)
    split = {"text": rng.uniform(1, 2, (n, steps, 3)), "audio": rng.uniform(1, 2, (n, steps + 1, 2)),
             "vision": rng.uniform(1, 2, (n, steps + 2, 2)),
             "regression_labels": np.arange(n, dtype=np.float64) - 1.0}
    if text_bert:
        bert = np.zeros((n, 3, steps))
        bert[:, 0, :] = 100 + np.arange(n * steps).reshape(n, steps)
        for i in range(n):
            bert[i, 1, : min(i + 1, steps)] = 1
        split["text_bert"] = bert
    if lengths:
        split["audio_lengths"] = np.array([(i % (steps + 1)) + 1 for i in range(n)])
        split["vision_lengths"] = np.array([0] + [steps + 2] * (n - 1))
    if ids:
        split["id"] = [f"clip$_${i}" for i in range(n)]
    if raw_text:
        split["raw_text"] = [f"s{i} café" for i in range(n)]
    return split


def write_pickle(path: Path, data: dict) -> Path:
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=4)
    return path


def message(info: pytest.ExceptionInfo) -> str:
    """The one line an error carries (a KeyError's without str()'s quotes)."""
    return info.value.args[0]


# --------------------------------------------------------------------------- layout and split names


def test_layout_is_read_from_the_first_split_and_every_alias_of_valid_is_a_split():
    assert S.detect_layout({"validation": {"regression_labels": 0}}) == "mmsa"
    assert S.detect_layout({"val": {"text_bert": 0}}) == "mmsa"
    assert S.detect_layout({"dev": {"classification_labels": 0}}) == "mmsa"
    assert S.detect_layout({"test": {"labels": 0}}) == "mult"
    # other top-level keys are not splits; the first split (in the file's order) decides
    assert S.detect_layout({"meta": {"regression_labels": 0}, "train": {"labels": 0},
                            "test": {"regression_labels": 0}}) == "mult"


@pytest.mark.parametrize("data, expected", [
    ([1, 2], "f.pkl: expected a dict of splits at the top level, got list"),
    ({"b": {}, "a": {}}, "f.pkl: no split found; expected top-level keys ('train', 'valid', 'test'), got ['a', 'b']"),
    ({"dev": [1]}, "f.pkl: split 'dev' is a list, expected a dict"),
    ({"train": {"x": 1, "a": 2}}, "f.pkl: split 'train' has neither 'regression_labels' (MMSA layout) nor 'labels' "
                                  "(MulT layout); keys: ['a', 'x']"),
])
def test_a_pickle_of_no_known_layout_is_named(data, expected):
    with pytest.raises(ValueError) as info:
        S.detect_layout(data, "f.pkl")
    assert message(info) == expected


def test_the_source_defaults_to_a_placeholder_name():
    with pytest.raises(ValueError) as info:
        S.detect_layout(3)
    assert message(info) == "<pickle>: expected a dict of splits at the top level, got int"


# --------------------------------------------------------------------------- published split sizes


def test_sizes_of_an_unknown_or_unnamed_dataset_are_not_checked():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert S.check_split_sizes(None, {"train": 1284, "valid": 229, "test": 686}) is None
        assert S.check_split_sizes("imdb", {"train": 1, "valid": 1, "test": 1}) is None
        assert S.check_split_sizes("sims", {"train": 1368, "valid": 456, "test": 457}) == "mmsa"


def test_the_mult_variant_warns_once_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert S.check_split_sizes("mosei", {"train": 16265, "valid": 1869, "test": 4643}, "m.pkl") == "mult"
    assert [(w.category, outside_the_module(w.filename)) for w in caught] == [(S.SplitSizeWarning, True)]
    assert str(caught[0].message) == (
        "m.pkl: split sizes (16265, 1869, 4643) are the MulT/MultiBench MOSEI split, not the MMSA one "
        "(16326, 1871, 4659): results are not comparable with papers that use the MMSA split; say which split you report")


@pytest.mark.parametrize("sizes, got", [
    ({"train": 1284, "valid": 229}, (1284, 229, -1)),  # a split missing counts as -1
    ({"train": 1285, "valid": 229, "test": 686}, (1285, 229, 686)),  # one sample more
    ({"train": 1284, "valid": 228, "test": 686}, (1284, 228, 686)),  # one less
])
def test_sizes_that_match_no_published_file_warn_with_the_known_ones(sizes, got):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert S.check_split_sizes("mosi", sizes) is None
    assert [(w.category, outside_the_module(w.filename)) for w in caught] == [(S.SplitSizeWarning, True)]
    assert str(caught[0].message) == (
        f"<pickle>: split sizes (train, valid, test) = {got} match no published mosi file (mmsa: (1284, 229, 686)); "
        "the copy may be incomplete or a different release")


# --------------------------------------------------------------------------- labels


def test_the_first_non_finite_label_is_named_with_its_row_and_id():
    S.check_finite_labels({"sentiment": np.array([0.0, -3.0, 3.0])}, "w")  # finite: nothing raised
    labels = {"sentiment": np.array([0.0, 1.0, 2.0]), "sentiment_T": np.array([0.5, np.nan, np.inf])}
    with pytest.raises(ValueError) as info:
        S.check_finite_labels(labels, "f [train]", ["a", "b", "c"])
    assert message(info) == ("f [train]: label 'sentiment_T' is not finite (nan) at row 1 (id 'b'); 2 of 3 labels are "
                             "non-finite: fix or drop those samples")
    with pytest.raises(ValueError) as info:
        S.check_finite_labels({"sentiment": np.array([-np.inf, 1.0])}, "f", ["a", "b"])
    assert message(info) == ("f: label 'sentiment' is not finite (-inf) at row 0 (id 'a'); 1 of 2 labels are non-finite: "
                             "fix or drop those samples")
    # no ids, or fewer ids than rows: the row alone
    for ids in (None, ["a"]):
        with pytest.raises(ValueError) as info:
            S.check_finite_labels(labels, "f", ids)
        assert message(info).startswith("f: label 'sentiment_T' is not finite (nan) at row 1; 2 of 3")


# --------------------------------------------------------------------------- lengths from left padding


def test_lengths_from_left_padding_count_from_the_first_non_zero_step():
    arr = np.zeros((4, 5, 2))
    arr[1, 3:, 1] = 7.0  # the last 2 steps, one feature non-zero
    arr[2] = 1.0  # every step
    arr[3, 0, 0] = 1.0  # a zero step after the first non-zero one is not padding
    arr[3, 4, 1] = 1.0
    lengths = S._lengths_from_left_padding(arr)
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [0, 2, 5, 5]


# --------------------------------------------------------------------------- one split, normalised


def normalise(raw: dict, layout: str = "mmsa", modalities=S.SEQUENCE_MODALITIES) -> dict:
    return S._normalise_split(raw, layout, "f.pkl", "train", modalities)


def test_an_mmsa_split_gives_its_labels_lengths_ids_and_text():
    raw = small_split(3)
    for suffix, value in (("T", 0.1), ("A", 0.2), ("V", 0.3)):
        raw[f"regression_labels_{suffix}"] = np.full(3, value)
    raw["classification_labels"] = np.array([[0], [1], [2]])
    raw["audio_lengths"] = np.array([0.6, 2.4, 5.0])  # rounded to the nearest step
    out = normalise(raw)
    assert out["padding"] == "right" and out["num_samples"] == 3
    assert {k: v.tolist() for k, v in out["labels"].items()} == {
        "sentiment": [-1.0, 0.0, 1.0], "sentiment_T": [0.1] * 3, "sentiment_A": [0.2] * 3, "sentiment_V": [0.3] * 3,
        "class_original": [0.0, 1.0, 2.0]}
    assert {m: v.tolist() for m, v in out["lengths"].items()} == {"text": [1, 2, 3], "audio": [1, 2, 5],
                                                                   "vision": [0, 6, 6]}
    assert all(v.dtype == np.int64 for v in out["lengths"].values())
    assert np.array_equal(out["text_ids"], raw["text_bert"][:, :2, :])
    assert out["ids"] == ["clip$_$0", "clip$_$1", "clip$_$2"] and out["raw_text"] == ["s0 café", "s1 café", "s2 café"]
    assert all(out["features"][m] is raw[m] for m in S.SEQUENCE_MODALITIES)  # no copy of the big arrays


def test_labels_of_any_array_form_become_one_float_per_sample():
    """Column vectors (N, 1) and object arrays of Python numbers, as pickles made by other tools hold them."""
    raw = small_split(3)
    raw["regression_labels"] = np.array([[-1.0], [0], [1]], dtype=object)
    raw["regression_labels_T"] = np.array([[0.5], [0.5], [0.5]], dtype=object)
    raw["classification_labels"] = np.array([0, 1, 2], dtype=object)
    labels = normalise(raw)["labels"]
    assert {k: (v.dtype, v.tolist()) for k, v in labels.items()} == {
        "sentiment": (np.float64, [-1.0, 0.0, 1.0]), "sentiment_T": (np.float64, [0.5] * 3),
        "class_original": (np.float64, [0.0, 1.0, 2.0])}
    raw["audio_lengths"] = np.array([[1], [2], [3]])  # lengths as a column too
    assert normalise(raw)["lengths"]["audio"].tolist() == [1, 2, 3]
    raw["labels"] = np.array([[[1]], [[2]], [[3]]], dtype=object)
    labels = normalise(raw, layout="mult")["labels"]
    assert (labels["sentiment"].dtype, labels["sentiment"].tolist()) == (np.float64, [1.0, 2.0, 3.0])
    S.check_finite_labels({"sentiment": np.array([1, 2], dtype=object)}, "f")  # finite: nothing raised


def test_without_length_keys_every_step_counts_and_text_follows_its_token_mask():
    raw = small_split(2, steps=4, lengths=False, ids=False, raw_text=False)
    raw["text_bert"][1, 1, :] = [0.9999, 1.0001, 1, 0]  # a float mask, rounded
    out = normalise(raw)
    assert {m: v.tolist() for m, v in out["lengths"].items()} == {"text": [1, 3], "audio": [5, 5], "vision": [6, 6]}
    assert out["ids"] == ["0", "1"] and out["raw_text"] is None
    # a text_lengths key wins over the token mask; without text_bert the text has every step
    raw["text_lengths"] = np.array([4, 2])
    assert normalise(raw)["lengths"]["text"].tolist() == [4, 2]
    del raw["text_bert"], raw["text_lengths"]
    out = normalise(raw)
    assert out["lengths"]["text"].tolist() == [4, 4] and out["text_ids"] is None
    # a text_bert of two rows (ids, mask) is enough
    raw["text_bert"] = np.ones((2, 2, 4))
    assert normalise(raw)["lengths"]["text"].tolist() == [4, 4]


def test_only_the_modalities_asked_are_read():
    raw = small_split(2)
    del raw["vision"], raw["vision_lengths"]
    out = normalise(raw, modalities=("text", "audio"))
    assert sorted(out["features"]) == ["audio", "text"] and sorted(out["lengths"]) == ["audio", "text"]
    out = normalise(raw, modalities=("audio",))
    assert sorted(out["lengths"]) == ["audio"] and out["text_ids"] is not None


def test_a_mult_split_is_left_padded_with_row_ids():
    feats = np.zeros((2, 3, 2))
    feats[0, 2] = 1.0
    feats[1, 1:] = 1.0
    raw = {"text": feats, "audio": feats[:, :, :1], "vision": feats, "labels": np.array([[[0.5]], [[-2.0]]]),
           "id": np.array([["v", "1", "2"], ["w", "3", "4"]])}
    out = normalise(raw, layout="mult")
    assert out["padding"] == "left" and out["text_ids"] is None and out["raw_text"] is None
    assert {m: v.tolist() for m, v in out["lengths"].items()} == {m: [1, 2] for m in S.SEQUENCE_MODALITIES}
    assert {k: v.tolist() for k, v in out["labels"].items()} == {"sentiment": [0.5, -2.0]}
    assert out["ids"] == ["v_1_2", "w_3_4"]
    raw["id"] = raw["id"].reshape(2, 1, 3)  # rows kept nested one level deeper: flattened the same
    assert normalise(raw, layout="mult")["ids"] == ["v_1_2", "w_3_4"]


def broken(change) -> dict:
    raw = small_split(3)
    change(raw)
    return raw


KEYS = ("['audio', 'audio_lengths', 'id', 'raw_text', 'regression_labels', 'text', 'text_bert', 'vision', "
        "'vision_lengths']")


@pytest.mark.parametrize("raw, layout, error, expected", [
    (broken(lambda r: r.pop("audio")), "mmsa", KeyError,
     "f.pkl [train]: missing key 'audio'; keys present: " + KEYS.replace("'audio', ", "")),
    (broken(lambda r: r.pop("regression_labels")), "mmsa", KeyError,
     "f.pkl [train]: missing key 'regression_labels'; keys present: " + KEYS.replace("'regression_labels', ", "")),
    (broken(lambda r: r.pop("regression_labels")), "mult", KeyError,
     "f.pkl [train]: missing key 'labels'; keys present: " + KEYS.replace("'regression_labels', ", "")),
    (broken(lambda r: r.update(audio=np.ones((3, 5)))), "mmsa", ValueError,
     "f.pkl [train]: 'audio' must be an array (N, L, D), got (3, 5)"),
    (broken(lambda r: r.update(audio=[[[1.0]]] * 3)), "mmsa", ValueError,
     "f.pkl [train]: 'audio' must be an array (N, L, D), got list"),
    (broken(lambda r: r.update(vision=r["vision"][:2])), "mmsa", ValueError,
     "f.pkl [train]: modalities disagree on the number of samples: {'text': 3, 'audio': 3, 'vision': 2}"),
    (broken(lambda r: r.update(labels=np.zeros(2))), "mult", ValueError,
     "f.pkl [train]: 'labels' has shape (2,); expected one sentiment score per sample (N = 3, e.g. (N, 1, 1))"),
    (broken(lambda r: r.update(regression_labels_A=np.zeros(2))), "mmsa", ValueError,
     "f.pkl [train]: label 'sentiment_A' has 2 entries but the features have 3 samples"),
    (broken(lambda r: r.update(regression_labels=np.zeros(4))), "mmsa", ValueError,
     "f.pkl [train]: label 'sentiment' has 4 entries but the features have 3 samples"),
    (broken(lambda r: r["regression_labels"].__setitem__(2, np.nan)), "mmsa", ValueError,
     "f.pkl [train]: label 'sentiment' is not finite (nan) at row 2 (id 'clip$_$2'); 1 of 3 labels are non-finite: "
     "fix or drop those samples"),
    (broken(lambda r: r.update(text_bert=np.ones((3, 4)))), "mmsa", ValueError,
     "f.pkl [train]: 'text_bert' must be (N, 3, L) with N = 3, got (3, 4)"),
    (broken(lambda r: r.update(text_bert=np.ones((2, 3, 4)))), "mmsa", ValueError,
     "f.pkl [train]: 'text_bert' must be (N, 3, L) with N = 3, got (2, 3, 4)"),
    (broken(lambda r: r.update(text_bert=np.ones((3, 1, 4)))), "mmsa", ValueError,
     "f.pkl [train]: 'text_bert' must be (N, 3, L) with N = 3, got (3, 1, 4)"),
    (broken(lambda r: r.update(audio_lengths=np.array([1, 2]))), "mmsa", ValueError,
     "f.pkl [train]: 'audio_lengths' has 2 entries but 'audio' has 3 samples"),
    (broken(lambda r: r.update(audio_lengths=np.array([1, 5, 6]))), "mmsa", ValueError,  # one step past L = 5
     "f.pkl [train]: lengths of 'audio' disagree with the array: sample 2 has length 6 but 'audio' has 5 steps "
     "(shape (3, 5, 2))"),
    (broken(lambda r: r.update(vision_lengths=np.array([0, -1, 6]))), "mmsa", ValueError,
     "f.pkl [train]: lengths of 'vision' disagree with the array: sample 1 has length -1 but 'vision' has 6 steps "
     "(shape (3, 6, 2))"),
    (broken(lambda r: r.update(id=["a", "b"])), "mmsa", ValueError,
     "f.pkl [train]: 'id' has 2 entries but the features have 3 samples"),
])
def test_a_broken_split_is_named_with_the_key_and_sample_at_fault(raw, layout, error, expected):
    with pytest.raises(error) as info:
        normalise(raw, layout=layout)
    assert type(info.value) is error and message(info) == expected


def test_lengths_at_the_array_length_and_zero_are_valid():
    raw = small_split(3)
    raw["audio_lengths"] = np.array([0, 5, 5])  # L = 5 exactly
    assert normalise(raw)["lengths"]["audio"].tolist() == [0, 5, 5]


# --------------------------------------------------------------------------- a whole pickle


def three_splits(**sizes: int) -> dict:
    sizes = sizes or {"train": 3, "valid": 2, "test": 2}
    return {s: small_split(n, seed=k) for k, (s, n) in enumerate(sizes.items())}


def test_reading_a_pickle_returns_its_layout_sizes_and_splits(tmp_path):
    p = write_pickle(tmp_path / "a.pkl", {"train": small_split(3), "dev": small_split(2), "test": small_split(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info, splits = S.read_sentiment_pickle(p)
    assert info == {"layout": "mmsa", "variant": None, "dataset": None, "sizes": {"train": 3, "valid": 2, "test": 2}}
    assert list(splits) == ["train", "valid", "test"]
    # one split, asked by any of its names
    info, splits = S.read_sentiment_pickle(p, splits=("validation",))
    assert list(splits) == ["valid"] and info["sizes"] == {"valid": 2}
    # the layout forced: a MulT reading of an MMSA file finds no 'labels'
    with pytest.raises(KeyError, match=r"\[train\]: missing key 'labels'"):
        S.read_sentiment_pickle(p, layout="mult")


def test_errors_of_a_pickle_name_the_file(tmp_path):
    p = write_pickle(tmp_path / "odd.pkl", {"train": {"x": 1}})
    with pytest.raises(ValueError) as info:
        S.read_sentiment_pickle(p)
    assert message(info) == (f"{p}: split 'train' has neither 'regression_labels' (MMSA layout) nor 'labels' "
                             "(MulT layout); keys: ['x']")
    broken = three_splits()
    broken["valid"]["audio_lengths"] = np.array([1])
    p = write_pickle(tmp_path / "broken.pkl", broken)
    with pytest.raises(ValueError) as info:
        S.read_sentiment_pickle(p)
    assert message(info) == f"{p} [valid]: 'audio_lengths' has 1 entries but 'audio' has 2 samples"


def test_a_wrong_layout_or_a_missing_split_names_the_option_at_fault(tmp_path):
    p = write_pickle(tmp_path / "a.pkl", {"train": small_split(3), "test": small_split(2)})
    with pytest.raises(ValueError) as info:
        S.read_sentiment_pickle(p, layout="csv")
    assert message(info) == "layout must be 'auto', 'mmsa' or 'mult', got 'csv'" and info.value.option == "layout"
    with pytest.raises(KeyError) as info:
        S.read_sentiment_pickle(p)
    assert message(info) == f"{p}: missing split 'valid'; splits present: ['test', 'train']"
    assert info.value.option == "split"


def test_split_sizes_are_checked_only_when_all_three_splits_are_read(tmp_path):
    sizes = {"train": 1284, "valid": 229, "test": 686}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert S.check_split_sizes("mosi", sizes) == "mmsa"
    assert caught == []
    p = write_pickle(tmp_path / "a.pkl", three_splits())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info, _ = S.read_sentiment_pickle(p, dataset="mosi", splits=("train", "test"))
    assert info["variant"] is None and not [w for w in caught if "split sizes" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        S.read_sentiment_pickle(p, dataset="mosi")
    assert [str(w.message) for w in caught if w.category is S.SplitSizeWarning] == [
        f"{p}: split sizes (train, valid, test) = (3, 2, 2) match no published mosi file (mmsa: (1284, 229, 686)); "
        "the copy may be incomplete or a different release"]


def test_feature_dims_are_compared_with_the_card_for_mmsa_files_only(tmp_path):
    p = write_pickle(tmp_path / "a.pkl", three_splits())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        S.read_sentiment_pickle(p, dataset="sims")
    dims = [w for w in caught if "feature dims" in str(w.message)]
    assert [(str(w.message), w.category, outside_the_module(w.filename)) for w in dims] == [
        (f"{p}: feature dims (text, audio, vision) = (3, 2, 2), the card lists (768, 33, 709) for the MMSA sims files "
         "(a different feature extraction?)", MMViewsWarning, True)]
    mult = {s: {"text": np.ones((2, 3, 3)), "audio": np.ones((2, 3, 2)), "vision": np.ones((2, 3, 2)),
                "labels": np.zeros((2, 1, 1))} for s in S.SPLITS}
    for data, dataset in ((mult, "sims"), (three_splits(), None)):
        q = write_pickle(tmp_path / "b.pkl", data)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            S.read_sentiment_pickle(q, dataset=dataset)
        assert not [w for w in caught if "feature dims" in str(w.message)]


# --------------------------------------------------------------------------- the store on disk


def test_arrays_are_written_in_chunks_with_non_finite_values_counted_and_zeroed(tmp_path):
    arr = np.arange(30, dtype=np.float64).reshape(5, 2, 3)
    arr[0, 0, 0], arr[4, 1, 2], arr[2, 1, 1] = np.nan, -np.inf, np.inf
    assert S._write_npy(tmp_path / "a.npy", arr, chunk=2) == 3
    back = np.load(tmp_path / "a.npy")
    assert back.dtype == np.float32
    assert np.array_equal(back, np.where(np.isfinite(arr), arr, 0.0).astype(np.float32))
    objects = arr.astype(object)  # features kept as Python floats (an object array) are converted too
    assert S._write_npy(tmp_path / "o.npy", objects, chunk=4) == 3
    assert np.array_equal(np.load(tmp_path / "o.npy"), back)


def store_of(tmp_path: Path, data: dict | None = None, name: str = "x.pkl", **kwargs) -> tuple[Path, Path]:
    pkl = write_pickle(tmp_path / name, data or three_splits())
    out = tmp_path / (name + ".store")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.convert_sentiment_pickle(pkl, out, progress=False, **kwargs)
    return pkl, out


def test_the_store_holds_every_split_as_float32_arrays_with_its_record(tmp_path):
    data = three_splits()
    data["train"]["audio"][0, 0, 0] = -np.inf
    data["train"]["classification_labels"] = np.array([0, 1, 2])
    pkl, out = store_of(tmp_path, data, dataset="mosi")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "mmviews-sentiment-store" and meta["version"] == 1
    assert (meta["dataset"], meta["layout"], meta["variant"]) == ("mosi", "mmsa", None)
    assert meta["source"] == {"path": str(pkl.resolve()), "size": pkl.stat().st_size, "mtime": pkl.stat().st_mtime}
    assert list(meta["splits"]) == ["train", "valid", "test"]
    train = meta["splits"]["train"]
    assert train == {"num_samples": 3, "padding": "right",
                     "modalities": {"text": {"shape": [3, 4, 3]}, "audio": {"shape": [3, 5, 2]},
                                    "vision": {"shape": [3, 6, 2]}},
                     "labels": ["class_original", "sentiment"], "has_text_ids": True, "has_raw_text": True,
                     "nonfinite_set_to_zero": {"text": 0, "audio": 1, "vision": 0}}
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "test", "train", "valid"]  # no marker left
    files = sorted(p.name for p in (out / "train").iterdir())
    assert files == ["audio.npy", "audio_lengths.npy", "ids.json", "label_class_original.npy", "label_sentiment.npy",
                     "raw_text.json", "text.npy", "text_ids.npy", "text_lengths.npy", "vision.npy",
                     "vision_lengths.npy"]
    audio = np.load(out / "train" / "audio.npy")
    assert audio.dtype == np.float32 and audio[0, 0, 0] == 0.0
    assert np.array_equal(audio[1], data["train"]["audio"][1].astype(np.float32))
    assert np.load(out / "train" / "audio_lengths.npy").tolist() == [1, 2, 3]
    label = np.load(out / "train" / "label_sentiment.npy")
    assert label.dtype == np.float32 and label.tolist() == [-1.0, 0.0, 1.0]
    text_ids = np.load(out / "train" / "text_ids.npy")
    assert text_ids.dtype == np.int64 and np.array_equal(text_ids, data["train"]["text_bert"][:, :2].astype(np.int64))
    assert json.loads((out / "train" / "ids.json").read_text()) == ["clip$_$0", "clip$_$1", "clip$_$2"]
    assert "s0 café" in (out / "train" / "raw_text.json").read_text(encoding="utf-8")  # not \u-escaped


def test_a_split_without_token_ids_or_raw_text_stores_neither(tmp_path):
    data = {s: small_split(2, text_bert=False, raw_text=False) for s in S.SPLITS}
    _, out = store_of(tmp_path, data)
    meta = S.read_store_meta(out)
    assert not meta["splits"]["train"]["has_text_ids"] and not meta["splits"]["train"]["has_raw_text"]
    assert not (out / "train" / "text_ids.npy").exists() and not (out / "train" / "raw_text.json").exists()
    for missing in ("raw_text", "text_ids"):
        with pytest.raises(KeyError) as info:
            S.SentimentStoreDataset(out, "train", modalities=(missing,))
        assert message(info) == (f"{out} [train]: modalities [{missing!r}] not in the store "
                                 "(available: ['audio', 'text', 'vision'])")


def test_the_stores_parent_folders_are_made_and_an_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    pkl = write_pickle(tmp_path / "x.pkl", three_splits())
    out = tmp_path / "a" / "b" / "store"
    calls = []

    def fail_on_the_fourth_array(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 4:
            raise OSError("disk full")
        return real(*args, **kwargs)

    real = S._write_npy
    monkeypatch.setattr(S, "_write_npy", fail_on_the_fourth_array)
    with pytest.raises(OSError, match="disk full"):
        S.convert_sentiment_pickle(pkl, out, progress=False)
    partial = out.with_name("store.partial")
    assert not out.exists() and (partial / ".mmviews-partial").is_file() and (partial / "train" / "text.npy").is_file()
    monkeypatch.setattr(S, "_write_npy", real)
    S.convert_sentiment_pickle(pkl, out, progress=False)
    assert not partial.exists() and S.read_store_meta(out)["splits"]["valid"]["num_samples"] == 2


def test_the_conversion_shows_a_bar_counting_arrays_unless_told_not_to(tmp_path, capsys):
    pkl = write_pickle(tmp_path / "bar.pkl", three_splits())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.convert_sentiment_pickle(pkl, tmp_path / "quiet", progress=False)
        assert capsys.readouterr().err == ""
        S.convert_sentiment_pickle(pkl, tmp_path / "shown")
    err = capsys.readouterr().err
    assert "converting bar.pkl" in err and "9/9" in err and "array" in err


def test_an_existing_store_is_replaced_only_when_asked_and_only_if_it_is_one(tmp_path):
    pkl, out = store_of(tmp_path)
    with pytest.raises(FileExistsError) as info:
        S.convert_sentiment_pickle(pkl, out, progress=False)
    assert message(info) == f"{out} exists; pass overwrite=True (--overwrite) to replace it"
    (out / "old.txt").write_text("left by an earlier store")
    S.convert_sentiment_pickle(pkl, out, overwrite=True, progress=False)
    assert not (out / "old.txt").exists() and (out / "meta.json").is_file()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty and is not an mmviews sentiment store"):
        S.convert_sentiment_pickle(pkl, foreign, overwrite=True, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_partial_folder_is_removed_only_if_an_interrupted_conversion_left_it(tmp_path):
    pkl = write_pickle(tmp_path / "x.pkl", three_splits())
    out = tmp_path / "st"
    partial = tmp_path / "st.partial"
    partial.mkdir()
    (partial / "keep.txt").write_text("not mmviews'")
    with pytest.raises(FileExistsError) as info:
        S.convert_sentiment_pickle(pkl, out, progress=False)
    assert message(info) == (f"{partial} exists and was not left by an interrupted conversion (no .mmviews-partial); "
                             "mmviews does not delete it: move it away or choose another store folder")
    assert (partial / "keep.txt").is_file() and not out.exists()
    (partial / ".mmviews-partial").write_text("")
    S.convert_sentiment_pickle(pkl, out, progress=False)
    assert not partial.exists() and S.read_store_meta(out)["splits"]["test"]["num_samples"] == 2


def test_only_an_absent_folder_an_empty_one_or_a_sentiment_store_is_replaceable(tmp_path):
    S.check_replaceable_store(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    S.check_replaceable_store(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError) as info:
        S.check_replaceable_store(tmp_path / "file")
    assert message(info) == (f"{tmp_path / 'file'} is a file, not a sentiment store: mmviews does not replace it; "
                             "choose another store folder (--out / data.options.store_dir)")
    not_ours = (f" is not empty and is not an mmviews sentiment store (no meta.json of format "
                "'mmviews-sentiment-store'): mmviews does not delete it; choose another store folder "
                "(--out / data.options.store_dir)")
    for name, meta in (("nometa", None), ("badjson", "{"), ("list", "[1]"), ("other", '{"format": "other"}'),
                       ("binary", b"\xff\xfe")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "x").write_text("")
        if isinstance(meta, bytes):
            (folder / "meta.json").write_bytes(meta)
        elif meta is not None:
            (folder / "meta.json").write_text(meta)
        with pytest.raises(FileExistsError) as info:
            S.check_replaceable_store(folder)
        assert message(info) == f"{folder}{not_ours}", name
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "meta.json").write_text('{"format": "mmviews-sentiment-store"}')
    S.check_replaceable_store(ours)


def test_reading_a_store_record_names_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        S.read_store_meta(tmp_path)
    assert message(info) == (f"{tmp_path} is not a sentiment store (no meta.json); create it with "
                             "`mmviews prepare mosi PATH.pkl` or convert_sentiment_pickle()")
    (tmp_path / "meta.json").write_text('{"format": "mmviews-video-store"}')
    with pytest.raises(ValueError) as info:
        S.read_store_meta(tmp_path)
    assert message(info) == f"{tmp_path / 'meta.json'}: not a mmviews-sentiment-store (format = 'mmviews-video-store')"


# --------------------------------------------------------------------------- reading a store


def test_a_store_split_reads_its_samples(tmp_path):
    data = three_splits()
    _, out = store_of(tmp_path, data, dataset="mosi")
    ds = S.SentimentStoreDataset(out, "dev", modalities=("text", "audio", "vision", "text_ids", "raw_text"))
    assert ds.split == "valid" and len(ds) == 2 and ds.dataset == "mosi"
    raw = data["valid"]
    item = ds[1]
    assert item["index"] == 1 and item["id"] == "clip$_$1"
    mods = item["modalities"]
    assert torch.equal(mods["audio"], torch.from_numpy(raw["audio"][1, :2].astype(np.float32)))
    assert torch.equal(mods["vision"], torch.from_numpy(raw["vision"][1].astype(np.float32)))
    assert torch.equal(mods["text"], torch.from_numpy(raw["text"][1, :2].astype(np.float32)))
    assert mods["text_ids"]["input_ids"].tolist() == raw["text_bert"][1, 0, :2].astype(int).tolist()
    assert mods["text_ids"]["attention_mask"].tolist() == [1, 1] and mods["text_ids"]["attention_mask"].dtype == torch.long
    assert mods["raw_text"] == "s1 café"
    assert item["labels"] == {"sentiment": 0.0, "class": 1}
    assert ds[0]["modalities"]["vision"] is None  # length 0: absent
    assert ds.modality_info() == {"text": {"kind": "sequence", "shape": (4, 3)},
                                  "audio": {"kind": "sequence", "shape": (5, 2)},
                                  "vision": {"kind": "sequence", "shape": (6, 2)},
                                  "text_ids": {"kind": "tokens"}, "raw_text": {"kind": "text"}}
    assert ds.labels().tolist() == [-1.0, 0.0] and ds.labels("sentiment").dtype == np.float32


def test_indexes_outside_the_split_are_refused(tmp_path):
    _, out = store_of(tmp_path)
    ds = S.SentimentStoreDataset(out, "test")
    assert ds[0]["index"] == 0 and ds[1]["index"] == 1
    for index in (-1, 2):
        with pytest.raises(IndexError) as info:
            ds[index]
        assert message(info) == f"index {index} out of range for 2 samples in {out} [test]"


def test_left_padded_features_and_empty_token_masks_are_read_from_the_right_end(tmp_path):
    def split(n):
        feats = np.zeros((n, 3, 2))
        for i in range(n):
            feats[i, 3 - i :] = i + 1.0  # sample i: its last i steps
        return {"text": feats, "audio": feats, "vision": feats, "labels": np.arange(n, dtype=float).reshape(n, 1, 1)}

    _, out = store_of(tmp_path, {s: split(3) for s in S.SPLITS})
    ds = S.SentimentStoreDataset(out, "train")
    assert ds[0]["modalities"]["audio"] is None
    assert ds[2]["modalities"]["audio"].tolist() == [[3.0, 3.0], [3.0, 3.0]]
    assert ds[1]["id"] == "1"
    # MMSA text with an empty token mask: no tokens
    data = three_splits()
    data["train"]["text_bert"][0, 1] = 0
    _, out = store_of(tmp_path, data, name="y.pkl")
    assert S.SentimentStoreDataset(out, "train", modalities=("text_ids",))[0]["modalities"]["text_ids"] is None


def test_a_store_refuses_a_missing_split_modality_or_non_finite_label(tmp_path):
    data = {s: small_split(2, text_bert=False) for s in S.SPLITS}
    _, out = store_of(tmp_path, data)
    with pytest.raises(KeyError) as info:
        S.SentimentStoreDataset(out, "extra")
    assert message(info) == f"{out}: no split 'extra'; available: ['test', 'train', 'valid']"
    assert info.value.option == "split"
    with pytest.raises(KeyError) as info:
        S.SentimentStoreDataset(out, "train", modalities=("audio", "text_ids", "faces"))
    assert message(info) == (f"{out} [train]: modalities ['text_ids', 'faces'] not in the store "
                             "(available: ['audio', 'raw_text', 'text', 'vision'])")
    assert info.value.option == "modalities"
    np.save(out / "valid" / "label_sentiment.npy", np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(ValueError) as info:
        S.SentimentStoreDataset(out, "valid")
    assert message(info) == (f"{out} [valid]: label 'sentiment' is not finite (nan) at row 1; 1 of 2 labels are "
                             "non-finite: fix or drop those samples")


def test_a_store_prepared_without_a_dataset_takes_the_class_rule_it_is_opened_with(tmp_path):
    _, out = store_of(tmp_path)  # dataset None
    assert S.SentimentStoreDataset(out, "train", dataset="sims")[1]["labels"]["class"] == 0  # 0 > 0 is false
    assert S.SentimentStoreDataset(out, "train")[1]["labels"]["class"] == 1  # 0 >= 0
    _, mosi = store_of(tmp_path, name="m.pkl", dataset="mosi")
    with pytest.raises(ValueError) as info:
        S.SentimentStoreDataset(mosi, "train", dataset="sims")
    assert info.value.option == "root"
    assert message(info) == (f"{mosi}: this store was prepared as 'mosi' (mmviews prepare mosi), not 'sims': open it as "
                             "'mosi', or prepare the copy again as 'sims'")


def test_a_pickled_dataset_leaves_its_memory_maps_behind(tmp_path):
    _, out = store_of(tmp_path)
    ds = S.SentimentStoreDataset(out, "train")
    first = ds[0]
    assert ds._arrays is not None
    state = ds.__getstate__()
    assert state["_arrays"] is None and ds._arrays is not None and state["store"] == out
    copy = pickle.loads(pickle.dumps(ds))
    assert torch.equal(copy[0]["modalities"]["audio"], first["modalities"]["audio"])


# --------------------------------------------------------------------------- opening a pickle or a store


def test_a_pickles_store_is_converted_again_only_when_the_pickle_or_the_dataset_changed(tmp_path, capsys):
    pkl = write_pickle(tmp_path / "c.pkl", three_splits())
    store = tmp_path / "elsewhere"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = S.open_sentiment(pkl, "test", store_dir=store, modalities=("audio",))
        assert ds.store == store and ds.modalities == ("audio",) and len(ds) == 2
        assert not (tmp_path / "c.pkl.mmstore").exists() and capsys.readouterr().err == ""

        def converted() -> int:
            return (store / "meta.json").stat().st_ino  # a conversion writes a new file beside the old one

        before = converted()
        S.open_sentiment(pkl, "train", store_dir=store)
        S.open_sentiment(pkl, "train", store_dir=store, dataset=None)
        assert converted() == before  # same pickle, same dataset
        S.open_sentiment(pkl, "train", store_dir=store, dataset="mosi", progress=True)
        assert "converting c.pkl" in capsys.readouterr().err
        assert S.read_store_meta(store)["dataset"] == "mosi"
        before = converted()
        S.open_sentiment(pkl, "train", store_dir=store)  # no dataset named: the mosi store serves
        S.open_sentiment(pkl, "train", store_dir=store, dataset="mosi")  # the same dataset: it serves too
        assert converted() == before
        st = pkl.stat()
        os.utime(pkl, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same size, new mtime
        S.open_sentiment(pkl, "train", store_dir=store, dataset="mosi")
        assert converted() != before
        before = converted()
        write_pickle(pkl, three_splits(train=4, valid=2, test=2))  # rewritten: another size
        os.utime(pkl, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert len(S.open_sentiment(pkl, "train", store_dir=store, dataset="mosi")) == 4
        assert converted() != before
        # the default store is beside the pickle; a forced layout reaches the reader
        assert S.open_sentiment(pkl, "valid").store == tmp_path / "c.pkl.mmstore"
        with pytest.raises(KeyError, match="missing key 'labels'"):
            S.open_sentiment(pkl, "valid", store_dir=tmp_path / "mult", layout="mult")


def test_the_layout_asked_for_is_the_layout_read_or_refused_by_name(tmp_path):
    """A pickle whose splits hold the keys of both layouts reads as MMSA by default (its
    ``regression_labels``) and as MulT when asked (its ``labels``). A pickle's store holding
    another layout than the one asked for is converted again (it once served the stored one
    silently); ``auto`` takes the stored one. A store folder cannot be converted: asked for
    another layout than it holds, it is refused with one line naming the option and both layouts."""
    data = three_splits()
    for k, split in enumerate(data.values()):
        split["labels"] = (np.arange(len(split["regression_labels"])) + 10.0 * (k + 1)).reshape(-1, 1, 1)
    pkl = write_pickle(tmp_path / "both.pkl", data)
    store = tmp_path / "store"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mmsa = S.open_sentiment(pkl, "train", store_dir=store)
        assert (mmsa.meta["layout"], mmsa[1]["labels"]["sentiment"]) == ("mmsa", 0.0)
        mult = S.open_sentiment(pkl, "train", store_dir=store, layout="mult")
        assert (mult.meta["layout"], mult[1]["labels"]["sentiment"]) == ("mult", 11.0)
        assert S.read_store_meta(store)["layout"] == "mult"
        assert S.open_sentiment(pkl, "valid", store_dir=store)[1]["labels"]["sentiment"] == 21.0  # auto: the store serves
        assert S.open_sentiment(pkl, "valid", store_dir=store, layout="mmsa")[1]["labels"]["sentiment"] == 0.0
    assert S.open_sentiment(store, "train", layout="mmsa").meta["layout"] == "mmsa"
    assert S.open_sentiment(store, "train", layout="auto").meta["layout"] == "mmsa"
    with pytest.raises(ValueError) as info:
        S.open_sentiment(store, "train", layout="mult")
    assert info.value.option == "layout"
    assert message(info) == (f"{store}: this store holds the 'mmsa' layout of its pickle, not the 'mult' asked for "
                             "(option layout): open it with layout 'auto' or 'mmsa', or prepare the pickle again "
                             "with --layout mult")


def test_the_training_split_and_the_sequences_are_opened_unless_told_otherwise(tmp_path):
    pkl, out = store_of(tmp_path)
    for ds in (S.SentimentStoreDataset(out), S.open_sentiment(out)):
        assert (ds.split, len(ds), ds.modalities) == ("train", 3, ("text", "audio", "vision"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = S.open_sentiment(pkl, store_dir=tmp_path / "other")
    assert (ds.split, len(ds)) == ("train", 3)
    assert S.open_sentiment(out, "test", modalities=("raw_text",)).modalities == ("raw_text",)  # a store folder


def test_opening_a_path_that_is_not_there_names_it(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        S.open_sentiment(tmp_path / "gone.pkl")
    assert message(info) == f"no such file or store: {tmp_path / 'gone.pkl'}"


def test_each_sentiment_builder_needs_a_root_and_passes_on_split_dataset_and_options(tmp_path):
    for dataset in ("mosi", "mosei", "sims"):
        with pytest.raises(ValueError) as info:
            build_dataset(dataset)
        assert message(info) == (f"{dataset}: pass root= the MMSA/MulT .pkl file or a store made by "
                                 f"`mmviews prepare {dataset}` (see data_cards/{dataset}.md)")
        assert info.value.option == "root"
    pkl = write_pickle(tmp_path / "b.pkl", three_splits())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = build_dataset("sims", root=pkl, split="valid", modalities=("raw_text",))
    assert (ds.split, ds.dataset, ds.modalities, len(ds)) == ("valid", "sims", ("raw_text",), 2)
    assert ds[1]["labels"]["class"] == 0  # sentiment 0 under CH-SIMS' rule


def test_features_are_float32_and_the_store_is_memory_mapped_whatever_its_files_hold(tmp_path):
    data = three_splits()
    data["train"]["text_bert"][1, 1] = [1, 0, 0, 0]  # sample 1: exactly one token
    _, out = store_of(tmp_path, data)
    np.save(out / "train" / "audio.npy", np.load(out / "train" / "audio.npy").astype(np.float64))  # edited since
    ds = S.SentimentStoreDataset(out, "train", modalities=("audio", "text_ids"))
    item = ds[1]
    assert item["modalities"]["audio"].dtype == torch.float32
    assert item["modalities"]["text_ids"]["input_ids"].tolist() == [int(data["train"]["text_bert"][1, 0, 0])]
    arrays = ds._open()
    assert all(isinstance(arrays[name], np.memmap) for name in ("text", "audio", "vision", "text_ids"))
