"""``mmviews bench scale``: time and peak memory of the objectives at large batches, with their
score blocks streamed and unchunked, forward + backward.

It checks the promise of the streamed objectives (:mod:`mmviews.objectives._streaming`): at most
1.3x the time per score entry of the unchunked path, and a bounded peak memory where the unchunked
path no longer fits. Each case runs in its own subprocess so that one case's allocator state
cannot inflate another's. The contenders, the memory and clock definitions and the targets are in
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mmviews.bench.common import seconds_of, synchroniser, verb_main
from mmviews.bench.report import environment, write_report
from mmviews.process_memory import reset_resident_peak, resident_bytes, resident_high_water_bytes

DEFAULT_OBJECTIVES = ["geometric_pvc", "mv_infonce", "multi_crop", "fmicl", "mv_dhel", "er"]
DEFAULT_SIZES = [2048, 4096, 8192, 16384, 32768, 65536]
# Objectives that need constructor parameters here (others: temperature only).
PARAMS: dict[str, dict[str, Any]] = {"fmicl": {"divergence": "kl"}}
# The largest score block of each objective, per anchor sample, as a function of (M, N):
# all pairs [M, N, M] or within view [M, N]; and the working copies its reduction holds
# (ViewSet.pairs_reduce's ``working_copies``: f-MICL's critic keeps several block-sized buffers).
BLOCKS: dict[str, tuple[str, int]] = {
    "geometric_pvc": ("pairs", 1),
    "arithmetic_pvc": ("pairs", 1),
    "sufficient_statistics": ("pairs", 1),
    "simclr": ("pairs", 1),
    "mv_infonce": ("pairs", 1),
    "mv_cl1": ("pairs", 1),
    "multi_crop": ("pairs", 1),
    "fmicl": ("pairs", 4),
    "mv_dhel": ("views", 1),
    "mv_cl2": ("views", 1),
    "er": ("views", 1),
}
RATIO_SIZE, RATIO_BOUND = 8192, 1.3
MEMORY_SIZE, MEMORY_BOUND = 65536, 3e9


def score_entries(name: str, K: int, M: int) -> int:
    """Entries of the objective's largest score block on one process (N = K)."""
    kind, _ = BLOCKS[name]
    return K * M * K * M if kind == "pairs" else M * K * K


def streamed_chunk(name: str, K: int, M: int, element_size: int, device_type: str) -> tuple[int, bool]:
    """``(block, default_streams)``: the block (anchor samples) the objective's defaults use once
    streaming on ``device_type``, and whether they stream at this size at all."""
    from mmviews.objectives._streaming import DEFAULT_SCORE_BUDGET_MB, plan_block

    kind, copies = BLOCKS[name]
    per_sample = (M * K * M if kind == "pairs" else M * K) * copies
    rows = M if kind == "pairs" else 1
    # the block plan_block picks once the whole block is over the budget (here: forced by a
    # sample count that is), for this objective's score layout
    block = plan_block(10**12, per_sample, element_size, None, DEFAULT_SCORE_BUDGET_MB, device_type, rows)
    assert block is not None
    return block, K * per_sample * element_size > DEFAULT_SCORE_BUDGET_MB * 2**20


