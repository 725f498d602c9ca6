"""``mmviews bench train``: the step it times is the trainer's, and its report is complete."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from mmviews.bench import train as bench
from mmviews.bench import train_cases, train_measure, train_report
from mmviews.bench.cli import VERBS
from mmviews.bench.host_reads import HostReadRecorder
from mmviews.config import load_config, resolve_recipe
from mmviews.data.views import ViewSetCollator, ViewSpec
from mmviews.train import build_run
from mmviews.train.setup import batches_forever, make_accelerator, prepare_run
from mmviews.train.step import PHASES as STEP_PHASES
from mmviews.train.step import train_step

# The quickstart shrunk to seconds: K = 16 of 64 samples, small eval splits unused.
SMALL = ["data.batch_size=16", "data.split_options.train.num_samples=64"]


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    options = ["--case", "quickstart", "--device", "cpu", "--steps", "2", "--warmup", "1", "--out",
               str(tmp_path / "bench.json"), *[w for item in SMALL for w in ("--set", item)], *extra]
    return parser.parse_args(options)


def test_dispatch_entry() -> None:
    assert VERBS["train"][0] == "mmviews.bench.train"


def test_quickstart_case_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    in_this_process: list[str] = []  # the measured process never runs the estimate's trial steps
    estimate_memory = bench.estimate_memory
    monkeypatch.setattr(bench, "estimate_memory",
                        lambda *a, **k: (in_this_process.append("estimate_memory"), estimate_memory(*a, **k))[1])
    assert bench.run(_args(tmp_path, "--count-host-reads", "1")) == 0
    assert in_this_process == []
    result = json.loads((tmp_path / "bench.json").read_text())
    (row,) = result["cases"]
    assert (row["case"], row["K"], row["M"], row["device"], row["num_workers"]) == ("quickstart", 16, 4, "cpu", 0)
    assert row["data_cache"] == "warm"  # data.cache: filled before timing, as the run's baseline evaluation does
    assert set(row["phase_ms"]) == set(train_measure.PHASES) and all(v >= 0 for v in row["phase_ms"].values())
    assert sum(row["phase_share"].values()) == pytest.approx(1.0)
    assert row["phase_ms"]["forward"] > 0 and row["phase_ms"]["backward"] > 0
    # samples/s from the timed steps: K * steps / their total time
    total_s = sum(row["phase_ms"].values()) * row["steps"] / 1000
    assert row["samples_per_s"] == pytest.approx(16 * 2 / total_s, rel=1e-6)
    assert row["views_per_s"] == pytest.approx(4 * row["samples_per_s"])
    assert row["peak_memory_mb"] > 0 and "getrusage" in row["memory_method"]
    # the --check estimate beside the measured peak, with its parts
    # the measured process only trains: its peak is set against the estimate's training step (the
    # whole run's figure, the larger of that and the evaluation's, is beside it)
    assert row["estimated_memory_mb"] == pytest.approx(row["estimate"]["step_alone"]) and row["estimated_memory_mb"] > 0
    assert row["estimated_run_memory_mb"] == pytest.approx(row["estimate"]["total"])
    assert row["estimate"]["activations"] > 0 and row["estimate"]["baseline"] > 0
    # the estimate against the measured peak and first step: the next test, in a fresh process (this
    # long-lived test process holds what earlier tests left: its peak and first step are not a run's)
    assert row["estimate"]["framework"] > 0 and row["first_step_residue_mb"] >= 0
    assert row["host_reads"]["steps"] == 1 and isinstance(row["host_reads"]["by_origin"], dict)
    assert {"torch", "platform", "threads"} <= set(result["environment"])
    table = capsys.readouterr().out
    assert "quickstart" in table and "samples/s" in table and "data%" in table and "fwd%" in table
    assert f"memory estimate of the training step (--check) {row['estimated_memory_mb']:.0f} MB vs measured peak RSS" in table


def test_realistic_case_config_and_data() -> None:
    """The realistic case's adapters and inputs (not built here: bert-base + HuBERT-base + ViT-B/32)."""
    config = train_cases.realistic_config_of(load_config(resolve_recipe("quickstart")), 8)
    assert config.data.batch_size == 8 and config.evaluation.tasks == []
    assert {m: a["type"] for m, a in config.adapters.items()} == {
        "text": "text", "audio": "hf_audio", "image": "open_clip", "flow": "flow_cnn"}
    assert config.adapters["text"]["bert_config"] == {}  # BertConfig defaults: bert-base
    assert "model_overrides" not in config.adapters["image"]  # ViT-B/32 as published (224 px)
    dataset = train_cases.RandomViews(20, pool=4, **train_cases.REALISTIC_INPUTS)
    collator = ViewSetCollator.for_dataset(dataset, ViewSpec.from_config(config.views))
    batch = collator([dataset[i] for i in range(3)])
    assert batch.inputs["audio"]["values"].shape == (3, 32000)  # 2 s at 16 kHz
    assert batch.inputs["image"]["values"].shape == (3, 3, 224, 224)
    assert batch.inputs["flow"]["values"].shape == (3, 4, 2, 224, 224)
    assert len(batch.inputs["text"]["text"]) == 3 and len(batch.inputs["text"]["text"][0].split()) == 60


