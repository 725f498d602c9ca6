"""Spatiotemporal video backbones: ``torchvision_video`` (torchvision's video classifiers) and
``hf_video`` (transformers' video encoders) on whole clips ``[B, T, 3, H, W]``.

Their features are checked against the libraries' own models run here on the same weights and
the backbone's own normalisation written out in the test; every torchvision video model is built
and run on the meta device (shapes only, no arithmetic: the 88 M-parameter Video Swin-B costs
nothing); the frames checks, weights (tags through torchvision's own loader, files by sha256),
fine-tuning modes, LoRA and activation checkpointing on small random-weight models; and a run
trained on real clips written with PyAV, checked (memory estimate), embedded and exported to ONNX.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.error import URLError

import pytest
import torch
from torch import nn

from mmviews.modalities import Adapter, build_adapter
from mmviews.modalities.presets import TINY_VIT, TINY_VIDEOMAE, example_inputs, tiny_config

KINETICS_MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(1, 3, 1, 1, 1)  # torchvision's video weights'
KINETICS_STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(1, 3, 1, 1, 1)
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 1, 3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 1, 3, 1, 1)

TINY_SHAPE = {k: v for k, v in TINY_VIT.items() if k != "model_type"}
HF_CONFIGS = {
    "videomae": TINY_VIDEOMAE,
    "timesformer": {**TINY_SHAPE, "model_type": "timesformer", "num_frames": 4},
    "vivit": {**TINY_SHAPE, "model_type": "vivit", "num_frames": 4, "tubelet_size": [2, 8, 8]},
    # a projection narrower than the vision tower (its multi-frame transformer runs at that width)
    "xclip": {"model_type": "xclip", "projection_dim": 24, "prompt_layers": 1, "prompt_attention_heads": 2,
              "vision_config": {**TINY_SHAPE, "num_frames": 4, "mit_hidden_size": 24, "mit_intermediate_size": 48,
                                "mit_num_hidden_layers": 1, "mit_num_attention_heads": 2},
              "text_config": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "intermediate_size": 32, "vocab_size": 50}},
}


def clips(b: int, t: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, t, 3, size, size, generator=torch.Generator().manual_seed(seed))


def hf_video(model_type: str, **keys) -> Adapter:
    return build_adapter({"type": "hf_video", "backbone_config": HF_CONFIGS[model_type], **keys})


# --------------------------------------------------------------------------- torchvision


def test_torchvision_video_features_are_the_models_penultimate_layer():
    """The features are torchvision's model with its ``fc`` replaced by the identity, on clips
    normalised by the Kinetics-400 statistics and laid out ``[B, 3, T, H, W]``; frames of another
    size are resized to ``image_size`` first (MC3-18 here, the smallest; the recipes' R(2+1)D-18 is
    the same family, built below and in the recipes' test)."""
    import torchvision
    from torchvision.transforms.v2 import functional as TF

    adapter = build_adapter({"type": "torchvision_video", "model": "mc3_18", "image_size": 16}).eval()
    assert adapter.config.mean == pytest.approx(KINETICS_MEAN.flatten().tolist())
    assert adapter.config.std == pytest.approx(KINETICS_STD.flatten().tolist())
    assert adapter.feature_dim == 512 and adapter.exact_frames is None and adapter.min_frames == 1
    reference = torchvision.models.video.mc3_18().eval()
    reference.fc = nn.Identity()
    reference.load_state_dict(adapter.backbone.state_dict())
    x = clips(2, 3, 16)
    wide = clips(2, 3, 20, seed=1)[..., :18]  # 20x18 frames: resized (shorter side 16), centre-cropped
    with torch.no_grad():
        expected = reference((x.transpose(1, 2) - KINETICS_MEAN) / KINETICS_STD)
        torch.testing.assert_close(adapter.features({"values": x}), expected)
        small = TF.center_crop(TF.resize(wide.flatten(0, 1), [16], antialias=True), [16, 16]).clamp(0, 1)
        expected = reference((small.view(2, 3, 3, 16, 16).transpose(1, 2) - KINETICS_MEAN) / KINETICS_STD)
        torch.testing.assert_close(adapter.features({"values": wide}), expected)
    with torch.device("meta"):
        assert build_adapter({"type": "torchvision_video"}).config.image_size == 112  # the weights' own crop


# feature width, frames (the fewest; "=" exactly), frame side, blocks, of every torchvision video model
TORCHVISION_VIDEO = {
    "r3d_18": (512, 1, 112, 4), "mc3_18": (512, 1, 112, 4), "r2plus1d_18": (512, 1, 112, 4),
    "s3d": (1024, 14, 224, 16), "mvit_v1_b": (768, "=16", 224, 16), "mvit_v2_s": (768, "=16", 224, 16),
    "swin3d_t": (768, 1, 224, 7), "swin3d_s": (768, 1, 224, 7), "swin3d_b": (1024, 1, 224, 7),
}


def test_every_torchvision_video_model_builds_and_embeds_its_smallest_clip():
    """Every model of ``torchvision.models.video`` builds, with the feature width, frame size and
    block list of its family, and embeds a clip of its smallest size to ``[B, embed_dim]`` (on the
    meta device: shapes without arithmetic); one frame fewer (or, for MViT, one more) is refused
    in one line naming the model, the frames it takes and the frames given."""
    import torchvision

    assert sorted(TORCHVISION_VIDEO) == sorted(torchvision.models.list_models(module=torchvision.models.video))
    for name, (width, frames, side, blocks) in TORCHVISION_VIDEO.items():
        with torch.device("meta"):
            adapter = build_adapter({"type": "torchvision_video", "model": name, "embed_dim": 8})
            exact = isinstance(frames, str)
            t = int(str(frames).lstrip("="))
            z = adapter({"values": torch.empty(2, max(t, 2), 3, side, side)}, check_inputs=False)
        on_host = torch.zeros(1, max(t, 2), 3, side, side, device="cpu")
        assert adapter.preprocess({"values": on_host})["pixels"].device.type == "meta"  # moved to the weights'
        assert (adapter.feature_dim, adapter.config.image_size, len(adapter.backbone_blocks())) == (width, side, blocks)
        assert z.shape == (2, 8), name
        assert adapter.any_frames_in_onnx == name.startswith(("r", "mc", "s3d")), name  # the traced T is dynamic
        head = getattr(adapter.backbone, "fc", None) or getattr(adapter.backbone, "classifier", None) or \
            adapter.backbone.head
        assert isinstance(head, nn.Identity), name  # the whole head, its dropout too (MViT, S3D)
        names = {n for n, _ in adapter.backbone.named_modules()}
        targets = adapter.default_lora_targets
        assert targets and all(t in names or any(n.endswith(f".{t}") for n in names) for t in targets), name
        if exact:
            message = (f"torchvision_video adapter: {name} takes clips of 16 frames (its positional embeddings' "
                       f"size), got 17 (values shape (1, 17, 3, 224, 224))")
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                adapter.preprocess({"values": torch.empty(1, 17, 3, 224, 224, device="meta")})
        if t > 1:
            message = (f"torchvision_video adapter: {name} takes clips of {'' if exact else 'at least '}{t} frames "
                       f"({'its positional embeddings' + chr(39) + ' size' if exact else 'torchvision' + chr(39) + 's smallest clip for it'})"
                       f", got {t - 1} (values shape (1, {t - 1}, 3, {side}, {side}))")
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                adapter.preprocess({"values": torch.empty(1, t - 1, 3, side, side, device="meta")})


def test_torchvision_video_frame_sizes_and_inputs_are_checked():
    """MViT takes exactly 224 px, S3D at least 224; images, other channel counts, integer frames
    and values outside [0, 1] are refused in one line."""
    with pytest.raises(ValueError, match=r"^torchvision_video adapter: mvit_v2_s takes frames of 224x224 px, got "
                                         r"image_size 112$"):
        with torch.device("meta"):
            build_adapter({"type": "torchvision_video", "model": "mvit_v2_s", "image_size": 112})
    with pytest.raises(ValueError, match=r"^torchvision_video adapter: s3d takes frames of at least 224x224 px, got "
                                         r"image_size 112$"):
        with torch.device("meta"):
            build_adapter({"type": "torchvision_video", "model": "s3d", "image_size": 112})
    with pytest.raises(ValueError, match=r"^torchvision_video adapter: unknown model 'resnet18'.*"
                                         r"\(torchvision\.models\.list_models\(module=torchvision\.models\.video\)\)$"):
        build_adapter({"type": "torchvision_video", "model": "resnet18"})
    adapter = build_adapter(tiny_config("torchvision_video"))
    with pytest.raises(ValueError, match=r"^torchvision_video adapter: input dict has no key 'values' \(keys: \['clips'\]\)$"):
        adapter({"clips": torch.rand(2, 2, 3, 16, 16)})
    one_pixel_wide = adapter.preprocess({"values": torch.rand(1, 2, 3, 20, 1)})["pixels"]  # resized, not refused
    assert one_pixel_wide.shape == (1, 2, 3, 16, 16)
    assert adapter.preprocess({"values": torch.rand(1, 2, 3, 16, 16, dtype=torch.float64)})["pixels"].dtype == torch.float32
    for bad, message in [(torch.rand(2, 3, 16, 16), r"values must be clips \[B, T, 3, H, W\], got shape \(2, 3, 16, 16\)"),
                         (torch.rand(2, 2, 1, 16, 16), r"values must be clips \[B, T, 3, H, W\], got shape \(2, 2, 1, 16, 16\)"),
                         (torch.rand(2, 2, 3, 0, 16), r"empty spatial size in shape \(2, 2, 3, 0, 16\)"),
                         (torch.rand(2, 2, 3, 16, 0), r"empty spatial size in shape \(2, 2, 3, 16, 0\)"),
                         (torch.zeros(2, 2, 3, 16, 16, dtype=torch.uint8), r"clips must be float in \[0, 1\], got dtype torch.uint8"),
                         (torch.rand(2, 2, 3, 16, 16) * 255, r"images must be in \[0, 1\], got range")]:
        with pytest.raises(ValueError, match=f"^torchvision_video adapter: {message}"):
            adapter({"values": bad})


def test_a_model_of_an_unknown_layout_is_named_with_the_adapter():
    """A model without a classification head, or whose blocks last_n cannot find (a layout that
    a later torchvision could bring), is one line naming the adapter and the model's class."""
    from mmviews.modalities.video_backbones import drop_video_classifier

    with pytest.raises(ValueError, match=r"^torchvision_video adapter: no Linear classification layer found in "
                                         r"Sequential$"):
        drop_video_classifier(nn.Sequential(nn.Conv3d(3, 4, 1), nn.ReLU()), "torchvision_video adapter")
    adapter = build_adapter(tiny_config("torchvision_video"))
    adapter.backbone = nn.Sequential(nn.Conv3d(3, 4, 1))
    with pytest.raises(NotImplementedError, match=r"^last_n: unknown block layout of torchvision Sequential$"):
        adapter.backbone_blocks()


def _state_with_head(name: str, seed: int) -> dict[str, torch.Tensor]:
    import torchvision

    torch.manual_seed(seed)
    return torchvision.models.get_model(name).state_dict()


def test_torchvision_video_weights_from_a_tag_or_a_file(tmp_path, monkeypatch):
    """A weight tag is torchvision's own loader with its own URL (replaced here: nothing is
    fetched), and an unreachable download is one line naming the URL; a local file (classifier
    included: dropped, S3D's convolution classifier too) is checked by the sha256 its name ends
    with, read weights-only, and must fit."""
    import torchvision

    state = _state_with_head("mc3_18", seed=3)
    asked = []

    def from_url(url, *args, **kwargs):
        asked.append(url)
        return state

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", from_url)
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", from_url, raising=False)
    adapter = build_adapter({"type": "torchvision_video", "model": "mc3_18", "weights": "KINETICS400_V1"})
    assert asked == ["https://download.pytorch.org/models/mc3_18-a90a0ba3.pth"]
    own = adapter.backbone.state_dict()
    assert set(state) - set(own) == {"fc.weight", "fc.bias"} and all(torch.equal(own[k], state[k]) for k in own)

    def offline(url, *args, **kwargs):
        raise URLError("no route to host")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline, raising=False)
    with pytest.raises(FileNotFoundError, match=r"^torchvision_video adapter: weights 'KINETICS400_V1' of 'mc3_18' "
                                                r"could not be downloaded from https://download\.pytorch\.org/models/"
                                                r"mc3_18-a90a0ba3\.pth \(no route to host\); download the file "
                                                r"elsewhere and give its path as weights, or set weights: null for "
                                                r"random weights$"):
        build_adapter({"type": "torchvision_video", "model": "mc3_18", "weights": "KINETICS400_V1"})
    with pytest.raises(FileNotFoundError, match=r"weights 'K400' is neither a file nor a weight tag of 'mc3_18' "
                                                r"\(KINETICS400_V1\)"):
        build_adapter({"type": "torchvision_video", "model": "mc3_18", "weights": "K400"})

    s3d = _state_with_head("s3d", seed=4)
    plain = tmp_path / "s3d.pth"
    torch.save(s3d, plain)
    digest = hashlib.sha256(plain.read_bytes()).hexdigest()
    named = tmp_path / f"s3d-{digest[:8]}.pth"
    plain.rename(named)
    adapter = build_adapter({"type": "torchvision_video", "model": "s3d", "weights": str(named)})
    own = adapter.backbone.state_dict()
    assert set(s3d) - set(own) == {"classifier.1.weight", "classifier.1.bias"}
    assert all(torch.equal(own[k], s3d[k]) for k in own)
    from mmviews.modalities import adapter_class

    cls = adapter_class("torchvision_video")
    with torch.device("meta"):  # the architecture alone (a saved adapter's): the file is not read
        cls(cls.config_class.from_dict({"model": "s3d", "weights": str(tmp_path / "never-read.pth")}),
            load_weights=False)
    wrong = tmp_path / "s3d-00000000.pth"
    named.rename(wrong)
    with pytest.raises(ValueError, match=r"s3d-00000000\.pth: sha256 [0-9a-f]{16}\.\.\. does not begin with '00000000'"):
        build_adapter({"type": "torchvision_video", "model": "s3d", "weights": str(wrong)})
    other = tmp_path / "r3d.pth"
    torch.save(_state_with_head("r3d_18", seed=5), other)
    with pytest.raises(ValueError, match=r"r3d\.pth: does not fit the backbone"):
        build_adapter({"type": "torchvision_video", "model": "mc3_18", "weights": str(other)})


