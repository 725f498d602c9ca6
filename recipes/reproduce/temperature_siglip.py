#!/usr/bin/env python
"""Learned vs fixed temperature, and SigLIP's sigmoid loss against the softmax objectives, as the batch shrinks.

Papers: SigLIP (Zhai et al., ICCV 2023, sec. 4 and Figure 2): the pairwise sigmoid loss, which
needs no normaliser over the batch, is ahead of the softmax (CLIP) loss at small batches
(below about 16k image-text pairs there) and the two meet at large ones; both learn their
temperature (CLIP's ``logit_scale``), SigLIP also a bias, initialised at t = 10 and b = -10.
The question here: does that small-batch advantage carry over to M > 2 views, against the
poly-view objectives that score all M views of a sample together (``geometric_pvc``, Shidani
et al., ICLR 2024; ``mv_dhel``), and does learning the temperature help those?

Here: the embedded synthetic data with quickstart's adapters, M = 3 natural modality views
(audio, image, optical flow) and, as the M = 2 reference (``--Ms 3 2``, the default), audio and
image (the pair of ``er_batch_size.py``). Text is left out: with the text view in, the probe sits
at 0.99-1.00 at every K (a ceiling that hides any batch-size effect, see ``er_batch_size.py``).
Variants (``--variants``): ``geometric_pvc`` and ``mv_dhel`` at the recipes' fixed temperature
0.2, the same learning it (``learn_temperature: true`` from 0.2, the optimiser's learning rate,
no weight decay), and ``siglip`` with the paper's learned scale and bias (t = 10, b = -10);
``siglip_fixed`` keeps SigLIP's t and b fixed. Same learning rate, schedule and number of epochs
for every run (2048 samples, 6 epochs), for batch sizes K in {256, 64, 16} (``--batch-sizes``;
a smaller batch makes more, smaller optimiser steps over the same samples). Linear-probe
accuracy (class, chance 0.25) and effective rank of the mean-of-views embedding on the test
split, 3 seeds; the learned temperature (and bias) at the end of each run.

Usage::

    python recipes/reproduce/temperature_siglip.py            # default: over 75 min on 2 CPU cores (M = 3 half: 75)
    python recipes/reproduce/temperature_siglip.py --Ms 3     # M = 3 only (about 60 % of the time)
    python recipes/reproduce/temperature_siglip.py --batch-sizes 256 64 32 16   # adds K = 32
    python recipes/reproduce/temperature_siglip.py --full     # 4096 samples, 30 epochs, K up to 512
    python recipes/reproduce/temperature_siglip.py --smoke    # seconds (tests)
    python recipes/reproduce/temperature_siglip.py --finished-only --update-shipped   # tables of the runs done

``--finished-only`` trains no objective run: the tables, plot and comparison cover the runs of
the chosen cells (M, variant, K, seed) that already hold a result in the run folder (a sweep
stopped before its end, or run in parts), and ``summary.csv``'s ``seeds`` column says how many
seeds each (variant, K) has; cells without any run are left out.

Writes ``results.csv``/``results.json`` (one row per M, variant, K, seed), ``summary.csv``
(mean +- std over seeds, drop from the largest K), ``commands.txt`` (the equivalent
``mmviews train`` command of every run), ``temperature_siglip.png`` and ``comparison/``
(``mmviews compare``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TITLE = "Learned vs fixed temperature; SigLIP's sigmoid loss vs poly-view softmax objectives as K shrinks"
# The modality views of each M (natural views only; text would put every objective at the ceiling).
MODALITIES = {2: ("audio", "image"), 3: ("audio", "image", "flow")}
SMOKE_MODALITIES = {2: ("image", "flow"), 3: ("audio", "image", "flow")}
TEMPERATURE = 0.2  # the recipes' fixed temperature of the softmax objectives
# SigLIP's own initialisation (the paper's t = 10, b = -10), learned unless "siglip_fixed".
SIGLIP = {"temperature": 0.1, "bias": -10.0}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "geometric_pvc": ("geometric_pvc", {"temperature": TEMPERATURE}),
    "geometric_pvc_learned": ("geometric_pvc", {"temperature": TEMPERATURE, "learn_temperature": True}),
    "mv_dhel": ("mv_dhel", {"temperature": TEMPERATURE}),
    "mv_dhel_learned": ("mv_dhel", {"temperature": TEMPERATURE, "learn_temperature": True}),
    "siglip": ("siglip", SIGLIP),
    "siglip_fixed": ("siglip", {**SIGLIP, "learn_temperature": False, "learn_bias": False}),
}
DEFAULT_VARIANTS = ("geometric_pvc", "geometric_pvc_learned", "mv_dhel", "mv_dhel_learned", "siglip")


def _flow_yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()


def variant_overrides(variant: str) -> list[str]:
    """The recipe overrides of one variant (objective name and params)."""
    name, params = VARIANTS[variant]
    return [f"objective.name={name}", f"objective.params={_flow_yaml(params)}"]


def learned_values(run_dir: str) -> dict[str, float]:
    """The objective's learned values at the end of the run (``results.json``'s
    ``objective_learned``): the temperature and, for siglip, the bias; nan where fixed."""
    results = C.from_repo(run_dir) / "results.json"
    learned = (json.loads(results.read_text()).get("objective_learned") or {}) if results.is_file() else {}
    return {"final_temperature": float(learned.get("temperature", math.nan)),
            "final_bias": float(learned.get("bias", math.nan))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_size_arguments(parser)
    parser.add_argument("--Ms", type=int, nargs="+", default=None, choices=sorted(MODALITIES),
                        help="numbers of views: 3 (audio, image, flow), 2 (audio, image) (default: 3 2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="K values (default 256 64 16)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: 0 1 2; --smoke: 0)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                        help=f"objective variants (default: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--finished-only", action="store_true",
                        help="train nothing: table the chosen runs that already hold a result (a stopped sweep)")
    C.add_output_arguments(parser, "temperature_siglip")
    args = parser.parse_args(argv)
    size = C.size_of(args)
    Ms = args.Ms or ([3] if size == "smoke" else [3, 2])
    batch_sizes = sorted(args.batch_sizes or {"smoke": [8], "default": [256, 64, 16], "full": [512, 128, 32]}[size],
                         reverse=True)
    seeds = args.seeds or ([0] if size == "smoke" else [0, 1, 2])
    variants = [v for v in VARIANTS if v in (args.variants or DEFAULT_VARIANTS)]
    out = C.output_dir(parser, args, "temperature_siglip")
    modalities_of = SMOKE_MODALITIES if size == "smoke" else MODALITIES
    # the base recipe holds every modality any M uses; each run's views pick its own
    used = tuple(m for m in C.NATURAL if any(m in modalities_of[M] for M in Ms))
    recipe = C.small_recipe("temperature_siglip", modalities=used, size=size, batch_size=max(batch_sizes))
    if size == "default":
        recipe["data"]["split_options"]["train"]["num_samples"] = 2048
    recipe_path = C.write_recipe(recipe, out / "recipes" / "base.yaml")

    specs = []
    for seed in seeds:
        for M in Ms:
            views = [{"modality": m} for m in modalities_of[M]]
            for K in reversed(batch_sizes):  # the smallest batch first: an interrupted sweep has the small-K rows
                for variant in variants:
                    specs.append({
                        "run": f"M{M}_{variant}_K{K}_s{seed}", "M": M, "variant": variant, "batch_size": K, "seed": seed,
                        "overrides": [*variant_overrides(variant), f"views={_flow_yaml(views)}",
                                      f"data.batch_size={K}", f"seed={seed}"],
                    })
    if args.finished_only:
        specs = [s for s in specs if (out / "runs" / s["run"] / "results.json").is_file()]
        if not specs:
            parser.error(f"--finished-only: none of the chosen runs has a result under {out / 'runs'}")
    rows = C.run_sweep(specs, recipe_path, out, args)
    rows = [{**r, **learned_values(r["run_dir"])} for r in rows]
    bases: dict[int, dict[str, Any]] = {}
    if size != "smoke":
        for M in Ms:
            views = [{"modality": m} for m in modalities_of[M]]
            bases[M] = C.random_init_baseline(recipe_path, out / f"M{M}", [f"views={_flow_yaml(views)}"], args)

    summary = []
    for M in Ms:
        for variant in variants:
            ref = None
            for K in batch_sizes:
                sel = [r for r in rows if r["M"] == M and r["variant"] == variant and r["batch_size"] == K
                       and r["status"] == "ok"]
                if args.finished_only and not sel:
                    continue  # a cell no run reached
                acc, acc_std = C.mean_std([r["acc"] for r in sel])
                erank, erank_std = C.mean_std([r["erank"] for r in sel])
                temperature, _ = C.mean_std([r["final_temperature"] for r in sel])
                bias, _ = C.mean_std([r["final_bias"] for r in sel])
                ref = acc if ref is None else ref
                summary.append({"M": M, "variant": variant, "batch_size": K, "acc": acc, "acc_std": acc_std,
                                "drop_from_largest": ref - acc, "erank": erank, "erank_std": erank_std,
                                "final_temperature": temperature, "final_bias": bias, "seeds": len(sel)})
    for M, base in bases.items():
        summary.append({"M": M, "variant": "random-init encoder", "batch_size": "-", "acc": base["acc"],
                        "erank": base["erank"]})
    C.write_table(summary, out, "summary")
    C.write_table(rows, out, "results")  # commands.txt lists every run

    plt = C.pyplot()
    fig, axes = plt.subplots(2, len(Ms), figsize=(5.5 * len(Ms), 7.5), squeeze=False)
    styles = {"geometric_pvc": ("C0", "-", "o"), "geometric_pvc_learned": ("C0", "--", "o"),
              "mv_dhel": ("C1", "-", "s"), "mv_dhel_learned": ("C1", "--", "s"),
              "siglip": ("C2", "-", "^"), "siglip_fixed": ("C2", "--", "^")}
    for j, M in enumerate(Ms):
        for variant in variants:
            colour, line, marker = styles[variant]
            pts = [s for s in summary if s["M"] == M and s["variant"] == variant]
            for i, key in enumerate(("acc", "erank")):  # error bars: std over seeds
                axes[i][j].errorbar([s["batch_size"] for s in pts], [s[key] for s in pts],
                                    yerr=[s[f"{key}_std"] for s in pts], color=colour, ls=line, marker=marker,
                                    capsize=3, label=variant)
        if M in bases:
            axes[0][j].axhline(bases[M]["acc"], color="gray", ls=":", lw=1, label="random-init encoder")
            axes[1][j].axhline(bases[M]["erank"], color="gray", ls=":", lw=1, label="random-init encoder")
        axes[0][j].set_title(f"M = {M}: {', '.join(modalities_of[M])}", fontsize=9)
        for i, ylabel in enumerate(("linear probe accuracy (test)", "effective rank (test, fused)")):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xticks(batch_sizes)
            axes[i][j].set_xticklabels([str(k) for k in batch_sizes])
            axes[i][j].set_xlabel("batch size K")
            axes[i][j].set_ylabel(ylabel)
            axes[i][j].grid(alpha=0.3)
            axes[i][j].legend(fontsize=7)
    over = ("the seeds finished (summary.csv: seeds)" if args.finished_only
            else f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}")
    fig.suptitle(f"{TITLE}\n(mean +- std over {over}; dashed: learned "
                 f"temperature for the softmax objectives, fixed for siglip_fixed)", fontsize=9)
    C.save_figure(fig, out / "temperature_siglip.png")
    if size != "smoke":  # mmviews compare over the runs (skipped in the quick test mode)
        C.compare_runs([r["run_dir"] for r in rows], out / "comparison")
    print(C.markdown_table(summary, ["M", "variant", "batch_size", "acc", "acc_std", "drop_from_largest", "erank",
                                     "final_temperature", "final_bias", "seeds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
