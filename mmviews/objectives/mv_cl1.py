"""MV-CL1 (Koromilas et al., 2025, eqs. 7 + 9): per-anchor alignment with InfoNCE negatives.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

    L = mean_{i, a} [ -LSE_{b != a} S[i,a,i,b] + LSE_{j, g != a} S[i,a,j,g] ]

The denominator runs over every sample j (the anchor's own included) and every view g other
than the anchor's view a; it reduces the ``[K, M, N, M]`` scores, streamed over blocks of
anchor samples beyond ``score_budget_mb`` (see the memory model in
``docs/objectives.md``). Mask: absent views are neither anchors, positives nor
candidates.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics
from ._streaming import keep_exclusion, lowest


@register_objective(
    "mv_cl1", "MV-CL1: per-anchor alignment with InfoNCE negatives (Koromilas et al., 2025)"
)
class MVCL1(ContrastiveObjective):

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        alignment = masked_logsumexp(views.within_sample(self.temperature), views.pair_valid, dim=2)  # [K, M]
        present = keep_exclusion(views.present_all[None, None] if views.masked else None, 0, views.K)

        def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [k, M, N, M]
            present(scores, start, stop)
            scores.diagonal(dim1=1, dim2=3).fill_(lowest(scores.dtype))  # candidate view g == anchor view a

        denominator = views.pairs_logsumexp(self.temperature, exclude, (2, 3))  # [K, M]
        loss = views.mean(denominator - alignment, views.anchor_valid)
        return ObjectiveOutput(loss, similarity_metrics(views))
