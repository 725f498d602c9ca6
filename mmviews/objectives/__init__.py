"""Multi-view objectives over ``z`` ``[K samples, M views, d]``.

``get_objective(name, **params)`` builds one by its registry name; ``list_objectives()``
lists the names and ``describe_objectives()`` gives each a one-line description;
``objective_class(name)`` is the class, whose attributes declare what the objective takes
(``supports_mask``, ``exact_views``, ``takes_index``, ``takes_teacher``, ``needs_teacher``,
``takes_dataset_size``, ``poly_view_bound``: see :class:`MultiViewObjective`).

Large batches: every objective that builds a large score block (all pairs ``[K M, N M]`` or
within view ``[M, K, N]``) takes ``chunk_size`` (anchor samples per block) and
``score_budget_mb`` (default 512): beyond the budget, or with a ``chunk_size``, the block is
streamed (computed and reduced block by block, recomputed in backward), with the same loss
and gradients and ``O(block * N M + K M d)`` memory (the memory model: ``docs/objectives.md``).

Every objective is an ``nn.Module``: ``objective(z, mask=None)`` returns the 0-dim loss,
``objective.compute(z, mask)`` an :class:`ObjectiveOutput` with metrics, and
``objective.last_metrics`` holds the metrics of the last call. The exact formulas, shapes and
departures from the authors' code are in each module's docstring. :mod:`.reference` holds
slow loop implementations written straight from the equations (used by the tests and by
``mmviews bench objectives``).
"""

from ._base import (
    ContrastiveObjective,
    MultiViewObjective,
    ObjectiveOutput,
    ViewSet,
    describe_objectives,
    get_objective,
    list_objectives,
    masked_logsumexp,
    mi_lower_bound,
    objective_class,
    register_objective,
)

# Importing the modules registers the objectives.
from . import simclr, geometric_pvc, arithmetic_pvc, sufficient_statistics, multi_crop, avg  # noqa: F401,E401
from . import mv_infonce, mv_dhel, mv_cl1, mv_cl2  # noqa: F401,E401
from . import fmicl, er, ipmc, siglip  # noqa: F401,E401

__all__ = [
    "ContrastiveObjective",
    "MultiViewObjective",
    "ObjectiveOutput",
    "ViewSet",
    "describe_objectives",
    "get_objective",
    "list_objectives",
    "masked_logsumexp",
    "mi_lower_bound",
    "objective_class",
    "register_objective",
]
