"""MV-CL2 (Koromilas et al., 2025): eq. 7's per-anchor alignment with MV-DHEL's uniformity,
as in the authors' code.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

    L = mean_{i, a} [ -LSE_{b != a} S[i,a,i,b] + sum_g LSE_{j != i} S[i,g,j,g] ]

Only the M x M block of each sample and the K x K block of each view are built.
Mask: as in mv_dhel; the uniformity sum runs over sample i's present views.
"""

from __future__ import annotations

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics
from .mv_dhel import within_view_uniformity


@register_objective(
    "mv_cl2", "MV-CL2: per-anchor alignment with MV-DHEL's uniformity (Koromilas et al., 2025)"
)
class MVCL2(ContrastiveObjective):

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        alignment = masked_logsumexp(views.within_sample(self.temperature), views.pair_valid, dim=2)  # [K, M]
        uniformity = within_view_uniformity(views, self.temperature).sum(dim=1, keepdim=True)  # [K, 1]
        loss = views.mean(uniformity - alignment, views.anchor_valid)
        return ObjectiveOutput(loss, similarity_metrics(views))
