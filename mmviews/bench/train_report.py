"""What ``mmviews bench train`` reports: a step under test against the plain step
(:func:`compare`), the parts of a ``--check`` estimate, and the human-readable table."""

from __future__ import annotations

from typing import Any

from mmviews.bench.train_measure import PHASES
from mmviews.train.memory import MemoryEstimate

_SHORT = {"data": "data", "flow": "flow", "forward": "fwd", "objective": "loss", "backward": "bwd", "optimiser": "optim"}


def estimate_parts_mb(estimate: MemoryEstimate) -> dict[str, float]:
    """The parts of a :class:`~mmviews.train.memory.MemoryEstimate`, in MB."""
    names = ("baseline", "framework", "sample_cache", "parameters", "gradients", "optimizer_state", "teacher",
             "batches", "activations", "working", "objective", "evaluation", "evaluation_kept", "step_alone", "step",
             "total")
    return {name: getattr(estimate, name) / 2**20 for name in names}


def compare(variant: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The step under test against the plain step: peak memory and time per sample, as ratios;
    for a compiled step also its compile time (:func:`compile_cost`)."""
    return {
        "case": variant["case"], "step": variant["step"], "K": variant["K"], "plain_K": plain["K"],
        "peak_memory_ratio": variant["peak_memory_mb"] / plain["peak_memory_mb"],
        "time_per_sample_ratio": plain["samples_per_s"] / variant["samples_per_s"],
        **(compile_cost(variant, plain) if variant.get("compiled") else {}),
    }


def compile_cost(compiled: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """What compiling costs and when it pays: ``compile_s``, the seconds the compiled run's
    warm-up steps took beyond the eager run's (the first step of each new shape compiles), and
    ``break_even_steps``, the steps after which the compiled run is ahead (None when its steps
    are not faster)."""
    compile_s = sum(compiled["warmup_s"]) - sum(eager["warmup_s"])
    saved_s = (eager["step_ms"] - compiled["step_ms"]) / 1000
    return {"compile_s": compile_s, "eager_step_ms": eager["step_ms"], "compiled_step_ms": compiled["step_ms"],
            "break_even_steps": max(0.0, compile_s) / saved_s if saved_s > 0 else None}


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a :func:`run` result."""
    env = result["environment"]
    devices = sorted({row["device"] for row in result["cases"]})
    gpu = f" ({env['cuda_device']})" if any(d.startswith("cuda") for d in devices) and "cuda_device" in env else ""
    allocator = ", ".join(sorted({row.get("host_memory", "system") for row in result["cases"]}))
    lines = [f"bench train on {', '.join(devices)}{gpu}, {env['threads']} CPU threads, host memory {allocator}; step ms: "
             "median of the timed steps; phase shares of their total",
             f"{'case':<15}{'step':<15}{'K':>5}{'M':>3}{'steps':>6}{'workers':>8}{'cache':>6}{'samples/s':>11}{'views/s':>10}{'step ms':>9}"
             + "".join(f"{_SHORT[name] + '%':>7}" for name in PHASES) + f"{'peak MB':>9}{'est MB':>8}{'params M':>10}"]
    for row in result["cases"]:
        lines.append(f"{row['case']:<15}{row.get('step', 'plain'):<15}{row['K']:>5}{row['M']:>3}{row['steps']:>6}{row['num_workers']:>8}"
                     f"{row.get('data_cache', '-'):>6}"
                     f"{row['samples_per_s']:>11.1f}{row['views_per_s']:>10.1f}{row['step_ms']:>9.1f}"
                     + "".join(f"{100 * row['phase_share'][name]:>7.1f}" for name in PHASES)
                     + f"{row['peak_memory_mb']:>9.0f}"
                     + (f"{row['estimated_memory_mb']:>8.0f}" if row.get("estimated_memory_mb") else f"{'-':>8}")
                     + f"{row['params_M']:>10.1f}")
    for row in result["cases"]:
        if row.get("estimated_memory_mb"):
            measured = row["peak_reserved_mb"] or row["peak_memory_mb"]
            what = "max_memory_reserved" if row["peak_reserved_mb"] else "peak RSS"
            lines.append(f"{row['case']} {row.get('step', 'plain')} K = {row['K']}: memory estimate of the training "
                         f"step (--check) {row['estimated_memory_mb']:.0f} MB vs measured {what} {measured:.0f} MB "
                         f"({100 * (row['estimated_memory_mb'] / measured - 1):+.1f} %)"
                         + (f"; framework state {row['estimate']['framework']:.0f} MB estimated, the first step "
                            f"left {row['first_step_residue_mb']:.0f} MB" if row.get("first_step_residue_mb") is not None
                            and "framework" in row["estimate"] else ""))
    for c in result.get("comparisons", []):
        lines.append(f"{c['case']}: {c['step']} at K = {c['K']} vs plain at K = {c['plain_K']}: peak memory "
                     f"{c['peak_memory_ratio']:.2f}x, time per sample {c['time_per_sample_ratio']:.2f}x")
        if "compile_s" in c:
            even = "never (not faster)" if c["break_even_steps"] is None else f"after {c['break_even_steps']:.0f} steps"
            lines.append(f"  compiled step {c['compiled_step_ms']:.0f} ms vs eager {c['eager_step_ms']:.0f} ms; compile "
                         f"time {c['compile_s']:.1f} s (warm-up steps beyond eager's); pays {even}")
    for row in result["cases"]:
        if row["sync_debug"]:
            s = row["sync_debug"]
            causes = s.get("causes", {})
            first = f"; first: {s['first_error']} ({causes.get(s['first_error'], '?')})" if s["first_error"] else ""
            lines.append(f"{row['case']}: sync debug ({s['mode']}): {sum(s['synchronisations'].values())} "
                         f"synchronisation(s) in {s['steps']} steps{first}")
            lines += [f"  {n} x {where}: {causes.get(where, '?')}" for where, n in s["synchronisations"].items()]
        if row["host_reads"]:
            h = row["host_reads"]
            lines.append(f"{row['case']}: {h['per_step']:.1f} host read(s) per step outside the loader:")
            lines += [f"  {n} x {what}" for what, n in h["by_origin"].items()]
    return "\n".join(lines)
