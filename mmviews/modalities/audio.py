"""Audio: HuBERT / wav2vec2-family encoders through ``transformers``, and a small 1-D CNN
over log-mel frames for CPU runs.

Input: ``{"values": FloatTensor[B, T], "lengths": LongTensor[B], "sample_rate": int}``.
Waveforms are resampled to the backbone's rate (``torchaudio.functional.resample``),
zero-padded past their length, and pooled by a masked mean over the frames that come
from real samples (base HuBERT checkpoints take no attention mask, so padding is
removed at pooling rather than in attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .hf_backbone import transformers_backbone
from .inputs import (
    InputCheck,
    SequenceInputCheck,
    input_lengths,
    lengths_to_mask,
    masked_mean,
    require_tensor,
    to_device,
)
from .checkpointing import checkpointed, enable_transformers_checkpointing


def waveform_tensor(inputs: Mapping[str, Any], where: str) -> tuple[torch.Tensor, int]:
    """``values [B, T]`` (float, T > 0) and ``sample_rate`` (positive) of waveform inputs,
    structure checked (no value of the waveform is read)."""
    x = require_tensor(inputs, "values", where)
    if x.dim() != 2:
        raise ValueError(f"{where}: waveform values must be [B, T] (mono), got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{where}: zero-length waveform (values shape {tuple(x.shape)})")
    if not x.is_floating_point():
        raise ValueError(f"{where}: waveform must be float, got dtype {x.dtype}")
    if "sample_rate" not in inputs:
        raise ValueError(f"{where}: inputs need 'sample_rate' (the waveform's rate in Hz)")
    rate = int(inputs["sample_rate"])
    if rate <= 0:
        raise ValueError(f"{where}: sample_rate must be positive, got {rate}")
    return x, rate


def resampled_lengths(lengths: torch.Tensor, rate: int, target_rate: int, resampled_max: int) -> torch.Tensor:
    """Real lengths at ``target_rate`` of waveforms of ``lengths`` samples at ``rate`` (rounded
    up), within the ``resampled_max`` samples of the resampled batch."""
    if rate == target_rate:
        return lengths
    return torch.div(lengths * target_rate + rate - 1, rate, rounding_mode="floor").clamp_max(resampled_max)


def resampled_size(samples: int, rate: int, target_rate: int) -> int:
    """Samples of a ``samples``-long waveform at ``rate`` resampled to ``target_rate``, as
    ``torchaudio.functional.resample`` returns them (rounded up)."""
    if rate == target_rate:
        return samples
    gcd = math.gcd(rate, target_rate)
    return math.ceil((target_rate // gcd) * samples / (rate // gcd))


def prepare_waveform(inputs: Mapping[str, Any], target_rate: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the structure, resample to ``target_rate`` and zero the padding.

    Returns ``values [B, T']`` float32 and ``lengths [B]`` (in samples at ``target_rate``). The
    values are checked by :class:`WaveformInputCheck`, not here."""
    import torchaudio.functional as AF

    x, rate = waveform_tensor(inputs, where)
    lengths = input_lengths(inputs, x, where)
    x = x.float()
    if rate != target_rate:
        x = AF.resample(x, rate, target_rate)
        lengths = resampled_lengths(lengths, rate, target_rate, x.shape[1])
    x = x * lengths_to_mask(lengths, x.shape[1])
    return x, lengths


