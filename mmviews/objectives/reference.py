"""Slow reference implementations of the objectives, written straight from the equations.

Each reference follows the formula of its objective (stated in the docstring of the
objective's module, and in the paper behind it) with explicit Python loops over samples
i, j and views a, b, g. They share no code with the vectorised implementations (none of the
score blocks, masks or helpers of :mod:`mmviews.objectives._base`), so that a test comparing
the two checks the vectorised algebra rather than reusing it. They compute in float64 on
0-dim torch tensors, so that ``torch.autograd.grad`` through them gives reference gradients.

They are slow (Python-level work grows as K^2 M^2 and more): tests run them on a few samples,
and ``mmviews bench objectives`` times them at a small batch as its "reference loop" column.

Every entry of :data:`REFERENCES` has the signature ``reference(z, temperature, mask=None) ->
0-dim tensor`` with ``z`` ``[K, M, d]`` and ``mask`` ``[K, M]`` (True = view present). The mask
contract:

- absent views are neither anchors, positives nor negatives/candidates;
- a sample with fewer than two present views adds no term (its present views stay
  negatives for the other samples, except in ``sufficient_statistics`` where its
  rest-of-views mean does not exist);
- the loss is the mean over the valid terms at the formula's own unit of averaging
  (triples (i, a, b) for geometric_pvc and multi_crop; anchors (i, a) for arithmetic_pvc,
  sufficient_statistics, mv_cl1 and mv_cl2; samples i for mv_infonce and mv_dhel);
  ``siglip`` sums a term over every scored pair, a sample with one present view included
  (as a negative), and divides by its number of positive pairs (i, a, b).

``simclr`` and ``avg`` take no mask; :data:`MASKED` lists the references that take one.
``simclr`` and ``geometric_pvc`` also take ``critic`` (``"cosine"``, or ``"squared_l2"``: the
scores ``-||z_ia - z_jb||^2 / tau`` of the unnormalised z, distances summed coordinate by coordinate).
``siglip``'s reference also takes ``bias`` (default -10, the objective's), and its temperature
and bias may be 0-dim tensors, so that the gradients of the learned scale and bias can be taken.
The objectives with more parameters have their own signatures: :func:`fmicl_reference`,
:func:`er_reference` (and :func:`er_reference_terms`), :func:`ipmc_reference`.
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


def simclr_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None,
                     critic: str = "cosine") -> Scalar:
    """NT-Xent of the two views; ``critic="squared_l2"``: :func:`squared_l2_simclr_reference`."""
    if mask is not None:
        raise ValueError("simclr takes no mask")
    if critic == "squared_l2":
        return squared_l2_simclr_reference(z, temperature)
    if critic != "cosine":
        raise ValueError(f"unknown critic {critic!r}")
    u, _, K, M = _setup(z, None)
    assert M == 2
    return _simclr_two_sets([u[i][0] for i in range(K)], [u[i][1] for i in range(K)], temperature)


def squared_l2_distance(x: Vector, y: Vector) -> Scalar:
    """sum_k (x_k - y_k)^2, coordinate by coordinate."""
    total = x.new_zeros(())
    for k in range(len(x)):
        total = total + (x[k] - y[k]) ** 2
    return total


def squared_l2_simclr_reference(z: torch.Tensor, temperature: float) -> Scalar:
    """NT-Xent with the critic of Daunhawer et al. (2023) on the unnormalised z [K, 2, d]:
    S(p, q) = -||p - q||^2 / tau. Anchor (i, a): positive (i, 1 - a), negatives (j, 0) and
    (j, 1) for j != i; mean over the 2K anchors."""
    z = z.to(torch.float64)
    K, M, _ = z.shape
    assert M == 2
    terms = []
    for i in range(K):
        for a in range(2):
            positive = -squared_l2_distance(z[i, a], z[i, 1 - a]) / temperature
            candidates = [positive]
            for j in range(K):
                if j != i:
                    for g in range(2):
                        candidates.append(-squared_l2_distance(z[i, a], z[j, g]) / temperature)
            terms.append(lse(candidates) - positive)
    return mean(terms)


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


def geometric_pvc_reference(z: torch.Tensor, temperature: float, mask: torch.Tensor | None = None,
                            critic: str = "cosine") -> Scalar:
    """Eq. 13: mean over i, a, b != a (a, b present) of CE[i,a,b]. ``critic="squared_l2"``:
    S[i,a,j,b] = -||z_ia - z_jb||^2 / tau on z as given (not normalised)."""
    u, present, K, M = _setup(z, mask)
    if critic == "squared_l2":
        x = z.to(torch.float64)
        S = [[[[-squared_l2_distance(x[i, a], x[j, b]) / temperature for b in range(M)] for j in range(K)]
              for a in range(M)] for i in range(K)]
    elif critic == "cosine":
        S = _scores(u, temperature, K, M)
    else:
        raise ValueError(f"unknown critic {critic!r}")
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


# ---------------------------------------------------------------------------------------
# f-MICL (Lu et al., 2024): Table 1 of the paper, extended to M views


def f_prime_reference(divergence: str, G: Scalar, q: float) -> Scalar:
    """The critic ``f'(G)`` of the f-Gaussian similarity ``G``."""
    if divergence == "kl":
        return torch.log(G) + 1
    if divergence == "js":
        return math.log(2) + torch.log(G / (1 + G))
    if divergence == "pearson":
        return 2 * (G - 1)
    if divergence == "sh":
        return 1 - G ** (-0.5)
    if divergence == "tsallis":
        return q / (q - 1) * G ** (q - 1)
    if divergence == "vlc":
        return 1 - 4 / (G + 1) ** 2
    raise ValueError(f"unknown divergence {divergence!r}")


