"""``mmviews bench adapters``: throughput of each modality adapter, and the feature cache.

For every adapter type: views per second of inference (eval mode, no autograd) and of a
training step (forward + backward) with the tiny configs of
:mod:`mmviews.modalities.presets`, and inference with one realistic size each (random
weights: bert-base-sized text, HuBERT-base, open_clip ViT-B-32 at 224 px, ...). A view
is one item of the modality's input (one sentence, image, clip, waveform, flow stack).
Memory: parameter count always; peak allocated memory per measurement on CUDA devices.
Then the speed-up of an epoch that reads a frozen backbone's features from the cache
over one that recomputes them. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from mmviews.bench.common import (cuda_peak_mib, median_seconds, reset_cuda_peak, seconds_of, synchroniser,
                                   verb_main)
from mmviews.bench.report import machine, write_report
from mmviews.modalities import MultiViewEncoder, build_adapter
from mmviews.modalities.presets import ADAPTER_TYPES, example_inputs, realistic_config, tiny_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTER_TYPES), choices=list(ADAPTER_TYPES),
                        help="adapter types to measure (default: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="views per call with the tiny configs")
    parser.add_argument("--realistic-batch-size", type=int, default=8, help="views per call at realistic size")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (after one warm-up)")
    parser.add_argument("--no-realistic", action="store_true", help="skip the realistic-size models")
    parser.add_argument("--cache-batches", type=int, default=4, help="batches per epoch in the cache measurement")
    parser.add_argument("--output", "--out", dest="output", default="bench_adapters.json",
                        help="JSON file to write (--out: the same)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="torch device for the adapters (cpu, cuda, ...)")


def _measure(
    kind: str, config: dict[str, Any], batch: int, repeats: int, realistic: bool, train: bool, device: torch.device
) -> dict[str, Any]:
    torch.manual_seed(0)
    adapter = build_adapter(config).to(device)
    inputs = example_inputs(kind, batch, realistic=realistic)
    row: dict[str, Any] = {
        "adapter": kind,
        "size": "realistic" if realistic else "tiny",
        "batch": batch,
        "params_M": round(adapter.num_parameters() / 1e6, 3),
    }
    adapter.eval()

    def infer() -> None:
        with torch.no_grad():
            adapter(inputs)

    reset_cuda_peak(device)
    row["infer_views_per_s"] = round(batch / median_seconds(infer, repeats, device), 1)
    if device.type == "cuda":
        row["infer_peak_MiB"] = round(cuda_peak_mib(device), 1)
    if train:
        adapter.train()

        def step() -> None:
            adapter.zero_grad(set_to_none=True)
            adapter(inputs).square().sum().backward()

        reset_cuda_peak(device)
        row["train_views_per_s"] = round(batch / median_seconds(step, repeats, device), 1)
        if device.type == "cuda":
            row["train_peak_MiB"] = round(cuda_peak_mib(device), 1)
    return row


def _cache_speedup(realistic: bool, batch: int, n_batches: int, device: torch.device) -> dict[str, Any]:
    from mmviews.data.batch import ViewBatch, ViewInfo

    torch.manual_seed(0)
    make = realistic_config if realistic else tiny_config
    cfg = make("text", finetune={"mode": "frozen"}, head={"kind": "mlp", "batch_norm": False})
    enc = MultiViewEncoder({"text": build_adapter(cfg)}).to(device).eval()
    batches = []
    for b in range(n_batches):
        inputs = example_inputs("text", batch, realistic=realistic, seed=b)
        batches.append(
            ViewBatch(
                inputs={"text": inputs},
                views=[ViewInfo("text_0", "text", 0)],
                mask=torch.ones(batch, 1, dtype=torch.bool),
                index=torch.arange(batch) + b * batch,
            )
        )

    def epoch() -> None:
        with torch.no_grad():
            for vb in batches:
                enc(vb)
        sync()

    sync = synchroniser(device)
    epoch()  # warm-up
    recompute = seconds_of(epoch)
    with tempfile.TemporaryDirectory() as d:
        enc.enable_cache(d)
        fill = seconds_of(epoch)  # fills the cache (backbone runs once more)
        cached = seconds_of(epoch)  # reads it
        enc.disable_cache()
    views = batch * n_batches
    return {
        "backbone": "bert-base-sized random (frozen)" if realistic else "tiny bert (frozen)",
        "views_per_epoch": views,
        "recompute_s": round(recompute, 4),
        "fill_s": round(fill, 4),
        "cached_s": round(cached, 4),
        "speedup": round(recompute / max(cached, 1e-9), 1),
    }


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    for kind in args.adapters:
        rows.append(
            _measure(kind, tiny_config(kind), args.batch_size, args.repeats, realistic=False, train=True, device=device)
        )
        print(_format_row(rows[-1]), flush=True)
        if not args.no_realistic:
            rows.append(
                _measure(kind, realistic_config(kind), args.realistic_batch_size, max(1, args.repeats - 1),
                         realistic=True, train=False, device=device)
            )
            print(_format_row(rows[-1]), flush=True)
    cache = [_cache_speedup(False, args.batch_size, args.cache_batches, device)]
    if not args.no_realistic:
        cache.append(_cache_speedup(True, args.realistic_batch_size, args.cache_batches, device))
    print()
    print(f"{'adapter':<18}{'size':<11}{'batch':>6}{'params M':>10}{'infer v/s':>12}{'train v/s':>12}")
    for r in rows:
        print(_format_row(r))
    print()
    for c in cache:
        print(f"feature cache, {c['backbone']}: {c['views_per_epoch']} views/epoch, recompute {c['recompute_s']:.3f} s, "
              f"cached {c['cached_s']:.4f} s -> {c['speedup']}x")
    result = {"machine": machine(device), "adapters": rows, "cache": cache}
    write_report(result, None, args.output)
    return 0


def _format_row(r: dict[str, Any]) -> str:
    train = f"{r['train_views_per_s']:>12}" if "train_views_per_s" in r else f"{'-':>12}"
    return f"{r['adapter']:<18}{r['size']:<11}{r['batch']:>6}{r['params_M']:>10}{r['infer_views_per_s']:>12}{train}"


def main(argv: list[str] | None = None) -> int:
    return verb_main("adapters", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
