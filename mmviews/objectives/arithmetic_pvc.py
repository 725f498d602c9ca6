"""Arithmetic poly-view contrastive loss (Shidani et al., ICLR 2024, eq. 12).

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]``.

With ``CE[i,a,b]`` the cross-entropy of :mod:`geometric_pvc` (anchor (i, a), positive (i, b),
every view of every other sample as a negative):

    L = mean_{i, a} -( LSE_{b != a}(-CE[i,a,b]) - log(M - 1) )

i.e. the cross-entropy of the arithmetic mean of the M - 1 positive probabilities.
Note: the paper's Algorithm 1 writes ``logsumexp(losses) - log(k)``, which contradicts its
eq. 12 (and was copied by the MV-DHEL authors' port); we follow eq. 12.

Mask: M - 1 becomes the anchor's number of present positives; anchors that are absent or
belong to a sample with fewer than two present views add no term.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, masked_logsumexp, register_objective, similarity_metrics


@register_objective(
    "arithmetic_pvc", "arithmetic poly-view contrastive loss (Shidani et al., 2024, eq. 12)"
)
class ArithmeticPVC(ContrastiveObjective):
    poly_view_bound = True  # mi_lower_bound(loss, K, M) applies

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        positives = views.within_sample(self.temperature)  # [K, M, M]
        negatives = views.cross_sample_negatives(self.temperature)  # [K, M]
        cross_entropy = torch.logaddexp(negatives[:, :, None], positives) - positives  # [K, M, M]
        num_positives = (views.views_present - 1).clamp_min(1).to(positives.dtype)  # [K]
        log_mean_probability = masked_logsumexp(-cross_entropy, views.pair_valid, dim=2) - torch.log(num_positives)[:, None]
        loss = views.mean(-log_mean_probability, views.anchor_valid)
        return ObjectiveOutput(loss, similarity_metrics(views))
