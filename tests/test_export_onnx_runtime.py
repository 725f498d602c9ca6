"""The numpy side of an ONNX export (mmviews.export.onnx_runtime), on graphs written by the test
with ``onnx.helper`` (not by the exporter), so that what the runtime does around a graph is
checked against numpy written here: a clip's frame vectors averaged and normalised again,
stacked flow groups, waveforms checked for their sample rate, length and finiteness, sequences,
the manifest's paths kept inside the export folder, and the manifest itself. (Real exports of
every adapter type against the torch encoder: test_export.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from mmviews.export import onnx_runtime  # noqa: E402
from mmviews.export.onnx_runtime import MANIFEST_FILE, OnnxEncoder, is_onnx_folder  # noqa: E402


def _save(graph: Any, path: Path) -> str:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path.name


def frame_graph(path: Path, channels: int, stacked: int | None = None) -> str:
    """values [N, C, H, W] (or [N, G, C, H, W] with ``stacked`` G) -> the unit vector of its
    per-channel means (stacked: of the group's per-channel means concatenated)."""
    if stacked is None:
        shape: list[Any] = ["n", channels, "h", "w"]
        nodes = [helper.make_node("ReduceMean", ["values"], ["m"], axes=[2, 3], keepdims=0)]
        width = channels
    else:
        shape = ["n", stacked, channels, "h", "w"]
        nodes = [helper.make_node("ReduceMean", ["values"], ["m3"], axes=[3, 4], keepdims=0),
                 helper.make_node("Flatten", ["m3"], ["m"], axis=1)]
        width = stacked * channels
    nodes.append(helper.make_node("LpNormalization", ["m"], ["z"], axis=-1, p=2))
    graph = helper.make_graph(nodes, "frames", [helper.make_tensor_value_info("values", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", width])])
    return _save(graph, path)


def wave_graph(path: Path) -> str:
    """values [B, T], lengths [B] -> unit vector of (mean of the first columns, length)."""
    nodes = [helper.make_node("ReduceMean", ["values"], ["m"], axes=[1], keepdims=1),
             helper.make_node("Cast", ["lengths"], ["lf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["lf", "axis"], ["l2"]),
             helper.make_node("Concat", ["m", "l2"], ["c"], axis=1),
             helper.make_node("LpNormalization", ["c"], ["z"], axis=-1, p=2)]
    graph = helper.make_graph(nodes, "wave", [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["b", "t"]),
                                              helper.make_tensor_value_info("lengths", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 2])],
                              initializer=[helper.make_tensor("axis", TensorProto.INT64, [1], [1])])
    return _save(graph, path)


def lengths_graph(path: Path, dim: int) -> str:
    """values [B, L, dim], lengths [B] -> unit vector of (the mean over L, the length)."""
    nodes = [helper.make_node("ReduceMean", ["values"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Cast", ["lengths"], ["lf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["lf", "axis"], ["l2"]),
             helper.make_node("Concat", ["m", "l2"], ["c"], axis=1),
             helper.make_node("LpNormalization", ["c"], ["z"], axis=-1, p=2)]
    graph = helper.make_graph(nodes, "lengths", [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["b", "l", dim]),
                                                 helper.make_tensor_value_info("lengths", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", dim + 1])],
                              initializer=[helper.make_tensor("axis", TensorProto.INT64, [1], [1])])
    return _save(graph, path)


def sequence_graph(path: Path, dim: int) -> str:
    nodes = [helper.make_node("ReduceMean", ["values"], ["m"], axes=[1], keepdims=0),
             helper.make_node("LpNormalization", ["m"], ["z"], axis=-1, p=2)]
    graph = helper.make_graph(nodes, "seq", [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["b", "l", dim])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", dim])])
    return _save(graph, path)


def text_graph(path: Path) -> str:
    """input_ids, attention_mask [B, L] -> unit vector of (sum of the kept ids, number kept, 1)."""
    nodes = [helper.make_node("Mul", ["input_ids", "attention_mask"], ["kept"]),
             helper.make_node("Cast", ["kept"], ["kf"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["attention_mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["kf", "axis"], ["s"], keepdims=1),
             helper.make_node("ReduceSum", ["mf", "axis"], ["n"], keepdims=1),
             helper.make_node("Mul", ["n", "zero"], ["n0"]),
             helper.make_node("Add", ["n0", "one"], ["ones"]),  # [B, 1] of ones
             helper.make_node("Concat", ["s", "n", "ones"], ["c"], axis=1),
             helper.make_node("LpNormalization", ["c"], ["z"], axis=-1, p=2)]
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "l"]) for n in ("input_ids", "attention_mask")]
    graph = helper.make_graph(nodes, "text", ints, [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 3])],
                              initializer=[helper.make_tensor("axis", TensorProto.INT64, [1], [1]),
                                           helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
                                           helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return _save(graph, path)


VOCAB = {"[PAD]": 0, "[UNK]": 1, "red": 2, "green": 3, "blue": 4, "sky": 5}


def word_tokenizer(path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path.name


def text_vector(ids: list[int]) -> np.ndarray:
    return unit(np.array([sum(ids), len(ids), 1.0]))


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def clip_graph(path: Path) -> str:
    """values [B, T, 3, H, W] -> the unit vector of its per-channel means over the whole clip (a
    spatiotemporal graph: one vector per clip, not per frame)."""
    nodes = [helper.make_node("ReduceMean", ["values"], ["m"], axes=[1, 3, 4], keepdims=0),
             helper.make_node("LpNormalization", ["m"], ["z"], axis=-1, p=2)]
    graph = helper.make_graph(nodes, "clips", [helper.make_tensor_value_info("values", TensorProto.FLOAT,
                                                                             ["b", "t", 3, "h", "w"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 3])])
    return _save(graph, path)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    """Whole-clip graphs as the spatiotemporal adapters export them: one that takes any number of
    frames from 2 on (torchvision_video), one exactly 4 (hf_video), one with no smallest clip named."""
    out = tmp_path_factory.mktemp("onnx_clips")
    graph = clip_graph(out / "clips.onnx")
    pre = {"channels": 3, "image_size": [4, 4], "clips": "video"}
    modalities = {
        "r3d": {"type": "torchvision_video", "embed_dim": 3, "graph": graph, "inputs": [{"name": "values"}],
                "preprocessing": {**pre, "frames": None, "min_frames": 2}},
        "mae": {"type": "hf_video", "embed_dim": 3, "graph": graph, "inputs": [{"name": "values"}],
                "preprocessing": {**pre, "frames": 4, "min_frames": 4}},
        "any": {"type": "torchvision_video", "embed_dim": 3, "graph": graph, "inputs": [{"name": "values"}],
                "preprocessing": {**pre, "frames": None}},
        "wide": {"type": "torchvision_video", "embed_dim": 3, "graph": graph, "inputs": [{"name": "values"}],
                 "preprocessing": {**pre, "image_size": [4, 6], "frames": None, "min_frames": 1}},
    }
    manifest = {"format": "mmviews-onnx", "version": 1, "modalities": modalities, "not_exported": {}}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out


def test_a_whole_clip_goes_through_a_spatiotemporal_graph_in_one_run(clip_folder: Path):
    """One vector per clip from the graph itself (not the per-frame path's average of frame
    vectors); float64 clips are fed as float32; the frames the manifest allows are taken."""
    encoder = OnnxEncoder(clip_folder)
    rng = np.random.default_rng(1)
    clips = rng.uniform(0, 1, size=(2, 3, 3, 4, 4))
    clips[:, 0] *= 0.1  # frames of different brightness: the clip's mean differs from its frames' unit vectors' mean
    expected = unit(clips.mean(axis=(1, 3, 4)))
    np.testing.assert_allclose(encoder.embed("r3d", {"values": clips}), expected, atol=1e-6)
    per_frame = unit(unit(clips.mean(axis=(3, 4))).mean(axis=1))
    assert np.abs(per_frame - expected).max() > 1e-3
    np.testing.assert_allclose(encoder.embed("mae", {"values": clips[:, :1].repeat(4, axis=1)}),
                               unit(clips[:, 0].mean(axis=(2, 3))), atol=1e-6)
    np.testing.assert_allclose(encoder.embed("any", {"values": clips[:, :1]}), unit(clips[:, 0].mean(axis=(2, 3))),
                               atol=1e-6)  # no min_frames in the manifest: one frame is a clip
    edge = np.full((1, 2, 3, 4, 4), 1 + 5e-4)
    edge[..., 0, 0] = -5e-4  # within the rounding the range check allows
    assert encoder.embed("r3d", {"values": edge}).shape == (1, 3)
    edge = np.full((1, 2, 3, 4, 4), 1 + 1e-3, np.float32)
    edge[..., 0, 0] = -1e-3  # its bounds included
    assert encoder.embed("r3d", {"values": edge}).shape == (1, 3)


@pytest.mark.parametrize("modality,shape,fill,message", [
    ("r3d", (2, 3, 4, 4), 0.5, r"values must be clips \[B, T, 3, H, W\], got shape \(2, 3, 4, 4\)"),
    ("r3d", (2, 3, 2, 4, 4), 0.5, r"values must be clips \[B, T, 3, H, W\], got shape \(2, 3, 2, 4, 4\)"),
    ("r3d", (2, 3, 3, 4, 5), 0.5, r"frames of 4x5; the graph takes 4x4 \(resizing is not part of the ONNX export: "
                                  r"resize the frames first\)"),
    ("r3d", (2, 3, 3, 5, 4), 0.5, r"frames of 5x4; the graph takes 4x4 \("),
    ("wide", (2, 3, 3, 6, 4), 0.5, r"frames of 6x4; the graph takes 4x6 \("),
    ("r3d", (2, 1, 3, 4, 4), 0.5, r"the graph takes clips of at least 2 frames, got 1"),
    ("mae", (2, 5, 3, 4, 4), 0.5, r"the graph takes clips of 4 frames, got 5"),
    ("mae", (2, 3, 3, 4, 4), 0.5, r"the graph takes clips of 4 frames, got 3"),
    ("r3d", (1, 2, 3, 4, 4), 1.002, r"clips must be in \[0, 1\], got range \[1, 1\] in inputs\['values'\] of shape "
                                    r"\(1, 2, 3, 4, 4\)"),
    ("r3d", (1, 2, 3, 4, 4), -0.002, r"clips must be in \[0, 1\], got range \[-0.002, -0.002\]"),
])
def test_clips_a_spatiotemporal_graph_cannot_take_are_named(clip_folder: Path, modality: str, shape, fill, message):
    encoder = OnnxEncoder(clip_folder)
    kind = {"r3d": "torchvision_video", "mae": "hf_video", "wide": "torchvision_video"}[modality]
    with pytest.raises(ValueError, match=rf"^{modality} \({kind}, ONNX\): {message}"):
        encoder.embed(modality, {"values": np.full(shape, fill, np.float32)})


def test_clips_without_values_are_named(clip_folder: Path):
    with pytest.raises(ValueError, match=r"^r3d \(torchvision_video, ONNX\): inputs have no key 'values' "
                                         r"\(keys: \['pixels'\]\)$"):
        OnnxEncoder(clip_folder).embed("r3d", {"pixels": np.zeros((1, 2, 3, 4, 4), np.float32)})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """An export folder of four modalities: images/clips (3 channels, 4x4), flow stacked by 2,
    audio at 16 kHz (min 8 samples), sequences of 3 features; one modality not exported."""
    out = tmp_path_factory.mktemp("onnx")
    modalities = {
        "video": {"type": "small_cnn", "embed_dim": 3, "graph": frame_graph(out / "video.onnx", 3),
                  "inputs": [{"name": "values"}],
                  "preprocessing": {"channels": 3, "frames_per_row": 1, "clips": "per-frame", "image_size": [4, 4]}},
        "flow": {"type": "flow_cnn", "embed_dim": 4, "graph": frame_graph(out / "flow.onnx", 2, stacked=2),
                 "inputs": [{"name": "values"}],
                 "preprocessing": {"channels": 2, "frames_per_row": 2, "clips": "per-frame"}},
        "audio": {"type": "audio_cnn", "embed_dim": 2, "graph": wave_graph(out / "audio.onnx"),
                  "inputs": [{"name": "values"}, {"name": "lengths"}],
                  "preprocessing": {"sample_rate": 16000, "min_samples": 8}},
        "x": {"type": "mlp", "embed_dim": 3, "graph": sequence_graph(out / "x.onnx", 3), "inputs": [{"name": "values"}],
              "preprocessing": {"input_dim": 3}},
        "seq": {"type": "feature_sequence", "embed_dim": 3, "graph": lengths_graph(out / "seq.onnx", 2),
                "inputs": [{"name": "values"}, {"name": "lengths"}], "preprocessing": {"input_dim": 2}},
        "speech": {"type": "hf_audio", "embed_dim": 2, "graph": "audio.onnx",
                   "inputs": [{"name": "values"}, {"name": "lengths"}],
                   "preprocessing": {"sample_rate": 8000, "min_samples": 0}},
        "image": {"type": "open_clip", "embed_dim": 3, "graph": "video.onnx", "inputs": [{"name": "values"}],
                  "preprocessing": {"channels": 3, "frames_per_row": 1, "clips": "per-frame", "image_size": [2, 3]}},
        "whole": {"type": "flow_clip", "embed_dim": 4, "graph": "flow.onnx", "inputs": [{"name": "values"}],
                  "preprocessing": {"channels": 2, "frames_per_row": 2, "clips": "whole"}},
        "text": {"type": "text", "embed_dim": 3, "graph": text_graph(out / "text.onnx"),
                 "inputs": [{"name": "input_ids"}, {"name": "attention_mask"}],
                 "preprocessing": {"tokenizer": word_tokenizer(out / "tokenizer.json"), "max_length": 3,
                                   "pad_token_id": 0}},
        "left": {"type": "text", "embed_dim": 3, "graph": "text.onnx",
                 "inputs": [{"name": "input_ids"}, {"name": "attention_mask"}],
                 "preprocessing": {"tokenizer": "tokenizer.json", "max_length": 3, "padding_side": "left",
                                   "pad_token_id": 5}},
    }
    manifest = {"format": "mmviews-onnx", "version": 1, "modalities": modalities,
                "not_exported": {"picture": "a reason of the exporter's"}}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out


def test_a_clips_frame_vectors_are_averaged_and_normalised_again(folder: Path):
    encoder = OnnxEncoder(folder)
    rng = np.random.default_rng(0)
    clips = rng.uniform(0, 1, size=(2, 3, 3, 4, 4)).astype(np.float32)
    frames = unit(clips.mean(axis=(3, 4)))  # [B, T, 3]: each frame's vector, as the graph computes it
    expected = unit(frames.mean(axis=1))
    z = encoder.embed("video", {"values": clips})
    assert z.dtype == np.float32 and z.shape == (2, 3)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(z, expected, atol=1e-6)
    # a single image, and a clip of one frame: the frame's own vector
    np.testing.assert_allclose(encoder.embed("video", {"values": clips[:, 0]}), frames[:, 0], atol=1e-6)
    np.testing.assert_allclose(encoder.embed("video", {"values": clips[:, :1]}), frames[:, 0], atol=1e-6)


def test_flow_is_embedded_in_stacked_groups(folder: Path):
    encoder = OnnxEncoder(folder)
    rng = np.random.default_rng(1)
    flow = rng.normal(size=(2, 4, 2, 5, 5)).astype(np.float32)
    groups = unit(flow.reshape(2, 2, 2, 2, 5, 5).mean(axis=(4, 5)).reshape(2, 2, 4))  # [B, groups, 2*2]
    np.testing.assert_allclose(encoder.embed("flow", {"values": flow}), unit(groups.mean(axis=1)), atol=1e-6)
    with pytest.raises(ValueError, match=r"^flow \(flow_cnn, ONNX\): T=3 flows is not a multiple of stacked_flows=2$"):
        encoder.embed("flow", {"values": flow[:, :3]})


def test_frame_inputs_are_checked(folder: Path):
    encoder = OnnxEncoder(folder)
    with pytest.raises(ValueError, match=r"^video \(small_cnn, ONNX\): values must be \[B, 3, H, W\] or \[B, T, 3, H, W\], "
                                         r"got shape \(2, 1, 4, 4\)$"):
        encoder.embed("video", {"values": np.zeros((2, 1, 4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"frames of 5x4; the graph takes 4x4 \(resizing is not part of the ONNX export"):
        encoder.embed("video", {"values": np.zeros((2, 3, 5, 4), np.float32)})
    bad = np.zeros((1, 3, 4, 4), np.float32)
    bad[0, 1, 2, 3] = np.inf
    with pytest.raises(ValueError, match=r"^video \(small_cnn, ONNX\): inputs\['values'\] of shape \(1, 3, 4, 4\) holds "
                                         r"non-finite values \(NaN or inf\)$"):
        encoder.embed("video", {"values": bad})
    with pytest.raises(ValueError, match=r"inputs have no key 'values' \(keys: \['pixels'\]\)"):
        encoder.embed("video", {"pixels": bad})


def test_audio_must_come_at_the_graphs_sample_rate_and_length(folder: Path):
    encoder = OnnxEncoder(folder)
    values = np.random.default_rng(2).normal(size=(2, 12)).astype(np.float32)
    for inputs, rate in (({"values": values}, 0), ({"values": values, "sample_rate": 8000}, 8000)):
        with pytest.raises(ValueError, match=rf"^audio \(audio_cnn, ONNX\): audio at {rate} Hz; the graph takes 16000 Hz "
                                             r"\(resampling is not part of the ONNX export: resample the audio first\)$"):
            encoder.embed("audio", inputs)
    z = encoder.embed("audio", {"values": values, "sample_rate": 16000})
    np.testing.assert_allclose(z, unit(np.stack([values.mean(1), np.full(2, 12.0)], 1)), atol=1e-6)
    lengths = np.array([12, 9])
    z = encoder.embed("audio", {"values": values, "sample_rate": 16000, "lengths": lengths})
    np.testing.assert_allclose(z, unit(np.stack([values.mean(1), lengths.astype(float)], 1)), atol=1e-6)
    with pytest.raises(ValueError, match=r"waveform of 7 samples is too short for the backbone's conv front end "
                                         r"\(it needs 8 at 16000 Hz\)"):
        encoder.embed("audio", {"values": values[:, :7], "sample_rate": 16000})
    with pytest.raises(ValueError, match=r"waveform\(s\) at position\(s\) \[1\] too short to give one frame "
                                         r"\(fewer than 8 samples at 16000 Hz\)"):
        encoder.embed("audio", {"values": values, "sample_rate": 16000, "lengths": [12, 7]})
    for lengths in ([12], [13, 12], [-1, 12]):
        with pytest.raises(ValueError, match=r"lengths must be \[B\] in \[0, 12\]"):
            encoder.embed("audio", {"values": values, "sample_rate": 16000, "lengths": lengths})
    for shape in ((2,), (2, 0), (2, 3, 4)):
        with pytest.raises(ValueError, match=r"waveform values must be \[B, T\] with T > 0"):
            encoder.embed("audio", {"values": np.zeros(shape, np.float32), "sample_rate": 16000})


def test_sequences_and_missing_rows(folder: Path):
    encoder = OnnxEncoder(folder)
    x = np.random.default_rng(3).normal(size=(4, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(encoder.embed("x", {"values": x}), unit(x.mean(1)), atol=1e-6)
    with pytest.raises(ValueError, match=r"^x \(mlp, ONNX\): values must be \[B, L, 3\] with L > 0, got shape \(4, 2, 2\)$"):
        encoder.embed("x", {"values": x[..., :2]})
    present = np.array([True, False, True, False])
    out = encoder.embed_present("x", {"values": x, "note": "kept", "ids": ["a", "b", "c", "d"]}, present)
    np.testing.assert_allclose(out[present], unit(x[present].mean(1)), atol=1e-6)
    assert (out[~present] == 0).all() and out.dtype == np.float32
    assert (encoder.embed_present("x", {"values": x}, np.zeros(4, bool)) == 0).all()
    assert onnx_runtime._subset({"v": x, "ids": ["a", "b", "c", "d"], "rate": 5, "short": [1, 2]},
                                np.array([0, 2]), 4)["ids"] == ["a", "c"]
    with pytest.raises(KeyError, match="modality 'picture' was not exported to ONNX: a reason of the exporter's"):
        encoder.embed("picture", {"values": x})
    with pytest.raises(KeyError, match=r"modality 'smell' is not in .* \(modalities: \['audio', 'flow', 'image', 'left', "
                                       r"'seq', 'speech', 'text', 'video', 'whole', 'x'\]\)"):
        encoder.embed("smell", {})
    assert encoder.embed_dim == 3 and encoder.eval() is encoder and is_onnx_folder(folder)
    assert encoder.not_exported == {"picture": "a reason of the exporter's"}
    assert encoder.manifest["format"] == "mmviews-onnx" and encoder.manifest["version"] == 1


def _copy_with(folder: Path, tmp_path: Path, change) -> Path:
    import shutil

    target = tmp_path / "export"
    shutil.copytree(folder, target)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    change(manifest)
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    return target


def test_manifest_paths_never_leave_the_export_folder(folder: Path, tmp_path: Path):
    """A manifest is a user's file: a graph named by a path to a file outside the folder (in its
    parent, an absolute path, a link out) is refused, naming the manifest, before anything is
    read; so is a path to no file."""
    outside = tmp_path / "outside.onnx"
    frame_graph(outside, 3)

    def graph_at(path: str):
        return lambda m: m["modalities"]["video"].update(graph=path)

    for case, path in (("parent", "../outside.onnx"), ("absolute", str(outside)), ("missing", "missing.onnx")):
        target = _copy_with(folder, tmp_path / case, graph_at(path))
        frame_graph(target.parent / "outside.onnx", 3)  # what ../outside.onnx names: a real graph
        with pytest.raises(ValueError, match=rf"{MANIFEST_FILE}: graph '{path}' is not a file inside "):
            OnnxEncoder(target)
    target = _copy_with(folder, tmp_path / "link", graph_at("link.onnx"))
    (target / "link.onnx").symlink_to(outside)
    with pytest.raises(ValueError, match="graph 'link.onnx' is not a file inside"):
        OnnxEncoder(target)


@pytest.mark.parametrize("text, message", [
    ('{"format": "mmviews-onnx", "version": 2, "modalities": {}}', "not a mmviews-onnx manifest of version 1"),
    ('{"format": "other", "version": 1, "modalities": {}}', "not a mmviews-onnx manifest of version 1"),
    ("[1, 2]", "not a mmviews-onnx manifest of version 1"),
    ("{not json", "not a JSON manifest"),
])
def test_a_manifest_that_is_not_ours_is_refused(tmp_path: Path, text: str, message: str):
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(ValueError, match=message):
        OnnxEncoder(tmp_path)
    assert is_onnx_folder(tmp_path)


def test_a_folder_without_a_manifest_is_named(tmp_path: Path):
    assert not is_onnx_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path} is not an ONNX export of mmviews: missing {tmp_path}/{MANIFEST_FILE}$"):
        OnnxEncoder(tmp_path)


@pytest.mark.parametrize("name, guard", [
    ("onnx_clip_not_renormalised", test_a_clips_frame_vectors_are_averaged_and_normalised_again),
    ("onnx_manifest_paths_unchecked", test_manifest_paths_never_leave_the_export_folder),
])
def test_onnx_runtime_guards_fail_when_broken(folder: Path, tmp_path: Path, monkeypatch, name: str, guard) -> None:
    from mutations import apply_break

    apply_break(name, monkeypatch.setattr)
    with pytest.raises((AssertionError, pytest.fail.Exception)):  # an assertion, or a pytest.raises that got nothing
        guard(folder, tmp_path) if "tmp_path" in guard.__code__.co_varnames[:2] else guard(folder)


def test_text_is_tokenised_with_the_saved_tokenizer_and_cut_to_max_length(folder: Path):
    encoder = OnnxEncoder(folder)
    z = encoder.embed("text", {"text": ["red sky", "blue", "green red blue sky"]})
    expected = np.stack([text_vector([2, 5]), text_vector([4]), text_vector([3, 2, 4])])  # cut to 3 tokens
    np.testing.assert_allclose(z, expected, atol=1e-6)
    for bad in ("red", [], ["red", 3]):
        with pytest.raises(ValueError, match=r"^text \(text, ONNX\): inputs\['text'\] must be a non-empty list of strings$"):
            encoder.embed("text", {"text": bad})


def test_token_ids_are_taken_as_collated_for_more_rows(folder: Path):
    encoder = OnnxEncoder(folder)
    ids = np.array([[2, 5, 0, 0, 0], [4, 3, 2, 5, 0]])
    mask = (ids > 0).astype(np.int64)
    np.testing.assert_allclose(encoder.embed("text", {"input_ids": ids, "attention_mask": mask}),
                               np.stack([text_vector([2, 5]), text_vector([4, 3, 2])]), atol=1e-6)
    # no mask: every id counts (cut to max_length)
    np.testing.assert_allclose(encoder.embed("text", {"input_ids": ids[:, :2]}),
                               np.stack([text_vector([2, 5]), text_vector([4, 3])]), atol=1e-6)
    # lengths: only the columns these rows need (right padding: the first, left padding: the last)
    z = encoder.embed("text", {"input_ids": ids, "attention_mask": mask, "lengths": [2, 1]})
    np.testing.assert_allclose(z, np.stack([text_vector([2, 5]), text_vector([4, 3])]), atol=1e-6)
    left = np.array([[0, 0, 0, 2, 5], [0, 4, 3, 2, 1]])
    z = encoder.embed("left", {"input_ids": left, "attention_mask": (left > 0).astype(np.int64), "lengths": [2, 2]})
    np.testing.assert_allclose(z, np.stack([text_vector([2, 5]), text_vector([2, 1])]), atol=1e-6)
    empty = encoder.embed("text", {"input_ids": ids, "attention_mask": mask, "lengths": []})
    assert empty.shape == (2, 3)  # no column needed: the graph sees [B, 0]


def test_left_padding_pads_with_the_saved_pad_id(folder: Path):
    encoder = OnnxEncoder(folder)
    feeds = encoder.adapters["left"]._tokens({"text": ["red sky", "blue"]})
    assert feeds["input_ids"].tolist() == [[2, 5], [5, 4]] and feeds["attention_mask"].tolist() == [[1, 1], [0, 1]]
    assert feeds["input_ids"].dtype == np.int64 and feeds["attention_mask"].dtype == np.int64
    right = encoder.adapters["text"]._tokens({"text": ["red sky", "blue"]})
    assert right["input_ids"].tolist() == [[2, 5], [4, 0]]


def test_a_view_batch_is_embedded_with_absent_views_zero(folder: Path):
    import torch

    from mmviews.data.batch import ViewBatch, ViewInfo

    encoder = OnnxEncoder(folder)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3 * 2, 2, 3)).astype(np.float32)  # 3 samples x 2 views of x, stacked by sample
    clips = rng.uniform(size=(3, 2, 3, 4, 4)).astype(np.float32)
    views = [ViewInfo("x_0", "x", 0), ViewInfo("video_0", "video", 0), ViewInfo("x_1", "x", 1, natural=False)]
    mask = torch.tensor([[True, True, False], [False, True, True], [True, False, True]])
    batch = ViewBatch(inputs={"x": {"values": torch.from_numpy(x)}, "video": {"values": torch.from_numpy(clips)}},
                      views=views, mask=mask)
    z, got_mask = encoder(batch)
    assert isinstance(z, torch.Tensor) and z.shape == (3, 3, 3) and torch.equal(got_mask, mask)
    x_vectors = unit(x.mean(1)).reshape(3, 2, 3)
    video = unit(unit(clips.mean(axis=(3, 4))).mean(axis=1))
    expected = np.zeros((3, 3, 3), np.float32)
    expected[:, 0], expected[:, 2], expected[:, 1] = x_vectors[:, 0], x_vectors[:, 1], video
    expected[~mask.numpy()] = 0
    np.testing.assert_allclose(z.numpy(), expected, atol=1e-6)


def test_sequences_with_lengths_feed_them_to_the_graph(folder: Path):
    encoder = OnnxEncoder(folder)
    x = np.random.default_rng(6).normal(size=(3, 4, 2)).astype(np.float32)
    full = encoder.embed("seq", {"values": x})
    np.testing.assert_allclose(full, unit(np.concatenate([x.mean(1), np.full((3, 1), 4.0)], 1)), atol=1e-6)
    given = encoder.embed("seq", {"values": x, "lengths": np.array([4, 1, 2])})
    np.testing.assert_allclose(given, unit(np.concatenate([x.mean(1), [[4.0], [1.0], [2.0]]], 1)), atol=1e-6)
    assert encoder.embed("seq", {"values": x[:, :1]}).shape == (3, 3)  # one step is a sequence
    with pytest.raises(ValueError, match=r"^seq \(feature_sequence, ONNX\): values must be \[B, L, 2\] with L > 0, "
                                         r"got shape \(3, 0, 2\)$"):
        encoder.embed("seq", {"values": x[:, :0]})
    with pytest.raises(ValueError, match=r"^seq \(feature_sequence, ONNX\): inputs\['lengths'\] of shape \(3,\) holds "
                                         r"non-finite values"):
        encoder.embed("seq", {"values": x, "lengths": np.array([4.0, np.nan, 1.0])})


def test_length_limits_of_waveforms(folder: Path):
    encoder = OnnxEncoder(folder)
    values = np.random.default_rng(7).normal(size=(12, 8)).astype(np.float32)
    z = encoder.embed("audio", {"values": values, "sample_rate": 16000, "lengths": np.full(12, 8)})
    assert z.shape == (12, 2)  # exactly min_samples (8) is enough
    with pytest.raises(ValueError, match=r"position\(s\) \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\] too short"):
        encoder.embed("audio", {"values": values, "sample_rate": 16000, "lengths": np.full(12, 7)})
    with pytest.raises(ValueError, match=r"lengths must be \[B\] in \[0, 8\], got \[9, 9, 9, 9, 9, 9, 9, 9, 9, 9\]$"):
        encoder.embed("audio", {"values": values, "sample_rate": 16000, "lengths": np.full(12, 9)})
    # a graph without a minimum still needs one sample per waveform
    speech = {"values": values[:2], "sample_rate": 8000}
    assert encoder.embed("speech", {**speech, "lengths": [1, 8]}).shape == (2, 2)
    with pytest.raises(ValueError, match=r"^speech \(hf_audio, ONNX\): waveform\(s\) at position\(s\) \[0\] too short"):
        encoder.embed("speech", {**speech, "lengths": [0, 8]})


def test_open_clip_images_must_be_in_the_unit_range_and_non_square_sizes_are_named(folder: Path):
    encoder = OnnxEncoder(folder)
    images = np.full((2, 3, 2, 3), 0.5, np.float32)
    for low, high in ((0.0, 1.0), (-0.0009, 1.0009)):
        images[0, 0, 0, 0], images[1, 2, 1, 2] = low, high
        assert encoder.embed("image", {"values": images}).shape == (2, 3)
    for low, high, shown in ((-0.0011, 0.5, r"\[-0.0011, 0.5\]"), (0.5, 1.0011, r"\[0.5, 1\]")):
        images[0, 0, 0, 0], images[1, 2, 1, 2] = low, high
        with pytest.raises(ValueError, match=r"^image \(open_clip, ONNX\): images must be in \[0, 1\], got range "):
            encoder.embed("image", {"values": images})
    with pytest.raises(ValueError, match=r"frames of 3x2; the graph takes 2x3 "):
        encoder.embed("image", {"values": np.zeros((1, 3, 3, 2), np.float32)})
    video = np.full((1, 3, 4, 4), 2.0, np.float32)  # another adapter type: no range check
    assert encoder.embed("video", {"values": video}).shape == (1, 3)


def test_whole_clips_go_through_the_graph_at_once(folder: Path):
    encoder = OnnxEncoder(folder)
    flow = np.random.default_rng(8).normal(size=(2, 2, 2, 3, 3)).astype(np.float32)
    expected = unit(flow.mean(axis=(3, 4)).reshape(2, 4))
    np.testing.assert_allclose(encoder.embed("whole", {"values": flow}), expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"^whole \(flow_clip, ONNX\): the graph takes clips of T=2 flows stacked, got T=4$"):
        encoder.embed("whole", {"values": np.concatenate([flow, flow], 1)})


def test_sessions_are_made_as_asked(folder: Path):
    encoder = OnnxEncoder(folder, threads=1)
    for adapter in encoder.adapters.values():
        options = adapter.session.get_session_options()
        assert options.intra_op_num_threads == 1 and options.log_severity_level == 3
        assert adapter.session.get_providers() == ["CPUExecutionProvider"]
        assert (adapter.tokenizer is None) == (adapter.kind != "text")
    default = OnnxEncoder(folder)
    assert default.adapters["x"].session.get_session_options().intra_op_num_threads == 0


def test_torch_tensors_are_taken_as_arrays(folder: Path):
    import torch

    encoder = OnnxEncoder(folder)
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(encoder.embed("x", {"values": x}), unit(x.numpy().mean(1)), atol=1e-6)
    present = np.array([False, True, True, False])
    out = encoder.embed_present("seq", {"values": torch.randn(4, 3, 2), "lengths": torch.tensor([3, 1, 2, 3]),
                                        "rate": np.array(5)}, present)
    assert (out[~present] == 0).all() and (np.linalg.norm(out[present], axis=1) > 0.99).all()
    subset = onnx_runtime._subset({"t": torch.arange(4), "scalar": np.array(7), "m": np.arange(8).reshape(4, 2)},
                                  np.array([1, 3]), 4)
    assert subset["t"].tolist() == [1, 3] and int(subset["scalar"]) == 7 and subset["m"].tolist() == [[2, 3], [6, 7]]
    one = encoder.embed_present("x", {"values": x}, np.array([False, False, True, False]))
    np.testing.assert_allclose(one[2], unit(x.numpy()[2].mean(0)), atol=1e-6)