def _grads(adapter: Adapter, x: torch.Tensor, seed: int = 0,
           saved: list[int] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward and backward (``saved``: the sizes of the tensors autograd keeps)."""
    torch.manual_seed(seed)
    adapter.train()
    keep = (lambda t: saved.append(t.numel()) or t) if saved is not None else (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        z = adapter({"values": x})
    (z * torch.linspace(-1, 1, z.numel()).view_as(z)).sum().backward()
    return z.detach(), {n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", ["mc3_18", "swin3d_t"])
def test_torchvision_video_checkpointing_keeps_embeddings_gradients_and_statistics(model):
    """Activation checkpointing of every block: the same embeddings and gradients (Swin's
    stochastic depth replayed in the recomputation), BatchNorm's running statistics moved once,
    the parameters' names unchanged (a saved adapter loads either way)."""
    config = {"type": "torchvision_video", "model": model, "image_size": 16 if model == "mc3_18" else 32}
    torch.manual_seed(0)
    plain = build_adapter(config)
    torch.manual_seed(0)
    checkpointed = build_adapter({**config, "gradient_checkpointing": True})
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    checkpointed.load_state_dict(plain.state_dict())
    x = clips(3, 2, config["image_size"])
    saved: list[int] = []
    plain_saved: list[int] = []
    z, grads = _grads(plain, x, saved=plain_saved)
    z_ckpt, grads_ckpt = _grads(checkpointed, x, saved=saved)
    torch.testing.assert_close(z_ckpt, z)
    assert grads_ckpt.keys() == grads.keys() and len(grads) > 10
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.equal(a, b), name  # running means, variances and batch counts: one update each
    assert sum(saved) < 0.5 * sum(plain_saved), "the blocks' activations are not kept"


def test_torchvision_video_last_n_and_lora():
    """``last_n`` trains the last stages (Video Swin's final norm with them); LoRA on a frozen
    video ResNet puts trainable matrices on the blocks' 3-D convolutions, and only they train."""
    pytest.importorskip("peft", reason="peft (the optional 'lora' extra) is not installed")
    swin = build_adapter({"type": "torchvision_video", "model": "swin3d_t", "image_size": 32,
                          "finetune": {"mode": "last_n", "last_n": 2}})
    blocks = swin.backbone_blocks()
    trained = {id(p) for p in swin.backbone.parameters() if p.requires_grad}
    assert trained == {id(p) for b in blocks[-2:] for p in b.parameters()} | {id(p) for p in swin.backbone.norm.parameters()}
    lora = build_adapter({**tiny_config("torchvision_video"), "finetune": {"mode": "frozen", "lora": {"r": 2}}})
    trainable = [n for n, p in lora.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    wrapped = {n.rsplit(".lora_", 1)[0] for n in trainable}
    assert wrapped == {t for t in lora.default_lora_targets}  # every convolution of layer1..layer4, nothing else
    z, grads = _grads(lora, example_inputs("torchvision_video", 3)["values"])
    assert any("lora_B" in n and g.abs().sum() > 0 for n, g in grads.items())


# --------------------------------------------------------------------------- transformers


def _transformers_reference(model_type: str, adapter: Adapter) -> nn.Module:
    from transformers import AutoConfig, AutoModel

    keys = dict(HF_CONFIGS[model_type])
    model = AutoModel.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys)).eval()
    missing, unexpected = model.load_state_dict(adapter.backbone.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("text_model", "text_projection", "prompts_", "logit_scale"))
                                  for k in missing)
    return model