def f_star_of_f_prime_reference(divergence: str, G: Scalar, q: float) -> Scalar:
    """The negative term ``f*(f'(G)) = G f'(G) - f(G)``."""
    if divergence == "kl":
        return G
    if divergence == "js":
        return torch.log((1 + G) / 2)
    if divergence == "pearson":
        return G**2 - 1
    if divergence == "sh":
        return G**0.5 - 1
    if divergence == "tsallis":
        return G**q
    if divergence == "vlc":
        # G f'(G) - f(G) with f(G) = (G - 1)^2 / (G + 1). The paper's Table 1 prints 3 - 4/(G + 1),
        # which is not the composition of its own f* and f' columns (it gives 1 at G = 1, where
        # f*(f'(1)) = f*(0) = 0).
        return (G - 1) * (3 * G + 1) / (G + 1) ** 2
    raise ValueError(f"unknown divergence {divergence!r}")


def conjugate_reference(divergence: str, t: Scalar, q: float) -> Scalar:
    """``f*(t) = sup_{x >= 0} (x t - f(x))`` (Table 1's f* column, with its x = 0 branch)."""
    if divergence == "kl":
        return torch.exp(t - 1)
    if divergence == "js":
        return -torch.log(2 - torch.exp(t))
    if divergence == "pearson":
        return t**2 / 4 + t if t >= -2 else torch.tensor(-1.0, dtype=t.dtype) + 0 * t
    if divergence == "sh":
        return t / (1 - t)
    if divergence == "tsallis":
        return ((q - 1) / q * t) ** (q / (q - 1)) if t > 0 else 0 * t
    if divergence == "vlc":
        return 4 - t - 4 * torch.sqrt(1 - t) if t >= -3 else torch.tensor(-1.0, dtype=t.dtype) + 0 * t
    raise ValueError(f"unknown divergence {divergence!r}")


def fmicl_reference(
    z: torch.Tensor,
    divergence: str,
    similarity: str = "gaussian",
    alpha: float = 40.0,
    sigma: float = 0.7071,
    mu: float = 1.0,
    temperature: float = 0.1,
    q: float = 3.0,
    mask: torch.Tensor | None = None,
) -> Scalar:
    """``-(mean_pos s - alpha * mean_neg f*(s))``: positives every ordered pair of present views
    of one sample, negatives every pair of present views of two different samples. Gaussian:
    ``G = mu exp(-||u - v||^2 / (2 sigma^2))``, ``s = f'(G)``; cosine: ``s = <u, v> / temperature``."""
    u, present, K, M = _setup(z, mask)

    def critic(x: Vector, y: Vector) -> tuple[Scalar, Scalar]:
        if similarity == "cosine":
            s = dot(x, y) / temperature
            return s, conjugate_reference(divergence, s, q)
        G = mu * torch.exp(-((x - y) ** 2).sum() / (2 * sigma**2))
        return f_prime_reference(divergence, G, q), f_star_of_f_prime_reference(divergence, G, q)

    positives, negatives = [], []
    for i in range(K):
        for a in range(M):
            for b in range(M):
                if a != b and present[i][a] and present[i][b]:
                    positives.append(critic(u[i][a], u[i][b])[0])
            for j in range(K):
                for b in range(M):
                    if j != i and present[i][a] and present[j][b]:
                        negatives.append(critic(u[i][a], u[j][b])[1])
    return -(mean(positives) - alpha * mean(negatives))


