"""The adapters' input helpers (``mmviews.modalities.inputs``): masked means and length masks
computed as written out by hand, the structure checks (a missing key, a non-tensor, lengths of
the wrong shape) and the value checks (``InputCheck``: non-finite values, lengths out of
``[0, T]``, zero-length present items) each one line naming the adapter, the input and the bad
values, and ``subset_inputs`` picking the rows of batch-sized tensors and lists only."""

from __future__ import annotations

import math

import pytest
import torch

from mmviews.modalities.inputs import (
    InputCheck,
    SequenceInputCheck,
    check_finite,
    check_lengths,
    input_lengths,
    lengths_to_mask,
    masked_mean,
    per_clip,
    require_tensor,
    subset_inputs,
    to_device,
)


def _message(callable_, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        callable_(*args, **kwargs)
    return str(caught.value)


def test_masked_mean_averages_the_valid_positions_and_gives_zeros_for_none():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True], [False] * 4, [False, True, False, False]])
    expected = torch.stack([(x[0, 0] + x[0, 2] + x[0, 3]) / 3, torch.zeros(2, dtype=torch.float64), x[2, 1]])
    out = masked_mean(x, mask)
    assert out.dtype == torch.float64 and torch.allclose(out, expected)
    for half in (torch.float16, torch.bfloat16):  # the result keeps the features' dtype
        assert masked_mean(x.to(half), mask).dtype == half


def test_lengths_become_a_mask_of_the_first_positions():
    mask = lengths_to_mask(torch.tensor([2, 0, 3]), 3)
    assert mask.tolist() == [[True, True, False], [False, False, False], [True, True, True]]


def test_require_tensor_names_the_adapter_the_key_and_what_is_there():
    x = torch.zeros(2)
    assert require_tensor({"values": x}, "values", "audio adapter") is x
    assert _message(require_tensor, {"b": 1, "a": 2}, "values", "audio adapter") == (
        "audio adapter: input dict has no key 'values' (keys: ['a', 'b'])")
    assert _message(require_tensor, {"values": [1.0]}, "values", "audio adapter") == (
        "audio adapter: inputs['values'] must be a torch.Tensor, got list")


def test_to_device_converts_the_dtype_when_asked():
    x = torch.arange(3)
    assert to_device(x, "cpu").dtype == torch.long and to_device(x, "cpu", torch.float32).dtype == torch.float32
    assert torch.equal(to_device(x, torch.device("cpu"), torch.float64), x.double())


def test_made_tensors_follow_the_inputs_device():
    """On the meta device (no accelerator needed): lengths, masks and moved tensors are made on the
    device of the tensor they go with, not on the host."""
    x = torch.empty(3, 5, 2, device="meta")
    assert input_lengths({}, x, "s").device.type == "meta"
    assert input_lengths({"lengths": [1, 2, 3]}, x, "s").device.type == "meta"
    assert lengths_to_mask(torch.empty(3, dtype=torch.long, device="meta"), 4).device.type == "meta"
    assert to_device(torch.zeros(2), "meta").device.type == "meta"
    assert to_device(torch.zeros(2), torch.device("meta"), torch.float16).dtype == torch.float16


def test_input_lengths_default_to_the_full_length_and_are_long():
    x = torch.zeros(3, 5, 2)
    full = input_lengths({}, x, "seq adapter")
    assert full.dtype == torch.long and full.tolist() == [5, 5, 5]
    given = input_lengths({"lengths": [1, 0, 5]}, x, "seq adapter")
    assert given.dtype == torch.long and given.tolist() == [1, 0, 5]
    assert input_lengths({"lengths": None}, x, "seq adapter").tolist() == [5, 5, 5]
    for lengths in ([1.0, 0.0, 5.0], torch.tensor([1, 0, 5], dtype=torch.int32)):  # read as long
        assert input_lengths({"lengths": lengths}, x, "seq adapter").dtype == torch.long
    assert _message(input_lengths, {"lengths": list(range(12))}, x, "seq adapter") == (
        "seq adapter: lengths must be [B] in [0, 5], got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]")
    assert _message(input_lengths, {"lengths": [[1, 2, 3]]}, x, "seq adapter") == (
        "seq adapter: lengths must be [B] in [0, 5], got [[1, 2, 3]]")