@pytest.mark.parametrize("model_type", list(HF_CONFIGS))
def test_hf_video_features_pool_as_each_model_does(model_type: str, tmp_path):
    """VideoMAE (no class token): the mean of its tokens; TimeSformer and ViViT: the class
    token; X-CLIP: its video features (frames through the vision tower, pooled by its multi-frame
    transformer), its text tower dropped; all on ImageNet-normalised clips. A saved adapter
    loads to the same embeddings."""
    adapter = hf_video(model_type).eval()
    model = _transformers_reference(model_type, adapter)
    x = clips(2, 4, 32)
    pixels = (x - IMAGENET_MEAN) / IMAGENET_STD
    with torch.no_grad():
        if model_type == "xclip":
            expected = model.get_video_features(pixel_values=pixels).pooler_output
            assert not hasattr(adapter.backbone, "text_model")
        else:
            tokens = model(pixel_values=pixels).last_hidden_state
            expected = tokens.mean(1) if model_type == "videomae" else tokens[:, 0]
        torch.testing.assert_close(adapter.features({"values": x}), expected)
    assert adapter.config.pooling == {"videomae": "mean", "xclip": None}.get(model_type, "cls")
    assert adapter.feature_dim == (24 if model_type == "xclip" else 32)  # X-CLIP: its projection's width
    adapter.save_pretrained(tmp_path / "saved")
    loaded = Adapter.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded({"values": x}), adapter({"values": x}))


