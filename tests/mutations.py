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

    import mmviews.modalities.dropout.keys as keys

    original = keys.sample_row_keys

    def by_row(step: int, index: Any, modality: str, num_views: int) -> Any:
        return original(step, torch.arange(index.numel(), device=index.device), modality, num_views)

    return keys, "sample_row_keys", by_row


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


def _read_rows_with_parquet_builder() -> tuple[Any, str, Any]:
    """Streamed rows read through ``datasets``' Parquet builder (``load_dataset("parquet",
    streaming=True)``) instead of :mod:`mmviews.data.row_groups`: with the default shuffle buffer
    (10 shards read at once by threads) every pass over the shards then ends with a 5 s sleep."""
    from mmviews.data.streaming import ShardSource

    def rows(self: Any, files: Any) -> Any:
        import datasets

        ds = datasets.load_dataset("parquet", data_files={self.split: list(files)}, split=self.split, streaming=True)
        for col in self.image_columns:
            ds = ds.cast_column(col, datasets.Image(decode=False))
        return ds

    return ShardSource, "_rows", rows


def _forget_samples_seen() -> tuple[Any, str, Any]:
    """A resume restores the weights, the optimiser, the scheduler and the loop position, but
    not the samples-seen counter (it restarts at 0: ``results.json`` under-reports the run)."""
    from mmviews.train.checkpoint import TrainState

    original = TrainState.load_state_dict

    def without_samples(self: Any, state: dict[str, Any]) -> None:
        original(self, {**state, "samples": 0})

    return TrainState, "load_state_dict", without_samples


def _skip_scheduler_restore() -> tuple[Any, str, Any]:
    """A resume restores everything but the learning-rate schedule, which starts again from its
    first step (warm-up included)."""
    from accelerate.scheduler import AcceleratedScheduler

    def load_nothing(self: Any, state_dict: Any) -> None:
        return None

    return AcceleratedScheduler, "load_state_dict", load_nothing


def _stop_one_step_late() -> tuple[Any, str, Any]:
    """On SIGINT/SIGTERM the loop runs one more optimiser step before it stops (``requested``
    answers True one call after it first could)."""
    from mmviews.train.interrupt import StopOnSignal

    original = StopOnSignal.requested

    def one_step_late(self: Any) -> bool:
        if getattr(self, "_seen_once", False):
            return True
        if original(self):
            self._seen_once = True
        return False

    return StopOnSignal, "requested", one_step_late


def _delete_old_checkpoints_first() -> tuple[Any, str, Any]:
    """Rotation deletes the checkpoints that the new one will push out of ``keep_last`` before it
    writes the new one (with ``keep_last: 1``, a kill mid-write leaves no checkpoint at all)."""
    import shutil

    import mmviews.train.trainer as trainer
    from mmviews.run import list_checkpoints

    original = trainer.save_checkpoint

    def deleting_first(accelerator: Any, run_dir: Any, state: Any, keep_last: int, *args: Any, **kwargs: Any) -> Any:
        if accelerator.is_main_process:
            old = list_checkpoints(run_dir)
            for checkpoint in old[:max(len(old) - keep_last + 1, 0)]:
                shutil.rmtree(checkpoint)
        return original(accelerator, run_dir, state, keep_last, *args, **kwargs)

    return trainer, "save_checkpoint", deleting_first


def _commit_without_flush() -> tuple[Any, str, Any]:
    """A folder is committed by its rename alone: no file, no folder flushed (a power cut may
    leave the new name on files whose data never reached the disk)."""
    import os

    import mmviews.fileio as fileio

    def rename_only(tmp: Any, final: Any) -> Any:
        os.replace(tmp, final)
        return final

    return fileio, "commit_folder", rename_only


def _resume_newest_unchecked() -> tuple[Any, str, Any]:
    """``output.auto_resume`` takes the newest checkpoint without checking its files."""
    import mmviews.train.run_folder as run_folder
    from mmviews.run import list_checkpoints

    return run_folder, "newest_intact_checkpoint", lambda run_dir, say=None: (list_checkpoints(run_dir) or [None])[-1]


def _keep_leftovers() -> tuple[Any, str, Any]:
    """Temporary left-overs of a run cut short stay in the run folder."""
    import mmviews.train.run_folder as run_folder

    return run_folder, "remove_leftovers", lambda run_dir: []


def _any_recipe_continues() -> tuple[Any, str, Any]:
    """``output.auto_resume`` continues a run whatever recipe the command gives."""
    import mmviews.train.run_folder as run_folder

    return run_folder, "_recipe_refusal", lambda config, run_dir, how: None


def _disk_full_passes_through() -> tuple[Any, str, Any]:
    """A full disk is not recognised: the writer's own error goes through, the partial checkpoint
    folder stays."""
    import contextlib

    import mmviews.train.checkpoint as checkpoint

    return checkpoint, "disk_full", lambda *args, **kwargs: contextlib.nullcontext()


