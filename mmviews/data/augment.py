"""Seeded augmentations, usable per view, looked up by name.

Every augmentation is a callable ``aug(value, generator) -> value``: all randomness comes
from the ``torch.Generator`` it is given (the collator seeds one per sample and view), so
the same seed gives the same view in any worker. ``get_augmentation(name, **params)``
builds one from the registry; ``list_augmentations()`` lists the names.

Value kinds (see :mod:`mmviews.data.views`): images ``[3, H, W]`` in [0, 1]; waveforms
``[T]``; feature sequences ``[L, D]``; video ``[T, 3, H, W]``; flow ``[T, 2, H, W]`` in
pixels (u horizontal, v vertical); text ``str`` or a token dict.

To crop/flip a video view and a flow view identically, give both views the same
``seed_group`` parameter in the view spec (e.g. ``params: {seed_group: clip}``) and the same
crop parameters: they then draw the same random numbers (see ``video_default`` and ``flow_default``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as TF

from mmviews.registry import Registry

Augmentation = Callable[[Any, torch.Generator], Any]
AugmentationFactory = Callable[..., Augmentation]

# name -> factory(**params) -> Augmentation; private: use the functions below.
_AUGMENTATIONS: Registry[AugmentationFactory] = Registry("augmentation")


def register_augmentation(name: str, description: str = "") -> Callable[[AugmentationFactory], AugmentationFactory]:
    """Decorator: register a factory ``factory(**params) -> aug(value, generator)`` as ``name``
    (``description`` defaults to the first line of its docstring). A name registered twice
    raises ``ValueError``."""
    return _AUGMENTATIONS.register(name, description)


def list_augmentations() -> dict[str, str]:
    """``{name: one-line description}`` of every registered augmentation, sorted by name."""
    return _AUGMENTATIONS.descriptions()


def get_augmentation(name: str, **params: Any) -> Augmentation:
    """The augmentation ``name`` built with ``params``. An unknown name raises ``ValueError``
    listing the known ones; parameters the factory does not take raise ``ValueError`` too."""
    factory = _AUGMENTATIONS.get(name)
    try:
        return factory(**params)
    except TypeError as err:
        raise ValueError(f"augmentation {name!r}: bad parameters {params}: {err}") from err


# ----------------------------------------------------------------------------- helpers


def _u(g: torch.Generator, lo: float = 0.0, hi: float = 1.0) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=g))


def _coin(g: torch.Generator, p: float) -> bool:
    return float(torch.rand((), generator=g)) < p


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]."""
    if hi <= lo:
        return lo
    return int(torch.randint(lo, hi + 1, (), generator=g))


def _sub_seed(g: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (), generator=g))


