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
- :func:`read_audio_window`: the samples of that track a clip needs, found by seeking (the same
  samples as slicing :func:`read_audio_track`, see its docstring for when it decodes everything).
- Flow: :func:`farneback_flow` (OpenCV Farneback between consecutive frames), stored as uint8
  flow images in the convention of the common TV-L1 flow releases: clip to +-20 px, then
  ``value = (f + 20) * 255 / 40`` (:func:`mmviews.data.decode.encode_flow_image` /
  :func:`~mmviews.data.decode.decode_flow_image`).

Decoding stored values (images, JPEG frames, audio bytes, flow images): :mod:`mmviews.data.decode`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import numpy as np

VIDEO_EXTENSIONS = (".avi", ".mp4", ".mkv", ".webm", ".mov")
# Frame rate assumed when a stream does not state one (the rate of UCF-101 / HMDB-51).
DEFAULT_FPS = 25.0
# Audio window reads (read_audio_window). After a seek the decoder starts without the state that
# earlier packets leave (AAC/Vorbis MDCT overlap, the MP3 bit reservoir, Opus pre-roll): audio
# decoded in the first AUDIO_DECODER_PREROLL_S after the landing point is dropped (80 ms is the
# Opus recommendation, the largest of these codecs).
AUDIO_DECODER_PREROLL_S = 0.2
# The resampler started mid-track has no history: its first outputs differ from those of a full
# decode for the length of its filter (swr's default 32 taps, widened by in/out rate when
# downsampling: about 33 output samples at 44.1 -> 16 kHz, 100 at 48 -> 8 kHz); they are dropped.
AUDIO_RESAMPLER_WARMUP_S = 0.05
# How much the container's duration may over-state what decodes (edit lists, encoder padding):
# a window within this of the stated end is read from earlier so that the shift that fits it
# inside the track (known only at the end) stays inside what was decoded. A track that ends
# earlier still is read a second time, from its real end: this only saves that second pass.
AUDIO_LENGTH_SLACK_S = 0.5


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


def _mono_resampler(sample_rate: int) -> Any:
    import av

    return av.AudioResampler(format="flt", layout="mono", rate=sample_rate)


def read_audio_track(path: str | os.PathLike[str], sample_rate: int = 16000, stats: dict[str, Any] | None = None
                     ) -> np.ndarray | None:
    """The audio track as mono float32 ``[T]`` at ``sample_rate`` (PyAV), or None if the file has none.

    Every decoded frame goes through one resampler, in order: sample ``k`` of the result is
    sample ``k`` of the concatenated decoded audio, resampled. ``stats``, when given, receives
    ``decoded`` (audio frames decoded).
    """
    import av

    stats = {} if stats is None else stats
    stats["decoded"] = 0
    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = _mono_resampler(sample_rate)
        chunks: list[np.ndarray] = []
        for frame in container.decode(stream):
            stats["decoded"] += 1
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):  # flush
            chunks.append(out.to_ndarray().reshape(-1))
    if not chunks:
        return None
    return np.concatenate(chunks).astype(np.float32)


def _drop_leading_samples(frame: Any, count: int) -> Any:
    """A copy of audio frame ``frame`` without its first ``count`` samples (same format and layout)."""
    import av

    data = frame.to_ndarray()  # planar: [channels, samples]; packed: [1, samples * channels], interleaved
    per_sample = 1 if frame.format.is_planar else frame.layout.nb_channels
    out = av.AudioFrame.from_ndarray(np.ascontiguousarray(data[:, count * per_sample:]), format=frame.format,
                                     layout=frame.layout)
    out.sample_rate = frame.sample_rate
    return out