def test_lengths_must_lie_in_zero_to_t_and_be_positive_for_present_items():
    check_lengths(torch.tensor([1, 4]), 4, None, "seq adapter")  # both ends of [1, T] pass
    assert _message(check_lengths, torch.tensor([5, 1]), 4, None, "seq adapter") == (
        "seq adapter: lengths must be [B] in [0, 4], got [5, 1]")
    assert _message(check_lengths, torch.tensor([2, -1]), 4, None, "seq adapter") == (
        "seq adapter: lengths must be [B] in [0, 4], got [2, -1]")
    long_bad = torch.tensor([9] * 12)
    assert _message(check_lengths, long_bad, 4, None, "s") == f"s: lengths must be [B] in [0, 4], got {[9] * 10}"
    assert _message(check_lengths, torch.tensor([0, 2, 0]), 4, None, "seq adapter", "clip") == (
        "seq adapter: zero-length clip at batch position(s) [0, 2] of present views")
    assert _message(check_lengths, torch.zeros(12, dtype=torch.long), 4, None, "s") == (
        f"s: zero-length sequence at batch position(s) {list(range(10))} of present views")
    # absent items (present False) may be empty; the mask may be given as 0/1
    check_lengths(torch.tensor([0, 2, 0]), 4, torch.tensor([False, True, False]), "s")
    check_lengths(torch.tensor([0, 2]), 4, torch.tensor([0, 1]), "s")
    # lengths given as floats (a float array collated) are checked the same way
    assert _message(check_lengths, torch.tensor([0.0, 2.0]), 4, None, "s") == (
        "s: zero-length sequence at batch position(s) [0] of present views")
    assert _message(check_lengths, torch.tensor([0, 2, 0]), 4, torch.tensor([0, 1, 1]), "s") == (
        "s: zero-length sequence at batch position(s) [2] of present views")


def test_per_clip_unflattens_the_frames_of_each_clip():
    features = torch.arange(12.0).reshape(6, 2)
    assert per_clip(features, None) is features
    clips = per_clip(features, 3)
    assert clips.shape == (2, 3, 2) and torch.equal(clips[1, 0], features[3])


def test_non_finite_values_are_counted_and_named():
    check_finite(torch.tensor([1.0, -2.0]), "a")
    check_finite(torch.tensor([1, 2]), "a")  # integers are always finite
    bad = torch.tensor([[1.0, math.nan, 2.0], [math.inf, 0.0, -math.inf]])
    assert _message(check_finite, bad, "audio adapter") == (
        "audio adapter: 3 non-finite value(s) (NaN/inf) in inputs['values'] of shape (2, 3)")
    assert _message(check_finite, bad[:1], "audio adapter", "mel") == (
        "audio adapter: 1 non-finite value(s) (NaN/inf) in inputs['mel'] of shape (1, 3)")


def test_the_base_input_check_looks_at_every_tensor():
    check = InputCheck("x adapter")
    check({"values": torch.ones(2), "note": "text", "ids": [math.nan]})  # only tensors are read
    assert _message(check, {"values": torch.ones(2), "extra": torch.tensor([math.nan])}) == (
        "x adapter: 1 non-finite value(s) (NaN/inf) in inputs['extra'] of shape (1,)")


def test_the_sequence_input_check_checks_lengths_when_they_fit_the_values():
    check = SequenceInputCheck("seq adapter", what="clip")
    values = torch.zeros(2, 3, 1)
    check({"values": values})  # no lengths: every item has all T steps
    assert _message(check, {"values": torch.zeros(2, 3), "lengths": [1, 4]}) == (
        "seq adapter: lengths must be [B] in [0, 3], got [1, 4]")  # values [B, T] have lengths too
    check({"values": values, "lengths": [3, 1]})
    check({"values": values, "lengths": [0, 1]}, torch.tensor([False, True]))
    assert _message(check, {"values": values, "lengths": [0, 1]}) == (
        "seq adapter: zero-length clip at batch position(s) [0] of present views")
    assert _message(check, {"values": values, "lengths": torch.tensor([4, 1])}) == (
        "seq adapter: lengths must be [B] in [0, 3], got [4, 1]")
    assert _message(check, {"values": torch.full((2, 3), math.nan), "lengths": [1, 1]}).startswith(
        "seq adapter: 6 non-finite value(s)")  # the base class's check runs first
    # a structure preprocess refuses is passed over here: it reports it
    check({"values": values, "lengths": [0, 0, 0]})
    check({"values": torch.zeros(2), "lengths": [9, 9]})
    check({"values": [[0.0]], "lengths": [9]})
    assert SequenceInputCheck("s").what == "sequence"


def test_subset_inputs_takes_the_rows_of_batch_sized_tensors_and_lists():
    rows = torch.tensor([2, 0])
    inputs = {"values": torch.arange(6).reshape(3, 2), "names": ["a", "b", "c"], "pair": ("x", "y", "z"),
              "rate": 16000, "scalar": torch.tensor(5), "other": torch.arange(4), "short": ["p", "q"],
              "lengths": torch.tensor([7, 8, 9])}
    out = subset_inputs(inputs, rows, 3)
    assert out["lengths"].tolist() == [9, 7]
    assert out["values"].tolist() == [[4, 5], [0, 1]]
    assert out["names"] == ["c", "a"] and out["pair"] == ["z", "x"]
    assert out["rate"] == 16000 and out["scalar"] is inputs["scalar"] and out["other"] is inputs["other"]
    assert out["short"] is inputs["short"]
    # host_rows: the same rows known on the host, used for the lists
    assert subset_inputs(inputs, rows, 3, host_rows=[1, 1])["names"] == ["b", "b"]
    assert subset_inputs(inputs, rows, 3, host_rows=[1, 1])["values"].tolist() == [[4, 5], [0, 1]]
