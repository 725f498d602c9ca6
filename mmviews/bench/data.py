"""``mmviews bench data``: samples per second through source + augmentations + collator.

Data loading is what limits many multi-view runs (decoding video and computing flow above all),
so this benchmark times the pipelines training reads through: synthetic and MOSI-shaped data with
their augmentations, video clips decoded whole, by seeking or from the prepared store, and Parquet
shards streamed against the store and against map-style reading. Every case builds its own data
in a temporary folder and reports ratios against a baseline timed in the same run. The cases and
what each measures are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from mmviews.bench.common import seconds_of, timed
from mmviews.bench.report import print_header
from mmviews.fileio import atomic_write_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples K per batch")
    parser.add_argument("--batches", type=int, default=12, help="timed batches per case (after the first)")
    parser.add_argument("--store-samples", type=int, default=1024, help="samples in the MOSI-shaped pickle")
    parser.add_argument("--cases", nargs="*", default=None,
                        help="subset of cases to run (synthetic-natural, synthetic-augmented, mosi-store-augmented, video, "
                             "streamed)")
    parser.add_argument("--video-clips", type=int, default=6, help="clips per video length (video case)")
    parser.add_argument("--video-seconds", type=float, default=7.0, help="main clip length; also half and twice it")
    parser.add_argument("--video-gop", type=int, default=12, help="keyframe interval of the generated videos")
    parser.add_argument("--video-passes", type=int, default=3,
                        help="timed passes over the clips per video case (the fastest counts)")
    parser.add_argument("--stream-clips", type=int, default=32, help="clips of the streamed case")
    parser.add_argument("--stream-seconds", type=float, default=2.0, help="clip length of the streamed case")
    parser.add_argument("--stream-workers", default="0,2,4", help="loader worker counts of the streamed case")
    parser.add_argument("--stream-epochs", type=int, default=2, help="timed epochs per streamed case")
    parser.add_argument("--stream-images", type=int, default=1437,
                        help="small images of the streamed case's map-style vs streamed comparison")
    parser.add_argument("--output", "--out", "--json", dest="json", default=None,
                        help="also write the results to this JSON file (--out, --json: the same)")
    from mmviews.bench.video_step import add_recipe_arguments

    add_recipe_arguments(parser)


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


def write_bench_video(path: Path, seconds: float, fps: int = 25, size: tuple[int, int] = (240, 320), gop: int = 12,
                      seed: int = 0) -> int:
    """Encode a clip that costs about what a UCF-101 clip costs to decode and to compute flow on.

    A two-octave smooth texture panning 1.5 px per frame, a disc crossing it and sensor noise
    (a bank of 8 noise frames, sigma ~3), as MPEG-4 part 2 in AVI (UCF-101's codec family) at
    ~1 Mbit/s with a keyframe every ``gop`` frames. Returns the number of frames.
    """
    import av
    import cv2

    h, w = size
    n = int(round(seconds * fps))
    rng = np.random.default_rng(seed)
    width = w + int(1.5 * n) + 2
    coarse = cv2.resize(rng.uniform(0, 255, (h // 16 + 2, width // 16 + 2, 3)).astype(np.float32), (width, h),
                        interpolation=cv2.INTER_CUBIC)
    fine = cv2.resize(rng.normal(0, 25, (h // 3 + 1, width // 3 + 1, 3)).astype(np.float32), (width, h),
                      interpolation=cv2.INTER_LINEAR)
    texture = np.clip(0.8 * coarse + fine + 25, 0, 255).astype(np.float32)
    noise = rng.normal(0, 3, (8, h, w, 3)).astype(np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.gop_size = gop
        stream.bit_rate = 1_000_000
        for i in range(n):
            x0 = int(1.5 * i)
            img = texture[:, x0:x0 + w] + noise[i % 8]
            cx, cy = (4 * i) % (w + 60) - 30, h / 2 + 40 * np.sin(i / 10)
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < 400] = (230, 60, 40)
            frame = av.VideoFrame.from_ndarray(np.clip(img, 0, 255).astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return n


def _time_clips(datasets: dict[str, Any], passes: int) -> dict[str, dict[str, float]]:
    """Per-clip cost of each dataset through ``dataset[i]`` in this process.

    One warm-up item each, then ``passes`` rounds; each round times one pass over every dataset
    in turn, so that all see the same load. A case's figure is its fastest pass (the least
    disturbed by other processes; the median is reported too).
    """
    for ds in datasets.values():
        ds[0]
    times: dict[str, list[float]] = {name: [] for name in datasets}
    for _ in range(passes):
        for name, ds in datasets.items():
            times[name].append(seconds_of(lambda: [ds[i] for i in range(len(ds))]))
    out = {}
    for name, ts in times.items():
        n = len(datasets[name])
        best = min(ts)
        out[name] = {"clips": n, "passes": passes, "best_pass_s": round(best, 3), "clips_per_s": round(n / best, 2),
                     "ms_per_clip": round(1000 * best / n, 2), "median_ms_per_clip": round(1000 * float(np.median(ts)) / n, 2)}
    return out


def _video_cases(args: argparse.Namespace) -> dict[str, Any]:
    """The video cases (docs/benchmarks.md): per-clip cost of each way of reading, same run, same clips."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker; several threads on tiny tensors only add contention
    try:
        return _video_cases_timed(args)
    finally:
        torch.set_num_threads(threads)


