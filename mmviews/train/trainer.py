"""The training loop, on HuggingFace Accelerate.

``train(config, run_dir, resume=...)`` is the whole job: build and check everything
(``build_run``) before any work, ``accelerator.prepare``, then a plain loop over epochs and
batches. Read top to bottom it is the Accelerate example loop plus four things a
contrastive trainer needs:

1. **Global batches.** ``data.batch_size`` is the number of samples K per micro-batch
   across all processes (``split_batches=True``): each of N processes encodes K/N samples
   and the objective gathers the embeddings, so the loss and the gradients are those of one
   process on the K samples (up to float rounding). BatchNorm layers are converted to
   SyncBatchNorm on GPUs when N > 1; on CPU (gloo) torch has no SyncBatchNorm, so there
   BatchNorm statistics are per process (use heads without BatchNorm to match one process
   exactly).
2. **Gradient accumulation** (``optimisation.grad_accum_steps``) sums gradients over
   micro-batches. It does NOT add negatives: each micro-batch's loss only contrasts the K
   samples of that micro-batch.
3. **Objective protocol.** Stateful objectives are driven through optional attributes
   looked up with ``getattr``; the loop has no per-objective code:

   - keyword inputs of ``objective.loss``: the loop passes ``index`` (the batch's dataset
     indices, e.g. IPMC's memory bank) and ``teacher`` when the objective's ``loss`` accepts
     them. ``teacher`` (with ``objective.ema_teacher: true`` in the recipe, or an objective
     whose ``requires_teacher`` is True): the loop keeps an EMA copy of the encoder (decay
     ``objective.teacher_momentum``, updated after every optimiser step) and passes its
     embeddings, computed under ``no_grad``: ``objective.compute(z, mask, teacher=z_t)``.
   - ``critic_step(z)``: called on every micro-batch with the detached embeddings before the
     loss (IPMC's critic updates, with the objective's own optimiser); the metrics it
     returns are logged.
   - ``on_step_end(z, index)``: after every micro-batch's backward, with the detached
     embeddings and the batch's dataset indices (memory banks).
   - ``on_epoch_end(epoch)``: after each epoch (view-filter warm-up, epoch statistics).
   - ``state_dict()``/``load_state_dict()``: saved in every checkpoint.

4. **Checkpoints you can kill.** ``accelerator.save_state`` (model, optimiser, scheduler,
   scaler, RNG states, EMA teacher, loop position) plus ``objective.pt`` (the objective's
   ``state_dict``, loaded before the RNG states are restored) are written into
   ``checkpoints/.tmp-checkpoint-N`` and the folder is renamed to ``checkpoint-N`` only when
   complete, so a kill mid-write leaves the previous checkpoint intact; the last
   ``output.keep_last`` are kept. ``--resume`` restores everything and skips the batches
   of the current epoch already done (``accelerator.skip_first_batches``): the final
   weights equal those of an uninterrupted run.

Run folder: ``config.yaml`` (resolved config), ``metrics.csv`` (one row per logged step),
``checkpoints/``, ``encoder/`` (``MultiViewEncoder.save_pretrained``), ``eval/`` (final
report), ``eval_random/`` (the same probes on the encoder as initialised), ``results.json``
and ``report.md`` (summary: wall time, final loss, trained vs random metrics).

Test hooks (environment variables, seconds): ``MMVIEWS_DEBUG_STEP_SLEEP`` sleeps after every
optimiser step; ``MMVIEWS_DEBUG_CHECKPOINT_SLEEP`` sleeps in the middle of writing a
checkpoint (after ``save_state``, before the rename); ``SECONDS@STEP`` only at that step.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from mmviews.fileio import atomic_write_text
from mmviews.train.config import ConfigError, TrainConfig, save_config
from mmviews.train.optim import build_optimizer, build_scheduler

# Objectives whose loss gives the poly-view MI lower bound log(K*M - M + 1) - loss.
POLY_VIEW_OBJECTIVES = frozenset({"geometric_pvc", "arithmetic_pvc", "sufficient_statistics"})
CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
CONFIG_FILE = "config.yaml"
LOG_FILE = "metrics.csv"
OBJECTIVE_FILE = "objective.pt"


# --------------------------------------------------------------------------- small state objects


@dataclass
class TrainState:
    """Where the loop is; saved in every checkpoint. ``batch_in_epoch`` counts the
    micro-batches of ``epoch`` already trained on; ``step`` the optimiser steps."""

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    samples: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.step, self.samples = int(state["step"]), int(state.get("samples", 0))


class GlobalBatchSampler(Sampler[list[int]]):
    """Exposes ``batch_size`` (= K) of :class:`mmviews.data.views.ViewSetBatchSampler` so that
    Accelerate can split each global batch of indices between processes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batch_size = int(inner.K)
        self.drop_last = True

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class EMATeacher(nn.Module):
    """Exponential moving average of the encoder's weights (no gradients)."""

    def __init__(self, encoder: nn.Module, momentum: float) -> None:
        super().__init__()
        self.module = copy.deepcopy(encoder)
        self.module.requires_grad_(False)
        self.momentum = momentum

    @torch.no_grad()
    def update(self, encoder: nn.Module) -> None:
        for t, s in zip(self.module.parameters(), encoder.parameters()):
            t.lerp_(s.detach(), 1.0 - self.momentum)
        for t, s in zip(self.module.buffers(), encoder.buffers()):
            t.copy_(s)

    @torch.no_grad()
    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module(batch)