def test_hf_video_checkpoint_folder_brings_its_processors_statistics(tmp_path):
    """A local VideoMAE checkpoint with its video processor: the processor's mean and std, the
    crop of the model's size; its weights; the frames checked against its config's
    ``num_frames``. The saved adapter loads without the checkpoint folder."""
    from transformers import AutoConfig, AutoModel, VideoMAEImageProcessor

    keys = dict(TINY_VIDEOMAE)
    torch.manual_seed(1)
    model = AutoModel.from_config(AutoConfig.for_model(keys.pop("model_type"), **keys)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    VideoMAEImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}, image_mean=mean,
                           image_std=std).save_pretrained(tmp_path / "ckpt")
    adapter = build_adapter({"type": "hf_video", "model": str(tmp_path / "ckpt")}).eval()
    assert (adapter.config.image_size, adapter.config.mean, adapter.config.std) == (32, mean, std)
    x = clips(2, 4, 32)
    with torch.no_grad():
        expected = model(pixel_values=(x - torch.tensor(mean).view(1, 1, 3, 1, 1))
                         / torch.tensor(std).view(1, 1, 3, 1, 1)).last_hidden_state.mean(1)
        torch.testing.assert_close(adapter.features({"values": x}), expected)
    message = ("hf_video adapter: VideoMAEModel takes clips of 4 frames (its config's num_frames), got 6 (values "
               "shape (2, 6, 3, 32, 32))")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        adapter({"values": clips(2, 6, 32)})
    adapter.save_pretrained(tmp_path / "saved")
    import shutil

    shutil.rmtree(tmp_path / "ckpt")
    loaded = Adapter.from_pretrained(tmp_path / "saved").eval()
    assert (loaded.config.mean, loaded.config.std) == (mean, std)
    with torch.no_grad():
        torch.testing.assert_close(loaded({"values": x}), adapter({"values": x}))
    with pytest.raises(FileNotFoundError, match=r"^video model: local folder .* has no config\.json"):
        build_adapter({"type": "hf_video", "model": str(tmp_path)})
    bare = dict(TINY_VIDEOMAE)
    del bare["model_type"]
    assert type(build_adapter({"type": "hf_video", "backbone_config": bare}).backbone).__name__ == "VideoMAEModel"


