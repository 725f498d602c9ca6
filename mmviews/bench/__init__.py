"""Benchmarks: objectives (small batches and at scale), adapters, data, dropout, training steps,
and the checks that need a GPU.

Run them with ``mmviews bench {objectives,scale,adapters,data,dropout,train,gpu}``; each is its own
module (:mod:`mmviews.bench.objectives`, :mod:`mmviews.bench.scale`, ...), imported by name, so
this package re-exports nothing. What they share: :mod:`mmviews.bench.common` (timing, memory
probes, the verbs' entry point), :mod:`mmviews.bench.report` (environment, report writer) and
:mod:`mmviews.bench.host_reads` (the host-read recorder of ``bench train``). ``bench train`` is
split in four: :mod:`~mmviews.bench.train` (the verb), :mod:`~mmviews.bench.train_cases`,
:mod:`~mmviews.bench.train_measure` and :mod:`~mmviews.bench.train_report`.
"""

__all__: list[str] = []
