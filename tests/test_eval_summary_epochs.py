"""``mmviews.eval.summary.epochs_text``: how much of the training split a run went through, as its
report and model card say it: whole epochs by count, a run that stopped inside an epoch by the
fraction it saw (a fresh-sample split is never gone through: "0 epochs" would read as no
training), and results.json files written before the fraction was recorded."""

from __future__ import annotations

import pytest

from mmviews.eval.summary import epochs_text


@pytest.mark.parametrize(("summary", "text"), [
    ({"epochs": 2, "epochs_trained": 2.0, "steps": 8}, "2 epochs"),
    ({"epochs": 1, "epochs_trained": 1.0, "steps": 4}, "1 epoch"),
    ({"epochs": 0, "epochs_trained": 0.0, "steps": 0}, "0 epochs"),
    ({"epochs": 0, "epochs_trained": 0.018311, "steps": 300}, "0.0183 of an epoch"),
    ({"epochs": 0, "epochs_trained": 0.5, "steps": 2}, "0.5 of an epoch"),
    ({"epochs": 2, "epochs_trained": 2.5, "steps": 10}, "2.5 epochs"),
    ({"epochs": 1, "epochs_trained": 1.25, "steps": 5}, "1.25 epochs"),
    # results.json written before epochs_trained existed: completed epochs only
    ({"epochs": 3, "steps": 12}, "3 epochs"),
    ({"epochs": 1, "steps": 4}, "1 epoch"),
    ({"epochs": 0, "steps": 300}, "less than one epoch"),
    ({"epochs": 0, "steps": 1}, "less than one epoch"),
    ({"epochs": 0, "steps": 0}, "0 epochs"),
    ({}, "0 epochs"),
])
def test_epochs_text(summary, text):
    assert epochs_text(summary) == text
