"""Video at speed, audio: read_audio_window decodes only around the window and gives the samples
of the full decode + slice (read_audio_track), in VideoFolder too."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from mmviews.data.video import VideoFolder
from mmviews.data.video_io import read_audio_track, read_audio_window

SR = 16000  # output rate; the files are written at 44.1 kHz, so every read resamples
IN_RATE = 44100
FPS = 25
# Identical code on identical decoded samples (same resampler phases): the window read should be
# bit-identical; 1e-6 (a few float32 ulps at the signal's scale) leaves room for nothing else.
# Placing a window one output sample off changes it by ~0.5 (the chirp goes up to 6 kHz).
EXACT = 1e-6


def write_av(path: Path, seconds: float, codec: str = "aac", pns: bool = False, audio: bool = True,
             rate: int = IN_RATE, audio_seconds: float | None = None, gap: tuple[float, float] | None = None) -> None:
    """A tiny mpeg4 video (25 fps) of ``seconds`` with a stereo audio track (of ``audio_seconds``,
    default the same) at ``rate``: a 440 Hz tone plus a chirp from 1 to 6 kHz plus a little noise.
    ``pns=False`` turns off the AAC encoder's perceptual noise substitution, whose decoder-side
    noise depends on how much was decoded before (see :func:`test_aac_noise_substitution_within_tolerance`).
    ``gap=(at, seconds)``: the audio timestamps jump by ``seconds`` at ``at`` (no samples missing)."""
    import av

    n = int((seconds if audio_seconds is None else audio_seconds) * rate)
    t = np.arange(n) / rate
    rng = np.random.default_rng(0)
    chirp = np.sin(2 * np.pi * (1000 * t + 2500 * t**2 / seconds))
    mono = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * chirp + 0.03 * rng.standard_normal(n)
    wave = np.stack([mono, 0.5 * mono]).astype(np.float32)
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        if audio:
            options = {"aac_pns": "0"} if codec == "aac" and not pns else {}
            sound = out.add_stream(codec, rate=rate, options=options)
            sound.layout = "stereo"
            # the encoder's own sample format (fltp for AAC, s16 for PCM, ...)
            convert = av.AudioResampler(format=sound.codec_context.format, layout="stereo", rate=rate)
        written = 0
        for i in range(int(seconds * FPS)):
            img = np.full((32, 32, 3), (7 * i) % 256, np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
            upto = min(n, int((i + 1) * rate / FPS))  # interleave audio with the frames, as real files do
            while audio and written < upto:
                k = min(1024, upto - written)
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, written:written + k]), format="fltp",
                                                   layout="stereo")
                jump = int(gap[1] * rate) if gap is not None and written >= gap[0] * rate else 0
                frame.sample_rate, frame.pts, frame.time_base = rate, written + jump, Fraction(1, rate)
                for converted in convert.resample(frame):
                    for packet in sound.encode(converted):
                        out.mux(packet)
                written += k
        for packet in video.encode():
            out.mux(packet)
        if audio:
            for converted in convert.resample(None):
                for packet in sound.encode(converted):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("av")
    made = {}
    for name, seconds, codec in [("aac.mp4", 6.0, "aac"), ("mp3.avi", 6.0, "mp3"), ("pcm.avi", 6.0, "pcm_s16le"),
                                 ("aac.mkv", 6.0, "aac"), ("long.mp4", 40.0, "aac")]:
        made[name] = root / name
        write_av(made[name], seconds, codec)
    # Opus in Matroska: millisecond timestamps, all off by the same half millisecond after the
    # encoder's pre-skip (312 samples): consecutive, yet not where the samples are
    made["opus.mkv"] = root / "opus.mkv"
    write_av(made["opus.mkv"], 6.0, "libopus", rate=48000)
    # PCM in AVI states no audio duration: the container's (the video's, 8 s) over-states the 6 s track
    made["pcm_short.avi"] = root / "pcm_short.avi"
    write_av(made["pcm_short.avi"], 8.0, "pcm_s16le", audio_seconds=6.0)
    made["gap.mp4"] = root / "gap.mp4"
    write_av(made["gap.mp4"], 6.0, "aac", gap=(3.0, 0.5))
    made["pns.mp4"] = root / "pns.mp4"
    write_av(made["pns.mp4"], 6.0, "aac", pns=True)
    made["short.mp4"] = root / "short.mp4"
    write_av(made["short.mp4"], 0.6, "aac")
    made["silent.mp4"] = root / "silent.mp4"
    write_av(made["silent.mp4"], 2.0, audio=False)
    return made


def windows(total: int, n: int) -> dict[str, int]:
    """Window starts covering the cases of the clamping: before the start, at the start, the middle,
    just before the end (not shifted), across the end (shifted back) and past the end."""
    return {"before": -3000, "start": 0, "middle": total // 2 - n // 2 + 7, "near end": total - n - 5000,
            "across end": total - n + 300, "past end": total + 10000}


@pytest.mark.parametrize("name, seeks", [("aac.mp4", True), ("mp3.avi", True), ("pcm.avi", True),
                                         ("pcm_short.avi", True), ("aac.mkv", False), ("opus.mkv", False)])
def test_window_equals_slice_of_full_decode(files, name, seeks):
    path = files[name]
    full_stats: dict = {}
    full = read_audio_track(path, SR, stats=full_stats)
    n = SR  # one second
    assert full is not None and len(full) > 5 * SR
    for where, start in windows(len(full), n).items():
        stats: dict = {}
        got = read_audio_window(path, start, n, SR, stats=stats)
        s = max(0, min(len(full) - n, start))
        assert got is not None and got.shape == (n,), (name, where)
        assert np.abs(got - full[s:s + n]).max() <= EXACT, (name, where, stats)
        if where in ("before", "start"):
            assert stats["method"] == "head"  # near the start: decoded from there, no seek
        else:
            # Matroska's millisecond timestamps cannot place samples exactly: everything is decoded
            assert stats["method"] == ("seek" if seeks else "full"), (name, where)
        if stats["method"] != "full":
            assert stats["decoded"] < 0.75 * full_stats["decoded"], (name, where, stats)
    # the same through the full path
    stats = {}
    got = read_audio_window(path, len(full) // 3, n, SR, seek=False, stats=stats)
    assert stats["method"] == "full" and np.array_equal(got, full[len(full) // 3:len(full) // 3 + n])


def test_track_shorter_than_window_and_no_audio(files):
    full = read_audio_track(files["short.mp4"], SR)
    assert full is not None and len(full) < SR
    for start in (-100, 0, 500, 5 * SR):  # any start: the whole track
        got = read_audio_window(files["short.mp4"], start, SR, SR)
        assert got is not None and np.abs(got - full).max() <= EXACT
    for seek in (True, False):
        assert read_audio_window(files["silent.mp4"], 0, SR, SR, seek=seek) is None
    assert read_audio_track(files["silent.mp4"], SR) is None
    with pytest.raises(ValueError, match="silent.mp4"):
        read_audio_window(files["silent.mp4"], 0, -1, SR)


def test_timestamp_gap(files):
    """The full decode puts the samples end to end; a window read places them by their timestamps.
    A gap seen in the decoded part -> the full decode. A gap before it cannot be seen without
    reading the file up to the window: the window read then follows the timestamps (the clock the
    frames are placed on), i.e. the full decode's samples from half a second (the gap) earlier."""
    path = files["gap.mp4"]
    full = read_audio_track(path, SR)
    n, gap = SR, SR // 2
    stats: dict = {}
    start = int(2.5 * SR)  # the window and its decoded margin span the gap at 3 s
    got = read_audio_window(path, start, n, SR, stats=stats)
    assert stats["method"] == "full" and np.array_equal(got, full[start:start + n])
    start = int(4.2 * SR)
    got = read_audio_window(path, start, n, SR, stats=stats)
    assert stats["method"] == "seek"
    assert np.abs(got - full[start - gap:start - gap + n]).max() <= EXACT