# ---------------------------------------------------------------------------------------
# Entropy-Reconstruction (Rodriguez-Galvez et al., 2023, eqs. 6-9)


def log_vmf_normaliser_reference(d: int, kappa: float) -> float:
    """``log C_d(kappa) = (d/2 - 1) log kappa - (d/2) log(2 pi) - log I_{d/2-1}(kappa)``, with
    the Bessel function in 30-digit arithmetic (mpmath, installed with torch through sympy)."""
    import mpmath

    nu = d / 2 - 1
    with mpmath.workdps(30):
        value = nu * mpmath.log(kappa) - (d / 2) * mpmath.log(2 * mpmath.pi) - mpmath.log(mpmath.besseli(nu, kappa))
    return float(value)


def er_reference_terms(
    z: torch.Tensor,
    temperature: float = 0.1,
    estimator: str = "joe",
    mask: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
) -> tuple[Scalar, Scalar, Scalar]:
    """``(loss, entropy, reconstruction)`` with ``loss = -(entropy + reconstruction)``.

    Per view a, over its present samples (K_a of them), ``log p(u_ia) = LSE_j kappa <u_ia, u_ja>
    - log K_a + log C_d`` (self-pair included); entropy ``H_a = -mean_i log p`` (joe) or
    ``-sum_i softmax(log p)_i log p`` (plugin); ``entropy = mean_a H_a`` over views with a present
    sample. ``reconstruction`` = mean over present ordered pairs (a, b), a != b, of
    ``kappa <u_ia, t_ib> + log C_d``, with ``t`` the normalised, detached teacher (else ``u``)."""
    K, M, d = z.shape
    kappa = 1 / temperature
    log_c = log_vmf_normaliser_reference(d, kappa)
    u, present, K, M = _setup(z, mask)
    if teacher is None:
        t = u
    else:
        teacher = teacher.to(torch.float64)
        t = [[normalise(teacher[i, a]).detach() for a in range(M)] for i in range(K)]
    entropies = []
    for a in range(M):
        samples = [i for i in range(K) if present[i][a]]
        if not samples:
            continue
        log_p = []
        for i in samples:
            kernel = torch.stack([kappa * dot(u[i][a], u[j][a]) for j in samples])
            log_p.append(torch.logsumexp(kernel, dim=0) - math.log(len(samples)) + log_c)
        log_p_a = torch.stack(log_p)
        if estimator == "joe":
            entropies.append(-log_p_a.mean())
        else:
            weights = torch.softmax(log_p_a, dim=0)
            entropies.append(-(weights * log_p_a).sum())
    rec = []
    for i in range(K):
        for a in range(M):
            for b in range(M):
                if a != b and present[i][a] and present[i][b]:
                    rec.append(kappa * dot(u[i][a], t[i][b]) + log_c)
    entropy, reconstruction = mean(entropies), mean(rec)
    return -(entropy + reconstruction), entropy, reconstruction


def er_reference(
    z: torch.Tensor,
    temperature: float = 0.1,
    estimator: str = "joe",
    mask: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
) -> Scalar:
    """The loss of :func:`er_reference_terms`."""
    return er_reference_terms(z, temperature, estimator, mask, teacher)[0]


# ---------------------------------------------------------------------------------------
# IPMC (Li et al.): the unified loss, eqs. 10-11 in Circle-loss form, over cross-view pools