def test_hf_video_without_checkpointing_or_layer_list_is_named(monkeypatch):
    """A transformers class without activation checkpointing, or without a layer list for
    ``last_n``, is refused naming the adapter and the class."""
    from transformers import VideoMAEModel

    import mmviews.modalities.video_backbones as video

    monkeypatch.setattr(VideoMAEModel, "supports_gradient_checkpointing", False)
    with pytest.raises(ValueError, match=r"^hf_video adapter: VideoMAEModel does not support gradient checkpointing$"):
        hf_video("videomae", gradient_checkpointing=True)
    monkeypatch.setattr(video, "_first_module_list", lambda model, names: None)
    with pytest.raises(NotImplementedError, match=r"^last_n: no layer list found in VideoMAEModel$"):
        hf_video("videomae", finetune={"mode": "last_n", "last_n": 1})


def test_clips_are_resized_within_the_unit_range_and_an_empty_batch_passes():
    """Bicubic resizing overshoots at sharp edges: the resized frames are clamped to [0, 1]
    before normalising; a batch of no clip (a process whose share of a view is empty) is resized
    as any other."""
    adapter = hf_video("videomae", interpolation="bicubic").eval()
    edge = torch.zeros(1, 4, 3, 40, 40)
    edge[..., 21:] = 1.0  # a step: bicubic resizing to 32 px gives -0.025 and 1.036 beside it
    pixels = adapter.preprocess({"values": edge})["pixels"] * IMAGENET_STD + IMAGENET_MEAN
    assert pixels.shape == (1, 4, 3, 32, 32)
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    assert (pixels <= 1e-6).float().mean() > 0.4 and (pixels >= 1 - 1e-6).float().mean() > 0.4  # clamped, not scaled
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    bicubic = TF.resize(edge[0], [32], interpolation=InterpolationMode.BICUBIC, antialias=True).clamp(0, 1)
    torch.testing.assert_close(pixels[0], TF.center_crop(bicubic, [32, 32]))
    assert adapter.preprocess({"values": torch.rand(0, 4, 3, 48, 40)})["pixels"].shape == (0, 4, 3, 32, 32)
    exact = torch.full((1, 4, 3, 32, 32), 1.0005)  # at the model's size (and within the value check's 1e-3)
    unchanged = adapter.preprocess({"values": exact})["pixels"] * IMAGENET_STD + IMAGENET_MEAN
    torch.testing.assert_close(unchanged, exact)  # not resampled, not clamped


