"""Audio adapters: resampling, feature-extractor normalisation, masked pooling, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmviews.modalities import build_adapter
from mmviews.modalities.audio import masked_standardise, prepare_waveform
from mmviews.modalities.presets import tiny_config


def test_normalisation_matches_wav2vec2_feature_extractor() -> None:
    from transformers import Wav2Vec2FeatureExtractor

    fe = Wav2Vec2FeatureExtractor(sampling_rate=16000, do_normalize=True, return_attention_mask=True)
    rng = np.random.default_rng(0)
    waves = [rng.normal(0.3, 2.0, 900).astype(np.float32), rng.normal(-1, 0.5, 500).astype(np.float32)]
    ref = fe(waves, sampling_rate=16000, padding=True, return_tensors="pt")["input_values"]
    x = torch.zeros(2, 900)
    x[0], x[1, :500] = torch.from_numpy(waves[0]), torch.from_numpy(waves[1])
    ours = masked_standardise(x, torch.tensor([900, 500]))
    assert torch.allclose(ours, ref, atol=1e-4)
    assert torch.all(ours[1, 500:] == 0)


def test_resampling_scales_lengths_and_preserves_a_tone() -> None:
    sr_in, sr_out = 8000, 16000
    t = torch.arange(8000) / sr_in
    tone = torch.sin(2 * torch.pi * 440 * t)
    x = torch.stack([tone, tone])
    values, lengths = prepare_waveform(
        {"values": x, "lengths": torch.tensor([8000, 4000]), "sample_rate": sr_in}, sr_out, "test"
    )
    assert values.shape == (2, 16000) and lengths.tolist() == [16000, 8000]
    assert torch.all(values[1, 8000:] == 0), "samples past the real length are zero padding"
    spectrum = torch.fft.rfft(values[0]).abs()
    peak_hz = int(spectrum.argmax()) * sr_out / 16000
    assert abs(peak_hz - 440) <= 2


def test_hubert_pools_only_frames_from_real_samples() -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("hf_audio")).eval()
    x = torch.randn(2, 4000)
    lengths = torch.tensor([4000, 1600])
    prepared = adapter.preprocess({"values": x, "lengths": lengths, "sample_rate": 16000})
    hidden = adapter.backbone(prepared["values"]).last_hidden_state
    # conv front end (kernel 10 stride 5, kernel 8 stride 4): frames = ((n - 10) // 5 + 1 - 8) // 4 + 1
    n_frames = [((n - 10) // 5 + 1 - 8) // 4 + 1 for n in lengths.tolist()]
    expected = torch.stack([hidden[i, :f].mean(0) for i, f in enumerate(n_frames)])
    assert torch.allclose(adapter.encode(prepared), expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["hf_audio", "audio_cnn"])
def test_bad_audio_inputs(kind: str) -> None:
    adapter = build_adapter(tiny_config(kind))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        adapter({"values": torch.randn(2, 1, 4000), "sample_rate": 16000})
    with pytest.raises(ValueError, match="zero-length waveform"):
        adapter({"values": torch.zeros(2, 0), "sample_rate": 16000})
    with pytest.raises(ValueError, match=r"zero-length waveform at batch position\(s\) \[1\]"):
        adapter({"values": torch.randn(2, 4000), "lengths": torch.tensor([4000, 0]), "sample_rate": 16000})
    with pytest.raises(ValueError, match="sample_rate"):
        adapter({"values": torch.randn(2, 4000)})
    with pytest.raises(ValueError, match="non-finite"):
        adapter({"values": torch.full((2, 4000), float("nan")), "sample_rate": 16000})
    # An absent view (length 0, marked not present) is accepted and gives finite output.
    z = adapter(
        {"values": torch.randn(3, 4000), "lengths": torch.tensor([4000, 0, 3000]), "sample_rate": 16000},
        present=torch.tensor([True, False, True]),
    )
    assert torch.isfinite(z).all()


def test_hubert_too_short_waveform() -> None:
    adapter = build_adapter(tiny_config("hf_audio"))
    with pytest.raises(ValueError, match="too short"):
        adapter({"values": torch.randn(2, 20), "sample_rate": 16000})


def test_missing_audio_checkpoint(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_adapter({"type": "hf_audio", "model": str(tmp_path / "hubert-missing")})


def test_wav2vec2_with_attention_mask_ignores_padding() -> None:
    torch.manual_seed(0)
    cfg = tiny_config("hf_audio")
    cfg["backbone_config"] = {**cfg["backbone_config"], "model_type": "wav2vec2", "feat_extract_norm": "layer",
                              "do_stable_layer_norm": True}
    adapter = build_adapter({**cfg, "use_attention_mask": True}).eval()
    assert type(adapter.backbone).__name__ == "Wav2Vec2Model"
    short = torch.randn(1, 2400)
    alone = adapter.features({"values": short, "sample_rate": 16000})
    padded = torch.zeros(2, 4000)
    padded[0], padded[1, :2400] = torch.randn(4000), short[0]
    batch = adapter.features({"values": padded, "lengths": torch.tensor([4000, 2400]), "sample_rate": 16000})
    assert torch.allclose(batch[1], alone[0], atol=1e-4), "padding must not change a waveform's features"
    # do_stable_layer_norm puts a LayerNorm after the last layer: it trains with last_n.
    tail = build_adapter({**cfg, "finetune": {"mode": "last_n", "last_n": 1}})
    assert all(p.requires_grad for p in tail.backbone.encoder.layer_norm.parameters())


def _hubert_without_dropout(**extra: object) -> dict:
    cfg = tiny_config("hf_audio")
    no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "feat_proj_dropout": 0.0,
                  "layerdrop": 0.0, "mask_time_prob": 0.5, "mask_time_length": 4}
    return {**cfg, "backbone_config": {**cfg["backbone_config"], **no_dropout}, **extra}


def test_hubert_spec_augment_is_off_unless_asked() -> None:
    """The model's own SpecAugment would mask natural views in training mode (and read a boolean
    mask back from the device every step): off by default, kept with ``spec_augment: true``."""
    from mmviews.bench.host_reads import HostReadRecorder

    inputs = {"values": torch.randn(2, 4000), "sample_rate": 16000}
    torch.manual_seed(0)
    plain = build_adapter(_hubert_without_dropout()).train()
    assert plain.backbone.config.apply_spec_augment is False
    with HostReadRecorder() as recorder:
        first = plain(inputs, check_inputs=False)
    assert not [r for r in recorder.reads if "mask" in r.op], [f"{r.op} at {r.where}" for r in recorder.reads]
    assert torch.equal(first, plain(inputs)), "without SpecAugment (and dropout) training forwards are deterministic"

    torch.manual_seed(0)
    masked = build_adapter(_hubert_without_dropout(spec_augment=True)).train()
    assert masked.backbone.config.apply_spec_augment is True
    assert not torch.equal(masked(inputs), masked(inputs)), "SpecAugment masks random frames at each forward"


def test_audio_cnn_spectrogram_in_float32_under_fp16_autocast() -> None:
    """A loud clip's mel power exceeds fp16's range (65504): under fp16 autocast the spectrogram
    is still computed in float32, so the features stay finite and match float32's."""
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("audio_cnn")).eval()
    t = torch.arange(4000) / 16000
    loud = (4.0 * torch.sin(2 * torch.pi * 440 * t)).repeat(2, 1)  # mel power about 1.7e5
    inputs = {"values": loud, "sample_rate": 16000}
    reference = adapter.features(inputs, check_inputs=False)
    with torch.autocast("cpu", dtype=torch.float16):
        half = adapter.features(inputs, check_inputs=False)
    assert bool(torch.isfinite(half).all())
    torch.testing.assert_close(half.float(), reference, rtol=0.05, atol=0.05)
