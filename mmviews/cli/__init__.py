"""The ``mmviews`` command line.

Every sub-command is a module exposing two functions, ``add_arguments(parser:
argparse.ArgumentParser) -> None`` and ``run(args) -> int``: ``train``, ``eval`` and ``list``
live in this package (:mod:`mmviews.cli.train`, :mod:`mmviews.cli.eval`,
:mod:`mmviews.cli.list`); ``compare``, ``bench``, ``prepare`` and ``demo`` in the module that
owns their feature. Only the module of the command being run is imported, so
``mmviews --help`` stays fast.

Multi-GPU / multi-node: ``accelerate launch -m mmviews.cli train RECIPE ...`` (``python -m
mmviews.cli`` runs :mod:`mmviews.cli.__main__`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# command -> (module, one-line help). Sub-commands with their own sub-verbs (bench) are
# dispatched by their module.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mmviews.cli.train", "train an encoder from a YAML recipe (with --set overrides, --resume)"),
    "eval": ("mmviews.cli.eval", "evaluate a run or checkpoint and write its report"),
    "compare": ("mmviews.eval.compare", "put several runs side by side in one table and one set of plots"),
    "bench": ("mmviews.bench.cli", "benchmark objectives, adapters or data loading"),
    "prepare": ("mmviews.data.prepare", "validate a dataset copy against its card and convert it to the fast store"),
    "list": ("mmviews.cli.list", "list objectives, recipes or datasets"),
    "demo": ("mmviews.demo", "train a toy encoder with a poly-view loss on synthetic views"),
}
# (Importing the submodules mmviews.cli.list and mmviews.cli.eval binds the names ``list`` and
# ``eval`` in this module's namespace, shadowing the builtins: code here must not call them.)


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmviews",
        description="Multimodal, multi-view representation learning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items())
        + "\n\nRun 'mmviews COMMAND --help' for the options of one command.",
    )
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = [*(sys.argv[1:] if argv is None else argv)]
    top = _top_level_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] == "--version":
        from mmviews import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}; choose from {', '.join(sorted(COMMANDS))}")
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"mmviews {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)