# --------------------------------------------------------------------------- building a run


@dataclass
class RunParts:
    """Everything a run needs, built and checked before any training work."""

    config: TrainConfig
    datasets: dict[str, Any]
    view_spec: Any
    collator: Any
    sampler: GlobalBatchSampler
    train_loader: DataLoader
    eval_loaders: dict[str, DataLoader | None]
    encoder: nn.Module
    objective: nn.Module
    loader_generator: torch.Generator = field(default_factory=torch.Generator)


def _register_extras() -> None:
    """The 1-D Gaussian dataset and the MLP adapter of ``recipes/polyview_gaussian.yaml``."""
    import mmviews.train.gaussian  # noqa: F401  (registers on import)


def _data_card(name: str) -> str:
    return f"data_cards/{name}.md"


class CachedDataset(Dataset):
    """Memoises ``dataset[i]`` (``data.cache``); other attributes are the wrapped dataset's."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._items: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self._items.get(index)
        if item is None:
            item = self._items[index] = self.dataset[index]
        return item

    def __getattr__(self, name: str) -> Any:  # modality_info() and friends
        if name in ("dataset", "_items"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def build_dataset_split(config: TrainConfig, split: str) -> Any:
    """One split of the recipe's dataset; a missing ``data.root`` is a FileNotFoundError
    that points to the dataset's card."""
    try:
        from mmviews.data import build_dataset
    except ImportError:  # the data layer's registry is not there yet
        build_dataset = _synthetic_only

    _register_extras()
    d = config.data
    if d.root is not None and not Path(d.root).expanduser().exists():
        raise FileNotFoundError(f"dataset {d.name!r} not found at {d.root}, see {_data_card(d.name)} "
                                f"(set data.root, e.g. --set data.root=/path/to/{d.name})")
    kwargs = {**d.options, **d.split_options.get(split, {})}
    if d.root is not None:
        kwargs["root"] = str(Path(d.root).expanduser())
    dataset = build_dataset(d.name, split=split, **kwargs)
    return CachedDataset(dataset) if d.cache else dataset


def _synthetic_only(name: str, split: str = "train", **options: Any) -> Any:
    """Stand-in for ``mmviews.data.build_dataset`` covering only the synthetic data (one
    seed per split)."""
    if name != "synthetic":
        raise ValueError(f"unknown dataset {name!r} (mmviews.data.build_dataset is unavailable)")
    from mmviews.data.synthetic import SyntheticMultimodal

    offsets = {"train": 0, "valid": 1, "val": 1, "test": 2}
    options = dict(options)
    options["seed"] = int(options.get("seed", 0)) * 10 + offsets[split]
    return SyntheticMultimodal(**options)


