"""The ``mlp`` adapter (the network of the poly-view synthetic 1-D Gaussian setting)."""

from __future__ import annotations

import pytest
import torch

from mmviews.modalities import Adapter, MLPAdapter, build_adapter

CONFIG = {"type": "mlp", "input_dim": 2, "hidden_dim": 8, "embed_dim": 4, "head": {"kind": "linear"}}


def test_first_step_through_linear_gelu_then_head_to_unit_vectors():
    torch.manual_seed(0)
    adapter = build_adapter(CONFIG).eval()
    assert isinstance(adapter, MLPAdapter) and adapter.feature_dim == 8
    values = torch.randn(5, 3, 2)
    z = adapter({"values": values})
    assert z.shape == (5, 4)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(5))
    lin, head = adapter.backbone[0], adapter.head.net
    expected = torch.nn.functional.normalize(head(torch.nn.functional.gelu(lin(values[:, 0]))), dim=-1)
    torch.testing.assert_close(z, expected)
    other = values.clone()
    other[:, 1:] = 100.0  # later steps are ignored
    torch.testing.assert_close(adapter({"values": other}), z)


def test_save_and_load_give_the_same_embeddings(tmp_path):
    adapter = build_adapter(dict(CONFIG, activation="relu")).eval()
    values = torch.randn(4, 1, 2)
    adapter.save_pretrained(tmp_path / "mlp")
    loaded = Adapter.from_pretrained(tmp_path / "mlp").eval()
    assert isinstance(loaded, MLPAdapter) and loaded.config == adapter.config
    torch.testing.assert_close(loaded({"values": values}), adapter({"values": values}))


def test_bad_configs_and_inputs_are_rejected():
    with pytest.raises(ValueError, match="activation must be one of"):
        build_adapter(dict(CONFIG, activation="tanh"))
    with pytest.raises(ValueError, match="hidden_dim must be >= 1"):
        build_adapter(dict(CONFIG, hidden_dim=0))
    adapter = build_adapter(CONFIG)
    with pytest.raises(ValueError, match=r"values must be \[B, L, 2\]"):
        adapter({"values": torch.randn(4, 1, 3)})
    with pytest.raises(ValueError, match="no key 'values'"):
        adapter({"x": torch.randn(4, 1, 2)})


def test_num_layers_stacks_hidden_layers_of_the_chosen_activation():
    torch.manual_seed(0)
    adapter = build_adapter(dict(CONFIG, num_layers=3, activation="leaky_relu")).eval()
    linears = [m for m in adapter.backbone if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(8, 2), (8, 8), (8, 8)]
    values = torch.randn(5, 1, 2)
    h = values[:, 0]
    for lin in linears:
        h = torch.nn.functional.leaky_relu(lin(h), 0.01)
    torch.testing.assert_close(adapter({"values": values}),
                               torch.nn.functional.normalize(adapter.head.net(h), dim=-1))
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        build_adapter(dict(CONFIG, num_layers=0))
