"""Audio: HuBERT / wav2vec2-family encoders through ``transformers``, and a small 1-D CNN
over log-mel frames for CPU runs.

Input: ``{"values": FloatTensor[B, T], "lengths": LongTensor[B], "sample_rate": int}``.
Waveforms are resampled to the backbone's rate (``torchaudio.functional.resample``),
zero-padded past their length, and pooled by a masked mean over the frames that come
from real samples (base HuBERT checkpoints take no attention mask, so padding is
removed at pooling rather than in attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .base import (
    Adapter,
    AdapterConfig,
    check_finite,
    validated_lengths,
    check_local_or_hub,
    lengths_to_mask,
    masked_mean,
    register_adapter,
    require_tensor,
)


def prepare_waveform(
    inputs: Mapping[str, Any], target_rate: int, present: torch.Tensor | None, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, resample to ``target_rate`` and zero the padding.

    Returns ``values [B, T']`` float32 and ``lengths [B]`` (in samples at ``target_rate``).
    """
    import torchaudio.functional as AF

    x = require_tensor(inputs, "values", where)
    if x.dim() != 2:
        raise ValueError(f"{where}: waveform values must be [B, T] (mono), got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{where}: zero-length waveform (values shape {tuple(x.shape)})")
    if not x.is_floating_point():
        raise ValueError(f"{where}: waveform must be float, got dtype {x.dtype}")
    check_finite(x, where)
    if "sample_rate" not in inputs:
        raise ValueError(f"{where}: inputs need 'sample_rate' (the waveform's rate in Hz)")
    rate = int(inputs["sample_rate"])
    if rate <= 0:
        raise ValueError(f"{where}: sample_rate must be positive, got {rate}")
    lengths = validated_lengths(inputs, x, present, where, what="waveform")
    x = x.float()
    if rate != target_rate:
        x = AF.resample(x, rate, target_rate)
        lengths = torch.div(lengths * target_rate + rate - 1, rate, rounding_mode="floor").clamp_max(x.shape[1])
    x = x * lengths_to_mask(lengths, x.shape[1])
    return x, lengths


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
    fine-tuning these models)."""

    type = "hf_audio"
    model: str | None = None
    pretrained: bool = True
    backbone_config: dict[str, Any] | None = None
    sample_rate: int | None = None
    do_normalize: bool | None = None
    use_attention_mask: bool | None = None
    layer: int | None = None
    freeze_feature_encoder: bool = True


@register_adapter
class HFAudioAdapter(Adapter):
    """HuBERT / wav2vec2 (transformers) on a waveform ``values [B, T]``, mean-pooled over frames."""

    config_class = HFAudioConfig
    default_lora_targets = ["q_proj", "v_proj"]
    config: HFAudioConfig

    def __init__(self, config: HFAudioConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        from huggingface_hub.errors import HFValidationError
        from transformers import AutoConfig, AutoFeatureExtractor, AutoModel, Wav2Vec2FeatureExtractor

        fe = None
        if saved_dir is not None:
            self.backbone = AutoModel.from_config(AutoConfig.from_pretrained(saved_dir / "backbone"))
            fe = AutoFeatureExtractor.from_pretrained(saved_dir / "feature_extractor")
        elif config.model:
            check_local_or_hub(config.model, "audio model")
            try:
                if config.pretrained and load_weights:
                    self.backbone = AutoModel.from_pretrained(config.model)
                else:
                    self.backbone = AutoModel.from_config(AutoConfig.from_pretrained(config.model))
            except (OSError, HFValidationError) as e:
                raise FileNotFoundError(
                    f"audio model {config.model!r}: neither a local checkpoint directory nor a reachable hub model ({e})"
                ) from e
            try:
                fe = AutoFeatureExtractor.from_pretrained(config.model)
            except (OSError, ValueError):
                fe = None  # some checkpoints ship no preprocessor config: use the defaults below
        elif config.backbone_config is not None:
            bcfg = dict(config.backbone_config)
            model_type = bcfg.pop("model_type", "hubert")
            self.backbone = AutoModel.from_config(AutoConfig.for_model(model_type, **bcfg))
        else:
            raise ValueError("hf_audio adapter needs 'model' (hub name or local dir) or 'backbone_config'")
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
        self.feature_dim = int(self.backbone.config.hidden_size)
        self._finish_init()

    def _apply_finetune(self) -> None:
        super()._apply_finetune()
        if self.config.freeze_feature_encoder and hasattr(self.backbone, "feature_extractor"):
            self.backbone.feature_extractor.requires_grad_(False)

    def _save_extra(self, directory: Path) -> None:
        self.backbone.config.save_pretrained(directory / "backbone")
        self.feature_extractor.save_pretrained(directory / "feature_extractor")

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
        x, lengths = prepare_waveform(inputs, self.sample_rate, present, where)
        frames = self.backbone._get_feat_extract_output_lengths(lengths)
        if int(self.backbone._get_feat_extract_output_lengths(torch.tensor(x.shape[1]))) <= 0:
            raise ValueError(f"{where}: waveform of {x.shape[1]} samples is too short for the backbone's conv front end")
        need = (lengths > 0) if present is None else (present.to(lengths.device).bool() & (lengths > 0))
        if bool(((frames <= 0) & need).any()):
            idx = torch.nonzero((frames <= 0) & need).flatten().tolist()
            raise ValueError(f"{where}: waveform(s) at position(s) {idx[:10]} too short to give one frame")
        if self.do_normalize:
            x = masked_standardise(x, lengths)
        device = next(self.backbone.parameters()).device
        return {"values": x.to(device), "lengths": lengths.to(device)}

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

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mel = torch.log(self.melspec(x) + 1e-6)  # [B, n_mels, F]
        frames = torch.div(lengths, self.hop, rounding_mode="floor") + 1  # center=True framing
        mask = lengths_to_mask(frames.clamp_max(mel.shape[-1]), mel.shape[-1]).unsqueeze(1).to(mel.dtype)
        n = mask.sum(-1, keepdim=True).clamp_min(1.0)
        mean = (mel * mask).sum(-1, keepdim=True) / n
        std = ((((mel - mean) * mask) ** 2).sum(-1, keepdim=True) / n + 1e-5).sqrt()
        h = (mel - mean) / std * mask
        for stage, stride in zip(self.stages, self.strides):
            h = stage(h)
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

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        x, lengths = prepare_waveform(inputs, self.config.sample_rate, present, "audio_cnn adapter")
        device = next(self.backbone.parameters()).device
        return {"values": x.to(device), "lengths": lengths.to(device)}

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return self.backbone(prepared["values"], prepared["lengths"])