def _keep_half_rows() -> tuple[Any, str, Any]:
    """A ``metrics.csv`` row cut short by a full disk stays in the file."""
    import mmviews.train.step_log as step_log

    class NoTruncate:
        def __getattr__(self, name: str) -> Any:
            import os

            return (lambda *args: None) if name == "truncate" else getattr(os, name)

    return step_log, "os", NoTruncate()


def _collective_errors_pass_through() -> tuple[Any, str, Any]:
    """A collective that failed because a peer hung or died is not recognised: the engine's
    traceback is all the user sees."""
    import mmviews.train.trainer as trainer

    return trainer, "collective_failure", lambda *args, **kwargs: None


def _remove_checkpoint_in_place() -> tuple[Any, str, Any]:
    """An old checkpoint is deleted under its own name (no rename first): a deletion cut short
    leaves a half-deleted ``checkpoint-N``."""
    import shutil

    import mmviews.train.checkpoint as checkpoint

    def remove_in_place(folder: Any) -> None:
        shutil.rmtree(folder)

    return checkpoint, "_remove_checkpoint", remove_in_place


def _onnx_clip_first_frame() -> tuple[Any, str, Any]:
    """The ONNX runtime embeds a clip by its first frame (or flow group) alone, not by the
    average of its frames' unit vectors that the adapter's ``project`` computes."""
    from mmviews.export.onnx_runtime import OnnxAdapter

    original = OnnxAdapter._frames

    def first_frame(self: Any, inputs: Any) -> Any:
        values = inputs["values"]
        values = values.detach().cpu().numpy() if hasattr(values, "detach") else values
        if values.ndim == 5 and self.pre["clips"] == "per-frame":
            inputs = {**inputs, "values": values[:, : int(self.pre["frames_per_row"])]}
        return original(self, inputs)

    return OnnxAdapter, "_frames", first_frame


def _chance_from_evaluated_majority() -> tuple[Any, str, Any]:
    """A classifier's chance level is the evaluated labels' own majority rate (a classifier that
    knew the test labels' distribution), not the training majority class scored on them."""
    import torch

    import mmviews.eval.health as health

    def evaluated_majority(train_labels: Any, eval_labels: Any) -> float:
        counts = torch.as_tensor(eval_labels).reshape(-1).unique(return_counts=True)[1]
        return float(counts.max()) / float(counts.sum())

    return health, "classification_chance", evaluated_majority


def _training_log_judges_alignment() -> tuple[Any, str, Any]:
    """The run's warnings judge alignment on the training batches even where the evaluation
    measured it on held-out data (the old behaviour: memorisation read as alignment)."""
    import mmviews.eval.health as health

    return health, "measures_held_out_alignment", lambda metrics: False


def _population_std_over_seeds() -> tuple[Any, str, Any]:
    """``mmviews compare`` divides by n, not n - 1, in the standard deviation over seeds."""
    import mmviews.eval.compare as compare

    def mean_and_std(values: list[float]) -> tuple[float, float | None]:
        mean = sum(values) / len(values)
        return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 if len(values) > 1 else None

    return compare, "mean_and_std", mean_and_std


def _evaluation_forward_with_gradients() -> tuple[Any, str, Any]:
    """``torch.no_grad()`` does nothing: the memory estimate's evaluation batch is encoded with
    autograd recording (as a training forward), not as the evaluation encodes it."""
    import contextlib

    import torch

    class nothing(contextlib.ContextDecorator):
        def __enter__(self) -> "nothing":
            return self

        def __exit__(self, *exc: Any) -> bool:
            return False

    def recording(function: Any = None) -> Any:  # torch.no_grad(), @torch.no_grad() and @torch.no_grad: no effect
        return function if callable(function) else nothing()

    return torch, "no_grad", recording
def _unpickle_weights_files() -> tuple[Any, str, Any]:
    """Backbone weights files (torchvision / timm adapters) read with ``torch.load(weights_only=False)``."""
    import torch

    import mmviews.modalities.image_backbones as image_backbones

    return image_backbones, "load_torch_file", lambda file: torch.load(file, map_location="cpu", weights_only=False)


def _skip_backbone_weights() -> tuple[Any, str, Any]:
    """A backbone weights file is read but never loaded: the backbone keeps its random weights."""
    import mmviews.modalities.image_backbones as image_backbones

    return image_backbones, "load_backbone_state", lambda *args, **kwargs: None


def _forget_tracker_runs() -> tuple[Any, str, Any]:
    """A resumed run opens new MLflow / W&B runs (the recorded run ids are ignored)."""
    import mmviews.train.step_log as step_log_module

    original = step_log_module.tracker_init_kwargs
    return step_log_module, "tracker_init_kwargs", lambda trackers, run_dir, resumed: original(trackers, run_dir, False)


