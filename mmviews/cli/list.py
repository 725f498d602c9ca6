"""``mmviews list {objectives,recipes,datasets,augmentations,adapters,tasks}``.

``recipes`` prints one line per recipe name: the name, where the file comes from and its path.
The origins, in lookup order (the first folder holding a name wins, see
:func:`mmviews.config.recipe_sources`): ``MMVIEWS_RECIPES`` (the folder named by that
variable), ``local`` (``./recipes``), ``packaged`` (shipped inside the installed wheel) or
``checkout`` (the top-level ``recipes/`` of a source checkout / editable install). ``datasets``
prints each dataset with the path of its card (layout, splits, formats, options).

``augmentations``, ``adapters``, ``tasks`` and ``objectives`` print each entry with its
description and its parameters with their defaults, read from the registries and the
signatures (or config dataclasses) themselves, so the listing cannot drift from the code:
an augmentation's factory signature (``views: [{modality: image, augment: simclr, params:
{strength: 0.5}}]``), an adapter's config fields (``adapters: {image: {type: small_cnn,
channels: [16, 32]}}``), an evaluation task's accepted parameters with the defaults of the
function that runs it (``evaluation: {tasks: [linear:class, {kind: knn, k: 20}]}``), an
objective's constructor (``objective: {name: ipmc, params: {preset: paper}}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any, Callable, Iterable

WHAT = ["objectives", "recipes", "datasets", "augmentations", "adapters", "tasks"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=WHAT)


def _table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns, two spaces apart (the last column is not padded)."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)


def _value(value: Any) -> str:
    """A default as a user writes it in YAML (None -> null, tuples as lists)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{f.name}: {_value(getattr(value, f.name))}" for f in dataclasses.fields(value)) + "}"
    return str(value)


def signature_defaults(function: Callable[..., Any], only: Iterable[str] | None = None,
                       skip: Iterable[str] = ()) -> list[tuple[str, str]]:
    """``[(parameter, default as YAML)]`` of ``function``'s keyword parameters (``"required"``
    when it has no default), restricted to ``only`` when given."""
    wanted = None if only is None else set(only)
    out = []
    for name, parameter in inspect.signature(function).parameters.items():
        if name in ("self", *skip) or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if wanted is not None and name not in wanted:
            continue
        out.append((name, "required" if parameter.default is parameter.empty else _value(parameter.default)))
    return out


def _entries(rows: list[tuple[str, str, list[tuple[str, str]]]]) -> str:
    """``name  description`` lines, each followed by an indented ``parameter: default`` line."""
    lines = []
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, description, params in rows:
        lines.append(f"{name.ljust(width)}  {description}".rstrip())
        if params:
            lines.append("    " + ", ".join(f"{p}: {d}" for p, d in params))
    return "\n".join(lines)


def augmentation_rows() -> list[tuple[str, str, list[tuple[str, str]]]]:
    from mmviews.data.augment import _AUGMENTATIONS, list_augmentations

    return [(name, description, signature_defaults(_AUGMENTATIONS.get(name)))
            for name, description in list_augmentations().items()]


def adapter_rows() -> list[tuple[str, str, list[tuple[str, str]]]]:
    from mmviews.modalities import ENTRY_POINT_GROUP, adapter_class, list_adapters
    from mmviews.modalities.config import AdapterConfig
    from mmviews.modalities.custom import unloaded_entry_points

    common = {f.name for f in dataclasses.fields(AdapterConfig)}
    rows = []
    for type_name, description in list_adapters().items():
        config = adapter_class(type_name).config_class()
        params = [(f.name, _value(getattr(config, f.name))) for f in dataclasses.fields(config) if f.name not in common]
        rows.append((type_name, description, params))
    for type_name, target in unloaded_entry_points().items():  # imported only when a recipe names them
        rows.append((type_name, f"installed entry point {target} ({ENTRY_POINT_GROUP}), loaded when a config names it",
                     []))
    base = AdapterConfig()
    rows.append(("(every adapter)", "fields common to all types",
                 [(f.name, _value(getattr(base, f.name))) for f in dataclasses.fields(base)]))
    return rows


def task_rows() -> list[tuple[str, str, list[tuple[str, str]]]]:
    from mmviews.eval.evaluate import TASK_FUNCTIONS
    from mmviews.eval.tasks import TASK_KINDS, TASK_PARAMS, task_description

    return [(kind, task_description(kind), signature_defaults(TASK_FUNCTIONS[kind], only=TASK_PARAMS[kind]))
            for kind in TASK_KINDS]


def objective_rows() -> list[tuple[str, str, list[tuple[str, str]]]]:
    from mmviews.objectives import describe_objectives, objective_class

    # memory/speed knobs and shapes the trainer fills in are left out: they do not change the loss
    rows = []
    for name, description in describe_objectives().items():
        cls = objective_class(name)
        params = signature_defaults(cls.__init__, skip=("chunk_size", "score_budget_mb", "num_views", "dim", "dataset_size"))
        # parameters left to a preset (ipmc's ``preset``): show what each preset sets
        presets: dict[str, dict[str, Any]] = getattr(cls, "presets", {}) or {}
        default_preset = dict(params).get("preset")
        if presets and default_preset in presets:
            params = [(p, " / ".join(f"{_value(values[p])} ({preset})" for preset, values in presets.items())
                       if d == "null" and p in presets[default_preset] else d) for p, d in params]
        rows.append((name, description, params))
    return rows


def run(args: argparse.Namespace) -> int:
    # Imported by choice, so that listing recipes does not import torch.
    if args.what == "objectives":
        print(_entries(objective_rows()))
    elif args.what == "recipes":
        from mmviews.config import list_recipes, recipe_origin

        print(_table([(path.stem, recipe_origin(path), str(path)) for path in list_recipes()]))
    elif args.what == "augmentations":
        print(_entries(augmentation_rows()))
    elif args.what == "adapters":
        print(_entries(adapter_rows()))
    elif args.what == "tasks":
        print(_entries(task_rows()))
    else:
        from mmviews.data import list_datasets
        from mmviews.resources import data_card

        rows = []
        for name in list_datasets():
            card = data_card(name)
            rows.append((name, f"card: {card}" if card is not None else ""))
        print(_table(rows))
    return 0
