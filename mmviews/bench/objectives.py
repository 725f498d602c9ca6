"""``mmviews bench objectives``: speed and peak memory of every objective, forward + backward.

For each objective on ``z`` ``[K, M, d]`` (random normal, ``requires_grad``) it measures, in one
run and with the calls interleaved round-robin (so that load from other processes hits every
contender alike):

- the median wall time of ``loss = objective(z); loss.backward()``;
- the peak memory of that call (see "Memory" below);
- both as ratios to the *floor*: a plain ``F.cross_entropy`` over one ``[K*M, K*M]`` score
  matrix of the normalised ``z`` (what any objective that needs every score pays at least);
- the speed-up over the *reference loops* of :mod:`mmviews.objectives.reference` (the
  equations written as Python loops over samples and views, float64 scalars; see
  :data:`REFERENCE_LOSSES` for the objectives that have one). Their Python-level work grows as
  K^2 M^2 and more (about 0.1-0.4 s per call at K = 8, M = 8 on one CPU thread, minutes at
  K = 256), so this column is measured at a smaller batch: the first ``--reference-K``
  samples (default 8) of the same ``z``, all M views and d, with the library timed again on
  exactly that batch (its dtype as ``--dtype``; the reference computes in float64 whatever the
  input, its cost being per-operation overhead rather than arithmetic). Before timing, each
  reference is checked, in float64 on that batch, to give the library's value; a mismatch
  aborts the benchmark. ``--reference-K 0`` skips the column. (``ipmc`` has none: its
  reference sums over every positive-negative pair, about 20 s per call at K = 8, M = 8.)

Clock and threads. On CPU the default is ``--threads 1 --clock cpu``: this process's CPU
time (``time.process_time``) on one intra-op thread, which other processes' load barely moves
(with more threads, idle threads spinning would count). This is how the figures of docs/objectives.md were
measured. ``--clock wall`` times elapsed time instead (the default on CUDA, where only wall
time means anything; ``--threads`` then defaults to torch's).

Noise. Every contender runs ``--repeats`` times (default 10), interleaved round-robin, after
``--warmup`` untimed rounds. Each time-vs-floor ratio is the median of the per-round ratios
(objective time / floor time of the same round), reported with their interquartile range
(``time_vs_floor_iqr``) and the timed calls' spread (``times_ms``). A target is ``ok`` or
``MISS`` when the whole IQR lies on one side of its bound, and ``noisy`` when the IQR
straddles it: rerun with more ``--repeats`` on a quieter machine before calling it a miss.

Objectives defined for a fixed number of views (``simclr``: 2) run on the first views of ``z``
and are compared with a floor of the same size.

Memory. On CUDA: ``torch.cuda.max_memory_allocated`` during the call (after
``reset_peak_memory_stats``). On CPU: the peak of the total size of live tensors over the
timeline that torch's memory profiler reconstructs from the allocator's events
(``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`` and
``torch.profiler._memory_profiler.MemoryProfileTimeline``, the data behind
``profile.export_memory_timeline``). Both count tensor memory only (``z`` and its gradient
included, allocator caching excluded), so the ratio to the floor is like for like. The CPU
numbers come from a separate profiled call, not from the timed ones. If the (private)
timeline API is unavailable the memory columns are ``null``; we do not fall back to process
RSS, which the allocator's caching makes meaningless at this scale.

Precision: under ``--dtype bfloat16`` the objectives compute in float32 (their contract), and so
does the floor; float64 inputs are computed in float64.
"""

from __future__ import annotations

import argparse
import inspect
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mmviews.bench.common import round_robin, synchroniser, tensor_peak_bytes_of, verb_main
from mmviews.bench.report import environment, write_report
from mmviews.objectives import get_objective, list_objectives, objective_class, reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

# Objectives that need constructor parameters in the benchmark (others use their defaults).
BENCH_PARAMS: dict[str, dict[str, Any]] = {
    "fmicl": {"divergence": "kl"},
    "ipmc": {"beta": 0.0},
}