def _crop_params(g: torch.Generator, H: int, W: int, scale: tuple[float, float], ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box sampler (Inception-style), drawing from ``g``."""
    area = H * W
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * _u(g, *scale)
        aspect = math.exp(_u(g, *log_r))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= W and 0 < h <= H:
            return _randint(g, 0, H - h), _randint(g, 0, W - w), h, w
    # Fallback: central crop at the clamped ratio.
    in_ratio = W / H
    if in_ratio < ratio[0]:
        w, h = W, int(round(W / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = H, int(round(H * ratio[1]))
    else:
        w, h = W, H
    return (H - h) // 2, (W - w) // 2, h, w


def compose(*augs: Augmentation) -> Augmentation:
    def run(x: Any, g: torch.Generator) -> Any:
        for a in augs:
            x = a(x, g)
        return x

    return run


@register_augmentation("identity")
def identity() -> Augmentation:
    """No change (an explicit natural view)."""
    return lambda x, g: x


# ----------------------------------------------------------------------------- images


@register_augmentation("simclr")
def simclr(size: int | tuple[int, int] | None = None, strength: float = 1.0, scale: tuple[float, float] = (0.08, 1.0),
           ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5, jitter_p: float = 0.8,
           gray_p: float = 0.2, blur_p: float = 0.5, blur_sigma: tuple[float, float] = (0.1, 2.0)) -> Augmentation:
    """SimCLR stack: random resized crop, h-flip, colour jitter of strength s, grayscale, blur.

    Uses ``torchvision.transforms.v2.functional``; parameters follow Chen et al. (2020):
    jitter brightness/contrast/saturation 0.8 s and hue 0.2 s in random order with p = 0.8,
    grayscale p = 0.2, Gaussian blur (kernel ~10% of the side) with p = ``blur_p`` (set 0 for
    CIFAR-sized images as the paper does). ``size`` defaults to the input size.
    """
    from torchvision.transforms.v2 import functional as F

    def run(img: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if img.ndim != 3:
            raise ValueError(f"simclr expects an image [C, H, W], got shape {tuple(img.shape)}")
        H, W = img.shape[-2:]
        out_size = (H, W) if size is None else ((size, size) if isinstance(size, int) else tuple(size))
        top, left, h, w = _crop_params(g, H, W, tuple(scale), tuple(ratio))
        x = F.resized_crop(img, top, left, h, w, list(out_size), antialias=True)
        if _coin(g, flip_p):
            x = F.horizontal_flip(x)
        if _coin(g, jitter_p) and strength > 0:
            order = torch.randperm(4, generator=g).tolist()
            b = _u(g, max(0.0, 1 - 0.8 * strength), 1 + 0.8 * strength)
            c = _u(g, max(0.0, 1 - 0.8 * strength), 1 + 0.8 * strength)
            s = _u(g, max(0.0, 1 - 0.8 * strength), 1 + 0.8 * strength)
            hue = _u(g, -min(0.5, 0.2 * strength), min(0.5, 0.2 * strength))
            for op in order:
                if op == 0:
                    x = F.adjust_brightness(x, b)
                elif op == 1:
                    x = F.adjust_contrast(x, c)
                elif op == 2:
                    x = F.adjust_saturation(x, s)
                else:
                    x = F.adjust_hue(x, hue)
        if _coin(g, gray_p):
            x = F.rgb_to_grayscale(x, num_output_channels=3)
        if _coin(g, blur_p):
            k = max(3, int(0.1 * min(out_size)) | 1)
            sigma = _u(g, *blur_sigma)
            x = F.gaussian_blur(x, [k, k], [sigma, sigma])
        return x.clamp(0.0, 1.0)

    return run


@register_augmentation("hflip")
def hflip(p: float = 0.5) -> Augmentation:
    """Horizontal flip of an image with probability p."""
    from torchvision.transforms.v2 import functional as F

    return lambda img, g: F.horizontal_flip(img) if _coin(g, p) else img


def _srgb_to_linear(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x <= 0.04045, x / 12.92, ((x + 0.055) / 1.055) ** 2.4)


def rgb_to_lab(img: torch.Tensor) -> torch.Tensor:
    """sRGB ``[..., 3, H, W]`` in [0, 1] -> CIE Lab (D65): L in [0, 100], a, b about [-128, 127]."""
    rgb = _srgb_to_linear(img.clamp(0, 1))
    m = torch.tensor([[0.412453, 0.357580, 0.180423], [0.212671, 0.715160, 0.072169], [0.019334, 0.119193, 0.950227]],
                     dtype=img.dtype)
    xyz = torch.einsum("ij,...jhw->...ihw", m, rgb)
    white = torch.tensor([0.950456, 1.0, 1.088754], dtype=img.dtype).view(3, 1, 1)
    t = xyz / white
    eps = 0.008856
    f = torch.where(t > eps, t.clamp_min(1e-12) ** (1 / 3), 7.787 * t + 16 / 116)
    L = torch.where(t[..., 1:2, :, :] > eps, 116 * f[..., 1:2, :, :] - 16, 903.3 * t[..., 1:2, :, :])
    a = 500 * (f[..., 0:1, :, :] - f[..., 1:2, :, :])
    b = 200 * (f[..., 1:2, :, :] - f[..., 2:3, :, :])
    return torch.cat([L, a, b], dim=-3)


def rgb_to_ydbdr(img: torch.Tensor) -> torch.Tensor:
    """RGB ``[..., 3, H, W]`` in [0, 1] -> YDbDr (Y in [0, 1], Db, Dr in [-1.333, 1.333])."""
    m = torch.tensor([[0.299, 0.587, 0.114], [-0.450, -0.883, 1.333], [-1.333, 1.116, 0.217]], dtype=img.dtype)
    return torch.einsum("ij,...jhw->...ihw", m, img)


def _channels(x: torch.Tensor, channels: int | None) -> torch.Tensor:
    if channels is None or x.shape[-3] == channels:
        return x
    if channels == 3 and x.shape[-3] == 1:
        return x.expand(*x.shape[:-3], 3, *x.shape[-2:]).clone()
    if channels == 3 and x.shape[-3] == 2:
        return torch.cat([x, x.mean(dim=-3, keepdim=True)], dim=-3)
    raise ValueError(f"cannot map {x.shape[-3]} channels to {channels}")


def _colour_view(which: str, channels: int | None, crop_scale: tuple[float, float] | None = None,
                 crop_ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.0) -> Augmentation:
    if crop_scale is not None and not 0.0 < float(crop_scale[0]) <= float(crop_scale[1]) <= 1.0:
        raise ValueError(f"colour view {which!r}: crop_scale must satisfy 0 < lo <= hi <= 1, got {crop_scale}")
    if not 0.0 <= flip_p <= 1.0:
        raise ValueError(f"colour view {which!r}: flip_p must be in [0, 1], got {flip_p}")

    def run(img: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if img.ndim != 3 or img.shape[-3] != 3:
            raise ValueError(f"colour view {which!r} needs an RGB image [3, H, W], got {tuple(img.shape)}")
        if crop_scale is not None or flip_p > 0:
            # CMC's augmentation (random resized crop + flip), drawn per view, so that the views do
            # not share pixel positions: otherwise matching the layout solves the task.
            from torchvision.transforms.v2 import functional as F

            H, W = img.shape[-2:]
            if crop_scale is not None:
                top, left, h, w = _crop_params(g, H, W, tuple(crop_scale), tuple(crop_ratio))
                img = F.resized_crop(img, top, left, h, w, [H, W], antialias=True).clamp(0.0, 1.0)
            if _coin(g, flip_p):
                img = F.horizontal_flip(img)
        if which == "rgb":
            return img
        if which in ("lab_l", "lab_ab"):
            lab = rgb_to_lab(img)
            out = lab[..., :1, :, :] / 100.0 if which == "lab_l" else (lab[..., 1:, :, :] + 128.0) / 255.0
        else:
            ydb = rgb_to_ydbdr(img)
            out = ydb[..., :1, :, :] if which == "ydbdr_y" else (ydb[..., 1:, :, :] + 1.333) / 2.666
        return _channels(out.clamp(0, 1), channels)

    return run


def _register_colour(name: str, doc: str) -> None:
    def factory(channels: int | None = None, crop_scale: tuple[float, float] | None = None,
                crop_ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.0) -> Augmentation:
        return _colour_view(name, channels, crop_scale, crop_ratio, flip_p)

    factory.__doc__ = doc + (" Optional CMC augmentation before the colour split: a random resized crop"
                             " (``crop_scale``, ``crop_ratio``) and a horizontal flip with probability ``flip_p``.")
    register_augmentation(name)(factory)


_register_colour("rgb", "IPMC colour view: the RGB image itself.")
_register_colour("lab_l", "IPMC colour view: L of CIE Lab scaled to [0, 1], [1, H, W] (channels=3 replicates it).")
_register_colour("lab_ab", "IPMC colour view: a, b of CIE Lab mapped to [0, 1], [2, H, W] (channels=3 appends their mean).")
_register_colour("ydbdr_y", "IPMC colour view: Y of YDbDr, [1, H, W].")
_register_colour("ydbdr_dbdr", "IPMC colour view: Db, Dr of YDbDr mapped to [0, 1], [2, H, W].")


# ----------------------------------------------------------------------------- audio


@register_augmentation("audio_crop")
def audio_crop(min_fraction: float = 0.6, max_fraction: float = 1.0) -> Augmentation:
    """Random crop of a waveform [T] to a fraction of its length in [min, max]."""

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        T = x.shape[-1]
        n = max(1, int(round(T * _u(g, min_fraction, max_fraction))))
        start = _randint(g, 0, T - n)
        return x[..., start : start + n]

    return run


@register_augmentation("audio_shift")
def audio_shift(max_fraction: float = 0.1) -> Augmentation:
    """Circular time shift by up to +-max_fraction of the length."""

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        m = int(x.shape[-1] * max_fraction)
        return torch.roll(x, _randint(g, -m, m), dims=-1)

    return run


@register_augmentation("audio_gain")
def audio_gain(min_db: float = -6.0, max_db: float = 6.0) -> Augmentation:
    """Gain in dB drawn uniformly (torchaudio.functional.gain)."""
    import torchaudio.functional as AF

    return lambda x, g: AF.gain(x, _u(g, min_db, max_db))


@register_augmentation("audio_noise")
def audio_noise(min_snr_db: float = 10.0, max_snr_db: float = 30.0) -> Augmentation:
    """White noise added at an SNR drawn in [min, max] dB (torchaudio.functional.add_noise)."""
    import torchaudio.functional as AF

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if x.numel() == 0 or float(x.pow(2).sum()) == 0.0:
            return x
        noise = torch.randn(x.shape, generator=g, dtype=x.dtype)
        snr = torch.tensor([_u(g, min_snr_db, max_snr_db)], dtype=x.dtype)
        return AF.add_noise(x.unsqueeze(0), noise.unsqueeze(0), snr).squeeze(0)

    return run


@register_augmentation("audio_speed")
def audio_speed(factors: tuple[float, ...] = (0.9, 1.0, 1.1), sample_rate: int = 16000) -> Augmentation:
    """Speed perturbation by resampling (Kaldi style: one of ``factors``; pitch moves too)."""
    import torchaudio.transforms as AT
    from fractions import Fraction

    # Playing at speed f = resampling by the ratio f : 1 and reading at the same rate. The
    # ratio is reduced to small integers (resample's kernel grows with orig / gcd) and each
    # kernel is built once here: sr -> sr / f per call would take tens of ms.
    resamplers = []
    for f in factors:
        r = Fraction(float(f)).limit_denominator(20)
        resamplers.append(None if r == 1 else AT.Resample(r.numerator, r.denominator))

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        rs = resamplers[_randint(g, 0, len(resamplers) - 1)]
        return x if rs is None else rs(x)

    return run


@register_augmentation("audio_default")
def audio_default(sample_rate: int = 16000, min_fraction: float = 0.7, snr_db: tuple[float, float] = (10.0, 30.0),
                  gain_db: tuple[float, float] = (-6.0, 6.0), speed: tuple[float, ...] = (0.9, 1.0, 1.1)) -> Augmentation:
    """Waveform pipeline: speed (resampling), crop, gain, noise at an SNR."""
    return compose(audio_speed(speed, sample_rate), audio_crop(min_fraction, 1.0), audio_gain(*gain_db),
                   audio_noise(*snr_db))


@register_augmentation("spec_augment")
def spec_augment(freq_mask: int = 8, time_mask: int = 20, num_freq_masks: int = 1, num_time_masks: int = 1) -> Augmentation:
    """SpecAugment masks (torchaudio Frequency/TimeMasking) on a spectrogram [..., F, T]."""
    import torchaudio.transforms as AT

    fm, tm = AT.FrequencyMasking(freq_mask), AT.TimeMasking(time_mask)

    def run(spec: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        # torchaudio draws from the global RNG: fork it so the view depends only on g.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_sub_seed(g))
            for _ in range(num_freq_masks):
                spec = fm(spec)
            for _ in range(num_time_masks):
                spec = tm(spec)
        return spec

    return run


# ----------------------------------------------------------------------------- text

_WORDLESS = ("[CLS]", "[SEP]", "[PAD]")


@register_augmentation("token_mask")
def token_mask(p: float = 0.15, mask_token: str = "[MASK]", mask_id: int = 103) -> Augmentation:
    """Replace each word (str input) or token id (token dict) by the mask with probability p."""

    def run(x: Any, g: torch.Generator) -> Any:
        if isinstance(x, str):
            words = x.split()
            keep = torch.rand(len(words), generator=g) >= p
            return " ".join(w if k else mask_token for w, k in zip(words, keep.tolist()))
        ids = torch.as_tensor(x["input_ids"]).clone()
        hit = torch.rand(ids.shape, generator=g) < p
        hit[0] = False  # keep [CLS]
        hit[-1] = False  # keep [SEP]
        ids[hit] = mask_id
        return {**x, "input_ids": ids}

    return run


@register_augmentation("word_deletion")
def word_deletion(p: float = 0.1) -> Augmentation:
    """Delete each word / inner token with probability p (at least one is kept)."""

    def run(x: Any, g: torch.Generator) -> Any:
        if isinstance(x, str):
            words = x.split()
            keep = torch.rand(len(words), generator=g) >= p
            if words and not bool(keep.any()):
                keep[_randint(g, 0, len(words) - 1)] = True
            return " ".join(w for w, k in zip(words, keep.tolist()) if k)
        ids = torch.as_tensor(x["input_ids"])
        keep = torch.rand(ids.shape, generator=g) >= p
        keep[0] = keep[-1] = True
        out = {"input_ids": ids[keep]}
        if "attention_mask" in x:
            out["attention_mask"] = torch.as_tensor(x["attention_mask"])[keep]
        return out

    return run


@register_augmentation("span_crop")
def span_crop(min_fraction: float = 0.6) -> Augmentation:
    """Keep a random contiguous span of at least min_fraction of the words / inner tokens."""

    def run(x: Any, g: torch.Generator) -> Any:
        if isinstance(x, str):
            words = x.split()
            n = len(words)
            if n == 0:
                return x
            k = max(1, int(math.ceil(n * _u(g, min_fraction, 1.0))))
            s = _randint(g, 0, n - k)
            return " ".join(words[s : s + k])
        ids = torch.as_tensor(x["input_ids"])
        inner = ids.shape[0] - 2
        if inner <= 1:
            return x
        k = max(1, int(math.ceil(inner * _u(g, min_fraction, 1.0))))
        s = 1 + _randint(g, 0, inner - k)
        sel = torch.cat([torch.tensor([0]), torch.arange(s, s + k), torch.tensor([ids.shape[0] - 1])])
        out = {"input_ids": ids[sel]}
        if "attention_mask" in x:
            out["attention_mask"] = torch.as_tensor(x["attention_mask"])[sel]
        return out

    return run


@register_augmentation("text_default")
def text_default(mask_p: float = 0.15, delete_p: float = 0.1, min_fraction: float = 0.8, mask_token: str = "[MASK]",
                 mask_id: int = 103) -> Augmentation:
    """Text pipeline: span crop, random deletion, token masking."""
    return compose(span_crop(min_fraction), word_deletion(delete_p), token_mask(mask_p, mask_token, mask_id))


# ----------------------------------------------------------------------------- video and flow


def _clip_params(g: torch.Generator, n_frames: int, H: int, W: int, num_frames: int | None,
                 scale: tuple[float, float], ratio: tuple[float, float], flip_p: float) -> tuple[int, int, tuple[int, int, int, int], bool]:
    """Shared sampler of (start, length in frames, crop box, flip) for a video of n_frames frames.

    The flow of the same clip (n_frames - 1 fields) calls it with n_frames = T_flow + 1 so both
    views draw the same numbers in the same order.
    """
    n = n_frames if num_frames is None else min(num_frames, n_frames)
    start = _randint(g, 0, n_frames - n)
    box = _crop_params(g, H, W, scale, ratio)
    flip = _coin(g, flip_p)
    return start, n, box, flip


@register_augmentation("video_default")
def video_default(num_frames: int | None = None, size: int | tuple[int, int] | None = None,
                  scale: tuple[float, float] = (0.3, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                  flip_p: float = 0.5) -> Augmentation:
    """Video [T, 3, H, W]: temporal crop to num_frames, one crop box and flip for all frames."""
    from torchvision.transforms.v2 import functional as F

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        T, _, H, W = x.shape
        start, n, (top, left, h, w), flip = _clip_params(g, T, H, W, num_frames, tuple(scale), tuple(ratio), flip_p)
        out_size = (H, W) if size is None else ((size, size) if isinstance(size, int) else tuple(size))
        y = F.resized_crop(x[start : start + n], top, left, h, w, list(out_size), antialias=True)
        return F.horizontal_flip(y) if flip else y

    return run


@register_augmentation("flow_default")
def flow_default(num_frames: int | None = None, size: int | tuple[int, int] | None = None,
                 scale: tuple[float, float] = (0.3, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 flip_p: float = 0.5) -> Augmentation:
    """Flow [T, 2, H, W]: the crop/flip of ``video_default`` with the same parameters (num_frames
    counts frames, so T_flow = num_frames - 1). Resizing scales u, v by the zoom; a horizontal
    flip mirrors the field and negates u.

    Frames [T, 3, H, W] whose flow is computed later, on the device (``data.options.flow: raft``):
    the same numbers crop and flip the frames that flow is made from (the T_flow + 1 frames of the
    window; frames are resized antialiased, as ``video_default`` does)."""
    from torchvision.transforms.v2 import functional as F

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        Tf, C, H, W = x.shape
        if C == 3:  # frames for flow on the device: T frames give T - 1 flows
            start, n, (top, left, h, w), flip = _clip_params(g, Tf, H, W, num_frames, tuple(scale), tuple(ratio), flip_p)
            out_size = (H, W) if size is None else ((size, size) if isinstance(size, int) else tuple(size))
            y = F.resized_crop(x[start : start + max(2, n)], top, left, h, w, list(out_size), antialias=True)
            return F.horizontal_flip(y) if flip else y
        if C != 2:
            raise ValueError(f"flow must be [T, 2, H, W] (or frames [T, 3, H, W] for flow on the device), got {tuple(x.shape)}")
        start, n, (top, left, h, w), flip = _clip_params(g, Tf + 1, H, W, num_frames, tuple(scale), tuple(ratio), flip_p)
        out_h, out_w = (H, W) if size is None else ((size, size) if isinstance(size, int) else tuple(size))
        y = x[start : start + max(1, n - 1), :, top : top + h, left : left + w]
        y = TF.interpolate(y, size=(out_h, out_w), mode="bilinear", align_corners=False)
        y = y * torch.tensor([out_w / w, out_h / h], dtype=y.dtype).view(1, 2, 1, 1)
        if flip:
            y = flip_flow(y)
        return y

    return run


def flip_flow(flow: torch.Tensor) -> torch.Tensor:
    """Horizontal flip of a flow field [..., 2, H, W]: mirror columns and negate u."""
    y = flow.flip(-1)
    return torch.cat([-y[..., :1, :, :], y[..., 1:, :, :]], dim=-3)


# ----------------------------------------------------------------------------- feature sequences


@register_augmentation("seq_temporal_crop")
def seq_temporal_crop(min_fraction: float = 0.7) -> Augmentation:
    """Keep a random contiguous window of a feature sequence [L, D]."""

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        L = x.shape[0]
        if L <= 1:
            return x
        n = max(1, int(math.ceil(L * _u(g, min_fraction, 1.0))))
        s = _randint(g, 0, L - n)
        return x[s : s + n]

    return run


@register_augmentation("seq_time_mask")
def seq_time_mask(max_width: float = 0.1, num_masks: int = 2) -> Augmentation:
    """Zero num_masks random time spans, each up to max_width of the length."""

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        L = x.shape[0]
        y = x.clone()
        for _ in range(num_masks):
            w = _randint(g, 0, int(L * max_width))
            s = _randint(g, 0, max(0, L - w))
            y[s : s + w] = 0
        return y

    return run


@register_augmentation("seq_noise")
def seq_noise(std: float = 0.1) -> Augmentation:
    """Gaussian noise of standard deviation std (relative to each feature's std over time)."""

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        scale = x.std(dim=0, keepdim=True) if x.shape[0] > 1 else torch.ones_like(x[:1])
        return x + std * scale * torch.randn(x.shape, generator=g, dtype=x.dtype)

    return run


@register_augmentation("seq_feature_dropout")
def seq_feature_dropout(p: float = 0.1) -> Augmentation:
    """Zero each feature dimension (for all time steps) with probability p."""

    def run(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        keep = (torch.rand(x.shape[-1], generator=g) >= p).to(x.dtype)
        return x * keep

    return run


@register_augmentation("sequence_default")
def sequence_default(min_fraction: float = 0.8, mask_width: float = 0.1, noise_std: float = 0.1,
                     dropout_p: float = 0.1) -> Augmentation:
    """Feature-sequence pipeline: temporal crop, time masking, Gaussian noise, feature dropout."""
    return compose(seq_temporal_crop(min_fraction), seq_time_mask(mask_width), seq_noise(noise_std),
                   seq_feature_dropout(dropout_p))
