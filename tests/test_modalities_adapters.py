"""The adapter contract, checked on every adapter type with tiny random-weight configs."""

from __future__ import annotations

import json

import pytest
import torch

from mmviews.modalities import Adapter, ProjectionHead, HeadConfig, build_adapter
from mmviews.modalities.presets import ADAPTER_TYPES, example_inputs, tiny_config

KINDS = list(ADAPTER_TYPES)


def _grad_norms(params) -> list[float]:
    return [0.0 if p.grad is None else float(p.grad.abs().sum()) for p in params]


def _loss(z: torch.Tensor) -> torch.Tensor:
    target = torch.randn(z.shape, generator=torch.Generator().manual_seed(1))
    return (z * target).sum()


@pytest.mark.parametrize("kind", KINDS)
def test_shape_unit_norm_and_gradients_full(kind: str) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config(kind))
    adapter.train()
    z = adapter(example_inputs(kind, 4))
    assert z.shape == (4, 16)
    assert torch.allclose(z.norm(dim=-1), torch.ones(4), atol=1e-5)
    _loss(z).backward()
    assert all(g > 0 for g in _grad_norms(adapter.head.parameters())), "every head parameter gets a gradient"
    backbone = [p for p in adapter.backbone.parameters() if p.requires_grad]
    assert backbone and sum(_grad_norms(backbone)) > 0, "gradients reach the unfrozen backbone"


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_backbone_gets_no_gradient(kind: str) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config(kind, finetune={"mode": "frozen"}))
    adapter.train()
    assert adapter.backbone_frozen
    assert not adapter.backbone.training, "a frozen backbone stays in eval mode"
    z = adapter(example_inputs(kind, 4))
    _loss(z).backward()
    assert all(p.grad is None for p in adapter.backbone.parameters())
    assert all(g > 0 for g in _grad_norms(adapter.head.parameters()))
    names = [g["name"] for g in adapter.param_groups(1e-5, 1e-3, 0.05)]
    assert names and all(n.startswith("head") for n in names)


@pytest.mark.parametrize("kind", KINDS)
def test_last_n_trains_only_the_last_blocks(kind: str) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config(kind, finetune={"mode": "last_n", "last_n": 1}))
    blocks = adapter.backbone_blocks()
    assert len(blocks) >= 2
    adapter.train()
    _loss(adapter(example_inputs(kind, 4))).backward()
    assert sum(_grad_norms(blocks[-1].parameters())) > 0
    assert all(p.grad is None for p in blocks[0].parameters())
    with pytest.raises(ValueError, match="last_n"):
        build_adapter(tiny_config(kind, finetune={"mode": "last_n", "last_n": len(blocks) + 1}))


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(kind: str, tmp_path) -> None:
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config(kind, head={"kind": "mlp", "hidden_dim": 24, "num_layers": 3}))
    inputs = example_inputs(kind, 3)
    adapter.train()
    adapter(inputs)  # moves BatchNorm running statistics away from their initial values
    adapter.eval()
    before = adapter(inputs)
    adapter.save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["type"] == kind and saved["head"]["num_layers"] == 3
    loaded = Adapter.from_pretrained(tmp_path / "a").eval()
    assert type(loaded) is type(adapter)
    assert torch.allclose(loaded(inputs), before, atol=1e-6)
    assert not list(tmp_path.glob("a/*.tmp")), "no temp files left behind"


def test_param_groups_learning_rates_and_decay() -> None:
    adapter = build_adapter(tiny_config("feature_sequence"))
    groups = {g["name"]: g for g in adapter.param_groups(backbone_lr=1e-5, head_lr=1e-3, weight_decay=0.1)}
    assert set(groups) == {"backbone", "backbone_no_decay", "head", "head_no_decay"}
    assert groups["backbone"]["lr"] == 1e-5 and groups["head"]["lr"] == 1e-3
    assert groups["head_no_decay"]["weight_decay"] == 0.0 and groups["backbone"]["weight_decay"] == 0.1
    n_grouped = sum(p.numel() for g in groups.values() for p in g["params"])
    assert n_grouped == adapter.num_parameters(trainable_only=True)
    assert all(p.ndim < 2 for p in groups["backbone_no_decay"]["params"])


def test_lora_trains_only_lora_matrices(tmp_path) -> None:
    pytest.importorskip("peft", reason="peft (the optional 'lora' extra) is not installed")
    torch.manual_seed(0)
    adapter = build_adapter(tiny_config("text", finetune={"mode": "frozen", "lora": {"r": 4, "alpha": 8}}))
    trainable = [n for n, p in adapter.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    adapter.train()
    _loss(adapter(example_inputs("text", 4))).backward()
    lora_b = [p for n, p in adapter.backbone.named_parameters() if "lora_B" in n]
    assert sum(_grad_norms(lora_b)) > 0
    with torch.no_grad():
        for p in lora_b:
            p.add_(0.05)  # LoRA B starts at zero: make the adapters matter before the round trip
    adapter.eval()
    inputs = example_inputs("text", 3)
    adapter.save_pretrained(tmp_path / "lora")
    loaded = Adapter.from_pretrained(tmp_path / "lora").eval()
    assert torch.allclose(loaded(inputs), adapter(inputs), atol=1e-6)


def test_head_variants() -> None:
    x = torch.randn(5, 10)
    linear = ProjectionHead(10, 4, HeadConfig(kind="linear"))
    assert isinstance(linear.net, torch.nn.Linear) and linear(x).shape == (5, 4)
    mlp = ProjectionHead(10, 4, HeadConfig(kind="mlp", hidden_dim=7, num_layers=3, batch_norm=False))
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(10, 7), (7, 7), (7, 4)]
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in mlp.modules())
    with pytest.raises(ValueError, match="head.kind"):
        ProjectionHead(10, 4, HeadConfig(kind="transformer"))


def test_config_errors_are_clear(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown adapter type"):
        build_adapter({"type": "smell"})
    with pytest.raises(ValueError, match="unknown key"):
        build_adapter(tiny_config("small_cnn", kernel=5))
    # an adapter's keys are checked by the recipe's validator: types and did-you-mean, named by type
    with pytest.raises(ValueError, match=r"^'small_cnn' adapter config: unknown key 'chanels' \(did you mean "
                                         r"'channels'\?\); allowed keys: embed_dim, head, "):
        build_adapter({"type": "small_cnn", "chanels": [8]})
    with pytest.raises(ValueError, match=r"^'small_cnn' adapter config: key 'head\.num_layers': expected int, "
                                         r"got str 'two'$"):
        build_adapter({"type": "small_cnn", "head": {"num_layers": "two"}})
    with pytest.raises(ValueError, match="finetune.mode"):
        build_adapter(tiny_config("small_cnn", finetune={"mode": "partial"}))
    with pytest.raises(FileNotFoundError, match="config.json"):
        Adapter.from_pretrained(tmp_path / "nothing")
