"""Embedded synthetic multimodal data: modalities sharing two hidden factors and a sample's content.

The default data of the quickstart and the tests, generated on the fly with nothing to download.
Each sample has a class, a continuous sentiment and its own content (a continuous latent that
every modality renders, so that held-out cross-view retrieval has something to find); text,
audio, image, video and flow each encode them in their own way under their own nuisance. The
factors live in relations (an interval, a hue difference, a relative motion) rather than in
first-order statistics, so a probe on a random encoder recovers them only partly while an
encoder trained to agree across modalities can learn them. Sample ``i`` depends only on
``(seed, i)``; ``missing_rate`` makes modalities absent. What each modality holds, the splits,
the options and measured numbers are in ``data_cards/synthetic.md``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from mmviews.data.registry import dataset_error, register_dataset

MODALITIES = ("text", "audio", "image", "video", "flow")

_TOPICS: tuple[tuple[str, ...], ...] = (
    ("pizza", "pasta", "dinner", "dessert", "soup", "bread"),
    ("flight", "hotel", "beach", "train", "museum", "trip"),
    ("laptop", "phone", "software", "camera", "battery", "screen"),
    ("match", "team", "goal", "coach", "race", "stadium"),
    ("concert", "album", "song", "guitar", "singer", "band"),
    ("film", "actor", "plot", "scene", "director", "cinema"),
    ("novel", "author", "chapter", "story", "poem", "library"),
    ("rain", "storm", "sunshine", "snow", "wind", "forecast"),
)
# Sentiment levels from strongly negative to strongly positive.
_SENTIMENT: tuple[tuple[str, ...], ...] = (
    ("terrible", "awful", "horrible", "dreadful"),
    ("bad", "poor", "dull", "disappointing"),
    ("okay", "average", "fine", "ordinary"),
    ("good", "nice", "pleasant", "enjoyable"),
    ("excellent", "wonderful", "amazing", "fantastic"),
)
# The sample's content (a continuous latent, u and v in [0, 1)) in words: one word per eighth
# of u (a place) and of v (a colour).
_PLACES = ("kitchen", "garden", "office", "harbour", "village", "station", "mountain", "island")
_COLOURS = ("crimson", "orange", "golden", "olive", "emerald", "teal", "navy", "violet")
CONTENT_LEVELS = len(_PLACES)
_INTENSIFIERS = ("very", "really", "quite", "so", "truly")
_FILLER = (
    "the", "a", "it", "was", "is", "i", "think", "honestly", "this", "that", "my", "we", "they", "just", "with",
    "and", "but", "about", "today", "yesterday", "friend", "people", "time", "some", "thing", "place", "also",
    "maybe", "still", "again", "here", "there", "overall", "kind", "of", "had", "got", "felt", "seemed", "went",
    "saw", "heard", "said", "for", "on", "in", "at", "to", "our", "their", "after", "before", "then", "well",
    "anyway", "actually", "somehow", "week", "morning", "evening",
)
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Interval (semitones) between the two tones of each class.
_INTERVALS = (3.0, 4.0, 5.0, 7.0, 8.0, 9.0, 10.0, 2.0)


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    import colorsys

    return np.array(colorsys.hsv_to_rgb(h, s, v))


def synthetic_vocabulary(special_tokens: bool = True) -> list[str]:
    """Every word the synthetic text can contain (sorted), special tokens first if asked.

    ``transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(synthetic_vocabulary())})``
    gives a tiny tokenizer with no unknown words (pass ``vocab=``: transformers 5 silently
    ignores ``vocab_file=`` and every word becomes ``[UNK]``). A text adapter config can name
    this list as ``vocab: synthetic`` instead of copying it.
    """
    words = {w for group in _TOPICS for w in group} | {w for group in _SENTIMENT for w in group}
    words |= set(_INTENSIFIERS) | set(_FILLER) | set(_PLACES) | set(_COLOURS) | {"not"}
    return (list(SPECIAL_TOKENS) if special_tokens else []) + sorted(words)


def write_vocabulary(path: str | Path) -> Path:
    """Write ``synthetic_vocabulary()`` one token per line (a BERT ``vocab.txt``)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(synthetic_vocabulary()) + "\n")
    tmp.replace(path)
    return path


