"""MV-DHEL (Koromilas et al., 2025, eq. 12): multi-view decoupled hyperspherical energy loss.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

    L_i = -LSE_{ordered (a, b), a != b} S[i,a,i,b] + sum_a LSE_{j != i} S[i,a,j,a]
    L   = mean_i L_i

Alignment uses the M x M block of each sample, uniformity the K x K block of each view, so the
cost grows as K M^2 + M K^2 and the full [K M, K M] score matrix is never built. The authors'
code sums the alignment over unordered pairs (a constant log 2 lower); we follow eq. 12, and
work in log space (their product of per-view sums of exponentials overflows in float32 at
collapse). At M = 2 this is DHEL. Mask: absent views are neither anchors nor negatives; the sum
over a runs over present anchors; samples with fewer than two present views add no term; a view
present in only one sample of the batch has no negative and adds no uniformity term.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics


def within_view_uniformity(views: ViewSet, temperature: float) -> torch.Tensor:
    """[K, M]: LSE_{j != i, (j, a) present} S[i,a,j,a], set to 0 for the anchors that count no term.

    An anchor counts when it is valid (present, sample with >= 2 present views) and view a is
    present in at least one other sample; with no negative at all the LSE is empty and the
    term is dropped rather than contributing log(0).
    """
    keep = views.other_sample[None] & views.present_all.T[:, None, :]  # [M, K, N]
    uniformity = masked_logsumexp(views.within_view(temperature), keep, dim=2).T  # [K, M]
    counts = views.anchor_valid & keep.any(dim=2).T
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