def test_decode_work_does_not_grow_with_the_track(files):
    n = SR
    counts = {}
    for name in ("aac.mp4", "long.mp4"):
        path = files[name]
        full_stats: dict = {}
        total = len(read_audio_track(path, SR, stats=full_stats))
        counts[name] = {"full": full_stats["decoded"]}
        for where in ("middle", "across end"):
            stats: dict = {}
            read_audio_window(path, windows(total, n)[where], n, SR, stats=stats)
            assert stats["method"] == "seek"
            counts[name][where] = stats["decoded"]
    short, long = counts["aac.mp4"], counts["long.mp4"]
    assert long["full"] > 6 * short["full"]  # 40 s against 6 s of 1024-sample AAC frames
    frame_s = 1024 / IN_RATE
    for where, seconds in (("middle", 1.0 + 0.25 + 0.05), ("across end", 1.0 + 0.5 + 0.25 + 0.05)):
        # the window, the decoder's pre-roll and the resampler's warm-up (and, at the end, the slack
        # for an over-stated duration), give or take the frames where the seek lands
        assert abs(long[where] - short[where]) <= 2, counts
        assert long[where] <= seconds / frame_s + 6, counts


def test_aac_noise_substitution_within_tolerance(files):
    """AAC's perceptual noise substitution: FFmpeg's decoder fills those bands from a noise generator
    whose state carries over from every frame decoded since it was opened, so decoding from a seek
    gives another noise draw there than decoding from the start: equal to the full decode up to that
    noise, not bit for bit. Tolerance: the difference is a small part of the signal and the
    correlation near 1, while the same measures put a one-sample misplacement far outside."""

    def close(got: np.ndarray, ref: np.ndarray) -> bool:
        # measured here: window reads differ by <= 2 % of the signal's std, correlation >= 0.9998
        return bool(np.std(got - ref) <= 0.1 * np.std(ref) and np.corrcoef(got, ref)[0, 1] >= 0.995)

    path = files["pns.mp4"]
    full = read_audio_track(path, SR)
    n = SR
    for where, start in windows(len(full), n).items():
        got = read_audio_window(path, start, n, SR)
        s = max(0, min(len(full) - n, start))
        ref = full[s:s + n]
        assert close(got, ref), (where, np.std(got - ref) / np.std(ref), np.corrcoef(got, ref)[0, 1])
        # the full decode itself one sample off: 35-100 % of the std, correlation <= 0.94
        shifted = full[s + 1:s + 1 + n] if s + 1 + n <= len(full) else full[s - 1:s - 1 + n]
        assert not close(shifted, ref), where


