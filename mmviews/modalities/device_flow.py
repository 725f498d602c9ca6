"""Optical flow computed in the training step, on the training device, by torchvision's RAFT.

With ``data.options.flow: raft`` a video dataset delivers the flow view as the clip's frames
(``{"frames": FloatTensor[B, T, 3, H, W]}`` in [0, 1], the inputs kind ``flow_frames``), so that
the loader's workers only decode; the flow view's augmentation (``flow_default``) crops and flips
those frames with the numbers it would draw for the flow. On the device, :class:`RAFTFlow` turns
them into the flow the flow adapter reads, ``{"values": FloatTensor[B, T - 1, 2, H, W]}`` in
pixels (u, v), in batches of frame pairs, under ``torch.no_grad`` and in float32 whatever the
run's autocast (RAFT's iterative refinement is numerically delicate; its cost is small beside the
encoders'). Nothing of RAFT is trained, saved with the encoder or seen by the optimiser: it is a
frozen part of the data path that happens to run on the accelerator.

The step converts a batch once, before anything else (:func:`mmviews.train.step.train_step`,
so that a cached-embedding step's chunks and the EMA teacher reuse it), and the encoder's forward
converts any batch that still holds frames (evaluation, ``mmviews embed``):
:meth:`mmviews.modalities.MultiViewEncoder.flow_from_frames`.

RAFT needs H and W divisible by 8 and at least 128 (its correlation pyramid halves a 1/8-size
feature map three times): smaller frames (UCF-101's recipe uses 112 px) are upsampled
(bilinear) to the next size that fits, and the flow is resized back with its displacements scaled.

Options (``data.options``):

- ``raft_model``: ``raft_small`` (default; 1.0 M parameters) or ``raft_large`` (5.3 M);
- ``raft_weights``: a torchvision weight tag of that model (``DEFAULT``, the default, or
  ``C_T_V2``, ``C_T_SKHT_V2``...; downloaded by torchvision when the hub is reachable), a local
  weights file (safetensors, or a torch file read with ``weights_only``) whose SHA-256 must begin
  with ``raft_weights_sha256`` or with the hex digits that end a torchvision file name
  (``raft_small_C_T_V2-01064c6d.pth``), or ``random`` (random weights: tests and benchmarks);
- ``raft_iterations``: refinement iterations (torchvision's default 12; fewer is faster and coarser);
- ``raft_pairs_per_call``: frame pairs per RAFT call (bounds its memory; default 64).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
import torch.nn.functional as TF

from mmviews.data.flow_options import RAFTOptions

#: RAFT's smallest input side: its 1/8 feature map must survive three halvings of the correlation pyramid.
RAFT_MIN_SIDE = 128
#: The key of a flow view's inputs that holds frames still to be turned into flow.
FRAMES_KEY = "frames"


def holds_frames(inputs: Any) -> bool:
    """Whether a modality's inputs are frames for flow on the device (``{"frames": ...}``)."""
    return isinstance(inputs, Mapping) and FRAMES_KEY in inputs and "values" not in inputs


