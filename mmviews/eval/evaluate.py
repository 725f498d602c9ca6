"""``evaluate_encoder``: the single evaluation entry used by the trainer and ``mmviews eval``.

One entry, so that a run's own evaluation and a later ``mmviews eval RUN`` compute the same
numbers the same way: it extracts the embeddings of every split once, then runs the recipe's
tasks on them (linear, kNN and ridge probes and the sentiment metrics on the fused embeddings,
cross-view retrieval and zero-shot prototypes between views, diagnostics, identifiability),
each on the test split (the validation split when there is none), and records each probe's
chance level beside it. The tasks, their parameters and their metric keys are in
``docs/evaluation.md`` ("Tasks").
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Literal, Mapping, Sequence

import torch

from mmviews.eval.diagnostics import representation_diagnostics
from mmviews.eval.extract import Embeddings, Encoder, extract_embeddings
from mmviews.eval.health import CHANCE_PREFIX, classification_chance, regression_chance
from mmviews.eval.identifiability import identifiability_metrics
from mmviews.eval.metrics import ACC2_CONVENTIONS, msa_metrics
from mmviews.eval.probes import (class_prototype_accuracy, knn_accuracy, linear_probe_classification,
                                 linear_probe_regression)
from mmviews.eval.retrieval import cross_view_retrieval
from mmviews.eval.tasks import EvalTask, extracted_splits, parse_tasks

# The function that runs each task kind: its signature holds the defaults of TASK_PARAMS
# (``mmviews list tasks`` reads them from there).
TASK_FUNCTIONS: dict[str, Any] = {
    "linear": linear_probe_classification,
    "knn": knn_accuracy,
    "regression": linear_probe_regression,
    "msa": linear_probe_regression,
    "retrieval": cross_view_retrieval,
    "prototype": class_prototype_accuracy,
    "diagnostics": representation_diagnostics,
    "identifiability": identifiability_metrics,
}


def _label(emb: Embeddings, key: str, split: str) -> torch.Tensor:
    if key not in emb.labels:
        raise ValueError(f"label {key!r} is not in the {split} batches; they carry {sorted(emb.labels) or 'no labels'}")
    return emb.labels[key]


def _on(emb: Embeddings, device: torch.device) -> Embeddings:
    return Embeddings(
        emb.views.to(device), emb.mask.to(device), emb.fused.to(device),
        {k: v.to(device) for k, v in emb.labels.items()}, emb.view_names, emb.index, emb.view_modalities,
    )


def _retrieval_pairs(emb: Embeddings, task: EvalTask) -> list[tuple[int, int]]:
    names = emb.view_names
    if "pairs" in task.params:
        pairs = []
        for a, b in task.params["pairs"]:
            for n in (a, b):
                if n not in names:
                    raise ValueError(f"retrieval view {n!r} is not one of the views {names}")
            pairs.append((names.index(a), names.index(b)))
        return pairs
    # Default: one view per modality (the first, i.e. slot 0) and all pairs of those; with a
    # single modality, all pairs of its views.
    modality_of = emb.view_modalities or names
    firsts: dict[str, int] = {}
    for i, mod in enumerate(modality_of):
        firsts.setdefault(mod, i)
    chosen = sorted(firsts.values()) if len(firsts) > 1 else list(range(len(names)))
    return list(itertools.combinations(chosen, 2))


def _spectra_by_view_name(data: dict[str, Any], view_names: Sequence[str]) -> dict[str, Any]:
    """The diagnostics' plot data with each view's spectrum (``spectrum/view<a>``, a position)
    under the view's name (``spectrum/text_0``), so that the plot's legend names the views."""
    renamed = {}
    for key, value in data.items():
        position = key[len("spectrum/view"):] if key.startswith("spectrum/view") else ""
        if position.isdigit() and int(position) < len(view_names):
            key = f"spectrum/{view_names[int(position)]}"
        renamed[key] = value
    return renamed


def _compute(
    tasks: list[EvalTask],
    train: Embeddings | None,
    val: Embeddings | None,
    ev: Embeddings,
    split: str,
    seed: int,
    device: torch.device,
) -> tuple[dict[str, float], dict[str, Any]]:
    # Probes and kNN run on `device` (the accelerator's GPU when there is one): large
    # splits are much faster there than on CPU.
    train, val, ev = (None if e is None else _on(e, device) for e in (train, val, ev))
    metrics: dict[str, float] = {}
    data: dict[str, Any] = {}

    def probe_splits(label: str) -> tuple[Any, ...]:
        """(train x, y, val x, y, eval x, y) of the fused embeddings, as the probes take them."""
        assert train is not None
        return (
            train.fused, _label(train, label, "train"),
            None if val is None else val.fused, None if val is None else _label(val, label, "val"),
            ev.fused, _label(ev, label, split),
        )

    for task in tasks:
        if task.kind == "linear":
            assert train is not None
            res = linear_probe_classification(
                *probe_splits(task.label), seed=seed, **task.params,
            )
            metrics[f"{split}/linear/{task.label}/acc"] = res.metrics["test_acc"]
            metrics[f"{CHANCE_PREFIX}{split}/linear/{task.label}/acc"] = classification_chance(
                _label(train, task.label, "train"), _label(ev, task.label, split))
            if split != "val":
                # the score that chose the weight decay; where the validation split is the one
                # evaluated, its key holds the probe's accuracy on that split (above) instead
                metrics[f"val/linear/{task.label}/acc"] = res.val_score
            if val is not None:  # (without a validation split the score is of a held-out tenth of train)
                metrics[f"{CHANCE_PREFIX}val/linear/{task.label}/acc"] = classification_chance(
                    _label(train, task.label, "train"), _label(val, task.label, "val"))
            metrics[f"linear/{task.label}/weight_decay"] = res.weight_decay
        elif task.kind == "knn":
            assert train is not None
            metrics[f"{split}/knn/{task.label}/top1"] = knn_accuracy(
                train.fused, _label(train, task.label, "train"), ev.fused, _label(ev, task.label, split),
                **task.params,
            )
            metrics[f"{CHANCE_PREFIX}{split}/knn/{task.label}/top1"] = classification_chance(
                _label(train, task.label, "train"), _label(ev, task.label, split))
        elif task.kind in ("regression", "msa"):
            assert train is not None
            res = linear_probe_regression(
                *probe_splits(task.label), seed=seed, **task.params,
            )
            if task.kind == "regression":
                chance = regression_chance(_label(train, task.label, "train"), _label(ev, task.label, split))
                for k in ("test_mae", "test_mse", "test_r2"):
                    if k in res.metrics:
                        metrics[f"{split}/regression/{task.label}/{k[5:]}"] = res.metrics[k]
                        if k[5:] in chance:
                            metrics[f"{CHANCE_PREFIX}{split}/regression/{task.label}/{k[5:]}"] = chance[k[5:]]
                metrics[f"regression/{task.label}/weight_decay"] = res.weight_decay
            else:
                assert res.predictions is not None
                for k, v in msa_metrics(res.predictions, _label(ev, task.label, split), task.dataset).items():
                    metrics[f"{split}/msa/{task.dataset}/{k}"] = v
                metrics[f"msa/{task.dataset}/weight_decay"] = res.weight_decay
        elif task.kind == "retrieval":
            pairs = _retrieval_pairs(ev, task)
            recalls: list[float] = []
            chances: list[float] = []
            for a, b in pairs:
                res = cross_view_retrieval(ev.views, ev.mask, a, b, ks=task.params.get("ks", (1, 5, 10)))
                na, nb = ev.view_names[a], ev.view_names[b]
                # the number of pairs: chance is R@k = k / n, mean rank (n + 1) / 2
                metrics[f"{split}/retrieval/{na}->{nb}/n"] = metrics[f"{split}/retrieval/{nb}->{na}/n"] = res["n"]
                for k, v in res.items():
                    if k.startswith("a2b/"):
                        metrics[f"{split}/retrieval/{na}->{nb}/{k[4:]}"] = v
                    elif k.startswith("b2a/"):
                        metrics[f"{split}/retrieval/{nb}->{na}/{k[4:]}"] = v
                if "a2b/R@1" in res:
                    recalls += [res["a2b/R@1"], res["b2a/R@1"]]
                    chances += [1.0 / res["n"]] * 2
            if len(pairs) > 1 and recalls:
                # one figure for the headline: R@1 averaged over every pair and direction, and its chance
                metrics[f"{split}/retrieval/mean/R@1"] = sum(recalls) / len(recalls)
                metrics[f"{CHANCE_PREFIX}{split}/retrieval/mean/R@1"] = sum(chances) / len(chances)
        elif task.kind == "prototype":
            assert train is not None
            chance = classification_chance(_label(train, task.label, "train"), _label(ev, task.label, split))
            accuracies = []
            pairs = _retrieval_pairs(ev, task)
            for a, b in pairs:
                for query, source in ((a, b), (b, a)):
                    # prototypes from the training samples that have the source view, queries that have theirs
                    has_source, has_query = train.mask[:, source], ev.mask[:, query]
                    if not has_source.any() or not has_query.any():
                        continue
                    accuracy = class_prototype_accuracy(
                        train.views[has_source, source], _label(train, task.label, "train")[has_source],
                        ev.views[has_query, query], _label(ev, task.label, split)[has_query])
                    key = f"{split}/prototype/{task.label}/{ev.view_names[query]}->{ev.view_names[source]}/acc"
                    metrics[key] = accuracy
                    metrics[CHANCE_PREFIX + key] = classification_chance(
                        _label(train, task.label, "train"), _label(ev, task.label, split)[has_query])
                    accuracies.append(accuracy)
            if len(pairs) > 1 and accuracies:
                metrics[f"{split}/prototype/{task.label}/mean/acc"] = sum(accuracies) / len(accuracies)
                metrics[f"{CHANCE_PREFIX}{split}/prototype/{task.label}/mean/acc"] = chance
        elif task.kind == "diagnostics":
            diag, diag_data = representation_diagnostics(ev.views, ev.mask, ev.fused, seed=seed, **task.params)
            metrics.update({f"{split}/diag/{k}": v for k, v in diag.items()})
            data.update(_spectra_by_view_name(diag_data, ev.view_names))
        elif task.kind == "identifiability":
            fit, score = (val, ev) if val is not None else _halves(ev)
            metrics.update(identifiability_metrics(fit, score, split, **task.params))
    return metrics, data


def _halves(emb: Embeddings) -> tuple[Embeddings, Embeddings]:
    """The first and the second half of a split's samples (a fit and a score set)."""
    half = emb.num_samples // 2

    def part(rows: slice) -> Embeddings:
        return Embeddings(emb.views[rows], emb.mask[rows], emb.fused[rows], {k: v[rows] for k, v in emb.labels.items()},
                          emb.view_names, None if emb.index is None else emb.index[rows], emb.view_modalities)

    return part(slice(0, half)), part(slice(half, None))


