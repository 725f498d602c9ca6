"""Optical flow: computing it from frames, the stored-flow convention, and two encoders.

Flow views are ``{"values": FloatTensor[B, T, 2, H, W]}`` in pixels ((u, v) = (x, y)
displacement); N frames give T = N - 1 flows.

Stored-flow convention (the one of the common TV-L1 flow releases of UCF-101 / HMDB-51,
``flow_x/flow_y`` JPEGs): clip to +-20 px, then ``value = (f + 20) * 255 / 40`` as uint8. :func:`encode_flow_uint8` / :func:`decode_flow_uint8`.

Encoders:

- ``flow_cnn``: a compact 2-D CNN trained from scratch, over each flow (pooled over
  time) or over the T flows stacked as 2T channels.
- ``flow_clip``: an open_clip ViT whose patch embedding takes ``2 * stacked_flows``
  channels, initialised from the RGB filters by averaging over the 3 colour channels and
  replicating the mean over the flow channels (the cross-modality initialisation of
  two-stream / TSN networks). Flows are scaled to [-1, 1] by the clip bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from .base import Adapter, register_adapter
from .config import AdapterConfig
from .inputs import per_clip, require_tensor, to_device
from .vision import (
    OpenCLIPTower,
    OpenCLIPVisionConfig,
    SmallCNN,
    create_open_clip_visual,
    resize_shortest_center_crop,
    split_frames,
)

FLOW_BOUND = 20.0


# --------------------------------------------------------------------------- storage


def clip_flow(flow: torch.Tensor, bound: float = FLOW_BOUND) -> torch.Tensor:
    return flow.clamp(-bound, bound)


def encode_flow_uint8(flow: torch.Tensor | np.ndarray, bound: float = FLOW_BOUND) -> torch.Tensor:
    """Flow in pixels -> uint8 with the stored-flow convention ``(f + b) * 255 / (2 b)`` after
    clipping to ``[-b, b]`` (rounded to nearest)."""
    f = torch.as_tensor(flow, dtype=torch.float32).clamp(-bound, bound)
    return torch.round((f + bound) * 255.0 / (2 * bound)).to(torch.uint8)


def decode_flow_uint8(stored: torch.Tensor | np.ndarray, bound: float = FLOW_BOUND) -> torch.Tensor:
    """uint8 stored flow -> float pixels: ``v * 2 b / 255 - b``."""
    v = torch.as_tensor(stored)
    if v.dtype != torch.uint8:
        raise ValueError(f"decode_flow_uint8 expects uint8 values, got {v.dtype}")
    return v.float() * (2 * bound / 255.0) - bound


# --------------------------------------------------------------------------- computation


def _to_gray_uint8(frames: torch.Tensor) -> np.ndarray:
    """``[N, 3, H, W]`` float in [0, 1] or uint8 -> ``[N, H, W]`` uint8 luma (BT.601)."""
    f = frames.detach().cpu()
    if f.dtype == torch.uint8:
        f = f.float() / 255.0
    gray = 0.299 * f[:, 0] + 0.587 * f[:, 1] + 0.114 * f[:, 2]
    return (gray.clamp(0, 1) * 255.0).round().to(torch.uint8).numpy()


def compute_flow(
    frames: torch.Tensor,
    method: str = "farneback",
    raft_weights: str | os.PathLike[str] | None = None,
    raft_model: str = "large",
    clip: float | None = FLOW_BOUND,
) -> torch.Tensor:
    """Optical flow between consecutive frames.

    ``frames``: ``[N, 3, H, W]`` (float in [0, 1] or uint8). Returns ``[N - 1, 2, H, W]``
    float32 pixels, clipped to ``+-clip`` (None: unclipped).

    ``method``: ``"farneback"`` (OpenCV, default), ``"tvl1"`` (needs opencv-contrib's
    ``cv2.optflow``), ``"raft"`` (torchvision RAFT; ``raft_weights`` must be a local
    state-dict file, as nothing is downloaded; H and W must be divisible by 8).
    """
    if frames.dim() != 4 or frames.shape[1] != 3:
        raise ValueError(f"compute_flow: frames must be [N, 3, H, W], got shape {tuple(frames.shape)}")
    if frames.shape[0] < 2:
        raise ValueError(f"compute_flow: need at least 2 frames, got {frames.shape[0]}")
    if method == "raft":
        flow = _raft_flow(frames, raft_weights, raft_model)
    elif method in ("farneback", "tvl1"):
        import cv2

        gray = _to_gray_uint8(frames)
        if method == "tvl1":
            if not hasattr(cv2, "optflow"):
                raise ImportError("method='tvl1' needs opencv-contrib (cv2.optflow); install opencv-contrib-python-headless")
            tvl1 = cv2.optflow.DualTVL1OpticalFlow_create()
            pairs = [tvl1.calc(gray[i], gray[i + 1], None) for i in range(len(gray) - 1)]
        else:
            # Parameters of OpenCV's own sample (pyramid 0.5, 3 levels, window 15).
            pairs = [
                cv2.calcOpticalFlowFarneback(gray[i], gray[i + 1], None, 0.5, 3, 15, 3, 5, 1.2, 0)
                for i in range(len(gray) - 1)
            ]
        flow = torch.from_numpy(np.stack(pairs)).permute(0, 3, 1, 2).float()
    else:
        raise ValueError(f"compute_flow: method must be 'farneback', 'tvl1' or 'raft', got {method!r}")
    return flow if clip is None else clip_flow(flow, clip)


def _raft_flow(frames: torch.Tensor, weights: str | os.PathLike[str] | None, model: str) -> torch.Tensor:
    from torchvision.models.optical_flow import raft_large, raft_small

    if weights is None:
        raise ValueError("compute_flow(method='raft') needs raft_weights: a local torchvision RAFT state-dict file")
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"RAFT weights file {str(weights)!r} does not exist")
    h, w = frames.shape[-2:]
    if h % 8 or w % 8:
        raise ValueError(f"RAFT needs H and W divisible by 8, got {h}x{w}")
    net = {"large": raft_large, "small": raft_small}[model](weights=None, progress=False)
    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    net.eval().to(frames.device)  # where the frames are (e.g. a GPU)
    f = frames.float() / 255.0 if frames.dtype == torch.uint8 else frames.float()
    f = f * 2.0 - 1.0  # RAFT's input range
    with torch.no_grad():
        return net(f[:-1], f[1:])[-1]  # one batched call over all pairs; last refinement


def check_flow(x: torch.Tensor, where: str) -> tuple[torch.Tensor, int]:
    """``[B, T, 2, H, W]`` (or ``[B, 2, H, W]``, one flow) -> ``([B*T, 2, H, W], T)``."""
    if x.dim() == 4:
        x = x.unsqueeze(1)
    if x.dim() != 5 or x.shape[2] != 2:
        raise ValueError(f"{where}: flow values must be [B, T, 2, H, W] (2 channels: u, v), got shape {tuple(x.shape)}")
    frames, t = split_frames(x, 2, where)
    if not frames.is_floating_point():
        raise ValueError(f"{where}: flow must be float pixels (decode stored uint8 flow first), got dtype {x.dtype}")
    return frames, int(t or 1)


# --------------------------------------------------------------------------- flow CNN


@dataclass
class FlowCNNConfig(AdapterConfig):
    """A compact 2-D CNN over flow, trained from scratch (stages of two 3x3 conv-BN-ReLU,
    stride 2 from the second stage, global average pooling). Flow is divided by
    ``flow_scale`` (the clip bound) first.

    ``temporal``: ``"stack"`` feeds the T flows as 2T input channels (the two-stream
    flow network; needs ``num_flows`` = T); ``"mean"`` encodes each flow separately
    (shared weights, any T) and averages the per-flow embeddings over time."""

    type = "flow_cnn"
    channels: list[int] = field(default_factory=lambda: [32, 64, 128])
    flow_scale: float = FLOW_BOUND
    temporal: str = "mean"
    num_flows: int | None = None


@register_adapter
class FlowCNNAdapter(Adapter):
    """Small 2-D CNN on optical flow ``values [B, T, 2, H, W]`` (per flow, or 2T stacked channels)."""

    config_class = FlowCNNConfig
    config: FlowCNNConfig

    def __init__(self, config: FlowCNNConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        if config.flow_scale <= 0:
            raise ValueError(f"flow_cnn flow_scale must be positive, got {config.flow_scale}")
        if config.temporal not in ("mean", "stack"):
            raise ValueError(f"flow_cnn temporal must be 'mean' or 'stack', got {config.temporal!r}")
        if config.temporal == "stack" and not (config.num_flows and config.num_flows > 0):
            raise ValueError("flow_cnn temporal='stack' needs num_flows (the T of every flow view)")
        in_channels = 2 * config.num_flows if config.temporal == "stack" else 2  # type: ignore[operator]
        self.backbone = SmallCNN(in_channels, list(config.channels))
        self.feature_dim = int(config.channels[-1])
        self._finish_init()

    def backbone_blocks(self) -> list[nn.Module]:
        return list(self.backbone.stages)

    def enable_gradient_checkpointing(self) -> None:
        self.backbone.checkpoint_stages = True

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = "flow_cnn adapter"
        frames, t = check_flow(require_tensor(inputs, "values", where), where)
        if self.config.temporal == "stack":
            if t != self.config.num_flows:
                raise ValueError(f"{where}: temporal='stack' expects T={self.config.num_flows} flows, got {t}")
            frames, t = frames.reshape(-1, 2 * t, *frames.shape[-2:]), 1
        device = next(self.backbone.parameters()).device
        return {"values": to_device(frames, device, torch.float32) / self.config.flow_scale,
                "frames": None if t == 1 else t}

    def encode(self, prepared: dict[str, Any]) -> torch.Tensor:
        return per_clip(self.backbone(prepared["values"]), prepared["frames"])


# --------------------------------------------------------------------------- flow ViT


@dataclass
class FlowCLIPConfig(OpenCLIPVisionConfig):
    """open_clip ViT over flow. ``pretrained`` (tag or local file) gives the RGB weights
    the patch embedding is adapted from. ``stacked_flows`` S: consecutive flows stacked
    as 2S input channels (TSN-style); T must be a multiple of S, the T/S groups are
    encoded separately and pooled over time like video frames."""

    type = "flow_clip"
    stacked_flows: int = 1
    flow_scale: float = FLOW_BOUND


def adapt_patch_embedding(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """A copy of ``conv`` taking ``in_channels`` inputs: the RGB filters averaged over
    their input channels, replicated over the new ones (cross-modality initialisation)."""
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        bias=conv.bias is not None,
    )
    with torch.no_grad():
        mean = conv.weight.mean(dim=1, keepdim=True)
        new.weight.copy_(mean.expand(-1, in_channels, -1, -1))
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    return new


@register_adapter
class FlowCLIPAdapter(OpenCLIPTower, Adapter):
    """open_clip ViT whose patch embedding is adapted from RGB to 2 flow channels."""

    config_class = FlowCLIPConfig
    default_lora_targets = ["c_fc", "c_proj"]
    config: FlowCLIPConfig

    def __init__(self, config: FlowCLIPConfig, *, load_weights: bool = True, saved_dir: Path | None = None) -> None:
        super().__init__(config)
        if config.stacked_flows < 1:
            raise ValueError(f"flow_clip stacked_flows must be >= 1, got {config.stacked_flows}")
        self.backbone = create_open_clip_visual(config, load_weights)
        if not isinstance(getattr(self.backbone, "conv1", None), nn.Conv2d):
            raise ValueError(f"flow_clip needs a ViT with a conv1 patch embedding, got {type(self.backbone).__name__}")
        self.backbone.conv1 = adapt_patch_embedding(self.backbone.conv1, 2 * config.stacked_flows)
        self._read_tower()
        self._finish_init()

    def preprocess(self, inputs: Mapping[str, Any], present: torch.Tensor | None = None) -> dict[str, Any]:
        where = "flow_clip adapter"
        frames, t = check_flow(require_tensor(inputs, "values", where), where)
        s = self.config.stacked_flows
        if t % s:
            raise ValueError(f"{where}: T={t} flows is not a multiple of stacked_flows={s}")
        device = next(self.backbone.parameters()).device
        x = to_device(frames, device, torch.float32)
        h, w = x.shape[-2:]
        if (h, w) != self.image_size:
            # Resizing changes displacements in proportion; crop keeps the centre.
            scale = max(self.image_size) / min(h, w)
            x = resize_shortest_center_crop(x, self.image_size, "bilinear") * scale
        groups = t // s
        x = x.reshape(-1, s * 2, *x.shape[-2:])  # [B * T/S, 2S, H, W]: S consecutive flows stacked
        pixels = x.clamp(-self.config.flow_scale, self.config.flow_scale) / self.config.flow_scale
        return {"pixels": pixels, "frames": None if groups == 1 else groups}
