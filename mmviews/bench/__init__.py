"""Benchmarks: objectives (small batches and at scale), adapters, data.

Run them with ``mmviews bench {objectives,scale,adapters,data}``; each is its own module
(:mod:`mmviews.bench.objectives`, :mod:`mmviews.bench.scale`, :mod:`mmviews.bench.adapters`,
:mod:`mmviews.bench.data`),
imported by name, so this package re-exports nothing.
"""

__all__: list[str] = []