def test_estimate_against_a_fresh_measured_process(tmp_path: Path) -> None:
    """The estimate within 15 % of the peak RSS of a fresh measured process, and its framework
    state (what its trial steps leave with no tensor alive, after
    malloc_trim) is part of what the first step leaves in a fresh measured process (which also ran
    an optimiser step; --check's own forward of each split is in its baseline). Both processes
    fresh, as a user's: in this long-lived test process earlier tests have already made the
    kernels, and the first step leaves less."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mmviews.bench.train", "--case", "quickstart", "--device", "cpu", "--steps", "1",
               "--warmup", "1", "--threads", "1", "--output", str(out), *[w for item in SMALL for w in ("--set", item)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["cases"]
    framework, residue = row["estimate"]["framework"], row["first_step_residue_mb"]
    assert 0 < framework <= 2 * residue, (framework, residue)
    # the training step's estimate (made in a process of its own, as mmviews train --check) is within
    # 15 % of the measured process's peak RSS (its own: VmHWM, not the test process's carried over at exec)
    assert abs(row["estimated_memory_mb"] / row["peak_memory_mb"] - 1) <= 0.15, (row["estimate"], row["peak_memory_mb"])


def test_finetune_small_case_config() -> None:
    """The finetune-small case: the finetune recipe's views, objective, precision and adapter
    settings on the tiny random-weight backbones (not built here: it trains in minutes on CPU)."""
    recipe = load_config(resolve_recipe("finetune"))
    config = train_cases.finetune_small_config()
    assert (config.data.batch_size, config.optimisation.encode_chunk_size, config.data.num_workers) == (64, 16, 0)
    assert config.views == [{**v, "params": {"size": 32}} if "params" in v else v for v in recipe.views]
    assert config.objective == recipe.objective
    assert config.optimisation.mixed_precision == recipe.optimisation.mixed_precision == "auto"
    for modality, adapter in recipe.adapters.items():
        small = config.adapters[modality]
        assert small["type"] == adapter["type"] and "pretrained" not in small and "embed_dim" not in small
        assert {"text": "bert_config", "hf_audio": "backbone_config", "open_clip": "model_overrides"}[small["type"]] in small
        for key in ("finetune", "gradient_checkpointing", "head"):
            assert small[key] == adapter[key], (modality, key)
    assert config.adapters["text"]["finetune"]["lora"] == {"r": 8, "alpha": 16}
    assert config.adapters["audio"]["backbone_config"]["num_hidden_layers"] == 2
    assert train_cases.finetune_small_config(["data.batch_size=32"]).data.batch_size == 32  # --set wins
    assert bench._plain_argv(["--steps", "1"], "finetune-small", _args(Path("."))) == [
        "--steps", "1", "--set", "optimisation.encode_chunk_size=null"]
    dataset = train_cases.RandomViews(4, pool=2, modalities=("text", "audio", "image"),
                                      **train_cases.FINETUNE_SMALL_INPUTS)
    assert set(dataset[0]["modalities"]) == set(dataset.modality_info()) == {"text", "audio", "image"}
    assert dataset[1]["modalities"]["image"].shape == (3, 32, 32)


def test_sync_debug_needs_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():  # pragma: no cover - CPU-only CI
        pytest.skip("CUDA present")
    with pytest.raises(SystemExit, match="--sync-debug needs --device cuda"):
        bench.run(_args(tmp_path, "--sync-debug", "error"))


def test_sync_debug_names_the_known_causes() -> None:
    from mmviews.bench.train_measure import explain_synchronisation

    site = "/venv/lib/python3.11/site-packages/torch"
    assert "GradScaler" in explain_synchronisation(f"{site}/amp/grad_scaler.py:451")
    assert "SyncBatchNorm" in explain_synchronisation(f"{site}/nn/modules/_functions.py:88")
    assert "log steps" in explain_synchronisation("/work/mmviews/train/trainer.py:224 (_check_losses): error")
    assert "batch sizes" in explain_synchronisation("/work/mmviews/objectives/_distributed.py:77")
    assert explain_synchronisation("/work/mmviews/modalities/text.py:12") is None  # a new one: worth a look


def test_host_read_recorder_sees_reads_and_value_sized_ops() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    with HostReadRecorder() as recorder:
        recorder.step = "a"
        float(x.sum())
        x.tolist()
        bool(x.all())
        x[x > 0]  # boolean mask: nonzero underneath
        with recorder.paused():
            x.max().item()
        y = x * 2  # no read
    ops = [(r.op, r.step) for r in recorder.reads]
    assert ("__float__", "a") in ops and ("tolist", "a") in ops and ("__bool__", "a") in ops
    assert any("boolean mask" in op or op == "nonzero" for op, _ in ops)
    assert all(r.where.startswith("tests/") or "test_bench_train.py" in r.where for r in recorder.reads)
    assert len(ops) == 4 and y.shape == (3,)


@pytest.mark.parametrize("chunk", [None, 8], ids=["plain", "cached"])
def test_bench_times_the_trainers_own_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None) -> None:
    """The bench's phase-timed step is a call of the trainer's train_step (its cached step with
    optimisation.encode_chunk_size) with a phase_end callback, which reports the step's phases
    in order and changes nothing it computes: same weights after the same batches as the plain
    loop (train_step without a callback, then the teacher update)."""
    config = load_config(resolve_recipe("quickstart"), [*SMALL, "cpu=true", f"optimisation.encode_chunk_size={chunk or 'null'}"])
    calls: list[object] = []
    monkeypatch.setattr(train_measure, "train_step", lambda *a: (calls.append(a[3] if len(a) > 3 else None), train_step(*a))[1])
    weights, ends = [], []
    for timed in (False, True):
        parts = build_run(config, 1, with_eval=False)
        p = prepare_run(make_accelerator(config, tmp_path / str(timed)), parts)
        assert p.encode_chunk_size == chunk
        p.model.train()
        batches = batches_forever(p, parts)
        for _ in range(2):
            if timed:
                seconds = train_measure.step_phases(p, batches, config.optimisation.max_grad_norm,
                                            lambda: ends.append(len(calls)))
                assert list(seconds) == list(train_measure.PHASES) and all(v >= 0 for v in seconds.values())
            else:
                train_measure.loop_step(p, next(batches), config.optimisation.max_grad_norm)
        weights.append({k: v.detach().clone() for k, v in p.model.state_dict().items()})
    assert [c is None for c in calls] == [True, True, False, False]  # the loop without a clock, the bench with
    assert isinstance(calls[-1], train_measure.PhaseClock)
    assert len(ends) == 2 * (len(train_measure.PHASES) + 1)  # each phase's end waits for the device; the loop's teacher too
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


@pytest.mark.parametrize("chunk", [None, 4], ids=["plain", "cached"])
def test_train_step_reports_its_phases_in_order(tmp_path: Path, chunk: int | None) -> None:
    """phase_end is called once per phase, in the order of PHASES, after the work it names:
    the loss exists at the objective's end, the gradients at the backward's, and they are cleared
    again (zero_grad) at the optimiser's. A tiny run (an MLP on 1-D latents)."""
    from test_train_sync import gaussian_config

    from mmviews.config import config_from_dict

    raw = gaussian_config({"name": "mv_infonce", "params": {"temperature": 0.2}})
    raw["optimisation"]["encode_chunk_size"] = chunk
    config = config_from_dict(raw)
    parts = build_run(config, 1, with_eval=False)
    p = prepare_run(make_accelerator(config, tmp_path), parts)
    model = p.accelerator.unwrap_model(p.model)
    seen: list[tuple[str, bool, bool]] = []

    def phase_end(name: str) -> None:
        seen.append((name, p.nonfinite is not None, any(q.grad is not None for q in model.parameters())))

    train_step(p, next(batches_forever(p, parts)), config.optimisation.max_grad_norm, phase_end)
    assert seen == [("flow", False, False), ("forward", False, False), ("objective", True, False),
                    ("backward", True, True), ("optimiser", True, False)]
    assert (STEP_PHASES == ("flow", "forward", "objective", "backward", "optimiser")
            and train_measure.PHASES == ("data", *STEP_PHASES))