def _video_cases_timed(args: argparse.Namespace) -> dict[str, Any]:
    from mmviews.data.video import VideoFolder
    from mmviews.data.video_store import prepare_video_store

    lengths = (args.video_seconds / 2, args.video_seconds, args.video_seconds * 2)
    result: dict[str, Any] = {"setup": {"clips_per_length": args.video_clips, "lengths_s": list(lengths),
                                        "video": "320x240, 25 fps, mpeg4/avi", "gop": args.video_gop,
                                        "clip": "8 frames, 112x112",
                                        "process": "one, 1 torch thread (as a loader worker)"}}
    with tempfile.TemporaryDirectory() as tmp:
        roots: dict[float, Path] = {}

        def encode() -> None:
            for seconds in lengths:
                root = roots[seconds] = Path(tmp) / f"videos_{seconds:g}s"
                for k in range(args.video_clips):
                    (root / f"class{k % 2}").mkdir(parents=True, exist_ok=True)
                    write_bench_video(root / f"class{k % 2}" / f"v_{k:02d}.avi", seconds, gop=args.video_gop, seed=k)

        result["encode_s"] = round(seconds_of(encode), 2)
        main = roots[args.video_seconds]
        kw: dict[str, Any] = {"split": "all", "num_frames": 8, "size": 112, "audio": False}
        store = Path(tmp) / "store"
        prep = prepare_video_store(main, store, image_format="jpeg", size=128, workers=args.workers, progress=False)
        size_mb = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 2**20
        result["prepare"] = {"clips": prep["clips"], "seconds": prep["seconds"], "workers": args.workers,
                             "clips_per_s": round(prep["clips"] / prep["seconds"], 2), "store_mb": round(size_mb, 1)}
        datasets = {"full+flow": VideoFolder(main, decode="full", flow="farneback", store=False, **kw),
                    "seek+flow": VideoFolder(main, decode="seek", flow="farneback", store=False, **kw),
                    "store+flow": VideoFolder(main, flow="farneback", store=store, **kw)}
        for seconds in lengths:
            for decode in ("full", "seek"):
                datasets[f"{decode} {seconds:g}s"] = VideoFolder(roots[seconds], decode=decode, flow=None, store=False, **kw)
        cases = _time_clips(datasets, args.video_passes)
    base = cases["full+flow"]["clips_per_s"]
    for r in cases.values():
        r["x_baseline"] = round(r["clips_per_s"] / base, 2)
    lo, hi = lengths[0], lengths[-1]
    result["cases"] = cases
    result["length_ratio"] = {d: round(cases[f"{d} {lo:g}s"]["clips_per_s"] / cases[f"{d} {hi:g}s"]["clips_per_s"], 2)
                              for d in ("full", "seek")}
    store_x = cases["store+flow"]["clips_per_s"] / base
    result["targets"] = {
        "store_vs_on_the_fly": round(store_x, 2), "store_vs_seek_on_the_fly":
            round(cases["store+flow"]["clips_per_s"] / cases["seek+flow"]["clips_per_s"], 2),
        "store_at_least_5x": store_x >= 5.0,
        # 4x the length: the full decode gets ~4x slower; the seek should not (some noise allowed)
        "seek_independent_of_length": result["length_ratio"]["seek"] < 1.5,
    }
    return result


