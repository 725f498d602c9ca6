"""Did the run learn? Warnings for the training log and the run report.

A contrastive run can fail quietly: the loss goes down a little, the report has numbers, and the
encoder is no better than its random initialisation. These checks read what a run already records
(``metrics.csv``, ``results.json``'s evaluation and random-init baseline) and say so in one line
each: divergence, collapse, no alignment (judged on held-out data where the evaluation measured
it), a probe below the random initialisation. The warnings of a run share one hint, for its most
basic problem and its own settings (:class:`HealthSettings`); :class:`LiveHealth` runs the log
checks during training. The thresholds, why each is where it is, and their calibration on real
runs are in ``docs/evaluation.md`` ("Health checks").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["CHANCE_PREFIX", "HealthSettings", "LiveHealth", "chance_level", "classification_chance",
           "evaluation_warnings", "is_chance_key", "measures_held_out_alignment", "regression_chance", "run_warnings",
           "training_warnings"]

COLLAPSE_NEG_SIM = 0.8
COLLAPSE_GAP = 0.1
ALIGNMENT_GAP = 0.02
MIN_ERANK = 2.0
MAX_UNIFORMITY = -0.5
CHANCE_RANK_FRACTION = 0.8
# Retrieval directions named in the one 'retrieval at chance' warning (the others are counted).
RETRIEVAL_EXAMPLES = 3
# The log checks judge at least this many logged steps (a tiny run's one or two rows are noise).
MIN_LOGGED_ROWS = 3
DIVERGENCE_RISE = 0.05
PROBE_MARGIN = 0.01  # accuracy, top-1 and R^2: absolute; MAE: relative
LIVE_START_FRACTION = 0.5
LIVE_CHECKS = 20

# The diagnoses, most basic first: a run's warnings carry the hint of the first one found.
DIVERGENCE, COLLAPSE, NO_ALIGNMENT, BELOW_RANDOM = "divergence", "collapse", "no alignment", "below random init"
DIAGNOSES = (DIVERGENCE, COLLAPSE, NO_ALIGNMENT, BELOW_RANDOM)
# Each diagnosis as the cause other warnings refer to ("likely a consequence of ...").
AS_CAUSE = {DIVERGENCE: "the divergence", COLLAPSE: "the collapse", NO_ALIGNMENT: "the views' lack of alignment",
            BELOW_RANDOM: "the probes below random init"}


@dataclass(frozen=True)
class HealthSettings:
    """What the hints need to know of the run: ``optimisation.lr``, the objective's name and
    its ``temperature``, ``optimisation.max_grad_norm`` (None when unknown or unset: the hint
    then names the key without a value)."""

    lr: float | None = None
    objective: str | None = None
    temperature: float | None = None
    max_grad_norm: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> "HealthSettings":
        """From a :class:`~mmviews.config.TrainConfig`."""
        temperature = _finite((config.objective.params or {}).get("temperature"))
        return cls(_finite(config.optimisation.lr), config.objective.name, temperature,
                   _finite(config.optimisation.max_grad_norm))


def _now(value: float | None) -> str:
    return "" if value is None else f" (now {value:g})"


def _now_inside(value: float | None) -> str:
    """:func:`_now` for a key already in parentheses."""
    return "" if value is None else f", now {value:g}"


def hint(diagnosis: str, settings: HealthSettings) -> str:
    """The one hint of a diagnosis, for the run's settings."""
    if diagnosis == DIVERGENCE:
        lower = "" if settings.lr is None else f", e.g. {settings.lr / 10:g}"
        clip = ("clip the gradients (optimisation.max_grad_norm)" if settings.max_grad_norm is None else
                f"clip the gradients harder (optimisation.max_grad_norm{_now_inside(settings.max_grad_norm)})")
        return f"hint: lower optimisation.lr{_now(settings.lr)}{lower}, or {clip}"
    if diagnosis == COLLAPSE:
        text = (f"hint: lower optimisation.lr{_now(settings.lr)}, or the objective's temperature "
                f"(objective.params.temperature{_now_inside(settings.temperature)})")
        if settings.objective != "mv_dhel":
            text += "; an objective with a uniformity term (mv_dhel) resists collapse"
        return text
    if diagnosis == NO_ALIGNMENT:
        return ("hint: check that the views share information (natural views of one sample, or augmented copies "
                f"that keep what you want to learn); train longer, or raise optimisation.lr{_now(settings.lr)}")
    return "hint: choose views that share the information this task needs (training made it worse for this task)"


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [v for v in (_finite(r.get(key)) for r in rows) if v is not None]
    return sum(values) / len(values) if values else None


