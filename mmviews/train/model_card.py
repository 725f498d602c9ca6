"""The model card of a trained encoder: ``<run>/encoder/README.md``.

The encoder folder is what users share, so it describes itself in the Hugging Face model-card
layout: YAML front matter (``library_name: mmviews``, tags, and the evaluation in the
``model-index`` format), then the objective and its parameters, the views and the adapters, the
data, the evaluation against the same encoder at random initialisation, how to load it, and
the command that trains it again. :meth:`MultiViewEncoder.from_pretrained` reads
``encoder.json`` and the per-modality folders only, so the card never affects loading.

The command is rebuilt from the resolved recipe, not from ``sys.argv`` (the Python API has
none): the recipe file the run came from plus one ``--set`` per value that differs from it.
It is checked before it is written, by applying those overrides to the recipe file again;
when they cannot express the difference (a removed key), or the recipe file is gone, the card
gives the full resolved recipe to save and train from instead.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any, Mapping

import yaml

from mmviews.config import ConfigError, TrainConfig, config_from_dict, dotted_keys, load_config, read_yaml, resolve_recipe
from mmviews.fileio import atomic_write_text
from mmviews.hub import MODEL_CARD_FILE
from mmviews.resources import resource_dir

__all__ = ["MODEL_CARD_FILE", "front_matter", "render_front_matter", "render_model_card", "replace_front_matter",
           "reproduce_command", "write_model_card"]



def _yaml_inline(value: Any) -> str:
    """One-line YAML for ``--set`` values and table cells (``0.002``, ``[a, b]``, ``{k: v}``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return text[: -len("\n...")].strip() if text.endswith("\n...") else text


def _recipe_argument(source: Path) -> str:
    """How the command names the recipe: its bare name when that name resolves to this very
    file (a recipe shipped with mmviews, not shadowed by a local one), else the path as given
    (relative to the current folder when it lies below it)."""
    shipped = resource_dir("recipes")
    if shipped is not None and shipped[0].resolve() == source.resolve().parent:
        try:
            if resolve_recipe(source.stem).resolve() == source.resolve():
                return source.stem
        except FileNotFoundError:
            pass
    try:
        return str(source.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(source)


def reproduce_command(config: TrainConfig, source: str | None) -> str | None:
    """``mmviews train RECIPE --set KEY=VALUE ...`` that resolves to exactly ``config``, where
    RECIPE is the file ``source``; None when no such command exists (see the module docstring)."""
    if not source or not Path(source).is_file():
        return None
    path = Path(source)
    try:
        base = config_from_dict(read_yaml(path), str(path)).to_dict()
    except (ConfigError, FileNotFoundError):
        return None
    wanted = dotted_keys(config.to_dict())
    have = dotted_keys(base)
    if set(have) - set(wanted):
        return None  # a key of the recipe file is gone: --set cannot remove keys
    overrides = [f"{key}={_yaml_inline(value)}" for key, value in wanted.items() if key not in have or have[key] != value]
    try:
        if load_config(path, overrides).to_dict() != config.to_dict():
            return None
    except (ConfigError, ValueError):
        return None
    return " ".join(["mmviews", "train", shlex.quote(_recipe_argument(path))]
                    + [f"--set {shlex.quote(text)}" for text in overrides])


def _lower_is_better(metric: str) -> bool:
    leaf = metric.rsplit("/", 1)[-1].lower()
    return leaf in {"mae", "mse", "rmse", "loss"} or leaf.startswith("mae")


def _split_metrics(metrics: Mapping[str, Any]) -> list[tuple[str, str, float | None]]:
    """``(split, metric, value)`` for the per-split metrics (``test/linear/class/acc``); the
    probes' chosen weight decays and other split-less entries are left out."""
    out = []
    for key in sorted(metrics):
        split, _, name = key.partition("/")
        if split in ("val", "test") and name and "weight_decay" not in name:
            value = metrics[key]
            out.append((split, name, None if value is None else float(value)))
    return out


def _model_index(config: TrainConfig, metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``model-index`` entry: one result per evaluated split, its headline metrics (those
    ``mmviews train`` prints: the probes and the mean retrieval R@1, no counts or per-pair
    figures; :func:`mmviews.eval.summary.headline_metrics`) named by probe."""
    from mmviews.eval.summary import headline_metrics

    results = []
    for split in ("test", "val"):
        of_split = {k: v for k, v in metrics.items() if k.startswith(f"{split}/")}
        rows = [(h["metric"].partition("/")[2], float(h["trained"])) for h in headline_metrics(of_split, None)
                if h["trained"] is not None]
        if not rows:
            continue
        results.append({
            "task": {"type": "feature-extraction", "name": "Probes on frozen multi-view embeddings"},
            "dataset": {"name": config.data.name, "type": config.data.name,
                        "split": config.data.test_split if split == "test" else config.data.val_split},
            "metrics": [{"type": name, "value": round(value, 6), "name": f"{split} {name}"} for name, value in rows],
        })
    return [{"name": config.name, "results": results}] if results else []


# What one modality's inputs look like, per adapter type (docs/modalities.md has them all).
_EXAMPLE_INPUTS: dict[str, str] = {
    "text": '{"text": ["a first sentence", "a second one"]}',
    "audio_cnn": '{"values": waveforms, "lengths": lengths, "sample_rate": 16000}  # [B, T] float, [B] int',
    "hf_audio": '{"values": waveforms, "lengths": lengths, "sample_rate": 16000}  # [B, T] float, [B] int',
    "small_cnn": '{"values": images}  # [B, C, H, W] float',
    "open_clip": '{"values": images}  # [B, 3, H, W] float',
    "torchvision": '{"values": images}  # [B, 3, H, W] float',
    "torchvision_video": '{"values": clips}  # [B, T, 3, H, W] float in [0, 1]',
    "hf_video": '{"values": clips}  # [B, T, 3, H, W] float in [0, 1], T the model\'s num_frames',
    "flow_cnn": '{"values": flows}  # [B, T, 2, H, W] optical flow',
    "flow_clip": '{"values": flows}  # [B, T, 2, H, W] optical flow',
    "feature_sequence": '{"values": features, "lengths": lengths}  # [B, L, D] float, [B] int',
    "mlp": '{"values": features}  # [B, L, D] float',
}


def _one_modality_lines(config: TrainConfig) -> list[str]:
    """The card's lines that embed one modality alone (``encode_modality``), for the run's first
    modality, with what its adapter type takes."""
    modality, adapter = next(iter(config.adapters.items()))
    inputs = _EXAMPLE_INPUTS.get(str(adapter.get("type")), "inputs  # what its adapter takes: docs/modalities.md")
    return ["", f"# one modality alone ({', '.join(config.adapters)}): [B, d] unit vectors",
            "import torch", "", "with torch.no_grad():",
            f'    z_{modality} = encoder.encode_modality("{modality}", {inputs})']


def _cell(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def _data_left_out(summary: Mapping[str, Any]) -> list[str]:
    """Per split, the samples training and evaluation lost (``data_losses``) and the modalities
    no sample had: the same lines as the run's report.md."""
    from mmviews.data.losses import ABSENT_MODALITIES_KEY, DATA_LOSSES_KEY, loss_lines

    lines = loss_lines(summary.get(DATA_LOSSES_KEY) or {}) + list((summary.get(ABSENT_MODALITIES_KEY) or {}).values())
    return ["Data left out:", "", *(f"- {line}" for line in lines), ""] if lines else []


def front_matter(config: TrainConfig, summary: Mapping[str, Any], license: str | None = None) -> dict[str, Any]:
    """The card's YAML metadata, as the Hugging Face Hub reads it: ``library_name``, ``license``
    (when given: an identifier of the Hub's list, e.g. ``apache-2.0``, ``mit``, ``other``),
    ``datasets``, ``pipeline_tag``, ``tags`` and the evaluation as ``model-index``."""
    front: dict[str, Any] = {"library_name": "mmviews"}
    if license:
        front["license"] = license
    front["datasets"] = [config.data.name]
    front["pipeline_tag"] = "feature-extraction"
    front["tags"] = list(dict.fromkeys(["mmviews", "multi-view", "contrastive-learning", "representation-learning",
                                        config.objective.name, *config.adapters]))
    model_index = _model_index(config, summary.get("eval") or {})
    if model_index:
        front["model-index"] = model_index
    return front


def render_front_matter(front: Mapping[str, Any]) -> str:
    """``front`` as the card's first lines, between ``---`` lines."""
    return "\n".join(["---", yaml.safe_dump(dict(front), sort_keys=False, width=1000).rstrip(), "---", ""])


def replace_front_matter(card: str, front: Mapping[str, Any]) -> str:
    """``card`` (a Markdown model card) with its YAML front matter replaced by ``front`` (added
    when it has none); the rest of the text unchanged."""
    body = card
    if card.startswith("---\n"):
        end = card.find("\n---\n", 4)
        if end >= 0:
            body = card[end + len("\n---\n"):]
    return render_front_matter(front) + body


def render_model_card(config: TrainConfig, summary: Mapping[str, Any], source: str | None = None,
                      versions: Mapping[str, str] | None = None, license: str | None = None) -> str:
    """The card's text. ``summary``: the run summary (``results.json``: ``eval``,
    ``eval_random``, ``steps``, ``epochs``, ``samples_seen``, ``final_loss``...); ``source``: the
    recipe file the run was started from; ``versions``: package -> version, for the record;
    ``license``: the front matter's license (none by default: the run's owner chooses it at
    ``mmviews export``)."""
    from mmviews.eval.summary import epochs_text

    modalities = list(config.adapters)
    trained: Mapping[str, Any] = summary.get("eval") or {}
    random_init: Mapping[str, Any] = summary.get("eval_random") or {}
    embed_dim = config.encoder.get("embed_dim")
    lines = [render_front_matter(front_matter(config, summary, license)).rstrip("\n"), "", f"# {config.name}", ""]
    if config.description:
        lines += [config.description, ""]
    lines += [f"A multi-view encoder trained with mmviews: {len(modalities)} "
              f"modality adapter(s) ({', '.join(modalities)}) map every view of a sample onto one unit sphere"
              + (f" of dimension {embed_dim}" if embed_dim else "") + ".", "",
              "## Load", "",
              "```python",
              "from mmviews.modalities import MultiViewEncoder",
              "",
              'encoder = MultiViewEncoder.from_pretrained("path/to/this/folder").eval()',
              "z, mask = encoder(batch)  # batch: mmviews.data.ViewBatch; z [K, M, d] unit vectors, mask [K, M]",
              *_one_modality_lines(config),
              "```", "",
              "## Objective", "",
              f"`{config.objective.name}` (`mmviews.objectives.get_objective`)"
              + (f", with an EMA teacher (momentum {config.objective.teacher_momentum})" if config.objective.ema_teacher else "")
              + ".", ""]
    if config.objective.params:
        lines += ["| parameter | value |", "|---|---|"]
        lines += [f"| {k} | {_yaml_inline(v)} |" for k, v in config.objective.params.items()]
        lines.append("")
    lines += ["## Views and adapters", "", "| view entry | modality | augmentation | copies |", "|---|---|---|---|"]
    for i, view in enumerate(config.views):
        view = view if isinstance(view, Mapping) else {"modality": str(view)}
        lines.append(f"| {i} | {view.get('modality', '')} | {view.get('augment') or 'none (natural view)'} | "
                     f"{view.get('copies', 1)} |")
    lines += ["", "| modality | adapter | options |", "|---|---|---|"]
    for name, adapter in config.adapters.items():
        options = {k: v for k, v in adapter.items() if k != "type"}
        lines.append(f"| {name} | `{adapter.get('type')}` | `{_yaml_inline(options)}` |" if options else
                     f"| {name} | `{adapter.get('type')}` | |")
    d, o = config.data, config.optimisation
    lines += ["", "## Data", "",
              f"- dataset: `{d.name}`" + (f" from `{d.root}`" if d.root else " (generated, no files)")
              + (f", options `{_yaml_inline(d.options)}`" if d.options else ""),
              f"- splits: train `{d.train_split}`, validation `{d.val_split}`, test `{d.test_split}`"
              + (f"; per split `{_yaml_inline(d.split_options)}`" if d.split_options else ""),
              f"- training: {summary.get('steps')} optimiser steps, {epochs_text(summary)}, "
              f"{summary.get('samples_seen')} samples seen, global batch {d.batch_size}, {o.optimizer} "
              f"(lr {o.lr:g}, weight decay {o.weight_decay:g}, {o.schedule} schedule), seed {config.seed}; "
              f"final training loss {_cell(summary.get('final_loss'))}", "",
              *_data_left_out(summary),
              "## Evaluation", ""]
    rows = _split_metrics(trained)
    if rows:
        lines += [f"Probes on the frozen embeddings (`{_yaml_inline(config.evaluation.tasks)}`, views fused by "
                  f"{config.evaluation.fuse}), for this encoder and for the same encoder as randomly initialised "
                  "(before any training step).", "",
                  "| split | metric | trained | random init | trained - random |", "|---|---|---|---|---|"]
        for split, name, value in rows:
            r = random_init.get(f"{split}/{name}")
            diff = "" if r is None or value is None else f"{value - r:+.4f}" + (" (lower is better)" if _lower_is_better(name) else "")
            lines.append(f"| {split} | {name} | {_cell(value)} | {_cell(None if r is None else float(r))} | {diff} |")
        lines.append("")
    else:
        lines += ["No evaluation was run (the recipe's `evaluation.tasks` is empty or `evaluation.at_end` is false).", ""]
    command = reproduce_command(config, source)
    lines += ["## Reproduce", ""]
    if command is not None:
        lines += ["```bash", command, "```", ""]
    else:
        lines += ["Save the recipe below as `recipe.yaml`, then:", "", "```bash", "mmviews train recipe.yaml", "```", ""]
    if versions:
        lines += ["Trained with " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", ""]
    lines += ["<details><summary>The resolved recipe</summary>", "", "```yaml",
              yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=None).rstrip(), "```", "",
              "</details>", ""]
    return "\n".join(lines)


def write_model_card(encoder_dir: str | Path, config: TrainConfig, summary: Mapping[str, Any],
                     source: str | None = None) -> Path:
    """Write ``encoder_dir/README.md`` (atomically) and return its path."""
    import torch

    from mmviews import __version__

    versions = {"mmviews": __version__, "torch": torch.__version__}
    return atomic_write_text(Path(encoder_dir) / MODEL_CARD_FILE, render_model_card(config, summary, source, versions))
