"""MSA metrics against hand-worked examples and an independent MMSA-style reference (sklearn)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, f1_score

from mmviews.eval import msa_metrics, weighted_f1


def mmsa_reference_mosi(preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Written from the MMSA metric definitions with sklearn, independently of the library."""
    nz = np.array([i for i, e in enumerate(labels) if e != 0])
    out = {
        "Has0_acc_2": accuracy_score(labels >= 0, preds >= 0),
        "Has0_F1": f1_score(labels >= 0, preds >= 0, average="weighted"),
        "Non0_acc_2": accuracy_score(labels[nz] > 0, preds[nz] > 0),
        "Non0_F1": f1_score(labels[nz] > 0, preds[nz] > 0, average="weighted"),
        "MAE": np.mean(np.abs(preds - labels)),
        "Corr": pearsonr(preds, labels)[0],
    }
    for n, bound in ((5, 2.0), (7, 3.0)):
        p = [round(float(v)) for v in np.clip(preds, -bound, bound)]  # Python's round is half-to-even too
        t = [round(float(v)) for v in np.clip(labels, -bound, bound)]
        out[f"Acc_{n}"] = sum(a == b for a, b in zip(p, t)) / len(t)
    return out


def sims_class(x: float, cuts: list[float]) -> int:
    # intervals (-inf, c0], (c0, c1], ... : count the cut points strictly below x
    return sum(1 for c in cuts if x > c)