class SyntheticMultimodal(Dataset):
    """K synthetic samples with text, audio, image, video and flow sharing (class, sentiment, content).

    Args:
        num_samples: K.
        seed: everything is a function of ``seed`` (and the index).
        missing_rate: probability that a modality is absent, a float or ``{modality: rate}``.
        num_classes: number of classes (2..8).
        modalities: which modalities to produce (default all five).
        sample_rate, image_size, num_frames: audio rate, image/video side, video length.

    Items are sample dicts: ``{"index", "modalities": {name: value or None}, "labels":
    {"class": int, "sentiment": float, "content_u": float, "content_v": float}}``; see
    ``data_cards/synthetic.md`` for the shapes.
    """

    def __init__(self, num_samples: int = 1024, seed: int = 0, missing_rate: float | Mapping[str, float] = 0.0, *,
                 num_classes: int = 4, modalities: Sequence[str] = MODALITIES, sample_rate: int = 16000,
                 image_size: int = 32, num_frames: int = 6) -> None:
        if num_samples < 0:
            raise dataset_error(ValueError, f"num_samples must be >= 0, got {num_samples}", "num_samples")
        if not 2 <= num_classes <= len(_TOPICS):
            raise dataset_error(ValueError, f"num_classes must be in [2, {len(_TOPICS)}], got {num_classes}", "num_classes")
        unknown = set(modalities) - set(MODALITIES)
        if unknown or not modalities:
            raise dataset_error(ValueError, f"unknown modalities {sorted(unknown)}; choose from {MODALITIES}", "modalities")
        if num_frames < 2:
            raise dataset_error(ValueError, "num_frames must be >= 2 (flow needs two frames)", "num_frames")
        rates = {m: float(missing_rate) for m in MODALITIES} if not isinstance(missing_rate, Mapping) else \
            {m: float(missing_rate.get(m, 0.0)) for m in MODALITIES}
        for m, r in rates.items():
            if not 0.0 <= r < 1.0:
                raise dataset_error(ValueError, f"missing_rate for {m!r} must be in [0, 1), got {r}", "missing_rate")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.num_classes = int(num_classes)
        self.modalities = tuple(m for m in MODALITIES if m in modalities)
        self.sample_rate = int(sample_rate)
        self.image_size = int(image_size)
        self.num_frames = int(num_frames)
        rng = np.random.default_rng([self.seed, 0x5EED])
        self.classes = rng.integers(0, self.num_classes, size=self.num_samples)
        self.sentiment = rng.uniform(-1.0, 1.0, size=self.num_samples)
        # The per-sample content every modality renders (after the factors, so that they keep their draws).
        self.content = rng.uniform(0.0, 1.0, size=(self.num_samples, 2))
        # Presence [K, len(modalities)]: drawn once so that it is a property of the dataset.
        present = np.ones((self.num_samples, len(self.modalities)), dtype=bool)
        for j, m in enumerate(self.modalities):
            present[:, j] = rng.random(self.num_samples) >= rates[m]
        if "video" in self.modalities and "flow" in self.modalities:
            present[:, self.modalities.index("flow")] &= present[:, self.modalities.index("video")]
        empty = ~present.any(axis=1)
        if empty.any():
            keep = rng.integers(0, len(self.modalities), size=int(empty.sum()))
            present[np.flatnonzero(empty), keep] = True
            if "flow" in self.modalities and "video" in self.modalities:
                fi, vi = self.modalities.index("flow"), self.modalities.index("video")
                rows = np.flatnonzero(empty)[keep == fi]
                present[rows, vi] = True
        self.present = present

    def __len__(self) -> int:
        return self.num_samples

    def modality_info(self) -> dict[str, dict[str, Any]]:
        S, T = self.image_size, self.num_frames
        info = {
            "text": {"kind": "text"},
            "audio": {"kind": "waveform", "shape": (None,), "sample_rate": self.sample_rate},
            "image": {"kind": "image", "shape": (3, S, S)},
            "video": {"kind": "video", "shape": (T, 3, S, S)},
            "flow": {"kind": "flow", "shape": (T - 1, 2, S, S)},
        }
        return {m: info[m] for m in self.modalities}

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index = index % self.num_samples
        c, s = int(self.classes[index]), float(self.sentiment[index])
        u, v = (float(x) for x in self.content[index])
        rng = np.random.default_rng([self.seed, index])
        mods: dict[str, Any] = {}
        # Each modality draws from its own child stream so that dropping one leaves the others unchanged.
        streams = {m: np.random.default_rng([self.seed, index, k]) for k, m in enumerate(MODALITIES)}
        del rng
        present = dict(zip(self.modalities, self.present[index].tolist()))
        if "text" in self.modalities:
            mods["text"] = self._text(c, s, u, v, streams["text"]) if present["text"] else None
        if "audio" in self.modalities:
            mods["audio"] = self._audio(c, s, u, v, streams["audio"]) if present["audio"] else None
        if "image" in self.modalities:
            mods["image"] = self._image(c, s, u, v, streams["image"]) if present["image"] else None
        if "video" in self.modalities or "flow" in self.modalities:
            want_v = present.get("video", False)
            want_f = present.get("flow", False)
            video, flow = self._video(c, s, u, v, streams["video"]) if (want_v or want_f) else (None, None)
            if "video" in self.modalities:
                mods["video"] = video if want_v else None
            if "flow" in self.modalities:
                mods["flow"] = flow if want_f else None
        return {"index": index, "modalities": mods, "labels": {"class": c, "sentiment": s, "content_u": u, "content_v": v}}

    # ------------------------------------------------------------------ generators

    def _text(self, c: int, s: float, u: float, v: float, rng: np.random.Generator) -> str:
        level = min(4, int((s + 1.0) / 2.0 * 5))
        # the content, quantised to eighths: a place and a colour word
        chunks: list[list[str]] = [["in", "the", _PLACES[min(CONTENT_LEVELS - 1, int(u * CONTENT_LEVELS))]],
                                   [_COLOURS[min(CONTENT_LEVELS - 1, int(v * CONTENT_LEVELS))]]]
        for _ in range(int(rng.integers(1, 3))):
            chunks.append([str(rng.choice(_TOPICS[c]))])
        if rng.random() < 0.7:
            # A negated topic word of another class ("not pizza"): counting topic words alone
            # (a bag of words) no longer tells the class; the negation has to be read.
            other = (c + int(rng.integers(1, self.num_classes))) % self.num_classes
            chunks.append(["not", str(rng.choice(_TOPICS[other]))])
        if level != 2 and rng.random() < 0.25:
            # "not" + the mirrored level: same polarity, different surface words.
            phrase = ["not", str(rng.choice(_SENTIMENT[4 - level]))]
        else:
            phrase = [str(rng.choice(_SENTIMENT[level]))]
            if level in (0, 4) and rng.random() < 0.5:
                phrase.insert(0, str(rng.choice(_INTENSIFIERS)))
        chunks.append(phrase)
        for _ in range(int(rng.integers(4, 10))):
            chunks.append([str(rng.choice(_FILLER))])
        order = rng.permutation(len(chunks))
        return " ".join(w for i in order for w in chunks[i])

    def _audio(self, c: int, s: float, u: float, v: float, rng: np.random.Generator) -> torch.Tensor:
        sr = self.sample_rate
        n = int(sr * rng.uniform(0.4, 0.6))
        t = np.arange(n) / sr
        # Class = the interval between two simultaneous tones over the content's root:
        # no single frequency band tells the class, only the relation between the two.
        # the content: u sets the root pitch (0.9 octave), v the timbre (the upper harmonics' weights)
        root = 200.0 * 2.0 ** (0.9 * u)
        interval = _INTERVALS[c] + rng.uniform(-0.3, 0.3)
        freqs = (root, root * 2.0 ** (interval / 12.0))
        tone = np.zeros(n)
        for f0 in freqs:
            weights = np.array([1.0, 0.6 * v, 0.6 * (1.0 - v)]) + rng.uniform(0.0, 0.05, size=3)
            phase = rng.uniform(0, 2 * math.pi, size=3)
            tone += sum(w * np.sin(2 * math.pi * f0 * (h + 1) * t + p) for h, (w, p) in enumerate(zip(weights, phase)))
        am_rate = 3.0 + 3.0 * (s + 1.0)
        envelope = 1.0 - 0.5 * (1.0 + np.sin(2 * math.pi * am_rate * t + rng.uniform(0, 2 * math.pi))) * 0.8
        x = tone * envelope
        onset = int(rng.uniform(0.0, 0.1) * sr)
        x[:onset] = 0.0
        x = x / (np.abs(x).max() + 1e-8) * rng.uniform(0.2, 1.0)
        snr_db = rng.uniform(0.0, 20.0)
        p_sig = float(np.mean(x[onset:] ** 2)) if n > onset else 1e-4
        noise = rng.standard_normal(n) * math.sqrt(p_sig / 10 ** (snr_db / 10.0))
        return torch.from_numpy((x + noise).astype(np.float32))

    def _image(self, c: int, s: float, u: float, v: float, rng: np.random.Generator) -> torch.Tensor:
        S = self.image_size
        yy, xx = np.mgrid[0:S, 0:S].astype(np.float64) / S
        theta = math.pi * c / self.num_classes + rng.uniform(-0.15, 0.15) * math.pi / self.num_classes
        # the content: v sets the stripes' spatial frequency, u their base hue (0.9 of the circle: no wrap-around)
        freq = 2.0 + 3.0 * v
        wave = 0.5 + 0.5 * np.sin(2 * math.pi * freq * (xx * math.cos(theta) + yy * math.sin(theta)) + rng.uniform(0, 2 * math.pi))
        # Sentiment = the hue difference between the two stripe colours (0 to 180 degrees) around a
        # base hue: the mean colour carries nothing, only the stripes' relation does.
        hue = 0.9 * u
        delta = 0.5 * (s + 1.0) / 2.0
        light = _hsv(hue, 0.85, 0.95)
        dark = _hsv((hue + delta) % 1.0, 0.85, 0.5)
        background = rng.uniform(0.0, 1.0, size=3)
        cx, cy = rng.uniform(0.3, 0.7, size=2)
        radius = rng.uniform(0.3, 0.5)
        window = (((xx - cx) ** 2 + (yy - cy) ** 2) < radius**2).astype(np.float64)
        stripes = (wave > 0.5).astype(np.float64)[None]
        pattern = light[:, None, None] * stripes + dark[:, None, None] * (1 - stripes)
        img = window[None] * pattern + (1 - window[None]) * background[:, None, None]
        img = img + rng.normal(0.0, rng.uniform(0.02, 0.12), size=img.shape)
        return torch.from_numpy(np.clip(img, 0.0, 1.0).astype(np.float32))

    def _video(self, c: int, s: float, u: float, v: float, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        S, T = self.image_size, self.num_frames
        # Class = the axis of the square's motion relative to the scene (C axes over 180
        # degrees), travelled in a random direction along it; sentiment = its relative speed.
        # The camera pans at a random velocity, so most of the flow (the background) is
        # nuisance and the factors are in the square's motion *relative* to its surround.
        angle = math.pi * c / self.num_classes + rng.uniform(-0.15, 0.15) + math.pi * int(rng.integers(0, 2))
        speed = 1.0 + (s + 1.0)  # px per frame, 1..3
        relative_v = np.array([math.cos(angle), math.sin(angle)]) * speed
        # the content: u sets the pan's direction (0.9 of the circle), v its speed (0.5-2.5 px/frame)
        pan_angle = 2 * math.pi * 0.9 * u
        pan = np.array([math.cos(pan_angle), math.sin(pan_angle)]) * (0.5 + 2.0 * v)
        size = int(rng.integers(6, 11))
        screen_v = relative_v + pan
        travel = screen_v * (T - 1)
        lo = np.maximum(0.0, -travel)
        hi = np.minimum(S - size, S - size - travel)
        start = rng.uniform(lo, np.maximum(lo, hi))
        pos = np.rint(start[None, :] + np.arange(T)[:, None] * screen_v[None, :]).astype(int)
        pos = np.clip(pos, 0, S - size)  # (x, y) top-left per frame
        # The background is a crop of a larger texture whose origin follows the pan.
        margin = int(math.ceil(2.5 * (T - 1))) + 1
        big = S + 2 * margin
        low = rng.uniform(0, 1, size=(3, big // 4 + 1, big // 4 + 1))
        texture_bg = np.kron(low, np.ones((1, 4, 4)))[:, :big, :big]
        bg_pos = np.rint(np.arange(T)[:, None] * pan[None, :]).astype(int)  # scene shift per frame (x, y)
        texture = rng.uniform(0.0, 1.0, size=3)[:, None, None] * (0.7 + 0.3 * rng.random((1, size, size)))
        video = np.empty((T, 3, S, S), dtype=np.float32)
        flow = np.zeros((T - 1, 2, S, S), dtype=np.float32)
        for t in range(T):
            # The scene moves by +pan on screen: the window into the texture moves by -pan.
            ox, oy = margin - bg_pos[t, 0], margin - bg_pos[t, 1]
            frame = texture_bg[:, oy : oy + S, ox : ox + S].copy()
            x0, y0 = pos[t]
            frame[:, y0 : y0 + size, x0 : x0 + size] = texture
            video[t] = frame
            if t < T - 1:
                db = bg_pos[t + 1] - bg_pos[t]
                flow[t, 0], flow[t, 1] = db[0], db[1]
                d = pos[t + 1] - pos[t]
                flow[t, 0, y0 : y0 + size, x0 : x0 + size] = d[0]
                flow[t, 1, y0 : y0 + size, x0 : x0 + size] = d[1]
        video += rng.normal(0.0, 0.03, size=video.shape).astype(np.float32)
        return torch.from_numpy(np.clip(video, 0, 1)), torch.from_numpy(flow)


# ----------------------------------------------------------------------------- registration

# Seed offsets so that the synthetic splits are disjoint draws of the same distribution.
_SPLIT_OFFSET = {"train": 0, "valid": 1, "test": 2}
SYNTHETIC_DEFAULT_SIZES = {"train": 2048, "valid": 512, "test": 512}


@register_dataset("synthetic", "embedded text/audio/image/video/flow data sharing a class, a sentiment and a per-sample content (no download)",
                  options_from=[SyntheticMultimodal])
def _build_synthetic(root: Any = None, split: str = "train", num_samples: int | None = None, seed: int = 0,
                     **options: Any) -> Dataset:
    # split s of seed k draws from seed 1000 k + offset(s): disjoint splits, one per seed.
    if split not in _SPLIT_OFFSET:
        raise dataset_error(ValueError, f"synthetic: unknown split {split!r}; choose from {sorted(_SPLIT_OFFSET)}", "split")
    n = SYNTHETIC_DEFAULT_SIZES[split] if num_samples is None else int(num_samples)
    return SyntheticMultimodal(n, seed=seed * 1000 + _SPLIT_OFFSET[split], **options)