def check_task_labels(tasks: Sequence[EvalTask], loaders: Mapping[str, Any]) -> None:
    """A ``ValueError`` naming the task, the label and the labels there are, when a label a task
    reads (``linear:KEY``, ``knn:KEY``...) is not carried by the first sample of a split it is
    extracted from (``loaders``: split name -> loader): said before any split is embedded, not
    after. Loaders whose samples are not mmviews sample dicts with a ``labels`` mapping are not checked."""
    from mmviews.data.streaming import first_samples
    from mmviews.registry import did_you_mean

    wanted = [task for task in tasks if task.label is not None]
    for split, loader in loaders.items():
        dataset = getattr(loader, "dataset", None)
        if not wanted or dataset is None:
            continue
        try:
            first = first_samples(dataset, 1)
        except (TypeError, NotImplementedError):  # an iterable dataset of the caller's, without a length
            continue
        # samples without a "labels" mapping (labels a collator of the caller's adds) are not checked
        if not first or not isinstance(first[0], Mapping) or not isinstance(first[0].get("labels"), Mapping):
            continue
        carried = sorted(first[0].get("labels") or {})
        for task in wanted:
            if task.label not in carried:
                raise ValueError(f"task '{task.kind}:{task.label}' reads the label {task.label!r}, which the samples of "
                                 f"the {split} split do not carry{did_you_mean(task.label, carried)}; they carry "
                                 f"{carried or 'no labels'}")