def test_hf_video_refuses_what_the_model_cannot_take():
    with pytest.raises(ValueError, match=r"^hf_video adapter: VideoMAEModel takes frames of 32x32 px \(its config's "
                                         r"image_size, which its position embeddings fix\), got image_size 64$"):
        hf_video("videomae", image_size=64)
    with pytest.raises(ValueError, match=r"^hf_video adapter: VideoMAEModel has no class token; use pooling 'mean'$"):
        hf_video("videomae", pooling="cls")
    with pytest.raises(ValueError, match=r"^hf_video adapter: pooling must be 'cls', 'mean' or 'pooler', got 'max'$"):
        hf_video("vivit", pooling="max")
    with pytest.raises(ValueError, match=r"^hf_video adapter: X-CLIP pools its frames with its own multi-frame "
                                         r"transformer; remove pooling \('mean'\)$"):
        hf_video("xclip", pooling="mean")
    with pytest.raises(ValueError, match=r"^hf_video adapter: ViTModel is not a video model \(it has no num_frames, "
                                         r"image_size and hidden_size; image models take the hf_vision adapter\)$"):
        build_adapter({"type": "hf_video", "backbone_config": TINY_VIT})
    with pytest.raises(ValueError, match=r"^hf_video adapter: TimesformerModel has no pooled output; use pooling "
                                         r"'cls' or 'mean'$"):
        hf_video("timesformer", pooling="pooler")({"values": clips(1, 4, 32)})
    vivit = hf_video("vivit", pooling="pooler").eval()
    with torch.no_grad():
        pooled = vivit.backbone(pixel_values=(clips(1, 4, 32) - IMAGENET_MEAN) / IMAGENET_STD).pooler_output
        torch.testing.assert_close(vivit.features({"values": clips(1, 4, 32)}), pooled)


