"""The experiment trackers of a run (``output.trackers``: TensorBoard, MLflow, Weights & Biases
and the rest of Accelerate's): which are installed, where each writes in the run folder, the run
ids a resumed run reopens, and each tracker's spelling of metric names."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

from mmviews.config import ConfigError, TrainConfig
from mmviews.fileio import atomic_write_text, read_json_object
from mmviews.notices import MMViewsWarning


# Accelerate tracker name -> the modules any one of which makes it usable (Accelerate's own
# availability test silently drops a tracker whose package is missing; we refuse instead).
_TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"), "aim": ("aim",), "mlflow": ("mlflow",), "wandb": ("wandb",),
    "comet_ml": ("comet_ml",), "clearml": ("clearml",), "dvclive": ("dvclive",), "swanlab": ("swanlab",),
    "trackio": ("trackio",),
}
#: Sub-folder of the run folder given to Accelerate as ``logging_dir``; file-based trackers
#: write under ``<run>/logs/<recipe name>/`` (TensorBoard's event files).
TRACKERS_DIR = "logs"
#: In ``<run>/logs/``: the run id each tracker gave this run (``{"mlflow": ..., "wandb": ...}``),
#: read on resume so that a resumed run goes on logging into the same tracker run.
TRACKER_RUNS_FILE = "tracker_runs.json"
#: Where MLflow writes unless ``MLFLOW_TRACKING_URI`` names a server or database: a SQLite store
#: in ``<run>/logs/`` (MLflow's recommended local backend; its file store is in maintenance mode
#: since MLflow 3), opened with ``mlflow ui --backend-store-uri sqlite:///<run>/logs/mlflow.db``,
#: and the artifacts (the report, its plots) beside it in :data:`MLFLOW_ARTIFACTS_DIR`.
MLFLOW_DB_FILE = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlartifacts"
#: The file store of runs written before the SQLite store: a resumed one keeps logging there.
MLFLOW_STORE_DIR = "mlruns"
# The tracking URIs tracker_init_kwargs set in this process (run folders' own stores).
_RUN_STORES: set[str] = set()
# MLflow metric and parameter names: letters, digits and ``_ - . / : space`` (no ``@``).
_MLFLOW_NAME_REFUSED = re.compile(r"[^\w\-./: ]")


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def tracker_installed(name: str) -> bool:
    """Whether the package of Accelerate tracker ``name`` can be imported."""
    return any(importlib.util.find_spec(module) is not None for module in _TRACKER_MODULES[name])


def check_trackers_installed(config: TrainConfig, source: str = "recipe") -> None:
    """A :class:`ConfigError` naming the key ``output.trackers`` and what to ``pip install``
    for the first tracker there whose package is missing (``mmviews train --check`` and the
    command itself call this before building anything, :func:`resolve_trackers` again)."""
    for name in dict.fromkeys(config.output.trackers):
        if not tracker_installed(name):
            extra = (f"pip install 'mmviews[{name}]'" if name in ("tensorboard", "mlflow", "wandb")
                     else f"pip install {name}")
            raise ConfigError(f"{source}: key 'output.trackers': tracker {name!r} is not installed ({extra}); "
                              "metrics.csv is always written, remove the tracker to train without it")


def resolve_trackers(config: TrainConfig, source: str = "recipe") -> list[str]:
    """The Accelerate trackers of a run (``log_with=``): ``output.trackers`` in order, without
    repeats; a tracker whose package is missing is a :class:`ConfigError` naming the key
    (:func:`check_trackers_installed`). The deprecated ``output.tensorboard: true`` adds
    TensorBoard when it is installed and is skipped with a warning otherwise (its old meaning),
    either way with a warning to move to ``trackers``."""
    check_trackers_installed(config, source)
    names = list(dict.fromkeys(config.output.trackers))
    if config.output.tensorboard:
        if tensorboard_available():
            names = list(dict.fromkeys([*names, "tensorboard"]))
        else:
            warnings.warn(f"{source}: output.tensorboard is true but TensorBoard is not installed; logging to "
                          "metrics.csv only", MMViewsWarning, stacklevel=2)
        warnings.warn(f"{source}: key 'output.tensorboard' is deprecated, use 'output.trackers: [tensorboard]'",
                      FutureWarning, stacklevel=2)
    return names


def flat_hparams(config: TrainConfig) -> dict[str, Any]:
    """The recipe as ``{"optimisation.lr": 0.001, ...}`` (scalars only), for the trackers'
    hyper-parameter tables."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, (int, float, str, bool)):
            out[prefix] = value

    walk("", config.to_dict())
    return out


