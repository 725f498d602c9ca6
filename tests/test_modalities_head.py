"""The projection head (``mmviews.modalities.head.ProjectionHead``): a ``linear`` head is one
Linear; an ``mlp`` head is ``num_layers - 1`` blocks of Linear (no bias under BatchNorm, whose
shift replaces it), BatchNorm, the activation and dropout when asked, then a last Linear with
neither norm nor activation; the hidden width defaults to the wider of input and output; a bad
kind, activation or depth is one line naming the key and the value."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmviews.modalities.config import HeadConfig
from mmviews.modalities.head import ProjectionHead


def _layers(head: ProjectionHead) -> list[str]:
    """The head's layers as ``Linear(in,out,bias)`` / class names, in order."""
    out = []
    for m in head.net if isinstance(head.net, nn.Sequential) else [head.net]:
        if isinstance(m, nn.Linear):
            out.append(f"Linear({m.in_features},{m.out_features},{m.bias is not None})")
        elif isinstance(m, nn.Dropout):
            out.append(f"Dropout({m.p})")
        else:
            out.append(type(m).__name__)
    return out


def test_a_linear_head_is_one_linear_layer():
    head = ProjectionHead(6, 3, HeadConfig(kind="linear"))
    assert _layers(head) == ["Linear(6,3,True)"]
    x = torch.randn(4, 6)
    assert torch.equal(head(x), head.net(x)) and head(x).shape == (4, 3)


def test_the_default_head_is_two_layers_with_batch_norm_and_relu_as_wide_as_the_wider_side():
    assert _layers(ProjectionHead(6, 3, HeadConfig())) == ["Linear(6,6,False)", "BatchNorm1d", "ReLU", "Linear(6,3,True)"]
    assert _layers(ProjectionHead(3, 8, HeadConfig())) == ["Linear(3,8,False)", "BatchNorm1d", "ReLU", "Linear(8,8,True)"]


def test_each_hidden_block_has_its_norm_activation_and_dropout():
    head = ProjectionHead(5, 2, HeadConfig(hidden_dim=7, num_layers=3, activation="gelu", dropout=0.25))
    assert _layers(head) == ["Linear(5,7,False)", "BatchNorm1d", "GELU", "Dropout(0.25)",
                             "Linear(7,7,False)", "BatchNorm1d", "GELU", "Dropout(0.25)", "Linear(7,2,True)"]
    plain = ProjectionHead(5, 2, HeadConfig(hidden_dim=4, batch_norm=False, dropout=0.0))
    assert _layers(plain) == ["Linear(5,4,True)", "ReLU", "Linear(4,2,True)"]


def test_the_mlp_head_computes_linear_norm_activation_linear():
    torch.manual_seed(0)
    head = ProjectionHead(4, 3, HeadConfig(hidden_dim=5, activation="gelu")).eval()
    first, norm, _, last = head.net
    x = torch.randn(6, 4)
    reference = last(nn.functional.gelu(norm(x @ first.weight.T)))
    assert torch.allclose(head(x), reference, atol=1e-6)


@pytest.mark.parametrize(("config", "message"), [
    (HeadConfig(kind="transformer"), "head.kind must be 'linear' or 'mlp', got 'transformer'"),
    (HeadConfig(num_layers=1), "head.num_layers must be >= 2 for an MLP head, got 1"),
    (HeadConfig(activation="tanh"), "head.activation must be one of ['gelu', 'relu'], got 'tanh'"),
])
def test_a_bad_head_is_refused_by_key_and_value(config, message):
    with pytest.raises(ValueError) as caught:
        ProjectionHead(4, 2, config)
    assert str(caught.value) == message
