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


def _keep_unreadable_samples() -> tuple[Any, str, Any]:
    """The collator keeps a sample whose files could not be read (on_error: skip): it enters the
    batch with every view absent, a phantom counted in the loss and the evaluation."""
    import mmviews.data.views as views

    return views, "readable_samples", lambda samples: (list(samples), ())


def _forget_known_bad_clips() -> tuple[Any, str, Any]:
    """The video datasets ignore the clips the store's manifest records as unreadable (they are
    decoded again during training)."""
    import mmviews.data.video as video

    return video, "known_bad_clips", lambda store: {}


def _keep_worker_tracebacks() -> tuple[Any, str, Any]:
    """The command line takes torch's re-raise of a DataLoader worker's error as it is (the
    worker's whole traceback in one message, or a RuntimeError when torch cannot rebuild the type)."""
    import mmviews.cli as cli

    return cli, "worker_error", lambda error: error


BREAKS: dict[str, Callable[[], tuple[Any, str, Any]]] = {
    "key_dropout_by_row": _key_dropout_by_row,
    "skip_restore": _skip_restore,
    "scale_loss": _scale_loss,
    "sum_accumulated_gradients": _no_accumulation_scaling,
    "drop_within_view_mask": _drop_within_view_mask,
    "shift_streamed_blocks": _shift_streamed_blocks,
    "unpickle_checkpoints": _unpickle_checkpoints,
    "orphan_prepare_workers": lambda: _orphan_prepare_workers(),
    "mtime_only_staleness": lambda: _mtime_only_staleness(),
    "keep_unreadable_samples": _keep_unreadable_samples,
    "forget_known_bad_clips": _forget_known_bad_clips,
    "keep_worker_tracebacks": _keep_worker_tracebacks,
}


def apply_break(name: str, set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """Apply the break ``name`` (a key of :data:`BREAKS`) with ``set_attribute(owner, name, value)``."""
    if name not in BREAKS:
        raise ValueError(f"unknown break {name!r}; known: {', '.join(BREAKS)}")
    set_attribute(*BREAKS[name]())


def init_worker_ignoring_parent(parent_pid: int | None = None) -> None:
    """A video-prepare worker initializer that does not tie the worker to its parent (module
    level, so that spawned workers can import it by name)."""
    import cv2

    cv2.setNumThreads(1)


def _orphan_prepare_workers() -> tuple[Any, str, Any]:
    """Video-prepare workers do not die with the prepare: a SIGKILLed prepare leaves them running."""
    import mmviews.data.video_store as video_store

    return video_store, "_init_worker", init_worker_ignoring_parent


def _mtime_only_staleness() -> tuple[Any, str, Any]:
    """The video store decides staleness by size and modification time alone (no content
    fingerprint): a dataset and store copied with ``cp -r`` are stale as a whole."""
    import mmviews.data.video_store as video_store

    def by_mtime(entry: Any, source: Any) -> bool:
        try:
            st = source.stat()
        except OSError:
            return False
        return entry.get("source_size") == st.st_size and entry.get("source_mtime_ns") == st.st_mtime_ns

    return video_store, "source_matches", by_mtime
