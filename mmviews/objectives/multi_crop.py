"""Multi-Crop / pairwise-ensemble loss (Caron et al., 2020; the "pwe" baseline of the poly-view
and MV-DHEL papers; CMC's all-pairs form).

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

The mean over ordered view pairs (a, b) of SimCLR applied to views a and b alone. Per anchor
(i, a) and partner view b != a, the negatives are the other samples' views a and b:

    CE[i,a,b] = LSE({S[i,a,i,b]} U {S[i,a,j,a], S[i,a,j,b] : j != i}) - S[i,a,i,b]
    L = mean over i, a, b != a of CE[i,a,b]

Computed from ``negb[i,a,b] = LSE_{j != i} S[i,a,j,b]`` (one reduction over samples of the
full score tensor, streamed over blocks of anchor samples beyond ``score_budget_mb``: see the memory model in ``docs/objectives.md``);
``negb[i,a,a]`` is the same-view part. Mask: as in geometric_pvc, and a
pair's negatives are the present views a, b of other samples.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, register_objective, similarity_metrics


@register_objective(
    "multi_crop", "mean over ordered view pairs of SimCLR (multi-crop / pairwise ensemble, Caron et al., 2020)"
)
class MultiCrop(ContrastiveObjective):

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        positives = views.within_sample(self.temperature)  # [K, M, M]
        per_view_negatives = views.per_view_negatives(self.temperature)  # [K, M, M]
        same_view_negatives = per_view_negatives.diagonal(dim1=1, dim2=2)[:, :, None].expand_as(positives)
        denominator = torch.logsumexp(torch.stack([positives, per_view_negatives, same_view_negatives]), dim=0)
        loss = views.mean(denominator - positives, views.pair_valid)
        return ObjectiveOutput(loss, similarity_metrics(views))
