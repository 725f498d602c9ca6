"""``mmviews compare``'s numbers (mmviews.eval.compare), each against a value the test computes
itself: mean and sample standard deviation over seeds (``statistics``), the "within noise" band
(two standard errors of the difference of the means), which runs are seeds of one configuration,
and what is read from a run folder. (The comparison's tables end to end: test_eval_chance.py
and test_eval_report.py.)"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from mmviews.eval import compare


@pytest.mark.parametrize("values", [[0.5], [0.70, 0.74, 0.72], [1.0, 2.0], [0.1, 0.4, 0.2, 0.9, 0.3]])
def test_mean_and_sample_std(values):
    mean, std = compare.mean_and_std(values)
    assert mean == pytest.approx(statistics.fmean(values))
    if len(values) == 1:
        assert std is None
    else:
        assert std == pytest.approx(statistics.stdev(values))


def _band(a: list[float], b: list[float]) -> float:
    """Two standard errors of the difference of the means (Welch): 2 sqrt(s_a^2/n_a + s_b^2/n_b)."""
    return 2 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def test_within_noise_is_two_standard_errors_of_the_difference():
    a = [0.70, 0.74, 0.72, 0.71, 0.73]
    b = [0.73, 0.77, 0.75, 0.74, 0.76]  # the means differ by 0.03
    # standard errors put 0.03 outside the band (0.020); standard deviations (2 sqrt(s_a^2 + s_b^2) = 0.045) would not
    assert _band(a, b) < 0.03 < 2 * math.sqrt(statistics.variance(a) + statistics.variance(b))
    within, band = compare.within_noise(a, b)
    assert band == pytest.approx(_band(a, b)) and within is False
    close = [0.71, 0.75, 0.73, 0.72, 0.74]  # 0.01 apart
    within, band = compare.within_noise(a, close)
    assert band == pytest.approx(_band(a, close)) and within is True
    # at the band's edge: equal is within
    edge_a, edge_b = [0.0, 2.0], [3.0, 5.0]
    assert _band(edge_a, edge_b) == pytest.approx(2 * math.sqrt(2 / 2 + 2 / 2))
    assert compare.within_noise(edge_a, [v - 3 + _band(edge_a, edge_b) for v in edge_b])[0] is True
    assert compare.within_noise(edge_a, [v - 3 + _band(edge_a, edge_b) + 1e-9 for v in edge_b])[0] is False
    assert compare.within_noise([0.5], b) is None and compare.within_noise(a, [0.5]) is None
    assert compare.NOISE_STANDARD_ERRORS == 2.0


def test_noise_guard_fails_when_the_band_is_of_standard_deviations(monkeypatch):
    from mutations import apply_break

    apply_break("noise_band_of_standard_deviations", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_within_noise_is_two_standard_errors_of_the_difference()
