"""Sufficient-statistics poly-view contrastive loss (Shidani et al., ICLR 2024, eq. 22, Algorithm 2).

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

Each anchor u[i,a] is contrasted with the re-normalised mean of its sample's other views,
``r[i,a] = normalise(mean_{b != a} u[i,b])``; the negatives are the r of every other sample:

    CE[i,a] = LSE({<u_ia, r_ia>/tau} U {<u_ia, r_jg>/tau : j != i, all g}) - <u_ia, r_ia>/tau
    L = mean_{i, a} CE[i,a]

At M = 2, r[i,a] is the other view, so the loss is SimCLR's. The negatives reduce a ``[K, M, N, M]``
block, streamed beyond ``score_budget_mb`` (see the memory model in ``docs/objectives.md``).
Mask: r[i,a] averages the present views b != a; absent views are neither anchors nor
give an r, and samples with fewer than two present views add no term and give no negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, register_objective, similarity_metrics
from ._streaming import keep_exclusion


def leave_one_out_directions(u, present):
    """[N, M, d]: normalise(sum of the other present views), the direction of their mean."""
    present_u = u * present[..., None]
    return F.normalize(present_u.sum(dim=1, keepdim=True) - present_u, dim=-1, eps=1e-12)


@register_objective(
    "sufficient_statistics", "poly-view contrastive loss against leave-one-out view means (Shidani et al., 2024, eq. 22)"
)
class SufficientStatistics(ContrastiveObjective):
    poly_view_bound = True  # mi_lower_bound(loss, K, M) applies

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        K, M, d = views.u.shape
        statistics = leave_one_out_directions(views.U, views.present_all)  # [N, M, d]
        local_statistics = statistics[views.offset : views.offset + K]
        anchors = views.u / self.temperature
        positives = (anchors * local_statistics).sum(dim=-1)  # [K, M]
        candidate_valid = views.present_all & (views.present_all.sum(dim=1) >= 2)[:, None]  # [N, M]
        valid = keep_exclusion(candidate_valid[None, None] if views.masked else None, 0, K)

        def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [k, M, N, M]
            valid(scores, start, stop)
            views.fill_own_sample(scores, start, 0, 2)

        negatives = views.pairs_logsumexp(self.temperature, exclude, (2, 3), candidates=statistics, anchors=anchors)  # [K, M]
        loss = views.mean(torch.logaddexp(negatives, positives) - positives, views.anchor_valid)
        return ObjectiveOutput(loss, similarity_metrics(views))
