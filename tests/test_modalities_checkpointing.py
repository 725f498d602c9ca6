"""Activation checkpointing (``gradient_checkpointing: true``): the same gradients as without,
fewer activations kept for backward, BatchNorm running statistics updated once, saved and
loaded with the adapter, and a clear error where an adapter has none."""

from __future__ import annotations

import json

import pytest
import torch

from mmviews.modalities import Adapter, MultiViewEncoder, SmallCNNVisionConfig, build_adapter
from mmviews.modalities.cache import backbone_fingerprint
from mmviews.modalities.presets import example_inputs, tiny_config

# Adapter types with activation checkpointing: transformers (text, hf_audio), open_clip ViTs
# (open_clip, flow_clip), transformers and timm image models (hf_vision, timm) and the CNNs
# (small_cnn, flow_cnn, audio_cnn).
SUPPORTED = ["text", "hf_audio", "open_clip", "flow_clip", "hf_vision", "timm", "small_cnn", "flow_cnn", "audio_cnn"]
# Backbones deep enough that checkpointing has something to drop (the presets' tiny ones have 2 blocks).
DEEPER = {
    "text": {"bert_config": {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
                             "intermediate_size": 64}},
    "hf_vision": {"backbone_config": {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 4,
                                      "num_attention_heads": 2, "intermediate_size": 64, "image_size": 32,
                                      "patch_size": 8}},
    "timm": {"model": "test_vit"},  # timm's switch is refused for BatchNorm models (test_resnet)
    "small_cnn": {"channels": [8, 16, 16, 16]},
    "flow_cnn": {"channels": [8, 16, 16, 16]},
    "audio_cnn": {"channels": [16, 16, 16, 16]},
}


def _config(kind: str, checkpointing: bool) -> dict:
    return tiny_config(kind, **DEEPER.get(kind, {}), gradient_checkpointing=checkpointing)