def _print_video(video: dict[str, Any]) -> None:
    header = f"{'video case':<16} {'clips':>5} {'clips/s':>8} {'ms/clip':>8} {'median ms':>9} {'x full+flow':>11}"
    print_header(header)
    for name, r in video["cases"].items():
        print(f"{name:<16} {r['clips']:>5} {r['clips_per_s']:>8.1f} {r['ms_per_clip']:>8.1f} {r['median_ms_per_clip']:>9.1f} "
              f"{r['x_baseline']:>11.2f}")
    lr, tg, pr = video["length_ratio"], video["targets"], video["prepare"]
    lengths = video["setup"]["lengths_s"]
    print(f"clips/s at {lengths[0]:g} s over clips/s at {lengths[-1]:g} s: full decode {lr['full']}x, seek {lr['seek']}x "
          f"(1x = independent of the video's length)")
    print(f"store vs on-the-fly (full+flow): {tg['store_vs_on_the_fly']}x (target >= 5x: "
          f"{'met' if tg['store_at_least_5x'] else 'NOT met'}); vs seek+flow: {tg['store_vs_seek_on_the_fly']}x")
    print(f"prepare: {pr['clips']} clips in {pr['seconds']} s with {pr['workers']} workers ({pr['clips_per_s']} clips/s), "
          f"store {pr['store_mb']} MB; encoding the test videos took {video['encode_s']} s")


