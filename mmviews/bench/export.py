"""``mmviews bench onnx``: embedding time of the ONNX export (onnxruntime) against the torch
adapter it was exported from.

For each adapter type (``--kinds``; random weights, ``--size tiny`` or ``realistic``: the
architectures of :mod:`mmviews.modalities.presets`), the adapter is exported as ``mmviews export
--format onnx`` exports it, then one batch of ``--batch-size`` rows is embedded by the torch
adapter (eval mode, ``no_grad``, float32) and by :class:`~mmviews.export.onnx_runtime.OnnxAdapter`
(its numpy preprocessing included), timed round-robin in the same run on the same number of
threads (``--threads``: torch's and onnxruntime's intra-op threads). Prints seconds per batch
and the ratio onnxruntime / torch; writes JSON.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from mmviews.bench.common import middle, round_robin, synchroniser, verb_main
from mmviews.bench.report import machine, write_report

KINDS = ("text", "hf_audio", "audio_cnn", "open_clip", "small_cnn", "flow_cnn", "flow_clip", "feature_sequence")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, metavar="KIND",
                        help=f"adapter types to measure (default: all of {', '.join(KINDS)})")
    parser.add_argument("--size", choices=["tiny", "realistic"], default="tiny",
                        help="the presets' tiny configs or full-size architectures (random weights)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per contender (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of torch and onnxruntime alike")
    parser.add_argument("--output", "--out", dest="output", default="bench_onnx.json", help="JSON file to write")


def _measure(kind: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from mmviews.export.onnx import export_adapter
    from mmviews.export.onnx_runtime import OnnxAdapter
    from mmviews.modalities import build_adapter
    from mmviews.modalities.presets import example_inputs, realistic_config, tiny_config

    realistic = args.size == "realistic"
    torch.manual_seed(0)
    adapter = build_adapter(realistic_config(kind) if realistic else tiny_config(kind)).eval()
    entry = export_adapter(adapter, folder)
    runtime = OnnxAdapter(folder, kind, entry, ["CPUExecutionProvider"], threads=args.threads)
    inputs = example_inputs(kind, args.batch_size, realistic=realistic)
    arrays = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def torch_embed() -> None:
        with torch.no_grad():
            adapter(inputs, check_inputs=False)

    times = round_robin({"torch": torch_embed, "onnxruntime": lambda: runtime.embed(arrays)}, args.repeats, 1,
                        synchroniser(torch.device("cpu")))
    torch_s, onnx_s = middle(times["torch"]), middle(times["onnxruntime"])
    return {"kind": kind, "exporter": entry["exporter"], "torch_s": round(torch_s, 5), "onnxruntime_s": round(onnx_s, 5),
            "ratio_onnx_to_torch": round(onnx_s / torch_s, 3)}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'adapter':<18}{'exporter':<13}{'torch s':>10}{'onnxrt s':>10}{'onnx/torch':>12}", flush=True)
    for kind in args.kinds:
        with tempfile.TemporaryDirectory(prefix="mmviews-bench-onnx-") as tmp:
            row = _measure(kind, args, Path(tmp))
        print(f"{kind:<18}{row['exporter']:<13}{row['torch_s']:>10.4f}{row['onnxruntime_s']:>10.4f}"
              f"{row['ratio_onnx_to_torch']:>11.2f}x", flush=True)
        rows.append(row)
    result = {"machine": machine(torch.device("cpu")),
              "settings": {k: getattr(args, k) for k in ("size", "batch_size", "repeats", "threads")}, "rows": rows}
    write_report(result, None, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    return verb_main("onnx", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
