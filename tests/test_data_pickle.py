"""safe_load_pickle and the MOSI/MOSEI/SIMS sources (MMSA and MulT layouts, store)."""

import os
import pickle
import warnings

import numpy as np
import pytest
import torch

from mmviews.data import CorruptFileError, UnsafePickleError, ViewSetCollator, ViewSpec, build_dataset, safe_load_pickle
from mmviews.data.sentiment import SplitSizeWarning, check_split_sizes, convert_sentiment_pickle, read_sentiment_pickle


def mmsa_split(n, sims=False, La=12, Lv=10, Lt=8, seed=0):
    """An MMSA split of ``n`` samples drawn from a generator of its own, seeded by ``seed`` and the
    other arguments: the same arguments give the same split whatever ran before."""
    rng = np.random.default_rng([seed, n, La, Lv, Lt, int(sims)])
    audio = rng.normal(size=(n, La, 5))
    audio[0, 0, 0] = -np.inf
    bert = np.stack([rng.integers(1000, 2000, size=(n, Lt)).astype(float), np.zeros((n, Lt)), np.zeros((n, Lt))], 1)
    tlen = rng.integers(2, Lt + 1, size=n)
    for i, t in enumerate(tlen):
        bert[i, 1, :t] = 1
    d = {
        "raw_text": [f"sentence {i}" for i in range(n)], "id": [f"vid$_${i}" for i in range(n)],
        "text": rng.normal(size=(n, Lt, 768)), "text_bert": bert, "audio": audio,
        "vision": rng.normal(size=(n, Lv, 20)), "audio_lengths": rng.integers(1, La + 1, size=n),
        "vision_lengths": np.r_[0, rng.integers(1, Lv + 1, size=n - 1)], "regression_labels": rng.uniform(-3, 3, size=n),
    }
    if sims:
        for s in "TAV":
            d[f"regression_labels_{s}"] = rng.uniform(-1, 1, size=n)
    return d


def test_mmsa_split_depends_only_on_its_arguments():
    """The helper other test files build their pickles with: the same arguments give the same
    split whatever was drawn before (it once drew from one generator of this module, so a split's
    lengths depended on the tests that ran first); another seed gives another split."""
    first = mmsa_split(5, sims=True)
    mmsa_split(3)
    again = mmsa_split(5, sims=True)
    assert first.keys() == again.keys()
    for key, value in first.items():
        assert np.array_equal(np.asarray(value), np.asarray(again[key])), key
    other = mmsa_split(5, sims=True, seed=1)
    assert not np.array_equal(other["audio_lengths"], first["audio_lengths"]) or \
        not np.array_equal(other["regression_labels"], first["regression_labels"])


def write(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)
    return path


class Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED_MARKER",))


def test_code_execution_payload_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = write(tmp_path / "evil.pkl", {"train": {"audio": np.zeros(2), "x": Boom()}})
    with pytest.raises(UnsafePickleError, match=r"posix\.system|os\.system"):
        safe_load_pickle(p)
    assert not (tmp_path / "PWNED_MARKER").exists()
    # Through a dataset builder too
    with pytest.raises(UnsafePickleError):
        build_dataset("mosi", root=p)
    assert not (tmp_path / "PWNED_MARKER").exists()


def test_allowed_content_round_trips(tmp_path):
    obj = {"a": np.arange(6.0).reshape(2, 3), "b": [np.float32(1.5), 3, "x"], "c": (1, None), "d": np.array(["u", "v"])}
    for proto in (2, 4, 5):
        p = tmp_path / f"ok{proto}.pkl"
        with open(p, "wb") as f:
            pickle.dump(obj, f, protocol=proto)
        out = safe_load_pickle(p)
        assert np.array_equal(out["a"], obj["a"]) and out["b"][0] == 1.5 and list(out["d"]) == ["u", "v"]


