"""The projection head an adapter puts on its backbone's features."""

from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig


class ProjectionHead(nn.Module):
    """Linear or MLP projection ``[N, in_dim] -> [N, out_dim]`` (not normalised)."""

    def __init__(self, in_dim: int, out_dim: int, config: HeadConfig) -> None:
        super().__init__()
        if config.kind == "linear":
            self.net: nn.Module = nn.Linear(in_dim, out_dim)
        elif config.kind == "mlp":
            if config.num_layers < 2:
                raise ValueError(f"head.num_layers must be >= 2 for an MLP head, got {config.num_layers}")
            hidden = config.hidden_dim or max(in_dim, out_dim)
            acts = {"relu": nn.ReLU, "gelu": nn.GELU}
            if config.activation not in acts:
                raise ValueError(f"head.activation must be one of {sorted(acts)}, got {config.activation!r}")
            layers: list[nn.Module] = []
            dim = in_dim
            for _ in range(config.num_layers - 1):
                # BatchNorm's shift makes the Linear bias redundant.
                layers.append(nn.Linear(dim, hidden, bias=not config.batch_norm))
                if config.batch_norm:
                    layers.append(nn.BatchNorm1d(hidden))
                layers.append(acts[config.activation]())
                if config.dropout > 0:
                    layers.append(nn.Dropout(config.dropout))
                dim = hidden
            layers.append(nn.Linear(dim, out_dim))
            self.net = nn.Sequential(*layers)
        else:
            raise ValueError(f"head.kind must be 'linear' or 'mlp', got {config.kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