def eval_view_config(config: TrainConfig) -> list[Any]:
    """Views of the evaluation loaders: ``evaluation.views``, else one natural view per
    modality of the training views (in order of first appearance)."""
    if config.evaluation.views is not None:
        return list(config.evaluation.views)
    from mmviews.data.views import ViewSpec

    return [{"modality": m} for m in ViewSpec.from_config(config.views).modalities]


def _eval_loader(config: TrainConfig, dataset: Any) -> DataLoader:
    from mmviews.data.views import ViewSetCollator

    collator = ViewSetCollator.for_dataset(dataset, eval_view_config(config), seed=config.seed)
    return DataLoader(dataset, batch_size=config.data.eval_batch_size, shuffle=False, collate_fn=collator,
                      num_workers=config.data.num_workers)


def build_eval_loaders(config: TrainConfig, train_dataset: Any | None = None) -> dict[str, DataLoader | None]:
    """Unshuffled, un-augmented loaders of the train, val and test splits (None where the
    recipe has no such split)."""
    d = config.data
    loaders: dict[str, DataLoader | None] = {}
    for key, split in (("train", d.train_split), ("val", d.val_split), ("test", d.test_split)):
        if split is None:
            loaders[key] = None
            continue
        dataset = train_dataset if key == "train" and train_dataset is not None else build_dataset_split(config, split)
        loaders[key] = _eval_loader(config, dataset)
    return loaders


def build_encoder(config: TrainConfig, source: str = "recipe") -> nn.Module:
    from mmviews.modalities.multiview import MultiViewEncoder

    _register_extras()
    try:
        return MultiViewEncoder.from_config(config.encoder_config())
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{source}: keys 'adapters'/'encoder': {error}") from error


def loss_inputs(objective: nn.Module) -> set[str]:
    """Keyword inputs of ``objective.loss`` that the loop can supply (``index``, ``teacher``)."""
    import inspect

    loss = getattr(objective, "loss", None)
    if loss is None:
        return set()
    return {"index", "teacher"} & set(inspect.signature(loss).parameters)


def uses_teacher(config: TrainConfig, objective: nn.Module) -> bool:
    return bool(config.objective.ema_teacher or getattr(objective, "requires_teacher", False))


def build_objective(config: TrainConfig, num_views: int, source: str = "recipe",
                    dataset_size: int | None = None) -> nn.Module:
    """The objective, checked against the view set (e.g. ``simclr`` needs M = 2).

    ``dataset_size`` fills the objective's ``dataset_size`` parameter (IPMC's view-filter
    memory) when the constructor takes one and the recipe leaves it out."""
    import inspect

    from mmviews.objectives import get_objective, list_objectives, objective_class

    params = dict(config.objective.params)
    cls = objective_class(config.objective.name) if config.objective.name in list_objectives() else None
    if (dataset_size is not None and cls is not None and "dataset_size" not in params
            and "dataset_size" in inspect.signature(cls.__init__).parameters):
        params["dataset_size"] = dataset_size
    try:
        objective = get_objective(config.objective.name, **params)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{source}: key 'objective': {error}") from error
    check = getattr(objective, "check_views", None)
    if check is not None:
        try:
            check(num_views)
        except ValueError as error:
            raise ConfigError(f"{source}: key 'objective.name': {error}; the recipe's views give M = {num_views}") from error
    if uses_teacher(config, objective) and "teacher" not in loss_inputs(objective):
        raise ConfigError(f"{source}: key 'objective.ema_teacher': objective {config.objective.name!r} takes no teacher "
                          "embeddings (its loss has no 'teacher' argument)")
    return objective


