"""What ``mmviews train RECIPE --check`` runs once the run is built: in seconds, everything that
training would otherwise find in its first step or at its end.

:data:`CHECKS` is a list of small functions ``check(parts, source)``, run in order by
:func:`run_checks`; each raises a :class:`~mmviews.config.ConfigError` that names the recipe key
to change and a value that would work. To add one, write a function with that signature and
append it to :data:`CHECKS`.

- :func:`check_view_modalities`: every view's modality is in the samples of every split (a view
  of a modality no dataset column is mapped to fails in the collator of the first step);
- :func:`check_batches_forward`: one small batch of each split through the real collator (the
  training collator with the encoder's host preparation, as the trainer's loader does; the
  evaluation loaders' own), and each adapter's forward on its modality's inputs (a ``[D]``
  column where the adapter wants ``[L, D]`` fails there);
- :func:`check_evaluation_labels`: every label an ``evaluation.tasks`` task reads is carried by
  the samples of the splits it is evaluated on (found otherwise only after the whole run).

Every split is checked with its own first samples, a streamed one (``data.streaming: true``)
included: those are read through its stream, so a streamed training split whose rows lack the
label a probe trains on fails here, not after training.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from mmviews.config import ConfigError
from mmviews.data.streaming import first_samples
from mmviews.registry import did_you_mean
from mmviews.train.build import RunParts

Check = Callable[[RunParts, str], None]

#: Samples per checked batch: enough for a batch, few enough to take a moment on any encoder.
CHECK_BATCH_SAMPLES = 2
#: What :func:`_splits` appends to the name of a split read through an evaluation loader.
EVALUATION_SUFFIX = " (evaluation)"


def _splits(parts: RunParts) -> Iterator[tuple[str, str, Any, Callable[[list[Any]], Any]]]:
    """``(split name, recipe key naming it, dataset, collate)`` of the training split and of each
    evaluation split (the loaders' own collators). Streamed splits (``data.streaming``) are listed
    too: the checks read their first samples through the stream
    (:func:`~mmviews.data.streaming.first_samples`), as their loaders would."""
    data = parts.config.data
    yield data.train_split, "data.train_split", parts.datasets["train"], parts.collator
    keys = {"train": ("data.train_split", data.train_split), "val": ("data.val_split", data.val_split),
            "test": ("data.test_split", data.test_split)}
    for role, loader in parts.eval_loaders.items():
        if loader is not None and role in keys:
            key, name = keys[role]
            yield f"{name}{EVALUATION_SUFFIX}", key, loader.dataset, loader.collate_fn


def _split_name(split: str) -> str:
    """The split's own name (the value of its recipe key), without :data:`EVALUATION_SUFFIX`."""
    return split.removesuffix(EVALUATION_SUFFIX)


def _first_samples(dataset: Any, n: int = CHECK_BATCH_SAMPLES) -> list[Any]:
    """The first ``n`` samples: indexed in a map-style split, read through the stream of a streamed one."""
    return first_samples(dataset, n)


def check_view_modalities(parts: RunParts, source: str) -> None:
    """Every modality a view names is a modality of every split's samples."""
    entries = parts.config.views
    for split, _, dataset, _ in _splits(parts):
        first = _first_samples(dataset, 1)
        if not first:
            continue
        have = sorted(first[0]["modalities"])
        for i, entry in enumerate(entries):
            # a bare string entry is the view's modality itself (ViewSpec.from_config)
            bare = isinstance(entry, str)
            modality, key = (entry, f"views.{i}") if bare else (entry.get("modality"), f"views.{i}.modality")
            if modality not in have:  # a view entry always names one (ViewSpec.from_config checked them)
                raise ConfigError(
                    f"{source}: key '{key}' = {modality!r}: the samples of split {split!r} have no "
                    f"modality {modality!r}{did_you_mean(modality, have)}; they have {have}: use one of them, or map "
                    f"a dataset column to it (data.options.columns: {{{modality}: <column>}})")


def _describe_inputs(inputs: Any) -> str:
    if not isinstance(inputs, dict):
        return type(inputs).__name__
    parts = []
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{key} {list(value.shape)}")
        elif isinstance(value, list):
            parts.append(f"{key}: list of {len(value)}")
    return ", ".join(parts) or "no tensors"


def _shape_hint(modality: str, adapter_type: str, inputs: Any) -> str:
    """A value that would work when an adapter that reads ``[B, L, D]`` sequences gets vectors."""
    values = inputs.get("values") if isinstance(inputs, dict) else None
    if isinstance(values, torch.Tensor) and values.ndim == 2 and adapter_type in ("mlp", "feature_sequence"):
        return (f"; the column behind {modality!r} holds one [D] = [{values.shape[1]}] vector per sample, read as a "
                f"waveform, whereas adapter type {adapter_type!r} reads an [L, D] sequence per sample: store each "
                f"value as a list of rows ([[...]], shape [1, {values.shape[1]}]), or map an [L, D] column in "
                f"data.options.columns")
    return ""


def check_batches_forward(parts: RunParts, source: str) -> None:
    """One small batch of each split through its collator, and every adapter's forward on it."""
    encoder = parts.encoder
    prepare = encoder.host_preparation()
    was_training = encoder.training
    encoder.eval()
    try:
        for split, key, dataset, collate in _splits(parts):
            samples = _first_samples(dataset)
            if not samples:
                continue
            try:
                batch = collate(samples)
                if collate is parts.collator:
                    batch = prepare(batch)
                batch = encoder.flow_from_frames(batch)  # data.options.flow: raft, as the step computes it
            except (ValueError, KeyError, TypeError, RuntimeError) as error:
                raise ConfigError(f"{source}: key '{key}' = {_split_name(split)!r}: a batch of its first "
                                  f"{len(samples)} samples cannot be collated: {error}") from error
            for modality, inputs in batch.inputs.items():
                # a validated recipe has an adapter, with a type, for every view's modality
                adapter_type = str(parts.config.adapters[modality]["type"])
                try:
                    with torch.no_grad():  # as training encodes it: only the present views reach the adapter
                        encoder.adapters[modality].embed_present(inputs, batch.present_items(modality),
                                                                 check_inputs=True)
                except Exception as error:  # any failure of the adapter on real inputs is the recipe's
                    raise ConfigError(
                        f"{source}: key 'adapters.{modality}' (type {adapter_type!r}): the {modality!r} inputs of a "
                        f"batch of split {split!r} ({_describe_inputs(inputs)}) fail in the adapter: "
                        f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                        f"{_shape_hint(modality, adapter_type, inputs)}") from error
    finally:
        encoder.train(was_training)


def check_evaluation_labels(parts: RunParts, source: str) -> None:
    """Every label an evaluation task reads is carried by the samples of its splits."""
    config = parts.config
    if not config.evaluation.tasks:
        return
    tasks = config.eval_tasks
    for split, key, dataset, _ in _splits(parts):
        first = _first_samples(dataset, 1) if split.endswith(EVALUATION_SUFFIX) else []
        if not first:
            continue
        carried = sorted((first[0].get("labels") or {}))
        for i, task in enumerate(tasks):
            if task.label is None or task.label in carried:
                continue
            spec = config.evaluation.tasks[i]
            works = [f"{task.kind}:{label}" for label in carried]
            value = (f"e.g. {works[0]!r}" if works else "a task without a label, e.g. 'retrieval'")
            note = getattr(dataset, "label_note", None)  # where this dataset's labels come from (an image folder's)
            raise ConfigError(
                f"{source}: key 'evaluation.tasks.{i}' = {spec!r}: task {task.kind!r} reads the label "
                f"{task.label!r}, which the samples of split {_split_name(split)!r} do not carry"
                f"{did_you_mean(task.label, carried)}; they carry {carried or 'no labels'}: use {value}, or map the "
                f"label to a dataset column (data.options.labels: {{{task.label}: <column>}})"
                + (f"; {note}" if isinstance(note, str) else ""))


#: The checks of :func:`run_checks`, in order (a modality first, then what reads it).
CHECKS: list[Check] = [check_view_modalities, check_batches_forward, check_evaluation_labels]


def run_checks(parts: RunParts, source: str, checks: list[Check] | None = None) -> None:
    """Run ``checks`` (default :data:`CHECKS`) on a built run; the first failure is raised."""
    for check in CHECKS if checks is None else checks:
        check(parts, source)
