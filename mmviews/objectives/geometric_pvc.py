"""Geometric poly-view contrastive loss (Shidani et al., ICLR 2024, eq. 13).

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]`` (True = view present).

With ``S[i,a,j,b] = <u_ia, u_jb> / tau``, for anchor (i, a) and positive view b != a:

    CE[i,a,b] = LSE({S[i,a,i,b]} U {S[i,a,j,g] : j != i, all g}) - S[i,a,i,b]
    L = mean over i, a, b != a of CE[i,a,b]

The negative set of anchor (i, a) does not depend on b, so one log-sum-exp per anchor,
``neg[i,a] = LSE_{j != i, g} S[i,a,j,g]``, serves all M - 1 positives:
``CE[i,a,b] = logaddexp(neg[i,a], S[i,a,i,b]) - S[i,a,i,b]``. The cost is one ``[K*M, N*M]`` score matrix,
built whole while it fits in ``score_budget_mb`` (default 512 MB), else streamed over blocks
of anchor samples, keeping only ``neg`` (see the memory model in ``docs/objectives.md``).

Mask: absent views are neither anchors, positives nor negatives; the mean runs over the
(i, a, b) with both views present (a sample with one present view adds no term).
At M = 2 this is SimCLR's NT-Xent. ``mi_lower_bound(L, K, M)`` gives the paper's bound.

``critic``: the score function. ``"cosine"`` (default): ``S[i,a,j,b] = <u_ia, u_jb> / tau`` as
above. ``"squared_l2"``: the embeddings are scored as given, not normalised, by their negative
squared Euclidean distance,

    S[i,a,j,b] = -||z_ia - z_jb||^2 / tau,

the critic of Daunhawer et al. (ICLR 2023, numerical simulation; their encoders' outputs are
unnormalised, compared at tau = 1), with the same CE and mean. The encoder must then leave its
output unnormalised (an adapter's ``l2_normalize: false``); on unit vectors the squared-L2 critic
is the cosine one at tau / 2 plus a constant. Computed without a ``[K*M, N*M, d]`` difference
tensor: ``-||a - b||^2 = 2 <a, b> - ||b||^2 - ||a||^2``, whose last term is constant over the
anchor's candidates, so ``neg[i,a]`` is one log-sum-exp of the dot products of ``[2 z_ia, -1] / tau``
with ``[z_jg, ||z_jg||^2]`` (the same score block and streaming as the cosine critic, with d + 1
coordinates), minus ``||z_ia||^2 / tau``; the positives ``S[i,a,i,b]`` are computed directly.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, register_objective, similarity_metrics
from ._streaming import DEFAULT_SCORE_BUDGET_MB

#: The score functions ``critic`` may name (see the module docstring).
CRITICS = ("cosine", "squared_l2")


@register_objective(
    "geometric_pvc", "geometric poly-view contrastive loss (Shidani et al., 2024, eq. 13)"
)
class GeometricPVC(ContrastiveObjective):
    poly_view_bound = True  # mi_lower_bound(loss, K, M) applies

    def __init__(
        self,
        temperature: float = 0.1,
        critic: str = "cosine",
        chunk_size: int | None = None,
        score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB,
        learn_temperature: bool = False,
    ) -> None:
        super().__init__(temperature, chunk_size, score_budget_mb, learn_temperature)
        if critic not in CRITICS:
            raise ValueError(f"objective {self.name!r}: critic must be one of {', '.join(CRITICS)}, got {critic!r}")
        self.critic = critic
        self.normalise_inputs = critic == "cosine"

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        if self.critic == "cosine":
            positives = views.within_sample(self.temperature)  # [K, M, M]
            negatives = views.cross_sample_negatives(self.temperature)  # [K, M]
            metrics = similarity_metrics(views)
        else:
            positives, negatives = squared_l2_scores(views, self.temperature)
            # the cosine similarities of the unnormalised embeddings, as the trainer logs them
            metrics = similarity_metrics(dataclasses.replace(views, u=F.normalize(views.u.detach(), dim=-1)))
        cross_entropy = torch.logaddexp(negatives[:, :, None], positives) - positives  # [K, M, M]
        loss = views.mean(cross_entropy, views.pair_valid)
        return ObjectiveOutput(loss, metrics)

    def extra_repr(self) -> str:
        critic = "" if self.critic == "cosine" else f", critic={self.critic!r}"
        return super().extra_repr() + critic


def squared_l2_scores(views: ViewSet, temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positives ``S[i,a,i,b]`` ``[K, M, M]`` and the cross-sample negatives
    ``LSE_{j != i, (j, g) present} S[i,a,j,g]`` ``[K, M]`` of the critic
    ``S[i,a,j,b] = -||z_ia - z_jb||^2 / tau`` on ``views.u`` (the embeddings as given)."""
    z, Z = views.u, views.U
    positives = -(z[:, :, None, :] - z[:, None, :, :]).pow(2).sum(-1) / temperature
    anchors = torch.cat([2 * z, -torch.ones_like(z[..., :1])], dim=-1) / temperature  # [K, M, d + 1]
    candidates = torch.cat([Z, Z.pow(2).sum(-1, keepdim=True)], dim=-1)  # [N, M, d + 1]
    negatives = views.cross_sample_negatives(temperature, anchors=anchors, candidates=candidates)
    return positives, negatives - z.pow(2).sum(-1) / temperature