@pytest.mark.parametrize("model_type", ["videomae", "timesformer", "vivit", "xclip"])
def test_hf_video_checkpointing_last_n_and_lora(model_type: str):
    """transformers' checkpointing gives the same gradients; ``last_n`` trains the last layers
    (of X-CLIP's vision tower, with its multi-frame transformer and projection as the tail); LoRA
    wraps the attention's query and value (TimeSformer's fused ``qkv``, X-CLIP's ``q_proj`` /
    ``v_proj``)."""
    torch.manual_seed(0)
    plain = hf_video(model_type)
    checkpointed = hf_video(model_type, gradient_checkpointing=True)
    checkpointed.load_state_dict(plain.state_dict())
    x = clips(3, 4, 32)
    z, grads = _grads(plain, x)
    z_ckpt, grads_ckpt = _grads(checkpointed, x)
    torch.testing.assert_close(z_ckpt, z)
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    last = hf_video(model_type, finetune={"mode": "last_n", "last_n": 1})
    trained = {n for n, p in last.backbone.named_parameters() if p.requires_grad}
    prefix = {"xclip": "vision_model.encoder.layers.", "vivit": "layers."}.get(model_type, "encoder.layer.")
    assert {n[len(prefix):].split(".")[0] for n in trained if n.startswith(prefix)} == {"1"}
    tail = {n for n in trained if not n.startswith(prefix)}
    if model_type == "xclip":  # the vision tower's final norm, the projection, the multi-frame transformer
        assert tail == {n for n, _ in last.backbone.named_parameters()
                        if n.startswith(("vision_model.post_layernorm.", "visual_projection.", "mit."))}
    else:  # TimeSformer's final LayerNorm, ViViT's and its pooler; VideoMAE (mean pooling) has none
        norm = {"layernorm.weight", "layernorm.bias"}
        assert tail == {"videomae": set(), "timesformer": norm,
                        "vivit": norm | {"pooler.dense.weight", "pooler.dense.bias"}}[model_type]
    pytest.importorskip("peft", reason="peft (the optional 'lora' extra) is not installed")
    lora = hf_video(model_type, finetune={"mode": "frozen", "lora": {"r": 2}})
    wrapped = {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n, p in lora.backbone.named_parameters()
               if p.requires_grad}
    assert wrapped == {"videomae": {"query", "value"}, "timesformer": {"qkv"}, "vivit": {"q_proj", "v_proj"},
                       "xclip": {"q_proj", "v_proj"}}[model_type]


# --------------------------------------------------------------------------- a run on real clips


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    """A UCF-101-style folder of MPEG-4 clips written with PyAV: two classes, three training
    clips and one test clip each, 8 frames of 32x32, no audio track."""
    from test_data_video import write_clip

    root = tmp_path_factory.mktemp("clips") / "UCF"
    lists = root / "ucfTrainTestlist"
    lists.mkdir(parents=True)
    train, test = [], []
    for c, cls in enumerate(("Jump", "Run")):
        (root / cls).mkdir()
        for k in range(4):
            rel = f"{cls}/v_{cls}_g0{k}_c01.avi"
            write_clip(root / rel, n_frames=8, audio=False, size=(32, 32), shade=30 * k + 110 * c)
            (train if k < 3 else test).append(f"{rel} {c + 1}" if k < 3 else rel)
    (lists / "classInd.txt").write_text("1 Jump\n2 Run\n")
    (lists / "trainlist01.txt").write_text("\n".join(train) + "\n")
    (lists / "testlist01.txt").write_text("\n".join(test) + "\n")
    return root


