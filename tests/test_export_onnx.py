"""The ONNX exporter (:mod:`mmviews.export.onnx`) on tiny adapters, without the slow exports of
whole encoders: what each adapter type's graph takes (its example inputs, dynamic axes, constants,
the manifest's preprocessing entry and the exporter used), a type without an export named with
the reason, one adapter's manifest entry and graph (other batch sizes and lengths through
onnxruntime give the adapter's embeddings), and ``export_onnx``'s folder: the manifest, the
recipe, the adapters left out, and nothing left behind when no adapter can be exported.
(Every adapter type of real runs exported and embedded against the torch encoder, and the dynamo
exporter's sequence graph quiet, at opset 18 with its dynamic dimensions: test_export.py, whose
runs export it once; each dynamo export costs ~15 CPU-s.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import mmviews.export.onnx as onnx_export  # noqa: E402
from mmviews.export.onnx import NotExportable, export_adapter, export_onnx, graph_spec  # noqa: E402
from mmviews.modalities.base import build_adapter  # noqa: E402
from mmviews.modalities.presets import tiny_config as adapter_config  # noqa: E402

IMAGE_PREPROCESSING = {"channels": 3, "image_size": None, "frames_per_row": 1, "clips": "per-frame"}

# adapter type (and its config's overrides) -> the graph's inputs (name -> shape), dynamic axes,
# constants, the manifest's preprocessing and whether the dynamo exporter is used
SPECS: dict[str, tuple[dict[str, Any], dict, dict, dict, dict, bool]] = {
    "mlp": ({"input_dim": 4, "hidden_dim": 8}, {"values": (2, 3, 4)}, {"values": {0: "batch", 1: "length"}}, {},
            {"input_dim": 4}, False),
    "small_cnn": ({"in_channels": 1}, {"values": (2, 1, 32, 32)}, {"values": {0: "frames", 2: "height", 3: "width"}},
                  {}, {**IMAGE_PREPROCESSING, "channels": 1}, False),
    "flow_cnn": ({}, {"values": (2, 1, 2, 32, 32)}, {"values": {0: "rows", 3: "height", 4: "width"}}, {},
                 {**IMAGE_PREPROCESSING, "channels": 2}, False),
    # the stacked flows are one input's channels: the group is fixed, a clip goes in whole
    "flow_cnn-stack": ({"temporal": "stack", "num_flows": 3}, {"values": (2, 3, 2, 32, 32)},
                       {"values": {0: "rows", 3: "height", 4: "width"}}, {},
                       {**IMAGE_PREPROCESSING, "channels": 2, "frames_per_row": 3, "clips": "whole"}, False),
    "flow_clip": ({"stacked_flows": 2}, {"values": (2, 2, 2, 32, 32)}, {"values": {0: "rows"}}, {},
                  {**IMAGE_PREPROCESSING, "channels": 2, "image_size": [32, 32], "frames_per_row": 2}, False),
    "open_clip": ({}, {"values": (2, 3, 32, 32)}, {"values": {0: "frames"}}, {},
                  {**IMAGE_PREPROCESSING, "image_size": [32, 32]}, False),
    "feature_sequence": ({"input_dim": 5}, {"values": (2, 5, 5), "lengths": (2,)},
                         {"values": {0: "batch", 1: "length"}, "lengths": {0: "batch"}}, {}, {"input_dim": 5}, True),
    # a quarter of a second of audio, longer than the adapter's shortest input
    "audio_cnn": ({}, {"values": (2, 4000), "lengths": (2,)},
                  {"values": {0: "batch", 1: "samples"}, "lengths": {0: "batch"}}, {"sample_rate": 16000},
                  {"sample_rate": 16000, "min_samples": 1}, True),
    "hf_audio": ({}, {"values": (2, 4000), "lengths": (2,)},
                 {"values": {0: "batch", 1: "samples"}, "lengths": {0: "batch"}}, {"sample_rate": 16000},
                 {"sample_rate": 16000, "min_samples": 45}, False),
    # whole clips: MC3-18's graph takes any number of frames (traced on 2, its smallest being 1);
    # VideoMAE's exactly its config's 4 (its position embeddings), the frame size fixed by both
    "torchvision_video": ({}, {"values": (2, 2, 3, 16, 16)}, {"values": {0: "batch", 1: "frames"}}, {},
                          {"channels": 3, "image_size": [16, 16], "frames": None, "min_frames": 1, "clips": "video"},
                          False),
    # Video Swin takes clips of any length in torch, but its traced graph fixes T (its windows)
    "torchvision_video-swin": ({"model": "swin3d_t", "image_size": 32}, {"values": (2, 2, 3, 32, 32)},
                               {"values": {0: "batch"}}, {},
                               {"channels": 3, "image_size": [32, 32], "frames": 2, "min_frames": 1, "clips": "video"},
                               False),
    "hf_video": ({}, {"values": (2, 4, 3, 32, 32)}, {"values": {0: "batch"}}, {},
                 {"channels": 3, "image_size": [32, 32], "frames": 4, "min_frames": 4, "clips": "video"}, False),
}


def tiny_adapter(kind: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return build_adapter({"type": "mlp", "embed_dim": 8, **overrides})
    return build_adapter(adapter_config(kind, **overrides))


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_adapter_types_graph_takes_its_inputs_with_their_dynamic_axes(kind: str) -> None:
    overrides, shapes, axes, constants, preprocessing, dynamo = SPECS[kind]
    spec = graph_spec(tiny_adapter(kind.partition("-")[0], **overrides))
    assert {name: tuple(t.shape) for name, t in spec.inputs.items()} == shapes
    assert list(spec.inputs) == list(shapes)  # the graph's input order
    assert spec.dynamic_axes == axes and spec.constants == constants and spec.preprocessing == preprocessing
    assert spec.dynamo is dynamo
    if "lengths" in spec.inputs:  # one full row, one shorter: the tracer sees a padded batch
        full = shapes["values"][1]
        assert spec.inputs["lengths"].tolist() == [full, full * 3 // 4 if "samples" in axes["values"].values() else 3]
    # the examples come from a generator of their own: the same at every export, and torch's global
    # generator (a caller's seeded stream) is not moved by them
    adapter = tiny_adapter(kind.partition("-")[0], **overrides)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    again = graph_spec(adapter)
    assert all(torch.equal(again.inputs[name], spec.inputs[name]) for name in shapes)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_short_sample_rate_traces_twice_the_shortest_input() -> None:
    """A quarter second shorter than what the adapter needs twice: the example is twice its minimum."""
    adapter = tiny_adapter("hf_audio")
    adapter.sample_rate = 100  # 25 samples a quarter second, under 2 x 45
    spec = graph_spec(adapter)
    assert tuple(spec.inputs["values"].shape) == (2, 90) and spec.inputs["lengths"].tolist() == [90, 67]
    assert spec.constants == {"sample_rate": 100} and spec.preprocessing == {"sample_rate": 100, "min_samples": 45}


def test_waveform_examples_are_audio_sized_and_flow_examples_flow_sized() -> None:
    """The traced examples lie where real inputs do (waveforms within [-1, 1], optical flow in
    pixels, images in [0, 1]): a check a preprocess makes on its values passes while tracing."""
    waves = graph_spec(tiny_adapter("hf_audio")).inputs["values"]
    assert 0.05 < float(waves.std()) < 0.2 and float(waves.abs().max()) < 1
    flow = graph_spec(tiny_adapter("flow_cnn")).inputs["values"]
    assert 2.5 < float(flow.std()) < 3.5
    images = graph_spec(tiny_adapter("small_cnn")).inputs["values"]
    assert 0 <= float(images.min()) and float(images.max()) <= 1 and float(images.std()) > 0.2


def test_the_text_graph_takes_token_ids_and_the_tokenizer_stays_outside() -> None:
    adapter = tiny_adapter("text")
    spec = graph_spec(adapter)
    ids, mask = adapter.host_preprocessor().tokens(["a b", "a b c d e"])
    assert torch.equal(spec.inputs["input_ids"], ids) and torch.equal(spec.inputs["attention_mask"], mask)
    assert int(mask[0].sum()) < int(mask[1].sum())  # a padded row: traced as they come
    assert spec.dynamic_axes == {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}}
    assert spec.preprocessing == {"tokenizer": "tokenizer/tokenizer.json", "max_length": adapter.config.max_length,
                                  "padding_side": "right", "pad_token_id": adapter.tokenizer.pad_token_id}
    assert not spec.dynamo and spec.constants == {}
    adapter.tokenizer.pad_token = adapter.tokenizer.unk_token  # a tokenizer whose padding id is not 0
    assert adapter.tokenizer.pad_token_id != 0
    assert graph_spec(adapter).preprocessing["pad_token_id"] == adapter.tokenizer.pad_token_id


def test_a_type_without_an_export_is_named() -> None:
    adapter = tiny_adapter("mlp", input_dim=2)
    adapter.config.type = "my_adapter"  # as a type registered outside mmviews
    with pytest.raises(NotExportable, match=r"^no ONNX export is defined for adapter type 'my_adapter'$"):
        graph_spec(adapter)


def run_graph(folder: Path, entry: dict[str, Any], inputs: dict[str, Any]) -> np.ndarray:
    from mmviews.export.onnx_runtime import OnnxAdapter

    return OnnxAdapter(folder, entry["type"], entry, ["CPUExecutionProvider"]).embed(inputs)


def declared_shape(value: Any) -> list[Any]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_an_mlp_graph_and_its_manifest_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    adapter = tiny_adapter("mlp", input_dim=4, hidden_dim=8).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = export_adapter(adapter, tmp_path)
    # quiet: the tracer's warnings about preprocess's shape checks and its printed diagnostics kept in
    assert [str(w.message) for w in caught] == [] and capsys.readouterr() == ("", "")
    assert not adapter.training  # traced in eval mode
    graph = onnx.load(str(tmp_path / "model.onnx"))
    assert [i.name for i in graph.graph.input] == ["values"] and declared_shape(graph.graph.input[0]) == [
        "batch", "length", 4]
    assert [o.name for o in graph.graph.output] == ["embedding"] and declared_shape(graph.graph.output[0])[0] == "rows"
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [17]
    assert entry == {
        "type": "mlp", "graph": "model.onnx",
        "inputs": [{"name": "values", "dtype": "float32", "shape": ["batch", "length", 4]}],
        "output": {"name": "embedding", "shape": ["rows", 8]}, "embed_dim": 8,
        "exporter": "torchscript", "opset": 17, "preprocessing": {"input_dim": 4}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    for batch, length in ((5, 2), (1, 7)):  # traced at 2 x 3
        values = torch.randn(batch, length, 4, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            reference = adapter({"values": values}).numpy()
        np.testing.assert_allclose(run_graph(tmp_path, entry, {"values": values}), reference, rtol=0, atol=1e-5)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A finished run of text, images and flow at random initialisation."""
    from test_export import make_run

    return make_run(tmp_path / "run", {"text": "text", "image": "small_cnn", "flow": "flow_cnn"})


