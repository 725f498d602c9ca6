"""Every ``mmviews bench`` verb writes its JSON to ``--output PATH``; the old spellings (``--out``,
and ``--json`` of ``bench data``) name the same option."""

from __future__ import annotations

import argparse
import importlib

import pytest

from mmviews.bench.cli import VERBS


def _parsed(verb: str, *options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(VERBS[verb][0]).add_arguments(parser)
    return parser.parse_args(list(options))


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_takes_output_and_out(verb: str) -> None:
    default = vars(_parsed(verb))
    new, old = vars(_parsed(verb, "--output", "x.json")), vars(_parsed(verb, "--out", "x.json"))
    assert new == old  # one option, two spellings
    changed = [key for key in new if new[key] != default[key]]
    assert len(changed) == 1 and str(new[changed[0]]) == "x.json", (verb, changed)


def test_bench_data_keeps_json() -> None:
    assert vars(_parsed("data", "--json", "r.json")) == vars(_parsed("data", "--output", "r.json"))