def clip_recipe(root: Path, adapter: dict) -> dict:
    """The video recipes' views (a natural clip and an augmented copy) on ``root``: one epoch of
    batches of 3, a k-NN probe."""
    return {
        "name": "clips", "seed": 0,
        "data": {"name": "ucf101", "root": str(root), "options": {"num_frames": 4, "size": 32, "audio": False},
                 "train_split": "train", "val_split": None, "test_split": "test", "batch_size": 3,
                 "num_workers": 0, "eval_batch_size": 4},
        "views": [{"modality": "video"}, {"modality": "video", "augment": "video_default"}],
        "encoder": {"embed_dim": 8},
        "adapters": {"video": {**adapter, "head": {"kind": "linear"}}},
        "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
        # float32 (`auto` picks bf16 on a CPU with native bf16): the ONNX export computes in float32
        "optimisation": {"optimizer": "adamw", "lr": 1e-3, "epochs": 1, "warmup_steps": 1, "mixed_precision": "no"},
        "evaluation": {"tasks": ["knn:class"], "random_baseline": False},
        "output": {"log_every": 1, "checkpoint_every": 100, "keep_last": 1, "progress_bar": False},
    }


@pytest.mark.slow
def test_a_run_on_real_clips_checks_trains_embeds_and_exports(clip_folder: Path, tmp_path: Path):
    """The video recipes' encoder, R(2+1)D-18, on clips decoded from real files: ``--check``
    prints the memory estimate, one epoch trains the backbone, the run's encoder loads with
    ``from_pretrained``, and ``mmviews embed`` on its ONNX export gives the torch embeddings
    (1e-4) of the test clips."""
    from test_export import check_onnx_embed_matches_torch
    from test_train_utils import train_in_process, write_recipe

    from mmviews.cli import main
    from mmviews.modalities import MultiViewEncoder

    adapter = {"type": "torchvision_video", "model": "r2plus1d_18", "image_size": 32}
    recipe = write_recipe(tmp_path / "clips.yaml", clip_recipe(clip_folder, adapter))
    checked = train_in_process(str(recipe), "--check", "--output", str(tmp_path / "checked"))
    assert checked.returncode == 0, checked.stderr
    assert "estimated peak memory per device (plain step; K = 3 samples, M = 2 views" in checked.stdout
    size, unit = re.search(r"\n  parameters +([\d.]+) (MiB|GiB)", checked.stdout).groups()  # type: ignore[union-attr]
    backbone = sum(p.numel() for p in build_adapter(adapter).backbone.parameters()) * 4 / 2**20  # float32, MiB
    assert abs(float(size) * (1024 if unit == "GiB" else 1) - backbone) <= 0.005 * 1024 + 1  # printed to 0.01 GiB
    done = train_in_process(str(recipe), "--output", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    encoder = MultiViewEncoder.from_pretrained(tmp_path / "run" / "encoder")
    norms = [m for m in encoder.adapters["video"].backbone.modules() if isinstance(m, nn.BatchNorm3d)]
    # BatchNorm starts at weight 1, bias 0, running mean 0: trained in training mode, all moved
    assert norms and all(not torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert all(m.running_mean.abs().sum() > 0 for m in norms)
    assert main(["export", str(tmp_path / "run"), "--format", "onnx", "--output", str(tmp_path / "onnx")]) == 0
    assert check_onnx_embed_matches_torch(tmp_path / "run", tmp_path / "onnx", tmp_path) <= 1e-4


@pytest.mark.parametrize("recipe", ["ucf101", "hmdb51"])
def test_the_video_recipes_encode_clips_with_r2plus1d_from_kinetics(recipe: str, monkeypatch):
    """The video recipes' video adapter: R(2+1)D-18 from torchvision's Kinetics-400 file (its
    loader replaced here: nothing is fetched), on the recipe's clips (8 frames of 112 px; on the
    meta device, shapes only)."""
    import torchvision

    from mmviews.config import load_config, resolve_recipe

    config = load_config(resolve_recipe(recipe))
    video = config.adapters["video"]
    assert (video["type"], video["model"], video["weights"]) == ("torchvision_video", "r2plus1d_18", "KINETICS400_V1")
    asked = []

    def from_url(url, *args, **kwargs):
        asked.append(url)
        with torch.device("meta"):
            return torchvision.models.video.r2plus1d_18().state_dict()

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", from_url)
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", from_url, raising=False)
    with torch.device("meta"):
        adapter = build_adapter({**video, "embed_dim": config.encoder["embed_dim"]})
        options = config.data.options
        z = adapter({"values": torch.empty(2, options["num_frames"], 3, options["size"], options["size"])},
                    check_inputs=False)
    assert asked == ["https://download.pytorch.org/models/r2plus1d_18-91a641e6.pth"]
    assert z.shape == (2, config.encoder["embed_dim"]) and adapter.config.image_size == options["size"] == 112