# ---------------------------------------------------------------------------------------------
# One case, in a subprocess
# ---------------------------------------------------------------------------------------------
def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Build ``z`` and the objective of ``case``, warm up, then time ``repeats`` calls; the first
    gives the peak memory. Returns times (s) and the peak added memory (bytes)."""
    from mmviews.objectives import get_objective, objective_class

    if case["threads"]:
        torch.set_num_threads(case["threads"])
    device = torch.device(case["device"])
    name, K, M, d = case["objective"], case["K"], case["M"], case["d"]
    params = dict(PARAMS.get(name, {}))
    if "temperature" in inspect.signature(objective_class(name).__init__).parameters:
        params["temperature"] = case["temperature"]
    params.update(case["streaming"])
    objective = get_objective(name, **params).to(device)
    generator = torch.Generator(device="cpu").manual_seed(case["seed"])
    z = torch.randn(K, M, d, generator=generator).to(device).requires_grad_(True)
    clock = time.process_time if case["clock"] == "cpu" else time.perf_counter
    sync = synchroniser(device)

    # warm-up on a small batch (library loading, kernel selection), not counted
    small = torch.randn(min(K, 64), M, d, generator=generator).to(device).requires_grad_(True)
    objective(small).backward()
    del small
    sync()

    times: list[float] = []
    peak: int | None = None
    for repeat in range(case["repeats"]):
        z.grad = None
        if repeat == 0:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            else:
                reset_resident_peak()
                before = resident_bytes()
        times.append(seconds_of(lambda: objective(z).backward(), sync, clock))
        if repeat == 0:
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - before
            else:
                peak = resident_high_water_bytes() - before
    return {"times_s": times, "peak_bytes": peak}


def _run_subprocess(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "mmviews.bench.scale", "--case", json.dumps(case)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit code {done.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------
def benchmark(
    objectives: list[str] | None = None,
    sizes: list[int] | None = None,
    M: int = 8,
    d: int = 128,
    unchunked_max: int = 16384,
    repeats: int = 3,
    repeat_max: int = 16384,
    clock: str | None = None,
    threads: int | None = 1,
    device: str | None = None,
    temperature: float = 0.1,
    seed: int = 0,
    timeout: float = 3600.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every case (see docs/benchmarks.md); returns the JSON-able result."""
    from mmviews.objectives import list_objectives

    names = list(objectives or DEFAULT_OBJECTIVES)
    unknown = [n for n in names if n not in list_objectives()]
    if unknown:
        raise ValueError(f"unknown objective(s) {unknown}; known: {', '.join(list_objectives())}")
    unsupported = [n for n in names if n not in BLOCKS]
    if unsupported:
        raise ValueError(f"objective(s) {unsupported} have no streamed score block to benchmark; supported: {', '.join(BLOCKS)}")
    sizes = list(sizes or DEFAULT_SIZES)
    bad = [s for s in sizes if s % M or s // M < 2]
    if bad:
        raise ValueError(f"--sizes must be multiples of --M {M} with K = size / M >= 2, got {bad}")
    device_ = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    clock = clock or ("cpu" if device_.type == "cpu" else "wall")
    if clock not in ("cpu", "wall"):
        raise ValueError(f"--clock must be cpu or wall, got {clock!r}")
    if clock == "cpu" and device_.type == "cuda":
        raise ValueError("--clock cpu measures host CPU time: use --clock wall on CUDA")
    for what, value in (("repeats", repeats), ("d", d), ("M", M)):
        if value < 1:
            raise ValueError(f"--{what} must be >= 1, got {value}")

    rows: list[dict[str, Any]] = []
    for size in sorted(sizes):
        K = size // M
        for name in names:
            block, default_streams = streamed_chunk(name, K, M, 4, device_.type)
            contenders = {"streamed": {} if default_streams else {"chunk_size": block}}
            if size <= unchunked_max:
                contenders = {"unchunked": {"score_budget_mb": float("inf")}, **contenders}
            for mode, streaming in contenders.items():
                case = {
                    "objective": name, "K": K, "M": M, "d": d, "device": str(device_), "clock": clock,
                    "threads": threads, "temperature": temperature, "seed": seed, "streaming": streaming,
                    "repeats": repeats if size <= repeat_max else 1,
                }
                if progress:
                    print(f"[bench scale] K*M={size} {name} {mode} {streaming} ...", file=sys.stderr, flush=True)
                result = _run_subprocess(case, timeout)
                row = {"objective": name, "KM": size, "K": K, "mode": mode, "streaming": streaming,
                       "block": block if mode == "streamed" else None, "entries": score_entries(name, K, M), **result}
                if "times_s" in result:
                    row["time_s"] = statistics.median(result["times_s"])
                    row["ns_per_entry"] = row["time_s"] / row["entries"] * 1e9
                rows.append(row)
                if progress:
                    shown = {k: row.get(k) for k in ("time_s", "peak_bytes", "error") if k in row}
                    print(f"[bench scale]   {shown}", file=sys.stderr, flush=True)

    def find(name: str, size: int, mode: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["objective"] == name and r["KM"] == size and r["mode"] == mode), None)

    targets = []
    for name in names:
        streamed, unchunked = find(name, RATIO_SIZE, "streamed"), find(name, RATIO_SIZE, "unchunked")
        if streamed and unchunked and "time_s" in streamed and "time_s" in unchunked:
            ratio = streamed["ns_per_entry"] / unchunked["ns_per_entry"]
            targets.append({"objective": name, "metric": f"streamed/unchunked time per entry at K*M={RATIO_SIZE}",
                            "value": ratio, "bound": RATIO_BOUND, "ok": ratio <= RATIO_BOUND})
        big = find(name, MEMORY_SIZE, "streamed")
        if big is not None:
            peak = big.get("peak_bytes")
            targets.append({"objective": name, "metric": f"streamed peak memory at K*M={MEMORY_SIZE}",
                            "value": peak, "bound": MEMORY_BOUND, "ok": None if peak is None else peak < MEMORY_BOUND})
    return {
        "config": {
            "M": M, "d": d, "sizes": sorted(sizes), "objectives": names, "unchunked_max": unchunked_max,
            "repeats": repeats, "repeat_max": repeat_max, "clock": clock, "device": str(device_),
            "temperature": temperature, "seed": seed,
            # the cases' own thread count (None: torch's default), not this process's
            **environment(), "threads": threads,
            "memory": "CUDA max_memory_allocated added by the first call" if device_.type == "cuda"
            else "resident-set high-water mark added by the first call (subprocess per case)",
        },
        "rows": rows,
        "targets": targets,
    }


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a :func:`benchmark` result."""
    c = result["config"]
    lines = [
        f"objectives at scale, forward+backward: M={c['M']} d={c['d']} float32 on {c['device']} "
        f"({c['threads']} threads), median {c['clock']} time; peak = memory added by the call; "
        "block: anchor samples per block (* = chosen by the default parameters); MB = 1e6 bytes",
        f"{'objective':<15}{'K*M':>7}  {'mode':<10}{'block':>6}{'time s':>10}{'ns/entry':>10}{'peak MB':>10}{'x unchunked t':>15}",
    ]
    by_key = {(r["objective"], r["KM"], r["mode"]): r for r in result["rows"]}
    for row in result["rows"]:
        base = by_key.get((row["objective"], row["KM"], "unchunked"))
        ratio = "-"
        if row["mode"] == "streamed" and base and "time_s" in base and "time_s" in row:
            ratio = f"{row['ns_per_entry'] / base['ns_per_entry']:.2f}"
        chunk = "-" if row["block"] is None else f"{row['block']}{'' if 'chunk_size' in row['streaming'] else '*'}"
        if "error" in row:
            lines.append(f"{row['objective']:<15}{row['KM']:>7}  {row['mode']:<10}{chunk:>6}  failed: {row['error']}")
            continue
        peak = "-" if row.get("peak_bytes") is None else f"{row['peak_bytes'] / 1e6:.0f}"
        lines.append(
            f"{row['objective']:<15}{row['KM']:>7}  {row['mode']:<10}{chunk:>6}{row['time_s']:>10.3f}"
            f"{row['ns_per_entry']:>10.3f}{peak:>10}{ratio:>15}"
        )
    lines.append("targets:")
    for t in result["targets"]:
        value = t["value"]
        shown = "-" if value is None else (f"{value / 1e6:.0f} MB" if "memory" in t["metric"] else f"{value:.2f}")
        bound = f"{t['bound'] / 1e9:.0f} GB" if "memory" in t["metric"] else f"{t['bound']}"
        status = "ok" if t["ok"] else ("MISS" if t["ok"] is False else "?")
        lines.append(f"  {t['objective']:<15}{t['metric']}: {shown} (bound {bound}) {status}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objectives", nargs="+", metavar="NAME", help=f"objectives (default: {' '.join(DEFAULT_OBJECTIVES)})")
    parser.add_argument("--sizes", nargs="+", type=int, metavar="KM", help="views per step K*M (default 2048 ... 65536)")
    parser.add_argument("--M", type=int, default=8, help="views per sample (default 8)")
    parser.add_argument("--d", type=int, default=128, help="embedding dimension (default 128)")
    parser.add_argument("--unchunked-max", type=int, default=16384, help="largest K*M run unchunked (default 16384)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case up to --repeat-max (default 3)")
    parser.add_argument("--repeat-max", type=int, default=16384, help="above this K*M, one timed call per case (default 16384)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None, help="cpu (default on CPU) or wall (CUDA)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each case (default 1; 0: torch's default)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--temperature", type=float, default=0.1, help="temperature (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of z (default 0)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per case before it is stopped (default 3600)")
    parser.add_argument("--output", "--out", dest="out", type=Path, default=Path("bench-scale.json"),
                        help="JSON output path (--out: the same)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case and print its JSON


def run(args: argparse.Namespace) -> int:
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    objectives = None
    if args.objectives:
        objectives = [name for item in args.objectives for name in item.split(",") if name]
    result = benchmark(
        objectives=objectives, sizes=args.sizes, M=args.M, d=args.d, unchunked_max=args.unchunked_max,
        repeats=args.repeats, repeat_max=args.repeat_max, clock=args.clock, threads=args.threads or None,
        device=args.device, temperature=args.temperature, seed=args.seed, timeout=args.timeout,
        progress=not args.no_progress,
    )
    write_report(result, format_table(result), args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m mmviews.bench.scale [options]``."""
    return verb_main("scale", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