def test_gradient_checkpointing_option(tmp_path: Path) -> None:
    """--gradient-checkpointing measures the recipe with every adapter that has it checkpointing
    (here one row, as each row of a comparison is measured in its own process)."""
    assert bench.run(_args(tmp_path, "--gradient-checkpointing", "--no-compare")) == 0
    (row,) = json.loads((tmp_path / "bench.json").read_text())["cases"]
    assert row["step"] == "plain+ckpt" and row["gradient_checkpointing"] == ["audio", "flow", "image", "text"]
    assert row["encode_chunk_size"] is None and row["samples_per_s"] > 0
    config = train_cases.with_gradient_checkpointing(load_config(resolve_recipe("quickstart")))
    assert all(a["gradient_checkpointing"] for a in config.adapters.values())


def test_comparison_plumbing(tmp_path: Path) -> None:
    """The plain row's options: the ones under test removed, K set by --plain-K; ratios."""
    args = _args(tmp_path, "--encode-chunk-size", "8", "--gradient-checkpointing", "--plain-K", "4")
    argv = bench.argv_of(args)
    assert "--encode-chunk-size" in argv and "--gradient-checkpointing" in argv
    plain = bench._plain_argv(argv, "quickstart", args)
    assert "--encode-chunk-size" not in plain and "--gradient-checkpointing" not in plain and "--plain-K" not in plain
    assert plain[-2:] == ["--set", "data.batch_size=4"]
    realistic = bench._plain_argv(argv, "realistic", args)
    assert realistic[realistic.index("--realistic-K") + 1] == "4"
    ratios = train_report.compare({"case": "quickstart", "step": "cached/8", "K": 16, "peak_memory_mb": 300.0,
                            "samples_per_s": 10.0},
                           {"case": "quickstart", "step": "plain", "K": 4, "peak_memory_mb": 1000.0,
                            "samples_per_s": 12.0})
    assert ratios["peak_memory_ratio"] == pytest.approx(0.3) and ratios["time_per_sample_ratio"] == pytest.approx(1.2)
    with pytest.raises(SystemExit, match="--encode-chunk-size must be >= 1"):
        bench.run(_args(tmp_path, "--encode-chunk-size", "0"))
    with pytest.raises(SystemExit, match="--plain-K needs --encode-chunk-size, --gradient-checkpointing or --compile"):
        bench.run(_args(tmp_path, "--plain-K", "8"))


