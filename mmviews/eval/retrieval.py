"""Cross-modal (cross-view) retrieval: Recall@k and median rank.

Query i's correct match is gallery item i. Items are ranked by cosine similarity; the rank
of the match is ``1 + #{j != i : sim(q_i, g_j) >= sim(q_i, g_i)}``, i.e. ties count against
the query, so a collapsed representation (all similarities equal) gets the worst rank
rather than a perfect one.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


@torch.no_grad()
def retrieval_ranks(query: torch.Tensor, gallery: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """1-based rank of each query's match. query, gallery: [N, d] (row i matches row i). Returns [N] long."""
    if query.ndim != 2 or query.shape != gallery.shape:
        raise ValueError(f"query and gallery must both be [N, d], got {tuple(query.shape)} and {tuple(gallery.shape)}")
    if query.shape[0] == 0:
        raise ValueError("retrieval needs at least one query")
    g = F.normalize(gallery.float(), dim=1)
    ranks = []
    for start in range(0, query.shape[0], chunk_size):  # bounds the [chunk, N] similarity memory
        q = F.normalize(query[start : start + chunk_size].float().to(g.device), dim=1)
        sim = q @ g.T
        rows = torch.arange(q.shape[0], device=g.device)
        true = sim[rows, rows + start]
        # counts the match itself (sim == true), hence 1-based
        ranks.append((sim >= true[:, None]).sum(1))
    return torch.cat(ranks).cpu()


def retrieval_metrics(
    query: torch.Tensor, gallery: torch.Tensor, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
    """``R@k`` (fraction of queries whose match ranks within k), ``MedR`` and ``MeanR``.

    query, gallery: [N, d] with row i of each describing the same sample.
    """
    ranks = retrieval_ranks(query, gallery).double()
    out = {f"R@{k}": float((ranks <= k).double().mean()) for k in ks}
    out["MedR"] = float(ranks.quantile(0.5))  # numpy's median: mean of the middle two for even N
    out["MeanR"] = float(ranks.mean())
    return out


def cross_view_retrieval(
    views: torch.Tensor,
    mask: torch.Tensor | None,
    a: int,
    b: int,
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float]:
    """Retrieval between views ``a`` and ``b`` of per-view embeddings, in both directions.

    Args:
        views: [N, M, d]; mask: [N, M] bool (True = present) or None. Only samples where
            both views are present take part. a, b: view positions.
    Returns:
        ``{"a2b/R@1": ..., "a2b/MedR": ..., "b2a/R@1": ..., "n": count}`` (keys prefixed by
        direction).
    """
    if views.ndim != 3:
        raise ValueError(f"views must be [N, M, d], got {tuple(views.shape)}")
    m = views.shape[1]
    if not (0 <= a < m and 0 <= b < m) or a == b:
        raise ValueError(f"view positions must be two different indices in [0, {m}), got {a} and {b}")
    keep = torch.ones(views.shape[0], dtype=torch.bool) if mask is None else (mask[:, a] & mask[:, b]).cpu()
    if not keep.any():
        raise ValueError(f"no sample has both views {a} and {b} present")
    qa, qb = views[keep.to(views.device), a], views[keep.to(views.device), b]
    out: dict[str, float] = {"n": float(keep.sum())}
    out.update({f"a2b/{k}": v for k, v in retrieval_metrics(qa, qb, ks).items()})
    out.update({f"b2a/{k}": v for k, v in retrieval_metrics(qb, qa, ks).items()})
    return out
