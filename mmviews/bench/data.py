"""``mmviews bench data``: samples per second through source + augmentations + collator.

Cases (each through a DataLoader with ``--workers`` worker processes and the
ViewSetCollator):

- ``synthetic-natural``: the embedded synthetic data, one natural view per modality
  (text, audio, image, flow: the quickstart's views);
- ``synthetic-augmented``: text x2, audio x2, image x2 (SimCLR), video + flow (one shared
  crop): 8 views;
- ``mosi-store-augmented``: a MOSI-shaped MMSA pickle (unaligned: text 50x768, audio
  500x5, vision 375x20) written to a temporary folder, converted to the memory-mapped store
  (conversion time reported), then text/audio/vision x2 with the feature-sequence augmentations.

The first batch (worker start-up) is timed separately; ``samples/s`` is the steady state.
Prints a table and the JSON (also written to ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples K per batch")
    parser.add_argument("--batches", type=int, default=12, help="timed batches per case (after the first)")
    parser.add_argument("--store-samples", type=int, default=1024, help="samples in the MOSI-shaped pickle")
    parser.add_argument("--cases", nargs="*", default=None, help="subset of cases to run")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _write_mosi_like(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)

    def split(k: int) -> dict[str, Any]:
        audio = rng.normal(size=(k, 500, 5))
        audio[:, :3, 0] = -np.inf  # as in the real files
        return {"raw_text": ["x"] * k, "id": [f"v$_${i}" for i in range(k)],
                "text": rng.normal(size=(k, 50, 768)), "text_bert": np.ones((k, 3, 50)),
                "audio": audio, "vision": rng.normal(size=(k, 375, 20)),
                "audio_lengths": rng.integers(100, 501, size=k), "vision_lengths": rng.integers(50, 376, size=k),
                "regression_labels": rng.uniform(-3, 3, size=k)}

    data = {"train": split(n), "valid": split(8), "test": split(8)}
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=4)


def _time_loader(dataset: Any, views: list[Any], batch_size: int, batches: int, workers: int) -> dict[str, float]:
    from torch.utils.data import DataLoader

    from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator, ViewSpec

    spec = ViewSpec.from_config(views)
    collate = ViewSetCollator.for_dataset(dataset, spec, seed=0)
    sampler = ViewSetBatchSampler(len(dataset), batch_size, len(spec), "growing", shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    n = 0
    for _ in range(batches):
        try:
            b = next(it)
        except StopIteration:
            break
        n += b.num_samples
    steady = time.perf_counter() - t1
    del it
    return {"views": len(spec), "batch_size": batch_size, "samples": n, "first_batch_s": round(first, 3),
            "seconds": round(steady, 3), "samples_per_s": round(n / steady, 1) if steady > 0 else float("nan"),
            "views_per_s": round(n * len(spec) / steady, 1) if steady > 0 else float("nan")}


def run(args: argparse.Namespace) -> int:
    import torch

    from mmviews.data.synthetic import SyntheticMultimodal

    results: dict[str, Any] = {"workers": args.workers, "torch_threads": torch.get_num_threads()}
    cases: dict[str, dict[str, Any]] = {}
    want = set(args.cases) if args.cases else None
    n_synth = args.batch_size * (args.batches + 1)
    if want is None or "synthetic-natural" in want:
        ds = SyntheticMultimodal(n_synth, seed=0, modalities=("text", "audio", "image", "flow"))
        cases["synthetic-natural"] = _time_loader(ds, ["text", "audio", "image", "flow"], args.batch_size, args.batches,
                                                  args.workers)
    if want is None or "synthetic-augmented" in want:
        ds = SyntheticMultimodal(n_synth, seed=0)
        views = [{"modality": "text", "copies": 2, "augment": "text_default"},
                 {"modality": "audio", "copies": 2, "augment": "audio_default"},
                 {"modality": "image", "copies": 2, "augment": "simclr", "params": {"blur_p": 0.0}},
                 {"modality": "video", "augment": "video_default", "params": {"seed_group": "clip"}},
                 {"modality": "flow", "augment": "flow_default", "params": {"seed_group": "clip"}}]
        cases["synthetic-augmented"] = _time_loader(ds, views, args.batch_size, args.batches, args.workers)
    if want is None or "mosi-store-augmented" in want:
        from mmviews.data.sentiment import SentimentStoreDataset, convert_sentiment_pickle

        with tempfile.TemporaryDirectory() as tmp:
            pkl = Path(tmp) / "mosi_like.pkl"
            _write_mosi_like(pkl, args.store_samples)
            t = time.perf_counter()
            convert_sentiment_pickle(pkl, Path(tmp) / "store", dataset=None, progress=False)
            convert_s = time.perf_counter() - t
            ds = SentimentStoreDataset(Path(tmp) / "store", "train")
            views = [{"modality": m, "copies": 2, "augment": "sequence_default"} for m in ("text", "audio", "vision")]
            r = _time_loader(ds, views, args.batch_size, args.batches, args.workers)
            r["convert_s"] = round(convert_s, 2)
            r["pickle_mb"] = round(pkl.stat().st_size / 2**20, 1)
            cases["mosi-store-augmented"] = r
    results["cases"] = cases
    header = f"{'case':<22} {'views':>5} {'K':>4} {'first batch s':>13} {'samples/s':>10} {'views/s':>9}"
    print(header)
    print("-" * len(header))
    for name, r in cases.items():
        print(f"{name:<22} {r['views']:>5} {r['batch_size']:>4} {r['first_batch_s']:>13.2f} {r['samples_per_s']:>10.1f} "
              f"{r['views_per_s']:>9.1f}")
    if "mosi-store-augmented" in cases:
        r = cases["mosi-store-augmented"]
        print(f"(MOSI-shaped pickle of {r['pickle_mb']} MB converted to the store in {r['convert_s']} s)")
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0
