#!/usr/bin/env python
"""Poly-view contrastive learning, synthetic 1-D Gaussian (Shidani et al., ICLR 2024, section 3.1, Figure 2).

Setting: ``c_i ~ N(0, sigma0^2)`` for ``i in [K]``, ``M`` views ``x_{i,a} ~ N(c_i, sigma^2)``.
An MLP ``1 -> 32 (GELU) -> 32`` is trained with each objective (AdamW, lr 5e-4, wd 5e-3);
the objective's lower bound on the one-vs-rest MI, evaluated on fresh held-out batches
after training, is compared with the closed form (paper eq. 26)

    I(x_a; x_{-a}) = 1/2 log[(1 + sigma0^2/sigma^2) (1 - sigma0^2 / (sigma^2 + M sigma0^2))].

Bounds (nats), with ``L`` the mean held-out loss:

- ``arithmetic_pvc``, ``geometric_pvc``, ``sufficient_statistics``: ``c(K, M) - L`` with
  ``c(K, M) = log((K - 1) M + 1)`` (``mmviews.objectives.mi_lower_bound``; paper Theorem 2.3:
  each anchor has one positive and (K - 1) M negatives).
- ``multi_crop``: ``log(2K - 1) - L`` (paper Proposition 2.1: Multi-Crop is a mean of pairwise
  InfoNCE terms, each with 2K - 1 candidates, so its bound keeps the M = 2 constant).

Two regimes are run:

- ``cap`` (default headline): K = 16, where the InfoNCE cap ``log(2K - 1)`` is about the size of
  the MI, so raising the cap with M (poly-view) visibly closes the gap while Multi-Crop's does not.
- ``large``: a larger batch (K = 64 in ``--quick``, K = 1024 in ``--full`` as in the paper), where
  the cap does not bind; there the gap of every objective grows with M, because a cosine critic's
  per-pair score cannot exceed the pairwise MI I(x_a; x_b) while the one-vs-rest MI grows with M.

Runs are vectorised over objectives and seeds: one grouped MLP holds G = objectives x seeds
independent networks; the summed loss gives each network exactly its own gradient, and AdamW
is element-wise, so this is the same as G separate trainings (and much faster on a CPU).

Usage::

    python recipes/reproduce/polyview_gaussian.py            # --quick (default), < 15 min on 2 CPU cores
    python recipes/reproduce/polyview_gaussian.py --full     # paper size (K = 1024, M in {2,4,8,10}, 16 seeds): hours
    python recipes/reproduce/polyview_gaussian.py --smoke    # a few steps, for tests

Writes to ``--out`` (default ``runs/reproduce/polyview_gaussian/`` under the current directory;
``--update-shipped`` regenerates the shipped ``recipes/reproduce/results/polyview_gaussian``): ``runs.csv`` (one row
per regime/objective/M/seed), ``summary.csv`` and ``summary.json`` (mean and std over seeds) and
``mi_gap.png`` (bands: mean +- std over seeds). Each finished (regime, M) piece is kept in
``OUT/cache/`` and reused by a later run with identical settings, so a long run can be split
(``--regimes large --Ms 8``) or resumed; ``--no-cache`` retrains everything.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmviews.fileio import atomic_write_bytes
from mmviews.objectives import get_objective, mi_lower_bound

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

OBJECTIVES: tuple[str, ...] = ("multi_crop", "arithmetic_pvc", "geometric_pvc", "sufficient_statistics")
FIGURE_CITATION = "cf. Shidani et al., Poly-View Contrastive Learning (ICLR 2024), Fig. 2"


# ---- closed forms ------------------------------------------------------------------------------
def one_vs_rest_mi(M: int, sigma0: float, sigma: float) -> float:
    """I(x_a; x_{-a}) in nats for M Gaussian views of one Gaussian latent (paper eq. 26).

    Derivation: the views are jointly Gaussian with covariance sigma^2 I + sigma0^2 11^T, whose
    determinant is sigma^{2(M-1)} (sigma^2 + M sigma0^2); I = 1/2 log(det S_1 det S_{M-1} / det S_M).
    """
    if M < 2:
        raise ValueError(f"one-vs-rest MI needs M >= 2 views, got M = {M}")
    if not (sigma0 > 0 and sigma > 0):
        raise ValueError(f"sigma0 and sigma must be > 0, got sigma0 = {sigma0}, sigma = {sigma}")
    s0, s = sigma0**2, sigma**2
    return 0.5 * math.log((1.0 + s0 / s) * (1.0 - s0 / (s + M * s0)))


def bound_constant(objective: str, K: int, M: int) -> float:
    """The constant c such that c - L lower-bounds the one-vs-rest MI for this objective."""
    if objective == "multi_crop":
        return math.log(2 * K - 1)  # Proposition 2.1: pairwise InfoNCE with 2K - 1 candidates
    return float(mi_lower_bound(0.0, K, M))  # log((K - 1) M + 1), Theorem 2.3


# ---- data and model ----------------------------------------------------------------------------
def sample_views(generator: torch.Generator, seeds: int, K: int, M: int, sigma0: float, sigma: float) -> torch.Tensor:
    """[seeds, K, M, 1]: per seed, K latents c ~ N(0, sigma0^2) and M views N(c, sigma^2) of each."""
    c = sigma0 * torch.randn(seeds, K, 1, 1, generator=generator)
    return c + sigma * torch.randn(seeds, K, M, 1, generator=generator)


class GroupedMLP(nn.Module):
    """G independent MLPs 1 -> hidden (GELU) -> out, evaluated as batched matmuls.

    Input ``[G, K, M, 1]``, output ``[G, K, M, out]``. Network g is initialised like a pair of
    ``nn.Linear`` layers (uniform +-1/sqrt(fan_in)) from ``init_seeds[g]``.
    """

    def __init__(self, init_seeds: list[int], hidden: int = 32, out: int = 32) -> None:
        super().__init__()
        G = len(init_seeds)
        w1, b1, w2, b2 = (torch.empty(G, 1, hidden), torch.empty(G, 1, hidden), torch.empty(G, hidden, out), torch.empty(G, 1, out))
        for g, seed in enumerate(init_seeds):
            gen = torch.Generator().manual_seed(int(seed))
            w1[g].uniform_(-1.0, 1.0, generator=gen)  # fan_in = 1
            b1[g].uniform_(-1.0, 1.0, generator=gen)
            bound = 1.0 / math.sqrt(hidden)
            w2[g].uniform_(-bound, bound, generator=gen)
            b2[g].uniform_(-bound, bound, generator=gen)
        self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(t) for t in (w1, b1, w2, b2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        G, K, M, _ = x.shape
        h = F.gelu(torch.baddbmm(self.b1, x.reshape(G, K * M, 1), self.w1))
        return torch.baddbmm(self.b2, h, self.w2).reshape(G, K, M, -1)


# ---- experiment ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Regime:
    name: str
    K: int
    Ms: tuple[int, ...]
    seeds: int
    steps: int
    eval_batches: int
    sigma0: float = 1.0
    sigma: float = 0.03
    temperature: float = 0.03
    lr: float = 5e-4
    weight_decay: float = 5e-3


def regimes_for(size: str) -> dict[str, Regime]:
    """The two regimes at a named size: smoke (tests), quick (default) or full (paper)."""
    if size == "smoke":
        return {"cap": Regime("cap", K=8, Ms=(2, 3), seeds=2, steps=4, eval_batches=2),
                "large": Regime("large", K=12, Ms=(2, 3), seeds=2, steps=4, eval_batches=2)}
    if size == "quick":
        return {"cap": Regime("cap", K=16, Ms=(2, 4, 8), seeds=4, steps=3000, eval_batches=200),
                "large": Regime("large", K=64, Ms=(2, 4, 8), seeds=3, steps=1500, eval_batches=50)}
    if size == "full":
        return {"cap": Regime("cap", K=16, Ms=(2, 4, 8, 10), seeds=16, steps=3000, eval_batches=400),
                "large": Regime("large", K=1024, Ms=(2, 4, 8, 10), seeds=16, steps=3000, eval_batches=20)}
    raise ValueError(f"unknown size {size!r}; expected smoke, quick or full")


def run_multiplicity(regime: Regime, M: int, objectives: tuple[str, ...], progress: bool = True) -> list[dict]:
    """Train every (objective, seed) network at multiplicity M together; one row per network."""
    from tqdm.auto import tqdm

    S, K = regime.seeds, regime.K
    losses = [get_objective(name, temperature=regime.temperature) for name in objectives]
    # Same initial weights and same data for every objective at a given seed (common random numbers).
    model = GroupedMLP([1000 * M + s for s in range(S)] * len(objectives))
    optimiser = torch.optim.AdamW(model.parameters(), lr=regime.lr, weight_decay=regime.weight_decay, foreach=True)
    train_gen = torch.Generator().manual_seed(10_000 + M)
    for _ in tqdm(range(regime.steps), desc=f"{regime.name} K={K} M={M}", disable=not progress, leave=False):
        x = sample_views(train_gen, S, K, M, regime.sigma0, regime.sigma)
        z = model(x.repeat(len(objectives), 1, 1, 1))  # [G, K, M, 32], g = objective * S + seed
        total = sum(losses[g // S](z[g]) for g in range(z.shape[0]))
        optimiser.zero_grad(set_to_none=True)
        total.backward()
        optimiser.step()

    # Held-out evaluation: fresh batches from a generator never used in training.
    eval_gen = torch.Generator().manual_seed(20_000_000 + M)
    sums = torch.zeros(len(objectives) * S, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(regime.eval_batches):
            x = sample_views(eval_gen, S, K, M, regime.sigma0, regime.sigma)
            z = model(x.repeat(len(objectives), 1, 1, 1))
            sums += torch.stack([losses[g // S](z[g]) for g in range(z.shape[0])]).double()
    mean_loss = (sums / regime.eval_batches).tolist()

    true_mi = one_vs_rest_mi(M, regime.sigma0, regime.sigma)
    rows = []
    for g, loss in enumerate(mean_loss):
        if not math.isfinite(loss):
            raise RuntimeError(f"{regime.name}: non-finite held-out loss for {objectives[g // S]}, M = {M}, seed {g % S}")
        name = objectives[g // S]
        constant = bound_constant(name, K, M)
        rows.append({
            "regime": regime.name, "K": K, "objective": name, "M": M, "seed": g % S,
            "loss": loss, "cap": constant, "bound": constant - loss, "true_mi": true_mi,
            "gap": true_mi - (constant - loss),
            "pairwise_mi": one_vs_rest_mi(2, regime.sigma0, regime.sigma),
        })
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Mean and (population) std over seeds of the bound and gap, per regime/objective/M; the
    std of one seed is nan (unknown; printed ``-``)."""
    keys = sorted({(r["regime"], r["objective"], r["M"]) for r in rows}, key=lambda k: (k[0], OBJECTIVES.index(k[1]) if k[1] in OBJECTIVES else 99, k[2]))
    out = []
    for regime, objective, M in keys:
        group = [r for r in rows if (r["regime"], r["objective"], r["M"]) == (regime, objective, M)]
        entry = {"regime": regime, "K": group[0]["K"], "objective": objective, "M": M, "seeds": len(group),
                 "true_mi": group[0]["true_mi"], "cap": group[0]["cap"]}
        for field in ("loss", "bound", "gap"):
            values = torch.tensor([r[field] for r in group], dtype=torch.float64)
            entry[f"{field}_mean"] = values.mean().item()
            entry[f"{field}_std"] = values.std(unbiased=False).item() if len(group) > 1 else math.nan
        out.append(entry)
    return out