def build_run(config: TrainConfig, num_processes: int = 1, source: str = "recipe", *,
              with_eval: bool = True) -> RunParts:
    """Build datasets, views, loaders, encoder and objective, checking that they fit
    together. Every recipe error surfaces here, before any training step."""
    from accelerate.utils import set_seed

    from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator, ViewSpec

    if with_eval and config.evaluation.tasks:
        from mmviews.eval.evaluate import parse_tasks

        try:
            parse_tasks(config.evaluation.tasks)
        except ValueError as error:
            raise ConfigError(f"{source}: key 'evaluation.tasks': {error}") from error
    try:
        spec = ViewSpec.from_config(config.views)
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{source}: key 'views': {error}") from error
    missing = [m for m in spec.modalities if m not in config.adapters]
    if missing:
        raise ConfigError(f"{source}: key 'adapters': no adapter for modalities {missing} used by 'views' "
                          f"(adapters given: {sorted(config.adapters)})")
    M = len(spec)
    d = config.data
    sampler = ViewSetBatchSampler(1, d.batch_size, M, d.batch_mode, reference_views=d.reference_views)
    if sampler.K < 2:
        raise ConfigError(f"{source}: key 'data.batch_size': the batch has K = {sampler.K} samples with M = {M} views "
                          f"(batch_mode {d.batch_mode!r}); K must be >= 2")
    if sampler.K % num_processes:
        raise ConfigError(f"{source}: key 'data.batch_size': K = {sampler.K} samples per batch cannot be split evenly "
                          f"between {num_processes} processes")

    train_dataset = build_dataset_split(config, d.train_split)
    objective = build_objective(config, M, source, dataset_size=len(train_dataset))
    if len(train_dataset) < sampler.K:
        raise ConfigError(f"{source}: key 'data.batch_size': the {d.train_split!r} split has {len(train_dataset)} samples, "
                          f"fewer than one batch of K = {sampler.K}")
    eval_loaders = build_eval_loaders(config, train_dataset) if with_eval else {}
    try:
        collator = ViewSetCollator.for_dataset(train_dataset, spec, seed=config.seed)
    except (ValueError, KeyError) as error:
        raise ConfigError(f"{source}: key 'views': {error}") from error
    inner = ViewSetBatchSampler(len(train_dataset), d.batch_size, M, d.batch_mode,
                                reference_views=d.reference_views, shuffle=True, drop_last=True, seed=config.seed)
    batches = GlobalBatchSampler(inner)
    generator = torch.Generator()
    generator.manual_seed(config.seed)
    # The loader draws its worker base seed from its own generator, not the global RNG, so
    # that resuming mid-epoch (a new iterator) leaves the training RNG stream unchanged.
    train_loader = DataLoader(train_dataset, batch_sampler=batches, collate_fn=collator,
                              num_workers=d.num_workers, generator=generator)
    set_seed(config.seed)  # identical initial weights on every process and every run
    encoder = build_encoder(config, source)
    return RunParts(config, {"train": train_dataset}, spec, collator, batches, train_loader, eval_loaders,
                    encoder, objective, generator)


# --------------------------------------------------------------------------- checkpoints


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a checkpoint folder, else the latest checkpoint of the run
    folder ``path``."""
    path = Path(path)
    if (path / "train_state.json").is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {path} (expected {path}/checkpoints/{CHECKPOINT_PREFIX}N)")
    return found[-1]


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def _debug_checkpoint_sleep(step: int) -> float:
    """``MMVIEWS_DEBUG_CHECKPOINT_SLEEP``: ``SECONDS`` (every checkpoint) or ``SECONDS@STEP``
    (only the checkpoint of that optimiser step)."""
    value = os.environ.get("MMVIEWS_DEBUG_CHECKPOINT_SLEEP", "")
    if not value:
        return 0.0
    seconds, _, at = value.partition("@")
    return float(seconds) if not at or int(at) == step else 0.0


def _save_checkpoint(accelerator: Any, run_dir: Path, state: TrainState, keep_last: int, objective: nn.Module) -> Path:
    """``save_state`` into a temporary folder, then rename: a kill mid-write never replaces
    a complete checkpoint. Every process calls this (each saves its RNG state)."""
    folder = run_dir / "checkpoints"
    final = folder / f"{CHECKPOINT_PREFIX}{state.step:08d}"
    tmp = folder / f"{TMP_PREFIX}{state.step:08d}"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        delay = _debug_checkpoint_sleep(state.step)
        if delay > 0:
            time.sleep(delay)  # test hook: a kill here must leave the previous checkpoint usable
        torch.save(objective.state_dict(), tmp / OBJECTIVE_FILE)
        (tmp / "train_state.json").write_text(json.dumps(state.state_dict()))
        if final.exists():  # same step saved twice (e.g. resumed and re-saved): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _clean_tmp_checkpoints(run_dir: Path) -> None:
    folder = run_dir / "checkpoints"
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- logging


class CSVLogger:
    """Appends one row per logged step to ``metrics.csv`` (main process only). The columns
    are fixed by the first row. On resume, rows after the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.fields: list[str] | None = None
        if resume_step is not None and path.is_file():
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                fields = reader.fieldnames
                rows = [r for r in reader if int(float(r["step"])) <= resume_step]
            if fields:
                kept = io.StringIO()
                writer = csv.DictWriter(kept, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)
                atomic_write_text(path, kept.getvalue())
                self.fields = list(fields)
        elif path.exists():
            path.unlink()

    def log(self, row: dict[str, Any]) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore", restval="")
            if new:
                writer.writeheader()
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def _flat_hparams(config: TrainConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, str, bool)):
            out[prefix] = value

    walk("", config.to_dict())
    return out


