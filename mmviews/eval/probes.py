"""Linear probes and weighted kNN on frozen embeddings.

The probes turn embeddings into the numbers a run is judged by, so they follow a fixed protocol
that cannot flatter an encoder: features standardised with the training split's statistics,
each probe fitted on the training split only for every weight decay of a grid, the weight decay
chosen on the validation split (a fixed 10 % of the training split when there is none), the test
split scored once. Classification is an L-BFGS logistic regression, regression a closed-form
ridge; kNN is InstDisc's weighted vote (k = 200, T = 0.07). Everything is deterministic and runs
in torch on the embeddings' device. The protocol step by step: ``docs/evaluation.md`` ("The
probes' protocol").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

DEFAULT_WEIGHT_DECAYS: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


@dataclass
class ProbeResult:
    """Outcome of a linear probe.

    ``weight`` is [d, C] (classification) or [d, 1] (regression) in the standardised space;
    ``predictions`` are the test predictions ([N_test] class indices in the original label
    values, or [N_test] scores), or None when no test split was given.
    """

    weight_decay: float
    val_score: float
    val_scores: dict[float, float]
    metrics: dict[str, float]
    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    classes: torch.Tensor | None = None
    predictions: torch.Tensor | None = field(default=None, repr=False)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Raw probe outputs ([N, C] logits or [N] scores) for embeddings ``x`` [N, d]."""
        x = (x.to(self.mean) - self.mean) / self.std
        out = x @ self.weight + self.bias
        return out if self.classes is not None else out[:, 0]