def unified_reference(
    pos: Sequence[Scalar], neg: Sequence[Scalar], gamma: float, delta: float,
    phi_dec: float | None = None, tau_dec: float = 1.0,
) -> Scalar:
    """``(1/gamma) log(1 + sum_p sum_n exp(gamma (alpha_n (s_n - delta) - alpha_p (s_p - (1 - delta)))))``
    with the detached weights ``alpha_p = relu(1 + delta - s_p)``, ``alpha_n = relu(s_n + delta)``;
    with ``phi_dec`` given, each weight is replaced by the paper's attenuated one,
    ``max(alpha^tau_dec / phi_dec + 1, 0)`` (sec. 4.3)."""

    def weight(alpha: Scalar) -> Scalar:
        alpha = alpha.detach()
        if phi_dec is None:
            return alpha
        return torch.clamp(alpha**tau_dec / phi_dec + 1, min=0)

    first = next(iter((*pos, *neg)), None)  # the zero goes where the scores are (stacked with them)
    exponents = [torch.zeros((), dtype=torch.float64, device=None if first is None else first.device)]
    for sp in pos:
        alpha_p = weight(torch.clamp(1 + delta - sp, min=0))
        for sn in neg:
            alpha_n = weight(torch.clamp(sn + delta, min=0))
            exponents.append(gamma * (alpha_n * (sn - delta) - alpha_p * (sp - (1 - delta))))
    return torch.logsumexp(torch.stack(exponents), dim=0) / gamma


def ipmc_reference(
    z: torch.Tensor,
    gamma: float,
    delta: float,
    candidates: Sequence[torch.Tensor] | None = None,
    candidate_index: Sequence[int] | None = None,
    index: Sequence[int] | None = None,
    moved: Sequence[Sequence[int]] | None = None,
    phi_dec: float | None = None,
    tau_dec: float = 1.0,
    scale: float = 1.0,
    pools: str = "sample",
) -> Scalar:
    """``scale`` times the mean of :func:`unified_reference` over the pools.

    ``pools="sample"``: one pool per sample i, positives the ordered cross-view pairs (a != b)
    of i, negatives the cross-view pairs of i with every candidate j (other samples of the batch,
    or bank entries ``candidates`` (each ``[M, d]``) whose dataset index ``candidate_index[j]``
    differs from ``index[i]``); mean over i. ``pools="direction"``: one pool per (i, a, b),
    a != b, positive (u[i,a], u[i,b]), negatives (u[i,a], candidate j's view b); mean over the
    (i, a, b). ``moved[i]``: candidate positions moved from i's negatives to its positives (the
    view filter)."""
    u, _, K, M = _setup(z, None)
    pool = range(K) if candidates is None else range(len(candidates))
    others = [u[j] if candidates is None else [normalise(candidates[j][b].to(torch.float64)) for b in range(M)]
              for j in pool]
    losses = []
    for i in range(K):
        directions = [(a, b) for a in range(M) for b in range(M) if a != b]
        rows = [directions] if pools == "sample" else [[ab] for ab in directions]
        for row in rows:
            pos = [dot(u[i][a], u[i][b]) for a, b in row]
            neg: list[Scalar] = []
            for j in pool:
                own = (j == i) if candidates is None else (candidate_index[j] == index[i])
                if own:
                    continue
                target = pos if (moved is not None and j in moved[i]) else neg
                target.extend(dot(u[i][a], others[j][b]) for a, b in row)
            losses.append(unified_reference(pos, neg, gamma, delta, phi_dec, tau_dec))
    return scale * mean(losses)


def siglip_reference(
    z: torch.Tensor, temperature: float | Scalar, mask: torch.Tensor | None = None, bias: float | Scalar = -10.0
) -> Scalar:
    """SigLIP over M views: for every present (i, a) and present (j, b) with a != b, the binary
    loss -log sigmoid(y * (<u[i,a], u[j,b]> / tau + bias)), y = +1 for i = j and -1 otherwise;
    their sum divided by the number of positive pairs, the ordered (i, a, b), a != b, both
    present. ``temperature`` and ``bias`` may be 0-dim tensors (for their gradients)."""
    u, present, K, M = _setup(z, mask)
    total = u[0][0].new_zeros(())
    positives = 0
    for i in range(K):
        for a in range(M):
            if not present[i][a]:
                continue
            for j in range(K):
                for b in range(M):
                    if b == a or not present[j][b]:
                        continue
                    label = 1.0 if i == j else -1.0
                    logit = dot(u[i][a], u[j][b]) / temperature + bias
                    total = total - torch.log(torch.sigmoid(label * logit))
                    positives += i == j
    if positives == 0:
        raise ValueError("no positive pair: the reference is undefined")
    return total / positives


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
    "siglip": siglip_reference,
}

#: objectives whose reference (and implementation) take a view mask
MASKED = ("multi_crop", "geometric_pvc", "arithmetic_pvc", "sufficient_statistics", "mv_infonce", "mv_dhel", "mv_cl1", "mv_cl2",
          "siglip")
