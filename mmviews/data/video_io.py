"""Reading video files for the video datasets and the prepared video store.

- :func:`read_video_frames`: every frame of a file (PyAV, sequential decode).
- :func:`read_video_window`: only the frames a clip needs. The frame count and rate come from
  the stream's metadata; PyAV seeks to the keyframe at or before the first wanted frame,
  decodes forward, drops the frames before it and stops after the last one, so the cost of a
  clip depends on the keyframe interval, not on the length of the video. Frames are identified
  by their timestamps: frame ``i`` has ``pts = start_time + i / (fps * time_base)``. When the
  timestamps do not give consecutive indices (variable frame rate, missing timestamps, a frame
  count larger than what decodes), it falls back to the sequential full decode, so the frames
  returned are always those :func:`read_video_frames` would give.
- :func:`read_audio_track`: the audio track, resampled to mono.
- Flow: :func:`farneback_flow` (OpenCV Farneback between consecutive frames) and the uint8
  flow-image convention of the common TV-L1 flow releases: clip to +-20 px, then
  ``value = (f + 20) * 255 / 40`` (:func:`encode_flow_image` / :func:`decode_flow_image`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import numpy as np

VIDEO_EXTENSIONS = (".avi", ".mp4", ".mkv", ".webm", ".mov")
FLOW_BOUND = 20.0
# Frame rate assumed when a stream does not state one (the rate of UCF-101 / HMDB-51).
DEFAULT_FPS = 25.0


def decode_flow_image(values: np.ndarray) -> np.ndarray:
    """uint8 flow image values -> pixels: ``v * 40 / 255 - 20`` (inverse of :func:`encode_flow_image`)."""
    return values.astype(np.float32) * (2 * FLOW_BOUND / 255.0) - FLOW_BOUND


def encode_flow_image(flow: np.ndarray) -> np.ndarray:
    """pixels -> uint8 flow image values: clip to +-20, then ``(f + 20) * 255 / 40``."""
    return np.rint((np.clip(flow, -FLOW_BOUND, FLOW_BOUND) + FLOW_BOUND) * 255.0 / (2 * FLOW_BOUND)).astype(np.uint8)


def farneback_pair(gray0: np.ndarray, gray1: np.ndarray) -> np.ndarray:
    """Farneback flow from ``gray0`` to ``gray1`` (uint8 ``[H, W]``) as float32 ``[2, H, W]`` (u, v) pixels.

    Parameters of OpenCV's own sample (pyramid scale 0.5, 3 levels, window 15, 3 iterations,
    poly_n 5, poly_sigma 1.2); unclipped.
    """
    import cv2

    return cv2.calcOpticalFlowFarneback(gray0, gray1, None, 0.5, 3, 15, 3, 5, 1.2, 0).transpose(2, 0, 1)


def to_gray(frame: np.ndarray) -> np.ndarray:
    """RGB uint8 ``[H, W, 3]`` -> luma uint8 ``[H, W]`` (OpenCV's RGB2GRAY, BT.601 weights)."""
    import cv2

    return cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)


def farneback_flow(frames: np.ndarray) -> np.ndarray:
    """Flow between consecutive frames: uint8 ``[N, H, W, 3]`` RGB -> float32 ``[N - 1, 2, H, W]`` pixels."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) < 2:
        raise ValueError(f"farneback_flow: frames must be [N >= 2, H, W, 3], got shape {tuple(frames.shape)}")
    gray = [to_gray(f) for f in frames]
    return np.stack([farneback_pair(gray[t], gray[t + 1]) for t in range(len(gray) - 1)])


def read_image(path: Path, mode: str) -> np.ndarray:
    """An image file as uint8 ``[H, W, 3]`` (``mode="RGB"``) or ``[H, W]`` (``"L"``); ValueError naming it."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert(mode))
    except Exception as err:  # PIL raises several types for damaged files
        raise ValueError(f"{path}: cannot read image ({type(err).__name__}: {err})") from err


def read_video_frames(path: str | os.PathLike[str]) -> tuple[np.ndarray, float]:
    """All frames of a video file as uint8 ``[N, H, W, 3]`` RGB, and its frame rate (PyAV)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream")
        stream = container.streams.video[0]
        fps = float(stream.average_rate) if stream.average_rate else DEFAULT_FPS
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    if not frames:
        raise ValueError(f"{path}: the video stream has no decodable frames")
    return np.stack(frames), fps


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` reads without decoding: ``num_frames`` (from the container's
    frame count, or counted from the packets when the container has none: ``frames_from``
    says which), ``fps`` (None when the stream states no rate), size and audio presence."""

    num_frames: int
    fps: float | None
    width: int
    height: int
    has_audio: bool
    frames_from: str