def raft_input_side(side: int) -> int:
    """The side RAFT runs at for frames of ``side`` px: the next multiple of 8, at least :data:`RAFT_MIN_SIDE`."""
    return max(RAFT_MIN_SIDE, -(-int(side) // 8) * 8)


def build_raft(options: RAFTOptions) -> torch.nn.Module:
    """torchvision's RAFT of ``options.model`` with its weights, in eval mode, frozen."""
    import torchvision
    from torchvision.models import optical_flow

    from .image_backbones import read_weights_file

    key = "data.options.raft_weights"
    constructor = getattr(optical_flow, options.model)
    weights = options.weights
    if weights == "random":
        net = constructor(weights=None, progress=False)
    elif os.path.isfile(os.path.expanduser(weights)):
        net = constructor(weights=None, progress=False)
        state = read_weights_file(weights, options.weights_sha256, key)
        try:
            net.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ValueError(f"{weights}: not {options.model} weights ({str(error).splitlines()[0]})") from None
    else:
        tags = [w.name for w in torchvision.models.get_model_weights(options.model)] + ["DEFAULT"]
        if weights not in tags:
            raise FileNotFoundError(f"{key}: {weights!r} is neither a file nor a weight tag of {options.model} "
                                    f"({', '.join(tags)}), nor 'random'")
        try:
            net = constructor(weights=weights, progress=False)
        except Exception as error:  # no network (URLError), a damaged download (hash)...
            raise OSError(f"{key}: cannot get torchvision's {options.model} weights {weights!r} "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); give a local "
                          f"file (data.options.raft_weights: /path/{options.model}_C_T_V2-<hash>.pth, checked by the "
                          "hex digits of its name or data.options.raft_weights_sha256)") from None
    net.eval()
    net.requires_grad_(False)
    return net


class RAFTFlow:
    """Frames -> optical flow by RAFT on the frames' device (see the module docstring).

    A plain object, not an ``nn.Module``: held by the encoder (``encoder.device_flow``) it adds
    no parameters, state-dict entries or gradients, and a deep copy (the EMA teacher's) shares it.
    """

    def __init__(self, options: RAFTOptions, net: torch.nn.Module | None = None) -> None:
        self.options = options
        self.net = net if net is not None else build_raft(options)
        self.net.eval()
        self.net.requires_grad_(False)

    def __deepcopy__(self, memo: dict[int, Any]) -> "RAFTFlow":
        return self  # frozen: a copy of the encoder (the EMA teacher) shares it

    def __repr__(self) -> str:
        o = self.options
        return f"RAFTFlow({o.model}, weights={o.weights!r}, iterations={o.iterations})"

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        """``[B, T, 3, H, W]`` in [0, 1] -> flow ``[B, T - 1, 2, H, W]`` in pixels (float32)."""
        if frames.dim() != 5 or frames.shape[2] != 3 or frames.shape[1] < 2:
            raise ValueError(f"flow from frames: frames must be [B, T >= 2, 3, H, W], got shape {tuple(frames.shape)}")
        B, T, _, H, W = frames.shape
        net = self.net
        if next(net.parameters()).device != frames.device:
            net.to(frames.device)
        x = frames.float()
        first, second = x[:, :-1].reshape(-1, 3, H, W), x[:, 1:].reshape(-1, 3, H, W)
        size = (raft_input_side(H), raft_input_side(W))
        flows = []
        with torch.autocast(frames.device.type, enabled=False):
            for start in range(0, first.shape[0], self.options.pairs_per_call):
                a, b = first[start:start + self.options.pairs_per_call], second[start:start + self.options.pairs_per_call]
                if size != (H, W):
                    a = TF.interpolate(a, size=size, mode="bilinear", align_corners=False)
                    b = TF.interpolate(b, size=size, mode="bilinear", align_corners=False)
                # RAFT reads images in [-1, 1]; the last of its refinements is the estimate
                flow = net(a * 2 - 1, b * 2 - 1, num_flow_updates=self.options.iterations)[-1]
                if size != (H, W):
                    flow = TF.interpolate(flow, size=(H, W), mode="bilinear", align_corners=False)
                    flow = flow * torch.tensor([W / size[1], H / size[0]], device=flow.device).view(1, 2, 1, 1)
                flows.append(flow)
        return torch.cat(flows).reshape(B, T - 1, 2, H, W)

    def convert(self, batch: Any) -> Any:
        """``batch`` (a :class:`~mmviews.data.batch.ViewBatch`) with every modality that holds frames
        given their flow instead (the same batch when none does)."""
        changed = {m: inputs for m, inputs in batch.inputs.items() if holds_frames(inputs)}
        if not changed:
            return batch
        import dataclasses

        inputs = dict(batch.inputs)
        for modality, value in changed.items():
            inputs[modality] = {**{k: v for k, v in value.items() if k != FRAMES_KEY}, "values": self(value[FRAMES_KEY])}
        return dataclasses.replace(batch, inputs=inputs)


def device_flow_for(options: Mapping[str, Any]) -> RAFTFlow | None:
    """The :class:`RAFTFlow` that ``data.options`` asks for (``flow: raft``), else None."""
    settings = RAFTOptions.from_data_options(options)
    return None if settings is None else RAFTFlow(settings)
