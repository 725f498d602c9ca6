"""Named ways to break mmviews on purpose, for the tests that prove a guard test can fail
(see ``tests/README.md``). (No tests here.)

Each break replaces one attribute; :func:`apply_break` takes the ``setattr`` to use, so that a
test applies it with pytest's ``monkeypatch.setattr`` (undone after the test) and
``tests/slow_train.py --break NAME`` applies it for good in a training subprocess (under
``accelerate launch`` too).
"""

from __future__ import annotations

from typing import Any, Callable


def _skip_restore() -> tuple[Any, str, Any]:
    """``--resume`` verifies nothing and restores nothing: training silently restarts at step 0."""
    import mmviews.train.trainer as trainer

    def restore_nothing(*args: Any, **kwargs: Any) -> None:
        return None

    return trainer, "load_checkpoint", restore_nothing


def _scale_loss() -> tuple[Any, str, Any]:
    """The loss is multiplied by the number of processes before backward (a gradient-scale error
    that only shows with several processes; AdamW would cancel it, plain SGD does not)."""
    from accelerate import Accelerator

    original = Accelerator.backward

    def backward(self: Any, loss: Any, **kwargs: Any) -> None:
        return original(self, loss * self.num_processes, **kwargs)

    return Accelerator, "backward", backward


def _no_accumulation_scaling() -> tuple[Any, str, Any]:
    """Gradient accumulation sums the micro-batch gradients instead of averaging them."""
    from accelerate import Accelerator

    original = Accelerator.backward

    def backward(self: Any, loss: Any, **kwargs: Any) -> None:
        return original(self, loss * self.gradient_accumulation_steps, **kwargs)

    return Accelerator, "backward", backward


def _drop_within_view_mask() -> tuple[Any, str, Any]:
    """MV-DHEL's within-view uniformity ignores the presence mask (absent views count as negatives)."""
    import mmviews.objectives.mv_dhel as mv_dhel

    def keep_nothing_out(keep: Any, row_axis: int, num_samples: int) -> Callable[..., None]:
        return lambda scores, start, stop: None

    return mv_dhel, "keep_exclusion", keep_nothing_out


def _shift_streamed_blocks() -> tuple[Any, str, Any]:
    """Every streamed block after the first scores the anchors one sample too early (an
    off-by-one in the block offsets)."""
    from mmviews.objectives import _streaming

    original = _streaming._block_scores

    def shifted(anchors: Any, candidates: Any, start: int, stop: int, *args: Any) -> Any:
        return original(anchors, candidates, start - 1, stop - 1, *args) if start > 0 else \
            original(anchors, candidates, start, stop, *args)

    return _streaming, "_block_scores", shifted


def _unpickle_checkpoints() -> tuple[Any, str, Any]:
    """Checkpoint files are read with full unpickling (``torch.load(weights_only=False)``)."""
    import torch

    import mmviews.train.checkpoint as checkpoint

    def load_anything(path: Any, safe_globals: Any = ()) -> Any:
        return torch.load(path, map_location="cpu", weights_only=False)

    return checkpoint, "load_torch_file", load_anything


def _key_dropout_by_row() -> tuple[Any, str, Any]:
    """Sample-keyed dropout keys each row by its position in the process's batch instead of its
    dataset index (the masks then depend on how the batch is split between processes)."""
    import torch

    import mmviews.modalities.dropout as dropout

    original = dropout.sample_row_keys

    def by_row(step: int, index: Any, modality: str, num_views: int) -> Any:
        return original(step, torch.arange(index.numel(), device=index.device), modality, num_views)

    return dropout, "sample_row_keys", by_row


def _round_stream_epoch_up() -> tuple[Any, str, Any]:
    """A streamed epoch's batch count rounded up: the process given the fewest rows cannot fill it."""
    import math

    import mmviews.data.streaming as streaming

    def rounded_up(shards: Any, num_processes: int, batch_size: int) -> int:
        return math.ceil(shards.min_rows_per_process(num_processes) / batch_size)

    return streaming, "streamed_epoch_batches", rounded_up


def _average_rows_per_process() -> tuple[Any, str, Any]:
    """The streamed epoch length taken from the mean rows per process (total / N) instead of the
    fewest any process is given (unequal shards split between processes)."""
    from mmviews.data.streaming import ShardFiles

    def mean_rows(self: Any, num_processes: int) -> int:
        return self.total // max(num_processes, 1)

    return ShardFiles, "min_rows_per_process", mean_rows


def _round_map_epoch_up() -> tuple[Any, str, Any]:
    """The map-style batch count rounded up (the batches themselves still drop the last partial one)."""
    import math

    from mmviews.data.views import ViewSetBatchSampler

    def rounded_up(self: Any) -> int:
        return math.ceil(self.num_samples / self.K)

    return ViewSetBatchSampler, "__len__", rounded_up


def _write_shards_in_place() -> tuple[Any, str, Any]:
    """Parquet shards written under their final name (no temporary name, so no rename)."""
    import mmviews.data.shards as shards

    return shards, "TMP_SUFFIX", ""


def _interleave_streamed_shards() -> tuple[Any, str, Any]:
    """The streamed shuffle buffer takes the ``datasets`` default (up to 10 shards read at once by
    threads, and a 5 s sleep at the end of every pass over Parquet shards)."""
    import mmviews.data.streaming as streaming

    return streaming, "_one_shard_at_a_time", dict


BREAKS: dict[str, Callable[[], tuple[Any, str, Any]]] = {
    "key_dropout_by_row": _key_dropout_by_row,
    "skip_restore": _skip_restore,
    "scale_loss": _scale_loss,
    "sum_accumulated_gradients": _no_accumulation_scaling,
    "drop_within_view_mask": _drop_within_view_mask,
    "shift_streamed_blocks": _shift_streamed_blocks,
    "unpickle_checkpoints": _unpickle_checkpoints,
    "round_stream_epoch_up": _round_stream_epoch_up,
    "average_rows_per_process": _average_rows_per_process,
    "round_map_epoch_up": _round_map_epoch_up,
    "write_shards_in_place": _write_shards_in_place,
    "interleave_streamed_shards": _interleave_streamed_shards,
}


def apply_break(name: str, set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """Apply the break ``name`` (a key of :data:`BREAKS`) with ``set_attribute(owner, name, value)``."""
    if name not in BREAKS:
        raise ValueError(f"unknown break {name!r}; known: {', '.join(BREAKS)}")
    set_attribute(*BREAKS[name]())
