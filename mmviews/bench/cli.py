"""``mmviews bench VERB [options]``: dispatch to one benchmark module.

Each verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
only the chosen one is imported (so ``mmviews bench objectives`` does not import the
adapters' or the data loaders' dependencies).
"""

from __future__ import annotations

import argparse
import importlib

from mmviews.bench.common import StopOnSignals
from mmviews.cli import CommandParser

VERBS: dict[str, tuple[str, str]] = {
    "objectives": ("mmviews.bench.objectives", "time and memory of every objective vs a cross-entropy floor and the reference loops"),
    "scale": ("mmviews.bench.scale", "time and peak memory of the objectives at K*M up to 65,536, streamed vs unchunked"),
    "adapters": ("mmviews.bench.adapters", "throughput and memory of the modality adapters"),
    "data": ("mmviews.bench.data", "throughput of the data pipeline"),
    "dropout": ("mmviews.bench.dropout", "a training step with sample-keyed dropout vs torch's dropout (and eager attention, and none)"),
    "onnx": ("mmviews.bench.export", "embedding time of the ONNX export (onnxruntime) vs the torch adapter, per adapter type"),
    "gpu": ("mmviews.bench.gpu", "every check only a GPU can answer (CUDA tests, memory estimate, eager vs compiled step), "
                                 "in at most 8 minutes, to one JSON"),
    "train": ("mmviews.bench.train", "samples/s of a whole training step and where its time goes (data, encoders, loss, backward, optimiser)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "verbs:\n"
        + "\n".join(f"  {name:<11} {help_text}" for name, (_, help_text) in VERBS.items())
        + "\n\nRun 'mmviews bench VERB --help' for the options of one verb."
    )
    parser.add_argument("verb", choices=sorted(VERBS), metavar="VERB", help="what to benchmark: " + ", ".join(VERBS))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of the verb")


def run(args: argparse.Namespace) -> int:
    module_name, help_text = VERBS[args.verb]
    module = importlib.import_module(module_name)
    parser = CommandParser(prog=f"mmviews bench {args.verb}", description=help_text)
    module.add_arguments(parser)
    options = parser.parse_args(args.options)
    options.owns_process = getattr(args, "owns_process", False)  # the mmviews program (mmviews.cli.main)
    if args.verb == "train" and options.sharded:  # real processes of their own
        module = importlib.import_module("mmviews.bench.sharded")
    elif args.verb == "train" and options.against_sentence_transformers:
        module = importlib.import_module("mmviews.bench.text_step")
    with StopOnSignals():  # SIGINT or SIGTERM: the verb's subprocesses stop with it
        return int(module.run(options) or 0)
