"""``mmviews export RUN --format hf|onnx --output DIR``: a trained encoder in a folder to share
or serve.

``--format hf``: a folder to upload to the Hugging Face Hub as it is (safetensors weights,
configs, a ``README.md`` model card with the Hub's front matter; :mod:`mmviews.export.hf`),
loadable with ``MultiViewEncoder.from_pretrained(DIR or "owner/name")``. ``--format onnx``:
each adapter as an ONNX graph with a manifest of its inputs and preprocessing
(:mod:`mmviews.export.onnx`), which ``mmviews embed DIR DATA_OR_RECIPE`` runs with
onnxruntime. ``RUN`` is a run folder or a checkpoint folder; ``DIR`` must not exist (it is
written under a temporary name and renamed when complete).
"""

from __future__ import annotations

import argparse

from mmviews.fileio import check_writable
from mmviews.modalities.remote import allow_remote_models

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or checkpoint folder")
    parser.add_argument("--format", required=True, choices=["hf", "onnx"],
                        help="hf: a Hugging Face Hub-ready folder; onnx: ONNX graphs for onnxruntime")
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="the folder to write (must not exist)")
    parser.add_argument("--license", default=None,
                        help="hf: the model card's license, a Hub license identifier (e.g. apache-2.0, mit, other); "
                        "left out of the card when not given")
    parser.add_argument("--allow-remote-models", action="store_true",
                        help="allow adapters to build open_clip models named 'hf-hub:...' or 'local-dir:...'")


def run(args: argparse.Namespace) -> int:
    """The command. Errors are raised; :func:`mmviews.cli.main` prints them as one line."""
    check_writable(args.output)  # before the encoder is loaded
    if args.format == "hf":
        from mmviews.export.hf import export_hf

        with allow_remote_models(args.allow_remote_models):
            folder = export_hf(args.run, args.output, args.license)
        print(f"wrote a Hub-ready folder to {folder} (upload it with `hf upload OWNER/NAME {folder}` "
              "or load it with MultiViewEncoder.from_pretrained)")
        return 0
    if args.license is not None:
        raise ValueError("--license is for --format hf (an ONNX folder has no model card)")
    from mmviews.export.onnx import export_onnx

    with allow_remote_models(args.allow_remote_models):
        folder, skipped = export_onnx(args.run, args.output)
    for name, reason in skipped.items():
        print(f"mmviews export: modality {name!r} not exported to ONNX: {reason}")
    print(f"wrote ONNX graphs to {folder} (run them with `mmviews embed {folder} DATA_OR_RECIPE --output F.parquet`)")
    return 0
