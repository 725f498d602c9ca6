"""Each dataset built by name (``build_dataset``, the registry's builders, ``mmviews prepare``)
uses its own defaults, never every dataset's:

- UCF-101 and HMDB-51 read only their own split lists, from their own archive folder, for every
  split, when the other dataset's lists (and folders named after it) sit at every place searched
  before it;
- MOSI, MOSEI and CH-SIMS compare a copy with their own published split sizes and feature dims,
  and derive the ``class`` label with their own rule (CH-SIMS: sentiment > 0; MOSI/MOSEI: >= 0).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
from test_data_pickle import mmsa_split, write
from test_data_video_prepare import run_prepare

from mmviews.data import build_dataset

# --------------------------------------------------------------------------- video split lists

ARCHIVE = {"ucf101": "ucfTrainTestlist", "hmdb51": "testTrainMulti_7030_splits"}  # what each archive unpacks to
OTHER = {"ucf101": "hmdb51", "hmdb51": "ucf101"}


def write_lists(folder: Path, kind: str, tag: str) -> None:
    """Split lists of ``kind``'s format naming clips ``A/<tag>_train.avi`` (train) and
    ``A/<tag>_test.avi`` (test) of fold 1, so that the clips read tell which lists were read."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "ucf101":
        (folder / "classInd.txt").write_text("1 A\n2 B\n")
        (folder / "trainlist01.txt").write_text(f"A/{tag}_train.avi 1\n")
        (folder / "testlist01.txt").write_text(f"A/{tag}_test.avi\n")
    else:
        (folder / "A_test_split1.txt").write_text(f"{tag}_train.avi 1\n{tag}_test.avi 2\n")


def crowded_layout(tmp_path: Path, dataset: str) -> Path:
    """``dataset``'s folder where every place searched before its own archive folder holds the
    other dataset's lists (the folder itself, ``splits/``), folders named after the other
    dataset's archive hold lists of both formats, and its own archive folder (beside the dataset
    folder, the last place searched) holds its own lists next to the other format's."""
    data = tmp_path / "data"
    root = data / dataset
    for cls in ("A", "B"):
        (root / cls).mkdir(parents=True)
    other = OTHER[dataset]
    write_lists(root, other, "root")
    write_lists(root / "splits", other, "splits")
    for where, folder in (("inner", root / ARCHIVE[other]), ("beside", data / ARCHIVE[other])):
        write_lists(folder, other, f"{where}_other")
        write_lists(folder, dataset, f"{where}_named_other")
    write_lists(data / ARCHIVE[dataset], dataset, "own")
    write_lists(data / ARCHIVE[dataset], other, "decoy")
    return root


@pytest.mark.parametrize("dataset", ["ucf101", "hmdb51"])
def test_video_datasets_read_only_their_own_split_lists(tmp_path, capsys, dataset):
    root = crowded_layout(tmp_path, dataset)
    own = root.parent / ARCHIVE[dataset]
    for split in ("train", "test"):
        ds = build_dataset(dataset, root=str(root), split=split, audio=False, store=False)
        assert ds.splits_dir == own and ds.clips == [("A", f"A/own_{split}.avi")], (split, ds.splits_dir, ds.clips)
    # `mmviews prepare` (the command's own builder of each split) reads the same lists
    _, out, err = run_prepare(capsys, dataset, str(root), "--check-only", "--out", str(tmp_path / "index.json"))
    assert f"split lists: {own}" in out, out + err
    assert "train (fold 1): 1 clips listed" in out and "test (fold 1): 1 clips listed" in out


# --------------------------------------------------------------------------- sentiment defaults

# Each dataset's published split sizes and feature dims, as its data card lists them.
CARD_SIZES = {"mosi": "(mmsa: (1284, 229, 686))",
              "mosei": "(mmsa: (16326, 1871, 4659), mult: (16265, 1869, 4643))",
              "sims": "(mmsa: (1368, 456, 457))"}
CARD_DIMS = {"mosi": (768, 5, 20), "mosei": (768, 74, 35), "sims": (768, 33, 709)}


@pytest.fixture(scope="module")
def small_pickle(tmp_path_factory) -> Path:
    """An MMSA pickle of 4 samples per split (none of the published sizes), features of MOSI's
    dims (768, 5, 20), the first training sample's sentiment exactly 0."""
    train = mmsa_split(4, sims=True)
    train["regression_labels"][0] = 0.0
    train["regression_labels"][1] = 0.5
    return write(tmp_path_factory.mktemp("sentiment") / "copy.pkl",
                 {"train": train, "valid": mmsa_split(4, sims=True), "test": mmsa_split(4, sims=True)})


@pytest.mark.parametrize("dataset", ["mosi", "mosei", "sims"])
def test_sentiment_datasets_check_against_their_own_card(small_pickle, tmp_path, dataset):
    pkl = tmp_path / "copy.pkl"
    shutil.copy(small_pickle, pkl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = build_dataset(dataset, root=str(pkl), split="train")
    messages = [str(w.message) for w in caught]
    sizes = [m for m in messages if "split sizes" in m]
    assert len(sizes) == 1 and f"match no published {dataset} file {CARD_SIZES[dataset]}" in sizes[0], messages
    assert not any(card in sizes[0] for other, card in CARD_SIZES.items() if other != dataset)
    dims = [m for m in messages if "feature dims" in m]
    if dataset == "mosi":  # the copy has MOSI's dims: nothing to say
        assert dims == [], dims
    else:
        assert len(dims) == 1 and f"the card lists {CARD_DIMS[dataset]} for the MMSA {dataset} files" in dims[0]
    # sentiment 0 is positive for MOSI/MOSEI (>= 0), negative for CH-SIMS (> 0); 0.5 positive for all
    assert ds[0]["labels"]["sentiment"] == 0.0 and ds[1]["labels"]["sentiment"] == 0.5
    assert (ds[0]["labels"]["class"], ds[1]["labels"]["class"]) == ((0, 1) if dataset == "sims" else (1, 1))


def test_a_copy_opened_as_another_sentiment_dataset_takes_that_ones_defaults(small_pickle, tmp_path, capsys):
    """The pickle's store converted as MOSI is converted again when the copy is opened as CH-SIMS
    (its card, its class rule); a store folder prepared as MOSI and opened as CH-SIMS is refused
    with one line naming both (``mmviews prepare`` then ``build_dataset``), never read with MOSI's rule."""
    pkl = tmp_path / "copy.pkl"
    shutil.copy(small_pickle, pkl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert build_dataset("mosi", root=str(pkl))[0]["labels"]["class"] == 1
        with pytest.warns(UserWarning, match=r"match no published sims file"):
            assert build_dataset("sims", root=str(pkl))[0]["labels"]["class"] == 0
        assert build_dataset("sims", root=str(pkl))[0]["labels"]["class"] == 0  # the store of the last conversion
    store = tmp_path / "store"
    rc, _, err = run_prepare(capsys, "mosi", str(pkl), "--out", str(store))
    assert rc == 0, err
    with pytest.raises(ValueError) as info:
        build_dataset("sims", root=str(store))
    message = str(info.value)
    assert f"{store}: this store was prepared as 'mosi'" in message and "not 'sims'" in message and "\n" not in message
    assert build_dataset("mosi", root=str(store))[0]["labels"]["class"] == 1
