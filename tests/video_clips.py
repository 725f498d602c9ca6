"""Real video files for the tests and the video benchmarks: a folder laid out as UCF-101
(``Class/v_Class_gXX_cYY.avi`` and ``ucfTrainTestlist/``), written with PyAV.

Each clip pans a smooth random texture (real motion for optical flow), with a class-dependent
direction, so that a probe has something to find; every other clip has an AAC audio track (UCF-101
has audio on about half of its clips).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

#: Motion per frame (dx, dy) in pixels, by class index (cycled).
MOTIONS = ((2, 0), (0, 2), (-2, 0), (0, -2), (2, 2), (-2, 2))


def write_clip(path: Path, n_frames: int, size: tuple[int, int], motion: tuple[int, int], seed: int,
               audio: bool, fps: int = 25, codec: str = "mpeg4") -> None:
    """One clip of ``n_frames`` frames of ``size`` (H, W): a texture moving by ``motion`` px per frame."""
    import av
    import cv2

    h, w = size
    dx, dy = motion
    pad = 2 * n_frames + 2
    rng = np.random.default_rng(seed)
    texture = cv2.resize(rng.integers(0, 256, ((h + 2 * pad) // 8, (w + 2 * pad) // 8, 3), dtype=np.uint8),
                         (w + 2 * pad, h + 2 * pad), interpolation=cv2.INTER_CUBIC)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if audio:
            sound = out.add_stream("aac", rate=16000)
            sound.layout = "mono"
        for i in range(n_frames):
            y, x = pad + dy * i, pad + dx * i
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(texture[y:y + h, x:x + w]), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if audio:
            n = int(16000 * n_frames / fps)
            t = np.arange(n) / 16000
            wave = (0.3 * np.sin(2 * np.pi * (220 + 40 * seed % 400) * t)).astype(np.float32)[None]
            chunk = av.AudioFrame.from_ndarray(wave, format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts, chunk.time_base = 16000, 0, Fraction(1, 16000)
            for packet in sound.encode(chunk):
                out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)


def make_ucf101(root: Path, classes: int = 2, train_per_class: int = 2, test_per_class: int = 1, n_frames: int = 10,
                size: tuple[int, int] = (48, 64), audio: bool = True, codec: str = "mpeg4") -> Path:
    """``root`` laid out as UCF-101 (split 1 lists and classInd.txt); returns ``root``."""
    names = [f"Action{chr(65 + c)}" for c in range(classes)]
    lists = root / "ucfTrainTestlist"
    lists.mkdir(parents=True, exist_ok=True)
    train, test = [], []
    for c, name in enumerate(names):
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(train_per_class + test_per_class):
            rel = f"{name}/v_{name}_g{k + 1:02d}_c01.avi"
            write_clip(root / rel, n_frames, size, MOTIONS[c % len(MOTIONS)], seed=100 * c + k, audio=audio and k % 2 == 0,
                       codec=codec)
            (train if k < train_per_class else test).append(rel)
    (lists / "classInd.txt").write_text("".join(f"{c + 1} {n}\n" for c, n in enumerate(names)))
    index = {n: c + 1 for c, n in enumerate(names)}
    (lists / "trainlist01.txt").write_text("".join(f"{rel} {index[rel.split('/')[0]]}\n" for rel in train))
    (lists / "testlist01.txt").write_text("".join(f"{rel}\n" for rel in test))
    return root


if __name__ == "__main__":  # [CODEC=libx264] python tests/video_clips.py ROOT [classes train_per_class test_per_class frames H W]
    import os
    import sys

    args = [int(a) for a in sys.argv[2:]]
    keys = ("classes", "train_per_class", "test_per_class", "n_frames")
    options = dict(zip(keys, args[:4]))
    if len(args) >= 6:
        options["size"] = (args[4], args[5])
    print(make_ucf101(Path(sys.argv[1]), codec=os.environ.get("CODEC", "mpeg4"), **options))
