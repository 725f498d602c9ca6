"""The recipe schema: typed training configuration, loaded from YAML recipes.

A recipe is a YAML mapping whose top-level keys are the fields of :class:`TrainConfig`
(``name``, ``seed``, ``data``, ``views``, ``adapters``, ``encoder``, ``objective``,
``optimisation``, ``evaluation``, ``output``...). Loading checks every key and every value's
type against the dataclasses below; an unknown key or a wrong type is a
:class:`ConfigError` that names the key path and the file it came from.

Overrides use dotted key paths with YAML scalars as values (``--set optimisation.lr=3e-4``,
``--set data.options.num_samples=512``, ``--set views.0.copies=3``); they are applied to the
raw mapping before validation, so they are checked exactly like the file.

The sections whose schema another layer owns are resolved when the recipe loads, by the same
validator (:mod:`mmviews.schema`), into the typed objects the rest of the code takes:
:attr:`TrainConfig.view_spec` and :attr:`~TrainConfig.eval_view_spec` (``views``,
``evaluation.views``: :class:`mmviews.data.ViewSpec`), :attr:`~TrainConfig.adapter_configs`
(``adapters``: :class:`mmviews.modalities.AdapterConfig`) and :attr:`~TrainConfig.eval_tasks`
(``evaluation.tasks``: :class:`mmviews.eval.tasks.EvalTask`); the fields keep the recipe as
written (what ``--set`` addresses and the run folder's copy holds). ``objective.params`` is
checked by the objective's constructor when the run is set up, before any training step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import yaml

from mmviews.fileio import atomic_write_text, is_folder_name
from mmviews.registry import did_you_mean
from mmviews.schema import FLOAT_LITERAL, ConfigError, build_section, check_keys, coerce, where

if TYPE_CHECKING:
    from mmviews.data.views import ViewSpec
    from mmviews.eval.tasks import EvalTask
    from mmviews.modalities.config import AdapterConfig


# --------------------------------------------------------------------------- sections


@dataclass
class DataConfig:
    """Where the samples come from and how batches are formed.

    ``batch_size`` is the number of samples K per optimiser micro-batch across ALL
    processes (the global batch): with N processes each one encodes ``K / N`` samples and
    the objectives gather embeddings, so the negatives seen by the loss do not depend on
    the number of processes. ``batch_mode="fixed"`` keeps ``K * M`` at
    ``batch_size * reference_views`` instead (poly-view paper, sec. 3.2).
    """

    name: str = "synthetic"  # registry name of mmviews.data.build_dataset
    root: str | None = None  # dataset folder or file; None for generated data
    options: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of build_dataset
    split_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per split name, over ``options``
    train_split: str = "train"
    val_split: str | None = "valid"
    test_split: str | None = "test"
    batch_size: int = 64
    batch_mode: Literal["growing", "fixed"] = "growing"
    reference_views: int = 2
    num_workers: int = 0
    eval_batch_size: int = 256
    # Keep every decoded sample in memory after its first use (small datasets whose samples
    # are costly to produce, e.g. the generated synthetic data). Per process and per loader
    # worker; augmentations still run on every use.
    cache: bool = False
    # Read the splits as streams of Parquet shards (data.name: hf; mmviews.data.streaming):
    # split across processes, shuffled with a seeded buffer of shuffle_buffer rows.
    streaming: bool = False
    shuffle_buffer: int = 1000


@dataclass
class ObjectiveConfig:
    """``name`` and keyword ``params`` of :func:`mmviews.objectives.get_objective`.

    ``ema_teacher``: keep an EMA copy of the encoder and give its embeddings (stop-gradient)
    to the objective as ``teacher=`` (``er``'s distillation form); objectives whose class sets
    ``needs_teacher`` get one anyway. ``teacher_momentum`` is the EMA decay.

    ``lr``: the learning rate of the objective's learned parameters (a learned temperature,
    ``params.learn_temperature: true``; ``siglip``'s scale and bias), which never take weight
    decay, as in open_clip; None: ``optimisation.lr``. They follow the run's schedule.
    """

    name: str = "mv_dhel"
    params: dict[str, Any] = field(default_factory=dict)
    ema_teacher: bool = False
    teacher_momentum: float = 0.996
    lr: float | None = None


@dataclass
class OptimisationConfig:
    """Optimiser, schedule and precision.

    ``lr`` is the learning rate of the projection heads (and of the whole model when
    ``backbone_lr`` is None). ``epochs`` bounds the run; ``max_steps`` (optimiser steps), when
    set, stops it earlier. Warm-up is ``warmup_steps`` plus ``warmup_epochs`` worth of steps.
    ``grad_accum_steps`` = n > 1 averages the gradients of n micro-batches before a step
    (each micro-batch's loss is divided by n; a shorter last window of an epoch is not
    rescaled, so its step is k/n of the average of its k micro-batches): it
    enlarges the effective batch for the optimiser but NOT the set of negatives, which
    stays one micro-batch of ``data.batch_size`` samples (contrastive losses do not
    decompose over micro-batches). ``encode_chunk_size`` does enlarge it beyond what the encoder's
    activations allow: cached-embedding steps encode the K samples in chunks of that many
    (:mod:`mmviews.train.step`). ``sample_keyed_dropout``: see
    :mod:`mmviews.modalities.dropout`.
    """

    optimizer: Literal["adamw", "sgd", "lars"] = "adamw"
    lr: float = 1e-3
    backbone_lr: float | None = None
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW
    momentum: float = 0.9  # SGD and LARS
    nesterov: bool = False
    lars_eta: float = 0.001  # LARS trust coefficient
    epochs: int = 1
    max_steps: int | None = None
    warmup_steps: int = 0
    warmup_epochs: float = 0.0
    schedule: Literal["cosine", "constant"] = "cosine"
    grad_accum_steps: int = 1
    # Dropout masks keyed by (seed, micro-batch, sample, view, layer) instead of drawn from the
    # global RNG: the same masks however a batch is chunked or split between processes
    # (mmviews.modalities.dropout); a random layer that cannot be keyed stops the run at setup.
    sample_keyed_dropout: bool = False
    max_grad_norm: float | None = None  # clip the global gradient norm (encoder and objective's learned parameters); None = no clipping
    # Samples per encoder chunk of a cached-embedding step (mmviews.train.step); None:
    # the plain step, which keeps the activations of all K samples for backward.
    encode_chunk_size: int | None = None
    # auto: bf16 where the device computes it natively (a bf16 GPU, a CPU with AVX512-BF16/AMX),
    # else float32; resolved once when a run starts (mmviews.eval.precision)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    # torch.compile of every adapter's backbone and head, in place (mmviews.train.compiled):
    # the same parameter names and checkpoints; the first step of a shape compiles.
    compile: bool = False


@dataclass
class EvaluationConfig:
    """Probes run by :func:`mmviews.eval.evaluate_encoder` on frozen embeddings.

    ``tasks``: the evaluation layer's task list (see :mod:`mmviews.eval.evaluate`, e.g.
    ``"linear:class"``, ``"regression:sentiment"``, ``{"kind": "msa", "dataset": "mosi"}``). ``every_epochs`` > 0 also evaluates during training. ``random_baseline``
    evaluates the encoder as initialised (before any step) with the same probes, so the
    report shows what training added. ``fuse``: probes see the concatenation of the views'
    embeddings or their mean (the mean rewards views that agree in the shared space).
    ``views``: the view spec of the evaluation loaders
    (None: one natural, un-augmented view per modality of the training views).
    ``plots``: draw each report's PNGs (training curves, similarity histogram, spectrum);
    ``false`` writes the same metrics and summary without them (the plots cost about a second
    of CPU per evaluation: for sweeps of many short runs, such as the reproduction scripts'
    ``--smoke`` size).
    """

    tasks: list[Any] = field(default_factory=list)  # strings ("linear:class") or mappings
    every_epochs: int = 0
    at_end: bool = True
    random_baseline: bool = True
    views: list[Any] | None = None
    fuse: Literal["concat", "mean"] = "concat"  # how per-view embeddings become one vector for probes
    plots: bool = True


@dataclass
class OutputConfig:
    """Run folder, logging and checkpoints.

    ``dir``: the run folder's name, one path component relative to the working directory
    (None: ``runs/<name>``; any other folder is chosen with ``--output``). ``checkpoint_every`` optimiser steps (0: at the end of
    every epoch only); the last ``keep_last`` checkpoints are kept.

    ``metrics.csv`` is always written. ``trackers`` adds Accelerate experiment trackers that
    receive the same per-step rows and the recipe as hyper-parameters (``log_with=``):
    ``tensorboard`` (the ``mmviews[tensorboard]`` extra; events in ``<run>/logs/``) and the
    others Accelerate knows, whose packages the user installs (a tracker asked for but not
    installed stops the run before any work). ``tensorboard`` is the old switch, kept so that
    recipes and run folders that have it still load: ``true`` adds TensorBoard when it is
    installed (skipped with a warning otherwise), ``false``/``null`` does nothing; new recipes
    use ``trackers: [tensorboard]``.

    ``auto_resume``: the same command continues the run in its folder from its newest intact
    checkpoint (a scheduler's or the elastic agent's restart), see :mod:`mmviews.train.resume`.
    """

    dir: str | None = None
    log_every: int = 1
    checkpoint_every: int = 0
    keep_last: int = 2
    trackers: list[Literal["tensorboard", "aim", "mlflow", "wandb", "comet_ml", "clearml", "dvclive", "swanlab",
                           "trackio"]] = field(default_factory=list)
    tensorboard: bool | None = None  # deprecated: use trackers: [tensorboard]
    progress_bar: bool = True
    auto_resume: bool = False


@dataclass
class DistributedConfig:
    """Several processes (``accelerate launch``). ``timeout_s``: how long a process waits in a
    collective before the run fails (the process group's timeout), e.g. the other processes
    waiting while the main one computes the evaluation metrics; NCCL's own default is 10
    minutes, too short for a long evaluation. See :mod:`mmviews.train.distributed`."""

    timeout_s: float = 3600.0
    # --- sharding (mmviews.train.sharding) ---
    # "none": every process holds all parameters, gradients and optimiser state (data parallel);
    # "fsdp": torch's FSDP2 (fully_shard) shards them over the processes. `accelerate launch
    # --use_fsdp --fsdp_version 2` (or an Accelerate config file with FSDP) asks for "fsdp" too.
    sharding: str = "none"
    # Sharding units per modality (the wrap policy): "backbone" (default: the adapter's backbone
    # and its projection head, one unit each), "layers" (also each transformer layer of the
    # backbone) or "adapter" (the whole adapter as one unit).
    fsdp_units: dict[str, str] = field(default_factory=dict)


@dataclass
class TrainConfig:
    """A whole recipe."""

    name: str = "run"
    description: str = ""
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    views: list[Any] = field(default_factory=list)  # mmviews.data.ViewSpec.from_config entries
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)  # modality -> adapter config
    encoder: dict[str, Any] = field(default_factory=dict)  # other MultiViewEncoder options (embed_dim...)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimisation: OptimisationConfig = field(default_factory=OptimisationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    cpu: bool = False  # force CPU even where an accelerator is present
    # DDP: tolerate parameters that get no gradient in a step (e.g. a BERT pooler unused by
    # mean pooling); set False for a little speed when every parameter is used.
    find_unused_parameters: bool = True
    # torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG (mmviews.train.distributed):
    # bitwise repeatable runs, and resumed runs equal to uninterrupted ones, on CUDA too; slower.
    deterministic: bool = False
    # whether glibc's malloc keeps the memory a step frees for the next step instead of giving it
    # back and faulting it in again: "auto" keeps the heap ("heap") when mmviews's command owns
    # the process and trains on the CPU; "hold" keeps everything (fastest, may raise the peak);
    # "system" leaves the allocator alone (mmviews.train.host_memory)
    host_memory: Literal["auto", "heap", "hold", "system"] = "auto"
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        """The recipe as written (the resolved objects below are made from it)."""
        return dataclasses.asdict(self)

    def encoder_config(self) -> dict[str, Any]:
        """The mapping given to ``MultiViewEncoder.from_config``: the resolved adapter configs."""
        return {**self.encoder, "modalities": dict(self.adapter_configs)}

    # The recipe's sections resolved into typed objects, once: by config_from_dict when a recipe
    # loads (errors name the file and the key), else at first use (a TrainConfig made in Python).

    @functools.cached_property
    def view_spec(self) -> ViewSpec:
        """The training views (``views``) as a :class:`mmviews.data.ViewSpec`."""
        return _view_spec(self.views, "views", _UNNAMED)

    @functools.cached_property
    def eval_view_spec(self) -> ViewSpec:
        """The views of the evaluation loaders: ``evaluation.views``, else one natural
        (un-augmented) view per modality of the training views."""
        return _eval_view_spec(self, _UNNAMED)

    @functools.cached_property
    def adapter_configs(self) -> dict[str, AdapterConfig]:
        """Each modality's adapter config (``adapters``), typed; ``encoder.embed_dim`` fills the
        adapters that do not set their own."""
        return _adapter_configs(self, _UNNAMED)

    @functools.cached_property
    def eval_tasks(self) -> list[EvalTask]:
        """The evaluation tasks (``evaluation.tasks``), typed; empty when none are named."""
        return _eval_tasks(self, _UNNAMED)


# --------------------------------------------------------------------------- typed loading

_UNNAMED = "recipe"  # the source named in errors of a TrainConfig that was not loaded from a file


def dotted_keys(value: Any, prefix: str = "") -> dict[str, Any]:
    """A recipe's nested mappings as ``{"optimisation.lr": leaf, ...}``; lists, scalars and empty
    mappings are leaves (what ``--set KEY=VALUE`` can name)."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(dotted_keys(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _view_spec(entries: Sequence[Any], key: str, source: str) -> ViewSpec:
    from mmviews.data.views import ViewSpec

    try:
        return ViewSpec.from_config(entries, source, key)
    except ConfigError:
        raise
    except ValueError as error:  # the views together (names not unique)
        raise ConfigError(f"{source}: key '{key}': {error}") from None


def _adapter_configs(config: TrainConfig, source: str) -> dict[str, AdapterConfig]:
    from mmviews.modalities.base import adapter_class

    check_keys(config.encoder, ["embed_dim"], "encoder", source)  # the adapters are a section of their own
    embed_dim = config.encoder.get("embed_dim")
    if embed_dim is not None:  # fills the adapters that do not set their own
        coerce(embed_dim, int, "encoder.embed_dim", source)
        if embed_dim < 1:  # a zero-width projection builds, and fails only in the first evaluation or step
            raise ConfigError(f"{where(source, 'encoder.embed_dim')}: must be >= 1 (the size of the shared "
                              f"embedding), got {embed_dim}")
    out = {}
    for modality, raw in config.adapters.items():
        key = f"adapters.{modality}"
        try:
            cls = adapter_class(raw["type"])
        except ValueError as error:
            raise ConfigError(f"{source}: key '{key}.type': {error}") from None
        if embed_dim is not None and "embed_dim" not in raw:
            raw = {**raw, "embed_dim": embed_dim}
        out[modality] = cls.config_class.from_dict(raw, key, source)
    return out


def _eval_view_spec(config: TrainConfig, source: str) -> ViewSpec:
    from mmviews.data.loaders import eval_view_config

    if config.evaluation.views is not None:
        return _view_spec(config.evaluation.views, "evaluation.views", source)
    return _view_spec(eval_view_config(config.view_spec), "views", source)


def _eval_tasks(config: TrainConfig, source: str) -> list[EvalTask]:
    from mmviews.eval.tasks import parse_tasks

    return parse_tasks(config.evaluation.tasks, source) if config.evaluation.tasks else []


def _resolve(config: TrainConfig, source: str, adapters: bool) -> None:
    """Resolve the sections that other layers type (views, adapters unless ``adapters`` is off,
    evaluation tasks) into ``config``'s cached properties, naming ``source`` in errors."""
    resolved = config.__dict__  # where functools.cached_property keeps its values
    resolved["view_spec"] = _view_spec(config.views, "views", source)
    resolved["eval_view_spec"] = _eval_view_spec(config, source)
    if adapters:
        resolved["adapter_configs"] = _adapter_configs(config, source)
    resolved["eval_tasks"] = _eval_tasks(config, source)


#: Why fp16 and FSDP sharding do not go together (refused at load, and when the launcher asks for FSDP).
FSDP_FP16_REFUSAL = ("fp16 is not supported with distributed.sharding: fsdp (Accelerate's gradient scaler does not "
                     "handle sharded gradients); use bf16")


def _check_values(config: TrainConfig, source: str) -> None:
    """Range checks that types cannot express."""

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: key '{key}': {message}")

    d, o, e, out = config.data, config.optimisation, config.evaluation, config.output
    need(d.batch_size >= 2, "data.batch_size", f"must be >= 2 (negatives come from other samples), got {d.batch_size}")
    need(d.reference_views >= 1, "data.reference_views", f"must be >= 1, got {d.reference_views}")
    need(d.num_workers >= 0, "data.num_workers", f"must be >= 0, got {d.num_workers}")
    need(d.eval_batch_size >= 1, "data.eval_batch_size", f"must be >= 1, got {d.eval_batch_size}")
    need(len(config.views) > 0, "views", "at least one view entry is needed")
    need(len(config.adapters) > 0, "adapters", "at least one modality adapter is needed")
    need(o.lr > 0, "optimisation.lr", f"must be > 0, got {o.lr}")
    need(o.backbone_lr is None or o.backbone_lr >= 0, "optimisation.backbone_lr", f"must be >= 0, got {o.backbone_lr}")
    need(o.weight_decay >= 0, "optimisation.weight_decay", f"must be >= 0, got {o.weight_decay}")
    need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimisation.betas", f"must be two numbers in [0, 1), got {o.betas}")
    need(0 <= o.momentum < 1, "optimisation.momentum", f"must be in [0, 1), got {o.momentum}")
    need(o.lars_eta > 0, "optimisation.lars_eta", f"must be > 0, got {o.lars_eta}")
    need(o.epochs >= 1, "optimisation.epochs", f"must be >= 1, got {o.epochs}")
    need(o.max_steps is None or o.max_steps >= 1, "optimisation.max_steps", f"must be >= 1, got {o.max_steps}")
    need(o.warmup_steps >= 0, "optimisation.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    need(o.warmup_epochs >= 0, "optimisation.warmup_epochs", f"must be >= 0, got {o.warmup_epochs}")
    need(o.grad_accum_steps >= 1, "optimisation.grad_accum_steps", f"must be >= 1, got {o.grad_accum_steps}")
    need(o.max_grad_norm is None or o.max_grad_norm > 0, "optimisation.max_grad_norm", f"must be > 0, got {o.max_grad_norm}")
    need(o.encode_chunk_size is None or o.encode_chunk_size >= 1, "optimisation.encode_chunk_size",
         f"must be a number of samples >= 1 (or null: no chunking), got {o.encode_chunk_size}")
    # torch.compile (2.11) fails on the context_fn with which checkpointing replays sample keys
    # (mmviews.modalities.checkpointing); without sample-keyed dropout none is passed
    checkpointed = sorted(m for m, a in config.adapters.items() if isinstance(a, dict) and a.get("gradient_checkpointing"))
    need(not (o.compile and checkpointed and o.sample_keyed_dropout), "optimisation.compile",
         f"cannot be combined with gradient_checkpointing (adapters {', '.join(checkpointed)}) under "
         "optimisation.sample_keyed_dropout: torch.compile rejects the context that replays the sample keys in the "
         "recomputation; turn one of the three off")
    need(not (config.distributed.sharding == "fsdp" and o.mixed_precision == "fp16"), "optimisation.mixed_precision",
         FSDP_FP16_REFUSAL)
    need(config.objective.lr is None or config.objective.lr >= 0, "objective.lr", f"must be >= 0, got {config.objective.lr}")
    need(0 <= config.objective.teacher_momentum < 1, "objective.teacher_momentum", f"must be in [0, 1), got {config.objective.teacher_momentum}")
    need(e.every_epochs >= 0, "evaluation.every_epochs", f"must be >= 0, got {e.every_epochs}")
    need(out.log_every >= 1, "output.log_every", f"must be >= 1, got {out.log_every}")
    need(out.checkpoint_every >= 0, "output.checkpoint_every", f"must be >= 0, got {out.checkpoint_every}")
    need(out.keep_last >= 1, "output.keep_last", f"must be >= 1, got {out.keep_last}")
    for modality, adapter in config.adapters.items():
        need("type" in adapter, f"adapters.{modality}.type", "every adapter needs a 'type'")
    # The run folder is runs/<name> (or output.dir): a name with a separator, '..' or an
    # absolute path would put it anywhere. Choosing another folder is --output's job.
    need(is_folder_name(config.name), "name",
         f"must be a single folder name (no '/', '\\', '..' or absolute path), got {config.name!r}; "
         "choose a run folder elsewhere with --output")
    need(out.dir is None or is_folder_name(out.dir), "output.dir",
         f"must be a single folder name (no '/', '\\', '..' or absolute path), got {out.dir!r}; "
         "choose a run folder elsewhere with --output")


# --------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> (``["a", "b"]``, value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE (e.g. optimisation.lr=3e-4)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"--set {text!r}: empty key component in {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {error}") from None
    if isinstance(value, str) and FLOAT_LITERAL.fullmatch(value.strip()):
        value = float(value)
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``--set`` strings to a raw recipe mapping (a deep copy is returned).

    Keys are checked against the schema: an unknown section key is an error naming the
    override, whereas free-form mappings (``data.options``, ``objective.params``,
    ``adapters.<modality>``) accept new keys. List items are addressed by index.
    """
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        _check_override_path(parts, text)
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                index = _list_index(node, part, text)
                node = node[index]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: '{'.'.join(parts[: i])}' is not a mapping")
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, text)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"--set {text!r}: '{'.'.join(parts[:-1])}' is not a mapping")
    return out


def _list_index(node: list, part: str, text: str) -> int:
    try:
        index = int(part)
    except ValueError:
        raise ConfigError(f"--set {text!r}: {part!r} must be a list index") from None
    if not -len(node) <= index < len(node):
        raise ConfigError(f"--set {text!r}: index {index} out of range for a list of {len(node)}")
    return index


def _check_override_path(parts: list[str], text: str) -> None:
    """Reject keys that are not fields of the typed sections (free-form mappings excepted)."""
    cls: Any = TrainConfig
    for depth, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return  # inside a free-form mapping or list: the owning layer validates it
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            path = ".".join(parts[: depth + 1])
            raise ConfigError(f"--set {text!r}: unknown key '{path}'{did_you_mean(part, names)}; "
                              f"allowed keys here: {', '.join(names)}")
        tp = typing.get_type_hints(cls)[part]
        cls = tp if dataclasses.is_dataclass(tp) else None


# --------------------------------------------------------------------------- files


def config_from_dict(data: Mapping[str, Any], source: str = "<config>", *, adapters: bool = True) -> TrainConfig:
    """Validate a raw mapping into a :class:`TrainConfig` (``source`` names it in errors), its
    views, adapters and evaluation tasks resolved. ``adapters=False`` leaves the adapters to
    their first use (:attr:`TrainConfig.adapter_configs`), for a recipe whose encoder mmviews
    does not build (an ONNX export's: its types' code need not be installed, nor imported)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a recipe must be a YAML mapping, got {type(data).__name__}")
    config = build_section(TrainConfig, data, "", source)
    _check_values(config, source)
    _resolve(config, source, adapters)
    return config


def _refuse_duplicate_keys(node: Any, path: Path, prefix: str = "") -> None:
    """A :class:`ConfigError` naming a key that a mapping of the recipe gives twice, with both
    lines: YAML keeps the last one silently, so the first would be lost without a word."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            # a scalar key by its tag and text: 1 and '1' are two keys
            key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            line = key_node.start_mark.line + 1
            if key is not None and key in seen:
                raise ConfigError(f"{path}: key '{dotted}' is given twice, on lines {seen[key]} and {line} (YAML would "
                                  "keep the second silently): keep one")
            if key is not None:
                seen[key] = line
            _refuse_duplicate_keys(value_node, path, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{prefix}.{i}" if prefix else str(i))


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe not found: {path}")
    text = path.read_text()
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = (), *, adapters: bool = True) -> TrainConfig:
    """Read a recipe, apply ``--set`` overrides, validate. Errors name the key and the file, or
    the ``--set`` whose value is at fault (the last one that set the key or a section above it).
    ``adapters``: see :func:`config_from_dict`."""
    raw = apply_overrides(read_yaml(path), overrides)
    source = str(path) + (" (with --set overrides)" if overrides else "")
    try:
        return config_from_dict(raw, source, adapters=adapters)
    except ConfigError as error:
        named = name_the_override(error, source, overrides)
        if named is error:
            raise
        raise named from None


def name_the_override(error: ConfigError, source: str, overrides: Sequence[str]) -> ConfigError:
    """``error`` (raised with ``source``, the recipe) told as the ``--set`` that set its key, when
    one did (:func:`override_of_error`); else ``error`` itself."""
    culprit = override_of_error(str(error), overrides)
    if culprit is None or source not in str(error):
        return error
    return ConfigError(str(error).replace(source, f"--set {culprit!r}", 1))


def override_of_error(message: str, overrides: Sequence[str]) -> str | None:
    """The ``--set`` text (the last one) that set the key named in ``message`` (``key 'a.b.c'``)
    or a key above or below it; None when the key came from the recipe file."""
    found = re.search(r"key '([^']+)'", message)
    if found is None:
        return None
    key = found.group(1).split(".")
    for text in reversed(overrides):
        parts = text.split("=", 1)[0].strip().split(".")
        n = min(len(parts), len(key))
        if parts[:n] == key[:n]:
            return text
    return None


def save_config(config: TrainConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config as YAML, atomically (temp file + rename)."""
    return atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=None))


