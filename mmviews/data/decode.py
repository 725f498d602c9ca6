"""Decoding stored values into the tensors of sample dicts: one place, below every reader.

The map-style readers (:class:`~mmviews.data.hf.HFDataset`, :class:`~mmviews.data.video.VideoFolder`
and its prepared store, :mod:`mmviews.data.video_store`) and the Parquet shard readers
(:mod:`mmviews.data.streaming`, map-style or streamed) decode with these functions, so a value
read either way gives the same tensor. This module imports none of them.

What each column kind decodes to (``kind`` as in ``HFDataset.kinds`` / ``mmviews_shards.json``):

- ``image``: bytes, ``{bytes, path}``, a path in ``{path}`` or a PIL image -> float32
  ``[3, H, W]`` RGB in [0, 1], resized (antialiased, clamped to [0, 1]) to ``image_size`` when
  given (:func:`decode_image`).
- ``waveform``: WAV/FLAC/OGG bytes, ``{bytes, path}``, a path or ``{array, sampling_rate}`` ->
  float32 ``[T]`` mono (channel mean) at ``sample_rate`` (torchaudio's resampler), values as
  stored, [-1, 1] for PCM files (:func:`decode_audio`). A video shard's audio track (FLAC bytes):
  the same as a numpy array (:func:`decode_flac`).
- ``text``: ``str``. ``tokens`` (sentiment shards): int64 ids ``[L]`` and an all-ones mask.
- ``sequence`` (sentiment features): float32 ``[L, D]``. ``array``: float32 of its recorded shape.
- Video frames: JPEG bytes (video shards, :func:`decode_jpeg`) or store files
  (:func:`read_jpeg`) -> uint8 ``[H, W, 3]`` RGB; frame-folder images (:func:`read_image`) ->
  uint8 ``[H, W, 3]`` RGB or ``[H, W]`` gray. The readers stack them to ``[T, 3, H, W]`` float32
  in [0, 1].
- Flow: uint8 flow images (frame folders, store, shards) in the convention of the common
  TV-L1 flow releases, clip to +-``FLOW_BOUND`` (20) px then ``value = (f + 20) * 255 / 40``
  (:func:`encode_flow_image`) -> float32 pixels in [-20, 20] (:func:`decode_flow_image`); the flow
  of a clip's frame window, ``[T - 1, 2, H, W]``, zero between repeated frames (:func:`window_flow`).

Video containers (PyAV: frames, windows, audio tracks by seeking) are read by
:mod:`mmviews.data.video_io`. A value that cannot be decoded is a ValueError naming the file
(or the value); the readers add the row and column.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

FLOW_BOUND = 20.0


def decode_image(value: Any, image_size: tuple[int, int] | None) -> torch.Tensor:
    """An image value (bytes, {bytes, path}, or a PIL image) as FloatTensor ``[3, H, W]`` in [0, 1], resized to
    ``image_size`` when given; a damaged file is a ValueError naming it."""
    from PIL import Image

    if isinstance(value, (bytes, bytearray)):
        value = {"bytes": bytes(value), "path": None}
    src = value.get("path") if isinstance(value, Mapping) else None
    try:
        if isinstance(value, Mapping) and value.get("bytes"):
            im = Image.open(io.BytesIO(value["bytes"]))
        elif src:
            im = Image.open(src)
        else:
            im = value  # already a PIL image
        arr = np.asarray(im.convert("RGB"))
    except Exception as err:  # PIL raises several types for damaged files
        raise ValueError(f"{src or '<image bytes>'}: cannot read image ({type(err).__name__}: {err})") from err
    x = torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)
    if image_size is not None and tuple(x.shape[-2:]) != tuple(image_size):
        from torchvision.transforms.v2 import functional as F

        x = F.resize(x, list(image_size), antialias=True).clamp_(0, 1)
    return x


def decode_audio(value: Any, sample_rate: int) -> torch.Tensor:
    """An audio value (bytes, {bytes, path}, a path, or {array, sampling_rate}) as mono float32 ``[T]`` at
    ``sample_rate`` (soundfile, then torchaudio's resampler); a damaged file is a ValueError naming it."""
    import soundfile as sf

    if isinstance(value, Mapping) and "array" in value:
        wav, sr = np.asarray(value["array"], dtype=np.float32), int(value.get("sampling_rate", sample_rate))
        src = value.get("path") or "<audio array>"
    else:
        if isinstance(value, (bytes, bytearray)):
            value = {"bytes": bytes(value), "path": None}
        src = (value.get("path") if isinstance(value, Mapping) else value) or "<audio bytes>"
        try:
            if isinstance(value, Mapping) and value.get("bytes"):
                wav, sr = sf.read(io.BytesIO(value["bytes"]), dtype="float32", always_2d=True)
            else:
                wav, sr = sf.read(str(src), dtype="float32", always_2d=True)
        except Exception as err:  # soundfile raises LibsndfileError / RuntimeError variants
            raise ValueError(f"{src}: cannot read audio ({type(err).__name__}: {err})") from err
        wav = wav.mean(axis=1)
    x = torch.from_numpy(np.ascontiguousarray(wav))
    if sr != sample_rate:
        import torchaudio.functional as AF

        x = AF.resample(x, sr, sample_rate)
    return x


def decode_flac(data: bytes, sample_rate: int) -> np.ndarray:
    """FLAC (or WAV) bytes as mono float32 ``[T]`` at ``sample_rate`` (numpy: a video clip's audio track
    in video shards, sliced to the clip's window before it becomes a tensor)."""
    import soundfile as sf

    try:
        wav, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as err:  # soundfile raises LibsndfileError / RuntimeError variants
        raise ValueError(f"cannot decode audio ({type(err).__name__}: {err})") from err
    wav = wav.mean(axis=1)
    if sr != sample_rate:
        import torchaudio.functional as AF

        wav = AF.resample(torch.from_numpy(wav), sr, sample_rate).numpy()
    return wav


def decode_jpeg(data: bytes, gray: bool) -> np.ndarray:
    """JPEG bytes (a video shard's frame or flow image) as uint8 ``[H, W]`` (gray) or ``[H, W, 3]`` RGB
    (OpenCV, as the store's :func:`read_jpeg`)."""
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR)
    if img is None:
        raise ValueError("cannot decode JPEG image")
    return img if gray else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def read_image(path: Path, mode: str) -> np.ndarray:
    """An image file as uint8 ``[H, W, 3]`` (``mode="RGB"``) or ``[H, W]`` (``"L"``); ValueError naming it."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert(mode))
    except Exception as err:  # PIL raises several types for damaged files
        raise ValueError(f"{path}: cannot read image ({type(err).__name__}: {err})") from err


def read_jpeg(path: Path, gray: bool) -> np.ndarray:
    """A store JPEG as uint8 ``[H, W]`` (gray) or ``[H, W, 3]`` RGB. OpenCV, not PIL: 2-4x faster
    on these small images (both use libjpeg-turbo)."""
    import cv2

    img = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR)
    if img is None:
        raise ValueError(f"{path}: missing or unreadable store image (rerun `mmviews prepare` to repair the store)")
    return img if gray else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def decode_flow_image(values: np.ndarray) -> np.ndarray:
    """uint8 flow image values -> pixels: ``v * 40 / 255 - 20`` (inverse of :func:`encode_flow_image`)."""
    return values.astype(np.float32) * (2 * FLOW_BOUND / 255.0) - FLOW_BOUND


def encode_flow_image(flow: np.ndarray) -> np.ndarray:
    """pixels -> uint8 flow image values: clip to +-20, then ``(f + 20) * 255 / 40``."""
    return np.rint((np.clip(flow, -FLOW_BOUND, FLOW_BOUND) + FLOW_BOUND) * 255.0 / (2 * FLOW_BOUND)).astype(np.uint8)


def window_flow(idx: np.ndarray, height: int, width: int, read: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Flow between frames ``idx[t]`` and ``idx[t + 1]`` as float32 ``[T - 1, 2, H, W]`` pixels, from
    ``read(starts)`` -> stored uint8 flow images ``[n, 2, H, W]`` of the frame pairs ``(s, s + 1)``.
    Consecutive frames read the stored flow; a repeated frame (a clip shorter than the window)
    gives zero flow. Shared by the store and the Parquet shards (:mod:`mmviews.data.streaming`)."""
    start = np.asarray(idx[:-1])
    moving = idx[1:] == idx[:-1] + 1
    out = np.zeros((len(start), 2, height, width), np.float32)
    wanted = start[moving]
    if len(wanted):
        out[moving] = decode_flow_image(read(wanted))
    return out
