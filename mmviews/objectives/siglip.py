"""SigLIP's pairwise sigmoid loss (Zhai, Mustafa, Kolesnikov and Beyer, ICCV 2023), over M views.

Shapes: ``z`` ``[K, M, d]``, optional ``mask`` ``[K, M]`` (True = view present).

Every ordered pair of present views of distinct view indices, ``(i, a)`` and ``(j, b)`` with
``a != b``, is a binary problem: positive (label ``y = +1``) when both belong to one sample
(``i = j``), negative (``y = -1``) otherwise. With ``u`` the L2-normalised ``z``, the learned
inverse temperature ``t = exp(logit_scale)`` (clamped at 100) and the learned bias ``b``:

    logit[i,a,j,b] = t <u_ia, u_jb> + b
    L = sum over i, a, j, b != a, both present, of  -log sigmoid(y[i,j] logit[i,a,j,b])
        / #{(i, a, b) : a != b, (i, a) and (i, b) present}

the sum of every pair's loss per positive pair. At M = 2 the two orders of a pair have the same
logit, so the sum is twice SigLIP's, over twice its K positives: ``L`` is exactly SigLIP's loss
``-1/K sum_{i,j} log sigmoid(y_ij (t <x_i, y_j> + b))`` (open_clip's ``SigLipLoss``). For
M > 2 each anchor view meets every other view index as in SigLIP's image-text case; pairs of
the same view index (two images) are not scored, as SigLIP scores none. Mask: absent views are
neither positives nor negatives; a sample with one present view adds negatives only (SigLIP's
negatives need no partner); the count of positive pairs runs over every process.

Defaults are the paper's: ``temperature`` 0.1 (``t = 10``, ``logit_scale = log 10``) and
``bias`` -10, both learned (``learn_temperature``, ``learn_bias``); the bias starts where the
many negatives' loss is small, which is what lets the loss start near its optimum.

Cost: one ``[K M, N M]`` score block (N the candidate samples of every process), reduced
row by row with no normaliser over the batch, so it is built whole within ``score_budget_mb``
and streamed over blocks of anchor samples beyond (memory ``O(block * N M + K M d)``; see the
memory model in ``docs/objectives.md``). The scale and the bias enter the block as one extra
coordinate of the anchors, ``[t u, b] . [v, 1] = t <u, v> + b``, so that their gradients flow
through the streamed block like the embeddings'. Across processes the candidates are gathered
with their gradient (open_clip's neighbour exchange gives the same sum; its equality with
``SigLipLoss(rank, world_size, dist_impl=...)`` is tested with two processes).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from . import _distributed as distributed
from ._base import ContrastiveObjective, ObjectiveOutput, ViewSet, register_objective, similarity_metrics
from ._streaming import DEFAULT_SCORE_BUDGET_MB, lowest


def check_bias(bias: float) -> float:
    """``bias`` as a float; ``ValueError`` unless it is a finite number."""
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise ValueError(f"objective 'siglip': bias must be a finite number, got {bias!r}")
    return float(bias)


@register_objective("siglip", "SigLIP's pairwise sigmoid loss with learned scale and bias, over M views (Zhai et al., 2023)")
class SigLIP(ContrastiveObjective):
    poly_view_bound: ClassVar[bool] = False

    def __init__(
        self,
        temperature: float = 0.1,
        bias: float = -10.0,
        learn_temperature: bool = True,
        learn_bias: bool = True,
        chunk_size: int | None = None,
        score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB,
    ) -> None:
        super().__init__(temperature, chunk_size, score_budget_mb, learn_temperature)
        self._fixed_bias = check_bias(bias)
        if not isinstance(learn_bias, bool):
            raise ValueError(f"objective 'siglip': learn_bias must be true or false, got {learn_bias!r}")
        self.learn_bias = learn_bias
        if learn_bias:
            self.logit_bias = nn.Parameter(torch.tensor(self._fixed_bias, dtype=torch.float64))
        else:
            self.register_parameter("logit_bias", None)

    @property
    def bias(self) -> float | torch.Tensor:
        """The fixed bias (a float) or the learned one (a 0-dim tensor in the graph)."""
        return self._fixed_bias if self.logit_bias is None else self.logit_bias

    def set_bias(self, bias: float) -> None:
        """Start from ``bias`` (e.g. a pretrained SigLIP's ``logit_bias``)."""
        self._fixed_bias = check_bias(bias)
        if self.logit_bias is not None:
            with torch.no_grad():
                self.logit_bias.fill_(self._fixed_bias)

    def learned_values(self) -> dict[str, float]:
        values = super().learned_values()
        if self.logit_bias is not None:
            values["bias"] = float(self.logit_bias.detach())
        return values

    def loss(self, views: ViewSet) -> ObjectiveOutput:
        K, M, _ = views.u.shape
        dtype = views.u.dtype
        temperature, bias = self.temperature, self.bias
        scaled = views.u / temperature  # [K, M, d]
        bias_column = torch.as_tensor(bias, dtype=dtype, device=views.u.device).expand(K, M, 1)
        anchors = torch.cat([scaled, bias_column], dim=-1)  # [K, M, d + 1]: . [v, 1] = t <u, v> + b
        candidates = torch.cat([views.U, views.U.new_ones(views.N, M, 1)], dim=-1)  # [N, M, d + 1]
        negatives = views.pairs_reduce(self._negative_terms(views), anchors=anchors, candidates=candidates)  # [K]
        # Every pair was scored as a negative, softplus(logit); a positive's loss is
        # softplus(-logit) = softplus(logit) - logit, so the positives subtract their logits.
        positives = torch.bmm(scaled, views.u.transpose(1, 2)) + bias  # [K, M, M]
        valid = views.pair_valid
        total = negatives.sum() - torch.where(valid, positives, positives.new_zeros(())).sum()
        count = distributed.all_reduce_sum(valid.sum().to(dtype))
        # No positive pair anywhere (every sample with one present view): the negatives' sum as
        # it is (the count clamped at 1), not x / 0; nothing scored at all gives 0 in the graph.
        loss = total * views.world / count.clamp_min(1)
        metrics = similarity_metrics(views)
        if self.logit_bias is not None:
            metrics["bias"] = self.logit_bias.detach()
        return ObjectiveOutput(loss, metrics)

    @staticmethod
    def _negative_terms(views: ViewSet):
        """The block reduction: per anchor sample, the sum of ``softplus(logit)`` over its
        present anchor views against every present candidate view of another view index."""
        M = views.M

        if not views.masked:
            def reduce(scores: torch.Tensor, start: int, stop: int) -> torch.Tensor:  # [k, M, C, M]
                terms = F.softplus(scores)
                same_view = torch.diagonal(terms, dim1=1, dim2=3)  # [k, C, M]: (i, a) against (j, a)
                return terms.sum(dim=(1, 2, 3)) - same_view.sum(dim=(1, 2))

            return reduce

        other_view = ~torch.eye(M, dtype=torch.bool, device=views.u.device)[None, :, None, :]  # [1, M, 1, M]
        candidate_present = views.present_all[None, None]  # [1, 1, N, M]

        def reduce_masked(scores: torch.Tensor, start: int, stop: int) -> torch.Tensor:  # [k, M, N, M]
            keep = views.present[start:stop, :, None, None] & candidate_present & other_view
            return F.softplus(scores.masked_fill(~keep, lowest(scores.dtype))).sum(dim=(1, 2, 3))

        return reduce_masked

    def extra_repr(self) -> str:
        learned = "" if self.learn_bias else ", learn_bias=False"
        return f"{super().extra_repr()}, bias={self._fixed_bias}{learned}"