def recipe_sources() -> list[tuple[Path, str]]:
    """Folders searched for bare recipe names, in order, each with where it comes from:

    1. ``$MMVIEWS_RECIPES`` (origin ``"MMVIEWS_RECIPES"``), when set;
    2. ``./recipes`` in the current folder (``"local"``);
    3. the recipes shipped with mmviews (:func:`mmviews.resources.resource_dir`): the wheel's
       packaged copy (``"packaged"``) or, in a source checkout or editable install, the
       repository's top-level ``recipes/`` (``"checkout"``).

    A folder reached twice (``./recipes`` of the checkout itself) is listed once, first origin."""
    from mmviews.resources import resource_dir

    found: list[tuple[Path, str]] = []
    if os.environ.get("MMVIEWS_RECIPES"):
        found.append((Path(os.environ["MMVIEWS_RECIPES"]), "MMVIEWS_RECIPES"))
    found.append((Path.cwd() / "recipes", "local"))
    shipped = resource_dir("recipes")
    if shipped is not None:
        found.append(shipped)
    unique: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for folder, origin in found:
        key = folder.resolve()
        if key not in seen:
            seen.add(key)
            unique.append((folder, origin))
    return unique


def recipes_dirs() -> list[Path]:
    """The folders of :func:`recipe_sources`, in search order."""
    return [folder for folder, _ in recipe_sources()]


