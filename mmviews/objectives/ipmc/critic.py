"""IPMC's distribution tier (eqs. 2, 4): Wasserstein critics between the views' embedding
distributions, trained with the WGAN-GP gradient penalty, and the distribution loss ``L_DA``.

Shapes: ``u`` ``[K, M, d]`` unit vectors; ``P = M (M - 1) / 2`` unordered view pairs a < b,
one critic head each.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import _distributed as distributed


class WassersteinCritic(nn.Module):
    """One MLP critic per unordered view pair (four linear layers, three ReLUs, as in the
    paper's appendix), evaluated for all pairs at once with batched weights ``[P, in, out]``.

    State (``state_dict`` keys): ``weights.0-3`` ``[P, in, out]`` and ``biases.0-3`` ``[P, 1, out]``.
    """

    def __init__(self, num_views: int, dim: int, hidden: int = 256) -> None:
        super().__init__()
        if num_views < 2 or dim < 1 or hidden < 1:
            raise ValueError(f"WassersteinCritic needs num_views >= 2, dim >= 1, hidden >= 1; got {num_views}, {dim}, {hidden}")
        pairs = torch.triu_indices(num_views, num_views, offset=1)
        self.register_buffer("pair_a", pairs[0].clone(), persistent=False)
        self.register_buffer("pair_b", pairs[1].clone(), persistent=False)
        P = pairs.shape[1]
        sizes = [dim, hidden, hidden, hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default initialisation
            self.weights.append(nn.Parameter(torch.empty(P, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(P, 1, fan_out).uniform_(-bound, bound)))

    @property
    def num_pairs(self) -> int:
        return self.pair_a.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[P, B, d]`` -> critic values ``[P, B]`` (head p applied to ``x[p]``)."""
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if layer < len(self.weights) - 1:
                x = torch.relu(x)
        return x.squeeze(-1)

    def pair_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``u`` ``[K, M, d]`` -> ``(u_a, u_b)``, each ``[P, K, d]``, for the pairs a < b."""
        return u[:, self.pair_a].transpose(0, 1), u[:, self.pair_b].transpose(0, 1)

    def distances(self, u: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``[P]`` estimates ``W_ab = critic_ab(u_a).mean() - critic_ab(u_b).mean()``."""
        u_a, u_b = self.pair_inputs(u)
        both = torch.cat([u_a, u_b], dim=1)
        values = self(both) if params is None else torch.func.functional_call(self, params, (both,))
        return values[:, : u.shape[0]].mean(dim=1) - values[:, u.shape[0] :].mean(dim=1)

    def gradient_penalty(self, u_a: torch.Tensor, u_b: torch.Tensor) -> torch.Tensor:
        """``[P]`` WGAN-GP penalty ``E (||grad critic(x_hat)|| - 1)^2`` on random interpolates."""
        shuffled = u_b[:, torch.randperm(u_b.shape[1], device=u_b.device)]
        eps = torch.rand(u_a.shape[0], u_a.shape[1], 1, device=u_a.device, dtype=u_a.dtype)
        x_hat = (eps * u_a + (1 - eps) * shuffled).requires_grad_(True)
        (grad,) = torch.autograd.grad(self(x_hat).sum(), x_hat, create_graph=True)
        return ((grad.norm(dim=-1) - 1.0) ** 2).mean(dim=1)


def make_critic_optimizer(critic: WassersteinCritic, lr: float) -> torch.optim.Optimizer:
    """Adam with WGAN-GP's settings (Gulrajani et al., 2017: betas (0, 0.9))."""
    return torch.optim.Adam(critic.parameters(), lr=lr, betas=(0.0, 0.9))


def train_critic(
    critic: WassersteinCritic, optimizer: torch.optim.Optimizer, u: torch.Tensor, steps: int, gp_weight: float
) -> dict[str, torch.Tensor]:
    """``steps`` optimiser steps maximising ``sum_p W_p - gp_weight * penalty_p`` on the detached
    unit vectors ``u`` ``[K, M, d]``; returns ``critic_distance`` (sum of the W estimates) and
    ``gradient_penalty`` (mean penalty) of the last step.

    Under torch.distributed the critic's gradients are averaged over ranks before each step,
    so the replicas' critics stay identical."""
    u = u.to(critic.weights[0].dtype)
    with torch.enable_grad(), torch.autocast(device_type=u.device.type, enabled=False):
        for _ in range(steps):
            u_a, u_b = critic.pair_inputs(u)
            distance = critic.distances(u)
            penalty = critic.gradient_penalty(u_a, u_b)
            cost = (-distance + gp_weight * penalty).sum()
            optimizer.zero_grad(set_to_none=True)
            cost.backward()
            for parameter in critic.parameters():
                distributed.average_(parameter.grad)
            optimizer.step()
        # leave no gradient behind for another optimiser that might hold these parameters
        optimizer.zero_grad(set_to_none=True)
    return {"critic_distance": distance.detach().sum(), "gradient_penalty": penalty.detach().mean()}


def distribution_loss(critic: WassersteinCritic, u: torch.Tensor) -> torch.Tensor:
    """``L_DA`` = twice the sum over pairs a < b of the critics' W_ab estimates on ``u``
    ``[K, M, d]`` (the sum over ordered pairs, W_ab = W_ba), with the critic's parameters
    detached: the gradient flows into ``u`` only, never into the critic."""
    params = {name: p.detach().to(u.dtype) for name, p in critic.named_parameters()}
    return 2.0 * critic.distances(u, params).sum()