def test_video_folder_audio_centred_on_the_frames(tmp_path):
    """VideoFolder keeps its centring: the audio is the full track's slice centred on the frame window
    (shifted inside the track), read by seeking or by the full decode alike."""
    root = tmp_path / "ucf"
    (root / "Jump").mkdir(parents=True)
    lengths = {"v_Jump_1.mp4": 8.0, "v_Jump_2.mp4": 3.0, "v_Jump_3.mp4": 1.2}
    for name, seconds in lengths.items():
        write_av(root / "Jump" / name, seconds)
    kw = dict(split="all", num_frames=8, size=16, max_audio_seconds=2.0, sample_rate=SR, store=False)
    seek, full = VideoFolder(root, decode="seek", **kw), VideoFolder(root, decode="full", **kw)
    n = 2 * SR
    for i, (_, rel) in enumerate(seek.clips):
        track = read_audio_track(root / rel, SR)
        frames = int(lengths[Path(rel).name] * FPS)
        first_frame = (frames - 8) // 2  # the middle 8 frames
        centre = int((first_frame / FPS + 8 / (2 * FPS)) * SR)
        s = max(0, min(len(track) - n, centre - n // 2))
        expected = torch.from_numpy(track[s:s + n])
        a, b = seek[i]["modalities"]["audio"], full[i]["modalities"]["audio"]
        assert a.shape == expected.shape == (min(n, len(track)),)
        assert (a - expected).abs().max() <= EXACT and torch.equal(b, expected), rel