def recipe_origin(path: str | os.PathLike[str]) -> str:
    """Where a recipe file comes from: the origin of the :func:`recipe_sources` folder holding
    it (``"packaged"``, ``"checkout"``, ``"local"``, ``"MMVIEWS_RECIPES"``), else ``"path"``."""
    parent = Path(path).resolve().parent
    for folder, origin in recipe_sources():
        if folder.resolve() == parent:
            return origin
    return "path"


def list_recipes() -> list[Path]:
    """Every ``*.yaml`` recipe found in :func:`recipes_dirs` (first occurrence of a name wins)."""
    seen: dict[str, Path] = {}
    for d in recipes_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                seen.setdefault(p.stem, p)
    return [seen[k] for k in sorted(seen)]


def resolve_recipe(name_or_path: str | os.PathLike[str]) -> Path:
    """A recipe given as a path, or as a bare name (``quickstart``) looked up in
    :func:`recipes_dirs` (see :func:`recipe_sources` for the order)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:
        for d in recipes_dirs():
            for suffix in (".yaml", ".yml"):
                candidate = d / f"{path.name}{suffix}"
                if candidate.is_file():
                    return candidate
    names = [p.stem for p in list_recipes()]
    known = ", ".join(names) or "none found"
    raise FileNotFoundError(f"recipe {str(name_or_path)!r} not found{did_you_mean(path.stem, names)} (not a file, nor a "
                            f"name in {', '.join(map(str, recipes_dirs()))}); known recipes: {known}")