def test_truncated_and_empty_and_missing(tmp_path):
    p = write(tmp_path / "full.pkl", {"train": mmsa_split(4)})
    data = p.read_bytes()
    cut = tmp_path / "cut.pkl"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match="truncated, re-download"):
        safe_load_pickle(cut)
    empty = tmp_path / "empty.pkl"
    empty.write_bytes(b"")
    with pytest.raises(CorruptFileError, match="truncated"):
        safe_load_pickle(empty)
    with pytest.raises(FileNotFoundError):
        safe_load_pickle(tmp_path / "nope.pkl")


def test_mmsa_pickle_loads_with_shapes_lengths_and_inf(tmp_path):
    p = write(tmp_path / "mosi_unaligned.pkl", {"train": mmsa_split(6), "valid": mmsa_split(3), "test": mmsa_split(4)})
    raw = safe_load_pickle(p)["train"]
    with pytest.warns(SplitSizeWarning):
        ds = build_dataset("mosi", root=p, split="train", modalities=("text", "audio", "vision", "text_ids", "raw_text"))
    assert len(ds) == 6
    x = ds[0]
    m = x["modalities"]
    assert m["audio"].shape == (raw["audio_lengths"][0], 5) and torch.isfinite(m["audio"]).all()
    assert m["audio"][0, 0] == 0  # -inf became 0
    assert m["vision"] is None  # length 0 = absent
    tl = int(raw["text_bert"][0, 1].sum())
    assert m["text"].shape == (tl, 768) and m["text_ids"]["input_ids"].shape == (tl,)
    assert m["text_ids"]["input_ids"].tolist() == raw["text_bert"][0, 0, :tl].astype(int).tolist()
    assert m["raw_text"] == "sentence 0" and x["id"] == "vid$_$0"
    assert x["labels"]["sentiment"] == pytest.approx(raw["regression_labels"][0], rel=1e-6)
    assert x["labels"]["class"] == int(raw["regression_labels"][0] >= 0)
    assert np.allclose(m["text"].numpy(), raw["text"][0, :tl], atol=1e-5)
    # the store is memory-mapped
    arrays = ds._open()
    assert isinstance(arrays["audio"], np.memmap)
    # collated: padding, lengths, mask
    spec = ViewSpec.from_config(["text", "audio", {"modality": "vision", "augment": "sequence_default"}])
    b = ViewSetCollator.for_dataset(ds, spec)([ds[i] for i in range(6)])
    assert b.inputs["audio"]["lengths"].tolist() == [min(int(v), 12) for v in raw["audio_lengths"]]
    assert b.mask[0].tolist() == [True, True, False]
    assert b.inputs["vision"]["values"].shape[2] == 20


def test_sims_per_modality_labels(tmp_path):
    p = write(tmp_path / "sims.pkl", {"train": mmsa_split(5, sims=True), "valid": mmsa_split(2, sims=True),
                                      "test": mmsa_split(2, sims=True)})
    with pytest.warns(SplitSizeWarning), pytest.warns(UserWarning, match=r"feature dims .* \(768, 33, 709\)"):
        ds = build_dataset("sims", root=p, split="valid")
    lab = ds[0]["labels"]
    assert {"sentiment", "sentiment_T", "sentiment_A", "sentiment_V", "class"} <= set(lab)
    assert lab["class"] == int(lab["sentiment"] > 0)


def test_mult_layout_left_padding(tmp_path):
    rng = np.random.default_rng(0)

    def split(n):
        v = np.zeros((n, 6, 3))
        a = np.zeros((n, 6, 4))
        t = np.zeros((n, 6, 300))
        for i in range(n):
            v[i, 6 - (i + 1):] = rng.uniform(4, 6, size=(i + 1, 3))  # > 3 whatever the draws: padding is 0
            a[i, 6 - 2:] = 1.0
            t[i, 1:] = 0.5
        return {"vision": v, "audio": a, "text": t, "labels": rng.uniform(-3, 3, size=(n, 1, 1)),
                "id": np.array([[f"c{i}", "0", "1"] for i in range(n)])}

    p = write(tmp_path / "mosei_senti_data.pkl", {"train": split(4), "valid": split(2), "test": split(3)})
    with pytest.warns(SplitSizeWarning):
        ds = build_dataset("mosei", root=p, split="test")
    assert ds.meta["layout"] == "mult"
    for i in range(3):
        m = ds[i]["modalities"]
        assert m["vision"].shape == (i + 1, 3) and (m["vision"] > 3).all()  # only the valid (right-aligned) rows
        assert m["audio"].shape == (2, 4) and m["text"].shape == (5, 300)
        assert ds[i]["id"] == f"c{i}_0_1"


