"""``mmviews embed RUN DATA_OR_RECIPE --output FILE``: the embeddings of every view of every
sample, written as one Parquet file (through ``datasets``).

``RUN`` is a run folder or a checkpoint folder (:func:`mmviews.run.load_run`), or a folder of
``mmviews export RUN --format onnx``, whose graphs then run with onnxruntime (float32, CPU;
no torch model code is imported on that path: :mod:`mmviews.export.onnx_runtime`). ``DATA_OR_RECIPE``
says which samples: a recipe (a YAML path or a name in ``recipes/``) whose ``data`` section is
read, or a dataset folder (a data file, for a run whose data is one, e.g. a ``.pkl``), read with
the run's own ``data`` section (``data.root`` replaced); any other file is refused as what it is.
Every split the data section names (``train_split``, ``val_split``, ``test_split``) is embedded,
with the run's evaluation views (``evaluation.views``, else one natural view per modality), un-
augmented, in dataset order, with the run's precision (``optimisation.mixed_precision``, under
``torch.autocast`` as in training and ``mmviews eval``).

One row per sample: ``split`` (the split's name as the dataset and the recipe call it:
``data.train_split``, ``data.val_split``, ``data.test_split``, e.g. ``train``, ``valid``,
``test``), ``sample_id`` (the sample's index in its split), one column per label the batches
carry (``class``, ``sentiment``, ...) and one column per view (the view names of the encoder's
batches: ``text_0``, ``audio_0``, ...) holding its unit-norm embedding as a list of ``d``
float32 values (as the encoder computes them; float64 would double the file for digits that
are not there), null where the sample lacks that modality. Read it back with ``datasets.Dataset.from_parquet(FILE)`` or
``pandas.read_parquet(FILE)``. The file is written under a temporary name and moved into place;
an existing file is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmviews.eval.extract import PRECISIONS, AutocastEncoder, extract_embeddings, precision_name
from mmviews.eval.precision import choose_precision
from mmviews.export.onnx_runtime import RECIPE_FILE, OnnxEncoder, is_onnx_folder
from mmviews.fileio import atomic_save, check_writable

if TYPE_CHECKING:
    from mmviews.data.views import ViewSpec

__all__ = ["add_arguments", "dataset_split_names", "embedding_table", "run", "write_embeddings"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or checkpoint folder")
    parser.add_argument("data", metavar="DATA_OR_RECIPE",
                        help="a recipe (YAML path or name in recipes/) whose data section to embed, or a dataset folder "
                        "read with the run's data section")
    parser.add_argument("--output", "-o", required=True, metavar="FILE", help="Parquet file to write (.parquet)")
    parser.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    parser.add_argument("--precision", choices=["run", *PRECISIONS], default="run",
                        help="autocast of the encoder's forward (default: the run's optimisation.mixed_precision)")
    parser.add_argument("--device", default=None, help="where the encoder runs (default: the run's)")
    parser.add_argument("--allow-remote-models", action="store_true",
                        help="allow adapters to build open_clip models named 'hf-hub:...' or 'local-dir:...'")


#: What a recipe file's name ends with (anything else that is a file is data, not a recipe).
RECIPE_SUFFIXES = (".yaml", ".yml")


def _data_section(spec: str, run_config: Any) -> Any:
    """The ``data`` section to embed: a dataset folder read with the run's, or a recipe's. A file
    that is not a recipe is the dataset's root when the run's data is read from a file (a
    ``.pkl``); else a ``ValueError`` saying what it is."""
    from mmviews.config import load_config, resolve_recipe

    path = Path(spec)
    data = run_config.data
    reads_a_file = data.root is not None and not Path(data.root).is_dir()
    if path.is_dir() or (path.is_file() and path.suffix.lower() not in RECIPE_SUFFIXES and reads_a_file):
        data.root = str(path)
        return data
    if path.is_file() and path.suffix.lower() not in RECIPE_SUFFIXES:
        source = (f"reads its data ({data.name!r}) from a folder" if data.root is not None
                  else f"generates its data ({data.name!r}), it reads no file")
        raise ValueError(f"{spec} is a data file ({path.suffix or 'no extension'}), not a recipe (.yaml, or a name in "
                         f"recipes/) or a dataset folder: the run {source}; give the folder that holds the data, or a "
                         "recipe whose data section reads it")
    return load_config(resolve_recipe(spec), adapters=False).data  # its data section only


def embedding_table(encoder: Any, loaders: dict[str, Any],
                    split_names: dict[str, str | None] | None = None) -> tuple[dict[str, list[Any]], list[str]]:
    """Columns ``split``, ``sample_id``, the labels and one per view (lists of floats, None
    where absent) of every loader's samples, in order; and the views' names. ``split_names``
    maps a loader's key (``train``, ``val``, ``test``) to the name its split has in the dataset
    (the ``split`` column's value); without it, the key."""
    columns: dict[str, list[Any]] = {"split": [], "sample_id": []}
    view_names: list[str] | None = None
    for key, loader in loaders.items():
        if loader is None:
            continue
        split = (split_names or {}).get(key) or key
        emb = extract_embeddings(encoder, loader, desc=f"embeddings ({split})")
        if view_names is None:
            view_names = list(emb.view_names)
            label_names = sorted(emb.labels)
            clash = set(columns) & set(label_names + view_names) or set(label_names) & set(view_names)
            if clash:
                raise ValueError(f"label or view names {sorted(clash)} clash with the columns split, sample_id "
                                 "or each other: rename them in the recipe")
            columns.update({name: [] for name in label_names + view_names})
        elif list(emb.view_names) != view_names or sorted(emb.labels) != label_names:
            raise ValueError(f"split {split!r} has views {emb.view_names} and labels {sorted(emb.labels)}; "
                             f"the first split had {view_names} and {label_names}")
        n = emb.num_samples
        columns["split"] += [split] * n
        columns["sample_id"] += (emb.index.tolist() if emb.index is not None else list(range(n)))
        for name in label_names:
            columns[name] += emb.labels[name].tolist()
        for m, name in enumerate(view_names):
            vectors, present = emb.views[:, m].tolist(), emb.mask[:, m].tolist()
            columns[name] += [v if p else None for v, p in zip(vectors, present)]
    if view_names is None:
        raise ValueError("the data section names no split to embed (train_split, val_split, test_split)")
    return columns, view_names


def _check_modalities(data_arg: str, loaders: dict[str, Any], views: ViewSpec) -> None:
    """Raise a ValueError naming ``data_arg`` and the split when a split's dataset lacks a
    modality of the run's views (known from the dataset's ``modality_info`` without reading a
    sample)."""
    needed = views.modalities
    for split, loader in loaders.items():
        dataset = getattr(loader, "dataset", None)
        if not hasattr(dataset, "modality_info"):
            continue
        has = sorted(dataset.modality_info())
        missing = [m for m in needed if m not in has]
        if missing:
            raise ValueError(f"{data_arg}: the {split} split has the modalities {has}, but the run's views read "
                             f"{list(needed)} (missing {missing}): give data with the modalities the run was "
                             "trained on")


def run(args: argparse.Namespace) -> int:
    """The command. Errors are raised; :func:`mmviews.cli.main` prints them as one line."""
    output = Path(args.output)
    if output.suffix != ".parquet":
        raise ValueError(f"--output {output}: give a .parquet file")
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"--output {output} exists: choose another file, or --overwrite to replace it")
    if not output.parent.is_dir():
        raise FileNotFoundError(f"--output {output}: folder {output.parent} does not exist")
    check_writable(output)  # before any embedding is computed
    if not Path(args.run).exists():
        raise FileNotFoundError(f"{args.run} does not exist: give a run folder, a checkpoint folder or an ONNX export")
    if is_onnx_folder(args.run):
        return _run_onnx(args, output)
    # the torch path: the model code is imported here only (the ONNX path runs without it)
    from mmviews.cli.eval import run_device
    from mmviews.data.loaders import build_eval_loaders
    from mmviews.modalities.remote import allow_remote_models
    from mmviews.run import load_run

    if args.device is not None:
        run_device(False, args.device)  # before the (slow) loading
    with allow_remote_models(args.allow_remote_models):
        encoder, config, _ = load_run(args.run)
    data = _data_section(args.data, config)
    views = config.eval_view_spec
    loaders = build_eval_loaders(data, views, config.seed)
    _check_modalities(args.data, loaders, views)  # before any work: the data must have what the views read
    precision = config.optimisation.mixed_precision if args.precision == "run" else args.precision
    if precision == "auto":  # resolved for the device the encoder runs on, as a run resolves it
        device = next((p.device.type for p in encoder.parameters()), "cpu")
        precision = choose_precision(precision, device).used
    encoder.to(run_device(config.cpu, args.device))
    columns, view_names = embedding_table(AutocastEncoder(encoder, precision), loaders, dataset_split_names(data))
    rows = write_embeddings(columns, view_names, output)
    print(f"wrote {rows} samples x {len(view_names)} views ({', '.join(view_names)}; precision {precision_name(precision)}) "
          f"to {output}")
    return 0


