"""``mmviews export RUN --format onnx``: each adapter of a trained encoder as an ONNX graph, with
a manifest of its inputs and of the preprocessing that stays outside the graph.

So that a trained encoder runs where neither torch nor mmviews' adapters are installed: each
graph is the adapter's own tokenizer-free ``preprocess``, ``encode`` and ``project``, traced with
dynamic batch (and sequence or image) axes, and :mod:`mmviews.export.onnx_runtime` does the rest
with numpy and ``tokenizers``. The exporter is chosen per adapter type (the TorchScript tracer,
or the dynamo exporter where the tracer cannot follow the model); a type without an export is
named in the manifest with the reason. Each adapter's graph inputs, what stays outside and which
exporter: ``docs/export.md`` ("ONNX").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from mmviews.export.onnx_runtime import FORMAT, MANIFEST_FILE, RECIPE_FILE, VERSION

OPSET = 17  # the TorchScript tracer's
DYNAMO_OPSET = 18  # the lowest the dynamo exporter writes

__all__ = ["GraphSpec", "NotExportable", "export_adapter", "export_onnx", "graph_spec"]


class NotExportable(Exception):
    """An adapter that has no ONNX graph; the message says why."""


@dataclass
class GraphSpec:
    """What the graph of one adapter takes: ``inputs`` (name -> example tensor, in the order of
    the graph's inputs), the dynamic axes of each, the non-tensor inputs fixed at tracing
    (``constants``: a waveform's sample rate) and the manifest's ``preprocessing`` entry."""

    inputs: dict[str, torch.Tensor]
    dynamic_axes: dict[str, dict[int, str]]
    constants: dict[str, Any] = field(default_factory=dict)
    preprocessing: dict[str, Any] = field(default_factory=dict)
    dynamo: bool = False  # torch.export (the dynamo exporter) instead of the TorchScript tracer


class AdapterGraph(nn.Module):
    """The traced function: named input tensors (plus constants) -> ``[rows, embed_dim]`` unit
    vectors, through the adapter's ``preprocess``, ``encode`` and ``project``."""

    def __init__(self, adapter: nn.Module, names: list[str], constants: dict[str, Any]) -> None:
        super().__init__()
        self.adapter, self.names, self.constants = adapter, names, constants

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        inputs = {**dict(zip(self.names, tensors)), **self.constants}
        adapter = self.adapter
        return adapter.project(adapter.encode(adapter.preprocess(inputs)))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _text_spec(adapter: Any) -> GraphSpec:
    ids, mask = adapter.host_preprocessor().tokens(["a b", "a b c d e"])  # padding rows: traced as they come
    return GraphSpec({"input_ids": ids, "attention_mask": mask},
                     {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}},
                     preprocessing={"tokenizer": "tokenizer/tokenizer.json", "max_length": adapter.config.max_length,
                                    "padding_side": adapter.tokenizer.padding_side,
                                    "pad_token_id": int(adapter.tokenizer.pad_token_id or 0)})


def _waveform_spec(adapter: Any) -> GraphSpec:
    rate = int(getattr(adapter, "sample_rate", None) or adapter.config.sample_rate)
    min_samples = int(getattr(adapter, "min_samples", 1))
    samples = max(2 * min_samples, rate // 4)
    values = torch.randn(2, samples, generator=_generator()) * 0.1
    # audio_cnn through torch.export: its log-mel front end is torch.stft, whose complex
    # tensors the tracer cannot export
    return GraphSpec({"values": values, "lengths": torch.tensor([samples, samples * 3 // 4])},
                     {"values": {0: "batch", 1: "samples"}, "lengths": {0: "batch"}},
                     constants={"sample_rate": rate},
                     preprocessing={"sample_rate": rate, "min_samples": min_samples},
                     dynamo=adapter.config.type == "audio_cnn")


def _images_spec(channels: int, size: tuple[int, int] | None) -> GraphSpec:
    """Images ``[frames, C, H, W]``; a fixed ``size`` for a ViT, any size for a CNN."""
    h, w = size or (32, 32)
    axes = {0: "frames"} if size else {0: "frames", 2: "height", 3: "width"}
    values = torch.rand(2, channels, h, w, generator=_generator())
    return GraphSpec({"values": values}, {"values": axes},
                     preprocessing={"channels": channels, "image_size": list(size) if size else None,
                                    "frames_per_row": 1, "clips": "per-frame"})


def _open_clip_spec(adapter: Any) -> GraphSpec:
    return _images_spec(3, tuple(adapter.image_size))


def _small_cnn_spec(adapter: Any) -> GraphSpec:
    return _images_spec(adapter.config.in_channels, None)


def _flow_spec(group: int, size: tuple[int, int] | None, clips: str) -> GraphSpec:
    """Flow ``[rows, group, 2, H, W]``: ``group`` consecutive flows per row."""
    h, w = size or (32, 32)
    axes = {0: "rows"} if size else {0: "rows", 3: "height", 4: "width"}
    values = torch.randn(2, group, 2, h, w, generator=_generator()) * 3
    return GraphSpec({"values": values}, {"values": axes},
                     preprocessing={"channels": 2, "image_size": list(size) if size else None,
                                    "frames_per_row": group, "clips": clips})


def _flow_cnn_spec(adapter: Any) -> GraphSpec:
    if adapter.config.temporal == "stack":  # the T flows are the channels of one input: T is fixed
        return _flow_spec(int(adapter.config.num_flows), None, "whole")
    return _flow_spec(1, None, "per-frame")


def _flow_clip_spec(adapter: Any) -> GraphSpec:
    return _flow_spec(int(adapter.config.stacked_flows), tuple(adapter.image_size), "per-frame")


def _video_spec(adapter: Any) -> GraphSpec:
    """Whole clips ``[batch, T, 3, S, S]`` at the adapter's frame size; T fixed (the model's own)
    unless the backbone's graph takes any (torchvision's video ResNets and S3D, from their
    smallest clip on)."""
    side = int(adapter.config.image_size)
    any_frames = adapter.exact_frames is None and getattr(adapter, "any_frames_in_onnx", False)
    frames = adapter.exact_frames or max(adapter.min_frames, 2)
    values = torch.rand(2, frames, 3, side, side, generator=_generator())
    return GraphSpec({"values": values}, {"values": {0: "batch", 1: "frames"} if any_frames else {0: "batch"}},
                     preprocessing={"channels": 3, "image_size": [side, side], "frames": None if any_frames else frames,
                                    "min_frames": int(adapter.min_frames), "clips": "video"})


def _sequence_spec(adapter: Any) -> GraphSpec:
    values = torch.randn(2, 5, adapter.config.input_dim, generator=_generator())
    # torch.export: the tracer fixes the batch size in nn.MultiheadAttention's reshapes
    return GraphSpec({"values": values, "lengths": torch.tensor([5, 3])},
                     {"values": {0: "batch", 1: "length"}, "lengths": {0: "batch"}},
                     preprocessing={"input_dim": adapter.config.input_dim}, dynamo=True)


def _mlp_spec(adapter: Any) -> GraphSpec:
    values = torch.randn(2, 3, adapter.config.input_dim, generator=_generator())
    return GraphSpec({"values": values}, {"values": {0: "batch", 1: "length"}},
                     preprocessing={"input_dim": adapter.config.input_dim})


_SPECS: dict[str, Callable[[Any], GraphSpec]] = {
    "text": _text_spec, "hf_audio": _waveform_spec, "audio_cnn": _waveform_spec, "open_clip": _open_clip_spec,
    "small_cnn": _small_cnn_spec, "torchvision_video": _video_spec, "hf_video": _video_spec,
    "flow_cnn": _flow_cnn_spec, "flow_clip": _flow_clip_spec, "feature_sequence": _sequence_spec, "mlp": _mlp_spec,
}
def graph_spec(adapter: Any) -> GraphSpec:
    """The :class:`GraphSpec` of ``adapter``; :class:`NotExportable` naming the reason."""
    kind = adapter.config.type
    if kind not in _SPECS:  # an adapter type registered outside mmviews
        raise NotExportable(f"no ONNX export is defined for adapter type {kind!r}")
    return _SPECS[kind](adapter)


def export_adapter(adapter: nn.Module, folder: Path) -> dict[str, Any]:
    """Trace ``adapter`` (in eval mode) to ``folder/model.onnx`` (with the tokenizer of a text
    adapter in ``folder/tokenizer``); returns its manifest entry, paths relative to ``folder``."""
    spec = graph_spec(adapter)
    path = folder / "model.onnx"
    adapter.eval()
    names = list(spec.inputs)
    graph = AdapterGraph(adapter, names, spec.constants).eval()
    # The tracer warns about every Python-level shape check of preprocess (constants in the graph:
    # the value checks of the runtime repeat them) and prints its diagnostics: kept quiet. Not
    # under no_grad: there, attention layers take torch's fused fast path, which has no ONNX form.
    args = tuple(spec.inputs[n] for n in names)
    opset = DYNAMO_OPSET if spec.dynamo else OPSET
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if spec.dynamo:
            dims = {axis: torch.export.Dim(axis) for axes in spec.dynamic_axes.values() for axis in axes.values()}
            shapes = tuple({i: dims[axis] for i, axis in spec.dynamic_axes.get(n, {}).items()} for n in names)
            torch.onnx.export(graph, args, str(path), input_names=names, output_names=["embedding"],
                              dynamic_shapes=(shapes,), opset_version=opset, dynamo=True, verbose=False)
        else:
            torch.onnx.export(graph, args, str(path), input_names=names, output_names=["embedding"],
                              dynamic_axes={**spec.dynamic_axes, "embedding": {0: "rows"}}, opset_version=opset,
                              dynamo=False)
    if adapter.config.type == "text":
        adapter.tokenizer.save_pretrained(folder / "tokenizer")
    return {
        "type": adapter.config.type,
        "graph": path.name,
        "inputs": [{"name": n, "dtype": str(spec.inputs[n].dtype).removeprefix("torch."),
                    "shape": [spec.dynamic_axes.get(n, {}).get(i, size) for i, size in enumerate(spec.inputs[n].shape)]}
                   for n in names],
        "output": {"name": "embedding", "shape": ["rows", int(adapter.config.embed_dim)]},
        "embed_dim": int(adapter.config.embed_dim),
        "exporter": "dynamo" if spec.dynamo else "torchscript",
        "opset": opset,
        "preprocessing": spec.preprocessing,
    }


def export_onnx(run: str | os.PathLike[str], output: str | os.PathLike[str]) -> tuple[Path, dict[str, str]]:
    """Write the ONNX folder of ``run`` (a run or checkpoint folder) to ``output`` (a new
    folder): per modality ``<modality>/model.onnx`` (and ``tokenizer/`` for text),
    ``onnx_manifest.json`` and the run's ``config.yaml`` (its data and views, for ``mmviews
    embed``). Returns the folder and the modalities not exported, with the reason."""
    from mmviews.config import save_config
    from mmviews.export.hf import export_space, finish_output_folder, prepare_output_folder
    from mmviews.fileio import atomic_write_text
    from mmviews.run import load_trained_encoder

    output = Path(output)
    encoder, config = load_trained_encoder(run)
    tmp = prepare_output_folder(output)
    try:
        with export_space(output, tmp, encoder):
            modalities: dict[str, Any] = {}
            skipped: dict[str, str] = {}
            for name, adapter in encoder.adapters.items():
                folder = tmp / name
                folder.mkdir()
                try:
                    entry = export_adapter(adapter, folder)
                except NotExportable as reason:
                    folder.rmdir()
                    skipped[name] = str(reason)
                    continue
                entry["graph"] = f"{name}/{entry['graph']}"  # relative to the export folder
                if "tokenizer" in entry["preprocessing"]:
                    entry["preprocessing"]["tokenizer"] = f"{name}/{entry['preprocessing']['tokenizer']}"
                modalities[name] = entry
            if not modalities:
                raise ValueError(f"{run}: no adapter of the encoder can be exported to ONNX: "
                                 + "; ".join(f"{n}: {r}" for n, r in skipped.items()))
            save_config(config, tmp / RECIPE_FILE)
            manifest = {"format": FORMAT, "version": VERSION, "torch": torch.__version__,
                        "recipe": RECIPE_FILE, "modalities": modalities, "not_exported": skipped}
            atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2))
            return finish_output_folder(tmp, output), skipped
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