# --------------------------------------------------------------------------- evaluation


@contextmanager
def _rng_preserved() -> Iterator[None]:
    """Run evaluation without moving the training RNG streams (torch, numpy, random), so
    that where evaluations happen does not change the trained weights."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def run_evaluation(encoder: nn.Module, parts: RunParts, out_dir: Path, accelerator: Any | None,
                   log_csv: Path | None = None, meta: dict[str, Any] | None = None) -> dict[str, float]:
    """The recipe's probes (``evaluation.tasks``) on ``encoder``; report written to ``out_dir``."""
    from mmviews.eval.evaluate import evaluate_encoder

    loaders = parts.eval_loaders
    with _rng_preserved():
        return evaluate_encoder(encoder, loaders.get("train"), loaders.get("val"), loaders.get("test"),
                                parts.config.evaluation.tasks, out_dir, accelerator, log_csv=log_csv,
                                meta=meta, seed=parts.config.seed, fuse=parts.config.evaluation.fuse,
                                progress=parts.config.output.progress_bar)


# --------------------------------------------------------------------------- the loop


def _objective_needs_mask(objective: nn.Module, mask: torch.Tensor) -> torch.Tensor | None:
    """The mask to pass: None when every view is present; an error when views are missing
    and the objective cannot take a mask."""
    if bool(mask.all()):
        return None
    if not getattr(objective, "supports_mask", False):
        raise ValueError(f"objective {getattr(objective, 'name', type(objective).__name__)!r} does not support missing "
                         "views, but this batch has absent modalities; choose an objective that takes a mask "
                         "(e.g. mv_dhel, geometric_pvc) or a dataset without missing modalities")
    return mask


