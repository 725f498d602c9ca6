"""Benchmarks: objectives, adapters, data."""
