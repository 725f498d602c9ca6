"""Linear probes and weighted kNN: separable vs random embeddings, and sklearn / hand references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression, Ridge

from mmviews.eval import (
    DEFAULT_WEIGHT_DECAYS,
    knn_accuracy,
    knn_predict,
    linear_probe_classification,
    linear_probe_regression,
)


def clusters(n: int, num_classes: int = 4, d: int = 16, sep: float = 4.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(num_classes, (n,), generator=g)
    centres = torch.zeros(num_classes, d)
    centres[torch.arange(num_classes), torch.arange(num_classes)] = sep
    return centres[y] + torch.randn(n, d, generator=g), y


def random_split(n: int, num_classes: int = 4, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(num_classes, (n,), generator=g)


def test_linear_probe_separable_high_random_chance():
    tr, va, te = clusters(400, seed=0), clusters(100, seed=1), clusters(400, seed=2)
    res = linear_probe_classification(*tr, *va, *te)
    assert res.metrics["test_acc"] > 0.95
    assert res.weight_decay in DEFAULT_WEIGHT_DECAYS
    assert set(res.val_scores) == set(DEFAULT_WEIGHT_DECAYS)
    assert res.val_score == max(res.val_scores.values())
    assert res.predictions.shape == (400,)

    tr, va, te = random_split(400, seed=0), random_split(100, seed=1), random_split(400, seed=2)
    res = linear_probe_classification(*tr, *va, *te)
    assert abs(res.metrics["test_acc"] - 0.25) < 0.08  # 4 classes: chance


def test_linear_probe_matches_sklearn_logistic_regression():
    x, y = clusters(300, num_classes=3, d=8, sep=1.5, seed=3)
    wd = 1e-2
    res = linear_probe_classification(x, y, x[:50], y[:50], x, y, weight_decays=[wd], max_iter=500)
    # sklearn minimises C * sum CE + ||W||^2 / 2, ours mean CE + wd / 2 ||W||^2: C = 1 / (wd N)
    xs = ((x - x.mean(0)) / x.std(0, unbiased=False)).double().numpy()
    ref = LogisticRegression(C=1.0 / (wd * x.shape[0]), tol=1e-10, max_iter=5000).fit(xs, y.numpy())
    ours = res.transform(x).double()
    ref_logits = torch.from_numpy(ref.decision_function(xs))
    # logits are defined up to a per-sample constant: compare centred logits
    torch.testing.assert_close(ours - ours.mean(1, keepdim=True), ref_logits - ref_logits.mean(1, keepdim=True), atol=2e-3, rtol=1e-3)
    assert res.metrics["test_acc"] == pytest.approx(float((ref.predict(xs) == y.numpy()).mean()))


def test_linear_probe_labels_need_not_be_contiguous():
    x, y = clusters(200, num_classes=3, seed=4)
    labels = torch.tensor([7, 11, 42])[y]
    res = linear_probe_classification(x, labels, test_x=x, test_y=labels, weight_decays=[1e-3])  # 10% held out
    assert set(res.predictions.tolist()) <= {7, 11, 42}
    assert res.metrics["test_acc"] > 0.95


def test_regression_probe_matches_sklearn_ridge_and_is_near_zero_on_noise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 10, generator=g) * torch.linspace(0.5, 3, 10)
    w_true = torch.randn(10, generator=g)
    y = x @ w_true + 0.1 * torch.randn(300, generator=g) + 2.0
    wd = 0.05
    res = linear_probe_regression(x[:200], y[:200], x[200:250], y[200:250], x[250:], y[250:], weight_decays=[wd])
    xs = ((x[:200] - x[:200].mean(0)) / x[:200].std(0, unbiased=False)).double().numpy()
    ref = Ridge(alpha=wd * 200).fit(xs, y[:200].double().numpy())  # sum-of-squares form
    np.testing.assert_allclose(res.weight[:, 0].double().numpy(), ref.coef_, rtol=1e-4, atol=1e-4)
    assert float(res.bias) == pytest.approx(ref.intercept_, abs=1e-4)
    assert res.metrics["test_r2"] > 0.99

    # pure noise targets: the probe cannot beat predicting the mean
    noise = torch.randn(300, generator=g)
    res = linear_probe_regression(x[:200], noise[:200], x[200:250], noise[200:250], x[250:], noise[250:])
    assert res.metrics["test_r2"] < 0.1


def test_knn_separable_high_random_chance():
    tr, te = clusters(600, seed=0), clusters(300, seed=1)
    assert knn_accuracy(*tr, *te) > 0.95
    tr, te = random_split(600, seed=0), random_split(400, seed=1)
    assert abs(knn_accuracy(*tr, *te) - 0.25) < 0.08


def test_knn_votes_are_temperature_weighted():
    # Two class-0 neighbours at cosine 0.5, one class-1 neighbour at cosine 0.99:
    # a majority vote says 0; exp(0.99/0.07) > 2 exp(0.5/0.07) says 1.
    a = math.acos(0.5)
    b = math.acos(0.99)
    train = torch.tensor([[math.cos(a), math.sin(a)], [math.cos(a), -math.sin(a)], [math.cos(b), math.sin(b)]])
    labels = torch.tensor([0, 0, 1])
    query = torch.tensor([[1.0, 0.0]])
    assert knn_predict(train, labels, query, k=3).tolist() == [1]
    # with a large temperature the weights flatten and the majority wins
    assert knn_predict(train, labels, query, k=3, temperature=100.0).tolist() == [0]
    # k = 1 keeps only the nearest
    assert knn_predict(train, labels, query, k=1, temperature=100.0).tolist() == [1]


def test_knn_matches_bruteforce_reference():
    g = torch.Generator().manual_seed(1)
    train, labels = torch.randn(120, 6, generator=g), torch.randint(5, (120,), generator=g)
    query = torch.randn(30, 6, generator=g)
    k, t = 20, 0.07
    expected = []
    for q in query:  # slow loop, written from InstDisc's description
        sims = [float(torch.dot(q, x) / (q.norm() * x.norm())) for x in train]
        order = sorted(range(len(sims)), key=lambda j: -sims[j])[:k]
        votes = [0.0] * 5
        for j in order:
            votes[int(labels[j])] += math.exp(sims[j] / t)
        expected.append(max(range(5), key=lambda c: votes[c]))
    assert knn_predict(train, labels, query, k=k, temperature=t, chunk_size=7).tolist() == expected


def test_probe_input_errors():
    x, y = clusters(20)
    with pytest.raises(ValueError, match=r"train labels must be \[N\]"):
        linear_probe_classification(x, y[:5])
    with pytest.raises(ValueError, match="non-finite"):
        linear_probe_regression(x * float("nan"), y.float())
    with pytest.raises(ValueError, match="test embeddings"):
        knn_predict(x, y, torch.zeros(3, 5))


def test_bad_weight_decay_grid():
    x, y = clusters(20)
    with pytest.raises(ValueError, match="weight_decays"):
        linear_probe_classification(x, y, weight_decays=[])
    with pytest.raises(ValueError, match="weight_decays"):
        linear_probe_regression(x, y.float(), weight_decays=[-1.0])


def test_ridge_without_decay_handles_more_dims_than_samples():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(30, 50, generator=g), torch.randn(30, generator=g)
    res = linear_probe_regression(x[:20], y[:20], x[20:], y[20:], weight_decays=[0.0])
    assert torch.isfinite(res.weight).all()
    # minimum-norm interpolation of the training targets
    torch.testing.assert_close(res.transform(x[:20]), y[:20], atol=1e-3, rtol=0)