def train(config: TrainConfig, run_dir: str | os.PathLike[str], resume: str | os.PathLike[str] | None = None,
          source: str = "recipe") -> dict[str, Any]:
    """Train (or resume) the run in ``run_dir``; returns the summary also written to
    ``results.json``. ``resume``: a run folder (latest checkpoint) or a checkpoint folder."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs
    from tqdm.auto import tqdm

    started = time.perf_counter()
    run_dir = Path(run_dir)
    o = config.optimisation
    checkpoint = find_checkpoint(resume) if resume is not None else None

    # Everything that can be wrong with the recipe fails here, before any work.
    num_processes = PartialState(cpu=config.cpu).num_processes
    parts = build_run(config, num_processes, source)
    encoder, objective = parts.encoder, parts.objective

    use_tb = config.output.tensorboard and _tensorboard_available()
    accelerator = Accelerator(
        cpu=config.cpu,
        mixed_precision=o.mixed_precision,
        gradient_accumulation_steps=o.grad_accum_steps,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        log_with="tensorboard" if use_tb else None,
        project_dir=str(run_dir),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=config.find_unused_parameters)],
    )
    main = accelerator.is_main_process
    if accelerator.num_processes > 1 and accelerator.device.type != "cpu":
        encoder = nn.SyncBatchNorm.convert_sync_batchnorm(encoder)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if checkpoint is None:  # a fresh run (e.g. --overwrite): no stale checkpoints or encoder
            for stale in ("checkpoints", "encoder"):
                shutil.rmtree(run_dir / stale, ignore_errors=True)
        save_config(config, run_dir / CONFIG_FILE)
        _clean_tmp_checkpoints(run_dir)
    accelerator.wait_for_everyone()

    backbone_lr = o.lr if o.backbone_lr is None else o.backbone_lr
    optimizer = build_optimizer(encoder.param_groups(backbone_lr, o.lr, o.weight_decay), o)
    batches_per_epoch = len(parts.train_loader)
    steps_per_epoch = math.ceil(batches_per_epoch / o.grad_accum_steps)
    total_steps = o.epochs * steps_per_epoch if o.max_steps is None else min(o.max_steps, o.epochs * steps_per_epoch)
    scheduler = build_scheduler(optimizer, o, total_steps, steps_per_epoch)

    objective.to(accelerator.device)
    teacher = EMATeacher(encoder, config.objective.teacher_momentum) if uses_teacher(config, objective) else None
    supplied = loss_inputs(objective)
    model, optimizer, train_loader, scheduler = accelerator.prepare(encoder, optimizer, parts.train_loader, scheduler)
    if teacher is not None:
        teacher.to(accelerator.device)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if teacher is not None:
        accelerator.register_for_checkpointing(teacher)

    random_metrics: dict[str, float] | None = None
    if checkpoint is not None:
        # The objective first: loading may build lazily created parts (IPMC's critic), which
        # draws random numbers; load_state then restores the RNG states.
        objective.load_state_dict(torch.load(checkpoint / OBJECTIVE_FILE, map_location=accelerator.device,
                                             weights_only=True))
        accelerator.load_state(str(checkpoint))
        state.load_state_dict(json.loads((checkpoint / "train_state.json").read_text()))
        if (run_dir / "eval_random" / "metrics.json").is_file():
            random_metrics = json.loads((run_dir / "eval_random" / "metrics.json").read_text())["metrics"]
    elif config.evaluation.random_baseline and config.evaluation.tasks:
        random_metrics = run_evaluation(accelerator.unwrap_model(model), parts, run_dir / "eval_random", accelerator,
                                        meta={"encoder": "random initialisation (before training)"})

    logger = CSVLogger(run_dir / LOG_FILE, resume_step=state.step if checkpoint is not None else None) if main else None
    if use_tb:
        accelerator.init_trackers("tensorboard", config=_flat_hparams(config))
    name = config.objective.name
    poly_view = getattr(objective, "poly_view", name in POLY_VIEW_OBJECTIVES)
    hooks = {h: getattr(objective, h, None) for h in ("critic_step", "on_step_end", "on_epoch_end")}
    step_sleep = float(os.environ.get("MMVIEWS_DEBUG_STEP_SLEEP", "0") or 0)
    ckpt_every, keep = config.output.checkpoint_every, config.output.keep_last
    last_loss = float("nan")
    done = state.step >= total_steps

    bar = tqdm(total=total_steps, initial=state.step, desc="train", disable=not (main and config.output.progress_bar),
               dynamic_ncols=True)
    last_time = time.perf_counter()
    for epoch in range(state.epoch, o.epochs):
        if done:
            break
        # The prepared loader calls set_epoch(its own iteration count) on the sampler when an
        # iterator starts; set it to the true epoch so that a resumed run shuffles the same.
        train_loader.set_epoch(epoch)
        parts.sampler.set_epoch(epoch)
        parts.collator.set_epoch(epoch)
        parts.loader_generator.manual_seed(config.seed * 1_000_003 + epoch)
        model.train()
        loader = train_loader
        if state.batch_in_epoch > 0:  # resuming mid-epoch
            loader = accelerator.skip_first_batches(train_loader, state.batch_in_epoch)
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                z, mask = model(batch)
                mask = _objective_needs_mask(objective, mask)
                extra: dict[str, Any] = {}
                if teacher is not None:
                    extra["teacher"] = teacher(batch)[0]
                if "index" in supplied:
                    extra["index"] = batch.index
                critic_metrics = {}
                if hooks["critic_step"] is not None:
                    critic_metrics = hooks["critic_step"](z.detach()) or {}
                out = objective.compute(z, mask, **extra)
                if not torch.isfinite(out.loss):
                    raise FloatingPointError(f"non-finite loss {out.loss.item()} at step {state.step + 1} "
                                             f"(epoch {epoch}, batch {state.batch_in_epoch})")
                accelerator.backward(out.loss)
                if accelerator.sync_gradients and o.max_grad_norm is not None:
                    accelerator.clip_grad_norm_(model.parameters(), o.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if hooks["on_step_end"] is not None:
                hooks["on_step_end"](z.detach(), batch.index)
            state.batch_in_epoch += 1
            K_global = batch.num_samples * accelerator.num_processes
            state.samples += K_global
            if not accelerator.sync_gradients:
                continue
            state.step += 1
            if teacher is not None:
                teacher.update(accelerator.unwrap_model(model))
            now = time.perf_counter()
            if state.step % config.output.log_every == 0 or state.step == total_steps:
                step_metrics = {**out.metrics, **critic_metrics}
                names = sorted(step_metrics)
                values = torch.stack([out.loss.detach().float()]
                                     + [torch.as_tensor(step_metrics[k], device=out.loss.device).float().reshape(()) for k in names])
                values = accelerator.reduce(values, reduction="mean").tolist()
                last_loss = values[0]
                row: dict[str, Any] = {"step": state.step, "epoch": epoch + state.batch_in_epoch / batches_per_epoch,
                                       "loss": last_loss}
                row.update(dict(zip(names, values[1:])))
                if poly_view:
                    from mmviews.objectives import mi_lower_bound

                    row["mi_lower_bound"] = float(mi_lower_bound(last_loss, K_global, batch.num_views))
                for group in optimizer.param_groups:  # one column per part (backbone, head)
                    part = str(group.get("name", "group")).split(".")[-1].replace("_no_decay", "")
                    row.setdefault(f"lr_{part}", group["lr"])
                row["samples_per_s"] = K_global * o.grad_accum_steps / max(now - last_time, 1e-9)
                row["time_s"] = now - started
                if logger is not None:
                    logger.log(row)
                if use_tb:
                    accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
                bar.set_postfix(loss=f"{last_loss:.4f}")
            bar.update(1)
            last_time = now
            if step_sleep > 0:
                time.sleep(step_sleep)
            done = state.step >= total_steps
            end_of_epoch = state.batch_in_epoch >= batches_per_epoch
            if ckpt_every and state.step % ckpt_every == 0 and not done and not end_of_epoch:
                _save_checkpoint(accelerator, run_dir, state, keep, objective)
            if done:
                break
        if state.batch_in_epoch >= batches_per_epoch:
            if hooks["on_epoch_end"] is not None:
                hooks["on_epoch_end"](epoch)
            state.epoch, state.batch_in_epoch = epoch + 1, 0
        _save_checkpoint(accelerator, run_dir, state, keep, objective)
        every = config.evaluation.every_epochs
        if every and config.evaluation.tasks and not done and (epoch + 1) % every == 0:
            run_evaluation(accelerator.unwrap_model(model), parts, run_dir / f"eval_epoch_{epoch + 1}", accelerator,
                           log_csv=run_dir / LOG_FILE, meta={"epoch": epoch + 1, "step": state.step})
    bar.close()

    unwrapped = accelerator.unwrap_model(model)
    if main:
        unwrapped.save_pretrained(run_dir / "encoder")
    accelerator.wait_for_everyone()
    metrics: dict[str, float] = {}
    if config.evaluation.at_end and config.evaluation.tasks:
        metrics = run_evaluation(unwrapped, parts, run_dir / "eval", accelerator, log_csv=run_dir / LOG_FILE,
                                 meta={"objective": name, "step": state.step, "recipe": config.name})
    summary = {
        "name": config.name,
        "objective": name,
        "steps": state.step,
        "epochs": state.epoch,
        "samples_seen": state.samples,
        "final_loss": last_loss,
        "wall_time_s": time.perf_counter() - started,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "resumed_from": str(checkpoint) if checkpoint is not None else None,
        "eval": metrics,
        "eval_random": random_metrics,
    }
    if main:
        _write_results(run_dir, summary)
    if use_tb:
        accelerator.end_training()
    return summary


def _lower_is_better(metric: str) -> bool:
    leaf = metric.rsplit("/", 1)[-1].lower()
    return leaf in {"mae", "mse", "rmse", "loss"} or leaf.startswith("mae")


def _write_results(run_dir: Path, summary: dict[str, Any]) -> None:
    """``results.json`` and ``report.md``: the run summary and, per metric, trained vs
    randomly initialised encoder."""
    atomic_write_text(run_dir / "results.json", json.dumps(summary, indent=2, default=str))
    lines = [f"# Run report: {summary['name']}", "",
             f"- objective: {summary['objective']}",
             f"- optimiser steps: {summary['steps']} ({summary['epochs']} epochs, {summary['samples_seen']} samples)",
             f"- final training loss: {summary['final_loss']:.4f}",
             f"- wall time: {summary['wall_time_s']:.1f} s on {summary['num_processes']} process(es), {summary['device']}",
             ""]
    trained, random_ = summary["eval"], summary["eval_random"] or {}
    if trained:
        lines += ["| metric | trained | random init | trained - random |", "|---|---|---|---|"]
        for key in sorted(trained):
            if "weight_decay" in key or not key.startswith(("test/", "val/")):
                continue
            t = trained[key]
            r = random_.get(key)
            diff = "" if r is None else f"{t - r:+.4f}" + (" (lower is better)" if _lower_is_better(key) else "")
            lines.append(f"| {key} | {t:.4f} | {'' if r is None else f'{r:.4f}'} | {diff} |")
        lines += ["", "Full evaluation report: [eval/summary.md](eval/summary.md)"
                  + ("; random-initialisation baseline: [eval_random/summary.md](eval_random/summary.md)" if random_ else ""), ""]
    atomic_write_text(run_dir / "report.md", "\n".join(lines))


# --------------------------------------------------------------------------- loading a run


def load_run(path: str | os.PathLike[str]) -> tuple[nn.Module, TrainConfig, dict[str, DataLoader | None]]:
    """Load a trained run for evaluation: ``(encoder, config, loaders)``.

    ``path``: a run folder (uses its ``encoder/`` if training finished, else its latest
    checkpoint) or a checkpoint folder. ``loaders``: ``{"train", "val", "test"}`` unshuffled,
    un-augmented loaders of the recipe's splits (None for a split the recipe lacks), with the
    evaluation views (``evaluation.views`` or one natural view per modality). The encoder is
    on CPU in eval mode.
    """
    from safetensors.torch import load_file

    from mmviews.modalities.multiview import MultiViewEncoder
    from mmviews.train.config import load_config

    _register_extras()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run or checkpoint at {path}")
    is_checkpoint = (path / "train_state.json").is_file()
    run_dir = run_dir_of(path) if is_checkpoint else path
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not an mmviews run: missing {config_path}")
    config = load_config(config_path)
    if not is_checkpoint and (run_dir / "encoder").is_dir():
        encoder = MultiViewEncoder.from_pretrained(run_dir / "encoder")
    else:
        checkpoint = find_checkpoint(path)
        encoder = build_encoder(config, str(config_path))
        weights = checkpoint / "model.safetensors"
        if weights.is_file():
            state = load_file(str(weights))
        else:
            state = torch.load(checkpoint / "pytorch_model.bin", map_location="cpu", weights_only=True)
        encoder.load_state_dict(state, strict=True)
    encoder.eval()
    loaders = build_eval_loaders(config)
    return encoder, config, loaders
