"""What a run left out of its data, per split: the one record that ``results.json``
(``data_losses``), ``report.md``, the model card and the training log all read.

``data_losses`` maps each split the run read, by its role (``"train"``, ``"val"``, ``"test"``),
to::

    {"split": "train",                  # the dataset's split name
     "excluded": 2,                     # samples left out before training: known bad
     "excluded_list": "/x.mmstore/manifest.json",   # where they are listed (None: none)
     "skipped_in_training": 1,          # distinct samples dropped from training batches when
                                        # they could not be read (data.options.on_error: skip),
                                        # since the run started or was last resumed
     "skipped_in_evaluation": 1,        # samples missing from the final evaluation's embeddings
                                        # (None: no evaluation of this split at the end)
     "examples": ["/x/Run/v_a.avi: InvalidDataError: ...", ...]}   # up to 5 messages

A dataset takes part by exposing ``excluded`` (``{sample id: reason}``) and ``excluded_list``
(:class:`~mmviews.data.video.VideoFolder` does), and by marking a sample it cannot read with
the key ``"unreadable"`` (the collator drops it and lists it in ``ViewBatch.dropped``).

``absent_modalities`` (also in ``results.json``) maps a modality that no sample of the training
split has to the one line that says so (``mmviews train --check``, the start of training and
the report print it); a dataset takes part with ``modality_present_anywhere(modality) -> bool |
None`` (None: unknown).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

DATA_LOSSES_KEY = "data_losses"
ABSENT_MODALITIES_KEY = "absent_modalities"
MAX_EXAMPLES = 5


def run_datasets(parts: Any) -> dict[str, tuple[str, Any]]:
    """``{role: (split name, dataset)}`` of the splits a run reads (train, and the evaluation's
    val/test), from its :class:`~mmviews.train.build.RunParts`."""
    data = parts.config.data
    names = {"train": data.train_split, "val": data.val_split, "test": data.test_split}
    datasets = {"train": (names["train"], parts.datasets["train"])}
    for role, loader in (parts.eval_loaders or {}).items():
        dataset = getattr(loader, "dataset", None)
        if role != "train" and dataset is not None:
            datasets[role] = (names.get(role) or role, dataset)
    return datasets


class DataLosses:
    """The per-split record (module docstring), filled as the run goes."""

    def __init__(self, datasets: Mapping[str, tuple[str, Any]]) -> None:
        """``datasets``: ``{role: (split name, dataset)}`` (:func:`run_datasets`)."""
        self.splits: dict[str, dict[str, Any]] = {}
        self._skipped: dict[str, set[str]] = {}
        for role, (split, dataset) in datasets.items():
            excluded = dict(getattr(dataset, "excluded", None) or {})
            self.splits[role] = {
                "split": split, "excluded": len(excluded),
                "excluded_list": getattr(dataset, "excluded_list", None) if excluded else None,
                "skipped_in_training": 0, "skipped_in_evaluation": None,
                "examples": [f"{rel}: {reason}" for rel, reason in list(excluded.items())[:MAX_EXAMPLES]],
            }
            self._skipped[role] = set()

    def record_dropped(self, role: str, messages: Iterable[str]) -> None:
        """Samples of split ``role`` dropped from a training batch (``ViewBatch.dropped``). One
        process only: a dataset that drops samples is refused on several (``build_run``)."""
        self._skipped[role].update(messages)

    def record_evaluated(self, role: str, dataset_size: int, evaluated: int | None) -> None:
        """The final evaluation embedded ``evaluated`` of the split's ``dataset_size`` samples."""
        if role in self.splits and evaluated is not None:
            self.splits[role]["skipped_in_evaluation"] = max(0, int(dataset_size) - int(evaluated))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out = {}
        for role, record in self.splits.items():
            skipped = sorted(self._skipped[role])
            examples = list(record["examples"])
            examples += skipped[:max(0, MAX_EXAMPLES - len(examples))]
            out[role] = {**record, "skipped_in_training": len(skipped), "examples": examples}
        return out


def excluded_lines(losses: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per split that left known-bad samples out before training."""
    return [f"left out {r['excluded']} sample(s) of split {r['split']!r} known to be unreadable (listed in "
            f"{r['excluded_list']})" for r in losses.values() if r.get("excluded")]


def loss_lines(losses: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per split that lost samples (excluded or skipped), for the log and reports."""
    lines = []
    for role, r in losses.items():
        parts = []
        if r.get("excluded"):
            parts.append(f"{r['excluded']} left out before training (known unreadable, listed in {r['excluded_list']})")
        if r.get("skipped_in_training"):
            parts.append(f"{r['skipped_in_training']} dropped from training batches (unreadable when read)")
        if r.get("skipped_in_evaluation"):
            parts.append(f"{r['skipped_in_evaluation']} missing from the final evaluation (unreadable when read)")
        if parts:
            lines.append(f"split {r['split']!r} ({role}): " + "; ".join(parts))
    return lines


def absent_modalities(dataset: Any, view_spec: Any, split: str) -> dict[str, str]:
    """``{modality: line}`` for each modality of the views that no sample of ``dataset`` has."""
    present_anywhere = getattr(dataset, "modality_present_anywhere", None)
    if present_anywhere is None:
        return {}
    out = {}
    for modality in view_spec.modalities:
        if present_anywhere(modality) is False:
            views = [v.name for v in view_spec.views if v.modality == modality]
            out[modality] = (f"modality {modality!r} is absent from every sample of split {split!r}: its view(s) "
                             f"{', '.join(views)} are masked 100 % and learn nothing; remove them from the recipe key "
                             f"'views' (and its adapter), or use data that has {modality}")
    return out
