"""MV-InfoNCE (Koromilas et al., 2025, eq. 11): one term per sample over all its views.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

    L_i = -LSE_{ordered (a, b), a != b} S[i,a,i,b] + LSE_{a, (j, g) != (i, a)} S[i,a,j,g]
    L   = mean_i L_i

The negative set follows the authors' released code: every (j, g) except the anchor itself,
so the other views of sample i appear in the denominator too. The denominator reduces the
``[K, M, N, M]`` scores, streamed over blocks of anchor samples beyond ``score_budget_mb``
(see the memory model in ``docs/objectives.md``). (Eq. 11 as printed restricts
the negatives to g != a.) Mask: absent views are neither anchors nor candidates; samples
with fewer than two present views add no term.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics
from ._streaming import keep_exclusion


@register_objective(
    "mv_infonce", "MV-InfoNCE: one term per sample over all its views (Koromilas et al., 2025, eq. 11)"
)
class MVInfoNCE(ContrastiveObjective):

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        alignment = masked_logsumexp(views.within_sample(self.temperature), views.pair_valid, dim=(1, 2))  # [K]
        eye = torch.eye(views.M, dtype=torch.bool, device=views.u.device)
        valid = views.anchor_valid[:, :, None, None] & views.present_all[None, None] if views.masked else None  # [K, M, N, M]
        present = keep_exclusion(valid, 0, views.K)

        def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [k, M, N, M]
            present(scores, start, stop)
            views.fill_own_sample(scores, start, 0, 2, pattern=eye)  # the anchor (i, a) itself

        denominator = views.pairs_logsumexp(self.temperature, exclude, (1, 2, 3))  # [K]
        loss = views.mean(denominator - alignment, views.views_present >= 2)
        return ObjectiveOutput(loss, similarity_metrics(views))