def _fsdp_skip_gradient_reduction() -> tuple[Any, str, Any]:
    """Sharded runs: FSDP2 never reduce-scatters the gradients into the shards (gradient sync
    off), so the processes' shards get no gradient of the global batch."""
    import mmviews.train.setup as setup
    from mmviews.train import sharding

    def shard_unsynced(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        encoder = sharding.shard_encoder(*args, **kwargs)
        for module in encoder.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(False, recurse=False)
        return encoder

    return setup, "shard_encoder", shard_unsynced


def _fsdp_clip_local_norm() -> tuple[Any, str, Any]:
    """Sharded runs: gradients clipped by the norm of each process's own shards, not the global norm."""
    import torch
    from accelerate import Accelerator

    def clip_local(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in parameters if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
        for g in local:
            g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    return Accelerator, "clip_grad_norm_", clip_local
def _ipmc_critic_on_local_batch() -> tuple[Any, str, Any]:
    """IPMC under torch.distributed: each process trains its critic on its own slice of the
    batch (gradients averaged), so its random draws differ from one process's over the batch."""
    from mmviews.objectives.ipmc.critic import train_critic
    from mmviews.objectives.ipmc.loss import IPMC

    def critic_step_local(self: Any, z: Any) -> dict:
        u = self._units(z)
        self.build(u.shape[1], u.shape[2])
        if self.critic is None or self.critic_steps == 0:
            return {}
        return train_critic(self.critic, self.critic_optimizer, u, self.critic_steps, self.gp_weight)

    return IPMC, "critic_step", critic_step_local


def _compile_static_shapes() -> tuple[Any, str, Any]:
    """Compiled steps with ``dynamic=False``: every new input size recompiles."""
    import mmviews.train.compiled as compiled

    return compiled, "COMPILE_OPTIONS", {"dynamic": False}


BREAKS: dict[str, Callable[[], tuple[Any, str, Any]]] = {
    "onnx_clip_first_frame": _onnx_clip_first_frame,
    "evaluation_forward_with_gradients": _evaluation_forward_with_gradients,
    "chance_from_evaluated_majority": _chance_from_evaluated_majority,
    "training_log_judges_alignment": _training_log_judges_alignment,
    "population_std_over_seeds": _population_std_over_seeds,
    "fsdp_skip_gradient_reduction": _fsdp_skip_gradient_reduction,
    "fsdp_clip_local_norm": _fsdp_clip_local_norm,
    "ipmc_critic_on_local_batch": _ipmc_critic_on_local_batch,
    "key_dropout_by_row": _key_dropout_by_row,
    "skip_restore": _skip_restore,
    "commit_without_flush": _commit_without_flush,
    "resume_newest_unchecked": _resume_newest_unchecked,
    "keep_leftovers": _keep_leftovers,
    "any_recipe_continues": _any_recipe_continues,
    "disk_full_passes_through": _disk_full_passes_through,
    "keep_half_rows": _keep_half_rows,
    "collective_errors_pass_through": _collective_errors_pass_through,
    "scale_loss": _scale_loss,
    "sum_accumulated_gradients": _no_accumulation_scaling,
    "drop_within_view_mask": _drop_within_view_mask,
    "shift_streamed_blocks": _shift_streamed_blocks,
    "unpickle_checkpoints": _unpickle_checkpoints,
    "orphan_prepare_workers": lambda: _orphan_prepare_workers(),
    "mtime_only_staleness": lambda: _mtime_only_staleness(),
    "cached_skip_accumulation_division": lambda: _cached_skip_accumulation_division(),
    "cached_bypass_scaler": lambda: _cached_bypass_scaler(),
    "cached_scale_by_processes": lambda: _cached_scale_by_processes(),
    "keyed_dropout_ignores_sample": lambda: _keyed_dropout_ignores_sample(),
    "keyed_dropout_ignores_view_slot": lambda: _keyed_dropout_ignores_view_slot(),
    "keyed_dropout_one_salt": lambda: _keyed_dropout_one_salt(),
    "keyed_dropout_ignores_micro_batch": lambda: _keyed_dropout_ignores_micro_batch(),
    "teacher_shares_student_dropout": lambda: _teacher_shares_student_dropout(),
    "keyed_dropout_salt_from_hash": lambda: _keyed_dropout_salt_from_hash(),
    "cached_no_rng_replay": lambda: _cached_no_rng_replay(),
    "dropout_draws_nothing": lambda: _dropout_draws_nothing(),
    "let_row_group_errors_through": lambda: _let_row_group_errors_through(),
    "keep_unreadable_samples": lambda: _keep_unreadable_samples(),
    "forget_known_bad_clips": lambda: _forget_known_bad_clips(),
    "keep_worker_tracebacks": lambda: _keep_worker_tracebacks(),
    "name_oldest_checkpoint": lambda: _name_oldest_checkpoint(),
    "eval_in_float32": lambda: _eval_in_float32(),
    "eval_fuse_ignores_recipe": lambda: _eval_fuse_ignores_recipe(),
    "eval_output_unresolved": lambda: _eval_output_unresolved(),
    "eval_plots_ignore_recipe": lambda: _eval_plots_ignore_recipe(),
    "check_first_split_only": lambda: _check_first_split_only(),
    "check_skips_streamed_splits": lambda: _check_skips_streamed_splits(),
    "checkpoint_with_context_always": lambda: _checkpoint_with_context_always(),
    "move_alignment_threshold": lambda: _move_alignment_threshold(),
    "round_stream_epoch_up": _round_stream_epoch_up,
    "average_rows_per_process": _average_rows_per_process,
    "round_map_epoch_up": _round_map_epoch_up,
    "write_shards_in_place": _write_shards_in_place,
    "read_rows_with_parquet_builder": _read_rows_with_parquet_builder,
    # memory estimate (defined at the end of the file; looked up when applied)
    "drop_optimizer_state": lambda: _drop_optimizer_state(),
    "halve_cached_embeddings": lambda: _halve_cached_embeddings(),
    "double_activations": lambda: _double_activations(),
    "drop_framework_state": lambda: _drop_framework_state(),
    "drop_allocator_slack": lambda: _drop_allocator_slack(),
    "cached_peak_without_embeddings": lambda: _cached_peak_without_embeddings(),
    "chunk_search_stops_below_bound": lambda: _chunk_search_stops_below_bound(),
    "bench_time_contenders_in_blocks": lambda: _bench_time_contenders_in_blocks(),
    "bench_rss_reset_does_nothing": lambda: _bench_rss_reset_does_nothing(),
    "forget_samples_seen": _forget_samples_seen,
    "skip_scheduler_restore": _skip_scheduler_restore,
    "stop_one_step_late": _stop_one_step_late,
    "delete_old_checkpoints_first": _delete_old_checkpoints_first,
    "remove_checkpoint_in_place": _remove_checkpoint_in_place,
    # data layer and keyed-dropout guards (defined at the end of the file)
    "key_dropout_by_optimiser_step": lambda: _key_dropout_by_optimiser_step(),
    "accept_changed_shuffle_buffer": lambda: _accept_changed_shuffle_buffer(),
    "fingerprint_first_block_only": lambda: _fingerprint_first_block_only(),
    "shards_drop_fixed_lengths": lambda: _shards_drop_fixed_lengths(),
    "unpickle_weights_files": _unpickle_weights_files,
    "skip_backbone_weights": _skip_backbone_weights,
    "forget_tracker_runs": _forget_tracker_runs,
    "compile_static_shapes": _compile_static_shapes,
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


def _checkpoint_with_context_always() -> tuple[Any, str, Any]:
    """The text adapter's checkpointing always passes the sample-key context as ``context_fn``
    (as it did before), keyed dropout or not: torch.compile cannot compile it."""
    import mmviews.modalities.text as text
    from mmviews.modalities.checkpointing import enable_transformers_checkpointing
    from mmviews.modalities.dropout import checkpoint_context
    from mmviews.modalities.dropout.hf_attention import set_transformers_checkpointing

    def with_context(model: Any, where: str) -> None:
        enable_transformers_checkpointing(model, where)
        set_transformers_checkpointing(model, {"use_reentrant": False, "context_fn": checkpoint_context})

    return text, "enable_transformers_checkpointing", with_context


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


def _cached_skip_accumulation_division() -> tuple[Any, str, Any]:
    """The cached step's backward into the encoder skips the gradient-accumulation division
    (``dL/dz`` multiplied back by n: the micro-batch gradients are summed, not averaged)."""
    import mmviews.train.step as step

    original = step.replay_backward

    def replay(p: Any, chunks: Any, states: Any, z_grad: Any) -> None:
        return original(p, chunks, states, z_grad * p.accelerator.gradient_accumulation_steps)

    return step, "replay_backward", replay


def _cached_bypass_scaler() -> tuple[Any, str, Any]:
    """The cached step's backward into the encoder bypasses the fp16 loss scaler: the encoder's
    gradients arrive unscaled, and the optimiser step divides them by the scale all the same."""
    import mmviews.train.step as step

    original = step.replay_backward

    def replay(p: Any, chunks: Any, states: Any, z_grad: Any) -> None:
        scaler = p.accelerator.scaler
        return original(p, chunks, states, z_grad if scaler is None else z_grad / scaler.get_scale())

    return step, "replay_backward", replay


def _cached_scale_by_processes() -> tuple[Any, str, Any]:
    """The cached step's backward into the encoder multiplies ``dL/dz`` by the number of
    processes (a gradient-scale error that only shows with several processes)."""
    import mmviews.train.step as step

    original = step.replay_backward

    def replay(p: Any, chunks: Any, states: Any, z_grad: Any) -> None:
        return original(p, chunks, states, z_grad * p.accelerator.num_processes)

    return step, "replay_backward", replay


def _keyed_dropout_ignores_sample() -> tuple[Any, str, Any]:
    """Sample-keyed dropout leaves the sample out of the key: every sample of a micro-batch gets
    the masks of dataset index 0 (views and layers still differ)."""
    import torch

    import mmviews.modalities.dropout.keys as keys

    original = keys.sample_row_keys

    def without_sample(step: int, index: Any, modality: str, num_views: int) -> Any:
        return original(step, torch.zeros_like(index), modality, num_views)

    return keys, "sample_row_keys", without_sample


def _keyed_dropout_ignores_view_slot() -> tuple[Any, str, Any]:
    """Sample-keyed dropout leaves the view slot out of the key: every view of a modality of a
    sample gets the same masks."""
    import mmviews.modalities.dropout.keys as keys

    original = keys.sample_row_keys

    def without_slot(step: int, index: Any, modality: str, num_views: int) -> Any:
        return original(step, index, modality, 1).repeat_interleave(num_views)

    return keys, "sample_row_keys", without_slot


def _keyed_dropout_one_salt() -> tuple[Any, str, Any]:
    """One salt for all the layers of a model (the layer's name left out; the namespace, which
    tells an EMA teacher from its student, kept): layers of the same shape share their masks."""
    import mmviews.modalities.dropout.layers as layers

    original = layers.layer_salt

    def one_salt(name: str, namespace: str = "") -> int:
        return original("", namespace)

    return layers, "layer_salt", one_salt


def _keyed_dropout_ignores_micro_batch() -> tuple[Any, str, Any]:
    """The micro-batch number is left out of the dropout key: every step draws the same masks."""
    import mmviews.modalities.dropout.keys as keys

    original = keys.step_key

    def without_micro_batch(seed: int, micro_batch: int) -> int:
        return original(seed, 0)

    return keys, "step_key", without_micro_batch


def _teacher_shares_student_dropout() -> tuple[Any, str, Any]:
    """The EMA teacher's copy is not re-salted: it draws the student's dropout masks."""
    import mmviews.train.teacher as teacher

    def keep_salts(model: Any, namespace: str = "") -> None:
        return None

    return teacher, "salt_sample_keyed_dropout", keep_salts


def _keyed_dropout_salt_from_hash() -> tuple[Any, str, Any]:
    """Layer salts from Python's ``hash`` of the name, which differs between processes (string
    hashing is randomised per process, ``PYTHONHASHSEED``): other masks in another process."""
    import mmviews.modalities.dropout.layers as layers

    def salted_by_hash(name: str, namespace: str = "") -> int:
        return hash(f"{namespace}/{name}") & 0xFFFFFFFF

    return layers, "layer_salt", salted_by_hash


def _cached_no_rng_replay() -> tuple[Any, str, Any]:
    """The cached step's pass 2 does not restore the RNG states of pass 1 (nor, after it, those
    the objective left): ordinary dropout draws other masks than the loss saw."""
    import mmviews.train.step as step

    def keep_state(state: Any, device: Any) -> None:
        return None

    return step, "_set_rng_state", keep_state


def _dropout_draws_nothing() -> tuple[Any, str, Any]:
    """``nn.Dropout`` keeps every element (a dropout that is silently off)."""
    from torch import nn

    def identity(self: Any, x: Any) -> Any:
        return x

    return nn.Dropout, "forward", identity


def _let_row_group_errors_through() -> tuple[Any, str, Any]:
    """The Parquet readers catch none of pyarrow's read errors: a damaged row group fails with
    pyarrow's message (naming neither the shard nor the row group) and cannot be skipped."""
    import mmviews.data.row_groups as row_groups

    return row_groups, "_read_errors", lambda: ()


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


def _eval_in_float32() -> tuple[Any, str, Any]:
    """``mmviews eval`` runs the encoder's forward in float32 whatever precision the run trained
    and evaluated with (an earlier behaviour, since replaced)."""
    from mmviews.eval.extract import AutocastEncoder

    def forward(self: Any, batch: Any) -> Any:
        return self.encoder(batch)

    return AutocastEncoder, "forward", forward


def _name_oldest_checkpoint() -> tuple[Any, str, Any]:
    """The training command's error hint names the oldest checkpoint as the one kept (the run's
    checkpoints reach it newest first: its ``[-1]`` is the oldest)."""
    import mmviews.cli.train as train_command

    listed = train_command.list_checkpoints
    return train_command, "list_checkpoints", lambda run_dir: listed(run_dir)[::-1]


def _eval_fuse_ignores_recipe() -> tuple[Any, str, Any]:
    """``mmviews eval`` probes the concatenated views whatever the run's ``evaluation.fuse``
    (the setting replaced by the default)."""
    import mmviews.cli.eval as eval_command

    evaluate = eval_command.evaluate_encoder
    return eval_command, "evaluate_encoder", lambda *args, **kwargs: evaluate(*args, **{**kwargs, "fuse": "concat"})


def _eval_plots_ignore_recipe() -> tuple[Any, str, Any]:
    """``mmviews eval`` draws every plot whatever the run's ``evaluation.plots`` or a ``--set``
    of it says (the old behaviour: the report's default)."""
    import mmviews.cli.eval as eval_command

    evaluate = eval_command.evaluate_encoder

    def always_plotted(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("plots", None)
        return evaluate(*args, **kwargs)

    return eval_command, "evaluate_encoder", always_plotted


def _eval_output_unresolved() -> tuple[Any, str, Any]:
    """``mmviews eval --output`` compares the folder with the run's as written, not where they
    are: a path through a link to the run (or with ``..``) reaches its own ``eval/``."""
    import mmviews.cli.eval as eval_command

    def as_written(out: Any, run_dir: Any) -> None:
        if out.parent == run_dir and (out.name in eval_command.TRAINING_EVAL_DIRS
                                      or out.name.startswith(eval_command.TRAINING_EVAL_PREFIX)):
            raise ValueError(f"--output {out} is the run's own evaluation")

    return eval_command, "check_output", as_written


def _check_first_split_only() -> tuple[Any, str, Any]:
    """``mmviews train --check`` checks the training split only (the first of the splits)."""
    import itertools

    import mmviews.train.preflight as preflight

    splits = preflight._splits
    return preflight, "_splits", lambda parts: itertools.islice(splits(parts), 1)


def _check_skips_streamed_splits() -> tuple[Any, str, Any]:
    """``mmviews train --check`` leaves out the evaluation loaders of streamed splits (the old
    behaviour): a streamed training split is checked for the training collator only, never for
    the labels the final evaluation reads."""
    import mmviews.train.preflight as preflight

    splits = preflight._splits

    def map_style_evaluation_only(parts: Any) -> Any:
        return (entry for entry in splits(parts)
                if not (entry[0].endswith(preflight.EVALUATION_SUFFIX) and getattr(entry[2], "streamed", False)))

    return preflight, "_splits", map_style_evaluation_only


def _move_alignment_threshold() -> tuple[Any, str, Any]:
    """The no-alignment threshold of the health checks moved from a gap of 0.02 to 0.03."""
    import mmviews.eval.health as health

    return health, "ALIGNMENT_GAP", 0.03


def _drop_optimizer_state() -> tuple[Any, str, Any]:
    """The memory estimate counts no optimiser state."""
    import mmviews.train.memory as memory

    return memory, "optimizer_state_bytes", lambda optimizer, trainable_bytes, momentum: 0


def _halve_cached_embeddings() -> tuple[Any, str, Any]:
    """The memory estimate counts the cached step's embeddings without their gradient."""
    from mmviews.train.memory import MemoryEstimate

    original = MemoryEstimate.cached_embeddings.fget
    return MemoryEstimate, "cached_embeddings", property(lambda self: original(self) // 2)


def _double_activations() -> tuple[Any, str, Any]:
    """The memory estimate counts twice the activations it measured."""
    from mmviews.train.memory import MemoryEstimate

    original = MemoryEstimate.saved_activations.fget
    return MemoryEstimate, "saved_activations", property(lambda self: 2 * original(self))


def _drop_framework_state() -> tuple[Any, str, Any]:
    """The memory estimate leaves the framework state (what a process keeps once it has run a
    step) out of the host memory it counts."""
    from mmviews.train.memory import MemoryEstimate

    original = MemoryEstimate.host.fget
    return MemoryEstimate, "host", property(lambda self: original(self) - (self.framework if self.on_host else 0))


def _drop_allocator_slack() -> tuple[Any, str, Any]:
    """The memory estimate's step leaves the allocator's measured slack out of the encoder's phase."""
    from mmviews.train.memory import MemoryEstimate

    return MemoryEstimate, "allocator_slack", property(lambda self: 0, lambda self, value: None)


def _cached_peak_without_embeddings() -> tuple[Any, str, Any]:
    """The cached step's peak leaves out the ``[K/N, M, d]`` embeddings and their gradient (the
    part itself is still reported)."""
    from mmviews.train.memory import MemoryEstimate

    original = MemoryEstimate.step.fget
    return MemoryEstimate, "step", property(lambda self: original(self) - self.cached_embeddings)


def _chunk_search_stops_below_bound() -> tuple[Any, str, Any]:
    """The chunk search tries the powers of two below K/N only (``<`` for ``<=``): K/N itself,
    when it is a power of two, is never suggested."""
    from mmviews.train.memory import MemoryEstimate

    def below_bound(self: Any, budget: float) -> Any:
        best, c = None, 1
        while c < self.samples_per_device:
            if self.with_chunk(c).total <= budget:
                best = c
            c *= 2
        return best

    return MemoryEstimate, "largest_chunk_within", below_bound


def _bench_time_contenders_in_blocks() -> tuple[Any, str, Any]:
    """The benchmarks time each contender's rounds in one block, one contender after another (a
    change of machine load between contenders then biases their ratios)."""
    import mmviews.bench.common as common

    round_robin = common.round_robin  # the intact one, run on one contender at a time

    def in_blocks(calls: Any, *args: Any, **kwargs: Any) -> dict[str, list[float]]:
        return {key: round_robin({key: call}, *args, **kwargs)[key] for key, call in calls.items()}

    return common, "round_robin", in_blocks


def _bench_rss_reset_does_nothing() -> tuple[Any, str, Any]:
    """The CPU peak-memory probe says it reset the resident set's high-water mark without doing
    it (a call's peak then includes whatever the process held before)."""
    import mmviews.process_memory as process_memory

    return process_memory, "reset_resident_peak", lambda: True


def _key_dropout_by_optimiser_step() -> tuple[Any, str, Any]:
    """Sample-keyed dropout keyed by the optimiser step instead of the micro-batch: under gradient
    accumulation the micro-batches of one window share a key."""
    import mmviews.train.step as step
    from mmviews.modalities.dropout import dropout_step

    return step, "micro_batch_dropout", lambda p: dropout_step(p.dropout_seed, p.state.step)


def _accept_changed_shuffle_buffer() -> tuple[Any, str, Any]:
    """A streamed run resumes with another ``data.shuffle_buffer`` than its checkpoint's (its
    replay then draws other batches than the interrupted run)."""
    import mmviews.data.streaming as streaming

    kept = {k: v for k, v in streaming._RESUMED_STREAM_KEYS.items() if k != "shuffle_buffer"}
    return streaming, "_RESUMED_STREAM_KEYS", kept


def _fingerprint_first_block_only() -> tuple[Any, str, Any]:
    """A video's content fingerprint hashes its first ``FINGERPRINT_BYTES`` only (a video cut or
    re-indexed at its end, same size, then passes for the prepared one when copied)."""
    import hashlib
    import os

    import mmviews.data.video_store as video_store

    def first_block_only(path: Any) -> str:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return f"{size}:{hashlib.sha256(f.read(video_store.FINGERPRINT_BYTES)).hexdigest()}"

    return video_store, "source_fingerprint", first_block_only


def _shards_drop_fixed_lengths() -> tuple[Any, str, Any]:
    """The Parquet shards store every array dimension as a list of any length (the fixed lengths
    of the source lost from the schema; the recorded shapes still say them)."""
    import datasets

    import mmviews.data.shards as shards

    original = shards.array_feature

    def any_length(feature: Any) -> Any:
        return datasets.List(any_length(feature.feature)) if isinstance(feature, datasets.List) else feature

    def without_fixed_lengths(feature: Any, column: str) -> Any:
        stored, shape = original(feature, column)
        return any_length(stored), shape

    return shards, "array_feature", without_fixed_lengths


# --- the fifth wave's parts (their guards: tests/README.md) ----------------------------------------


def _host_memory_accepts_a_second_setting() -> tuple[Any, str, Any]:
    """``keep_freed_memory`` reports success for a setting other than the one already applied."""
    import mmviews.train.host_memory as host_memory

    original = host_memory.keep_freed_memory

    def accepts_any(setting: str) -> bool:
        return True if host_memory._applied is not None else original(setting)

    return host_memory, "keep_freed_memory", accepts_any


def _regression_chance_from_evaluated_mean() -> tuple[Any, str, Any]:
    """The regression probe's chance predicts the evaluated split's own mean, not the training mean."""
    import mmviews.eval.evaluate as evaluate
    import mmviews.eval.health as health

    def own_mean(train_targets: Any, eval_targets: Any) -> dict[str, float]:
        return health.regression_chance(eval_targets, eval_targets)

    return evaluate, "regression_chance", own_mean


def _synthetic_shared_content() -> tuple[Any, str, Any]:
    """Every synthetic sample gets the first sample's content (u, v)."""
    from mmviews.data.synthetic import SyntheticMultimodal

    original = SyntheticMultimodal.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if len(self.content):
            self.content[:] = self.content[0]

    return SyntheticMultimodal, "__init__", init


def _noise_band_of_standard_deviations() -> tuple[Any, str, Any]:
    """``mmviews compare``'s "within noise" band: two standard deviations, not standard errors."""
    import math

    import mmviews.eval.compare as compare

    def within_noise(a: list[float], b: list[float]) -> Any:
        (ma, sa), (mb, sb) = compare.mean_and_std(a), compare.mean_and_std(b)
        if sa is None or sb is None:
            return None
        band = compare.NOISE_STANDARD_ERRORS * math.sqrt(sa**2 + sb**2)
        return abs(ma - mb) <= band, band

    return compare, "within_noise", within_noise


def _onnx_clip_not_renormalised() -> tuple[Any, str, Any]:
    """The ONNX runtime averages a clip's frame vectors without normalising the mean again."""
    import mmviews.export.onnx_runtime as onnx_runtime

    return onnx_runtime, "_normalise", lambda x: x


def _onnx_manifest_paths_unchecked() -> tuple[Any, str, Any]:
    """A manifest's graph and tokenizer paths are followed wherever they lead."""
    import mmviews.export.onnx_runtime as onnx_runtime

    def anywhere(folder: Any, relative: str, what: str) -> Any:
        path = (folder / relative).resolve()
        if not path.is_file():
            raise ValueError(f"{folder / onnx_runtime.MANIFEST_FILE}: {what} {relative!r} is not a file inside {folder}")
        return path

    return onnx_runtime, "_inside", anywhere


def _hub_fetches_code() -> tuple[Any, str, Any]:
    """Hub downloads also fetch pickles (``*.bin``) and Python files."""
    import mmviews.hub as hub

    return hub, "HUB_FILE_PATTERNS", [*hub.HUB_FILE_PATTERNS, "*.bin", "*.py"]


def _launcher_fsdp_defaults_to_version_2() -> tuple[Any, str, Any]:
    """``accelerate launch --use_fsdp`` without ``FSDP_VERSION`` is taken as FSDP2 (Accelerate runs FSDP1)."""
    import os

    import mmviews.train.sharding as sharding

    def requested() -> str | None:
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in ("1", "true", "yes"):
            return None
        return os.environ.get("FSDP_VERSION", "2")

    return sharding, "fsdp_requested_by_launcher", requested


def _shards_reduced_in_bf16() -> tuple[Any, str, Any]:
    """Sharded bf16 runs reduce their gradients in bf16 (not float32)."""
    import torch

    import mmviews.train.sharding as sharding

    def policy(mixed_precision: str) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)

    return sharding, "_policy", policy


def _sharded_optimizer_state_by_sorted_name() -> tuple[Any, str, Any]:
    """A sharded checkpoint's optimiser state numbered by sorted parameter name, not the groups' order."""
    import mmviews.train.sharding as sharding

    def by_sorted_name(state: dict[str, Any]) -> dict[str, Any]:
        names = sorted(name for group in state["param_groups"] for name in group["params"])
        index = {name: i for i, name in enumerate(names)}
        groups = [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]]
        return {"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups}

    return sharding, "optimizer_state_by_index", by_sorted_name


def _export_in_place() -> tuple[Any, str, Any]:
    """``mmviews export`` writes straight into ``--output`` (no temporary folder beside it)."""
    import mmviews.export.hf as hf

    def in_place(output: Any) -> Any:
        if output.exists():
            raise FileExistsError(f"--output {output} exists: give a new folder")
        output.mkdir()
        return output

    return hf, "prepare_output_folder", in_place


def _width_probe_in_train_mode() -> tuple[Any, str, Any]:
    """A custom backbone's width is measured by a forward in training mode (BatchNorm statistics move)."""
    import torch

    from mmviews.modalities.custom import CustomBackboneAdapter

    def measure(self: Any) -> int:
        side = self.config.image_size or 32
        with torch.no_grad():
            return int(self.backbone(torch.zeros(2, self.config.in_channels, side, side)).shape[1])

    return CustomBackboneAdapter, "_measure_width", measure


def _backbone_normalisation_wins() -> tuple[Any, str, Any]:
    """An image backbone's own mean and std override the recipe's."""
    from mmviews.modalities.image_backbones import ImageInputAdapter

    original = ImageInputAdapter._set_image_input

    def backbones_first(self: Any, size: Any, mean: Any, std: Any, channels: int = 3) -> None:
        if mean is not None:
            self.config.mean = None
        if std is not None:
            self.config.std = None
        original(self, size, mean, std, channels)

    return ImageInputAdapter, "_set_image_input", backbones_first


BREAKS.update({
    "host_memory_accepts_a_second_setting": _host_memory_accepts_a_second_setting,
    "regression_chance_from_evaluated_mean": _regression_chance_from_evaluated_mean,
    "synthetic_shared_content": _synthetic_shared_content,
    "noise_band_of_standard_deviations": _noise_band_of_standard_deviations,
    "onnx_clip_not_renormalised": _onnx_clip_not_renormalised,
    "onnx_manifest_paths_unchecked": _onnx_manifest_paths_unchecked,
    "hub_fetches_code": _hub_fetches_code,
    "launcher_fsdp_defaults_to_version_2": _launcher_fsdp_defaults_to_version_2,
    "shards_reduced_in_bf16": _shards_reduced_in_bf16,
    "sharded_optimizer_state_by_sorted_name": _sharded_optimizer_state_by_sorted_name,
    "export_in_place": _export_in_place,
    "width_probe_in_train_mode": _width_probe_in_train_mode,
    "backbone_normalisation_wins": _backbone_normalisation_wins,
})
