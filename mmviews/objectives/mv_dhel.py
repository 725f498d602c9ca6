"""MV-DHEL (Koromilas et al., 2025, eq. 12): multi-view decoupled hyperspherical energy loss.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

    L_i = -LSE_{ordered (a, b), a != b} S[i,a,i,b] + sum_a LSE_{j != i} S[i,a,j,a]
    L   = mean_i L_i

Alignment uses the M x M block of each sample, uniformity the K x K block of each view, so the
cost grows as K M^2 + M K^2 and the full [K M, K M] score matrix is never built; the ``[M, K, N]``
within-view block is streamed over blocks of anchor samples beyond ``score_budget_mb``
(see the memory model in ``docs/objectives.md``). The authors'
code sums the alignment over unordered pairs (a constant log 2 lower); we follow eq. 12, and
work in log space (their product of per-view sums of exponentials overflows in float32 at
collapse). At M = 2 this is DHEL. Mask: absent views are neither anchors nor negatives; the sum
over a runs over present anchors; samples with fewer than two present views add no term; a view
present in only one sample of the batch has no negative and adds no uniformity term.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics
from ._streaming import keep_exclusion


def within_view_uniformity(views: ViewSet, temperature: float) -> torch.Tensor:
    """[K, M]: LSE_{j != i, (j, a) present} S[i,a,j,a], set to 0 for the anchors that count no term.

    An anchor counts when it is valid (present, sample with >= 2 present views) and view a is
    present in at least one other sample; with no negative at all the LSE is empty and the
    term is dropped rather than contributing log(0).
    """
    present = keep_exclusion(views.present_all.T[:, None, :] if views.masked else None, 1, views.K)  # [M, 1, N]

    def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [M, k, N]
        present(scores, start, stop)
        views.fill_own_sample(scores, start, 1, 2)

    uniformity = views.within_view_logsumexp(temperature, exclude).T  # [K, M]
    # view a has a negative for (i, a) iff it is present in some sample j != i: its global count
    # minus (i, a)'s own presence (sample i is one of the N) is positive
    others_present = views.present_all.sum(dim=0)[None, :] - views.present.to(torch.long)  # [K, M]
    counts = views.anchor_valid & (others_present > 0)
    return uniformity.masked_fill(~counts, 0.0)


@register_objective(
    "mv_dhel", "MV-DHEL: decoupled hyperspherical energy loss over M views (Koromilas et al., 2025, eq. 12)"
)
class MVDHEL(ContrastiveObjective):

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        alignment = masked_logsumexp(views.within_sample(self.temperature), views.pair_valid, dim=(1, 2))  # [K]
        uniformity = within_view_uniformity(views, self.temperature).sum(dim=1)  # [K]
        loss = views.mean(uniformity - alignment, views.views_present >= 2)
        return ObjectiveOutput(loss, similarity_metrics(views))
