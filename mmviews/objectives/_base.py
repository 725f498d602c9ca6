"""Shared machinery of every objective: the registry, the contract (class attributes and
hooks of :class:`MultiViewObjective`), input checks, precision, the view-set context holding
local anchors and (gathered) candidates, and the score blocks.

An objective states its formula and asks :class:`ViewSet` for the score blocks it needs
(within a sample, within a view, all pairs); masks, exclusions of the anchor's own sample and the
choice between building a block whole and streaming it within ``score_budget_mb`` are handled
here once, so that every objective gets finite values for fully masked rows, no ``[K, N]``
masks and a memory bound at large batches. The blocks, their costs and the memory model are in
``docs/objectives.md`` ("Score blocks and the memory model").
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from mmviews.registry import Registry, did_you_mean

from . import _distributed as distributed
from ._streaming import (
    DEFAULT_SCORE_BUDGET_MB,
    BlockReduce,
    Exclude,
    check_streaming,
    fill_own_sample,
    keep_exclusion,
    plan_block,
    streamed_logsumexp,
    streamed_reduce,
)

_CLASSES: Registry[type["MultiViewObjective"]] = Registry("objective")
T = TypeVar("T", bound=type["MultiViewObjective"])


def register_objective(name: str, description: str = "") -> Callable[[T], T]:
    """Class decorator: make an objective available as ``get_objective(name)``.

    ``description`` is the one line :func:`describe_objectives` shows (default: the first
    line of the class docstring). The class's contract attributes are checked against its
    ``loss`` and constructor signatures here, so that a mismatch fails at import rather
    than as a missing input in the middle of a training run.
    """

    def wrap(cls: T) -> T:
        check_contract(cls)
        _CLASSES.add(name, cls, description)
        cls.name = name
        return cls

    return wrap


def list_objectives() -> list[str]:
    """Names accepted by :func:`get_objective`, sorted."""
    return _CLASSES.names()


def describe_objectives() -> dict[str, str]:
    """``{name: one-line description}`` of every registered objective, sorted by name."""
    return _CLASSES.descriptions()


def objective_class(name: str) -> type["MultiViewObjective"]:
    """The class registered as ``name`` (e.g. to read its contract attributes or its
    constructor's parameters); an unknown name raises ``ValueError`` listing the known ones."""
    return _CLASSES.get(name)


def _parameter_hint(word: str, accepted: list[str]) -> str:
    """The did-you-mean of a misspelt parameter: the one parameter the word abbreviates
    (``temp``: ``temperature``, too short for a spelling match), else the closest spelling."""
    abbreviated = [p for p in accepted if p.startswith(word)] if len(word) >= 3 else []
    return f" (did you mean {abbreviated[0]!r}?)" if len(abbreviated) == 1 else did_you_mean(word, accepted)


def get_objective(name: str, **params) -> "MultiViewObjective":
    """Build the objective registered as ``name`` with its keyword parameters."""
    cls = objective_class(name)
    signature = inspect.signature(cls.__init__).parameters
    accepted = [p for p, parameter in signature.items() if p != "self"
                and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in signature.values())
    unknown = [key for key in params if key not in accepted]
    if unknown and not takes_any:  # named before the constructor says "unexpected keyword argument"
        raise ValueError(f"objective {name!r}: unknown parameter {unknown[0]!r}{_parameter_hint(unknown[0], accepted)}; "
                         f"accepted parameters: {accepted}")
    try:
        return cls(**params)
    except TypeError as error:  # e.g. a value of the wrong type: say which objective and what it takes
        raise ValueError(f"objective {name!r}: {error}; accepted parameters: {accepted}") from None
    except ValueError as error:  # a value out of range: say which objective, once
        if str(error).startswith((f"objective {name!r}", f"{name}:")):
            raise
        raise ValueError(f"objective {name!r}: {error}") from None


def check_contract(cls: type["MultiViewObjective"]) -> None:
    """Raise ``TypeError`` if ``cls``'s contract attributes disagree with its signatures:
    ``takes_index`` / ``takes_teacher`` with the ``index`` / ``teacher`` parameters of
    ``loss``, ``takes_dataset_size`` with the ``dataset_size`` parameter of ``__init__``, and
    ``needs_teacher`` only together with ``takes_teacher``."""
    loss_parameters = inspect.signature(cls.loss).parameters
    init_parameters = inspect.signature(cls.__init__).parameters
    declared = {
        ("takes_index", "loss", "index"): (cls.takes_index, "index" in loss_parameters),
        ("takes_teacher", "loss", "teacher"): (cls.takes_teacher, "teacher" in loss_parameters),
        ("takes_dataset_size", "__init__", "dataset_size"): (cls.takes_dataset_size, "dataset_size" in init_parameters),
    }
    for (attribute, method, parameter), (value, present) in declared.items():
        if bool(value) != present:
            has = "has" if present else "has no"
            raise TypeError(f"objective class {cls.__qualname__}: {attribute} = {value} but its {method}() {has} parameter {parameter!r}")
    if cls.needs_teacher and not cls.takes_teacher:
        raise TypeError(f"objective class {cls.__qualname__}: needs_teacher = True requires takes_teacher = True")


def check_temperature(temperature: float, what: str = "temperature") -> float:
    """``temperature`` as a float; ``ValueError`` unless it is finite and > 0."""
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):  # e.g. a string: the same sentence as for a number out of range
        raise ValueError(f"{what} must be a finite number > 0, got {temperature!r}") from None
    if not 0 < temperature < math.inf:  # NaN fails both comparisons
        raise ValueError(f"{what} must be a finite number > 0, got {temperature}")
    return temperature