def mmsa_reference_sims(preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    p, t = np.clip(preds, -1, 1), np.clip(labels, -1, 1)
    out = {}
    for n, cuts in ((2, [0.0]), (3, [-0.1, 0.1]), (5, [-0.7, -0.1, 0.1, 0.7])):
        cp = [sims_class(v, cuts) for v in p]
        ct = [sims_class(v, cuts) for v in t]
        out[f"Acc_{n}"] = accuracy_score(ct, cp)
        if n == 2:
            out["F1"] = f1_score(ct, cp, average="weighted")
    out["MAE"] = np.mean(np.abs(p - t))
    out["Corr"] = pearsonr(p, t)[0]
    return out


def test_mosi_hand_worked_example():
    labels = [-3.0, -1.5, 0.0, 0.5, 2.5, 3.0]
    preds = [-4.0, -0.6, 0.2, 0.0, 2.4, 3.6]
    m = msa_metrics(preds, labels, "mosi")
    assert set(m) == {"Has0_acc_2", "Has0_F1", "Non0_acc_2", "Non0_F1", "Acc_5", "Acc_7", "MAE", "Corr"}
    assert m["Has0_acc_2"] == 1.0 and m["Has0_F1"] == 1.0
    # label 0 dropped; pred 0.0 for label 0.5 counts as negative
    assert m["Non0_acc_2"] == pytest.approx(0.8)
    assert m["Non0_F1"] == pytest.approx(0.8)
    # half to even: -1.5 -> -2, 0.5 -> 0, 2.5 -> 2 (half away from zero would give 3/6)
    assert m["Acc_7"] == pytest.approx(5 / 6)
    assert m["Acc_5"] == pytest.approx(5 / 6)
    assert m["MAE"] == pytest.approx(3.3 / 6)  # unclipped: the -4 and 3.6 count in full
    assert m["Corr"] == pytest.approx(pearsonr(preds, labels)[0])


def test_sims_hand_worked_example():
    labels = [-1.0, -0.1, 0.0, 0.1, 0.6, 1.0]
    preds = [-1.4, 0.05, -0.1, 0.1, 0.8, 0.7]
    m = msa_metrics(np.array(preds), torch.tensor(labels), "SIMS")
    assert set(m) == {"Acc_2", "Acc_3", "Acc_5", "F1", "MAE", "Corr"}
    assert m["Acc_2"] == pytest.approx(5 / 6)  # 0.0 belongs to [-1, 0]
    assert m["Acc_3"] == pytest.approx(4 / 6)  # -0.1 in the lowest class, 0.1 in the middle one
    assert m["Acc_5"] == pytest.approx(2 / 6)
    assert m["F1"] == pytest.approx((3 * 0.8 + 3 * 6 / 7) / 6)
    assert m["MAE"] == pytest.approx(0.75 / 6)  # after clipping -1.4 to -1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mosi_matches_reference_on_hard_random_data(seed: int):
    rng = np.random.default_rng(seed)
    n = 300
    # labels on MOSI's grid of thirds plus exact zeros and x.5 values; predictions outside [-3, 3]
    labels = np.concatenate([rng.integers(-9, 10, n) / 3.0, np.zeros(20), rng.integers(-3, 3, 30) + 0.5])
    preds = np.concatenate([rng.normal(0, 2.5, n), rng.normal(0, 0.01, 20), rng.integers(-4, 4, 30) + 0.5])
    preds[::37] = 0.0
    ref = mmsa_reference_mosi(preds, labels)
    got = msa_metrics(torch.tensor(preds, dtype=torch.float64), labels, "mosei")
    for k, v in ref.items():
        assert got[k] == pytest.approx(float(v), abs=1e-12), k
        assert isinstance(got[k], float)
    for k in ("Has0_acc_2", "Has0_F1", "Non0_acc_2", "Non0_F1", "Acc_5", "Acc_7"):
        assert 0.0 <= got[k] <= 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_sims_matches_reference_on_cut_points(seed: int):
    rng = np.random.default_rng(seed)
    cut_points = np.array([-1.0, -0.7, -0.1, 0.0, 0.1, 0.7, 1.0])
    labels = np.concatenate([rng.choice(cut_points, 100), rng.uniform(-1, 1, 100)])
    preds = np.concatenate([rng.choice(cut_points, 100), rng.uniform(-1.5, 1.5, 100)])
    ref = mmsa_reference_sims(preds, labels)
    got = msa_metrics(preds, labels, "sims")
    for k, v in ref.items():
        assert got[k] == pytest.approx(float(v), abs=1e-12), k


def test_float32_inputs_give_the_same_classes():
    labels = np.array([-0.1, 0.1, -0.7, 0.7, 0.0], dtype=np.float32)
    preds = labels.copy()
    m = msa_metrics(torch.from_numpy(preds), torch.from_numpy(labels), "sims")
    assert m["Acc_2"] == m["Acc_3"] == m["Acc_5"] == 1.0


def test_single_class_present():
    labels = np.array([0.5, 1.0, 2.0, 3.0])  # only non-negative labels
    preds = np.array([0.4, -1.0, 2.0, -0.2])
    got = msa_metrics(preds, labels, "mosi")
    assert got["Has0_F1"] == pytest.approx(f1_score(labels >= 0, preds >= 0, average="weighted"))
    assert got["Has0_acc_2"] == 0.5
    assert got["Non0_F1"] == pytest.approx(f1_score(labels > 0, preds > 0, average="weighted"))
    same = msa_metrics([1.0, 2.0, 3.0], [1.0, 1.5, 2.0], "mosi")
    assert same["Has0_F1"] == 1.0 and same["Non0_F1"] == 1.0


def test_weighted_f1_matches_sklearn_multiclass():
    rng = np.random.default_rng(3)
    t = rng.integers(0, 5, 200)
    p = rng.integers(0, 6, 200)  # class 5 only ever predicted: support 0, weight 0
    assert weighted_f1(t, p) == pytest.approx(f1_score(t, p, average="weighted", zero_division=0))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown MSA dataset"):
        msa_metrics([0.1], [0.2], "imdb")
    with pytest.raises(ValueError, match="preds has 2 values but labels has 3"):
        msa_metrics([0.1, 0.2], [0.1, 0.2, 0.3], "mosi")
    with pytest.raises(ValueError, match="non-finite"):
        msa_metrics([0.1, float("nan")], [0.1, 0.2], "mosi")
    with pytest.raises(ValueError, match="every label is exactly 0"):
        msa_metrics([0.1, -0.2], [0.0, 0.0], "mosi")
    with pytest.raises(ValueError, match=r"shape \[N\]"):
        msa_metrics(np.zeros((3, 2)), np.zeros((3, 2)), "mosi")
    # [N, 1] is accepted, like MMSA's view(-1)
    m = msa_metrics(np.array([[1.0], [-1.0]]), np.array([[1.0], [-1.0]]), "mosi")
    assert m["Has0_acc_2"] == 1.0


def test_constant_predictions_warn_and_give_nan_corr():
    with pytest.warns(RuntimeWarning, match="Corr is undefined"):
        m = msa_metrics([0.5, 0.5, 0.5], [1.0, -1.0, 2.0], "mosi")
    assert math.isnan(m["Corr"])
    assert m["MAE"] == pytest.approx((0.5 + 1.5 + 1.5) / 3)


def mmsa_float32_classes(x: np.ndarray, edges: list[float]) -> np.ndarray:
    """MMSA's loop on a float32 array: numpy compares it with Python floats in float32."""
    out = np.zeros_like(x)
    for i in range(len(edges) - 1):
        out[np.logical_and(x > edges[i], x <= edges[i + 1])] = i
    return out


def test_sims_cut_points_follow_the_input_precision():
    rng = np.random.default_rng(5)
    values = np.array([-1.0, -0.7, -0.1, 0.0, 0.1, 0.7, 1.0] * 10, dtype=np.float32)
    lab32 = rng.permutation(values)
    pred32 = rng.permutation(values)
    ms3 = [-1.01, -0.1, 0.1, 1.01]
    ms5 = [-1.01, -0.7, -0.1, 0.1, 0.7, 1.01]
    m = msa_metrics(torch.from_numpy(pred32), torch.from_numpy(lab32), "sims")
    assert m["Acc_3"] == pytest.approx(np.mean(mmsa_float32_classes(pred32, ms3) == mmsa_float32_classes(lab32, ms3)))
    assert m["Acc_5"] == pytest.approx(np.mean(mmsa_float32_classes(pred32, ms5) == mmsa_float32_classes(lab32, ms5)))
    # float32(0.1) lies in (-0.1, 0.1] although it exceeds 0.1 in float64
    m1 = msa_metrics(np.array([0.05, -0.5]), np.array([0.1, -0.5], dtype=np.float32), "sims")
    assert m1["Acc_3"] == 1.0
