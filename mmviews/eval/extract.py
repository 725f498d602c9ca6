"""Embedding extraction for a whole split, on one or several processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import torch
from tqdm.auto import tqdm

from mmviews.data.batch import ViewBatch

Encoder = Callable[[ViewBatch], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Embeddings:
    """Embeddings of one split, in dataset order (for an unshuffled loader).

    views: [N, M, d] float32 per-view embeddings (absent views are whatever the encoder
    returned, usually zeros); mask: [N, M] bool; fused: [N, M*d] (concat) or [N, d] (mean);
    labels: name -> [N]; index: [N] dataset indices when the batches carry them;
    view_names / view_modalities: per view, in the global view order.
    """

    views: torch.Tensor
    mask: torch.Tensor
    fused: torch.Tensor
    labels: dict[str, torch.Tensor] = field(default_factory=dict)
    view_names: list[str] = field(default_factory=list)
    index: torch.Tensor | None = None
    view_modalities: list[str] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return int(self.views.shape[0])


def fuse_views(views: torch.Tensor, mask: torch.Tensor, how: Literal["concat", "mean"] = "concat") -> torch.Tensor:
    """Fuses per-view embeddings [N, M, d] into one vector per sample.

    ``concat``: [N, M*d], absent views zeroed (so a missing modality is visible as zeros,
    not as whatever the encoder emitted). ``mean``: [N, d], mean over present views
    (zeros for a sample with no present view).
    """
    if views.ndim != 3 or mask.shape != views.shape[:2]:
        raise ValueError(f"views must be [N, M, d] and mask [N, M], got {tuple(views.shape)} and {tuple(mask.shape)}")
    m = mask.to(views.dtype)[..., None]
    if how == "concat":
        return (views * m).flatten(1)
    if how == "mean":
        return (views * m).sum(1) / m.sum(1).clamp_min(1.0)
    raise ValueError(f"fuse must be 'concat' or 'mean', got {how!r}")


def _prepared(loader: Any) -> bool:
    """True for a loader already wrapped by ``accelerator.prepare`` (it shards by itself)."""
    from accelerate.data_loader import DataLoaderStateMixin

    return isinstance(loader, DataLoaderStateMixin)


@torch.no_grad()
def extract_embeddings(
    encoder: Encoder,
    loader: Iterable[ViewBatch],
    accelerator: Any | None = None,
    fuse: Literal["concat", "mean"] = "concat",
    *,
    desc: str = "embeddings",
    device: torch.device | str | None = None,
    progress: bool = True,
) -> Embeddings:
    """Runs ``encoder(batch) -> (z [K, M, d], mask [K, M])`` over ``loader`` under ``no_grad``.

    With an ``accelerate.Accelerator`` the loader is sharded across processes (it is
    passed through ``accelerator.prepare_data_loader`` unless it already was) and the
    outputs of each batch are collected with ``accelerator.gather_for_metrics``, which drops
    the samples that the last, uneven batch duplicates to pad the shards. Every process
    returns the full split. Without one, everything runs on ``device`` (default: the
    encoder's parameters' device, else CPU).

    A ``torch.nn.Module`` encoder is put in eval mode for the pass and restored afterwards.
    ``progress=False`` hides the progress bar (shown on the main process otherwise).
    Returns an :class:`Embeddings` on CPU.
    """
    if fuse not in ("concat", "mean"):
        raise ValueError(f"fuse must be 'concat' or 'mean', got {fuse!r}")
    # A streamed split (mmviews.data.streaming.StreamLoader) is read whole by every process, in one
    # pass: nothing to shard, and nothing to gather.
    streamed = getattr(loader, "streamed", False)
    if accelerator is not None:
        device = accelerator.device
        if not _prepared(loader) and not streamed:
            loader = accelerator.prepare_data_loader(loader)
    elif device is None:
        params = list(encoder.parameters()) if isinstance(encoder, torch.nn.Module) else []
        device = params[0].device if params else torch.device("cpu")
    was_training = isinstance(encoder, torch.nn.Module) and encoder.training
    if isinstance(encoder, torch.nn.Module):
        encoder.eval()

    show = progress and (accelerator is None or accelerator.is_local_main_process)
    chunks: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]] = []
    view_names: list[str] = []
    view_modalities: list[str] = []
    try:
        for batch in tqdm(loader, desc=desc, disable=not show, leave=False):
            if not isinstance(batch, ViewBatch):
                raise TypeError(f"the loader must yield ViewBatch objects, got {type(batch).__name__}")
            if batch.num_samples == 0:  # every sample of it unreadable (a dataset's on_error: skip)
                continue
            view_names = [v.name for v in batch.views]
            view_modalities = [v.modality for v in batch.views]
            batch = batch.to(device)
            z, mask = encoder(batch)
            k, m = batch.num_samples, batch.num_views
            if z.ndim != 3 or z.shape[:2] != (k, m) or tuple(mask.shape) != (k, m):
                raise ValueError(
                    f"encoder must return z [K={k}, M={m}, d] and mask [{k}, {m}], "
                    f"got {tuple(z.shape)} and {tuple(mask.shape)}"
                )
            # float32 so that bf16/fp16 encoders give comparable metrics; uint8 mask
            # because gloo cannot all-gather bool tensors.
            payload: dict[str, Any] = {
                "z": z.float().contiguous(),
                "mask": mask.to(torch.uint8),
                "labels": {name: t.to(device) for name, t in batch.labels.items()},
            }
            if batch.index is not None:
                payload["index"] = batch.index.to(device)
            if accelerator is not None and not streamed:
                payload = accelerator.gather_for_metrics(payload)
            chunks.append(
                (
                    payload["z"].cpu(),
                    payload["mask"].cpu().bool(),
                    {n: t.cpu() for n, t in payload["labels"].items()},
                    payload["index"].cpu() if "index" in payload else None,
                )
            )
    finally:
        if was_training:
            encoder.train()
    if not chunks:
        raise ValueError(f"{desc}: the loader yielded no batches")
    views = torch.cat([c[0] for c in chunks])
    mask = torch.cat([c[1] for c in chunks])
    labels = {name: torch.cat([c[2][name] for c in chunks]) for name in chunks[0][2]}
    index = torch.cat([c[3] for c in chunks]) if all(c[3] is not None for c in chunks) else None
    return Embeddings(views, mask, fuse_views(views, mask, fuse), labels, view_names, index, view_modalities)


PRECISIONS = ("no", "bf16", "fp16")


def precision_name(precision: str) -> str:
    """A :data:`PRECISIONS` value as a command prints it: ``"no"`` (no mixed precision) is float32."""
    return "float32" if precision == "no" else precision
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AutocastEncoder(torch.nn.Module):
    """``encoder`` whose forward runs under ``torch.autocast`` of ``precision`` (a recipe's
    ``optimisation.mixed_precision``: ``"no"``, ``"bf16"`` or ``"fp16"``) on the device its
    parameters live on, the way Accelerate runs a prepared model.

    The trainer evaluates the model Accelerate prepared, whose forward keeps the run's
    autocast; an encoder loaded back from its folder runs in float32 and gives other
    embeddings (on a bf16 run a linear probe moved by 0.19). Evaluating a run again through
    this wrapper, with the run's precision, gives the numbers its report printed. Only the
    forward is wrapped: probes and diagnostics stay in float32, as in the trainer."""

    def __init__(self, encoder: Encoder, precision: str) -> None:
        super().__init__()
        if precision not in PRECISIONS and precision != "auto":  # auto: a recipe's, resolved per device below
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.encoder, self.precision = encoder, precision

    def forward(self, batch: ViewBatch) -> tuple[torch.Tensor, torch.Tensor]:
        params = list(self.encoder.parameters()) if isinstance(self.encoder, torch.nn.Module) else []
        device_type = params[0].device.type if params else "cpu"
        precision = self.precision
        if precision == "auto":  # as a run resolves it (mmviews.eval.precision)
            from mmviews.eval.precision import choose_precision

            precision = choose_precision("auto", device_type).used
        if precision == "no":
            return self.encoder(batch)
        with torch.autocast(device_type=device_type, dtype=_AUTOCAST_DTYPES[precision]):
            z, mask = self.encoder(batch)
        return z.float(), mask  # as Accelerate's convert_outputs_to_fp32