def cache_path(out: Path, regime: Regime, M: int, objectives: tuple[str, ...]) -> Path:
    """Where the rows of one (regime, M) piece are kept; the name hashes every setting that affects them."""
    import hashlib

    settings = {**asdict(regime), "Ms": None, "M": M, "objectives": list(objectives), "version": 1}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return out / "cache" / f"{regime.name}_K{regime.K}_M{M}_{digest}.json"


# ---- output ----------------------------------------------------------------------------------------
def write_csv(path: Path, rows: list[dict]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_bytes(path, buffer.getvalue().encode())


def plot(summary: list[dict], regimes: list[Regime], path: Path) -> None:
    """Per regime: bounds vs the true MI (left) and the MI gap (right), mean +- std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"multi_crop": "tab:red", "arithmetic_pvc": "tab:green", "geometric_pvc": "tab:blue", "sufficient_statistics": "tab:orange"}
    fig, axes = plt.subplots(len(regimes), 2, figsize=(11, 3.8 * len(regimes)), squeeze=False)
    for row, regime in enumerate(regimes):
        ax_bound, ax_gap = axes[row]
        entries = [e for e in summary if e["regime"] == regime.name]
        Ms = sorted({e["M"] for e in entries})
        ax_bound.plot(Ms, [one_vs_rest_mi(M, regime.sigma0, regime.sigma) for M in Ms], "k-", lw=2, label="true one-vs-rest MI (eq. 26)")
        for name in OBJECTIVES:
            sel = sorted((e for e in entries if e["objective"] == name), key=lambda e: e["M"])
            if not sel:
                continue
            xs = [e["M"] for e in sel]
            for ax, field in ((ax_bound, "bound"), (ax_gap, "gap")):
                mean = torch.tensor([e[f"{field}_mean"] for e in sel])
                std = torch.tensor([e[f"{field}_std"] for e in sel])
                ax.plot(xs, mean, "o-", color=colours[name], label=name)
                ax.fill_between(xs, mean - std, mean + std, color=colours[name], alpha=0.2)
        ax_bound.plot(Ms, [math.log(2 * regime.K - 1)] * len(Ms), ":", color="tab:red", label="cap log(2K-1)")
        ax_bound.plot(Ms, [math.log((regime.K - 1) * M + 1) for M in Ms], ":", color="tab:blue", label="cap log((K-1)M+1)")
        ax_bound.set_ylim(top=max(one_vs_rest_mi(max(Ms), regime.sigma0, regime.sigma), math.log(2 * regime.K - 1)) + 0.6)
        setting = f"{regime.name}: K={regime.K}, sigma0={regime.sigma0}, sigma={regime.sigma}, tau={regime.temperature}, {regime.steps} steps, {regime.seeds} seeds"
        ax_bound.set_title(f"lower bound vs true MI ({setting})", fontsize=8)
        ax_gap.set_title(f"MI gap = true MI - bound ({regime.name}, K={regime.K})", fontsize=9)
        for ax in (ax_bound, ax_gap):
            ax.set_xlabel("view multiplicity M")
            ax.set_xticks(Ms)
            ax.grid(alpha=0.3)
        ax_bound.set_ylabel("nats")
        ax_gap.set_ylabel("nats")
        ax_bound.legend(fontsize=7)
        ax_gap.legend(fontsize=7)
    fig.suptitle(f"Synthetic 1-D Gaussian: MI gap vs M ({FIGURE_CITATION}); bands = mean +- std over seeds", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick", help="CPU size, < 15 min on 2 cores (default)")
    size.add_argument("--full", dest="size", action="store_const", const="full", help="the paper's size (K = 1024, M in {2,4,8,10}, 16 seeds)")
    size.add_argument("--smoke", dest="size", action="store_const", const="smoke", help="a few steps on tiny batches (tests)")
    parser.set_defaults(size="quick")
    parser.add_argument("--regimes", default="cap,large", help="comma-separated subset of cap,large (default both)")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated objective names")
    parser.add_argument("--Ms", default=None, help="override the multiplicities, e.g. 2,4,8,10")
    parser.add_argument("--seeds", type=int, default=None, help="override the number of seeds")
    parser.add_argument("--steps", type=int, default=None, help="override the training steps")
    parser.add_argument("--batch-size", type=int, default=None, help="override K of the large regime")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    C.add_output_arguments(parser, "polyview_gaussian")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--no-cache", action="store_true",
                        help="retrain every piece; by default each finished (regime, M) is kept in OUT/cache and "
                             "reused by a later run with the same settings, so a run can be split or resumed")
    args = parser.parse_args(argv)
    args.out = C.output_dir(parser, args, "polyview_gaussian")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    available = regimes_for(args.size)
    names = [n.strip() for n in args.regimes.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise ValueError(f"--regimes: unknown {unknown or names}; expected a subset of {sorted(available)}")
    objectives = tuple(n.strip() for n in args.objectives.split(",") if n.strip())
    bad = [n for n in objectives if n not in OBJECTIVES]
    if bad or not objectives:
        raise ValueError(f"--objectives: {bad or objectives} not in {OBJECTIVES}")
    regimes = []
    for name in names:
        regime = available[name]
        if args.Ms:
            Ms = tuple(int(m) for m in args.Ms.split(","))
            if any(m < 2 for m in Ms):
                raise ValueError(f"--Ms: every multiplicity must be >= 2, got {Ms}")
            regime = replace(regime, Ms=Ms)
        if args.seeds is not None:
            regime = replace(regime, seeds=max(1, args.seeds))
        if args.steps is not None:
            regime = replace(regime, steps=max(0, args.steps))
        if args.batch_size is not None and name == "large":
            regime = replace(regime, K=args.batch_size)
        regimes.append(regime)

    start = time.perf_counter()
    rows: list[dict] = []
    compute_seconds = 0.0
    for regime in regimes:
        for M in regime.Ms:
            cache = None if args.no_cache else cache_path(args.out, regime, M, objectives)
            if cache is not None and cache.exists():
                piece = json.loads(cache.read_text())
                print(f"[{regime.name}] K={regime.K} M={M}: reused {cache.name} ({piece['seconds']:.1f}s when run)", file=sys.stderr)
            else:
                t0 = time.perf_counter()
                piece = {"rows": run_multiplicity(regime, M, objectives, progress=not args.no_progress),
                         "seconds": time.perf_counter() - t0}
                print(f"[{regime.name}] K={regime.K} M={M}: {piece['seconds']:.1f}s", file=sys.stderr)
                if cache is not None:
                    atomic_write_bytes(cache, json.dumps(piece).encode())
            rows += piece["rows"]
            compute_seconds += piece["seconds"]
    wall = time.perf_counter() - start
    summary = summarise(rows)

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "runs.csv", rows)
    write_csv(args.out / "summary.csv", summary)
    meta = {"size": args.size, "wall_seconds": wall, "compute_seconds": compute_seconds, "threads": args.threads, "regimes": [asdict(r) for r in regimes],
            "objectives": list(objectives), "figure": FIGURE_CITATION,
            "bounds": "poly-view: log((K-1)M+1) - L (mi_lower_bound); multi_crop: log(2K-1) - L (Proposition 2.1)",
            "summary": summary}
    atomic_write_bytes(args.out / "summary.json", (json.dumps(meta, indent=2) + "\n").encode())
    plot(summary, regimes, args.out / "mi_gap.png")

    def spread(std: float) -> str:
        return "    -" if math.isnan(std) else f"{std:5.3f}"  # one seed: unknown, not 0

    print(f"{'regime':6} {'K':>5} {'objective':22} {'M':>3} {'true MI':>8} {'bound':>15} {'gap':>15}")
    for e in summary:
        print(f"{e['regime']:6} {e['K']:5d} {e['objective']:22} {e['M']:3d} {e['true_mi']:8.3f} "
              f"{e['bound_mean']:7.3f} +- {spread(e['bound_std'])} {e['gap_mean']:7.3f} +- {spread(e['gap_std'])}")
    print(f"wall time {wall:.0f}s (training + evaluation, cached pieces included: {compute_seconds:.0f}s); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
