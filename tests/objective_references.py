"""Slow reference implementations of the objectives of OBJECTIVES.md, for tests only.

Each reference is written straight from the equations of ``/work/shared/OBJECTIVES.md``
(and the papers behind it) with explicit Python loops over samples i, j and views a, b, g,
independently of the vectorised code in :mod:`mmviews.objectives`. They work on float64
torch scalars so that ``torch.autograd.grad`` through them gives reference gradients.

Every reference has the signature ``reference(z, temperature, mask=None) -> 0-dim tensor``
with ``z`` ``[K, M, d]`` and ``mask`` ``[K, M]`` (True = view present). The mask contract:

- absent views are neither anchors, positives nor negatives/candidates;
- a sample with fewer than two present views adds no term (its present views stay
  negatives for the other samples, except in ``sufficient_statistics`` where its
  rest-of-views mean does not exist);
- the loss is the mean over the valid terms at the formula's own unit of averaging
  (triples (i, a, b) for geometric_pvc and multi_crop; anchors (i, a) for arithmetic_pvc,
  sufficient_statistics, mv_cl1 and mv_cl2; samples i for mv_infonce and mv_dhel).

``simclr`` and ``avg`` take no mask. ``REFERENCES`` maps registry names to references.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

Scalar = torch.Tensor  # a 0-dim tensor
Vector = torch.Tensor  # a 1-dim tensor [d]


# ---------------------------------------------------------------------------------------
# scalar helpers


def lse(scores: Sequence[Scalar]) -> Scalar:
    """log(sum_k exp(scores[k])) over an explicit list of 0-dim tensors."""
    if len(scores) == 0:
        raise ValueError("log-sum-exp over an empty candidate set")
    return torch.logsumexp(torch.stack(list(scores)), dim=0)


def dot(x: Vector, y: Vector) -> Scalar:
    return (x * y).sum()


def normalise(x: Vector) -> Vector:
    return x / torch.sqrt(dot(x, x))


def mean(terms: Sequence[Scalar]) -> Scalar:
    if len(terms) == 0:
        raise ValueError("no valid term: the reference is undefined")
    total = terms[0].new_zeros(())
    for t in terms:
        total = total + t
    return total / len(terms)


def _setup(z: torch.Tensor, mask: torch.Tensor | None):
    """Unit vectors u[i][a] (float64), the present matrix as nested lists, and K, M."""
    z = z.to(torch.float64)
    K, M, _ = z.shape
    u = [[normalise(z[i, a]) for a in range(M)] for i in range(K)]
    if mask is None:
        present = [[True] * M for _ in range(K)]
    else:
        present = [[bool(mask[i, a]) for a in range(M)] for i in range(K)]
    return u, present, K, M


def _scores(u, temperature: float, K: int, M: int):
    """S[i][a][j][b] = <u[i,a], u[j,b]> / tau as nested lists of 0-dim tensors."""
    return [[[[dot(u[i][a], u[j][b]) / temperature for b in range(M)] for j in range(K)] for a in range(M)] for i in range(K)]


def _n_present(present, i: int) -> int:
    return sum(present[i])


# ---------------------------------------------------------------------------------------
# pairwise baselines


def _simclr_two_sets(x: list[Vector], y: list[Vector], temperature: float) -> Scalar:
    """NT-Xent between two lists of K vectors (used as given: no normalisation here).

    Anchor x_i: positive <x_i, y_i>, negatives <x_i, x_j>, <x_i, y_j> for j != i; the same
    with x and y swapped for anchor y_i; mean over the 2K anchors.
    """
    K = len(x)
    terms = []
    for anchors, others in ((x, y), (y, x)):
        for i in range(K):
            positive = dot(anchors[i], others[i]) / temperature
            candidates = [positive]
            for j in range(K):
                if j != i:
                    candidates.append(dot(anchors[i], anchors[j]) / temperature)
                    candidates.append(dot(anchors[i], others[j]) / temperature)
            terms.append(lse(candidates) - positive)
    return mean(terms)


def simclr_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    if mask is not None:
        raise ValueError("simclr takes no mask")
    u, _, K, M = _setup(z, None)
    assert M == 2
    return _simclr_two_sets([u[i][0] for i in range(K)], [u[i][1] for i in range(K)], temperature)


def multi_crop_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Mean over ordered view pairs (a, b) of simclr on views a, b, i.e. (equal counts) the
    mean over triples (i, a, b) of the cross-entropy of anchor (i,a), positive (i,b),
    negatives (j,a) and (j,b) for j != i. Masked: mean over triples with a, b present."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        for a in range(M):
            for b in range(M):
                if a == b or not (present[i][a] and present[i][b]):
                    continue
                positive = S[i][a][i][b]
                candidates = [positive]
                for j in range(K):
                    if j == i:
                        continue
                    if present[j][a]:
                        candidates.append(S[i][a][j][a])
                    if present[j][b]:
                        candidates.append(S[i][a][j][b])
                terms.append(lse(candidates) - positive)
    return mean(terms)


def avg_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Mean over views a of simclr between u[:, a] and the (not re-normalised) mean of the
    other views' unit vectors."""
    if mask is not None:
        raise ValueError("avg takes no mask")
    u, _, K, M = _setup(z, None)
    per_view = []
    for a in range(M):
        x = [u[i][a] for i in range(K)]
        y = []
        for i in range(K):
            rest = torch.zeros_like(u[i][a])
            for b in range(M):
                if b != a:
                    rest = rest + u[i][b]
            y.append(rest / (M - 1))
        per_view.append(_simclr_two_sets(x, y, temperature))
    return mean(per_view)


