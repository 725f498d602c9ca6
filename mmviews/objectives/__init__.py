"""Multi-view objectives over ``z`` ``[K samples, M views, d]``.

``get_objective(name, **params)`` builds one by its registry name; ``list_objectives()``
lists the names. Every objective is an ``nn.Module``: ``objective(z, mask=None)`` returns
the 0-dim loss, ``objective.compute(z, mask)`` an :class:`ObjectiveOutput` with metrics, and
``objective.last_metrics`` holds the metrics of the last call. The exact formulas are in
each module's docstring (and in the project's OBJECTIVES.md).
"""

from ._base import (
    ContrastiveObjective,
    MultiViewObjective,
    ObjectiveOutput,
    ViewSet,
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
from . import fmicl, er, ipmc  # noqa: F401,E401

__all__ = [
    "ContrastiveObjective",
    "MultiViewObjective",
    "ObjectiveOutput",
    "ViewSet",
    "get_objective",
    "list_objectives",
    "masked_logsumexp",
    "mi_lower_bound",
    "objective_class",
    "register_objective",
]