def _count_frames(container: Any, stream: Any) -> tuple[int, str]:
    """Frame count of ``stream`` and where it came from ("metadata" or "packet scan")."""
    if stream.frames and stream.frames > 0:
        return int(stream.frames), "metadata"  # AVI (header) and MP4/MOV (sample table) record it
    # Matroska/WebM and raw streams do not record a frame count. Only then, scan the file: count
    # the video packets by demuxing (reads the file, decodes nothing; one packet per frame for
    # the codecs of these datasets). The caller seeks before decoding, so the read position
    # left at the end of the file does not matter.
    n = sum(1 for packet in container.demux(stream) if packet.size > 0)
    return n, "packet scan"


def probe_video(path: str | os.PathLike[str]) -> VideoInfo:
    """Frame count, rate, size and audio presence of a video file, without decoding frames."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream")
        stream = container.streams.video[0]
        n, source = _count_frames(container, stream)
        fps = float(stream.average_rate) if stream.average_rate else None
        return VideoInfo(n, fps, int(stream.codec_context.width), int(stream.codec_context.height),
                         bool(container.streams.audio), source)


def _decode_range(container: Any, stream: Any, start: int, stop: int, stats: dict[str, Any]) -> np.ndarray | None:
    """Frames ``start .. stop - 1`` as uint8 ``[stop - start, H, W, 3]`` by seeking, or None when
    the timestamps do not identify them (the caller then decodes sequentially). Counts the
    frames decoded in ``stats["decoded"]``."""
    rate = Fraction(stream.average_rate)
    tb = Fraction(stream.time_base)
    t0 = stream.start_time or 0
    # Seek (on the video stream's clock) to the keyframe at or before frame `start`.
    container.seek(t0 + int(Fraction(start) / (rate * tb)), stream=stream, backward=True, any_frame=False)
    out: list[np.ndarray] = []
    expect = start
    for frame in container.decode(stream):
        stats["decoded"] = stats.get("decoded", 0) + 1
        if frame.pts is None:
            return None
        i = round((frame.pts - t0) * tb * rate)
        if i < start:
            continue  # decoded only to reach the window (frames since the keyframe)
        if i != expect:
            return None  # a gap or a seek past `start`: indices by timestamp are not reliable here
        out.append(frame.to_ndarray(format="rgb24"))
        expect += 1
        if expect == stop:
            return np.stack(out)
    return None  # end of stream before `stop`: the recorded frame count was too large


def read_video_window(path: str | os.PathLike[str], select: Callable[[int], np.ndarray], seek: bool = True,
                      stats: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """The frames ``select(n)`` picks from a video of ``n`` frames.

    ``select`` maps the frame count to frame indices (sorted, repeats allowed, in ``[0, n)``).
    Returns ``(frames uint8 [len(idx), H, W, 3], idx, fps)``. With ``seek`` only the frames from
    the keyframe before ``idx[0]`` to ``idx[-1]`` are decoded; otherwise (or when the file's
    timestamps or frame count cannot be trusted, see the module docstring) every frame is.
    ``stats``, when given, receives ``decoded`` (frames decoded, seeking included), ``method``
    ("seek" or "full") and ``frames_from`` (where the frame count came from).
    """
    import av

    stats = {} if stats is None else stats
    stats["decoded"] = 0
    if seek:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"{path}: no video stream")
            stream = container.streams.video[0]
            if stream.average_rate:  # without a rate, timestamps cannot be mapped to frame indices
                n, stats["frames_from"] = _count_frames(container, stream)
                if n > 0:
                    idx = np.asarray(select(n))
                    lo, hi = int(idx.min()), int(idx.max()) + 1
                    if lo < 0 or hi > n:
                        raise ValueError(f"{path}: frame indices {lo}..{hi - 1} outside 0..{n - 1}")
                    frames = _decode_range(container, stream, lo, hi, stats)
                    if frames is not None:
                        stats["method"] = "seek"
                        return frames[idx - lo], idx, float(stream.average_rate)
    frames, fps = read_video_frames(path)
    stats.update(method="full", frames_from="full decode")
    stats["decoded"] += len(frames)
    idx = np.asarray(select(len(frames)))
    return frames[idx], idx, fps


def read_audio_track(path: str | os.PathLike[str], sample_rate: int = 16000) -> np.ndarray | None:
    """The audio track as mono float32 ``[T]`` at ``sample_rate`` (PyAV), or None if the file has none."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
        chunks: list[np.ndarray] = []
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):  # flush
            chunks.append(out.to_ndarray().reshape(-1))
    if not chunks:
        return None
    return np.concatenate(chunks).astype(np.float32)


def list_video_clips(root: str | os.PathLike[str], extensions: tuple[str, ...] = VIDEO_EXTENSIONS) -> list[str]:
    """Relative paths ``"Class/clip.ext"`` of the videos in ``root/<class>/``, sorted by class then name."""
    root = Path(root)
    return [f"{cls.name}/{f.name}" for cls in sorted(p for p in root.iterdir() if p.is_dir())
            for f in sorted(cls.iterdir()) if f.is_file() and f.suffix.lower() in extensions]