def test_split_size_check_warns_on_mult_variant():
    with pytest.warns(SplitSizeWarning, match="MulT"):
        assert check_split_sizes("mosei", {"train": 16265, "valid": 1869, "test": 4643}) == "mult"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_split_sizes("mosei", {"train": 16326, "valid": 1871, "test": 4659}) == "mmsa"
        assert check_split_sizes("mosi", {"train": 1284, "valid": 229, "test": 686}) == "mmsa"


def test_bad_files_give_named_errors(tmp_path):
    good = {"train": mmsa_split(3), "valid": mmsa_split(2), "test": mmsa_split(2)}
    p = write(tmp_path / "nosplit.pkl", {"train": good["train"], "valid": good["valid"]})
    with pytest.raises(KeyError, match="missing split 'test'"):
        read_sentiment_pickle(p)
    bad = mmsa_split(3)
    del bad["regression_labels"]
    p = write(tmp_path / "nokey.pkl", {**good, "valid": bad})
    with pytest.raises(KeyError, match=r"\[valid\].*regression_labels"):
        read_sentiment_pickle(p)
    bad = mmsa_split(3)
    bad["audio_lengths"] = np.array([1, 99, 2])
    p = write(tmp_path / "badlen.pkl", {**good, "train": bad})
    with pytest.raises(ValueError, match="sample 1 has length 99.*'audio' has 12 steps"):
        read_sentiment_pickle(p)
    bad = mmsa_split(3)
    bad["vision"] = bad["vision"][:2]
    p = write(tmp_path / "badn.pkl", {**good, "train": bad})
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        read_sentiment_pickle(p)


def test_convert_is_atomic_and_refuses_overwrite(tmp_path):
    p = write(tmp_path / "x.pkl", {"train": mmsa_split(3), "valid": mmsa_split(2), "test": mmsa_split(2)})
    out = tmp_path / "store"
    meta = convert_sentiment_pickle(p, out, progress=False)
    assert meta["splits"]["train"]["nonfinite_set_to_zero"]["audio"] == 1
    assert not (tmp_path / "store.partial").exists()
    with pytest.raises(FileExistsError):
        convert_sentiment_pickle(p, out, progress=False)
    ds = build_dataset("mosi", root=out, split="valid")
    assert len(ds) == 2
    with pytest.raises(KeyError, match="no split 'dev2'"):
        build_dataset("mosi", root=out, split="dev2")


def test_prepare_cli_converts_and_reports(tmp_path, capsys):
    import argparse

    from mmviews.data import prepare

    p = write(tmp_path / "mosi.pkl", {"train": mmsa_split(3), "valid": mmsa_split(2), "test": mmsa_split(2)})
    parser = argparse.ArgumentParser()
    prepare.add_arguments(parser)
    assert prepare.run(parser.parse_args(["mosi", str(p), "--out", str(tmp_path / "st")])) == 0
    out = capsys.readouterr().out
    assert "train: 3 samples" in out and "match no published mosi file" in out
    assert len(build_dataset("mosi", root=tmp_path / "st", split="test")) == 2
    # bad input: a clear message and exit status 2, not a traceback
    evil = write(tmp_path / "evil.pkl", {"train": Boom()})
    assert prepare.run(parser.parse_args(["mosi", str(evil), "--out", str(tmp_path / "st2")])) == 2
    assert "refused to load global" in capsys.readouterr().err
    assert prepare.run(parser.parse_args(["mosei", str(tmp_path / "missing.pkl")])) == 2


def test_bench_data_smoke(capsys):
    import argparse

    from mmviews.bench import data as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--workers", "0", "--batch-size", "4", "--batches", "1", "--cases", "synthetic-natural"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "synthetic-natural" in out and '"samples_per_s"' in out
