"""The guard tests of the README's strong claims fail when the claim is broken on purpose.

Each test applies one break of ``tests/mutations.py`` (with ``monkeypatch``, undone after the
test), runs the guard test's own check on one of its cases and asserts that the check reports
the failure. The claims, their guards and the breaks are listed in ``tests/README.md``; the
slower mutation tests live beside their guards (resume: test_train_resume.py, two processes:
test_train_distributed.py, accumulation: test_train_accumulation.py, the cached step's scale and
RNG replay: test_train_cached_scaling.py and test_train_cached.py, sample-keyed dropout masks:
test_modalities_dropout_masks.py)."""

from __future__ import annotations

import pytest
from mutations import apply_break

from mmviews.objectives import _streaming


def test_reference_check_fails_without_mv_dhels_within_view_mask(monkeypatch):
    """Claim: the objectives are exact (values and gradients equal the float64 loop references)."""
    import test_objectives_reference as guard

    case = ("mv_dhel", 5, 3, 4, 0.5, 0)
    guard.test_masked_value_and_gradient_match_reference(*case)  # the guard passes on the intact code
    apply_break("drop_within_view_mask", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="are not close"):
        guard.test_masked_value_and_gradient_match_reference(*case)


def test_streaming_check_fails_with_shifted_blocks(monkeypatch):
    """Claim: streamed (chunked) score blocks give the unchunked loss and gradients."""
    import test_objectives_streaming as guard

    case, chunk = ("geometric_pvc", "geometric_pvc", {}), 3
    apply_break("shift_streamed_blocks", monkeypatch.setattr)
    # the guard's spy, wrapped around the broken function (it records the blocks asked for)
    calls: list[tuple[int, int]] = []
    broken = _streaming._block_scores

    def spy(anchors, candidates, start, stop, *args):
        calls.append((start, stop))
        return broken(anchors, candidates, start, stop, *args)

    monkeypatch.setattr(_streaming, "_block_scores", spy)
    with pytest.raises(AssertionError, match="are not close"):
        guard.test_streamed_equals_unchunked_float64(case, False, chunk, calls)


def test_hostile_checkpoint_check_fails_when_checkpoints_are_unpickled(tiny_run, monkeypatch, tmp_path, capsys):
    """Claim: no code from a run folder ever runs (checkpoint files load weights-only)."""
    import test_security as guard

    apply_break("unpickle_checkpoints", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        guard.test_resume_refuses_a_hostile_pickle_in_the_checkpoint(tiny_run, tmp_path, capsys, "optimizer.bin")
    assert (tmp_path / "PWNED").exists()  # the break did what it says: the payload ran
