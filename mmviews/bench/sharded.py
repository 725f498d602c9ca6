"""``mmviews bench train --sharded``: what sharding (``distributed.sharding: fsdp``) saves per
process, and what it costs per step, in one run.

Each case (``--case finetune-small``, ``base-sizes``...) is trained for ``--warmup`` + ``--steps``
steps three times, each a fresh set of real processes (gloo on CPU, NCCL on GPU, started as
``torchrun`` starts its workers): one process (unsharded), two unsharded processes (DDP) and two
sharded ones (FSDP2). After the steps each process counts the bytes it holds of the encoder's
parameters, of their gradients and of the optimiser's state (its local shards when sharded; the
objective's own parameters, e.g. IPMC's critic, are not the encoder's and are left out), and
the median step time. The table gives these per process (rank 0's; the shards of the ranks
differ by at most one row of a tensor) and the ratios sharded / unsharded at two processes
(memory: about 1/2; step time: what the gathers and reduce-scatters cost).

Beside them, for the cases ``mmviews train --check`` can estimate (not ``base-sizes``), each
setup's training-step estimate (:func:`mmviews.train.memory.estimate_memory` for that process
count and sharding, made in a fresh process as a user's ``--check`` is) against rank 0's measured
peak: its resident-set high-water mark on CPU, ``torch.cuda.max_memory_reserved`` on CUDA.

The ``base-sizes`` case is ``finetune-small`` with the full-size random-weight backbones of
:func:`mmviews.modalities.presets.realistic_config` (BERT-base, HuBERT-base, open_clip
ViT-B/32) at K = 4 samples and the small inputs: the static memory of real backbone sizes
without a long CPU step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

#: (processes, sharding) of each measured set of processes, in order.
SETUPS = ((1, "none"), (2, "none"), (2, "fsdp"))


def local_bytes(tensors: Any) -> int:
    """Bytes this process holds of ``tensors``: a sharded tensor (DTensor) counts its local shard."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def held_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """The encoder's parameters, gradients and optimiser state held by this process."""
    from mmviews.train.memory import tensors_in

    raw = getattr(optimizer, "optimizer", optimizer)
    params = list(model.parameters())
    return {"parameters": local_bytes(params), "gradients": local_bytes([p.grad for p in params]),
            "optimizer_state": local_bytes(list(tensors_in(list(raw.state.values()))))}


def _worker(args: argparse.Namespace, out: Path) -> None:
    """One process of a measured setup: build the case, prepare it as ``mmviews train`` does,
    run the steps, write rank 0's figures to ``out``."""
    from mmviews.bench.train_cases import build_case
    from mmviews.process_memory import resident_high_water_bytes
    from mmviews.train.distributed import process_state
    from mmviews.train.setup import batches_forever, make_accelerator, prepare_run
    from mmviews.train.step import train_step

    parts = build_case(args.case, args)
    config = parts.config
    process_state(config)
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-sharded-") as tmp:
        accelerator = make_accelerator(config, Path(tmp))
        p = prepare_run(accelerator, parts)
        batches = batches_forever(p, parts)
        p.model.train()
        times = []
        for i in range(args.warmup + args.steps):
            batch = next(batches)
            start = time.perf_counter()
            train_step(p, batch, config.optimisation.max_grad_norm)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        # the peak of the training steps, before the extra backward below
        if accelerator.device.type == "cuda":
            peak_mb = torch.cuda.max_memory_reserved(accelerator.device) / 2**20
        else:
            peak_mb = resident_high_water_bytes() / 2**20
        held = held_bytes(accelerator.unwrap_model(p.model), p.optimizer)
        # Gradients are cleared after each step: count them after a backward without the step.
        z, _ = p.model(next(batches))
        z.float().sum().backward()
        held["gradients"] = local_bytes([q.grad for q in accelerator.unwrap_model(p.model).parameters()])
        if accelerator.is_main_process:
            out.write_text(json.dumps({"step_s": statistics.median(times), "sharded": p.sharded, "peak_memory_mb": peak_mb,
                                       "num_processes": accelerator.num_processes, **held}))
        accelerator.wait_for_everyone()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_setup(argv: list[str], processes: int, sharding: str, timeout: float = 3600) -> dict[str, Any]:
    """``processes`` real processes of this module's worker over the bench arguments ``argv``."""
    with tempfile.TemporaryDirectory(prefix="mmviews-bench-sharded-") as tmp:
        out = Path(tmp) / "rank0.json"
        command = [sys.executable, "-m", "mmviews.bench.sharded", "--worker-output", str(out), *argv,
                   "--set", f"distributed.sharding={sharding}"]
        port = str(_free_port())
        procs = []
        for rank in range(processes):
            env = dict(os.environ)
            if processes > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                           LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen(command, env=env))
        codes = [proc.wait(timeout=timeout) for proc in procs]
        if any(codes) or not out.is_file():
            raise RuntimeError(f"bench train --sharded: {processes} process(es), sharding {sharding}: exit "
                               f"statuses {codes}: {' '.join(command)}")
        return {"processes": processes, "sharding": sharding, **json.loads(out.read_text())}


