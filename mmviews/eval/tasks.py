"""The evaluation tasks a recipe names: their kinds, parameters and descriptions, and the
typed :class:`EvalTask` each entry of ``evaluation.tasks`` resolves to.

This is the schema of the section, free of torch, so that loading a recipe resolves its tasks
(:mod:`mmviews.config`) without the probes that run them (:mod:`mmviews.eval.evaluate`). A task
is written as a string (``"linear:KEY"``, ``"msa:DATASET"``) or a mapping with the same fields
and the kind's parameters (``{"kind": "knn", "label": "class", "k": 20}``); what each kind
computes is described in ``docs/evaluation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from mmviews.registry import did_you_mean
from mmviews.schema import ConfigError, coerce, where

# Spellings other layers use (the trainer's recipes write "linear_probe").
TASK_ALIASES = {
    "linear_probe": "linear",
    "logistic": "linear",
    "regression_probe": "regression",
    "ridge": "regression",
    "diagnostic": "diagnostics",
    "zero_shot": "prototype",
    "zeroshot": "prototype",
}
MSA_DATASETS = ("mosi", "mosei", "sims")


@dataclass(frozen=True)
class TaskKind:
    """One kind of evaluation task. ``params``: its keyword parameters in the mapping form, each
    with the type its value is checked against (their defaults are the running function's:
    ``mmviews list tasks``). ``default_label``: the label read when the task names none (None:
    the task reads no label). ``needs_train``: it fits on the training split's embeddings.
    ``needs_val``: it fits on the validation split's (and scores on the evaluated split)."""

    name: str
    description: str
    params: Mapping[str, Any] = field(default_factory=dict)
    default_label: str | None = None
    needs_train: bool = False
    needs_val: bool = False


TASKS: dict[str, TaskKind] = {kind.name: kind for kind in (
    TaskKind("linear", "logistic-regression probe on a class label (linear:KEY, default label class)",
             {"weight_decays": Sequence[float], "max_iter": int}, "class", True),
    TaskKind("knn", "weighted kNN accuracy on a class label (knn:KEY, default label class)",
             {"k": int, "temperature": float}, "class", True),
    TaskKind("regression", "ridge probe on a score (regression:KEY, default label sentiment): MAE, MSE, R^2",
             {"weight_decays": Sequence[float]}, "sentiment", True),
    TaskKind("msa", "ridge probe on sentiment with the MSA metrics (msa:mosi|mosei|sims)",
             {"weight_decays": Sequence[float]}, "sentiment", True),
    TaskKind("retrieval", "cross-view retrieval R@k both ways (pairs default: the first view of each modality, "
             "all pairs)", {"pairs": Sequence[Sequence[str]], "ks": Sequence[int]}),
    TaskKind("prototype", "zero-shot classification across views: class prototypes of one view's training "
             "embeddings classify another view (prototype:KEY, default label class; pairs as retrieval, both ways)",
             {"pairs": Sequence[Sequence[str]]}, "class", True),
    TaskKind("diagnostics", "alignment, uniformity, effective rank, vMF entropy, similarity histograms",
             {"kappa": float, "max_samples": int | None}),
    TaskKind("identifiability", "R^2 of each latent block (content, style, specific) from each modality's embedding, "
             "linear and RBF kernel ridge, fitted on valid, scored on test (the identifiability dataset's labels)",
             {"blocks": Sequence[str], "alphas": Sequence[float], "gammas": Sequence[float], "folds": int,
              "fit_samples": int}, needs_val=True),
)}
TASK_KINDS = tuple(TASKS)
# Keyword parameters each task accepts in its mapping form (checked before any extraction).
TASK_PARAMS: dict[str, frozenset[str]] = {name: frozenset(kind.params) for name, kind in TASKS.items()}


def task_description(kind: str) -> str:
    """One line on task ``kind`` (one of :data:`TASK_KINDS`)."""
    return TASKS[kind].description


@dataclass
class EvalTask:
    """One resolved entry of ``evaluation.tasks``: its ``kind`` (one of :data:`TASK_KINDS`), the
    ``label`` it reads (the kind's default when not given), the MSA ``dataset`` (``msa`` only)
    and the kind's keyword ``params``, checked."""

    kind: str
    label: str | None = None
    dataset: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_train(self) -> bool:
        return TASKS[self.kind].needs_train

    @property
    def needs_val(self) -> bool:
        return TASKS[self.kind].needs_val


