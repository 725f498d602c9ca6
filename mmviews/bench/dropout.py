"""``mmviews bench dropout``: the cost of sample-keyed dropout against torch's own.

A training step (forward + backward, training mode) of adapters with dropout, measured in the
same run in four variants (timed round-robin):

- ``native``: ``nn.Dropout`` and the backbone's attention dropout as shipped (global RNG;
  transformers' sdpa kernel draws the attention mask itself) -- the baseline;
- ``native_eager``: the same with eager attention (the probabilities kept in memory), to
  separate the cost of leaving the fused kernel from that of the keyed masks;
- ``keyed``: :func:`mmviews.modalities.dropout.enable_sample_keyed_dropout` (hashed masks; eager
  attention when it drops);
- ``no_dropout``: every dropout at p = 0 (the floor).

Cases: a BERT-tiny-sized text adapter (random config: 4 layers, width 256, 4 heads,
dropout 0.1 on hidden states and attention, ``--length`` tokens) and the ``feature_sequence``
transformer (``nn.MultiheadAttention``, dropout 0.1). Prints seconds per step and the ratios to
``native``; writes JSON. On CUDA also the peak memory of each step.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from mmviews.bench.common import cuda_peak_mib, middle, reset_cuda_peak, round_robin, synchroniser, verb_main
from mmviews.bench.report import machine, write_report
from mmviews.modalities import build_adapter
from mmviews.modalities.dropout import dropout_rows, dropout_step, enable_sample_keyed_dropout
from mmviews.modalities.presets import TINY_WORDS

VARIANTS = ("native", "native_eager", "keyed", "no_dropout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=64, help="rows per step")
    parser.add_argument("--length", type=int, default=64, help="tokens (text) / steps (sequence) per row")
    parser.add_argument("--width", type=int, default=256, help="BERT hidden size (4 heads, 4 layers)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability of every layer")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    parser.add_argument("--output", "--out", dest="output", default="bench_dropout.json",
                        help="JSON file to write (--out: the same)")


def _config(case: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    p = 0.0 if variant == "no_dropout" else args.dropout
    head = {"kind": "mlp", "hidden_dim": 256, "batch_norm": False, "dropout": p}
    if case == "text":
        bert = {"hidden_size": args.width, "num_hidden_layers": 4, "num_attention_heads": 4,
                "intermediate_size": 4 * args.width, "hidden_dropout_prob": p, "attention_probs_dropout_prob": p,
                "max_position_embeddings": max(args.length + 8, 64)}
        return {"type": "text", "bert_config": bert, "vocab": list(TINY_WORDS), "max_length": args.length + 2,
                "embed_dim": 128, "head": head}
    return {"type": "feature_sequence", "input_dim": 64, "width": args.width, "num_layers": 4,
            "num_heads": 4, "dropout": p, "embed_dim": 128, "head": head}


def _inputs(case: str, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    if case == "text":
        words = torch.randint(len(TINY_WORDS), (args.batch_size, args.length), generator=g).tolist()
        return {"text": [" ".join(TINY_WORDS[i] for i in row) for row in words]}
    lengths = torch.randint(args.length // 2, args.length + 1, (args.batch_size,), generator=g)
    return {"values": torch.randn(args.batch_size, args.length, 64, generator=g), "lengths": lengths}


def _step(case: str, variant: str, args: argparse.Namespace, device: torch.device) -> Callable[[], None]:
    """One training step of the ``variant`` adapter of ``case`` (built here, seeded)."""
    torch.manual_seed(0)
    adapter = build_adapter(_config(case, variant, args))
    if variant == "native_eager":
        adapter.backbone.set_attn_implementation("eager")
    if variant == "keyed":
        enable_sample_keyed_dropout(adapter)
    adapter.to(device).train()
    inputs = _inputs(case, args)
    if case == "text":  # tokenised once, outside the timed step (the trainer does it in the loader)
        inputs = adapter.host_preprocessor()(inputs)
    keys = torch.arange(args.batch_size, device=device) * 7919

    def step() -> None:
        adapter.zero_grad(set_to_none=True)
        with dropout_step(0, 0), dropout_rows(keys):
            adapter(inputs, check_inputs=False).square().sum().backward()

    return step


def _measure(case: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Median seconds per step of every variant, timed round-robin (one step of each variant in
    turn, ``--repeats`` rounds after a warm-up round) so that a change of machine load between
    variants does not bias the ratios."""
    variants = [v for v in VARIANTS if not (case == "feature_sequence" and v == "native_eager")]
    steps = {v: _step(case, v, args, device) for v in variants}
    peaks: dict[str, float] = {}

    def record_peak(variant: str) -> None:
        if device.type == "cuda":
            peaks[variant] = max(peaks.get(variant, 0.0), cuda_peak_mib(device))

    times = round_robin(steps, args.repeats, 1, synchroniser(device), before=lambda variant: reset_cuda_peak(device),
                        after=record_peak)
    rows = []
    for v in variants:
        row: dict[str, Any] = {"case": case, "variant": v, "s_per_step": middle(times[v])}
        if v in peaks:
            row["peak_MiB"] = round(peaks[v], 1)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    for case in ("text", "feature_sequence"):
        case_rows = _measure(case, args, device)
        base = next(r["s_per_step"] for r in case_rows if r["variant"] == "native")
        for r in case_rows:
            r["ratio_to_native"] = round(r["s_per_step"] / base, 3)
            r["s_per_step"] = round(r["s_per_step"], 5)
            memory = f"{r['peak_MiB']:>10}" if "peak_MiB" in r else ""
            print(f"{case:<18}{r['variant']:<14}{r['s_per_step']:>10.4f} s{r['ratio_to_native']:>8.2f}x{memory}",
                  flush=True)
        rows += case_rows
    result = {
        "machine": machine(device),
        "settings": {k: getattr(args, k) for k in ("batch_size", "length", "width", "dropout", "repeats")},
        "rows": rows,
    }
    write_report(result, None, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("dropout", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