# name -> list of (metric, bound) with metric one of time_vs_floor, memory_vs_floor (<= bound)
# or speedup_vs_reference (>= bound): the project's targets at K = 256, M = 8, d = 128, float32.
_POLY = [("time_vs_floor", 1.5), ("memory_vs_floor", 3.0)]
TARGETS: dict[str, list[tuple[str, float]]] = {
    "geometric_pvc": _POLY,
    "arithmetic_pvc": _POLY,
    "sufficient_statistics": _POLY,
    "mv_infonce": _POLY,
    "mv_cl1": _POLY,
    "multi_crop": _POLY,
    "siglip": _POLY,
    "mv_dhel": [("time_vs_floor", 0.5)],
    "er": [("time_vs_floor", 0.5)],
}

ReferenceLoss = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


# ---------------------------------------------------------------------------------------------
# The floor (written here, independent of mmviews.objectives) and the reference loops
# ---------------------------------------------------------------------------------------------
def _unit(z: torch.Tensor) -> torch.Tensor:
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    return F.normalize(z.to(dtype), dim=-1)


def floor_loss(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """One cross-entropy over the [K*M, K*M] scores of the normalised z (label: the next view
    of the same sample). No masking: the least work any all-pairs objective must do."""
    K, M, d = z.shape
    u = _unit(z).reshape(K * M, d)
    scores = u @ u.T / temperature
    index = torch.arange(K * M, device=z.device)
    labels = (index // M) * M + (index % M + 1) % M
    return F.cross_entropy(scores, labels)


def _with_temperature(name: str) -> ReferenceLoss:
    return lambda z, params: reference.REFERENCES[name](z, params["temperature"])


#: name -> reference(z, params) with ``params`` the objective's constructor keywords, so that
#: the reference computes the same loss as the objective built with them.
REFERENCE_LOSSES: dict[str, ReferenceLoss] = {name: _with_temperature(name) for name in reference.REFERENCES}
REFERENCE_LOSSES["fmicl"] = lambda z, params: reference.fmicl_reference(z, **params)
REFERENCE_LOSSES["er"] = lambda z, params: reference.er_reference(z, **params)


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------
class _Step:
    """One forward + backward on the leaf ``z``; ``reset()`` drops the previous gradient (done
    outside the measured region, so that its release is not counted)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor) -> None:
        self.loss_fn, self.z = loss_fn, z

    def reset(self) -> None:
        self.z.grad = None

    def __call__(self) -> None:
        self.loss_fn(self.z).backward()


def peak_memory_bytes(call: _Step, device: torch.device) -> int | None:
    """Peak tensor memory of one ``call`` (see the module docstring), or None if unmeasurable."""
    call.reset()
    return tensor_peak_bytes_of(call, device)


def _objective_kwargs(name: str, temperature: float) -> dict[str, Any]:
    params = dict(BENCH_PARAMS.get(name, {}))
    if "temperature" in inspect.signature(objective_class(name).__init__).parameters:
        params.setdefault("temperature", temperature)
    return params


def target_verdict(ok: bool | None, bound: float, spread: list[float] | None = None) -> str:
    """``"ok"`` / ``"MISS"`` by the median (``ok``), ``"noisy"`` when the interquartile range
    ``spread`` of the per-round values straddles ``bound``, ``"?"`` when unmeasured."""
    if ok is None:
        return "?"
    if spread is not None and spread[0] <= bound <= spread[1]:
        return "noisy"
    return "ok" if ok else "MISS"


def _quartiles(samples: list[float]) -> tuple[float, float]:
    """First and third quartiles (the interquartile range; both the value itself for one sample)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _check_sizes(K: int, M: int, d: int, repeats: int, warmup: int, dtype: str, reference_K: int,
                 objectives: list[str] | None) -> list[str]:
    """A clear error for a size, dtype or objective the benchmark cannot take; the objectives' names."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    for what, value, least in (("K", K, 2), ("M", M, 2), ("d", d, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if value < least:
            raise ValueError(f"--{what} must be >= {least}, got {value}")
    if reference_K != 0 and reference_K < 2:
        raise ValueError(f"--reference-K must be 0 (no reference column) or >= 2, got {reference_K}")
    known = list_objectives()
    names = known if not objectives else list(objectives)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown objective(s) {unknown}; known objectives: {', '.join(known)}")
    return names


def _device_and_clock(device: str | None, clock: str | None, threads: int | None) -> tuple[torch.device, str]:
    """The device and the clock (see :func:`benchmark`); sets torch's threads when asked (or
    one, for the CPU clock by default)."""
    device_ = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if clock is None:  # how the figures of docs/objectives.md were measured: one thread's CPU time on CPU
        clock = "cpu" if device_.type == "cpu" else "wall"
        if clock == "cpu" and threads is None:
            threads = 1
    if clock not in CLOCKS:
        raise ValueError(f"--clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and device_.type == "cuda":
        raise ValueError("--clock cpu measures host CPU time: use --clock wall on CUDA")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return device_, clock


def _reference_check(name: str, params: dict[str, Any], z64: torch.Tensor) -> dict[str, float]:
    """The reference loop of ``name`` against the library on ``z64`` (float64, so only summation
    order differs): their values, or a RuntimeError when they disagree."""
    want = float(get_objective(name, **params).to(z64.device)(z64).detach())
    got = float(REFERENCE_LOSSES[name](z64, params))
    if not math.isclose(got, want, rel_tol=1e-7, abs_tol=1e-9):
        K, M = z64.shape[:2]
        raise RuntimeError(f"reference {name} gives {got!r} but mmviews gives {want!r} (float64, K={K}, M={M})")
    return {"library_loss": want, "reference_loss": got, "abs_diff": abs(got - want)}


def _contenders(names: list[str], base: torch.Tensor, M: int, temperature: float, device: torch.device,
                dtype: torch.dtype, reference_K: int) -> tuple[dict[str, _Step], dict[str, dict[str, Any]], dict[int, str]]:
    """The timed calls: the floor per number of views used, each objective, and for the
    objectives with a reference loop, that loop and the objective again, both on the first
    ``reference_K`` samples. Returns the calls, each objective's row so far, and the floors' names."""
    K = base.shape[0]

    def leaf(num_views: int, samples: int = K) -> torch.Tensor:
        return base[:samples, :num_views].to(device, dtype).contiguous().requires_grad_(True)

    calls: dict[str, _Step] = {}
    rows: dict[str, dict[str, Any]] = {}
    floors: dict[int, str] = {}
    for name in names:
        num_views = objective_class(name).exact_views or M
        if num_views > M:
            raise ValueError(f"objective {name!r} needs {num_views} views, more than --M {M}")
        if num_views not in floors:
            floors[num_views] = f"floor@M={num_views}"
            calls[floors[num_views]] = _Step(lambda z: floor_loss(z, temperature), leaf(num_views))
        params = _objective_kwargs(name, temperature)
        objective = get_objective(name, **params).to(device)
        calls[name] = _Step(objective, leaf(num_views))
        row: dict[str, Any] = {"params": params, "M": num_views, "floor": floors[num_views]}
        with torch.no_grad():
            row["loss"] = float(objective(leaf(num_views).detach()))
        if reference_K and name in REFERENCE_LOSSES:
            reference_loss = REFERENCE_LOSSES[name]
            calls[f"reference:{name}"] = _Step(
                lambda z, f=reference_loss, p=params: f(z, p), leaf(num_views, reference_K)
            )
            calls[f"library@reference:{name}"] = _Step(objective, leaf(num_views, reference_K))
            row["reference_check"] = _reference_check(name, params, base[:reference_K, :num_views].to(device))
        rows[name] = row
    return calls, rows, floors


def _time_and_measure(calls: dict[str, _Step], repeats: int, warmup: int, device: torch.device,
                      timer: Callable[[], float], memory: bool,
                      progress: bool) -> tuple[dict[str, list[float]], dict[str, int | None]]:
    """Seconds of each call (warm-up, then rounds over every contender in turn) and its peak
    memory. Peak memory of the objectives and floors only: the reference loops run hundreds of
    thousands of scalar ops, which the profiler would take minutes to record."""
    from tqdm import tqdm

    measured = [key for key in calls if not key.startswith(("reference:", "library@reference:"))]
    total = (warmup + repeats) * len(calls)
    with tqdm(total=total + len(measured), desc="bench objectives", disable=not progress, file=sys.stderr) as bar:

        def before(key: str) -> None:
            bar.set_postfix_str(key)
            calls[key].reset()

        times = round_robin(calls, repeats, warmup, synchroniser(device), clock=timer, before=before,
                            after=lambda key: bar.update())
        peaks: dict[str, int | None] = {key: None for key in calls}
        for key in measured:
            bar.set_postfix_str(f"memory {key}")
            peaks[key] = peak_memory_bytes(calls[key], device) if memory else None
            bar.update()
    return times, peaks


def _target_checks(name: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the project's :data:`TARGETS` for ``name`` against its row: value, ok, verdict."""
    checks = []
    for metric, bound in TARGETS.get(name, []):
        value = row[metric]
        ok = None if value is None else (value >= bound if metric == "speedup_vs_reference" else value <= bound)
        spread = row["time_vs_floor_iqr"] if metric == "time_vs_floor" else None
        checks.append({"metric": metric, "bound": bound, "value": value, "ok": ok,
                       "verdict": target_verdict(ok, bound, spread)})
    return checks


def _summarise(rows: dict[str, dict[str, Any]], floors: dict[int, str], times: dict[str, list[float]],
               peaks: dict[str, int | None], reference_K: int) -> dict[str, dict[str, Any]]:
    """The floors' rows; each objective's row completed with its times, memory, ratios to its
    floor, the reference column and the targets."""

    def summary(key: str) -> dict[str, Any]:
        peak = peaks[key]
        return {"time_ms": _median_ms(times[key]), "times_ms": [t * 1e3 for t in times[key]],
                "time_iqr_ms": [q * 1e3 for q in _quartiles(times[key])],
                "peak_mb": None if peak is None else peak / 2**20}

    floor_rows = {key: summary(key) for key in floors.values()}
    for name, row in rows.items():
        row.update(summary(name))
        floor = floor_rows[row["floor"]]
        # per-round ratios: a round's load hits the objective and its floor alike
        ratios = [t / f for t, f in zip(times[name], times[row["floor"]])]
        row["time_vs_floor"] = statistics.median(ratios)
        row["time_vs_floor_iqr"] = list(_quartiles(ratios))
        row["memory_vs_floor"] = None if row["peak_mb"] is None or not floor["peak_mb"] else row["peak_mb"] / floor["peak_mb"]
        if f"reference:{name}" in times:
            row["reference"] = {"K": reference_K, **summary(f"reference:{name}")}
            row["library_at_reference_K"] = summary(f"library@reference:{name}")
            row["speedup_vs_reference"] = row["reference"]["time_ms"] / row["library_at_reference_K"]["time_ms"]
        else:
            row["reference"], row["library_at_reference_K"], row["speedup_vs_reference"] = None, None, None
        row["targets"] = _target_checks(name, row)
    return floor_rows


def benchmark(
    K: int = 256,
    M: int = 8,
    d: int = 128,
    dtype: str = "float32",
    repeats: int = 10,
    warmup: int = 2,
    objectives: list[str] | None = None,
    temperature: float = 0.1,
    device: str | None = None,
    seed: int = 0,
    progress: bool = True,
    clock: str | None = None,
    threads: int | None = None,
    memory: bool = True,
    reference_K: int = 8,
) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result (see ``run`` for the printed table).

    ``clock`` None: ``"cpu"`` on a CPU device (with ``threads`` defaulting to 1), ``"wall"``
    on CUDA (see the module docstring)."""
    names = _check_sizes(K, M, d, repeats, warmup, dtype, reference_K, objectives)
    reference_K = min(reference_K, K)
    device_, clock = _device_and_clock(device, clock, threads)
    base = torch.randn(K, M, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    calls, rows, floors = _contenders(names, base, M, temperature, device_, DTYPES[dtype], reference_K)
    times, peaks = _time_and_measure(calls, repeats, warmup, device_, CLOCKS[clock], memory, progress)
    floor_rows = _summarise(rows, floors, times, peaks, reference_K)
    return {
        "config": {
            "K": K, "M": M, "d": d, "dtype": dtype, "repeats": repeats, "warmup": warmup,
            "temperature": temperature, "device": str(device_), "seed": seed,
            **environment(),
            "memory_method": "torch.cuda.max_memory_allocated" if device_.type == "cuda"
            else "torch.profiler memory timeline (peak live tensor bytes)",
            "clock": clock,
            "timing": f"median {clock} time of forward+backward, contenders interleaved round-robin; "
                      "time_vs_floor: median of the per-round ratios, time_vs_floor_iqr their interquartile range",
            "reference_K": reference_K,
            "reference": "mmviews.objectives.reference loops (float64) vs the library, both on the first "
            "reference_K samples of z" if reference_K else "skipped (--reference-K 0)",
        },
        "floors": floor_rows,
        "objectives": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a :func:`benchmark` result."""

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    c = result["config"]
    lines = [
        f"objectives, forward+backward: K={c['K']} M={c['M']} d={c['d']} {c['dtype']} on {c['device']} "
        f"({c['threads']} threads), median {c['clock']} time of {c['repeats']} interleaved rounds; "
        f"x floor t: median ratio [interquartile range over the rounds]; noisy: that range straddles the target",
        f"{'objective':<22}{'ms':>9}{'peak MB':>9}{'x floor t':>22}{'x floor m':>10}{'ref ms':>10}{'lib ms':>9}"
        f"{'speedup':>9}  targets   (ref/lib: reference loop and library at K={c['reference_K']})",
    ]
    for key, floor in result["floors"].items():
        lines.append(f"{key:<22}{floor['time_ms']:>9.2f}{num(floor['peak_mb'], '.1f'):>9}{'1.00':>22}{'1.00':>10}")
    for name, row in result["objectives"].items():
        ref, lib = row["reference"], row["library_at_reference_K"]
        marks = " ".join(
            f"{t['metric'].split('_')[0]}{'<=' if t['metric'] != 'speedup_vs_reference' else '>='}{t['bound']}:"
            f"{t['verdict']}"
            for t in row["targets"]
        )
        lines.append(
            f"{name:<22}{row['time_ms']:>9.2f}{num(row['peak_mb'], '.1f'):>9}"
            f"{row['time_vs_floor']:>10.2f} [{row['time_vs_floor_iqr'][0]:.2f}-{row['time_vs_floor_iqr'][1]:.2f}]"
            f"{num(row['memory_vs_floor'], '.2f'):>10}{num(ref and ref['time_ms'], '.2f'):>10}"
            f"{num(lib and lib['time_ms'], '.2f'):>9}{num(row['speedup_vs_reference'], '.1f'):>9}  {marks}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--K", type=int, default=256, help="samples per batch (default 256)")
    parser.add_argument("--M", type=int, default=8, help="views per sample (default 8)")
    parser.add_argument("--d", type=int, default=128, help="embedding dimension (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of z (default float32)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per contender (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender first (default 2)")
    parser.add_argument("--objectives", nargs="+", metavar="NAME", help="subset of objectives (default: all)")
    parser.add_argument("--temperature", type=float, default=0.1, help="temperature of every objective (default 0.1)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random z (default 0)")
    parser.add_argument("--output", "--out", dest="out", type=Path, default=Path("bench-objectives.json"),
                        help="JSON output path (--out: the same)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 with --clock cpu, else torch's)")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default=None,
        help="cpu: this process's CPU time, steady on a shared machine (default on CPU, with --threads 1; "
        "how the figures of docs/objectives.md were measured); wall: elapsed time (default on CUDA)",
    )
    parser.add_argument(
        "--reference-K", type=int, default=8,
        help="samples on which the reference loops and the library are timed for the speed-up column "
        "(default 8; the loops' cost grows as K^2 M^2; 0 skips the column)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    objectives = None
    if args.objectives:
        objectives = [name for item in args.objectives for name in item.split(",") if name]
    result = benchmark(
        K=args.K, M=args.M, d=args.d, dtype=args.dtype, repeats=args.repeats, warmup=args.warmup,
        objectives=objectives, temperature=args.temperature, device=args.device, seed=args.seed,
        progress=not args.no_progress, clock=args.clock, threads=args.threads, memory=not args.no_memory,
        reference_K=args.reference_K,
    )
    write_report(result, format_table(result), args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m mmviews.bench.objectives [options]``."""
    return verb_main("objectives", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
