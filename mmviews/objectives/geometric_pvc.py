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
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, register_objective, similarity_metrics


@register_objective(
    "geometric_pvc", "geometric poly-view contrastive loss (Shidani et al., 2024, eq. 13)"
)
class GeometricPVC(ContrastiveObjective):
    poly_view_bound = True  # mi_lower_bound(loss, K, M) applies

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        positives = views.within_sample(self.temperature)  # [K, M, M]
        negatives = views.cross_sample_negatives(self.temperature)  # [K, M]
        cross_entropy = torch.logaddexp(negatives[:, :, None], positives) - positives  # [K, M, M]
        loss = views.mean(cross_entropy, views.pair_valid)
        return ObjectiveOutput(loss, similarity_metrics(views))