def test_compile_comparison_plumbing(tmp_path: Path) -> None:
    """--compile: the compiled row sets optimisation.compile, the eager row drops the flag; the
    compile time is the compiled warm-up beyond the eager one, and it pays after that time over
    the time each step saves."""
    args = _args(tmp_path, "--compile")
    assert bench._compared(args) and "optimisation.compile=true" in train_cases._overrides_of(args)
    argv = bench.argv_of(args)
    assert "--compile" in argv and "--compile" not in bench._plain_argv(argv, "quickstart", args)
    # compiled alone is measured against the same step eager: finetune-small keeps its cached step
    assert bench._plain_argv(argv, "finetune-small", args) == [w for w in argv if w != "--compile"]
    row = {"case": "quickstart", "K": 16, "peak_memory_mb": 1100.0, "samples_per_s": 16 / 0.8}
    compiled = {**row, "step": "plain+compiled", "compiled": True, "warmup_s": [40.0, 3.0], "step_ms": 800.0}
    eager = {**row, "step": "plain", "compiled": False, "warmup_s": [2.0, 1.0], "step_ms": 1000.0,
             "samples_per_s": 16.0}
    c = train_report.compare(compiled, eager)
    assert c["compile_s"] == pytest.approx(40.0) and c["break_even_steps"] == pytest.approx(200.0)
    assert c["time_per_sample_ratio"] == pytest.approx(0.8)
    slower = train_report.compare({**compiled, "step_ms": 1100.0}, eager)
    assert slower["break_even_steps"] is None
    table = train_report.format_table({"environment": {"threads": 2}, "cases": [], "comparisons": [c, slower]})
    assert "compile time 40.0 s" in table and "pays after 200 steps" in table and "never (not faster)" in table


@pytest.mark.parametrize("flag,module", [(("--sharded",), "mmviews.bench.sharded"),
                                         (("--against-sentence-transformers", "8"), "mmviews.bench.text_step")])
def test_sharded_and_text_step_runs_go_to_their_own_module(tmp_path: Path, monkeypatch, flag, module) -> None:
    """`mmviews bench train FLAG` runs FLAG's own module; `python -m mmviews.bench.train FLAG`
    refuses it in one line instead of running the plain bench."""
    import importlib

    from mmviews.bench.cli import run as bench_command

    called = []
    monkeypatch.setattr(importlib.import_module(module), "run", lambda options: called.append(options) or 0)
    assert bench_command(argparse.Namespace(verb="train", options=[*flag, "--output", str(tmp_path / "o.json")])) == 0
    assert len(called) == 1
    with pytest.raises(SystemExit, match=f"{flag[0]} runs through the command"):
        bench.run(_args(tmp_path, *flag))