@dataclass
class ObjectiveOutput:
    """The loss (0-dim, differentiable) and detached scalar metrics."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def masked_logsumexp(scores: torch.Tensor, keep: torch.Tensor | None, dim: int | tuple[int, ...]) -> torch.Tensor:
    """log-sum-exp of ``scores`` over ``dim`` counting only entries where ``keep`` (broadcastable) is True.

    A fully masked reduction returns about ``finfo.min`` (finite), never NaN.
    """
    if keep is None:
        return torch.logsumexp(scores, dim=dim)
    filled = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.logsumexp(filled, dim=dim)


class _ScoresLogSumExp(torch.autograd.Function):
    """``LSE`` over ``dims`` of ``(anchors @ candidates.T).view(shape)``, the entries filled by
    ``exclude`` left out, in one score buffer (the unchunked path).

    The forward turns the score buffer into the softmax weights in place and saves only
    those; the backward is two matrix products. Compared with ``masked_fill`` followed by
    ``torch.logsumexp`` this avoids two extra copies of the largest tensor of the loss and
    one pass over it (it is what keeps the all-pairs objectives near the cost of a single
    cross-entropy).
    """

    @staticmethod
    def forward(ctx, anchors, candidates, exclude, shape, dims):  # type: ignore[override]
        scores = (anchors @ candidates.T).view(shape)
        exclude(scores, 0, shape[0])
        top = scores.amax(dim=dims, keepdim=True)
        scores.sub_(top).exp_()
        total = scores.sum(dim=dims, keepdim=True)
        scores.div_(total)
        # A fully masked reduction has top = finfo.min and uniform weights over dropped
        # entries: its gradient must be zero, not spread over them.
        row_has_entries = top > torch.finfo(scores.dtype).min
        ctx.save_for_backward(anchors, candidates, scores, row_has_entries)
        return (top + total.log()).squeeze(dims)

    @staticmethod
    @once_differentiable  # a second derivative through these hand-written passes would be wrong
    def backward(ctx, grad):  # type: ignore[override]
        anchors, candidates, weights, row_has_entries = ctx.saved_tensors
        grad = grad.reshape(row_has_entries.shape) * row_has_entries
        with torch.autocast(device_type=anchors.device.type, enabled=False):
            weighted = (weights * grad).view(anchors.shape[0], candidates.shape[0])
            return weighted @ candidates, weighted.T @ anchors, None, None, None


def scores_logsumexp(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    keep: torch.Tensor | Exclude,
    shape: tuple[int, ...],
    dims: tuple[int, ...],
) -> torch.Tensor:
    """``masked_logsumexp((anchors @ candidates.T).view(shape), keep, dims)``, fused (see above).

    anchors ``[R, d]``, candidates ``[C, d]``, ``shape`` a view of ``[R, C]`` whose dim 0 is the
    anchor samples; ``keep`` a bool mask broadcastable to it, or an :data:`Exclude`
    ``exclude(scores, 0, shape[0])`` that fills the left-out entries in place.
    """
    exclude = keep if callable(keep) else keep_exclusion(keep, 0, shape[0])
    return _ScoresLogSumExp.apply(anchors, candidates, exclude, shape, tuple(sorted(dims)))


def _grouped(exclude: Exclude, *, axis: int = 0) -> Exclude:
    """The :data:`Exclude` of an ungrouped score layout ``[k, ...]`` as one for the grouped
    layout ``[G, k, A, ...]`` of :mod:`._streaming`, with ``G = 1`` (``axis = 0``) or ``A = 1``
    (``axis = 2``): it is handed the block without that axis (a view)."""
    return lambda scores, start, stop: exclude(scores.select(axis, 0), start, stop)


@dataclass
class ViewSet:
    """One call's inputs in the form the formulas use.

    ``u``/``present``: this process's samples; ``U``/``present_all``: every process's samples
    (the same tensors on one process); ``offset``: index of this rank's first sample in ``U``.
    """

    u: torch.Tensor  # [K, M, d] unit vectors (z as given if the objective's normalise_inputs is False), float32 or float64
    present: torch.Tensor  # [K, M] bool
    U: torch.Tensor  # [N, M, d]
    present_all: torch.Tensor  # [N, M] bool
    offset: int
    world: int
    masked: bool  # False when the caller gave no mask (all views present)
    # score blocks: anchor samples per block (None: automatic) and the automatic choice's budget
    chunk_size: int | None = None
    score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB

    @property
    def K(self) -> int:
        return self.u.shape[0]

    @property
    def M(self) -> int:
        return self.u.shape[1]

    @property
    def N(self) -> int:
        return self.U.shape[0]

    # ---- masks -------------------------------------------------------------------------
    @cached_property
    def other_sample(self) -> torch.Tensor:
        """[K, N] bool: candidate sample j is not the anchor's own sample i."""
        return self.other_sample_rows(0, self.K)

    def other_sample_rows(self, start: int, stop: int) -> torch.Tensor:
        """[stop - start, N] bool: rows ``start:stop`` of :attr:`other_sample`, built alone (a
        streamed block never builds the [K, N] mask)."""
        own = torch.arange(start, stop, device=self.u.device) + self.offset
        return torch.arange(self.N, device=self.u.device)[None, :] != own[:, None]

    @cached_property
    def views_present(self) -> torch.Tensor:
        """[K] number of present views of each local sample."""
        return self.present.sum(dim=1)

    @cached_property
    def anchor_valid(self) -> torch.Tensor:
        """[K, M] bool: (i, a) is present and sample i has at least two present views."""
        return self.present & (self.views_present >= 2)[:, None]

    @cached_property
    def pair_valid(self) -> torch.Tensor:
        """[K, M, M] bool: ordered positive pair (a, b), a != b, both present."""
        eye = torch.eye(self.M, dtype=torch.bool, device=self.u.device)
        return self.present[:, :, None] & self.present[:, None, :] & ~eye

    @cached_property
    def negative_keep(self) -> torch.Tensor:
        """[K, 1, N, M] bool: candidate (j, g) is another sample's present view."""
        return (self.other_sample[:, :, None] & self.present_all[None, :, :])[:, None]

    def block_size(self, elements_per_sample: int, rows_per_sample: int) -> int | None:
        """Anchor samples per block for a score block with ``elements_per_sample`` entries per
        anchor sample, in ``rows_per_sample`` rows of its matrix products, or None for the
        unchunked path (see docs/objectives.md and :func:`._streaming.plan_block`)."""
        return plan_block(
            self.K, elements_per_sample, self.u.element_size(), self.chunk_size, self.score_budget_mb,
            self.u.device.type, rows_per_sample,
        )

    # ---- score blocks --------------------------------------------------------------------
    def within_sample(self, temperature: float) -> torch.Tensor:
        """[K, M, M]: S[i, a, i, b]."""
        return torch.bmm(self.u / temperature, self.u.transpose(1, 2))

    def within_view(self, temperature: float) -> torch.Tensor:
        """[M, K, N]: S[i, a, j, a] for each view a."""
        anchors = (self.u / temperature).transpose(0, 1)  # [M, K, d]
        return torch.bmm(anchors, self.U.permute(1, 2, 0))  # [M, K, N]

    def fill_own_sample(
        self, scores: torch.Tensor, start: int, row_axis: int, candidate_axis: int, pattern: torch.Tensor | None = None
    ) -> None:
        """Exclude (fill in place) the scores of local anchor samples ``start + i`` (``row_axis``)
        against their own sample among the candidates (``candidate_axis`` indexes ``U``), all of
        them or those where ``pattern`` is True (see :func:`._streaming.fill_own_sample`)."""
        fill_own_sample(scores, start, self.offset, row_axis, candidate_axis, pattern)

    def pairs_logsumexp(
        self,
        temperature: float,
        exclude: Exclude,
        dims: tuple[int, ...],
        candidates: torch.Tensor | None = None,
        anchors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """LSE over ``dims`` (not 0) of the all-pairs scores ``[K, M, N, M]``, the entries filled
        by ``exclude`` left out, unchunked (one score buffer) or streamed (:meth:`block_size`).

        ``exclude(scores, start, stop)`` fills, in place, the left-out scores of the block of
        anchor samples ``start:stop`` (``scores`` ``[stop - start, M, N, M]``; e.g. with
        :meth:`fill_own_sample` and :func:`._streaming.keep_exclusion`). ``candidates``:
        ``[N, M, d]`` in place of ``U`` (e.g. sufficient statistics); ``anchors``: ``[K, M, d]``
        in place of ``u / temperature`` (when the caller uses that tensor too).
        """
        K, M, _ = self.u.shape
        candidates = self.U if candidates is None else candidates
        N = candidates.shape[0]
        anchors = self.u / temperature if anchors is None else anchors
        d = anchors.shape[-1]
        block = self.block_size(M * N * M, M)
        if block is None:
            return scores_logsumexp(anchors.reshape(K * M, d), candidates.reshape(N * M, d), exclude, (K, M, N, M), dims)
        return streamed_logsumexp(
            anchors.reshape(1, K, M, d), candidates.reshape(1, N * M, d), _grouped(exclude), (N, M), tuple(x + 1 for x in dims), block
        )[0]

    def cross_sample_negatives(
        self, temperature: float, anchors: torch.Tensor | None = None, candidates: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[K, M]: LSE_{j != i, (j, g) present} S[i,a,j,g], every view of every other sample.
        ``anchors`` ``[K, M, e]`` / ``candidates`` ``[N, M, e]``: in place of ``u / temperature``
        and ``U`` (see :meth:`pairs_logsumexp`), e.g. augmented vectors whose dot products are
        another critic's scores."""
        present = keep_exclusion(self.present_all[None, None] if self.masked else None, 0, self.K)

        def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [k, M, N, M]
            present(scores, start, stop)
            self.fill_own_sample(scores, start, 0, 2)

        return self.pairs_logsumexp(temperature, exclude, (2, 3), candidates=candidates, anchors=anchors)

    def per_view_negatives(self, temperature: float) -> torch.Tensor:
        """[K, M, M]: LSE_{j != i, (j, b) present} S[i,a,j,b] for each anchor view a and candidate view b."""
        K, M, d = self.u.shape
        present = keep_exclusion(self.present_all.T[None, None] if self.masked else None, 0, K)

        def exclude(scores: torch.Tensor, start: int, stop: int) -> None:  # [k, M, M, N]
            present(scores, start, stop)
            self.fill_own_sample(scores, start, 0, 3)

        # candidates ordered view-major so that the reduction over samples j is contiguous
        candidates = self.U.transpose(0, 1).reshape(M * self.N, d)
        anchors = self.u / temperature
        block = self.block_size(M * M * self.N, M)
        if block is None:
            return scores_logsumexp(anchors.reshape(K * M, d), candidates, exclude, (K, M, M, self.N), (3,))
        return streamed_logsumexp(anchors.reshape(1, K, M, d), candidates[None], _grouped(exclude), (M, self.N), (4,), block)[0]

    def within_view_logsumexp(self, temperature: float, exclude: Exclude) -> torch.Tensor:
        """[M, K]: LSE_j over the within-view scores S[i,a,j,a] (:meth:`within_view`), the
        entries filled by ``exclude(scores, start, stop)`` (``scores`` ``[M, stop - start, N]``)
        left out, unchunked or streamed (:meth:`block_size`)."""
        K, M, d = self.u.shape
        block = self.block_size(M * self.N, 1)
        if block is None:
            scores = self.within_view(temperature)
            exclude(scores, 0, K)  # in place on the product, whose backward does not need it
            return torch.logsumexp(scores, dim=2)
        anchors = (self.u / temperature).transpose(0, 1)[:, :, None, :]  # [M, K, 1, d]
        candidates = self.U.transpose(0, 1).contiguous()  # [M, N, d], made contiguous once, not per block
        return streamed_logsumexp(anchors, candidates, _grouped(exclude, axis=2), (self.N,), (3,), block)[:, :, 0]

    def pairs_reduce(
        self,
        reduce: BlockReduce,
        temperature: float = 1.0,
        candidates: torch.Tensor | None = None,
        working_copies: int = 4,
        anchors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``reduce(S, 0, K)`` of the all-pairs scores ``S`` ``[K, M, C, M]`` (with ``C``
        candidate samples, ``U`` by default), or the concatenation along dim 0 of
        ``reduce(S[start:stop], start, stop)`` over blocks of anchor samples when streaming.

        ``reduce`` returns a tensor whose dim 0 is the block's samples and must be
        differentiable in ``S`` only (see :func:`._streaming.streamed_reduce`). The block is
        sized for ``working_copies`` block-sized temporaries of the reduction within the budget.
        ``anchors``: ``[K, M, e]`` in place of ``u / temperature`` (``candidates`` then
        ``[C, M, e]``), e.g. with an extra coordinate that adds a learned bias to every score.
        """
        K, M, _ = self.u.shape
        candidates = self.U if candidates is None else candidates
        C = candidates.shape[0]
        if anchors is None:
            anchors = self.u if isinstance(temperature, float) and temperature == 1.0 else self.u / temperature
        d = anchors.shape[-1]
        block = self.block_size(M * C * M * working_copies, M)
        if block is None:
            return reduce((anchors.reshape(K * M, d) @ candidates.reshape(C * M, d).T).view(K, M, C, M), 0, K)
        return streamed_reduce(
            anchors.reshape(1, K, M, d),
            candidates.reshape(1, C * M, d),
            lambda scores, start, stop: reduce(scores[0], start, stop)[None],
            (C, M),
            block,
        )[0]

    def all_pairs(self, temperature: float) -> torch.Tensor:
        """[K, M, N, M]: S[i, a, j, b] (the full score tensor of local anchors)."""
        K, M, d = self.u.shape
        scores = (self.u / temperature).reshape(K * M, d) @ self.U.reshape(self.N * M, d).T
        return scores.view(K, M, self.N, M)

    # ---- reductions -----------------------------------------------------------------------
    def mean(self, terms: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Mean of ``terms`` over the valid ones of all ranks, scaled so that the mean over
        ranks of the returned values is the single-process mean on the whole batch."""
        if valid is None:
            valid = torch.ones_like(terms, dtype=torch.bool)
        total = torch.where(valid, terms, torch.zeros((), dtype=terms.dtype, device=terms.device)).sum()
        count = distributed.all_reduce_sum(valid.sum().to(terms.dtype))
        # No valid term anywhere (e.g. every sample has a single present view): a zero loss
        # that still belongs to the graph, rather than 0/0.
        return total * self.world / count.clamp_min(1)


def check_embeddings(z: object, prefix: str) -> None:
    """``ValueError`` (starting with ``prefix``) unless ``z`` is a floating-point tensor of
    shape ``[K, M, d]``. Sizes are checked by :meth:`MultiViewObjective.prepare`."""
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"{prefix} z must be a torch.Tensor of shape [K, M, d], got {type(z).__name__}")
    if z.ndim != 3:
        raise ValueError(f"{prefix} z must have shape [K, M, d] (3 dims), got shape {tuple(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"{prefix} z must be a floating-point tensor, got {z.dtype}")


def check_finite(z: torch.Tensor, prefix: str) -> None:
    """``ValueError`` (starting with ``prefix``) naming the first non-finite entry of ``z``."""
    if not torch.isfinite(z).all():
        bad = (~torch.isfinite(z)).nonzero()[0].tolist()
        raise ValueError(f"{prefix} z has non-finite values (first at index {tuple(bad)})")


class MultiViewObjective(nn.Module):
    """Base class of every objective, and the contract the trainer codes against.

    ``objective(z, mask=None, *, index=None, teacher=None)`` returns the 0-dim loss;
    ``objective.compute(...)`` an :class:`ObjectiveOutput` with metrics too; after either call
    the detached metrics are also in ``objective.last_metrics``.

    What an objective takes and needs is declared by class attributes (checked against the
    signatures of ``loss`` and ``__init__`` by :func:`register_objective`), so that callers
    read them instead of probing methods:

    - ``supports_mask``: ``mask`` ``[K, M]`` (True = view present) is honoured; else refused.
    - ``exact_views``: the objective is defined for exactly this number of views (else None).
    - ``takes_index``: ``loss`` uses ``index`` ``LongTensor[K]``, the batch's dataset indices
      (e.g. IPMC's memory bank and view filter).
    - ``takes_teacher``: ``loss`` uses ``teacher`` ``Tensor[K, M, d]``, embeddings of the same
      views by an EMA teacher encoder.
    - ``needs_teacher``: the trainer must build an EMA teacher even when the recipe does not ask.
    - ``takes_dataset_size``: the constructor takes ``dataset_size=`` (the number of training
      samples), which the trainer fills in when the recipe leaves it out.
    - ``poly_view_bound``: :func:`mi_lower_bound` ``(loss, K, M)`` is a valid bound for this loss.

    Stateful objectives override the hooks, which are no-ops here: ``critic_step(z)`` on every
    micro-batch, with detached embeddings, before the loss (returns extra metrics);
    ``on_step_end(z, index)`` after each micro-batch's backward; ``on_optimizer_step()`` after
    each optimiser step; ``on_epoch_end(epoch)`` after each epoch (counted from 0).

    Objectives with learned parameters (a learned temperature, SigLIP's bias) hold them as
    ``nn.Parameter``: the trainer optimises ``objective.parameters()`` (see
    :class:`ContrastiveObjective`), averages their gradients over processes and saves them.
    """

    name: ClassVar[str] = ""
    supports_mask: ClassVar[bool] = False
    exact_views: ClassVar[int | None] = None
    takes_index: ClassVar[bool] = False
    takes_teacher: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    takes_dataset_size: ClassVar[bool] = False
    poly_view_bound: ClassVar[bool] = False
    # Score blocks (see the memory model in docs/objectives.md): objectives that build large
    # blocks take these as constructor parameters and set them with ``set_streaming``.
    chunk_size: int | None = None
    score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB
    # Input checks that read values back to the host (z finite; IPMC's index range): a clear
    # ValueError for direct callers, but a device synchronisation per call on an accelerator.
    # A training loop that checks the loss itself sets it to False (mmviews.train does, and
    # checks for a non-finite loss at log steps); shapes and dtypes are always checked.
    check_inputs: bool = True
    # prepare() L2-normalises z (the cosine critic); an objective that scores the embeddings as
    # given (a squared-L2 critic) sets it to False.
    normalise_inputs: bool = True

    def __init__(self) -> None:
        super().__init__()
        self.last_metrics: dict[str, torch.Tensor] = {}

    def set_streaming(self, chunk_size: int | None, score_budget_mb: float) -> None:
        """Validate and keep the score-block parameters: ``chunk_size`` anchor samples per block
        (None: chosen from the budget), ``score_budget_mb`` MB of scores per block (the whole
        block unchunked when it fits; ``inf``: always unchunked unless ``chunk_size`` is set)."""
        self.chunk_size, self.score_budget_mb = check_streaming(chunk_size, score_budget_mb, f"objective {self.name!r}")

    def forward(
        self,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        index: torch.Tensor | None = None,
        teacher: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.compute(z, mask, index=index, teacher=teacher).loss

    def compute(
        self,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        index: torch.Tensor | None = None,
        teacher: torch.Tensor | None = None,
    ) -> ObjectiveOutput:
        """The loss and metrics of ``z`` ``[K, M, d]``. ``index`` / ``teacher`` reach ``loss``
        only when the objective takes them (``takes_index`` / ``takes_teacher``); giving one
        it does not take is a ``ValueError`` rather than a silently ignored input."""
        extra: dict[str, torch.Tensor | None] = {}
        for key, value, taken in (("index", index, self.takes_index), ("teacher", teacher, self.takes_teacher)):
            if taken:
                extra[key] = value
            elif value is not None:
                raise ValueError(f"objective {self.name!r} does not take {key}= (its takes_{key} is False)")
        views = self.prepare(z, mask)
        # Losses in float32 (or the caller's float64) even under bf16/fp16 autocast.
        with torch.autocast(device_type=views.u.device.type, enabled=False):
            output = self.loss(views, **extra)
        self.last_metrics = {k: v.detach() for k, v in output.metrics.items()}
        return output

    def loss(self, views: ViewSet) -> ObjectiveOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- trainer hooks (no-ops unless the objective keeps state) -------------------------
    def critic_step(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Train an auxiliary model on the detached ``z`` ``[K, M, d]`` before the loss; returns metrics."""
        return {}

    def on_step_end(self, z: torch.Tensor, index: torch.Tensor) -> None:
        """After a micro-batch's backward, with the detached ``z`` ``[K, M, d]`` and ``index`` ``[K]``."""

    def on_epoch_end(self, epoch: int) -> None:
        """After epoch ``epoch`` (counted from 0)."""

    def on_optimizer_step(self) -> None:
        """After every optimiser step (not inside an accumulation window): e.g. clamp a learned
        temperature (:class:`ContrastiveObjective`)."""

    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters the trainer's optimiser updates with the encoder's (a learned
        temperature, SigLIP's bias): their own learning rate (``objective.lr``), no weight decay,
        gradients averaged over processes. Auxiliary models with their own optimiser (IPMC's
        critic) are not among them."""
        return []

    def learned_values(self) -> dict[str, float]:
        """The current values of the learned parameters, by name (e.g. ``temperature``), for
        ``results.json`` and the exported encoder; empty when nothing is learned."""
        return {}

    # ---- input handling ------------------------------------------------------------------
    def check_views(self, M: int) -> None:
        """``ValueError`` if the objective is not defined for ``M`` views per sample."""
        if self.exact_views is not None and M != self.exact_views:
            raise ValueError(
                f"objective {self.name!r} needs exactly {self.exact_views} views per sample, got M = {M} "
                "(use multi_crop or a poly-view objective for more)"
            )
        if M < 2:
            raise ValueError(f"objective {self.name!r} needs at least 2 views per sample, got M = {M}")

    def prepare(self, z: torch.Tensor, mask: torch.Tensor | None) -> ViewSet:
        """Check ``z`` ``[K, M, d]`` and ``mask`` ``[K, M]``, normalise (unless
        ``normalise_inputs`` is False), gather across ranks."""
        prefix = f"objective {self.name!r}:"
        check_embeddings(z, prefix)
        K, M, d = z.shape
        self.check_views(M)
        if K < 2:
            raise ValueError(f"{prefix} needs at least K = 2 samples (negatives come from other samples), got K = {K}")
        if d < 1:
            raise ValueError(f"{prefix} embedding dimension d must be >= 1, got {d}")
        if self.check_inputs:
            check_finite(z, prefix)
        if mask is not None:
            if not self.supports_mask:
                raise ValueError(f"{prefix} does not support a view mask")
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (K, M):
                shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"{prefix} mask must have shape [K, M] = {(K, M)}, got {shape}")
            mask = mask.to(device=z.device, dtype=torch.bool)
        dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
        u = F.normalize(z.to(dtype), dim=-1, eps=1e-12) if self.normalise_inputs else z.to(dtype)
        present = torch.ones(K, M, dtype=torch.bool, device=z.device) if mask is None else mask
        world = distributed.world_size()
        if world > 1:
            distributed.check_equal_local_sizes(K, z.device, host_check=self.check_inputs)
            U = distributed.gather_with_grad(u)
            present_all = distributed.gather_no_grad(present)
            offset = distributed.rank() * K
        else:
            U, present_all, offset = u, present, 0
        return ViewSet(
            u=u, present=present, U=U, present_all=present_all, offset=offset, world=world, masked=mask is not None,
            chunk_size=self.chunk_size, score_budget_mb=self.score_budget_mb,
        )


#: The bound on a learned inverse temperature ``exp(logit_scale)``: 100, CLIP's (Radford et al.,
#: 2021) and open_clip's, which clamp ``logit_scale`` at ``log 100`` after every optimiser step.
MAX_LOGIT_SCALE = math.log(100.0)


def check_flag(value: object, what: str) -> bool:
    """``value`` as a bool; ``ValueError`` unless it is one (a YAML ``"yes"`` string is not)."""
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {value!r}")
    return value


class ContrastiveObjective(MultiViewObjective):
    """An objective over temperature-scaled cosine scores that honours a view mask.

    Default ``temperature`` 0.1: the value of SimCLR and CMC, which the MV-DHEL paper uses on
    ImageNet and the ER paper matches for its kernel bandwidth. The recipes here use 0.2 on the
    synthetic data; a one-seed check there (MV-DHEL, natural views, 96 steps,
    ``recipes/reproduce/_common.py``'s setup) gave linear-probe accuracy 0.834 at 0.1 and
    0.848 at 0.2, a difference inside the seed spread (about 0.04-0.09), so the default was
    kept. Start at 0.1-0.2; see ``recipes/README.md``.

    ``learn_temperature``: the temperature is learned, as in CLIP and open_clip. The objective
    then holds the parameter ``logit_scale`` = log(1 / temperature), initialised from
    ``temperature``; scores are ``<u, v> * exp(min(logit_scale, log 100))`` (the bound of
    :data:`MAX_LOGIT_SCALE`, which :meth:`on_optimizer_step` also applies to the parameter, as
    open_clip does after every step). The trainer gives it its own learning rate and no weight
    decay (``objective.lr``) and saves it with the run's checkpoints; ``temperature``
    (the property) is then a 0-dim tensor in the graph, and the metrics report its value. The
    parameter is float64 (one number): the temperature a recipe gives is the one used, to
    1e-16, and the scores keep the embeddings' dtype.

    ``chunk_size`` / ``score_budget_mb``: how its large score blocks are evaluated (see the
    memory model in ``docs/objectives.md``); they change memory and speed, not the loss."""

    supports_mask: ClassVar[bool] = True

    def __init__(
        self,
        temperature: float = 0.1,
        chunk_size: int | None = None,
        score_budget_mb: float = DEFAULT_SCORE_BUDGET_MB,
        learn_temperature: bool = False,
    ) -> None:
        super().__init__()
        initial = check_temperature(temperature)
        self.learn_temperature = check_flag(learn_temperature, f"objective {self.name!r}: learn_temperature")
        if self.learn_temperature:
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / initial), dtype=torch.float64))
        else:
            self.register_parameter("logit_scale", None)
        self._fixed_temperature = initial
        self.set_streaming(chunk_size, score_budget_mb)

    @property
    def temperature(self) -> float | torch.Tensor:
        """The fixed temperature (a float), or the learned one, ``exp(-min(logit_scale, log 100))``
        (a 0-dim tensor whose gradient reaches ``logit_scale``)."""
        if self.logit_scale is None:
            return self._fixed_temperature
        return torch.exp(-self.logit_scale.clamp(max=MAX_LOGIT_SCALE))

    def set_temperature(self, temperature: float) -> None:
        """Start from ``temperature`` (e.g. a pretrained model's learned value): the fixed value,
        or the learned parameter's (``logit_scale = log(1 / temperature)``, in place)."""
        temperature = check_temperature(temperature)
        self._fixed_temperature = temperature
        if self.logit_scale is not None:
            with torch.no_grad():
                self.logit_scale.fill_(math.log(1.0 / temperature))

    @torch.no_grad()
    def on_optimizer_step(self) -> None:
        """Clamp the learned ``logit_scale`` at log 100 (open_clip's bound), so that a value
        pushed past it comes back as soon as its gradient says so."""
        if self.logit_scale is not None:
            self.logit_scale.clamp_(max=MAX_LOGIT_SCALE)

    def trained_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.logit_scale, getattr(self, "logit_bias", None)) if p is not None]

    def learned_values(self) -> dict[str, float]:
        if self.logit_scale is None:
            return {}
        scale = min(float(self.logit_scale.detach()), MAX_LOGIT_SCALE)
        return {"temperature": math.exp(-scale), "logit_scale": scale}

    def compute(self, z: torch.Tensor, mask: torch.Tensor | None = None, **extra) -> ObjectiveOutput:
        output = super().compute(z, mask, **extra)
        if self.logit_scale is not None:
            value = torch.exp(-self.logit_scale.detach().clamp(max=MAX_LOGIT_SCALE))
            output.metrics["temperature"] = value
            self.last_metrics["temperature"] = value
        return output

    def extra_repr(self) -> str:
        streaming = "" if self.chunk_size is None else f", chunk_size={self.chunk_size}"
        if self.score_budget_mb != DEFAULT_SCORE_BUDGET_MB:
            streaming += f", score_budget_mb={self.score_budget_mb}"
        learned = ", learn_temperature=True" if self.learn_temperature else ""
        return f"temperature={self._fixed_temperature}{learned}{streaming}"


def mi_lower_bound(loss: torch.Tensor | float, K: int, M: int) -> torch.Tensor | float:
    """Poly-view lower bound on the one-vs-rest mutual information, in nats:
    ``c(B, M) - L = log(K*M - M + 1) - loss`` (Shidani et al., 2024, Theorem 2.3 / eq. 10).
    It bounds the objectives whose ``poly_view_bound`` is True."""
    if K < 2 or M < 2:
        raise ValueError(f"mi_lower_bound needs K >= 2 and M >= 2, got K = {K}, M = {M}")
    return math.log(K * M - M + 1) - loss


@torch.no_grad()
def similarity_metrics(views: ViewSet) -> dict[str, torch.Tensor]:
    """Mean cosine similarity of positive pairs (views of one sample) and of negative pairs
    (views of different samples), over the local batch, in O(K M d) without a score matrix.

    Uses sum_{i != j} <s_i, s_j> = ||sum_i s_i||^2 - sum_i ||s_i||^2 with s_i = sum of sample i's views.
    """
    u = views.u * views.present[..., None]
    per_sample = u.sum(dim=1)  # [K, d]
    counts = views.present.sum(dim=1).to(u.dtype)  # [K]
    self_sims = (u * u).sum(dim=(1, 2))  # sum_a <u_a, u_a> (1 per present view)
    pos_sum = (per_sample * per_sample).sum(dim=1) - self_sims
    pos_pairs = counts * (counts - 1)
    total = per_sample.sum(dim=0)
    neg_sum = (total * total).sum() - (per_sample * per_sample).sum()
    neg_pairs = counts.sum() ** 2 - (counts * counts).sum()
    return {
        "pos_sim": pos_sum.sum() / pos_pairs.sum().clamp_min(1),
        "neg_sim": neg_sum / neg_pairs.clamp_min(1),
    }
