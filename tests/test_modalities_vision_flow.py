"""Vision (open_clip, small CNN) and optical flow: preprocessing, clips, flow helpers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmviews.modalities import (
    adapt_patch_embedding,
    build_adapter,
    compute_flow,
    decode_flow_uint8,
    encode_flow_uint8,
)
from mmviews.modalities.presets import tiny_config


def test_open_clip_normalisation_uses_the_model_preprocess_cfg() -> None:
    adapter = build_adapter(tiny_config("open_clip"))
    x = torch.rand(2, 3, 32, 32)
    pixels = adapter.preprocess({"values": x})["pixels"]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    assert torch.allclose(pixels, (x - mean) / std, atol=1e-6)
    # Other sizes are resized (shorter side) and centre-cropped to the model's size.
    assert adapter.preprocess({"values": torch.rand(1, 3, 48, 64)})["pixels"].shape == (1, 3, 32, 32)


@pytest.mark.parametrize("kind", ["open_clip", "small_cnn"])
def test_clip_is_mean_of_normalised_frame_embeddings(kind: str) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config(kind)).eval()
    clip = torch.rand(2, 3, 3, 32, 32)
    z = adapter({"values": clip})
    frames = adapter({"values": clip.reshape(6, 3, 32, 32)}).reshape(2, 3, -1)
    assert torch.allclose(z, F.normalize(frames.mean(1), dim=-1), atol=1e-5)
    assert torch.allclose(z.norm(dim=-1), torch.ones(2), atol=1e-5)


@pytest.mark.parametrize("kind", ["open_clip", "small_cnn"])
def test_bad_image_inputs(kind: str) -> None:
    adapter = build_adapter(tiny_config(kind))
    with pytest.raises(ValueError, match="expected 3 channels, got 1"):
        adapter({"values": torch.rand(2, 1, 32, 32)})
    with pytest.raises(ValueError, match="values must be"):
        adapter({"values": torch.rand(32, 32)})
    with pytest.raises(ValueError, match="no key 'values'"):
        adapter({"pixels": torch.rand(2, 3, 32, 32)})


def test_open_clip_range_and_missing_checkpoint(tmp_path) -> None:
    adapter = build_adapter(tiny_config("open_clip"))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        adapter({"values": torch.rand(2, 3, 32, 32) * 255})
    with pytest.raises(FileNotFoundError, match="neither a tag"):
        build_adapter(tiny_config("open_clip", pretrained=str(tmp_path / "missing.pt")))


def test_flow_uint8_convention() -> None:
    flow = torch.tensor([-30.0, -20.0, -5.0, 0.0, 7.3, 20.0, 45.0])
    stored = encode_flow_uint8(flow)
    assert stored.dtype == torch.uint8
    # stored-flow convention: value = (f + 20) * 255 / 40 after clipping to +-20
    expected = torch.round((flow.clamp(-20, 20) + 20) * 255 / 40).to(torch.uint8)
    assert torch.equal(stored, expected)
    assert stored[0] == 0 and stored[-1] == 255
    decoded = decode_flow_uint8(stored)
    assert torch.all((decoded - flow.clamp(-20, 20)).abs() <= 40 / 255 / 2 + 1e-5)
    with pytest.raises(ValueError, match="uint8"):
        decode_flow_uint8(torch.zeros(3))


def test_farneback_recovers_a_known_shift() -> None:
    g = torch.Generator().manual_seed(0)
    base = F.interpolate(torch.rand(1, 1, 24, 24, generator=g), size=(96, 96), mode="bicubic").clamp(0, 1)
    shifted = torch.roll(base, shifts=(0, 3), dims=(2, 3))  # content moves +3 px along x
    frames = torch.cat([base, shifted]).expand(-1, 3, -1, -1)
    flow = compute_flow(frames)
    assert flow.shape == (1, 2, 96, 96)
    centre = flow[0, :, 24:72, 24:72]
    assert abs(float(centre[0].median()) - 3.0) < 0.5 and abs(float(centre[1].median())) < 0.5


def test_flow_computation_errors(tmp_path) -> None:
    frames = torch.rand(3, 3, 32, 32)
    with pytest.raises(FileNotFoundError, match="RAFT weights"):
        compute_flow(frames, method="raft", raft_weights=tmp_path / "raft.pth")
    with pytest.raises(ValueError, match="at least 2 frames"):
        compute_flow(frames[:1])
    with pytest.raises(ValueError, match="method"):
        compute_flow(frames, method="lucas")
    import cv2

    if not hasattr(cv2, "optflow"):
        with pytest.raises(ImportError, match="opencv-contrib"):
            compute_flow(frames, method="tvl1")


def test_cross_modality_patch_embedding() -> None:
    torch.manual_seed(0)
    rgb = torch.nn.Conv2d(3, 8, 4, stride=4, bias=False)
    flow_conv = adapt_patch_embedding(rgb, 2)
    assert flow_conv.weight.shape == (8, 2, 4, 4)
    x = torch.randn(2, 2, 16, 16)
    # Averaged RGB filters on (u, v) == the RGB conv on the channel mean (u + v) / 3 replicated.
    rgb_input = ((x[:, :1] + x[:, 1:]) / 3).expand(-1, 3, -1, -1)
    assert torch.allclose(flow_conv(x), rgb(rgb_input), atol=1e-5)


def test_flow_clip_adapter_patch_embedding_and_stacking() -> None:
    adapter = build_adapter(tiny_config("flow_clip", stacked_flows=2))
    assert adapter.backbone.conv1.in_channels == 4
    z = adapter({"values": torch.randn(3, 4, 2, 32, 32)})
    assert z.shape == (3, 16)
    with pytest.raises(ValueError, match="multiple of stacked_flows"):
        adapter({"values": torch.randn(3, 3, 2, 32, 32)})


@pytest.mark.parametrize("kind", ["flow_cnn", "flow_clip"])
def test_flow_needs_two_channels(kind: str) -> None:
    adapter = build_adapter(tiny_config(kind))
    with pytest.raises(ValueError, match="2 channels"):
        adapter({"values": torch.randn(2, 3, 3, 32, 32)})
    with pytest.raises(ValueError, match="float"):
        adapter({"values": torch.zeros(2, 3, 2, 32, 32, dtype=torch.uint8)})


def test_local_open_clip_checkpoint_and_flow_init_from_rgb(tmp_path) -> None:
    import open_clip

    from mmviews.modalities.presets import TINY_CLIP_OVERRIDES

    torch.manual_seed(3)
    rgb_model = open_clip.create_model("ViT-B-32", pretrained=None, **TINY_CLIP_OVERRIDES)
    ckpt = tmp_path / "tiny_clip.pt"
    torch.save(rgb_model.state_dict(), ckpt)
    vision = build_adapter(tiny_config("open_clip", pretrained=str(ckpt)))
    assert torch.equal(vision.backbone.conv1.weight, rgb_model.visual.conv1.weight)
    assert torch.equal(vision.backbone.transformer.resblocks[1].mlp.c_fc.weight,
                       rgb_model.visual.transformer.resblocks[1].mlp.c_fc.weight)
    flow = build_adapter(tiny_config("flow_clip", pretrained=str(ckpt)))
    rgb_w = rgb_model.visual.conv1.weight
    assert torch.allclose(flow.backbone.conv1.weight, rgb_w.mean(1, keepdim=True).expand(-1, 2, -1, -1))
    assert torch.equal(flow.backbone.transformer.resblocks[0].attn.in_proj_weight,
                       rgb_model.visual.transformer.resblocks[0].attn.in_proj_weight)


def test_flow_cnn_stacked_flows() -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("flow_cnn", temporal="stack", num_flows=3)).eval()
    assert adapter.backbone.stages[0][0].in_channels == 6
    # Uniform motion that speeds up over time (u = 0, 4, 8 px), so order matters.
    x = torch.zeros(2, 3, 2, 32, 32)
    x[:, :, 0] = torch.tensor([0.0, 4.0, 8.0]).view(1, 3, 1, 1)
    x = x + 0.1 * torch.randn(2, 3, 2, 32, 32)
    z = adapter({"values": x})
    assert z.shape == (2, 16)
    # Stacking keeps the temporal order: reversing the flows changes the embedding.
    assert not torch.allclose(z, adapter({"values": x.flip(1)}), atol=1e-4)
    with pytest.raises(ValueError, match="T=3 flows"):
        adapter({"values": torch.randn(2, 4, 2, 32, 32)})
    with pytest.raises(ValueError, match="num_flows"):
        build_adapter(tiny_config("flow_cnn", temporal="stack"))


@pytest.mark.parametrize("kind", ["small_cnn", "flow_cnn"])
def test_image_and_flow_front_ends_stay_float32_under_fp16_autocast(kind: str) -> None:
    """Normalisation (images) and scaling (flow) are elementwise: autocast leaves them in float32."""
    from mmviews.modalities.presets import example_inputs

    adapter = build_adapter(tiny_config(kind))
    inputs = example_inputs(kind, 2)
    inputs["values"] = inputs["values"] * (1.0 if kind == "small_cnn" else 1e4)  # flow of 10,000 pixels
    with torch.autocast("cpu", dtype=torch.float16):
        prepared = adapter.preprocess(inputs)
        features = adapter.features(inputs, check_inputs=False)
    values = prepared.get("pixels", prepared.get("values"))
    assert values.dtype == torch.float32 and bool(torch.isfinite(values).all())
    assert bool(torch.isfinite(features).all())
