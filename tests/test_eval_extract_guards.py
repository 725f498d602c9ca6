"""Unit guards of :mod:`mmviews.eval.extract` beyond the extraction itself: ``fuse_views``'s
default, its shape check and the dtype it keeps, and :class:`AutocastEncoder`, which runs the
wrapped encoder's forward under the autocast of the run's precision *on the device its
parameters live on* (what Accelerate does for a prepared model) and hands back float32."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mmviews.eval.extract import AutocastEncoder, fuse_views


def test_fuse_views_concatenates_by_default_with_absent_views_zeroed() -> None:
    views = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2) + 1.0
    mask = torch.tensor([[True, False, True], [False, True, True]])
    fused = fuse_views(views, mask)
    # written out by hand: sample 0 keeps views 0 and 2, sample 1 views 1 and 2
    expected = torch.tensor([[1.0, 2.0, 0.0, 0.0, 5.0, 6.0], [0.0, 0.0, 9.0, 10.0, 11.0, 12.0]])
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["concat", "mean"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fuse_views_keeps_the_embeddings_dtype(how: str, dtype: torch.dtype) -> None:
    """Half-precision embeddings stay half (no silent float32 copy of a large split), float64 stays float64."""
    views = torch.ones(4, 3, 2, dtype=dtype)
    mask = torch.tensor([[True, True, False]] * 4)
    fused = fuse_views(views, mask, how)
    assert fused.dtype == dtype
    expected = torch.ones(4, 2, dtype=dtype) if how == "mean" else torch.tensor([[1.0] * 4 + [0.0] * 2] * 4, dtype=dtype)
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)


@pytest.mark.parametrize("views_shape,mask_shape", [((2, 3, 4), (3, 2)), ((2, 3), (2, 3)), ((2, 3, 4), (2, 3, 1))])
def test_fuse_views_names_both_shapes_when_they_do_not_fit(views_shape, mask_shape) -> None:
    """Either fault alone (views not [N, M, d], or a mask that is not views' [N, M]) is refused."""
    views, mask = torch.zeros(views_shape), torch.ones(mask_shape, dtype=torch.bool)
    message = f"views must be [N, M, d] and mask [N, M], got {views_shape} and {mask_shape}"
    with pytest.raises(ValueError) as raised:
        fuse_views(views, mask)
    assert str(raised.value) == message


def test_autocast_encoder_refuses_an_unknown_precision_naming_the_choices() -> None:
    with pytest.raises(ValueError) as raised:
        AutocastEncoder(torch.nn.Linear(2, 2), "fp8")
    assert str(raised.value) == "precision must be one of no, bf16, fp16, got 'fp8'"


class _Recorder(torch.nn.Module):
    """One linear map without bias (a single parameter tensor) that records the autocast state
    its forward runs under: ``(enabled on CPU, CPU autocast dtype, dtype of its output)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3, bias=False)
        self.seen: list[tuple[bool, torch.dtype, torch.dtype]] = []

    def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.lin(batch)
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), z.dtype))
        return z[:, None, :], torch.ones(z.shape[0], 1, dtype=torch.bool)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_forward_runs_under_the_precisions_autocast_and_returns_float32(precision: str, dtype: torch.dtype) -> None:
    inner = _Recorder()
    x = torch.randn(5, 4)
    z, mask = AutocastEncoder(inner, precision)(x)
    enabled, autocast_dtype, inner_dtype = inner.seen[-1]
    assert (enabled, autocast_dtype, inner_dtype) == (True, dtype, dtype)
    assert z.dtype == torch.float32 and mask.tolist() == [[True]] * 5
    # the reference: the same product computed in that precision by hand, then widened
    expected = (x.to(dtype) @ inner.lin.weight.detach().to(dtype).T).float()[:, None, :]
    torch.testing.assert_close(z, expected, rtol=0, atol=0)


def test_precision_no_runs_the_encoder_as_it_is() -> None:
    inner = _Recorder()
    x = torch.randn(5, 4)
    z, _ = AutocastEncoder(inner, "no")(x)
    assert inner.seen[-1][0] is False and inner.seen[-1][2] == torch.float32
    torch.testing.assert_close(z, (x @ inner.lin.weight.detach().T)[:, None, :], rtol=0, atol=0)


def test_an_encoder_without_parameters_runs_under_cpu_autocast() -> None:
    """A plain function (an encoder need not be a module) has no device of its own: CPU."""
    seen = []

    def encoder(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return (batch @ torch.ones(4, 3))[:, None, :], torch.ones(batch.shape[0], 1, dtype=torch.bool)

    z, _ = AutocastEncoder(encoder, "bf16")(torch.randn(2, 4))
    assert seen == [(True, torch.bfloat16)] and z.dtype == torch.float32


def test_the_autocast_is_the_parameters_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder whose parameters live off the CPU (the meta device stands in for a GPU here)
    gets the autocast of that device: on a CUDA run a CPU autocast would leave every CUDA op in
    float32 and the numbers would not be the run's. The request to ``torch.autocast`` is
    recorded (the meta device has no autocast of its own to run under)."""
    requested = []

    def recording_autocast(device_type: str, dtype: torch.dtype | None = None, **kwargs):
        requested.append((device_type, dtype))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch, "autocast", recording_autocast)

    class OffCpu(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(3, 4, device="meta"))

        def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # nothing computed on the meta device (its first kernel call costs seconds)
            return torch.zeros(batch.shape[0], 1, 3, dtype=torch.float16), torch.ones(batch.shape[0], 1, dtype=torch.bool)

    z, _ = AutocastEncoder(OffCpu(), "fp16")(torch.zeros(2, 4))
    assert requested == [("meta", torch.float16)] and z.dtype == torch.float32