def _stream_cases(args: argparse.Namespace) -> dict[str, Any]:
    """The streamed case (docs/benchmarks.md): samples/s of the same clips from shards, store and videos."""
    import torch
    from torch.utils.data import DataLoader

    from mmviews.data import shards
    from mmviews.data.streaming import ShardStream, StreamLoader
    from mmviews.data.video import VideoFolder
    from mmviews.data.video_store import VideoStore, prepare_video_store
    from mmviews.data.views import ViewSetCollator

    views = [{"modality": "video"}, {"modality": "flow"}]
    kw: dict[str, Any] = {"num_frames": 8, "size": 112, "flow": "farneback", "audio": False}
    K = max(1, min(args.batch_size, args.stream_clips // 4))
    result: dict[str, Any] = {"setup": {"clips": args.stream_clips, "seconds": args.stream_seconds, "batch_size": K,
                                        "views": "video + flow, 8 frames 112x112", "epochs": args.stream_epochs,
                                        "torch_threads": torch.get_num_threads()}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "videos"
        for k in range(args.stream_clips):
            (root / f"class{k % 2}").mkdir(parents=True, exist_ok=True)
            write_bench_video(root / f"class{k % 2}" / f"v_{k:02d}.avi", args.stream_seconds, gop=args.video_gop, seed=k)
        store_path = Path(tmp) / "videos.mmstore"
        prep = prepare_video_store(root, store_path, image_format="jpeg", size=128, workers=max(1, args.workers),
                                   progress=False)
        store = VideoStore(store_path)
        out = Path(tmp) / "videos-parquet"
        written, shards_s = timed(lambda: shards.write_shards(
            out, {"all": shards.video_split_rows(root, "all", 1, store)},
            source={"dataset": "bench", "root": str(root), "kind": "video", "options": store.options},
            columns={"frames": "jpeg_frames", "flow_x": "flow_images", "flow_y": "flow_images", "audio": "flac_track"},
            labels={"class": "class"}, shard_rows=max(1, args.stream_clips // 8), progress=False))
        shard_mb = sum(f.stat().st_size for f in out.rglob("*.parquet")) / 2**20
        result["prepare"] = {"store_s": prep["seconds"], "shards_s": round(shards_s, 2),
                             "shards": written["splits"]["all"]["shards"], "shards_mb": round(shard_mb, 1)}
        sources = {"on-the-fly": VideoFolder(root, split="all", decode="seek", store=False, **kw),
                   "store": VideoFolder(root, split="all", store=store_path, **kw),
                   "parquet-stream": ShardStream(out, "all", **kw)}
        cases: dict[str, dict[str, Any]] = {}
        for workers in [int(w) for w in args.stream_workers.split(",")]:
            for name, ds in sources.items():
                collate = ViewSetCollator.for_dataset(ds, views, seed=0)

                def loader_of(epoch: int) -> Any:
                    if name == "parquet-stream":  # as training reads it: shuffle buffer, full batches
                        loader = StreamLoader(ds, K, collate, seed=0, num_workers=workers)
                        loader.set_epoch(epoch)
                        return loader
                    generator = torch.Generator().manual_seed(epoch)
                    return DataLoader(ds, batch_size=K, shuffle=True, collate_fn=collate, num_workers=workers,
                                      generator=generator, drop_last=True)

                samples, seconds = _read_epochs(loader_of, args.stream_epochs)
                cases[f"{name} w{workers}"] = {"workers": workers, "samples": samples, "seconds": round(seconds, 2),
                                               "samples_per_s": round(samples / seconds, 2)}
            base = cases[f"store w{workers}"]["samples_per_s"]
            for name in sources:
                cases[f"{name} w{workers}"]["x_store"] = round(cases[f"{name} w{workers}"]["samples_per_s"] / base, 2)
    result["cases"] = cases
    result["parquet_vs_store"] = {w: c["x_store"] for w, c in
                                  ((c["workers"], c) for n, c in cases.items() if n.startswith("parquet"))}
    result["images"] = _stream_images_case(args)
    return result


def _read_epochs(loader_of: Callable[[int], Iterable[Any]], epochs: int) -> tuple[int, float]:
    """Samples read and seconds taken by ``epochs`` epochs, each through the fresh loader
    ``loader_of(epoch)`` (its start-up, workers included, counted)."""
    return timed(lambda: sum(batch.num_samples for epoch in range(epochs) for batch in loader_of(epoch)))


def _stream_images_case(args: argparse.Namespace) -> dict[str, Any]:
    """Small images, map-style against streamed, as training reads them (docs/benchmarks.md)."""
    import io

    import datasets
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader

    from mmviews.data import shards
    from mmviews.data.hf import HFDataset
    from mmviews.data.streaming import ParquetShardDataset, ShardStream, StreamLoader
    from mmviews.data.views import ViewSetCollator

    n, K, epochs = args.stream_images, min(args.batch_size, max(2, args.stream_images // 4)), args.stream_epochs
    rng = np.random.default_rng(0)

    def png(pixels: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(buf, format="PNG")
        return buf.getvalue()

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    table = {"image": [{"bytes": png(rng.integers(0, 256, (8, 8), dtype=np.uint8)), "path": None} for _ in range(n)],
             "label": [int(c) for c in rng.integers(0, 10, n)]}
    views = [{"modality": "image", "copies": 2, "augment": "simclr", "params": {"flip_p": 0.0, "blur_p": 0.0}}]
    options = {"columns": {"image": "image"}, "labels": {"class": "label"}, "image_size": 32}
    result: dict[str, Any] = {"setup": {"images": n, "batch_size": K, "epochs": epochs, "workers": 0,
                                        "views": "image x2 (simclr), 8x8 -> 32x32"}}
    with tempfile.TemporaryDirectory() as tmp:
        datasets.DatasetDict({"train": datasets.Dataset.from_dict(table, features=features)}).save_to_disk(f"{tmp}/images")
        source = HFDataset(f"{tmp}/images", split="train", columns=options["columns"], labels=options["labels"])
        shards.write_shards(f"{tmp}/images-parquet", {"train": shards.hf_split_rows(source)},
                            source={"dataset": "bench", "root": f"{tmp}/images", "kind": "hf", "options": {}},
                            columns={"image": "image"}, labels={"class": "label"}, progress=False)
        readers = {"map-style": ParquetShardDataset(f"{tmp}/images-parquet", "train", **options),
                   "streamed": ShardStream(f"{tmp}/images-parquet", "train", **options)}
        for name, ds in readers.items():
            collate = ViewSetCollator.for_dataset(ds, views, seed=0)

            def loader_of(epoch: int) -> Any:
                if name == "streamed":
                    loader = StreamLoader(ds, K, collate, seed=0)
                    loader.set_epoch(epoch)
                    return loader
                return DataLoader(ds, batch_size=K, shuffle=True, drop_last=True, collate_fn=collate,
                                  generator=torch.Generator().manual_seed(epoch))

            samples, seconds = _read_epochs(loader_of, epochs)
            result[name] = {"samples": samples, "seconds": round(seconds, 2), "samples_per_s": round(samples / seconds, 1)}
    result["streamed_vs_map_time"] = round(result["streamed"]["seconds"] / result["map-style"]["seconds"], 2)
    return result


def _print_stream(stream: dict[str, Any]) -> None:
    header = f"{'streamed case':<20} {'workers':>7} {'samples':>7} {'s':>7} {'samples/s':>9} {'x store':>7}"
    print_header(header)
    for name, r in stream["cases"].items():
        print(f"{name:<20} {r['workers']:>7} {r['samples']:>7} {r['seconds']:>7.2f} {r['samples_per_s']:>9.1f} "
              f"{r['x_store']:>7.2f}")
    p = stream["prepare"]
    print(f"store made in {p['store_s']} s; {p['shards']} Parquet shards ({p['shards_mb']} MB) written in {p['shards_s']} s")
    images = stream["images"]
    setup = images["setup"]
    print(f"{setup['images']} small images ({setup['views']}, K = {setup['batch_size']}, {setup['epochs']} epochs, "
          f"no workers): map-style {images['map-style']['seconds']:.2f} s, streamed {images['streamed']['seconds']:.2f} s, "
          f"streamed / map-style time {images['streamed_vs_map_time']:.2f}x")


def _time_loader(dataset: Any, views: list[Any], batch_size: int, batches: int, workers: int) -> dict[str, float]:
    from torch.utils.data import DataLoader

    from mmviews.data.views import ViewSetBatchSampler, ViewSetCollator

    collate = ViewSetCollator.for_dataset(dataset, views, seed=0)
    spec = collate.view_spec
    sampler = ViewSetBatchSampler(len(dataset), batch_size, len(spec), "growing", shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers)
    it = iter(loader)
    first = seconds_of(lambda: next(it))
    n, steady = timed(lambda: sum(batch.num_samples for batch in itertools.islice(it, batches)))
    del it
    return {"views": len(spec), "batch_size": batch_size, "samples": n, "first_batch_s": round(first, 3),
            "seconds": round(steady, 3), "samples_per_s": round(n / steady, 1) if steady > 0 else float("nan"),
            "views_per_s": round(n * len(spec) / steady, 1) if steady > 0 else float("nan")}


def run(args: argparse.Namespace) -> int:
    import torch

    if args.recipe is not None:  # a video recipe's data path and step (mmviews.bench.video_step)
        from mmviews.bench.video_step import print_recipe, run_recipe

        recipe = run_recipe(args)
        print_recipe(recipe)
        if args.json:
            atomic_write_text(args.json, json.dumps(recipe, indent=2))
        return 0

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
            convert_s = seconds_of(lambda: convert_sentiment_pickle(pkl, Path(tmp) / "store", dataset=None, progress=False))
            ds = SentimentStoreDataset(Path(tmp) / "store", "train")
            views = [{"modality": m, "copies": 2, "augment": "sequence_default"} for m in ("text", "audio", "vision")]
            r = _time_loader(ds, views, args.batch_size, args.batches, args.workers)
            r["convert_s"] = round(convert_s, 2)
            r["pickle_mb"] = round(pkl.stat().st_size / 2**20, 1)
            cases["mosi-store-augmented"] = r
    results["cases"] = cases
    if want is None or "video" in want:
        results["video"] = _video_cases(args)
    if want is not None and "streamed" in want:  # slow (encodes clips): only when asked for
        results["streamed"] = _stream_cases(args)
    header = f"{'case':<22} {'views':>5} {'K':>4} {'first batch s':>13} {'samples/s':>10} {'views/s':>9}"
    if cases:
        print_header(header)
    for name, r in cases.items():
        print(f"{name:<22} {r['views']:>5} {r['batch_size']:>4} {r['first_batch_s']:>13.2f} {r['samples_per_s']:>10.1f} "
              f"{r['views_per_s']:>9.1f}")
    if "mosi-store-augmented" in cases:
        r = cases["mosi-store-augmented"]
        print(f"(MOSI-shaped pickle of {r['pickle_mb']} MB converted to the store in {r['convert_s']} s)")
    if "video" in results:
        if cases:
            print()
        _print_video(results["video"])
    if "streamed" in results:
        print()
        _print_stream(results["streamed"])
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        atomic_write_text(args.json, text)
    return 0
