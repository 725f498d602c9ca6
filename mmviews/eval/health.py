"""Did the run learn? Warnings for the training log and the run report.

A contrastive run can fail quietly: the loss goes down a little, the report has numbers, and
the encoder is no better than its random initialisation. These checks read what a run
already records and say so in one line each, with a hint:

From the training log (``metrics.csv`` rows; the mean of the last quarter of the logged rows,
at least one):

- ``collapse``: positive and negative similarity both high and close (``neg_sim >= 0.8`` and
  ``pos_sim - neg_sim <= 0.1``): every embedding points the same way.
- ``no_alignment``: ``pos_sim - neg_sim <= 0.02`` with ``neg_sim < 0.8``: the views of a sample
  are no closer than different samples.
- ``mi_bound``: the poly-view MI lower bound (``mi_lower_bound``) is <= 0 nats: the loss is no
  better than the InfoNCE cap log(KM - M + 1), i.e. chance.

From the final evaluation (``results.json``'s ``eval`` and ``eval_random``):

- ``rank``: the effective rank of the embeddings (``diag/erank/fused`` or ``view_mean``) is
  below 2: the embeddings span about one direction.
- ``uniformity``: the uniformity loss (``diag/unif``, log E exp(-2 ||u - v||^2)) is above
  -0.5: the embeddings sit in a small cap of the sphere (a uniform spread in d >= 8 gives
  about -3.5 to -4).
- ``retrieval``: cross-view retrieval at chance: a mean rank of at least 0.8 times the chance
  value (n + 1) / 2 (``n`` the number of pairs).
- ``probe``: a probe of the trained encoder scores below the same probe on the randomly
  initialised encoder (accuracy, kNN top-1, R^2 lower; MAE higher).

The live check (:class:`LiveHealth`) applies the log checks to each logged row once 20 % of
the steps are done (a randomly initialised encoder often looks collapsed at step 1) and
reports each kind once.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

__all__ = ["LiveHealth", "evaluation_warnings", "run_warnings", "training_warnings"]

COLLAPSE_NEG_SIM = 0.8
COLLAPSE_GAP = 0.1
ALIGNMENT_GAP = 0.02
MIN_ERANK = 2.0
MAX_UNIFORMITY = -0.5
CHANCE_RANK_FRACTION = 0.8

HINT_COLLAPSE = ("hint: lower optimisation.lr, or the objective's temperature (objective.params.temperature); "
                 "an objective with a uniformity term (mv_dhel) resists collapse")
HINT_ALIGN = ("hint: check that the views share information (natural views of one sample, or augmented copies "
              "that keep what you want to learn); try a higher optimisation.lr or more steps")
HINT_MI = "hint: the loss is at chance: lower optimisation.lr or the temperature, check that the views share information"


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _tail_mean(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the last quarter of ``rows`` (at least the last row) where it is finite."""
    tail = rows[-max(1, len(rows) // 4):]
    values = [v for v in (_finite(r.get(key)) for r in tail) if v is not None]
    return sum(values) / len(values) if values else None


def _row_warnings(pos: float | None, neg: float | None, mi: float | None, where: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if pos is not None and neg is not None:
        if neg >= COLLAPSE_NEG_SIM and pos - neg <= COLLAPSE_GAP:
            out.append(("collapse", f"collapse{where}: positive and negative similarity are both high and close "
                                    f"(pos_sim {pos:.2f}, neg_sim {neg:.2f}); {HINT_COLLAPSE}"))
        elif pos - neg <= ALIGNMENT_GAP:
            out.append(("no_alignment", f"no alignment{where}: the views of a sample are no closer than different "
                                        f"samples (pos_sim {pos:.2f}, neg_sim {neg:.2f}); {HINT_ALIGN}"))
    if mi is not None and mi <= 0:
        out.append(("mi_bound", f"MI lower bound <= 0{where} ({mi:.2f} nats); {HINT_MI}"))
    return out


def training_warnings(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Warnings from the training log's rows (``metrics.csv``), over its last quarter."""
    if not rows:
        return []
    where = f" at the end of training (mean of the last {max(1, len(rows) // 4)} logged steps)"
    return [message for _, message in _row_warnings(_tail_mean(rows, "pos_sim"), _tail_mean(rows, "neg_sim"),
                                                     _tail_mean(rows, "mi_lower_bound"), where)]


_HIGHER_IS_BETTER = ("/acc", "/top1", "/r2")
_LOWER_IS_BETTER = ("/mae",)


def evaluation_warnings(trained: Mapping[str, Any] | None, random_init: Mapping[str, Any] | None) -> list[str]:
    """Warnings from the final evaluation metrics, against the random-initialisation baseline."""
    trained, random_init = trained or {}, random_init or {}
    out: list[str] = []
    for split in ("test", "val"):
        erank = _finite(trained.get(f"{split}/diag/erank/fused", trained.get(f"{split}/diag/erank/view_mean")))
        if erank is not None and erank < MIN_ERANK:
            out.append(f"collapse: the {split} embeddings' effective rank is {erank:.2f} (near 1: one direction); "
                       f"{HINT_COLLAPSE}")
        unif = _finite(trained.get(f"{split}/diag/unif"))
        if unif is not None and unif > MAX_UNIFORMITY:
            out.append(f"collapse: the {split} uniformity loss is {unif:.2f} (> {MAX_UNIFORMITY}: the embeddings "
                       f"crowd together); {HINT_COLLAPSE}")
        if erank is not None or unif is not None:
            break  # the test split when there is one
    for key in sorted(trained):
        if "/retrieval/" in key and key.endswith("/MeanR"):
            n, mean_rank = _finite(trained.get(key[: -len("MeanR")] + "n")), _finite(trained[key])
            if n is not None and mean_rank is not None and n >= 2 and mean_rank >= CHANCE_RANK_FRACTION * (n + 1) / 2:
                pair = key.split("/retrieval/")[1].rsplit("/", 1)[0]
                out.append(f"retrieval at chance: {pair} mean rank {mean_rank:.1f} of {int(n)} (chance {(n + 1) / 2:.1f}); "
                           f"{HINT_ALIGN}")
    for key in sorted(trained):
        if not key.startswith("test/") and not (key.startswith("val/") and not any(k.startswith("test/") for k in trained)):
            continue
        higher = key.endswith(_HIGHER_IS_BETTER)
        if not (higher or key.endswith(_LOWER_IS_BETTER)):
            continue
        t, r = _finite(trained[key]), _finite(random_init.get(key))
        if t is None or r is None:
            continue
        if (t < r) if higher else (t > r):
            out.append(f"probe below random init: {key} is {t:.4f} trained, {r:.4f} for the encoder as initialised; "
                       "training made the representation worse for this task (see the warnings above; hint: "
                       "temperature, learning rate, views that share the information this task needs)")
    return out


def run_warnings(rows: Sequence[Mapping[str, Any]], trained: Mapping[str, Any] | None,
                 random_init: Mapping[str, Any] | None) -> list[str]:
    """Every warning of a finished run: its training log, then its evaluation."""
    return training_warnings(rows) + evaluation_warnings(trained, random_init)


class LiveHealth:
    """The log checks on each logged row during training, each kind reported once, and only
    after ``start_fraction`` of ``total_steps`` (an untrained encoder often starts collapsed)."""

    def __init__(self, total_steps: int, start_fraction: float = 0.2) -> None:
        self.first_step = max(1, math.ceil(total_steps * start_fraction))
        self.reported: set[str] = set()

    def check(self, row: Mapping[str, Any]) -> list[str]:
        """New warnings for this row (``step``, ``pos_sim``, ``neg_sim``, ``mi_lower_bound``)."""
        step = int(row.get("step", 0))
        if step < self.first_step:
            return []
        found = _row_warnings(_finite(row.get("pos_sim")), _finite(row.get("neg_sim")),
                              _finite(row.get("mi_lower_bound")), f" at step {step}")
        new = [(kind, message) for kind, message in found if kind not in self.reported]
        self.reported.update(kind for kind, _ in new)
        return [message for _, message in new]