def _quarter(rows: Sequence[Mapping[str, Any]]) -> int:
    return max(1, len(rows) // 4)


def training_findings(rows: Sequence[Mapping[str, Any]], where: str | None = None) -> list[tuple[str, str]]:
    """``[(diagnosis, message without hint)]`` from the training log's rows; nothing from fewer
    than :data:`MIN_LOGGED_ROWS` rows (one or two logged steps say nothing about a trend)."""
    if len(rows) < MIN_LOGGED_ROWS:
        return []
    n, n_head = _quarter(rows), max(1, len(rows) // 10)
    # the head is short: a diverging loss jumps within a few steps (quickstart at lr 1.0: 25.9 to 37.7 at step 3)
    head, tail = rows[:n_head], rows[-n:]
    if where is None:
        where = f" at the end of training (mean of the last {n} logged steps)"
    out: list[tuple[str, str]] = []
    first, last = _mean(head, "loss"), _mean(tail, "loss")
    if first is not None and last is not None and last - first > DIVERGENCE_RISE * abs(first):
        out.append((DIVERGENCE, f"divergence{where}: the training loss rose from {first:.4g} (mean of the first "
                                f"{n_head} logged steps) to {last:.4g}"))
    pos, neg, mi = _mean(tail, "pos_sim"), _mean(tail, "neg_sim"), _mean(tail, "mi_lower_bound")
    if pos is not None and neg is not None:
        if neg >= COLLAPSE_NEG_SIM and pos - neg <= COLLAPSE_GAP:
            out.append((COLLAPSE, f"collapse{where}: positive and negative similarity are both high and close "
                                  f"(pos_sim {pos:.2f}, neg_sim {neg:.2f})"))
        elif pos - neg <= ALIGNMENT_GAP:
            out.append((NO_ALIGNMENT, f"no alignment{where}: on the training batches, the views of a sample are no "
                                      f"closer than different samples (pos_sim {pos:.3f}, neg_sim {neg:.3f}: gap "
                                      f"{pos - neg:.3f}, chance 0)"))
    if mi is not None and mi <= 0:
        out.append((NO_ALIGNMENT, f"MI lower bound <= 0{where} ({mi:.2f} nats): the loss is at chance"))
    return out


_HIGHER_IS_BETTER = ("/acc", "/top1", "/r2")
_LOWER_IS_BETTER = ("/mae",)


# Metrics that hold the chance level of another metric: ``chance/<metric>`` (written by the
# evaluation beside the probes' metrics; no table lists them as metrics of their own).
CHANCE_PREFIX = "chance/"


def is_chance_key(key: str) -> bool:
    """Whether ``key`` is the chance level of another metric, not a metric."""
    return key.startswith(CHANCE_PREFIX)


def classification_chance(train_labels: Any, eval_labels: Any) -> float:
    """The accuracy of a classifier that sees nothing of its input: it always answers the
    training split's most frequent class (the smallest such class on a tie), scored on the
    evaluated labels. 1 / C for C balanced classes; the majority rate for unbalanced ones."""
    import torch

    train_labels, eval_labels = torch.as_tensor(train_labels).reshape(-1), torch.as_tensor(eval_labels).reshape(-1)
    if train_labels.numel() == 0 or eval_labels.numel() == 0:
        raise ValueError("classification_chance needs training and evaluated labels")
    values, counts = torch.unique(train_labels, return_counts=True)
    majority = values[int(torch.argmax(counts))]  # argmax: the first of the most frequent (sorted values)
    return float((eval_labels.to(train_labels.device) == majority).double().mean())


def regression_chance(train_targets: Any, eval_targets: Any) -> dict[str, float]:
    """MAE, MSE and R^2 (``{"mae", "mse", "r2"}``) of the prediction that sees nothing of its
    input: the training split's mean, scored on the evaluated targets (R^2 as the probes
    compute it, against the evaluated targets' own variance: about 0, slightly below)."""
    import torch

    train_targets = torch.as_tensor(train_targets, dtype=torch.float64).reshape(-1)
    eval_targets = torch.as_tensor(eval_targets, dtype=torch.float64).reshape(-1).to(train_targets.device)
    if train_targets.numel() == 0 or eval_targets.numel() == 0:
        raise ValueError("regression_chance needs training and evaluated targets")
    resid = eval_targets - train_targets.mean()
    out = {"mae": float(resid.abs().mean()), "mse": float((resid**2).mean())}
    var = float(((eval_targets - eval_targets.mean()) ** 2).mean())
    if var > 0:
        out["r2"] = 1.0 - out["mse"] / var
    return out


def chance_level(key: str, metrics: Mapping[str, Any]) -> float | None:
    """The value a metric takes for embeddings that carry no information, where the metrics
    hold what it needs: the evaluation's ``chance/<key>`` for the probes (a classifier that
    always answers the training split's most frequent class, :func:`classification_chance`; a
    regression that predicts the training mean, :func:`regression_chance`); R@k = k / n and
    mean or median rank (n + 1) / 2 for retrieval (``n`` pairs, ``.../n``); for the alignment
    figures, the same quantity over negative pairs: ``diag/sim_pos_mean`` ->
    ``diag/sim_neg_mean``, ``diag/align`` (mean squared distance of positive pairs of unit
    vectors) -> 2 - 2 ``sim_neg_mean``. None otherwise."""
    recorded = _finite(metrics.get(CHANCE_PREFIX + key))
    if recorded is not None:
        return recorded
    if "/retrieval/" in key:
        n = _finite(metrics.get(key.rsplit("/", 1)[0] + "/n"))
        leaf = key.rsplit("/", 1)[1]
        if n is None or n < 1:
            return None
        if leaf.startswith("R@") and leaf[2:].isdigit():
            return min(1.0, int(leaf[2:]) / n)
        if leaf in ("MeanR", "MedR"):
            return (n + 1) / 2
        return None
    if key.endswith(("/diag/sim_pos_mean", "/diag/align")):
        neg = _finite(metrics.get(key.rsplit("/diag/", 1)[0] + "/diag/sim_neg_mean"))
        if neg is None:
            return None
        return neg if key.endswith("sim_pos_mean") else 2.0 - 2.0 * neg
    return None


def evaluation_findings(trained: Mapping[str, Any] | None, random_init: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``[(diagnosis, message without hint)]`` from the final evaluation metrics, against the
    random-initialisation baseline."""
    trained, random_init = trained or {}, random_init or {}
    out: list[tuple[str, str]] = []
    for split in ("test", "val"):
        erank = _finite(trained.get(f"{split}/diag/erank/fused", trained.get(f"{split}/diag/erank/view_mean")))
        if erank is not None and erank < MIN_ERANK:
            out.append((COLLAPSE, f"collapse: the {split} embeddings' effective rank is {erank:.2f} (near 1: one "
                                  "direction)"))
        unif = _finite(trained.get(f"{split}/diag/unif"))
        if unif is not None and unif > MAX_UNIFORMITY:
            out.append((COLLAPSE, f"collapse: the {split} uniformity loss is {unif:.2f} (> {MAX_UNIFORMITY}: the "
                                  "embeddings crowd together)"))
        if erank is not None or unif is not None:
            break  # the test split when there is one
    directions, at_chance = 0, []
    for key in sorted(trained):
        if "/retrieval/" in key and key.endswith("/MeanR"):
            n, mean_rank = _finite(trained.get(key[: -len("MeanR")] + "n")), _finite(trained[key])
            if n is None or mean_rank is None or n < 2:
                continue
            directions += 1
            if mean_rank >= CHANCE_RANK_FRACTION * (n + 1) / 2:
                pair = key.split("/retrieval/")[1].rsplit("/", 1)[0]
                at_chance.append(f"{pair} mean rank {mean_rank:.1f} of {int(n)} (chance {(n + 1) / 2:.1f})")
    if at_chance:  # one warning for all directions: the same diagnosis, the same hint
        shown = ", ".join(at_chance[:RETRIEVAL_EXAMPLES])
        more = f", and {len(at_chance) - RETRIEVAL_EXAMPLES} more" if len(at_chance) > RETRIEVAL_EXAMPLES else ""
        out.append((NO_ALIGNMENT, f"retrieval at chance in {len(at_chance)} of {directions} directions: {shown}{more}"))
    for split in ("test", "val"):
        pos, neg = (_finite(trained.get(f"{split}/diag/sim_{k}_mean")) for k in ("pos", "neg"))
        if pos is not None and neg is not None:
            if neg < COLLAPSE_NEG_SIM and pos - neg <= ALIGNMENT_GAP:  # a collapse is flagged by erank / unif
                out.append((NO_ALIGNMENT, f"no alignment on the held-out {split} split: the views of a sample are no "
                                          f"closer than different samples (sim_pos_mean {pos:.3f}, sim_neg_mean "
                                          f"{neg:.3f}: gap {pos - neg:.3f}, chance 0)"))
            break
    has_test = any(k.startswith("test/") for k in trained)
    for key in sorted(trained):
        if not (key.startswith("test/") or (key.startswith("val/") and not has_test)):
            continue
        higher = key.endswith(_HIGHER_IS_BETTER)
        if not (higher or key.endswith(_LOWER_IS_BETTER)):
            continue
        if not higher and key.rsplit("/", 1)[0] + "/r2" in trained:
            # judged by its R^2, in the label's units: polyview_gaussian's latent is regressed to
            # R^2 0.998 trained, 1.000 at random init (a 1-D input), MAE 0.035 against 0.003
            continue
        t, r = _finite(trained[key]), _finite(random_init.get(key))
        if t is None or r is None:
            continue
        if (t < r - PROBE_MARGIN) if higher else (t > r + PROBE_MARGIN * abs(r)):
            out.append((BELOW_RANDOM, f"probe below random init: {key} is {t:.4f} trained, {r:.4f} for the encoder "
                                      "as initialised"))
    return out


def with_hints(findings: Sequence[tuple[str, str]], settings: HealthSettings | None = None,
               primary: str | None = None) -> list[str]:
    """The messages of ``findings``, each with the hint of the run's one diagnosis: ``primary``
    (one reported earlier) unless a more basic one is among the findings. Findings of that
    diagnosis carry its hint; the others refer to it."""
    settings = settings or HealthSettings()
    # a more basic problem found later (live: a run that diverges after it failed to align) takes over
    found = {d for d, _ in findings} | ({primary} if primary else set())
    primary = next((d for d in DIAGNOSES if d in found), None)
    out = []
    for diagnosis, message in findings:
        if diagnosis == primary:
            out.append(f"{message}; {hint(diagnosis, settings)}")
        else:
            out.append(f"{message}; likely a consequence of {AS_CAUSE[primary]} (see that warning and its hint)")
    return out


def training_warnings(rows: Sequence[Mapping[str, Any]], settings: HealthSettings | None = None) -> list[str]:
    """Warnings from the training log's rows (``metrics.csv``)."""
    return with_hints(training_findings(rows), settings)


def evaluation_warnings(trained: Mapping[str, Any] | None, random_init: Mapping[str, Any] | None,
                        settings: HealthSettings | None = None) -> list[str]:
    """Warnings from the final evaluation metrics, against the random-initialisation baseline."""
    return with_hints(evaluation_findings(trained, random_init), settings)


def measures_held_out_alignment(metrics: Mapping[str, Any] | None) -> bool:
    """Whether an evaluation measured the alignment of the views on held-out data (a val or
    test split, in eval mode): cross-view retrieval or the diagnostics' similarities."""
    return any(k.startswith(("test/", "val/")) and ("/retrieval/" in k and k.endswith("/MeanR")
                                                   or k.endswith("/diag/sim_pos_mean"))
               for k in metrics or {})


def run_warnings(rows: Sequence[Mapping[str, Any]], trained: Mapping[str, Any] | None,
                 random_init: Mapping[str, Any] | None, settings: HealthSettings | None = None) -> list[str]:
    """Every warning of a finished run, its training log's then its evaluation's, with one hint.

    Alignment is judged on held-out data where the evaluation measured it
    (:func:`measures_held_out_alignment`): the training log's alignment checks (the gap of
    ``pos_sim`` and ``neg_sim``, the MI bound) are then left out, because on the training
    batches an encoder can tell its samples apart by memorising them (the quickstart on data
    whose modalities shared only a class and a sentiment: gap 0.154 on the last training
    batches, 0.044 on the test split, cross-view R@1 0.0036 at chance 0.002)."""
    log = training_findings(rows)
    if measures_held_out_alignment(trained):
        log = [(d, m) for d, m in log if d != NO_ALIGNMENT]
    return with_hints(log + evaluation_findings(trained, random_init), settings)


class LiveHealth:
    """The log checks during training, on the rows logged so far: from ``start_fraction`` of
    ``total_steps`` on (an untrained encoder often starts collapsed, and a healthy one needs
    time to align), at most about ``LIVE_CHECKS`` times, each kind reported once. Every warning
    carries the hint of the first diagnosis reported (or refers to it)."""

    def __init__(self, total_steps: int, start_fraction: float = LIVE_START_FRACTION,
                 settings: HealthSettings | None = None) -> None:
        self.total_steps = max(1, total_steps)
        self.first_step = max(1, math.ceil(self.total_steps * start_fraction))
        self.every = max(1, (self.total_steps - self.first_step + 1) // LIVE_CHECKS)
        self.settings = settings or HealthSettings()
        self.rows: list[dict[str, float | None]] = []
        self.reported: set[str] = set()  # message kinds: the first word ("divergence", "collapse", "MI", ...)
        self.primary: str | None = None

    def check(self, row: Mapping[str, Any]) -> list[str]:
        """New warnings after this row (``step``, ``loss``, ``pos_sim``, ``neg_sim``, ``mi_lower_bound``)."""
        step = int(row.get("step", 0))
        self.rows.append({k: _finite(row.get(k)) for k in ("loss", "pos_sim", "neg_sim", "mi_lower_bound")})
        if step < self.first_step or ((step - self.first_step) % self.every and step < self.total_steps):
            return []
        n = _quarter(self.rows)
        found = training_findings(self.rows, f" at step {step} (mean of the last {n} logged steps)")
        new = [(d, m) for d, m in found if m.split(" ")[0] not in self.reported]
        if not new:
            return []
        self.reported.update(m.split(" ")[0] for _, m in new)
        messages = with_hints(new, self.settings, self.primary)
        self.primary = next(d for d in DIAGNOSES if d in {d for d, _ in new} | {self.primary})
        return messages
