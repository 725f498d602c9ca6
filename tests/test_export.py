"""`mmviews export`: ONNX graphs that `mmviews embed` runs with onnxruntime and numpy
alone, giving the torch encoder's embeddings; a Hub-ready folder, loading by Hub repo id from a
pre-filled cache offline, and push_to_hub's folder.

The runs here are not trained: a recipe's encoder at random initialisation, saved as a finished
run saves it (``config.yaml`` and ``encoder/``); exporting and embedding need nothing else.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from test_train_utils import env, tiny_config

from mmviews.cli import main
from mmviews.modalities.presets import example_inputs
from mmviews.modalities.presets import tiny_config as adapter_config

# adapters of each test run (modality -> adapter type); the data: synthetic or gaussian_latents
RUNS: dict[str, dict[str, str]] = {
    # clips (video: small_cnn on [B, T, 3, H, W]) and stacked flow groups go through the frame pooling
    "multimodal": {"text": "text", "audio": "hf_audio", "image": "open_clip", "video": "small_cnn",
                   "flow": "flow_clip"},
    "cnn": {"image": "small_cnn", "flow": "flow_cnn", "audio": "audio_cnn"},
    "mlp": {"x": "mlp"},
    "sequence": {"x": "feature_sequence"},
    # whole clips through spatiotemporal backbones: MC3-18 (any number of frames), a tiny VideoMAE (4)
    "video3d": {"video": "torchvision_video"},
    "videomae": {"video": "hf_video"},
}


def make_run(folder: Path, adapters: dict[str, str]) -> Path:
    """A finished run of a tiny recipe with ``adapters``, at random initialisation."""
    from mmviews.config import config_from_dict, save_config
    from mmviews.run import build_encoder

    raw = tiny_config(num_samples=20)
    if "x" in adapters:  # feature sequences: the 1-D Gaussian latents, [1, 1] per sample
        raw["data"] = {"name": "gaussian_latents", "options": {"sigma0": 1.0}, "batch_size": 8, "eval_batch_size": 16,
                       "split_options": {s: {"num_samples": 20} for s in ("train", "valid", "test")}}
        overrides: dict[str, Any] = {"input_dim": 1}
    else:
        raw["data"]["options"].update(modalities=list(adapters), missing_rate=0.25)
        if "hf_video" in adapters.values():
            raw["data"]["options"]["num_frames"] = 4  # the tiny VideoMAE's
        raw["data"]["eval_batch_size"] = 16  # several batches per split, the last one short
        overrides = {}
    raw["adapters"] = {}
    for modality, kind in adapters.items():
        if kind == "mlp":
            cfg = {"type": "mlp", "input_dim": 1, "hidden_dim": 16, "embed_dim": 16}
        else:
            cfg = adapter_config(kind, **(overrides if kind == "feature_sequence" else {}))
        if kind == "flow_clip":
            cfg["stacked_flows"] = 1
        if kind == "torchvision_video":
            cfg["image_size"] = 32  # the synthetic clips' (the graph takes frames at its size)
        raw["adapters"][modality] = cfg
    raw["views"] = [{"modality": m} for m in adapters]
    config = config_from_dict(raw)
    folder.mkdir(parents=True)
    save_config(config, folder / "config.yaml")
    torch.manual_seed(0)
    build_encoder(config).save_pretrained(folder / "encoder")
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, list[str], str]]:
    """Per test run: (run folder, its ONNX export, the warnings and the stdout of its export)."""
    pytest.importorskip("onnxruntime")
    out = {}
    for name, adapters in RUNS.items():
        tmp = tmp_path_factory.mktemp(name)
        run = make_run(tmp / "run", adapters)
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()) as stdout:
            warnings.simplefilter("always")
            assert main(["export", str(run), "--format", "onnx", "--output", str(tmp / "onnx")]) == 0
        out[name] = (run, tmp / "onnx", [str(w.message) for w in caught], stdout.getvalue())
    return out


@pytest.fixture(scope="module")
def exported(exports) -> dict[str, tuple[Path, Path]]:
    """Per test run: (run folder, its ONNX export)."""
    return {name: (run, onnx) for name, (run, onnx, _, _) in exports.items()}


def read_embeddings(path: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pydict()


def check_onnx_embed_matches_torch(run: Path, onnx: Path, tmp: Path) -> float:
    """The guard's check: ``mmviews embed ONNX`` and ``mmviews embed RUN`` write the same rows,
    the same absent views, and vectors within 1e-4. Returns the largest difference."""
    assert main(["embed", str(run), str(run / "config.yaml"), "--output", str(tmp / "torch.parquet")]) == 0
    assert main(["embed", str(onnx), str(run / "config.yaml"), "--output", str(tmp / "onnx.parquet")]) == 0
    ref, got = read_embeddings(tmp / "torch.parquet"), read_embeddings(tmp / "onnx.parquet")
    assert ref.keys() == got.keys()
    views = [k for k in ref if k not in ("split", "sample_id", "class", "sentiment", "latent")]
    for key in set(ref) - set(views):
        assert got[key] == ref[key], key
    worst = 0.0
    for view in views:
        absent = [v is None for v in ref[view]]
        assert [v is None for v in got[view]] == absent, view
        a = np.array([v for v in ref[view] if v is not None])
        b = np.array([v for v in got[view] if v is not None])
        assert a.shape == b.shape and a.shape[0] > 0, view
        diff = float(np.abs(a - b).max())
        assert diff <= 1e-4, f"{view}: max abs diff {diff}"
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("name", list(RUNS))
def test_onnx_embed_gives_the_torch_embeddings(exported, name: str, tmp_path: Path):
    run, onnx = exported[name]
    check_onnx_embed_matches_torch(run, onnx, tmp_path)
    manifest = json.loads((onnx / "onnx_manifest.json").read_text())
    assert set(manifest["modalities"]) == set(RUNS[name]) and manifest["not_exported"] == {}


def test_onnx_check_fails_when_clips_are_embedded_by_their_first_frame(exported, monkeypatch, tmp_path: Path):
    """Mutation test: with a clip embedded by its first frame alone, the check fails (video)."""
    from mutations import apply_break

    apply_break("onnx_clip_first_frame", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="video"):
        check_onnx_embed_matches_torch(*exported["multimodal"], tmp_path)


def test_manifest_names_inputs_with_dynamic_batch_and_length(exported):
    manifest = json.loads((exported["multimodal"][1] / "onnx_manifest.json").read_text())["modalities"]
    shapes = {name: {i["name"]: i["shape"] for i in entry["inputs"]} for name, entry in manifest.items()}
    assert shapes["text"] == {"input_ids": ["batch", "tokens"], "attention_mask": ["batch", "tokens"]}
    assert shapes["audio"] == {"values": ["batch", "samples"], "lengths": ["batch"]}
    assert shapes["image"] == {"values": ["frames", 3, 32, 32]}  # the ViT's input size
    assert shapes["video"] == {"values": ["frames", 3, "height", "width"]}
    assert manifest["audio"]["preprocessing"]["sample_rate"] == 16000
    assert manifest["text"]["preprocessing"]["tokenizer"] == "text/tokenizer/tokenizer.json"
    sequence = json.loads((exported["sequence"][1] / "onnx_manifest.json").read_text())["modalities"]["x"]
    assert {i["name"]: i["shape"] for i in sequence["inputs"]} == {"values": ["batch", "length", 1],
                                                                   "lengths": ["batch"]}


def test_a_sequence_graph_is_exported_by_dynamo_quietly_with_its_dynamic_dimensions(exports):
    """The sequence run's graph (feature_sequence: torch.onnx's dynamo exporter, opset 18, batch
    and length dynamic) is written without a warning or the exporter's diagnostics on stdout;
    that it embeds other batch sizes and lengths as the adapter does:
    test_graphs_take_other_batch_sizes_and_lengths[feature_sequence]."""
    import onnx

    _, folder, caught, stdout = exports["sequence"]
    assert caught == [] and [line.split(" to ")[0] for line in stdout.splitlines()] == ["wrote ONNX graphs"], stdout
    entry = json.loads((folder / "onnx_manifest.json").read_text())["modalities"]["x"]
    assert (entry["exporter"], entry["opset"]) == ("dynamo", 18)
    graph = onnx.load(str(folder / entry["graph"]))
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [18]
    assert [o.name for o in graph.graph.output] == ["embedding"]
    assert [i.name for i in graph.graph.input] == ["values", "lengths"]
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input]
    assert dims[0][2] == 1 and all(isinstance(d, str) for d in (*dims[0][:2], *dims[1])), dims  # symbolic


# adapter type -> (test run, modality) whose export holds its graph; flow_cnn-stack: exported here
GRAPHS = {"text": ("multimodal", "text"), "hf_audio": ("multimodal", "audio"), "audio_cnn": ("cnn", "audio"),
          "feature_sequence": ("sequence", "x"), "small_cnn": ("cnn", "image"), "flow_cnn-stack": (None, None),
          "torchvision_video": ("video3d", "video"), "hf_video": ("videomae", "video")}


@pytest.mark.parametrize("kind", list(GRAPHS))
def test_graphs_take_other_batch_sizes_and_lengths(exported, kind: str, tmp_path: Path):
    """Each graph, traced at one batch size and length, embeds others as the adapter does."""
    from mmviews.export.onnx import export_adapter
    from mmviews.export.onnx_runtime import OnnxAdapter, OnnxEncoder
    from mmviews.modalities.base import build_adapter
    from mmviews.modalities.multiview import MultiViewEncoder

    base, _, variant = kind.partition("-")
    run_name, modality = GRAPHS[kind]
    if run_name is None:  # temporal: stack, in no test run
        torch.manual_seed(0)
        adapter = build_adapter(adapter_config(base, temporal="stack", num_flows=2)).eval()
        runtime = OnnxAdapter(tmp_path, base, export_adapter(adapter, tmp_path), ["CPUExecutionProvider"])
    else:
        run, onnx = exported[run_name]
        adapter = MultiViewEncoder.from_pretrained(run / "encoder").adapters[modality].eval()
        runtime = OnnxEncoder(onnx).adapters[modality]
    for batch, seed in ((5, 1), (1, 2)):
        inputs = example_inputs(base, batch, seed=seed)
        if base == "text":  # texts of other lengths than at tracing, one over max_length
            inputs["text"] = [" ".join(["cat"] * (3 + 9 * i)) for i in range(batch)]
        if base == "feature_sequence":  # the run's sequences have one feature (gaussian_latents)
            inputs["values"] = inputs["values"][..., :1]
        if base in ("hf_audio", "audio_cnn", "feature_sequence"):  # a shorter sequence axis
            cut = inputs["values"].shape[1] * 2 // 3
            inputs["values"] = inputs["values"][:, :cut]
            inputs["lengths"] = inputs["lengths"].clamp_max(cut)
        if base == "small_cnn":  # another image size: a CNN pools over any
            inputs["values"] = torch.rand(batch, 3, 24, 40, generator=torch.Generator().manual_seed(seed))
        if base == "torchvision_video":  # clips of 3 and 9 frames (traced at the run's 6): a 3-D CNN takes any
            inputs["values"] = torch.rand(batch, 3 * seed ** 2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            reference = adapter(inputs).numpy()
        np.testing.assert_allclose(runtime.embed(inputs), reference, rtol=0, atol=1e-4)


def test_onnx_embed_imports_no_model_code(exported, tmp_path: Path):
    """The ONNX path of `mmviews embed` loads neither mmviews' adapters nor transformers,
    open_clip or torchaudio (the data still comes through mmviews' loaders)."""
    run, onnx = exported["multimodal"]
    script = (
        "import sys\n"
        "from mmviews.cli import main\n"
        f"rc = main(['embed', {str(onnx)!r}, {str(run / 'config.yaml')!r}, '--output', "
        f"{str(tmp_path / 'e.parquet')!r}])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'open_clip', 'torchaudio', "
        "'timm', 'peft') or m.startswith('mmviews.modalities'))\n"
        "print('LOADED', loaded)\n"
        "sys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LOADED []" in result.stdout, result.stdout


def test_an_adapter_that_cannot_export_is_named_with_its_reason(exported, tmp_path: Path, capsys, monkeypatch):
    """Every built-in adapter type exports; one without an export (as a type registered outside
    mmviews is) is left out, named with the reason, and embedding its views is a one-line error."""
    import mmviews.export.onnx as onnx_export

    monkeypatch.delitem(onnx_export._SPECS, "audio_cnn")
    run, _ = exported["cnn"]
    capsys.readouterr()
    assert main(["export", str(run), "--format", "onnx", "--output", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    reason = "no ONNX export is defined for adapter type 'audio_cnn'"
    assert f"modality 'audio' not exported to ONNX: {reason}" in out, out
    assert json.loads((tmp_path / "again" / "onnx_manifest.json").read_text())["not_exported"] == {"audio": reason}
    assert main(["embed", str(tmp_path / "again"), str(run / "config.yaml"), "--output", str(tmp_path / "e.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "['audio']" in err and reason in err, err
    assert not (tmp_path / "e.parquet").exists()


def test_onnx_runtime_refuses_what_the_graphs_cannot_take(exported):
    """Inputs the torch adapter refuses, or that need what the graph leaves out, are one-line
    errors naming the modality and the value, never silent NaN or clamped values."""
    from mmviews.export.onnx_runtime import OnnxEncoder

    encoder = OnnxEncoder(exported["multimodal"][1])
    audio = example_inputs("hf_audio", 2)
    with pytest.raises(ValueError, match="audio at 8000 Hz; the graph takes 16000 Hz"):
        encoder.embed("audio", {**audio, "sample_rate": 8000})
    values = audio["values"].clone()
    values[1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"audio \(hf_audio, ONNX\): inputs\['values'\] .* non-finite"):
        encoder.embed("audio", {**audio, "values": values})
    with pytest.raises(ValueError, match=r"position\(s\) \[1\] too short"):
        encoder.embed("audio", {**audio, "lengths": torch.tensor([4000, 0])})
    with pytest.raises(ValueError, match=r"images must be in \[0, 1\]"):
        encoder.embed("image", {"values": torch.rand(2, 3, 32, 32) * 2})
    with pytest.raises(ValueError, match="frames of 24x24; the graph takes 32x32"):
        encoder.embed("image", {"values": torch.rand(2, 3, 24, 24)})
    # whole clips: the graph's frame size and number of frames, the unit range
    video, mae = OnnxEncoder(exported["video3d"][1]), OnnxEncoder(exported["videomae"][1])
    where = r"^video \((torchvision|hf)_video, ONNX\): "
    for encoder, clip, message in [
        (video, torch.rand(2, 3, 32, 32), r"values must be clips \[B, T, 3, H, W\], got shape \(2, 3, 32, 32\)$"),
        (video, torch.rand(2, 4, 3, 24, 32), r"frames of 24x32; the graph takes 32x32 \(resizing is not part of the ONNX "
                                             r"export: resize the frames first\)$"),
        (video, torch.rand(2, 1, 3, 32, 32) * 2, r"clips must be in \[0, 1\], got range \[.*\] in inputs\['values'\] "
                                                 r"of shape \(2, 1, 3, 32, 32\)$"),
        (mae, torch.rand(2, 6, 3, 32, 32), r"the graph takes clips of 4 frames, got 6$"),
    ]:
        with pytest.raises(ValueError, match=where + message):
            encoder.embed("video", {"values": clip})
    assert video.adapters["video"].pre["frames"] is None and mae.adapters["video"].pre["frames"] == 4


def test_export_refuses_an_existing_folder(exported, tmp_path: Path, capsys):
    run, _ = exported["mlp"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("kept")
    for fmt in ("onnx", "hf"):
        assert main(["export", str(run), "--format", fmt, "--output", str(tmp_path / "taken")]) == 2
        assert "exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]


# ---- Hub-ready folders -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """A run with the results and card a finished run has, and its ``--format hf`` export."""
    from mmviews.config import load_config
    from mmviews.train.model_card import write_model_card

    tmp = tmp_path_factory.mktemp("hf")
    run = make_run(tmp / "run", {"text": "text", "image": "small_cnn"})
    summary = {"steps": 4, "epochs": 2, "samples_seen": 40, "final_loss": 1.25,
               "eval": {"test/linear/class/acc": 0.625, "test/retrieval/text_0->image_0/R@1": 0.25},
               "eval_random": {"test/linear/class/acc": 0.25, "test/retrieval/text_0->image_0/R@1": 0.05}}
    (run / "results.json").write_text(json.dumps(summary))
    write_model_card(run / "encoder", load_config(run / "config.yaml"), summary)
    out = tmp / "hf"
    assert main(["export", str(run), "--format", "hf", "--output", str(out), "--license", "apache-2.0"]) == 0
    return run, out, summary


def front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:card.index("\n---\n", 4)])


def test_hf_folder_has_weights_config_and_a_hub_model_card(hf_export):
    run, out, summary = hf_export
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert {"README.md", "encoder.json", "text/config.json", "text/model.safetensors", "image/config.json",
            "image/model.safetensors", "text/tokenizer/tokenizer.json"} <= set(files), files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".py"))]
    card = (out / "README.md").read_text()
    front = front_matter(card)
    assert front["library_name"] == "mmviews" and front["license"] == "apache-2.0"
    assert front["datasets"] == ["synthetic"] and {"mmviews", "text", "image"} <= set(front["tags"])
    metrics = {m["type"]: m["value"] for r in front["model-index"][0]["results"] for m in r["metrics"]}
    assert metrics == {k.removeprefix("test/"): v for k, v in summary["eval"].items()}
    # followed by the card the run wrote (its body, unchanged)
    run_card = (run / "encoder" / "README.md").read_text()
    assert card[card.index("\n---\n", 4):] == run_card[run_card.index("\n---\n", 4):]
    assert "license" not in front_matter(run_card)


def test_hf_folder_loads_as_the_runs_encoder(hf_export):
    from mmviews.modalities.multiview import MultiViewEncoder

    run, out, _ = hf_export
    exported, original = MultiViewEncoder.from_pretrained(out), MultiViewEncoder.from_pretrained(run / "encoder")
    a, b = exported.state_dict(), original.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fill_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str = "0123456789abcdef0123") -> Path:
    """``folder`` as huggingface_hub's cache holds a downloaded repository: snapshots/<rev>/
    with the files, refs/main naming <rev>."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_from_pretrained_loads_a_hub_repo_id_from_the_cache_offline(hf_export, tmp_path: Path):
    """With HF_HUB_OFFLINE=1 and HF_HUB_CACHE pre-filled, a repo id loads from the cache; files
    a repository may hold besides the encoder's (a pickle, a Python module) are never run."""
    from crafted_files import hostile_pickle

    _, out, _ = hf_export
    cache = tmp_path / "cache"
    snapshot = fill_hub_cache(cache, "someone/tiny-mmviews", out)
    marker = tmp_path / "code-ran"
    hostile_pickle(snapshot / "pytorch_model.bin", marker)
    (snapshot / "modeling_mmviews.py").write_text(f"open({str(marker)!r}, 'w')\n")
    script = (
        "import sys, torch\n"
        "from mmviews.modalities.multiview import MultiViewEncoder\n"
        "hub = MultiViewEncoder.from_pretrained('someone/tiny-mmviews')\n"
        f"local = MultiViewEncoder.from_pretrained({str(out)!r})\n"
        "a, b = hub.state_dict(), local.state_dict()\n"
        "assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)\n"
        "try:\n"
        "    MultiViewEncoder.from_pretrained('someone/not-cached')\n"
        "except FileNotFoundError as error:\n"
        "    print('MISSING', error)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MISSING 'someone/not-cached' is neither a local folder nor a Hub repository" in result.stdout, result.stdout
    assert not marker.exists()


def test_push_to_hub_uploads_the_saved_folder_with_its_card(hf_export, monkeypatch, tmp_path: Path):
    """push_to_hub's upload is huggingface_hub's: the network calls (HfApi.create_repo and
    upload_folder) are replaced, and the folder they would upload is checked and loaded."""
    import shutil

    from huggingface_hub import HfApi

    from mmviews.modalities.multiview import MultiViewEncoder

    calls: list[tuple[str, Any]] = []

    def create_repo(self: Any, repo_id: str, **kwargs: Any) -> None:
        calls.append(("create_repo", repo_id))

    def upload_folder(self: Any, *, repo_id: str, folder_path: str, **kwargs: Any) -> str:
        shutil.copytree(folder_path, tmp_path / "uploaded")
        calls.append(("upload_folder", repo_id))
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    _, out, _ = hf_export
    encoder = MultiViewEncoder.from_pretrained(out)
    card = (out / "README.md").read_text()
    assert encoder.push_to_hub("someone/tiny-mmviews", model_card=card) == "commit"
    assert calls == [("create_repo", "someone/tiny-mmviews"), ("upload_folder", "someone/tiny-mmviews")]
    uploaded = tmp_path / "uploaded"
    assert sorted(p.relative_to(uploaded) for p in uploaded.rglob("*")) == sorted(p.relative_to(out) for p in out.rglob("*"))
    assert (uploaded / "README.md").read_text() == card
    again = MultiViewEncoder.from_pretrained(uploaded).state_dict()
    assert all(torch.equal(again[k], v) for k, v in encoder.state_dict().items())


def test_bench_onnx_times_both_contenders(tmp_path: Path, capsys):
    """`mmviews bench onnx` measures the torch adapter and its ONNX graph on the same batch."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bench.json"
    assert main(["bench", "onnx", "--kinds", "small_cnn", "--repeats", "1", "--batch-size", "4",
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["exporter"]) for r in rows] == [("small_cnn", "torchscript")]
    assert rows[0]["torch_s"] > 0 and rows[0]["onnxruntime_s"] > 0
    ratio = rows[0]["onnxruntime_s"] / rows[0]["torch_s"]  # of the times as written, rounded to 10 us
    assert rows[0]["ratio_onnx_to_torch"] == pytest.approx(ratio, rel=0.1)
    assert "small_cnn" in capsys.readouterr().out