def _check_xy(x: torch.Tensor, y: torch.Tensor, split: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{split} embeddings must be [N, d], got {tuple(x.shape)}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{split} labels must be [N] with N = {x.shape[0]}, got {tuple(y.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{split} split is empty")
    if not torch.isfinite(x).all():
        raise ValueError(f"{split} embeddings contain non-finite values")


def _check_grid(weight_decays: Sequence[float]) -> list[float]:
    grid = sorted({float(w) for w in weight_decays}, reverse=True)
    if not grid or any(not (w >= 0.0) for w in grid):
        raise ValueError(f"weight_decays must be a non-empty list of values >= 0, got {list(weight_decays)}")
    return grid


def _holdout(x: torch.Tensor, y: torch.Tensor, seed: int, fraction: float = 0.1):
    n = x.shape[0]
    if n < 2:
        raise ValueError("need at least 2 training samples to hold out a validation split")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).to(x.device)
    n_val = max(1, int(round(n * fraction)))
    val, tr = perm[:n_val], perm[n_val:]
    return x[tr], y[tr], x[val], y[val]


def _standardiser(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(0)
    std = x.std(0, unbiased=False).clamp_min(1e-6)
    return mean, std


def _fit_logistic(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    weight_decay: float,
    max_iter: int,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[1]
    if init is None:
        w = torch.zeros(d, num_classes, device=x.device, dtype=x.dtype, requires_grad=True)
        b = torch.zeros(num_classes, device=x.device, dtype=x.dtype, requires_grad=True)
    else:
        w = init[0].clone().requires_grad_(True)
        b = init[1].clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [w, b], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-6,
        tolerance_change=1e-9, line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(x @ w + b, y) + 0.5 * weight_decay * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


def _probe_splits(train_x, train_y, val_x, val_y, test_x, test_y, weight_decays, seed):
    """Checks shared by both probes; without a validation split, 10% of train is held out.
    Returns ``(grid, train_x (float), train_y, val_x, val_y)``."""
    _check_xy(train_x, train_y, "train")
    grid = _check_grid(weight_decays)
    if (val_x is None) != (val_y is None) or (test_x is None) != (test_y is None):
        raise ValueError("give both embeddings and labels for a split, or neither")
    train_x = train_x.float()
    if val_x is None:
        train_x, train_y, val_x, val_y = _holdout(train_x, train_y, seed)
    _check_xy(val_x, val_y, "val")
    return grid, train_x, train_y, val_x, val_y


def linear_probe_classification(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    val_x: torch.Tensor | None = None,
    val_y: torch.Tensor | None = None,
    test_x: torch.Tensor | None = None,
    test_y: torch.Tensor | None = None,
    *,
    weight_decays: Sequence[float] = DEFAULT_WEIGHT_DECAYS,
    max_iter: int = 100,
    seed: int = 0,
) -> ProbeResult:
    """Multinomial logistic-regression probe (protocol: docs/evaluation.md).

    Args:
        train_x, val_x, test_x: embeddings [N, d] of each split.
        train_y, val_y, test_y: integer class labels [N] (any integer values; classes are
            those seen in training, other labels count as errors).
    Returns:
        A ProbeResult whose ``metrics`` hold ``val_acc`` and, with a test split, ``test_acc``.
    """
    grid, train_x, train_y, val_x, val_y = _probe_splits(
        train_x, train_y, val_x, val_y, test_x, test_y, weight_decays, seed
    )
    classes = torch.unique(train_y)

    def encode(y: torch.Tensor) -> torch.Tensor:
        # index of y in `classes`, or -1 for a class unseen in training
        y = y.to(classes.device)
        pos = torch.searchsorted(classes, y).clamp_max(classes.numel() - 1)
        return torch.where(classes[pos] == y, pos, torch.full_like(pos, -1))

    mean, std = _standardiser(train_x)
    xs = (train_x - mean) / std
    xv = (val_x.float().to(mean.device) - mean) / std
    ytr, yv = encode(train_y), encode(val_y)

    best: tuple[float, float, torch.Tensor, torch.Tensor] | None = None
    scores: dict[float, float] = {}
    # Descending decay so that ties keep the more regularised probe; each fit starts from
    # the previous (more regularised) solution, which is close, so L-BFGS needs few steps.
    prev: tuple[torch.Tensor, torch.Tensor] | None = None
    for wd in grid:
        w, b = _fit_logistic(xs, ytr, classes.numel(), wd, max_iter, init=prev)
        prev = (w, b)
        acc = float(((xv @ w + b).argmax(1) == yv).double().mean())
        scores[wd] = acc
        if best is None or acc > best[0]:
            best = (acc, wd, w, b)
    assert best is not None  # _check_grid guarantees one fit
    acc, wd, w, b = best
    result = ProbeResult(wd, acc, scores, {"val_acc": acc}, w, b, mean, std, classes=classes)
    if test_x is not None and test_y is not None:
        _check_xy(test_x, test_y, "test")
        pred_idx = result.transform(test_x.float()).argmax(1)
        result.predictions = classes[pred_idx]
        result.metrics["test_acc"] = float((pred_idx == encode(test_y)).double().mean())
    return result


def _fit_ridge(x: torch.Tensor, y: torch.Tensor, weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x is standardised (zero mean), so the bias is the mean of y and decouples from W.
    n, d = x.shape
    x64, y64 = x.double(), y.double()
    y_mean = y64.mean()
    gram = x64.T @ x64 / n + weight_decay * torch.eye(d, dtype=x64.dtype, device=x.device)
    rhs = x64.T @ (y64 - y_mean) / n
    if weight_decay > 0:
        w = torch.linalg.solve(gram, rhs[:, None])
    else:  # the Gram matrix may be singular (d > n); pinv gives the minimum-norm solution
        w = torch.linalg.pinv(gram, hermitian=True) @ rhs[:, None]
    return w.to(x.dtype), y_mean.to(x.dtype).reshape(1)


def linear_probe_regression(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    val_x: torch.Tensor | None = None,
    val_y: torch.Tensor | None = None,
    test_x: torch.Tensor | None = None,
    test_y: torch.Tensor | None = None,
    *,
    weight_decays: Sequence[float] = DEFAULT_WEIGHT_DECAYS,
    seed: int = 0,
) -> ProbeResult:
    """Ridge-regression probe (protocol: docs/evaluation.md).

    Args:
        train_x, val_x, test_x: embeddings [N, d]; train_y, val_y, test_y: scores [N].
    Returns:
        A ProbeResult; ``metrics`` hold ``val_mae`` and, with a test split, ``test_mae``,
        ``test_mse`` and ``test_r2``; ``predictions`` are the test scores [N_test].
    """
    grid, train_x, train_y, val_x, val_y = _probe_splits(
        train_x, train_y, val_x, val_y, test_x, test_y, weight_decays, seed
    )
    train_y = train_y.float()
    mean, std = _standardiser(train_x)
    xs = (train_x - mean) / std
    xv = (val_x.float().to(mean.device) - mean) / std
    yv = val_y.float().to(mean.device)

    best: tuple[float, float, torch.Tensor, torch.Tensor] | None = None
    scores: dict[float, float] = {}
    for wd in grid:
        w, b = _fit_ridge(xs, train_y, wd)
        mae = float((xv @ w + b)[:, 0].sub(yv).abs().mean())
        scores[wd] = mae
        if best is None or mae < best[0]:
            best = (mae, wd, w, b)
    assert best is not None  # _check_grid guarantees one fit
    mae, wd, w, b = best
    result = ProbeResult(wd, mae, scores, {"val_mae": mae}, w, b, mean, std)
    if test_x is not None and test_y is not None:
        _check_xy(test_x, test_y, "test")
        pred = result.transform(test_x.float())
        yt = test_y.float().to(pred.device)
        result.predictions = pred
        resid = pred - yt
        result.metrics["test_mae"] = float(resid.abs().mean())
        result.metrics["test_mse"] = float((resid**2).mean())
        var = float(((yt - yt.mean()) ** 2).mean())
        if var > 0:
            result.metrics["test_r2"] = 1.0 - result.metrics["test_mse"] / var
    return result


@torch.no_grad()
def knn_predict(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    *,
    k: int = 200,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Weighted kNN (InstDisc / MV-DHEL Table III).

    Args:
        train_x: [N, d] memory embeddings; train_y: [N] integer labels; test_x: [Q, d].
        k: neighbours (clamped to N). temperature: T in the vote weight ``exp(sim / T)``.
    Returns:
        [Q] predicted labels (values taken from ``train_y``).
    """
    _check_xy(train_x, train_y, "train")
    if test_x.ndim != 2 or test_x.shape[1] != train_x.shape[1]:
        raise ValueError(f"test embeddings must be [Q, {train_x.shape[1]}], got {tuple(test_x.shape)}")
    if k < 1 or temperature <= 0:
        raise ValueError(f"need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
    classes, y_idx = torch.unique(train_y, return_inverse=True)
    mem = F.normalize(train_x.float(), dim=1)
    y_idx = y_idx.to(mem.device)
    k = min(k, mem.shape[0])
    preds = []
    for start in range(0, test_x.shape[0], chunk_size):  # chunks bound the [Q, N] similarity memory
        q = F.normalize(test_x[start : start + chunk_size].float().to(mem.device), dim=1)
        sim, idx = (q @ mem.T).topk(k, dim=1)
        # Subtracting each row's top similarity rescales that row's weights by one constant:
        # same argmax, and neither overflow nor an all-zero underflow at small T.
        weights = torch.exp((sim - sim[:, :1]) / temperature)
        votes = torch.zeros(q.shape[0], classes.numel(), device=mem.device)
        votes.scatter_add_(1, y_idx[idx], weights)
        preds.append(votes.argmax(1))
    return classes[torch.cat(preds).to(classes.device)]


def knn_accuracy(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    *,
    k: int = 200,
    temperature: float = 0.07,
) -> float:
    """Top-1 accuracy (fraction) of :func:`knn_predict` on ``test_y`` [Q]."""
    pred = knn_predict(train_x, train_y, test_x, k=k, temperature=temperature)
    return float((pred == test_y.to(pred.device)).double().mean())


@torch.no_grad()
def class_prototype_accuracy(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
) -> float:
    """Zero-shot classification by class prototypes: each class's prototype is the mean of
    the unit-normalised training embeddings ``train_x`` [N, d] of that class (one view, e.g.
    the text), normalised again; each test embedding ``test_x`` [N', d] (another view, e.g.
    the audio) takes the class of the most similar prototype (cosine). Nothing is fitted: the
    views must share one space for this to beat chance. Returns the test accuracy. (The
    ``prototype`` task of :func:`mmviews.eval.evaluate_encoder` chooses the views.)
    """
    _check_xy(train_x, train_y, "train")
    _check_xy(test_x, test_y, "test")
    if train_x.shape[0] == 0 or test_x.shape[0] == 0:
        raise ValueError("class prototypes need at least one training and one test embedding")
    classes, index = torch.unique(train_y, return_inverse=True)
    unit = F.normalize(train_x.float(), dim=1)
    sums = torch.zeros(len(classes), unit.shape[1], dtype=unit.dtype, device=unit.device)
    sums.index_add_(0, index.to(unit.device), unit)
    prototypes = F.normalize(sums, dim=1)
    scores = F.normalize(test_x.float().to(unit.device), dim=1) @ prototypes.T
    predicted = classes.to(unit.device)[scores.argmax(dim=1)]
    return float((predicted == test_y.to(unit.device)).double().mean())