def dataset_split_names(data: Any) -> dict[str, str | None]:
    """The dataset's names of the splits :func:`build_eval_loaders` keys ``train``, ``val`` and
    ``test``."""
    return {"train": data.train_split, "val": data.val_split, "test": data.test_split}


def write_embeddings(columns: dict[str, list[Any]], view_names: list[str], output: Path) -> int:
    """Write :func:`embedding_table`'s columns to the Parquet file ``output`` (atomically:
    :func:`mmviews.fileio.atomic_save`), the views' vectors as float32 lists; returns the number of rows."""
    import datasets

    table = datasets.Dataset.from_dict(columns)
    features = table.features.copy()
    features.update({name: datasets.List(datasets.Value("float32")) for name in view_names})
    table = table.cast(features)
    atomic_save(output, table.to_parquet)
    return len(table)



def _run_onnx(args: argparse.Namespace, output: Path) -> int:
    """``RUN`` is a folder of ``mmviews export --format onnx``: its graphs run with onnxruntime
    on CPU, in float32, with the exported run's recipe (data section and evaluation views)."""
    from mmviews.config import load_config
    from mmviews.data.loaders import build_eval_loaders

    if args.precision not in ("run", "no"):
        raise ValueError(f"--precision {args.precision}: an ONNX export runs in float32 (give 'no' or leave it out)")
    if args.device not in (None, "cpu"):
        raise ValueError(f"--device {args.device}: an ONNX export runs on onnxruntime's CPU provider (give 'cpu')")
    encoder = OnnxEncoder(args.run)
    config = load_config(Path(args.run) / RECIPE_FILE, adapters=False)  # the graphs are the adapters
    data = _data_section(args.data, config)
    views = config.eval_view_spec
    missing = set(views.modalities) - set(encoder.adapters)
    if missing:
        reasons = "; ".join(f"{name}: {encoder.not_exported.get(name, 'not in the export')}" for name in sorted(missing))
        raise ValueError(f"{args.run}: the views need modalities {sorted(missing)} that have no ONNX graph ({reasons})")
    loaders = build_eval_loaders(data, views, config.seed)
    columns, view_names = embedding_table(encoder, loaders, dataset_split_names(data))
    rows = write_embeddings(columns, view_names, output)
    print(f"wrote {rows} samples x {len(view_names)} views ({', '.join(view_names)}; onnxruntime, float32) "
          f"to {output}")
    return 0