def evaluate_encoder(
    encoder: Encoder,
    train_loader: Any | None,
    val_loader: Any | None,
    test_loader: Any | None,
    tasks: Sequence[str | Mapping[str, Any]] | str,
    out_dir: str | os.PathLike | None = None,
    accelerator: Any | None = None,
    *,
    fuse: Literal["concat", "mean"] = "concat",
    log_csv: str | os.PathLike | None = None,
    meta: Mapping[str, Any] | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
    plots: bool = True,
) -> dict[str, float]:
    """Extracts embeddings of the splits the tasks need, computes the metrics and (with
    ``out_dir``) writes the report (``metrics.json``, ``summary.md``, plots).

    Args:
        encoder: ``encoder(batch: ViewBatch) -> (z [K, M, d], mask [K, M])``.
        train_loader, val_loader, test_loader: loaders of ViewBatch (unshuffled); train is
            needed by probes and kNN; val (optional) selects the probes' weight decay; the
            metrics are computed on test, or on val if test is None.
        tasks: see docs/evaluation.md ("Tasks").
        accelerator: an ``accelerate.Accelerator`` for multi-process extraction; the metrics
            are computed on the main process and broadcast, and only it writes files.
        log_csv: training log (``step,loss,...``) plotted in the report when it exists.
        meta: extra run information stored in ``metrics.json``; ``mmviews compare`` reads
            ``meta["objective"]`` and ``meta["num_views"]`` (the number of views M the
            encoder was TRAINED with, which may differ from the evaluation views).
        device: where probes, kNN and diagnostics run (default: the accelerator's device,
            else CPU).
        progress: show a progress bar per extracted split (main process only).
        plots: draw the report's PNGs (see :func:`mmviews.eval.report.write_report`).
    Returns:
        Flat dict metric name -> float, identical on every process.
    """
    parsed = parse_tasks(tasks)
    if test_loader is None and val_loader is None:
        raise ValueError("evaluate_encoder needs a test or a validation loader to evaluate on")
    extracted = extracted_splits(parsed, val_loader is not None, test_loader is not None)
    if "train" in extracted and train_loader is None:
        kinds = sorted({t.kind for t in parsed if t.needs_train})
        raise ValueError(f"tasks {kinds} need a train_loader")
    split = extracted[-1]
    eval_loader = test_loader if split == "test" else val_loader
    by_split = {"train": train_loader, "val": val_loader, "test": test_loader}
    check_task_labels(parsed, {name: by_split[name] for name in extracted})  # before the (slow) extraction

    def extract(loader: Any, name: str) -> Embeddings:
        return extract_embeddings(encoder, loader, accelerator, fuse, desc=f"embeddings ({name})", progress=progress)

    train = extract(train_loader, "train") if "train" in extracted else None
    val = extract(val_loader, "val") if "val" in extracted[:-1] else None
    ev = extract(eval_loader, split)

    is_main = accelerator is None or accelerator.is_main_process
    metrics: dict[str, float] = {}
    if is_main:
        if device is None:
            device = accelerator.device if accelerator is not None else "cpu"
        metrics, data = _compute(parsed, train, val, ev, split, seed, torch.device(device))
        info: dict[str, Any] = {
            "eval_split": split,
            # the views evaluated; the trainer passes the training M as meta["num_views"]
            "eval_num_views": len(ev.view_names),
            "views": ", ".join(ev.view_names),
            "fuse": fuse,
            "tasks": ", ".join(f"{t.kind}:{t.dataset or t.label}" if t.label or t.dataset else t.kind for t in parsed),
            f"n_{split}": ev.num_samples,
            "embedding_dim": int(ev.views.shape[2]),
        }
        if train is not None:
            info["n_train"] = train.num_samples
        if val is not None:
            info["n_val"] = val.num_samples
        if any(t.kind == "msa" for t in parsed):
            info["acc2_conventions"] = dict(ACC2_CONVENTIONS)
        info.update(meta or {})
        if out_dir is not None:
            from mmviews.eval.report import write_report

            write_report(out_dir, metrics, meta=info, data=data, log_csv=log_csv, plots=plots)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [metrics]
        broadcast_object_list(box, from_process=0)
        metrics = box[0]
    return metrics