def _stated_track_samples(container: Any, stream: Any, in_rate: int) -> float | None:
    """Length of the audio track in input samples as the container states it (nothing decoded), or None."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base * in_rate)
    if container.duration:  # the longest stream's, in microseconds: an upper bound for the audio
        return container.duration / 1e6 * in_rate
    return None


def _decode_audio_range(container: Any, stream: Any, start: int, length: int, sample_rate: int,
                        stats: dict[str, Any], stated: float | None) -> tuple[np.ndarray | None, int | None]:
    """``(what read_audio_window returns, None)``, decoding only around the window, or ``(None,
    end)`` when it cannot: ``end`` is the track's length in input samples when the track ended
    before the decoded part (``stated``, its length in input samples as far as known, was too
    large; the caller tries again with ``end``), None when the timestamps cannot place the decoded
    samples exactly (the caller decodes everything). Counts the audio frames decoded in
    ``stats["decoded"]``.

    Samples are placed by their timestamps, relative to the first frame the decoder gives (sample
    0 of :func:`read_audio_track`): input sample ``(pts - pts0) * time_base * rate``. That is
    exact when a timestamp tick is at most one sample (MP4/MOV: the sample rate; PCM in AVI) or
    exactly one frame of samples (AVI's block counts), so only those are trusted; millisecond
    timestamps (Matroska/WebM) are rounded and are not. The full decode puts samples end to end,
    ignoring timestamps: a gap in the timestamps within the decoded part makes this give up, but
    one before the seek's landing point cannot be seen without reading the file up to it, so there
    the samples follow the timestamps (the frames' clock) where the full decode closes the gap.
    The resampler is fed from an input sample that falls on its output grid (a multiple of
    ``in_rate / gcd(in_rate, out_rate)``), so its outputs are those of the full decode, once its
    warm-up is dropped.
    """
    import av

    in_rate = int(stream.codec_context.sample_rate or 0)
    if not in_rate or stream.time_base is None:
        return None, None
    samples_per_tick = Fraction(stream.time_base) * in_rate
    frames = container.decode(stream)
    first = next(frames, None)
    if first is None:
        return None, None
    stats["decoded"] += 1

    def input_index(frame: Any) -> int | None:
        """Where ``frame`` starts in the full decode, in input samples; None when its timestamp cannot say."""
        if frame.pts is None or first.pts is None or (samples_per_tick > 1 and frame.samples != samples_per_tick):
            return None  # missing, or coarser than a sample without counting frames (rounded)
        return round((frame.pts - first.pts) * samples_per_tick)

    # The first output sample that must come out right: the window's start, or earlier when the
    # window may end up shifted to fit the track's end (its exact length is known only there).
    first_needed = max(0, start)
    if stated is not None:
        slack = AUDIO_LENGTH_SLACK_S * sample_rate
        first_needed = max(0, min(first_needed, math.floor(stated * sample_rate / in_rate - slack) - length))
    # Feed the resampler from output sample k0 (input sample m) on the shared grid, warm-up before it.
    grid = math.gcd(in_rate, sample_rate)
    steps = (first_needed - math.ceil(AUDIO_RESAMPLER_WARMUP_S * sample_rate)) // (sample_rate // grid)
    preroll = math.ceil(AUDIO_DECODER_PREROLL_S * in_rate)
    m = steps * (in_rate // grid)
    resampler = _mono_resampler(sample_rate)
    chunks: list[np.ndarray] = []
    produced = 0

    def push(frame: Any | None) -> None:
        nonlocal produced
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray().reshape(-1))
            produced += len(chunks[-1])

    seeked = m - preroll > 0
    if seeked:
        if input_index(first) is None:
            return None, None
        stats["method"] = "seek"
        k0 = steps * (sample_rate // grid)
        first_valid = k0 + math.ceil(AUDIO_RESAMPLER_WARMUP_S * sample_rate)
        target = m - preroll
        try:
            container.seek(first.pts + math.floor(target / samples_per_tick), stream=stream, backward=True,
                           any_frame=False)
        except av.error.FFmpegError:  # e.g. an AVI without an index: it can only be read in order
            return None, None
        frames = container.decode(stream)
    else:  # the window is near the start: decode from there, exactly as the full decode does
        stats["method"] = "head"
        k0 = first_valid = 0
        push(first)
    wanted_end = max(0, start) + length  # once the output reaches it, no shift to the end can happen
    expect: int | None = None  # input index the next decoded frame must start at (seek path)
    landed = False
    input_end = 0  # where the last decoded frame ends, in input samples (seek path)
    ended = True
    for frame in frames:
        stats["decoded"] += 1
        if seeked:
            i = input_index(frame)
            if i is None:
                return None, None
            if not landed:
                if i > target:
                    return None, None  # landed after the target: the decoder would not be warmed up
                landed = True
            input_end = i + frame.samples
            if expect is None:
                if i + frame.samples <= m:
                    continue  # decoded only to rebuild the decoder's state
                frame = _drop_leading_samples(frame, m - i)
                i = m
            elif i != expect:
                return None, None  # a gap or overlap: samples are not where the full decode puts them
            expect = i + frame.samples
            frame.pts, frame.time_base = i, Fraction(1, in_rate)
        push(frame)
        if k0 + produced >= wanted_end:
            ended = False
            break
    if ended:
        push(None)  # flush, as the full decode does at the end of the track
    total = k0 + produced  # the track's length, when it ended; otherwise a lower bound
    s = max(0, min(total - length, start)) if ended else max(0, start)
    if s < first_valid:  # the track ended earlier than stated: the shifted window starts before the decoded part
        return None, input_end
    wav = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    return wav[s - k0 : s - k0 + length].copy(), None  # a copy: the decoded margins are not kept alive


def read_audio_window(path: str | os.PathLike[str], start: int, length: int, sample_rate: int = 16000,
                      seek: bool = True, stats: dict[str, Any] | None = None) -> np.ndarray | None:
    """``length`` samples from sample ``start`` of :func:`read_audio_track` (mono float32 at
    ``sample_rate``), decoding only what they need; None when the file has no audio.

    Like slicing the full track: the window is shifted to fit inside the track
    (``s = max(0, min(T - length, start))``, ``T`` the track's length) and a track shorter than
    ``length`` is returned whole. The samples are those of the full decode, bit for bit, with two
    exceptions: after a gap in the audio timestamps (see :func:`_decode_audio_range`), and AAC
    bands coded by perceptual noise substitution, which FFmpeg's decoder fills from a noise
    generator whose state depends on everything decoded since the file was opened (another draw
    of the same noise). With ``seek``, PyAV seeks the audio stream to a little before
    the window, decodes and resamples forward and stops once the window is out, so the cost does
    not depend on the length of the track; a window near the start is decoded from the start
    without seeking ("head"), and one that may be shifted to fit the end is decoded to the end,
    from :data:`AUDIO_LENGTH_SLACK_S` before where the container says the track ends (if the track
    ends before that, a second pass starts from its real end). When the timestamps cannot place
    samples exactly (missing, millisecond-rounded, with gaps) or the seek fails or lands after the
    window, everything is decoded instead ("full"). ``stats``, when given, receives ``decoded``
    (audio frames decoded, seeking and a second pass included) and ``method`` ("seek", "head" or
    "full").
    """
    import av

    if length < 0:
        raise ValueError(f"{path}: audio window length must be >= 0 samples, got {length}")
    stats = {} if stats is None else stats
    stats["decoded"] = 0
    stated: float | None = None
    for attempt in range(2 if seek else 0):
        with av.open(str(path)) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            if attempt == 0:
                stated = _stated_track_samples(container, stream, int(stream.codec_context.sample_rate or 0))
            wav, end = _decode_audio_range(container, stream, start, length, sample_rate, stats, stated)
        if wav is not None:
            return wav
        if end is None:
            break
        stated = end  # the track is shorter than its container says: once more, from its real end
    decoded_before = stats["decoded"]
    track = read_audio_track(path, sample_rate, stats)
    stats["decoded"] += decoded_before
    stats["method"] = "full"
    if track is None:
        return None
    s = max(0, min(len(track) - length, start))
    return track[s : s + length].copy()


def list_video_clips(root: str | os.PathLike[str], extensions: tuple[str, ...] = VIDEO_EXTENSIONS) -> list[str]:
    """Relative paths ``"Class/clip.ext"`` of the videos in ``root/<class>/``, sorted by class then name."""
    root = Path(root)
    return [f"{cls.name}/{f.name}" for cls in sorted(p for p in root.iterdir() if p.is_dir())
            for f in sorted(cls.iterdir()) if f.is_file() and f.suffix.lower() in extensions]
