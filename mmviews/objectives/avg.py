"""AVG baseline (as in the MV-DHEL paper's experiments, Koromilas et al., 2025).

Shapes: ``z`` ``[K, M, d]`` (no mask).

For each view a, SimCLR between ``x = u[:, a]`` and ``y = mean_{b != a} u[:, b]`` (the mean of
the other views' unit vectors, NOT re-normalised, following the authors' code), with raw dot
products over the temperature as scores. Each of the 2K anchors p_i (x_i or y_i) has its
partner q_i (y_i or x_i) as positive and x_j, y_j (j != i) as negatives:

    CE[a, p_i] = LSE({p_i.q_i} U {p_i.x_j, p_i.y_j : j != i} / tau) - p_i.q_i / tau
    L = mean over views a and the 2K anchors of CE

Cost: four K x N blocks per view. Memory: those ``[M, 2, K, 2, N]`` scores are streamed over
blocks of anchor samples when they exceed ``score_budget_mb`` (or when ``chunk_size`` is
given), see the memory model in ``docs/objectives.md``.
"""

from __future__ import annotations

import torch

from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, register_objective, similarity_metrics
from ._streaming import streamed_logsumexp


@register_objective(
    "avg", "SimCLR between each view and the mean of the other views (AVG baseline of Koromilas et al., 2025)"
)
class Avg(ContrastiveObjective):
    supports_mask = False

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        K, M = views.K, views.M

        def pairs(unit: torch.Tensor) -> torch.Tensor:  # [n, M, d] -> [M, 2, n, d]: (x, y) per view
            others_mean = (unit.sum(dim=1, keepdim=True) - unit) / (M - 1)
            return torch.stack([unit, others_mean]).permute(2, 0, 1, 3)

        anchors = pairs(views.u) / self.temperature  # [M, 2, K, d]
        candidates = pairs(views.U)  # [M, 2, N, d]
        block = views.block_size(M * 2 * 2 * views.N, 2)
        if block is not None:
            return self._streamed(views, anchors, candidates, block)
        scores = torch.einsum("mskd,mtnd->msktn", anchors, candidates)  # [M, 2, K, 2, N]
        local = torch.arange(K, device=scores.device)
        own = local + views.offset
        side = torch.arange(2, device=scores.device)
        positives = scores[:, side[:, None], local[None, :], (1 - side)[:, None], own[None, :]]  # [M, 2, K]
        own_sample = ~views.other_sample  # [K, N]
        # own sample's candidates are excluded except the positive (the other side)
        excluded = own_sample[None, None, :, None, :] & (side[:, None] == side[None, :])[None, :, None, :, None]
        scores = scores.masked_fill(excluded, torch.finfo(scores.dtype).min)
        denominator = torch.logsumexp(scores.flatten(3), dim=3)  # [M, 2, K]
        loss = views.mean(denominator - positives)
        return ObjectiveOutput(loss, similarity_metrics(views))

    def _streamed(self, views: ViewSet, anchors: torch.Tensor, candidates: torch.Tensor, block: int) -> ObjectiveOutput:
        """The same loss with the ``[M, 2, K, 2, N]`` scores streamed over blocks of anchor samples."""
        K, N = views.K, views.N
        same_side = torch.eye(2, dtype=torch.bool, device=anchors.device)

        def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [M, k, 2 (anchor side), 2 (candidate side), N]
            views.fill_own_sample(scores, start, 1, 4, pattern=same_side)  # own sample, same side: not a candidate

        M, _, _, d = anchors.shape
        grouped_candidates = candidates.reshape(M, 2 * N, d)  # per view, (side, sample) flattened
        denominator = streamed_logsumexp(anchors.permute(0, 2, 1, 3), grouped_candidates, exclude, (2, N), (3, 4), block)
        partners = candidates[:, :, views.offset : views.offset + K].flip(1)  # q_i: the other side of sample i
        positives = (anchors * partners).sum(dim=-1)  # [M, 2, K]
        loss = views.mean(denominator.permute(0, 2, 1) - positives)
        return ObjectiveOutput(loss, similarity_metrics(views))
