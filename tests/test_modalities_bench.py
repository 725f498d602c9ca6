"""`mmviews bench adapters` runs end to end on a tiny selection and writes its JSON."""

from __future__ import annotations

import argparse
import json

from mmviews.bench import adapters as bench


def test_bench_adapters_writes_table_and_json(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["--adapters", "feature_sequence", "--no-realistic", "--repeats", "1", "--batch-size", "4",
         "--cache-batches", "2", "--output", str(out)]
    )
    assert bench.run(args) == 0
    result = json.loads(out.read_text())
    (row,) = result["adapters"]
    assert row["adapter"] == "feature_sequence" and row["infer_views_per_s"] > 0 and row["train_views_per_s"] > 0
    (cache,) = result["cache"]
    assert cache["views_per_epoch"] == 8 and cache["recompute_s"] > 0 and cache["fill_s"] > 0 and cache["cached_s"] > 0
    # The reported speedup is the measured recompute time over the cached time (both rounded
    # to 4 decimals, the speedup to 1), not a constant.
    exact = cache["recompute_s"] / cache["cached_s"]
    assert abs(cache["speedup"] - exact) <= 0.05 + exact * 1e-4 / min(cache["recompute_s"], cache["cached_s"]), cache
    assert "feature_sequence" in capsys.readouterr().out
