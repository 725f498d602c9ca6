"""Memory-bounded (streamed) evaluation of score blocks.

Every score block of the objectives is a product of anchors and candidates that is only ever
reduced (a log-sum-exp, or a sum of a function of each score), so it never needs to exist whole:
:func:`streamed_logsumexp` and :func:`streamed_reduce` process the anchor samples a block at a
time, keep only each row's reduced values, and recompute each block's scores in backward
(flash-attention style). Peak memory is a few score blocks plus the embeddings, independent of
``(K M)^2``, with the same values and gradients up to float rounding; :func:`plan_block` sizes
the blocks. The shapes, the block sizes, the allocation on CPU and the exactness argument are in
``docs/objectives.md`` ("Streamed evaluation").
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

#: Default score memory per block (MB), the ``score_budget_mb`` of the objectives.
DEFAULT_SCORE_BUDGET_MB = 512.0

#: Score memory of one streamed block by device type (MB; never above the budget). On CPU a
#: block that fits in the last-level cache keeps the elementwise passes over the scores
#: (``exp``, shifts, sums) out of main memory, which more than pays for the recomputation:
#: measured on a 2-core EPYC (32 MB L3), geometric PVC at K M = 16,384 takes 0.85x the time of
#: the unchunked path with 16 MB blocks, 0.98x with 512 MB blocks. Devices not listed (CUDA)
#: use the largest block within the budget, where fewer, larger kernels are what counts.
STREAM_BLOCK_MB: dict[str, float] = {"cpu": 16.0}
#: ... but at least this many anchor rows per block (within the budget): with many candidates
#: (65,536), a 16 MB block is a few dozen rows, and the matrix products lose a third of their
#: speed below about 256 rows (each call re-reads the whole candidate matrix).
MIN_BLOCK_ROWS = 256
#: Scores per tile of :func:`streamed_reduce`'s reduction by device type (on CPU 1 MB of
#: float32, so that the reduction's temporaries stay in cache; at least one sample). Devices
#: not listed (CUDA) reduce each block as one tile: a tile of 2**18 scores there would be
#: thousands of tiny kernel launches and autograd calls per block, and the block already fits
#: the reduction's working copies within ``score_budget_mb`` (:func:`plan_block`).
TILE_ELEMENTS: dict[str, int] = {"cpu": 2**18}

#: ``exclude(scores, start, stop)``: fill, in place, the entries of the scores of anchor samples
#: ``start:stop`` that must not count with ``lowest(scores.dtype)``. Writing the exclusions as
#: code rather than as a mask lets the common ones cost almost nothing: the anchor's own sample
#: is a diagonal (:func:`fill_own_sample`), where a ``masked_fill_`` with a broadcast mask is a
#: full pass over the block as slow as the ``exp``.
Exclude = Callable[[torch.Tensor, int, int], None]
#: ``reduce(scores, start, stop)``: ``scores`` ``[G, stop - start, A, *cand_shape]`` -> a tensor
#: whose dim 1 is the block's sample axis; must depend differentiably on ``scores`` only, and
#: neither modify ``scores`` nor return a view of it (its storage is reused by the next block).
BlockReduce = Callable[[torch.Tensor, int, int], torch.Tensor]


def lowest(dtype: torch.dtype) -> float:
    """The fill value of excluded scores: ``finfo.min`` rather than ``-inf``, so that a row whose
    every entry is excluded still has a finite log-sum-exp (and gets zero gradient)."""
    return torch.finfo(dtype).min


def no_exclusion(scores: torch.Tensor, start: int, stop: int) -> None:
    """An :data:`Exclude` that keeps every score."""


def fill_own_sample(
    scores: torch.Tensor, start: int, offset: int, row_axis: int, candidate_axis: int, pattern: torch.Tensor | None = None
) -> None:
    """Fill with :func:`lowest` the scores of anchor sample ``start + i`` (index ``i`` on
    ``row_axis``) against its own sample as a candidate (index ``offset + start + i`` on
    ``candidate_axis``): a strided diagonal, so ``O(k * other dims)``, not a pass over the block.

    ``pattern``: bool, broadcastable to the remaining dims of ``scores`` (in order, without the
    two sample axes): which own-sample cells to fill (True), e.g. only the anchor view itself;
    None fills them all."""
    k = scores.shape[row_axis]
    own = torch.diagonal(scores.narrow(candidate_axis, offset + start, k), dim1=row_axis, dim2=candidate_axis)
    if pattern is None:
        own.fill_(lowest(scores.dtype))
    else:
        own.masked_fill_(pattern[..., None], lowest(scores.dtype))


def keep_exclusion(keep: torch.Tensor | None, row_axis: int, num_samples: int) -> Exclude:
    """An :data:`Exclude` from a bool ``keep`` mask (True = counts) broadcastable to the whole
    scores, sliced to each block along ``row_axis`` (unless that axis has size 1)."""
    if keep is None:
        return no_exclusion

    def exclude(scores: torch.Tensor, start: int, stop: int) -> None:
        rows = _slice_rows(keep, start, stop, row_axis, num_samples)
        scores.masked_fill_(rows.logical_not(), lowest(scores.dtype))

    return exclude


def check_streaming(chunk_size: int | None, score_budget_mb: float, owner: str) -> tuple[int | None, float]:
    """Validated ``(chunk_size, score_budget_mb)``: chunk_size None or an int >= 1, budget > 0
    (``float('inf')`` never streams unless chunk_size is given)."""
    if chunk_size is not None:
        integral = isinstance(chunk_size, int) or (isinstance(chunk_size, float) and chunk_size.is_integer())
        if isinstance(chunk_size, bool) or not integral or chunk_size < 1:
            raise ValueError(f"{owner}: chunk_size must be None (automatic) or an integer >= 1 (anchor samples per block), got {chunk_size!r}")
        chunk_size = int(chunk_size)
    if isinstance(score_budget_mb, bool) or not isinstance(score_budget_mb, (int, float)) or not score_budget_mb > 0:
        raise ValueError(f"{owner}: score_budget_mb must be a number > 0 (MB of scores per block; inf = never stream), got {score_budget_mb!r}")
    return chunk_size, float(score_budget_mb)


def plan_block(
    num_samples: int,
    elements_per_sample: int,
    element_size: int,
    chunk_size: int | None,
    score_budget_mb: float,
    device_type: str = "cpu",
    rows_per_sample: int = 1,
) -> int | None:
    """Anchor samples per block, or None for the unchunked path.

    ``elements_per_sample``: score entries (times the reduction's working copies) of one anchor
    sample, ``G A C``; ``rows_per_sample``: its anchor rows in each matrix product, ``A``. An
    explicit ``chunk_size`` always streams (also when it exceeds ``num_samples``: one block).
    Otherwise None when all ``num_samples`` fit in ``score_budget_mb``; else the largest block
    within ``score_budget_mb`` and, on devices listed in :data:`STREAM_BLOCK_MB`, within the
    larger of that size and :data:`MIN_BLOCK_ROWS` anchor rows (>= 1 sample).
    """
    if chunk_size is not None:
        return int(chunk_size)
    per_sample = elements_per_sample * element_size
    budget = score_budget_mb * 2**20
    if num_samples * per_sample <= budget:
        return None
    block_bytes = budget
    if device_type in STREAM_BLOCK_MB:
        min_rows_bytes = math.ceil(MIN_BLOCK_ROWS / rows_per_sample) * per_sample
        block_bytes = min(budget, max(STREAM_BLOCK_MB[device_type] * 2**20, min_rows_bytes))
    return max(1, int(block_bytes // per_sample))


def _blocks(num_samples: int, block: int) -> range:
    return range(0, num_samples, block)


def _score_buffer(anchors: torch.Tensor, candidates: torch.Tensor, block: int) -> torch.Tensor:
    """Flat storage for one block's scores, reused by every block of a pass.

    One allocation per pass rather than one per block: besides the page faults of a fresh
    buffer each time, allocating and freeing blocks of tens of MB between small tensors
    fragments the CPU allocator's heap, and the process's resident memory then grows far past
    the live tensors (measured: 0.7-0.9 GB for 16 MB blocks at K M = 16,384)."""
    G, K, A, _ = anchors.shape
    return anchors.new_empty(G * min(block, K) * A * candidates.shape[1])


def _block_scores(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    start: int,
    stop: int,
    cand_shape: tuple[int, ...],
    buffer: torch.Tensor,
) -> torch.Tensor:
    """``[G, stop - start, A, *cand_shape]`` scores of the anchor samples ``start:stop``, written
    into (the start of) ``buffer``: valid until the next block."""
    G, _, A, d = anchors.shape
    rows = anchors[:, start:stop].reshape(G, (stop - start) * A, d)
    out = buffer[: G * (stop - start) * A * candidates.shape[1]].view(G, (stop - start) * A, candidates.shape[1])
    return torch.bmm(rows, candidates.transpose(1, 2), out=out).view(G, stop - start, A, *cand_shape)


def _accumulate(
    weights: torch.Tensor,
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    start: int,
    stop: int,
    grad_anchors: torch.Tensor | None,
    grad_candidates: torch.Tensor | None,
) -> None:
    """With ``weights`` = dL/dS of the block: grad_a[:, block] = W c, grad_c += W^T a[:, block]."""
    G, _, A, d = anchors.shape
    flat = weights.reshape(G, (stop - start) * A, candidates.shape[1])
    if grad_anchors is not None:
        grad_anchors[:, start:stop] = torch.bmm(flat, candidates).view(G, stop - start, A, d)
    if grad_candidates is not None:
        rows = anchors[:, start:stop].reshape(G, (stop - start) * A, d)
        grad_candidates.baddbmm_(flat.transpose(1, 2), rows)


def _slice_rows(keep: torch.Tensor, start: int, stop: int, axis: int, num_samples: int) -> torch.Tensor:
    """Rows ``start:stop`` of a mask along the sample ``axis`` (size-1 axes broadcast as they are)."""
    if keep.shape[axis] == 1:
        return keep
    if keep.shape[axis] != num_samples:
        raise ValueError(f"mask of shape {tuple(keep.shape)} has size {keep.shape[axis]} on the sample axis {axis}, expected {num_samples} or 1")
    return keep.narrow(axis, start, stop - start)


class _StreamedLogSumExp(torch.autograd.Function):
    """Masked LSE of the grouped scores, one block of anchor samples at a time (see docs/objectives.md)."""

    @staticmethod
    def forward(ctx, anchors, candidates, exclude, cand_shape, dims, block):  # type: ignore[override]
        G, K, A, _ = anchors.shape
        parts = []
        buffer = _score_buffer(anchors, candidates, block)
        with torch.autocast(device_type=anchors.device.type, enabled=False):
            for start in _blocks(K, block):
                stop = min(K, start + block)
                scores = _block_scores(anchors, candidates, start, stop, cand_shape, buffer)
                exclude(scores, start, stop)
                top = scores.amax(dim=dims, keepdim=True)
                total = scores.sub_(top).exp_().sum(dim=dims, keepdim=True)
                parts.append(total.log_().add_(top))
                del scores
        del buffer
        lse = torch.cat(parts, dim=1)  # keepdim form: [G, K, A, *cand_shape with 1 on dims]
        # A fully masked row (every entry at `lowest`) must get zero gradient, not a uniform one.
        row_has_entries = lse > lowest(lse.dtype)
        ctx.save_for_backward(anchors, candidates, lse, row_has_entries)
        ctx.exclude, ctx.cand_shape, ctx.block = exclude, cand_shape, block
        return lse.squeeze(dims)

    @staticmethod
    @once_differentiable  # a second derivative through these hand-written passes would be wrong
    def backward(ctx, grad):  # type: ignore[override]
        anchors, candidates, lse, row_has_entries = ctx.saved_tensors
        G, K, A, _ = anchors.shape
        grad = grad.reshape(lse.shape) * row_has_entries
        grad_anchors = torch.zeros_like(anchors, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        grad_candidates = torch.zeros_like(candidates, memory_format=torch.contiguous_format) if ctx.needs_input_grad[1] else None
        buffer = _score_buffer(anchors, candidates, ctx.block)
        with torch.no_grad(), torch.autocast(device_type=anchors.device.type, enabled=False):
            for start in _blocks(K, ctx.block):
                stop = min(K, start + ctx.block)
                scores = _block_scores(anchors, candidates, start, stop, ctx.cand_shape, buffer)
                ctx.exclude(scores, start, stop)
                # softmax weights times the incoming gradient, in the score buffer
                weights = scores.sub_(lse[:, start:stop]).exp_().mul_(grad[:, start:stop])
                _accumulate(weights, anchors, candidates, start, stop, grad_anchors, grad_candidates)
                del scores, weights
        return grad_anchors, grad_candidates, None, None, None, None


def tile_samples(device_type: str, scores_per_sample: int, block: int) -> int:
    """Anchor samples per tile of :func:`streamed_reduce`'s reduction: within
    :data:`TILE_ELEMENTS` scores (at least one sample) on the devices it lists, else the whole
    ``block``."""
    if device_type in TILE_ELEMENTS:
        return max(1, TILE_ELEMENTS[device_type] // scores_per_sample)
    return max(1, block)


def _tiles(start: int, stop: int, tile: int) -> list[tuple[int, int]]:
    return [(t, min(stop, t + tile)) for t in range(start, stop, tile)]


class _StreamedReduce(torch.autograd.Function):
    """Any per-row reduction of the grouped scores, one block at a time, recomputed in backward.

    Within a block, ``reduce`` (and its autograd backward) runs on tiles of about
    :data:`TILE_ELEMENTS` scores: its temporaries (a reduction such as f-MICL's critic makes
    several block-sized ones) then stay small and in cache, and the same few small buffers are
    reused, where block-sized ones would be fresh pages every time (or fragment the heap); the
    matrix products still run on whole blocks."""

    @staticmethod
    def forward(ctx, anchors, candidates, reduce, cand_shape, block):  # type: ignore[override]
        G, K, A, _ = anchors.shape
        tile = tile_samples(anchors.device.type, G * A * candidates.shape[1], block)
        out: torch.Tensor | None = None  # allocated once its shape is known (not one small tensor per tile)
        buffer = _score_buffer(anchors, candidates, block)
        with torch.autocast(device_type=anchors.device.type, enabled=False):
            for start in _blocks(K, block):
                stop = min(K, start + block)
                scores = _block_scores(anchors, candidates, start, stop, cand_shape, buffer)
                for t0, t1 in _tiles(start, stop, tile):
                    part = reduce(scores[:, t0 - start : t1 - start], t0, t1)
                    if out is None:
                        out = part.new_empty((part.shape[0], K, *part.shape[2:]))
                    out[:, t0:t1] = part
                    del part
                del scores
        del buffer
        ctx.save_for_backward(anchors, candidates)
        ctx.reduce, ctx.cand_shape, ctx.block = reduce, cand_shape, block
        return out

    @staticmethod
    @once_differentiable  # a second derivative through these hand-written passes would be wrong
    def backward(ctx, grad):  # type: ignore[override]
        anchors, candidates = ctx.saved_tensors
        G, K, A, _ = anchors.shape
        tile = tile_samples(anchors.device.type, G * A * candidates.shape[1], ctx.block)
        grad_anchors = torch.zeros_like(anchors, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        grad_candidates = torch.zeros_like(candidates, memory_format=torch.contiguous_format) if ctx.needs_input_grad[1] else None
        buffer = _score_buffer(anchors, candidates, ctx.block)
        with torch.autocast(device_type=anchors.device.type, enabled=False):
            for start in _blocks(K, ctx.block):
                stop = min(K, start + ctx.block)
                with torch.no_grad():
                    scores = _block_scores(anchors, candidates, start, stop, ctx.cand_shape, buffer)
                # dL/dS tile by tile, written over the tile's scores (no longer needed) in the buffer
                for t0, t1 in _tiles(start, stop, tile):
                    part = scores[:, t0 - start : t1 - start]
                    leaf = part.detach().requires_grad_(True)  # a leaf over the buffer
                    with torch.enable_grad():
                        out = ctx.reduce(leaf, t0, t1)
                        (weights,) = torch.autograd.grad(out, leaf, grad.narrow(1, t0, t1 - t0), allow_unused=True)
                    del leaf, out
                    with torch.no_grad():
                        part.zero_() if weights is None else part.copy_(weights)
                    del weights
                with torch.no_grad():
                    _accumulate(scores, anchors, candidates, start, stop, grad_anchors, grad_candidates)
                del scores
        return grad_anchors, grad_candidates, None, None, None


def _check_inputs(anchors: torch.Tensor, candidates: torch.Tensor, cand_shape: Sequence[int], block: int) -> tuple[int, ...]:
    if anchors.ndim != 4 or candidates.ndim != 3 or anchors.shape[0] != candidates.shape[0] or anchors.shape[3] != candidates.shape[2]:
        raise ValueError(
            f"streamed scores need anchors [G, K, A, d] and candidates [G, C, d], got {tuple(anchors.shape)} and {tuple(candidates.shape)}"
        )
    cand_shape = tuple(int(n) for n in cand_shape)
    if math.prod(cand_shape) != candidates.shape[1]:
        raise ValueError(f"cand_shape {cand_shape} does not multiply to the {candidates.shape[1]} candidates")
    if int(block) < 1:
        raise ValueError(f"block must be >= 1 anchor samples, got {block}")
    return cand_shape


def streamed_logsumexp(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    exclude: Exclude,
    cand_shape: Sequence[int],
    dims: Sequence[int],
    block: int,
) -> torch.Tensor:
    """``LSE`` over ``dims`` of the scores ``[G, K, A, *cand_shape]`` (see the module
    docstring), the entries filled by ``exclude`` (an :data:`Exclude` called on each block, in
    this grouped layout) left out, ``block`` anchor samples at a time.

    ``dims`` must not include the sample axis 1. Returns the scores' shape without ``dims``. A
    row whose every entry is excluded gives about ``finfo.min`` (finite) and a zero gradient.
    """
    cand_shape = _check_inputs(anchors, candidates, cand_shape, block)
    ndim = 3 + len(cand_shape)
    dims = tuple(sorted(d % ndim for d in dims))
    if 1 in dims:
        raise ValueError("streamed_logsumexp cannot reduce over the anchor-sample axis 1 (blocks are cut along it)")
    return _StreamedLogSumExp.apply(anchors, candidates, exclude, cand_shape, dims, int(block))


def streamed_reduce(
    anchors: torch.Tensor, candidates: torch.Tensor, reduce: BlockReduce, cand_shape: Sequence[int], block: int
) -> torch.Tensor:
    """``cat([reduce(S[:, start:stop], start, stop) for each block], dim=1)`` with the scores
    ``S`` ``[G, K, A, *cand_shape]`` recomputed block by block in backward (see the module
    docstring). ``reduce`` must be differentiable in its scores argument only: gradients to
    other tensors it closes over are not propagated (detach them)."""
    cand_shape = _check_inputs(anchors, candidates, cand_shape, block)
    return _StreamedReduce.apply(anchors, candidates, reduce, cand_shape, int(block))