def _mb(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def estimate_setup(case: str, argv: list[str], processes: int, sharding: str) -> dict[str, Any]:
    """The training-step estimate of ``mmviews train --check`` for ``processes`` processes and
    ``sharding``, made in a fresh process, on the workers' thread count."""
    from mmviews.bench.train import estimate_in_subprocess
    from mmviews.bench.train_report import estimate_parts_mb

    threads = [] if "--threads" in argv else ["--threads", "1"]  # the workers' default (main below)
    estimate = estimate_in_subprocess(case, [*argv, *threads, "--set", f"distributed.sharding={sharding}",
                                             "--estimate-processes", str(processes)])
    return {"estimated_memory_mb": estimate.step / 2**20, "estimate": estimate_parts_mb(estimate)}


def run_sharded(case: str, argv: list[str]) -> dict[str, Any]:
    """The three setups of ``case`` and their ratios (with ``--check``'s estimate of each, where
    the case has one)."""
    from mmviews.bench.train_cases import has_estimate

    rows = []
    for n, sharding in SETUPS:
        row = measure_setup([*argv, "--case", case], n, sharding)
        if has_estimate(case):
            row.update(estimate_setup(case, argv, n, sharding))
            row["estimate_over_peak"] = row["estimated_memory_mb"] / row["peak_memory_mb"]
        rows.append(row)
    unsharded, sharded = rows[1], rows[2]
    held = ("parameters", "gradients", "optimizer_state")
    ratios = {f"{k}_sharded_over_unsharded": sharded[k] / unsharded[k] if unsharded[k] else None for k in held}
    ratios["step_time_sharded_over_unsharded"] = sharded["step_s"] / unsharded["step_s"]
    return {"case": case, "setups": rows, "ratios": ratios}


def format_sharded(results: list[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        estimated = any("estimated_memory_mb" in row for row in result["setups"])
        lines.append(f"case {result['case']}: per process (rank 0), MiB        parameters  gradients  optimiser"
                     "    step s" + ("   peak  estimate  est/peak" if estimated else ""))
        for row in result["setups"]:
            what = f"{row['processes']} process{'es' if row['processes'] > 1 else ''}, sharding {row['sharding']}"
            line = (f"  {what:<46}{_mb(row['parameters'])}  {_mb(row['gradients'])}  "
                    f"{_mb(row['optimizer_state'])}  {row['step_s']:8.3f}")
            if "estimated_memory_mb" in row:
                line += f" {row['peak_memory_mb']:6.0f}  {row['estimated_memory_mb']:8.0f}  {row['estimate_over_peak']:8.2f}"
            lines.append(line)
        r = result["ratios"]
        lines.append("  sharded / unsharded at 2 processes: " + ", ".join(
            f"{k.split('_sharded')[0]} {v:.3f}" for k, v in r.items() if v is not None))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """A worker: ``python -m mmviews.bench.sharded --worker-output FILE BENCH_TRAIN_OPTIONS``."""
    from mmviews.bench.train import add_arguments
    from mmviews.bench.train_cases import steps_of

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mmviews.bench.sharded")
    parser.add_argument("--worker-output", type=Path, required=True)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.owns_process = True  # a worker process of this bench's own (host_memory applies as in mmviews train)
    args.case = args.case[0]
    args.steps, args.warmup = steps_of(args.case, args)
    torch.set_num_threads(args.threads or 1)
    _worker(args, args.worker_output)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def run(args: argparse.Namespace) -> int:
    """``mmviews bench train --sharded``: each case on 1, 2 unsharded and 2 sharded processes."""
    from mmviews.bench.report import environment, write_report
    from mmviews.bench.train import argv_of

    argv = list(argv_of(args))
    args.case = args.case or ["quickstart", "realistic"]  # bench train's cases when none is named
    results = [run_sharded(case, argv) for case in dict.fromkeys(args.case)]
    result = {"environment": environment(details=True),
              "command": " ".join(["mmviews", "bench", "train", "--sharded", "--case", *args.case, *argv]),
              "sharded": results}
    write_report(result, format_sharded(results), args.out)
    return 0