def tracker_init_kwargs(trackers: Sequence[str], run_dir: Path, resumed: bool) -> dict[str, dict[str, Any]]:
    """Accelerate's ``init_kwargs`` for the run's trackers: MLflow and W&B write under
    ``<run>/logs/`` (MLflow: a SQLite store there, :func:`mlflow_store_uri`, unless
    ``MLFLOW_TRACKING_URI`` names another store or a server; W&B: its
    ``wandb/`` folder, online or offline as ``WANDB_MODE`` says), and a resumed run reopens the
    tracker runs recorded in :data:`TRACKER_RUNS_FILE` when it started."""
    logs = run_dir / TRACKERS_DIR
    previous: dict[str, Any] = {}
    if resumed and (logs / TRACKER_RUNS_FILE).is_file():
        previous = read_json_object(logs / TRACKER_RUNS_FILE)
    kwargs: dict[str, dict[str, Any]] = {}
    if "mlflow" in trackers:
        kwargs["mlflow"] = {"run_id": previous["mlflow"]} if previous.get("mlflow") else {}
        # MLflow's set_tracking_uri also sets the variable: a value this module set is a run's own
        # store, not the user's choice (a second run in the same process gets its own store)
        quiet_mlflow_store_logs()
        if os.environ.get("MLFLOW_TRACKING_URI", "") in _RUN_STORES | {""}:
            import mlflow

            if resumed and (logs / MLFLOW_STORE_DIR).is_dir() and not (logs / MLFLOW_DB_FILE).is_file():
                # a run started with the file store goes on in it (MLflow 3 keeps it behind this switch)
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                uri = (logs / MLFLOW_STORE_DIR).resolve().as_uri()
            else:
                logs.mkdir(parents=True, exist_ok=True)
                uri = mlflow_store_uri(run_dir)
                # the experiment's artifact root (MLflow's own default is ./mlruns in the current folder)
                kwargs["mlflow"]["logging_dir"] = (logs / MLFLOW_ARTIFACTS_DIR).resolve().as_uri()
            _RUN_STORES.add(uri)
            mlflow.set_tracking_uri(uri)
    if "wandb" in trackers:
        logs.mkdir(parents=True, exist_ok=True)
        kwargs["wandb"] = {"dir": str(logs)}
        if previous.get("wandb"):
            kwargs["wandb"].update(id=previous["wandb"], resume="allow")
    return kwargs


#: MLflow's loggers that describe its store's machinery at INFO ("Creating initial MLflow database
#: tables...", "Updating database tables", alembic's migrations) on stderr when a store is made.
MLFLOW_STORE_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration")


def quiet_mlflow_store_logs() -> None:
    """MLflow's INFO lines about creating its SQLite store off (its warnings stay), unless the
    user sets ``MLFLOW_LOGGING_LEVEL`` (``mmviews COMMAND --debug`` sets it to INFO): the run
    folder's ``logs/`` says where the run went."""
    if os.environ.get("MLFLOW_LOGGING_LEVEL"):
        return
    for name in MLFLOW_STORE_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def mlflow_store_uri(run_dir: Path) -> str:
    """The tracking URI of a run's own MLflow store: ``sqlite:///<absolute run>/logs/mlflow.db``
    (what ``mlflow ui --backend-store-uri`` and ``MlflowClient(tracking_uri=...)`` take)."""
    return f"sqlite:///{(Path(run_dir) / TRACKERS_DIR / MLFLOW_DB_FILE).resolve()}"


def record_tracker_runs(accelerator: Any, trackers: Sequence[str], run_dir: Path) -> None:
    """Write :data:`TRACKER_RUNS_FILE`: the run id of the MLflow and W&B runs (main process)."""
    ids: dict[str, str] = {}
    if "mlflow" in trackers:
        ids["mlflow"] = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    if "wandb" in trackers:
        ids["wandb"] = accelerator.get_tracker("wandb", unwrap=True).id
    if ids:
        atomic_write_text(run_dir / TRACKERS_DIR / TRACKER_RUNS_FILE, json.dumps(ids, indent=2))


def tracker_metric_name(tracker: str, name: str) -> str:
    """``name`` as ``tracker`` accepts it: MLflow refuses some characters, so a retrieval pair's
    arrow is spelled out and ``@`` too (``text->image/R@1`` -> ``text_to_image/R_at_1``); any
    other refused character becomes ``_``."""
    if tracker == "mlflow":
        return _MLFLOW_NAME_REFUSED.sub("_", name.replace("->", "_to_").replace("@", "_at_"))
    return name
