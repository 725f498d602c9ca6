"""The training loop, on HuggingFace Accelerate.

``train(config, run_dir, resume=...)`` is the whole job: build and check everything
(:func:`~mmviews.train.build.build_run`) before any work, ``accelerator.prepare`` (the setup that
``mmviews bench`` shares: :mod:`mmviews.train.setup`), then a plain
loop over epochs and batches whose body is :func:`~mmviews.train.step.train_step` (the step, plain
or cached, and its parts live in :mod:`mmviews.train.step`) plus a logging call. Beyond the
Accelerate example loop, a contrastive trainer needs:

1. **Global batches.** ``data.batch_size`` is the number of samples K per micro-batch
   across all processes (``split_batches=True``): each of N processes encodes K/N samples
   and the objective gathers the embeddings, so the loss and the gradients are those of one
   process on the K samples (up to float rounding). BatchNorm layers are converted to
   SyncBatchNorm on GPUs when N > 1 (every process joins every collective, also with no or one
   present view of a modality: :meth:`~mmviews.modalities.Adapter.embed_present`); on CPU (gloo)
   torch has no SyncBatchNorm, so there BatchNorm statistics are per process (use heads without
   BatchNorm to match one process exactly). ``distributed.timeout_s`` is the process group's
   timeout and ``deterministic`` turns on deterministic algorithms
   (:mod:`mmviews.train.distributed`). Dropout draws its masks from each process's RNG, unless
   ``optimisation.sample_keyed_dropout`` keys them by sample
   (:func:`~mmviews.train.step.micro_batch_dropout`).
2. **Gradient accumulation** (``optimisation.grad_accum_steps`` = n): Accelerate divides each
   micro-batch's loss by n, so an optimiser step follows the average of the n micro-batch
   gradients (the last window of an epoch with fewer than n batches left sums its k < n
   divided gradients, i.e. k/n of their average). It does NOT add negatives: each
   micro-batch's loss only contrasts the K samples of that micro-batch. What does is
   ``optimisation.encode_chunk_size``: cached-embedding steps (:mod:`mmviews.train.step`)
   encode K samples in chunks, so that K is not limited by the encoder's activations.
3. **The objective's contract** (class attributes and no-op hooks of
   :class:`~mmviews.objectives.MultiViewObjective`); the loop has no per-objective code:

   - ``takes_index``: the batch's dataset indices are passed as ``index`` (IPMC's memory bank).
   - ``takes_teacher`` / ``needs_teacher``: with ``objective.ema_teacher: true`` in the recipe,
     or an objective that needs one, the loop keeps an EMA copy of the encoder (decay
     ``objective.teacher_momentum``, updated after every optimiser step) and passes its
     embeddings, computed under ``no_grad``, as ``teacher``.
   - ``critic_step(z)``: every micro-batch, with the detached embeddings, before the loss
     (IPMC's critic updates with the objective's own optimiser); its metrics are logged.
   - ``on_step_end(z, index)``: after every micro-batch's backward (memory banks).
   - ``on_epoch_end(epoch)``: after each epoch (view-filter warm-up, epoch statistics).
   - ``trained_parameters()``: a learned temperature (and siglip's bias), optimised with the
     encoder in a group of their own (``objective.lr``, no weight decay), their gradients averaged
     over processes, clamped by ``on_optimizer_step()``; their values end in ``results.json``
     (``objective_learned``) and the exported encoder.
   - ``state_dict()``/``load_state_dict()``: saved in every checkpoint.
   - ``poly_view_bound``: ``mi_lower_bound`` is logged.

4. **Checkpoints you can kill** (:mod:`mmviews.train.checkpoint`): written to a temporary
   folder and renamed when complete. ``--resume`` restores everything and skips the batches
   of the current epoch already done (``accelerator.skip_first_batches``): the final weights
   equal those of an uninterrupted run (on CUDA bitwise only with ``deterministic: true``). A streamed run (``data.streaming``) is not prepared by
   Accelerate: each process reads its own shards, and its loader position is checkpointed as
   data and replayed (:mod:`mmviews.data.streaming`). SIGINT (Ctrl-C) and SIGTERM finish the
   current step, write a checkpoint and raise ``TrainingInterrupted`` (:mod:`mmviews.train.interrupt`;
   every process stops at the same step, agreed without a device synchronisation).

5. **No host synchronisation between log steps.** Nothing in the step reads a device value
   back: the objective's own input checks are off (``check_inputs = False``), a non-finite
   loss is recorded in a device-side flag and checked at the next log step or checkpoint
   (the error names the range of steps), "are all views present" (of the batch, and of each
   modality) comes from the batch's host-side mask, the adapters' checks of input values
   (finite, lengths, token ids...) and their host preprocessing (tokenising text) run on each
   batch where it is collated, on host tensors (:class:`~mmviews.train.setup.HostPreparedCollate`; a bad input stops
   the run there, naming the modality), and batches are copied with ``non_blocking=True`` from
   pinned memory (on CUDA) by persistent loader workers. ``mmviews bench train`` measures the
   step. Two settings do read back: fp16's GradScaler (once per step; bf16 needs none) and
   SyncBatchNorm (once per layer); ``bench train --sync-debug`` names the cause of each read.

The run folder's layout is described in :mod:`mmviews.run`. ``callback``
(:class:`~mmviews.train.callbacks.TrainCallback`) is called after every optimiser step and
before each checkpoint's rename.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mmviews.config import TrainConfig
from mmviews.data.batch import ViewBatch
from mmviews.data.losses import (
    ABSENT_MODALITIES_KEY,
    DATA_LOSSES_KEY,
    DataLosses,
    absent_modalities,
    excluded_lines,
    run_datasets,
)
from mmviews.eval.health import HealthSettings
from mmviews.fileio import save_folder
from mmviews.notices import print_warning
from mmviews.eval.summary import (RESULTS_LOGGER, finalise_summary, headline_lines, headline_metrics, read_eval_metrics,
                                  write_results)
from mmviews.run import ENCODER_DIR, LOG_FILE, list_checkpoints, read_finished_run, record_run_outputs
from mmviews.train.build import RunParts, build_run
from mmviews.train.callbacks import TrainCallback
from mmviews.train.checkpoint import load_checkpoint, save_checkpoint
from mmviews.train.distributed import (check_launch, collective_failure, configure_determinism, process_state, steps_on_cpu,
                                      timeout_of)
from mmviews.train.evaluation import run_evaluation
from mmviews.train.host_memory import configure_host_memory, host_memory_state
from mmviews.train.interrupt import StopOnSignal, TrainingInterrupted
from mmviews.train.memory import tensor_bytes
from mmviews.train.step_log import StepLogger
from mmviews.train.trackers import resolve_trackers
from mmviews.train.model_card import write_model_card
from mmviews.eval.precision import PrecisionChoice, announce_precision, resolve_precision
from mmviews.train.preflight import check_evaluation_labels
from mmviews.train.run_folder import (CONTINUE, Decision, Intent, RunFolder, add_damaged_checkpoint_hint,
                                     decide_on_every_process)
from mmviews.train.state import TrainState
from mmviews.train.setup import epoch_loader, make_accelerator, planned_steps, prepare_run
from mmviews.train.sharding import full_model_state, launcher_fsdp_hidden, whole_encoder
from mmviews.train.step import Prepared, train_step, update_teacher


def _sharded(p: Prepared) -> tuple[nn.Module, Any] | None:
    """The (model, optimiser) that checkpoints gather and scatter when the run is sharded."""
    return (p.model, p.optimizer) if p.sharded else None


def _check_losses(p: Prepared, state: TrainState, log_every: int) -> None:
    """``FloatingPointError`` if a loss since the previous check was NaN or inf, naming the
    range of optimiser steps in which it happened.

    The loop calls it at log steps and before every checkpoint (so that no checkpoint holds
    weights updated from a non-finite loss): one host read of the accumulated device flag, and
    with several processes one collective, so that every process stops at the same step."""
    flag, first = p.nonfinite, p.checked_step + 1
    p.nonfinite, p.checked_step = None, state.step
    if flag is None:  # no micro-batch since the last check (the same on every process)
        return
    if p.accelerator.num_processes > 1:
        flag = p.accelerator.reduce(flag.float().reshape(1), reduction="sum")
    if bool(flag):
        where = f"step {state.step}" if first >= state.step else f"one of steps {first}-{state.step}"
        raise FloatingPointError(
            f"non-finite loss (NaN or inf) at {where} (epoch {state.epoch}; the loss is checked at log steps, "
            f"output.log_every = {log_every}, and before checkpoints); try a lower optimisation.lr, "
            "optimisation.max_grad_norm, or optimisation.mixed_precision: 'no'")


def check_epoch_complete(state: TrainState, batches_per_epoch: int, epoch: int) -> None:
    """A ``RuntimeError`` when the training loader ran out before ``batches_per_epoch`` micro-batches
    (the epoch length the schedule, the progress bar and the step count were planned with). Left
    unchecked, a short epoch would end the run early with exit status 0, a wrong ``epochs`` in
    ``results.json``, or, when only some processes run short, a hang in the next collective."""
    if state.batch_in_epoch != batches_per_epoch:
        raise RuntimeError(f"epoch {epoch}: the training loader gave {state.batch_in_epoch} batches, "
                           f"{batches_per_epoch} expected (len() of the loader at the start of the run)")


def log_run_end(run_dir: Path, summary: dict[str, Any]) -> None:
    """The end of a run on the :data:`~mmviews.eval.summary.RESULTS_LOGGER` logger, for Python
    callers of :func:`train` (``mmviews train`` prints the same itself): the headline metrics
    (info) and each warning of the health checks (warning, shown even without logging set up)."""
    logger = logging.getLogger(RESULTS_LOGGER)
    lines = headline_lines(summary.get("headline") or [])
    if lines:
        logger.info("%s: %s", run_dir, "\n".join(lines))
    for message in summary.get("warnings") or []:
        logger.warning("warning: %s", message)


def record_evaluated_sizes(losses: DataLosses, eval_dir: Path, datasets: dict[str, tuple[str, Any]]) -> None:
    """Count, per split, the samples the evaluation in ``eval_dir`` did not embed (``n_<split>``
    of its ``metrics.json`` against the dataset's size): those left out when unreadable. A
    streamed split has no size: not counted here."""
    try:
        meta = json.loads((eval_dir / "metrics.json").read_text()).get("meta") or {}
    except (OSError, ValueError):
        return
    for role, (_, dataset) in datasets.items():
        if f"n_{role}" in meta and not getattr(dataset, "streamed", False) and hasattr(dataset, "__len__"):
            losses.record_evaluated(role, len(dataset), int(meta[f"n_{role}"]))


def train(config: TrainConfig, run_dir: str | os.PathLike[str], resume: str | os.PathLike[str] | None = None,
          source: str = "recipe", callback: TrainCallback | None = None, *, overwrite: bool = False,
          resume_ignore_rng: bool = False, reevaluate: bool = False, recipe_given: bool = False) -> dict[str, Any]:
    """Train (or resume) the run in ``run_dir``; returns the summary also written to
    ``results.json``: among others ``"eval"`` and ``"eval_random"`` (the final evaluation of
    the trained and of the randomly initialised encoder), ``"headline"`` (the probes' and
    retrieval's main metrics, trained against random init, with chance levels) and
    ``"warnings"`` (the health checks of :mod:`mmviews.eval.health`), both also logged on the
    ``mmviews.train.results`` logger (:func:`log_run_end`). ``resume``: a run folder (latest checkpoint) or a checkpoint folder.
    A fresh run needs ``run_dir`` new, empty, or a run that stopped before its first checkpoint
    (:mod:`mmviews.train.run_folder`), or ``overwrite`` to replace an mmviews run (only what
    that run wrote is removed).
    ``resume_ignore_rng``: resume even if the checkpoint's RNG states cannot be read.
    ``recipe_given`` (with ``resume``): ``config`` comes from a recipe of the caller's rather than
    from the run's ``config.yaml``, so it must be the run's own outside ``output``. What the call
    does with ``run_dir`` (start, continue, replace, refuse) is decided once, by
    :class:`mmviews.train.run_folder.RunFolder`, whose lock the main process holds until the call
    returns: another command on the same folder meanwhile is refused.

    Resuming a finished run (its checkpoint at the last step, ``results.json`` written) changes
    nothing and returns that summary with ``"already_finished": True``; with ``reevaluate`` the
    final evaluation runs again (the summary keeps the training's wall time).

    SIGINT and SIGTERM finish the current optimiser step, write a checkpoint and raise
    :class:`~mmviews.train.interrupt.TrainingInterrupted` (:mod:`mmviews.train.interrupt`)."""
    progress: list[TrainState] = []  # the loop's state, once there is one (for the error below)
    with StopOnSignal() as stop, ExitStack() as on_exit:  # the previous signal handlers come back at the end
        try:
            intent = Intent(None if resume is None else Path(resume), overwrite, recipe_given or resume is None)
            return _train(config, Path(run_dir), intent, source, callback or TrainCallback(), stop, on_exit,
                          resume_ignore_rng=resume_ignore_rng, reevaluate=reevaluate, progress=progress)
        except Exception as error:  # a peer that hung or died: one line of ours (the engine's error chained)
            found = list_checkpoints(run_dir)
            failure = collective_failure(error, config.distributed.timeout_s, progress[-1].step if progress else None,
                                         str(found[-1]) if found else None)
            if failure is None:
                raise
            raise failure from error


def _data_left_out(accelerator: Any, parts: Any) -> dict[str, dict[str, Any]]:
    """What ``on_error: skip`` left out of the training and evaluation splits, over every
    process (collective: every process calls it)."""
    from mmviews.data.loaders import data_left_out, merge_data_left_out

    splits = dict(parts.datasets)
    for name, loader in (parts.eval_loaders or {}).items():
        if loader is not None and name not in splits:
            splits[name] = getattr(loader, "dataset", None)
    local = data_left_out(splits)
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        return merge_data_left_out(gather_object([local]))
    return merge_data_left_out([local])


@dataclass
class _Run:
    """What the loop's steps share: the run, its prepared objects and its bookkeeping."""

    config: TrainConfig
    run_dir: Path
    parts: RunParts
    p: Prepared
    log: StepLogger
    losses: DataLosses
    callback: TrainCallback
    stop: StopOnSignal
    precision: PrecisionChoice


def _train(config: TrainConfig, run_dir: Path, intent: Intent, source: str, callback: TrainCallback,
           stop: StopOnSignal, on_exit: ExitStack, *, resume_ignore_rng: bool, reevaluate: bool,
           progress: list[TrainState]) -> dict[str, Any]:
    # Setup: what happens to the run folder, build and check the run, the accelerator, prepare, resume.
    started = time.perf_counter()
    processes = _start_processes(config)
    # "auto" resolved for this device once, before the recipe is compared with a run's or saved
    config, precision = resolve_precision(config, processes.device.type)
    if processes.is_main_process:
        announce_precision(precision)
    folder = RunFolder(run_dir)
    on_exit.callback(folder.release)  # the main process holds the folder's lock until the end
    decision = decide_on_every_process(folder, config, intent, processes.is_main_process, processes.num_processes)
    decision.raise_if_refused()
    checkpoint = decision.checkpoint if decision.action == CONTINUE else None
    parts = build_run(config, processes.num_processes, source)
    check_evaluation_labels(parts, source)  # as --check does: else found at the first evaluation, maybe the last
    finished = None if checkpoint is None else read_finished_run(
        run_dir, checkpoint, planned_steps(config, len(parts.train_loader))[0], reevaluate)
    if finished is not None and not reevaluate:
        return {**finished, "already_finished": True}
    trackers = resolve_trackers(config, source)  # a tracker asked for but not installed fails here too
    accelerator = make_accelerator(config, run_dir, trackers)
    _claim_run_dir(accelerator, parts, folder, decision, on_exit)
    losses, absent = _announce_data_losses(accelerator, parts)
    p = prepare_run(accelerator, parts)
    p.state.leg_started = started  # a resume adds the earlier legs' wall time (from the checkpoint) to this one's
    progress.append(p.state)
    random_metrics = _resume_or_evaluate_random(p, parts, folder, checkpoint, resume_ignore_rng)
    log = StepLogger(accelerator, config, run_dir, trackers=trackers, total_steps=p.total_steps,
                     batches_per_epoch=p.batches_per_epoch, poly_view_bound=parts.objective.poly_view_bound,
                     state=p.state, resumed=checkpoint is not None, started=started)
    on_exit.callback(log.close)  # an error's line then starts on a line of its own, after the bar
    if trackers:  # however the run ends (an error too): a tracker run left open would block the next one
        on_exit.callback(accelerator.end_training)
    run = _Run(config, run_dir, parts, p, log, losses, callback, stop, precision)

    # The loop: epochs of micro-batches, each one train_step (mmviews.train.step).
    saved = _train_epochs(run, checkpoint)
    log.close()
    if stop.end_of_loop():  # a signal reached some process: every process stops here, checkpoint written
        raise TrainingInterrupted(stop.agreed, p.state.step, saved)

    # The end: the encoder, the final evaluation, results.json and the model card.
    encoder = _save_encoder(run, source)
    metrics = _evaluate_at_end(run, encoder)
    summary = _summary(run, started=started, finished=finished, checkpoint=checkpoint, metrics=metrics,
                       random_metrics=random_metrics, absent=absent)
    if accelerator.is_main_process:
        write_results(run_dir, summary, HealthSettings.from_config(config))
        log_run_end(run_dir, summary)
        write_model_card(run_dir / ENCODER_DIR, config, summary, source)  # after evaluation: it has the numbers
        record_run_outputs(run_dir)
    if trackers:
        log.log_evaluation(metrics, random_metrics, p.state.step)
        log.log_report()
    return summary


def _start_processes(config: TrainConfig) -> Any:
    """This process set up for the run and Accelerate's process state (the process group, when
    launched with several): a launch that asked for more processes than it got fails here."""
    configure_determinism(config.deterministic)  # before CUDA starts (CUBLAS_WORKSPACE_CONFIG)
    # called from a program: only an explicit "heap" or "hold" (mmviews's command applied "auto" already)
    configure_host_memory(config.host_memory, owns_process=False, on_cpu=steps_on_cpu(config))
    with launcher_fsdp_hidden():  # mmviews shards itself (mmviews.train.sharding), on CPU and GPU alike
        processes = process_state(config)
    check_launch(processes.num_processes, config)  # a launch that asked for N processes and got fewer stops here
    return processes


def _claim_run_dir(accelerator: Any, parts: RunParts, folder: RunFolder, decision: Decision,
                   on_exit: ExitStack) -> None:
    """The run folder made ready by the main process as decided (:meth:`RunFolder.claim`; its
    manifest written however the run ends), and what the data says of itself printed there;
    every process waits for it."""
    if accelerator.is_main_process:
        folder.claim(decision, parts.config)
        on_exit.callback(record_run_outputs, folder.run_dir)  # however the run ends, its manifest lists what it wrote
        note = getattr(parts.datasets["train"], "source_note", None)  # e.g. which split lists a video folder read
        if isinstance(note, str):
            print(f"data: {note}", flush=True)
    accelerator.wait_for_everyone()


def _announce_data_losses(accelerator: Any, parts: RunParts) -> tuple[DataLosses, dict[str, str]]:
    """What the data lacks, said once before any work: known-bad samples left out of their split,
    a modality that no training sample has. Counted on in data_losses (results.json)."""
    losses = DataLosses(run_datasets(parts))
    absent = (absent_modalities(parts.datasets["train"], parts.view_spec, parts.config.data.train_split)
              if accelerator.is_main_process else {})  # it may open every clip: once is enough
    if accelerator.is_main_process:
        for line in excluded_lines(losses.splits) + list(absent.values()):
            print(f"mmviews train: {line}", flush=True)
    return losses, absent


def _resume_or_evaluate_random(p: Prepared, parts: RunParts, folder: RunFolder, checkpoint: Path | None,
                               ignore_rng: bool) -> dict[str, float] | None:
    """Resuming: the checkpoint's state loaded, then (only then) the run's ``config.yaml``
    rewritten with the recipe it continues with, and the random baseline's metrics read back.
    Fresh: the randomly initialised encoder evaluated (``evaluation.random_baseline``)."""
    accelerator, state, evaluation, run_dir = p.accelerator, p.state, parts.config.evaluation, folder.run_dir
    if checkpoint is None:
        if evaluation.random_baseline and evaluation.tasks:
            return run_evaluation(accelerator.unwrap_model(p.model), parts, run_dir / "eval_random", accelerator,
                                  meta={"encoder": "random initialisation (before training)"})
        return None
    try:
        load_checkpoint(checkpoint, accelerator, state, parts.objective, p.teacher, ignore_rng=ignore_rng,
                        sharded=_sharded(p))
    except (OSError, ValueError, pickle.UnpicklingError) as error:  # a damaged file, named: which checkpoint instead
        add_damaged_checkpoint_hint(error, checkpoint)
        raise
    if state.stream is not None and state.stream_state is not None:
        state.stream.load_state_dict(state.stream_state)  # refuses other shards, seed or process count
    p.checked_step = state.step
    if accelerator.is_main_process:  # one line, so that a user (and the tests) see where it continues
        folder.continued(parts.config)
        print_warning("mmviews train", f"resumed from {checkpoint} at step {state.step} of {p.total_steps}")
    return read_eval_metrics(run_dir / "eval_random")


def _train_epochs(run: _Run, saved: Path | None) -> Path | None:
    """The epochs left (until the run's last step or a stop), a checkpoint after each and the
    evaluation every ``evaluation.every_epochs``; the last checkpoint written (else ``saved``)."""
    p, state, eval_cfg = run.p, run.p.state, run.config.evaluation
    num_views = len(run.parts.view_spec)
    run.stop.defer(p.accelerator.num_processes, p.accelerator.is_main_process,
                   timeout_of(run.config))  # a signal now stops after the step
    for epoch in range(state.epoch, run.config.optimisation.epochs):
        if state.step >= p.total_steps or run.stop.agreed:
            break
        p.model.train()
        _train_epoch(run, epoch)
        if state.batch_in_epoch >= p.batches_per_epoch:
            run.parts.objective.on_epoch_end(epoch)
            state.epoch, state.batch_in_epoch = epoch + 1, 0
        saved = _checkpoint(run)
        if (eval_cfg.every_epochs and eval_cfg.tasks and state.step < p.total_steps and not run.stop.agreed
                and (epoch + 1) % eval_cfg.every_epochs == 0):
            run_evaluation(p.accelerator.unwrap_model(p.model), run.parts, run.run_dir / f"eval_epoch_{epoch + 1}",
                           p.accelerator, log_csv=run.run_dir / LOG_FILE,
                           meta={"epoch": epoch + 1, "step": state.step, "num_views": num_views})
    return saved


def _train_epoch(run: _Run, epoch: int) -> None:
    """The micro-batches of ``epoch`` (those left of it when resuming), each one
    :func:`~mmviews.train.step.train_step`, until the epoch ends, the run's last step or a stop."""
    p, state = run.p, run.p.state
    for batch in epoch_loader(p, run.parts, epoch):
        _count_unreadable(run.losses, batch)
        out, critic_metrics = train_step(p, batch, run.config.optimisation.max_grad_norm)
        state.batch_in_epoch += 1
        state.samples += batch.num_samples * p.accelerator.num_processes
        if p.accelerator.sync_gradients and _after_optimiser_step(run, out, critic_metrics, batch):
            return
    # the loader ran out: it must have given the whole epoch (not a shorter one on some process)
    check_epoch_complete(state, p.batches_per_epoch, epoch)


def _count_unreadable(losses: DataLosses, batch: ViewBatch) -> None:
    """Unreadable samples left out of this batch (``on_error: skip``) counted; a batch left with
    fewer than two samples stops the run (nothing to contrast: the data is too damaged to go on)."""
    if not batch.dropped:
        return
    losses.record_dropped("train", batch.dropped)
    if batch.num_samples < 2:
        raise ValueError(f"{len(batch.dropped)} of the {len(batch.dropped) + batch.num_samples} samples "
                         f"of a training batch are unreadable (data.options.on_error: skip), e.g. "
                         f"{batch.dropped[0]}; repair them or rerun `mmviews prepare` to list them")


def _after_optimiser_step(run: _Run, out: Any, critic_metrics: dict[str, Any], batch: ViewBatch) -> bool:
    """The step counted, the teacher updated, the step logged, a periodic checkpoint; True when
    the epoch's loop stops here (a signal, or the run's last step)."""
    p, state, out_cfg = run.p, run.p.state, run.config.output
    state.step += 1
    update_teacher(p)
    if state.step % out_cfg.log_every == 0 or state.step == p.total_steps:  # StepLogger's log steps
        _check_losses(p, state, out_cfg.log_every)
    run.log.log(state, out, critic_metrics, p.optimizer, batch.num_samples, batch.num_views)
    run.callback.on_step_end(state)
    if run.stop.requested():  # at the same step on every process
        return True
    done, end_of_epoch = state.step >= p.total_steps, state.batch_in_epoch >= p.batches_per_epoch
    if out_cfg.checkpoint_every and state.step % out_cfg.checkpoint_every == 0 and not done and not end_of_epoch:
        _checkpoint(run)
    return done


def _checkpoint(run: _Run) -> Path:
    """The losses since the last check checked (no checkpoint holds weights updated from a
    non-finite loss), ``metrics.csv`` flushed, then a checkpoint; its folder."""
    p = run.p
    _check_losses(p, p.state, run.config.output.log_every)
    run.log.sync()  # the log's rows up to this step reach the disk before this step's checkpoint is committed
    return save_checkpoint(p.accelerator, run.run_dir, p.state, run.config.output.keep_last, run.parts.objective,
                           run.callback, p.teacher, sharded=_sharded(p))


def _save_encoder(run: _Run, source: str) -> nn.Module:
    """The trained encoder saved in ``encoder/`` (full tensors, loadable by one process, also
    when the run is sharded: a collective gather first); the unwrapped encoder."""
    accelerator, p = run.p.accelerator, run.p
    encoder = accelerator.unwrap_model(p.model)
    learned = run.parts.objective.learned_values()  # a learned temperature: kept in encoder.json (and exports)
    info = {"name": run.config.objective.name, **learned} if learned else None
    encoder.objective_info = info
    # encoder/ is written in a temporary folder and committed durably (mmviews.fileio.save_folder)
    if p.sharded:
        full = full_model_state(encoder)
        if accelerator.is_main_process:
            whole = whole_encoder(run.config, full, source)
            whole.objective_info = info
            save_folder(run.run_dir / ENCODER_DIR, whole.save_pretrained, needed=tensor_bytes(full.values()))
    elif accelerator.is_main_process:
        save_folder(run.run_dir / ENCODER_DIR, encoder.save_pretrained, needed=tensor_bytes(encoder.state_dict().values()))
    accelerator.wait_for_everyone()
    return encoder


def _evaluate_at_end(run: _Run, encoder: nn.Module) -> dict[str, float]:
    """The final evaluation (``evaluation.at_end``) of the trained encoder; its metrics."""
    config, accelerator = run.config, run.p.accelerator
    if not (config.evaluation.at_end and config.evaluation.tasks):
        return {}
    metrics = run_evaluation(encoder, run.parts, run.run_dir / "eval", accelerator, log_csv=run.run_dir / LOG_FILE,
                             meta={"objective": config.objective.name, "step": run.p.state.step, "recipe": config.name,
                                   "num_views": len(run.parts.view_spec)})
    if accelerator.is_main_process:  # the only one that wrote eval/metrics.json
        record_evaluated_sizes(run.losses, run.run_dir / "eval", run_datasets(run.parts))
    return metrics


def _summary(run: _Run, *, started: float, finished: dict[str, Any] | None, checkpoint: Path | None,
             metrics: dict[str, float], random_metrics: dict[str, float] | None,
             absent: dict[str, str]) -> dict[str, Any]:
    """The run's summary (``results.json``); what the data left out is gathered from every
    process (collective)."""
    config, p, state, accelerator = run.config, run.p, run.p.state, run.p.accelerator
    return finalise_summary({
        "name": config.name, "objective": config.objective.name, "steps": state.step, "epochs": state.epoch,
        # completed epochs above; here with the part of the last one (a split of fresh samples is
        # never gone through: 0 completed epochs)
        "epochs_trained": round(state.epoch + state.batch_in_epoch / p.batches_per_epoch, 6),
        "samples_seen": state.samples, "final_loss": run.log.last_loss,
        # the objective's learned parameters at the end (a learned temperature, siglip's bias), if any
        "objective_learned": run.parts.objective.learned_values(),
        # K (samples per micro-batch over all processes) and the micro-batches of one optimiser step
        "global_batch_size": config.data.batch_size, "grad_accum_steps": config.optimisation.grad_accum_steps,
        # every leg of the run (a resume counts the legs before it up to its checkpoint); an evaluation
        # run again (reevaluate) keeps the wall time of the training
        "wall_time_s": (finished or {}).get("wall_time_s") or state.wall_time_s,
        "num_processes": accelerator.num_processes, "device": str(accelerator.device),
        "sharding": "fsdp" if p.sharded else "none", "mixed_precision": accelerator.mixed_precision,
        "mixed_precision_choice": run.precision.to_dict(),  # asked (auto...), used, why
        "compile": bool(config.optimisation.compile), "host_memory": host_memory_state(),
        "resumed_from": str(checkpoint) if checkpoint is not None else None, "eval": metrics, "eval_random": random_metrics,
        "data_skipped": _data_left_out(accelerator, run.parts),
        DATA_LOSSES_KEY: run.losses.to_dict(), ABSENT_MODALITIES_KEY: absent,
        "headline": headline_metrics(metrics, random_metrics),
    })