def _step(adapter: Adapter, inputs: dict) -> tuple[dict[str, torch.Tensor], int]:
    """One forward and backward of ``adapter`` in training mode (dropout on, RNG seeded): the
    gradients by parameter name and the activation bytes saved for backward."""
    adapter.train()
    params = {p.untyped_storage().data_ptr() for p in adapter.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    torch.manual_seed(123)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        z = adapter(inputs)
    target = torch.randn(z.shape, generator=torch.Generator().manual_seed(1))
    (z * target).sum().backward()
    grads = {n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None}
    return grads, sum(saved.values())


def _pair(kind: str) -> tuple[Adapter, Adapter]:
    torch.manual_seed(0)
    plain = build_adapter(_config(kind, False))
    torch.manual_seed(0)
    checkpointed = build_adapter(_config(kind, True))
    checkpointed.load_state_dict(plain.state_dict())
    return plain, checkpointed


@pytest.mark.parametrize("kind", SUPPORTED)
def test_same_gradients_fewer_saved_activations(kind: str) -> None:
    plain, checkpointed = _pair(kind)
    inputs = example_inputs(kind, 6)
    grads, plain_bytes = _step(plain, inputs)
    grads_ck, ck_bytes = _step(checkpointed, inputs)
    assert grads.keys() == grads_ck.keys() and any(".backbone." in f".{n}" for n in grads)
    for name in grads:
        torch.testing.assert_close(grads_ck[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # BatchNorm running statistics (and every other buffer) as after the plain step: the
    # recomputation in backward does not update them a second time.
    for (name, b), (_, b_ck) in zip(plain.named_buffers(), checkpointed.named_buffers()):
        assert torch.equal(b, b_ck), name
    print(f"{kind}: {plain_bytes} -> {ck_bytes} bytes saved for backward")
    assert ck_bytes < 0.8 * plain_bytes, (kind, plain_bytes, ck_bytes)


@pytest.mark.parametrize("kind", ["text", "open_clip", "small_cnn"])
def test_saved_and_loaded_with_the_adapter(kind: str, tmp_path) -> None:
    """``gradient_checkpointing`` is in the saved config.json (encoder folder) and the loaded
    adapter checkpoints again: it saves as few activations as the one that was saved."""
    torch.manual_seed(0)
    encoder = MultiViewEncoder.from_config({"x": _config(kind, True)})
    encoder.save_pretrained(tmp_path / "enc")
    assert json.loads((tmp_path / "enc" / "x" / "config.json").read_text())["gradient_checkpointing"] is True
    loaded = MultiViewEncoder.from_pretrained(tmp_path / "enc").adapters["x"]
    assert loaded.config.gradient_checkpointing is True
    plain = build_adapter(_config(kind, False))
    plain.load_state_dict(loaded.state_dict())
    inputs = example_inputs(kind, 4)
    grads, plain_bytes = _step(plain, inputs)
    grads_loaded, loaded_bytes = _step(loaded, inputs)
    assert loaded_bytes < 0.8 * plain_bytes
    for name in grads:
        torch.testing.assert_close(grads_loaded[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_unsupported_adapter_is_refused_by_name() -> None:
    for kind in ("feature_sequence", "mlp"):
        config = tiny_config(kind) if kind != "mlp" else {"type": "mlp", "embed_dim": 16}
        with pytest.raises(ValueError, match=rf"'{kind}' adapter does not support gradient_checkpointing.*"
                                             r"audio_cnn, flow_clip, flow_cnn, hf_audio, hf_video, hf_vision, open_clip, small_cnn, text, timm, "
                                             r"torchvision_video\)"):
            build_adapter({**config, "gradient_checkpointing": True})
        build_adapter({**config, "gradient_checkpointing": False})  # false is accepted everywhere
    # a mapping is checked by the recipe's validator; a config built in Python by the adapter itself
    with pytest.raises(ValueError, match="key 'gradient_checkpointing': expected bool, got str 'yes'"):
        build_adapter(tiny_config("small_cnn", gradient_checkpointing="yes"))
    with pytest.raises(ValueError, match="gradient_checkpointing must be true or false, got 'yes'"):
        build_adapter(SmallCNNVisionConfig(gradient_checkpointing="yes"))  # type: ignore[arg-type]


def test_open_clip_resnet_tower_is_refused() -> None:
    """open_clip's ResNet towers ignore set_grad_checkpointing: refused, not silently left as they are."""
    overrides = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8},
                 "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 1, "layers": 1}}
    config = {"type": "open_clip", "model": "RN50", "model_overrides": overrides, "embed_dim": 16}
    build_adapter(config)
    with pytest.raises(ValueError, match="'RN50' .*does not support gradient checkpointing"):
        build_adapter({**config, "gradient_checkpointing": True})


def test_feature_cache_key_ignores_checkpointing() -> None:
    """Checkpointing changes how gradients are computed, not the features: cached features stay valid."""
    torch.manual_seed(0)
    plain, checkpointed = _pair("small_cnn")
    assert backbone_fingerprint(plain) == backbone_fingerprint(checkpointed)


def test_evaluation_is_unchanged() -> None:
    """Under no_grad (evaluation, feature extraction) the checkpointed backbone is a plain forward."""
    plain, checkpointed = _pair("small_cnn")
    inputs = example_inputs("small_cnn", 4)
    with torch.no_grad():
        torch.testing.assert_close(checkpointed.eval()(inputs), plain.eval()(inputs), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["text", "small_cnn"])
def test_checkpointing_replays_sample_keyed_dropout(kind: str) -> None:
    """With ``optimisation.sample_keyed_dropout`` the recomputation in backward runs after the
    encoder call's row keys are gone: the adapter's checkpointing must replay them (else the
    keyed layers refuse to drop without keys, or drop other elements)."""
    from mmviews.modalities.dropout import dropout_rows, dropout_step, enable_sample_keyed_dropout

    dropout = {"bert_config": {**DEEPER["text"]["bert_config"], "hidden_dropout_prob": 0.2,
                               "attention_probs_dropout_prob": 0.2}} if kind == "text" else DEEPER[kind]
    adapters = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        config = tiny_config(kind, **dropout, gradient_checkpointing=checkpointing)
        config["head"] = {**config.get("head", {}), "dropout": 0.3}
        adapters.append(build_adapter(config))
        enable_sample_keyed_dropout(adapters[-1])
    plain, checkpointed = adapters
    checkpointed.load_state_dict(plain.state_dict())
    inputs = example_inputs(kind, 6)
    keys = torch.arange(6) * 7919 + 11
    grads = []
    for adapter in adapters:  # as in MultiViewEncoder.forward: the row keys hold for the forward only
        adapter.train()
        with dropout_step(3, 5):
            with dropout_rows(keys):
                z = adapter(inputs)
            (z * torch.randn(z.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads.append({n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_timm_batchnorm_model_is_refused() -> None:
    """timm's switch would update BatchNorm running statistics twice per step: refused by name."""
    with pytest.raises(ValueError, match="timm adapter: gradient_checkpointing is not supported for 'test_resnet'"):
        build_adapter(tiny_config("timm", gradient_checkpointing=True))


@pytest.mark.parametrize("kind", ["small_cnn", "torchvision_video"])
def test_a_training_forward_without_backward_moves_the_running_statistics_once(kind: str) -> None:
    """The forward, not the recomputation, updates BatchNorm's running statistics: a training
    forward that is never backpropagated (the loss dropped) leaves them as without checkpointing.
    torchvision_video: its blocks made checkpointed inside torchvision's own model."""
    torch.manual_seed(0)
    plain = build_adapter(_config(kind, False))
    torch.manual_seed(0)
    checkpointed = build_adapter(_config(kind, True))
    checkpointed.load_state_dict(plain.state_dict())
    inputs = example_inputs(kind, 3)
    before = {n: b.clone() for n, b in plain.named_buffers()}
    for adapter in (plain, checkpointed):
        adapter.train()
        adapter(inputs)  # under autograd, never backpropagated
    moved = [n for n, b in plain.named_buffers() if "running_mean" in n and not torch.equal(b, before[n])]
    assert moved  # BatchNorm layers inside the checkpointed blocks
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.equal(a, b), name


def test_checkpointed_video_blocks_train_behind_frozen_ones() -> None:
    """last_n with checkpointing: the first trained block's input needs no gradient (the blocks
    before it are frozen), and its parameters still get the gradients of the plain model."""
    config = {**tiny_config("torchvision_video"), "finetune": {"mode": "last_n", "last_n": 1}}
    torch.manual_seed(0)
    plain = build_adapter(config)
    torch.manual_seed(0)
    checkpointed = build_adapter({**config, "gradient_checkpointing": True})
    checkpointed.load_state_dict(plain.state_dict())
    inputs = example_inputs("torchvision_video", 3)
    grads, _ = _step(plain, inputs)
    grads_ckpt, _ = _step(checkpointed, inputs)
    last = {n for n, p in plain.named_parameters() if p.requires_grad and n.startswith("backbone.layer4.")}
    assert last and last <= set(grads) and set(grads_ckpt) == set(grads)
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