def extracted_splits(tasks: Sequence[EvalTask], has_val: bool, has_test: bool) -> tuple[str, ...]:
    """The splits (``"train"``, ``"val"``, ``"test"``) whose embeddings an evaluation of ``tasks``
    extracts, in the order it extracts them: the training split when a task fits on it
    (``needs_train``), the validation split when a task fits or selects on it and the test split
    is the one evaluated, and the evaluated split (the test split, else the validation split).
    What :func:`mmviews.eval.evaluate.evaluate_encoder` embeds, and so what the memory estimate
    of ``--check`` counts."""
    if not (has_val or has_test):
        raise ValueError("an evaluation needs a test or a validation split to evaluate on")
    evaluated = "test" if has_test else "val"
    fits_on_train = any(task.needs_train for task in tasks)
    fits_on_val = fits_on_train or any(task.needs_val for task in tasks)
    return ((("train",) if fits_on_train else ()) + (("val",) if fits_on_val and has_val and evaluated == "test" else ())
            + (evaluated,))


def parse_tasks(tasks: Iterable[str | Mapping[str, Any] | EvalTask] | str, source: str | None = None,
                key: str = "evaluation.tasks") -> list[EvalTask]:
    """Task strings / mappings (see the module docstring) as :class:`EvalTask` objects.

    A wrong entry raises ``ValueError`` naming it; with ``source`` (the recipe), a
    :class:`~mmviews.schema.ConfigError` naming ``source`` and the entry's key path
    (``key.<i>``, ``key.<i>.<parameter>``)."""
    if isinstance(tasks, str):
        tasks = [tasks]
    parsed = [_parse_task(spec, source, f"{key}.{i}") for i, spec in enumerate(tasks)]
    if not parsed:
        raise ValueError("no evaluation tasks given")
    return parsed


def _parse_task(spec: str | Mapping[str, Any] | EvalTask, source: str | None, key: str) -> EvalTask:
    def fail(message: str) -> ValueError:
        return ConfigError(f"{where(source, key)}: {message}") if source is not None else ValueError(message)

    if isinstance(spec, EvalTask):  # resolved already (a loaded recipe's eval_tasks)
        return spec
    if isinstance(spec, str):
        kind, _, arg = spec.partition(":")
        params: dict[str, Any] = {}
        label = dataset = None
        if kind == "msa":
            dataset = arg or None
        elif arg:
            label = arg
    elif isinstance(spec, Mapping):
        params = dict(spec)
        if "kind" not in params:
            raise fail(f"task {spec!r}: a task mapping needs a 'kind', one of {', '.join(TASK_KINDS)}")
        kind = str(params.pop("kind"))
        label = params.pop("label", None)
        dataset = params.pop("dataset", None)
    else:
        raise fail(f"an evaluation task must be a string or a mapping, got {spec!r}")
    kind = TASK_ALIASES.get(kind, kind)
    if kind not in TASKS:
        raise fail(f"unknown evaluation task {spec!r}{did_you_mean(kind, [*TASKS, *TASK_ALIASES])}; "
                   f"kinds are {', '.join(TASK_KINDS)}")
    if kind == "msa" and str(dataset).lower() not in MSA_DATASETS:
        raise fail(f"task {spec!r}: msa needs a dataset among 'mosi', 'mosei', 'sims' (e.g. 'msa:mosi')")
    accepted = TASKS[kind].params
    unknown = sorted(set(params) - set(accepted), key=str)
    if unknown:
        raise fail(f"task {spec!r}: unknown parameter(s) {unknown}; {kind} accepts {sorted(accepted)}"
                   f"{did_you_mean(unknown[0], accepted)}")
    # the values' types, with the recipe's key path (or the task itself) in the message
    context = source if source is not None else f"task {spec!r}"
    for name, value in (("label", label), ("dataset", dataset)):
        if value is not None and not isinstance(value, str):
            raise fail(f"task {spec!r}: {name} must be a string, got {value!r}")
    params = {name: coerce(value, accepted[name], f"{key}.{name}" if source is not None else name, context)
              for name, value in params.items()}
    return EvalTask(kind, label or TASKS[kind].default_label, dataset, params)