def test_export_onnx_writes_each_adapter_the_manifest_and_the_recipe(run: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from mmviews.config import load_config
    from mmviews.export.onnx_runtime import OnnxEncoder
    from mmviews.run import load_trained_encoder

    monkeypatch.delitem(onnx_export._SPECS, "flow_cnn")  # as a type without an export
    reason = "no ONNX export is defined for adapter type 'flow_cnn'"
    out, skipped = export_onnx(run, tmp_path / "onnx")
    assert out == tmp_path / "onnx" and skipped == {"flow": reason}
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "image", "onnx_manifest.json", "text"]
    assert sorted(p.name for p in (out / "text").iterdir()) == ["model.onnx", "tokenizer"]
    assert (out / "text" / "tokenizer" / "tokenizer.json").is_file()
    text = (out / "onnx_manifest.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=2)  # indented for a person to read
    assert {k: manifest[k] for k in ("format", "version", "torch", "recipe", "not_exported")} == {
        "format": "mmviews-onnx", "version": 1, "torch": torch.__version__, "recipe": "config.yaml",
        "not_exported": {"flow": reason}}
    entries = manifest["modalities"]
    assert list(entries) == ["text", "image"]
    assert (entries["text"]["graph"], entries["image"]["graph"]) == ("text/model.onnx", "image/model.onnx")
    assert entries["text"]["preprocessing"]["tokenizer"] == "text/tokenizer/tokenizer.json"  # from the folder
    encoder, config = load_trained_encoder(run)
    assert load_config(out / "config.yaml").to_dict() == config.to_dict()
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = encoder.adapters["image"]({"values": images}).numpy()
    np.testing.assert_allclose(OnnxEncoder(out).adapters["image"].embed({"values": images}), reference,
                               rtol=0, atol=1e-5)


def test_an_encoder_without_an_exportable_adapter_is_refused_and_leaves_nothing(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for kind in ("text", "small_cnn", "flow_cnn"):
        monkeypatch.delitem(onnx_export._SPECS, kind)
    with pytest.raises(ValueError) as caught:
        export_onnx(run, tmp_path / "onnx")
    assert str(caught.value) == (
        f"{run}: no adapter of the encoder can be exported to ONNX: "
        + "; ".join(f"{m}: no ONNX export is defined for adapter type {k!r}"
                    for m, k in (("text", "text"), ("image", "small_cnn"), ("flow", "flow_cnn"))))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no temporary folder
