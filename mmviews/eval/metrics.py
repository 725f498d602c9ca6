"""Multimodal sentiment analysis (MSA) metrics, exactly as the MMSA / M-SENA papers compute them.

Conventions (those of the MMSA / M-SENA evaluation code):

- MOSI / MOSEI (scores in [-3, 3]):
  ``Has0_acc_2`` / ``Has0_F1``: every sample, negative (< 0) vs non-negative (>= 0).
  ``Non0_acc_2`` / ``Non0_F1``: samples whose label is exactly 0 are dropped, then
  label > 0 vs pred > 0 (negative vs positive).
  ``Acc_7``: clip both to [-3, 3], round half to even (``numpy.round``), exact match.
  ``Acc_5``: the same after clipping to [-2, 2]. ``MAE`` on unclipped values, ``Corr``
  Pearson on unclipped values.
- SIMS (scores in [-1, 1]): clip both to [-1, 1]; classes are left-open, right-closed
  intervals: ``Acc_2`` [-1, 0] vs (0, 1]; ``Acc_3`` cut points -0.1, 0.1; ``Acc_5`` cut
  points -0.7, -0.1, 0.1, 0.7. ``F1`` is the weighted F1 of the 2 classes. ``MAE`` and
  ``Corr`` after clipping. Cut points are taken in the precision of each input (float32
  tensors, as MMSA's loaders make, compare with float32(0.1)).

Accuracies and F1 are fractions in [0, 1]. F1 is scikit-learn's ``average="weighted"``
F1, reimplemented in numpy so that scikit-learn stays a test-only dependency.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from mmviews.notices import MMViewsRuntimeWarning

# Names the Acc-2 conventions; reports print it next to the numbers because papers
# disagree on which one they call "Acc-2".
ACC2_CONVENTIONS: dict[str, str] = {
    "Has0_acc_2": "all samples; label >= 0 vs pred >= 0 (negative vs non-negative)",
    "Non0_acc_2": "samples with label exactly 0 dropped; label > 0 vs pred > 0 (negative vs positive)",
    "Acc_2": "SIMS: clipped to [-1, 1]; classes [-1, 0] vs (0, 1]",
}

_SIMS_CUTS: dict[int, tuple[float, ...]] = {
    2: (0.0,),
    3: (-0.1, 0.1),
    5: (-0.7, -0.1, 0.1, 0.7),
}


def _as_1d_float64(x: Any, name: str) -> tuple[np.ndarray, type]:
    """Converts a tensor / array / sequence of shape [N] or [N, 1] to float64 [N].

    Also returns the input's precision (np.float32 for float32 / half inputs, else
    np.float64): MMSA compares float32 tensors with the SIMS cut points in float32, where
    float32(0.1) == 0.1 but float32(0.1) > 0.1 in float64.
    """
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu()
        if x.is_floating_point() and x.element_size() <= 4:
            x = x.float()
        x = x.numpy()
    arr = np.asarray(x)
    low = np.issubdtype(arr.dtype, np.floating) and arr.dtype.itemsize <= 4
    arr = arr.astype(np.float64)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(f"{name} must have shape [N] or [N, 1], got {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name} contains a non-finite value ({arr[bad]}) at index {bad}")
    return arr, (np.float32 if low else np.float64)


def _sims_classes(x: np.ndarray, cuts: tuple[float, ...], precision: type) -> np.ndarray:
    # Cut points rounded to the input's precision, then compared exactly in float64 (which
    # holds every float32 value exactly): the same outcome as comparing in that precision.
    edges = np.asarray(cuts, dtype=precision).astype(np.float64)
    # side="left": a value equal to a cut point falls in the lower (right-closed) interval.
    return np.searchsorted(edges, x, side="left")


def weighted_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """scikit-learn's ``f1_score(y_true, y_pred, average="weighted")`` for discrete labels.

    Per-class F1 ``2 TP / (2 TP + FP + FN)`` over the classes present in ``y_true``,
    weighted by their support in ``y_true``. Classes only predicted (support 0) get
    weight 0, as in scikit-learn.
    """
    y_true = np.asarray(y_true)
    y_pred = np.asarray(y_pred)
    if y_true.shape != y_pred.shape or y_true.ndim != 1:
        raise ValueError(f"y_true {y_true.shape} and y_pred {y_pred.shape} must be equal 1-D shapes")
    classes, support = np.unique(y_true, return_counts=True)
    # [C, N] one-vs-rest indicator matrices; C is tiny (2 to 7 classes).
    is_true = y_true[None, :] == classes[:, None]
    is_pred = y_pred[None, :] == classes[:, None]
    tp = np.sum(is_true & is_pred, axis=1)
    fp = np.sum(~is_true & is_pred, axis=1)
    fn = np.sum(is_true & ~is_pred, axis=1)
    f1 = 2.0 * tp / (2.0 * tp + fp + fn)  # denominator >= support > 0
    return float(np.sum(f1 * support) / np.sum(support))


def _accuracy(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


def _pearson(x: np.ndarray, y: np.ndarray, dataset: str) -> float:
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        which = "predictions" if np.ptp(x) == 0 else "labels"
        warnings.warn(
            f"msa_metrics({dataset!r}): Corr is undefined because the {which} are constant; reported as NaN",
            MMViewsRuntimeWarning,
            stacklevel=3,
        )
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def msa_metrics(preds: Any, labels: Any, dataset: str) -> dict[str, float]:
    """Sentiment regression metrics of the MMSA papers.

    Args:
        preds: predicted scores, shape [N] (or [N, 1]); tensor, array or sequence.
        labels: true scores, shape [N] (or [N, 1]).
        dataset: ``"mosi"``, ``"mosei"`` (keys ``Has0_acc_2, Has0_F1, Non0_acc_2, Non0_F1,
            Acc_5, Acc_7, MAE, Corr``) or ``"sims"`` (keys ``Acc_2, Acc_3, Acc_5, F1, MAE,
            Corr``). Case-insensitive.

    Returns:
        A dict of python floats; accuracies and F1 are fractions in [0, 1]. ``Corr`` is NaN,
        with a RuntimeWarning, when predictions or labels are constant.

    Raises:
        ValueError: unknown dataset, shape mismatch, empty or non-finite input, or (MOSI /
            MOSEI) every label exactly 0 so that the Non0 metrics are undefined.
    """
    name = str(dataset).lower()
    if name not in ("mosi", "mosei", "sims"):
        raise ValueError(f"unknown MSA dataset {dataset!r}; expected 'mosi', 'mosei' or 'sims'")
    p, p_precision = _as_1d_float64(preds, "preds")
    y, y_precision = _as_1d_float64(labels, "labels")
    if p.shape != y.shape:
        raise ValueError(f"preds has {p.shape[0]} values but labels has {y.shape[0]}")

    if name == "sims":
        pc = np.clip(p, -1.0, 1.0)
        yc = np.clip(y, -1.0, 1.0)
        out: dict[str, float] = {}
        classes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n, cuts in _SIMS_CUTS.items():
            cp = _sims_classes(pc, cuts, p_precision)
            cy = _sims_classes(yc, cuts, y_precision)
            classes[n] = (cp, cy)
            out[f"Acc_{n}"] = _accuracy(cp, cy)
        out["F1"] = weighted_f1(classes[2][1], classes[2][0])
        out["MAE"] = float(np.mean(np.abs(pc - yc)))
        out["Corr"] = _pearson(pc, yc, name)
        return out

    nonzero = y != 0
    if not np.any(nonzero):
        raise ValueError(
            f"msa_metrics({dataset!r}): every label is exactly 0, so Non0_acc_2 / Non0_F1 are undefined"
        )
    has0_true, has0_pred = y >= 0, p >= 0
    non0_true, non0_pred = y[nonzero] > 0, p[nonzero] > 0
    return {
        "Has0_acc_2": _accuracy(has0_pred, has0_true),
        "Has0_F1": weighted_f1(has0_true, has0_pred),
        "Non0_acc_2": _accuracy(non0_pred, non0_true),
        "Non0_F1": weighted_f1(non0_true, non0_pred),
        "Acc_5": _accuracy(np.round(np.clip(p, -2.0, 2.0)), np.round(np.clip(y, -2.0, 2.0))),
        "Acc_7": _accuracy(np.round(np.clip(p, -3.0, 3.0)), np.round(np.clip(y, -3.0, 3.0))),
        "MAE": float(np.mean(np.abs(p - y))),
        "Corr": _pearson(p, y, name),
    }
