"""``mmviews demo``: a one-minute sanity check of the objectives.

Trains a small MLP encoder with a multi-view loss on synthetic views: each sample has a
hidden factor c ~ N(0, I); view a is ``A_a c + noise`` with its own random mixing A_a.
The loss falls and the mutual-information lower bound (poly-view objectives) rises.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from mmviews.objectives import get_objective, list_objectives, mi_lower_bound, objective_class


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objective", default="geometric_pvc", choices=list_objectives())
    parser.add_argument("--views", type=int, default=None,
                        help="views per sample M (default: 4, or the number an objective is defined for, e.g. 2 for simclr)")
    parser.add_argument("--batch", type=int, default=128, help="samples per batch (K)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)


def synthetic_views(num_samples: int, mixings: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[K, M, input_dim]: M noisy linear views of a shared 8-dimensional factor."""
    factors = torch.randn(num_samples, mixings.shape[1], generator=generator)
    views = torch.einsum("mfi,kf->kmi", mixings, factors)
    return views + 0.3 * torch.randn(views.shape, generator=generator)


def run(args: argparse.Namespace) -> int:
    if args.views is None:
        args.views = objective_class(args.objective).exact_views or 4
    generator = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    input_dim, factor_dim = 32, 8
    mixings = torch.randn(args.views, factor_dim, input_dim, generator=generator) / factor_dim**0.5
    encoder = nn.Sequential(nn.Linear(input_dim, 128), nn.GELU(), nn.Linear(128, 32))
    params = {"temperature": args.temperature} if args.objective not in ("er",) else {}
    objective = get_objective(args.objective, **params)
    optimiser = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
    print(f"demo: {args.objective}, K = {args.batch}, M = {args.views}, {args.steps} steps")
    for step in range(1, args.steps + 1):
        z = encoder(synthetic_views(args.batch, mixings, generator))
        loss = objective(z)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step == 1 or step % max(1, args.steps // 10) == 0:
            line = f"step {step:5d}  loss {loss.item():.4f}"
            if args.objective in ("geometric_pvc", "arithmetic_pvc", "sufficient_statistics", "simclr"):
                line += f"  MI lower bound {mi_lower_bound(loss.item(), args.batch, args.views):.3f} nats"
            print(line, flush=True)
    return 0