# ---------------------------------------------------------------------------------------
# poly-view (Shidani et al., 2024)


def _pvc_cross_entropy(S, present, K: int, M: int, i: int, a: int, b: int) -> Scalar:
    """CE[i,a,b] = LSE({S[i,a,i,b]} U {S[i,a,j,g] : j != i, g present}) - S[i,a,i,b]."""
    positive = S[i][a][i][b]
    candidates = [positive]
    for j in range(K):
        if j == i:
            continue
        for g in range(M):
            if present[j][g]:
                candidates.append(S[i][a][j][g])
    return lse(candidates) - positive


def geometric_pvc_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Eq. 13: mean over i, a, b != a (a, b present) of CE[i,a,b]."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        for a in range(M):
            for b in range(M):
                if a != b and present[i][a] and present[i][b]:
                    terms.append(_pvc_cross_entropy(S, present, K, M, i, a, b))
    return mean(terms)


def arithmetic_pvc_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Eq. 12: mean over anchors (i, a) of -(LSE_{b != a}(-CE[i,a,b]) - log(#positives))."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        if _n_present(present, i) < 2:
            continue
        for a in range(M):
            if not present[i][a]:
                continue
            negated = []
            for b in range(M):
                if b != a and present[i][b]:
                    negated.append(-_pvc_cross_entropy(S, present, K, M, i, a, b))
            terms.append(-(lse(negated) - math.log(len(negated))))
    return mean(terms)


def sufficient_statistics_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Eq. 22 / Algorithm 2: r[i,a] = normalise(mean_{b != a, present} u[i,b]); anchor u[i,a],
    positive r[i,a], negatives r[j,g] for j != i (with >= 2 present views), g present."""
    u, present, K, M = _setup(z, mask)
    valid = [_n_present(present, i) >= 2 for i in range(K)]
    r: list[list[Vector | None]] = []
    for i in range(K):
        row: list[Vector | None] = []
        for a in range(M):
            if not (valid[i] and present[i][a]):
                row.append(None)
                continue
            rest = torch.zeros_like(u[i][a])
            count = 0
            for b in range(M):
                if b != a and present[i][b]:
                    rest = rest + u[i][b]
                    count += 1
            row.append(normalise(rest / count))
        r.append(row)
    terms = []
    for i in range(K):
        for a in range(M):
            if r[i][a] is None:
                continue
            positive = dot(u[i][a], r[i][a]) / temperature
            candidates = [positive]
            for j in range(K):
                if j == i:
                    continue
                for g in range(M):
                    if r[j][g] is not None:
                        candidates.append(dot(u[i][a], r[j][g]) / temperature)
            terms.append(lse(candidates) - positive)
    return mean(terms)


# ---------------------------------------------------------------------------------------
# MV-InfoNCE, MV-DHEL and ablations (Koromilas et al., 2025)


def _alignment_per_sample(S, present, M: int, i: int) -> Scalar:
    """LSE over ordered pairs (a, b), a != b, both present, of S[i,a,i,b]."""
    return lse([S[i][a][i][b] for a in range(M) for b in range(M) if a != b and present[i][a] and present[i][b]])


def _within_view_uniformity(S, present, K: int, i: int, g: int, skip_empty: bool) -> Scalar | None:
    """LSE_{j != i, (j,g) present} S[i,g,j,g]; None for an empty set when ``skip_empty``."""
    candidates = [S[i][g][j][g] for j in range(K) if j != i and present[j][g]]
    if not candidates and skip_empty:
        return None
    return lse(candidates)


def mv_infonce_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Eq. 11 with the authors' negative set: per sample i,
    -LSE_{ordered (a,b)} S[i,a,i,b] + LSE_{a, (j,g) != (i,a)} S[i,a,j,g]; mean over i."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        if _n_present(present, i) < 2:
            continue
        uniformity = []
        for a in range(M):
            if not present[i][a]:
                continue
            for j in range(K):
                for g in range(M):
                    if present[j][g] and (j, g) != (i, a):
                        uniformity.append(S[i][a][j][g])
        terms.append(-_alignment_per_sample(S, present, M, i) + lse(uniformity))
    return mean(terms)


def mv_dhel_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None, skip_empty: bool = False) -> Scalar:
    """Eq. 12: per sample i, -LSE_{ordered (a,b)} S[i,a,i,b] + sum_a LSE_{j != i} S[i,a,j,a].

    ``skip_empty``: a view present in sample i only has no within-view candidate; the
    default raises (the formula is undefined), True drops that uniformity term."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        if _n_present(present, i) < 2:
            continue
        term = -_alignment_per_sample(S, present, M, i)
        for a in range(M):
            if present[i][a]:
                uniformity = _within_view_uniformity(S, present, K, i, a, skip_empty)
                if uniformity is not None:
                    term = term + uniformity
        terms.append(term)
    return mean(terms)


def mv_cl1_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> Scalar:
    """Eqs. 7 + 9 (InfoNCE negatives): mean over anchors (i, a) of
    -LSE_{b != a} S[i,a,i,b] + LSE_{j, g != a} S[i,a,j,g]."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        if _n_present(present, i) < 2:
            continue
        for a in range(M):
            if not present[i][a]:
                continue
            alignment = lse([S[i][a][i][b] for b in range(M) if b != a and present[i][b]])
            uniformity = lse([S[i][a][j][g] for j in range(K) for g in range(M) if g != a and present[j][g]])
            terms.append(-alignment + uniformity)
    return mean(terms)


def mv_cl2_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None, skip_empty: bool = False) -> Scalar:
    """Eq. 7 alignment + MV-DHEL uniformity: mean over anchors (i, a) of
    -LSE_{b != a} S[i,a,i,b] + sum_g LSE_{j != i} S[i,g,j,g]. ``skip_empty`` as in mv_dhel."""
    u, present, K, M = _setup(z, mask)
    S = _scores(u, temperature, K, M)
    terms = []
    for i in range(K):
        if _n_present(present, i) < 2:
            continue
        for a in range(M):
            if not present[i][a]:
                continue
            alignment = lse([S[i][a][i][b] for b in range(M) if b != a and present[i][b]])
            uniformity = z.new_zeros((), dtype=torch.float64)
            for g in range(M):
                if present[i][g]:
                    term = _within_view_uniformity(S, present, K, i, g, skip_empty)
                    if term is not None:
                        uniformity = uniformity + term
            terms.append(-alignment + uniformity)
    return mean(terms)


def mi_lower_bound_reference(loss: float, K: int, M: int) -> float:
    """Poly-view c(B, M) - L with B = K*M: log(K*M - M + 1) - loss (nats)."""
    return math.log(K * M - M + 1) - loss


REFERENCES: dict[str, Callable[..., Scalar]] = {
    "simclr": simclr_reference,
    "multi_crop": multi_crop_reference,
    "avg": avg_reference,
    "geometric_pvc": geometric_pvc_reference,
    "arithmetic_pvc": arithmetic_pvc_reference,
    "sufficient_statistics": sufficient_statistics_reference,
    "mv_infonce": mv_infonce_reference,
    "mv_dhel": mv_dhel_reference,
    "mv_cl1": mv_cl1_reference,
    "mv_cl2": mv_cl2_reference,
}

#: objectives whose reference (and implementation) take a view mask
MASKED = ("multi_crop", "geometric_pvc", "arithmetic_pvc", "sufficient_statistics", "mv_infonce", "mv_dhel", "mv_cl1", "mv_cl2")