@dataclass(frozen=True)
class WaveformInputCheck(SequenceInputCheck):
    """Finite values, lengths in ``[0, T]`` and non-zero for present items and, with
    ``min_samples`` > 1, every present waveform long enough at ``target_rate`` to give the
    backbone one frame."""

    what: str = "waveform"
    target_rate: int = 16000
    min_samples: int = 1

    def __call__(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> None:
        super().__call__(inputs, present)
        x = inputs.get("values")
        try:
            rate = int(inputs.get("sample_rate"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        if self.min_samples <= 1 or not isinstance(x, torch.Tensor) or x.dim() != 2 or rate <= 0:
            return
        lengths = inputs.get("lengths")
        lengths = torch.full((x.shape[0],), x.shape[1]) if lengths is None else torch.as_tensor(lengths).long()
        if lengths.shape != (x.shape[0],):
            return
        resampled_max = resampled_size(x.shape[1], rate, self.target_rate)
        resampled = resampled_lengths(lengths, rate, self.target_rate, resampled_max)
        need = lengths > 0 if present is None else present.to(lengths.device).bool() & (lengths > 0)
        short = (resampled < self.min_samples) & need
        if bool(short.any()):
            idx = torch.nonzero(short).flatten().tolist()
            raise ValueError(f"{self.where}: waveform(s) at position(s) {idx[:10]} too short to give one frame "
                             f"(fewer than {self.min_samples} samples at {self.target_rate} Hz)")


def min_samples_for_one_frame(frames_of: Callable[[torch.Tensor], torch.Tensor], where: str) -> int:
    """The fewest samples from which ``frames_of`` (a conv front end's output length, which
    grows with its input's) gives one frame."""
    high = 1
    while int(frames_of(torch.tensor(high))) < 1:
        high *= 2
        if high > 2**31:
            raise ValueError(f"{where}: the backbone's conv front end gives no frame for any waveform length")
    low = high // 2  # gives no frame (or is 0)
    while high - low > 1:
        mid = (low + high) // 2
        if int(frames_of(torch.tensor(mid))) >= 1:
            high = mid
        else:
            low = mid
    return high


def masked_standardise(x: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Zero mean, unit variance of each row of ``x [B, T]`` over its first ``lengths``
    samples (the Wav2Vec2FeatureExtractor normalisation); padding stays 0."""
    mask = lengths_to_mask(lengths, x.shape[1]).to(x.dtype)
    n = mask.sum(1, keepdim=True).clamp_min(1.0)
    mean = (x * mask).sum(1, keepdim=True) / n
    var = (((x - mean) * mask) ** 2).sum(1, keepdim=True) / n
    return (x - mean) / torch.sqrt(var + eps) * mask


@dataclass
class HFAudioConfig(AdapterConfig):
    """``model``: hub name or local directory of a HuBERT / wav2vec2-family checkpoint
    (AutoModel); ``pretrained=False`` keeps only its architecture. Without ``model``:
    ``backbone_config`` = ``{"model_type": "hubert", ...}`` keyword arguments for a
    random-weight config. ``sample_rate``/``do_normalize``/``use_attention_mask`` default
    to the checkpoint's feature extractor. ``layer``: hidden-state index to pool
    (None: last). ``freeze_feature_encoder``: keep the conv front end fixed (usual when
    fine-tuning these models). ``spec_augment``: keep the model's own SpecAugment time/feature
    masking in training mode (off by default: in mmviews augmentation belongs to the views, so
    that a natural view stays un-augmented, and the masking reads a boolean mask back from the
    device at every training step)."""

    type = "hf_audio"
    model: str | None = None
    pretrained: bool = True
    backbone_config: dict[str, Any] | None = None
    sample_rate: int | None = None
    do_normalize: bool | None = None
    use_attention_mask: bool | None = None
    layer: int | None = None
    freeze_feature_encoder: bool = True
    spec_augment: bool = False


@register_adapter
class HFAudioAdapter(Adapter):
    """HuBERT / wav2vec2 (transformers) on a waveform ``values [B, T]``, mean-pooled over frames."""

    config_class = HFAudioConfig
    default_lora_targets = ["q_proj", "v_proj"]
    config: HFAudioConfig

    def __init__(self, config: HFAudioConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        from transformers import AutoFeatureExtractor, Wav2Vec2FeatureExtractor

        self.backbone = transformers_backbone(config, load_weights=load_weights, saved_dir=saved_dir, what="audio",
                                              default_type="hubert")
        fe = None
        if saved_dir is not None:
            fe = AutoFeatureExtractor.from_pretrained(saved_dir / "feature_extractor")
        elif config.model:
            try:
                fe = AutoFeatureExtractor.from_pretrained(config.model)
            except (OSError, ValueError):
                fe = None  # some checkpoints ship no preprocessor config: use the defaults below
        if hasattr(self.backbone.config, "apply_spec_augment"):  # read by the model at each training forward
            self.backbone.config.apply_spec_augment = bool(config.spec_augment)
        if fe is None:
            fe = Wav2Vec2FeatureExtractor(sampling_rate=16000, do_normalize=True, return_attention_mask=False)
        self.feature_extractor = fe
        self.sample_rate = int(config.sample_rate or getattr(fe, "sampling_rate", 16000))
        self.do_normalize = bool(getattr(fe, "do_normalize", True) if config.do_normalize is None else config.do_normalize)
        self.use_attention_mask = bool(
            getattr(fe, "return_attention_mask", False) if config.use_attention_mask is None else config.use_attention_mask
        )
        if not hasattr(self.backbone, "_get_feat_extract_output_lengths"):
            raise ValueError(f"hf_audio: {type(self.backbone).__name__} is not a wav2vec2-family model")
        # Known once, so that the checks of a waveform's length read nothing from the device.
        self.min_samples = min_samples_for_one_frame(self.backbone._get_feat_extract_output_lengths, "hf_audio")
        self.feature_dim = int(self.backbone.config.hidden_size)
        self._finish_init()

    def _apply_finetune(self) -> None:
        super()._apply_finetune()
        if self.config.freeze_feature_encoder and hasattr(self.backbone, "feature_extractor"):
            self.backbone.feature_extractor.requires_grad_(False)

    def _save_extra(self, directory: Path) -> None:
        self.backbone.config.save_pretrained(directory / "backbone")
        self.feature_extractor.save_pretrained(directory / "feature_extractor")

    def enable_gradient_checkpointing(self) -> None:
        enable_transformers_checkpointing(self.backbone, "hf_audio adapter")

    def backbone_blocks(self) -> list[nn.Module]:
        return list(self.backbone.encoder.layers)

    def backbone_tail(self) -> list[nn.Parameter]:
        if getattr(self.backbone.config, "do_stable_layer_norm", False):
            return list(self.backbone.encoder.layer_norm.parameters())  # applied after the last layer
        return []

    def preprocessing_signature(self) -> dict[str, Any]:
        sig = super().preprocessing_signature()
        sig.update(rate=self.sample_rate, normalize=self.do_normalize, attention_mask=self.use_attention_mask)
        return sig

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = "hf_audio adapter"
        x, lengths = prepare_waveform(inputs, self.sample_rate, where)
        if x.shape[1] < self.min_samples:
            raise ValueError(f"{where}: waveform of {x.shape[1]} samples is too short for the backbone's conv "
                             f"front end (it needs {self.min_samples} at {self.sample_rate} Hz)")
        if self.do_normalize:
            x = masked_standardise(x, lengths)
        device = next(self.backbone.parameters()).device
        return {"values": to_device(x, device), "lengths": to_device(lengths, device)}

    def input_check(self) -> InputCheck:
        return WaveformInputCheck("hf_audio adapter", target_rate=self.sample_rate, min_samples=self.min_samples)

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        x, lengths = prepared["values"], prepared["lengths"]
        kwargs: dict[str, Any] = {}
        if self.use_attention_mask:
            kwargs["attention_mask"] = lengths_to_mask(lengths, x.shape[1]).long()
        if self.config.layer is not None:
            kwargs["output_hidden_states"] = True
        out = self.backbone(x, **kwargs)
        h = out.last_hidden_state if self.config.layer is None else out.hidden_states[self.config.layer]
        frames = self.backbone._get_feat_extract_output_lengths(lengths).clamp(0, h.shape[1])
        return masked_mean(h, lengths_to_mask(frames, h.shape[1]))


@dataclass
class AudioCNNConfig(AdapterConfig):
    """Log-mel frames (per-utterance mean/variance normalised over real frames) into a
    1-D CNN over time (stride 2 after the first stage), masked mean over frames."""

    type = "audio_cnn"
    sample_rate: int = 16000
    n_mels: int = 40
    n_fft: int = 400
    hop_length: int = 160
    channels: list[int] = field(default_factory=lambda: [64, 128, 128])
    kernel_size: int = 5


class AudioCNN(nn.Module):
    def __init__(self, cfg: AudioCNNConfig) -> None:
        super().__init__()
        import torchaudio

        self.melspec = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate, n_fft=cfg.n_fft, hop_length=cfg.hop_length, n_mels=cfg.n_mels
        )
        # The periodic window is a view into a longer tensor; safetensors refuses partial views.
        for mod in self.melspec.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = buf.clone()
        if cfg.kernel_size % 2 == 0:
            raise ValueError(f"audio_cnn kernel_size must be odd, got {cfg.kernel_size}")
        self.kernel, self.pad = cfg.kernel_size, cfg.kernel_size // 2
        self.strides = [1 if i == 0 else 2 for i in range(len(cfg.channels))]
        stages, c = [], cfg.n_mels
        for width, stride in zip(cfg.channels, self.strides):
            stages.append(
                nn.Sequential(
                    nn.Conv1d(c, width, cfg.kernel_size, stride=stride, padding=self.pad, bias=False),
                    nn.BatchNorm1d(width),
                    nn.ReLU(inplace=True),
                )
            )
            c = width
        self.stages = nn.ModuleList(stages)
        self.hop = cfg.hop_length
        self.checkpoint_stages = False  # gradient_checkpointing: recompute each stage in backward

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the autocast: the mel projection is a matmul, which fp16 autocast
        # would run in half precision, where a loud clip's power (> 65504) overflows to inf.
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x.shape[0] == 0:  # no clip (a rank joining SyncBatchNorm's collectives): stft refuses it
                mel = x.new_zeros(0, self.melspec.n_mels, 1, dtype=torch.float32)
            else:
                mel = torch.log(self.melspec(x.float()) + 1e-6)  # [B, n_mels, F]
        frames = torch.div(lengths, self.hop, rounding_mode="floor") + 1  # center=True framing
        mask = lengths_to_mask(frames.clamp_max(mel.shape[-1]), mel.shape[-1]).unsqueeze(1).to(mel.dtype)
        n = mask.sum(-1, keepdim=True).clamp_min(1.0)
        mean = (mel * mask).sum(-1, keepdim=True) / n
        std = ((((mel - mean) * mask) ** 2).sum(-1, keepdim=True) / n + 1e-5).sqrt()
        h = (mel - mean) / std * mask
        for stage, stride in zip(self.stages, self.strides):
            h = checkpointed(stage, h) if self.checkpoint_stages else stage(h)
            frames = torch.div(frames + 2 * self.pad - self.kernel, stride, rounding_mode="floor") + 1
        return masked_mean(h.transpose(1, 2), lengths_to_mask(frames.clamp(0, h.shape[-1]), h.shape[-1]))


@register_adapter
class AudioCNNAdapter(Adapter):
    """Log-mel spectrogram and a small 1-D CNN on a waveform ``values [B, T]``."""

    config_class = AudioCNNConfig
    config: AudioCNNConfig

    def __init__(self, config: AudioCNNConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        if not config.channels:
            raise ValueError("audio_cnn needs at least one stage in 'channels'")
        self.backbone = AudioCNN(config)
        self.feature_dim = int(config.channels[-1])
        self._finish_init()

    def backbone_blocks(self) -> list[nn.Module]:
        return list(self.backbone.stages)

    def enable_gradient_checkpointing(self) -> None:
        self.backbone.checkpoint_stages = True

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        x, lengths = prepare_waveform(inputs, self.config.sample_rate, "audio_cnn adapter")
        device = next(self.backbone.parameters()).device
        return {"values": to_device(x, device), "lengths": to_device(lengths, device)}

    def input_check(self) -> InputCheck:
        return WaveformInputCheck("audio_cnn adapter", target_rate=self.config.sample_rate)

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return self.backbone(prepared["values"], prepared["lengths"])
