#!/usr/bin/env python
"""View multiplicity: probe quality and effective rank as the number of views M grows.

Papers: poly-view contrastive learning (Shidani et al., ICLR 2024, sec. 3.2 and Figure 3):
with the batch growing with M (K fixed, K*M views) poly-view objectives improve with M, and in
the fixed-batch setting (K*M held constant, so fewer unique samples per batch) they still
improve, whereas Multi-Crop saturates. MV-DHEL (Figures 3-4): MV-DHEL's accuracy and effective
rank keep growing with M while MV-InfoNCE / pairwise objectives saturate or lose rank
(dimensional collapse).

Here: the embedded synthetic data; the views are the natural image and optical-flow views
(M = 2) plus augmented copies: M = 3 adds a SimCLR-augmented image, M = 4 also an augmented
flow, M = 6 two of each, M = 8 three of each. Objectives ``mv_dhel``, ``geometric_pvc``,
``mv_infonce``, ``multi_crop`` (temperature 0.2). Batch policies of the trainer
(``data.batch_mode``, ``mmviews.data.views.batch_size_for``): ``growing`` (K = batch_size for
every M) and ``fixed`` (K = batch_size * 2 // M, so K*M stays at 2 * batch_size). Same number
of epochs for every run. Linear-probe accuracy (class, chance 0.25) and effective rank of the
mean of the natural views' embeddings on the test split.

Usage::

    python recipes/reproduce/view_multiplicity.py            # default: M in {2, 3, 4}, < 15 min on 2 CPU cores
    python recipes/reproduce/view_multiplicity.py --full     # M in {2, 4, 6, 8}, 4096 samples, 30 epochs, 3 seeds
    python recipes/reproduce/view_multiplicity.py --smoke    # seconds (tests)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TITLE = "View multiplicity (cf. Shidani et al. 2024 sec. 3.2 / Fig. 3; MV-DHEL Figs. 3-4)"
OBJECTIVES = ("mv_dhel", "geometric_pvc", "mv_infonce", "multi_crop")
IMAGE_AUG = {"modality": "image", "augment": "simclr", "params": {"strength": 0.5, "blur_p": 0.0}}
FLOW_AUG = {"modality": "flow", "augment": "flow_default"}


def views_for(M: int) -> list[dict[str, Any]]:
    """Natural image + flow, then augmented image / flow copies alternately."""
    if M < 2:
        raise ValueError(f"M must be >= 2, got {M}")
    views: list[dict[str, Any]] = [{"modality": "image"}, {"modality": "flow"}]
    extra = M - 2
    n_img, n_flow = (extra + 1) // 2, extra // 2
    if n_img:
        views.append({**IMAGE_AUG, "copies": n_img})
    if n_flow:
        views.append({**FLOW_AUG, "copies": n_flow})
    return views


def _flow_yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_size_arguments(parser)
    parser.add_argument("--Ms", type=int, nargs="+", default=None, help="numbers of views (default 2 3 4)")
    parser.add_argument("--objectives", nargs="+", default=None, choices=OBJECTIVES)
    parser.add_argument("--modes", nargs="+", default=["growing", "fixed"], choices=["growing", "fixed"])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: 0; --full: 0 1 2)")
    parser.add_argument("--batch-size", type=int, default=None, help="K at M = 2 (default 64; smoke 16)")
    parser.add_argument("--out", type=Path, default=C.RESULTS_DIR / "view_multiplicity")
    args = parser.parse_args(argv)
    size = C.size_of(args)
    Ms = args.Ms or {"smoke": [2, 3], "default": [2, 3, 4], "full": [2, 4, 6, 8]}[size]
    objectives = args.objectives or (["mv_dhel"] if size == "smoke" else list(OBJECTIVES))
    modes = ["fixed"] if size == "smoke" and args.modes == ["growing", "fixed"] else args.modes
    seeds = args.seeds or ([0, 1, 2] if size == "full" else [0])
    K = args.batch_size or (8 if size == "smoke" else 64 if size == "default" else 256)
    out: Path = args.out
    recipe = C.small_recipe("view_multiplicity", size=size, batch_size=K)
    if size == "default":
        recipe["data"]["split_options"]["train"]["num_samples"] = 640
    recipe["data"]["reference_views"] = 2
    recipe_path = C.write_recipe(recipe, out / "recipes" / "base.yaml")

    specs = []
    for seed in seeds:
        for name in objectives:
            for M in Ms:
                for mode in modes:
                    if M == 2 and mode == "fixed" and "growing" in modes:
                        continue  # identical to growing at the reference M = 2
                    specs.append({
                        "run": f"{name}_M{M}_{mode}_s{seed}", "objective": name, "M": M, "mode": mode, "seed": seed,
                        "K": K if mode == "growing" else max(1, K * 2 // M),
                        "overrides": [f"objective.name={name}", "objective.params={temperature: 0.2}",
                                      f"views={_flow_yaml(views_for(M))}", f"data.batch_mode={mode}", f"seed={seed}"],
                    })
    rows = C.run_sweep(specs, recipe_path, out, args)
    base = C.random_init_baseline(recipe_path, out, ["objective.params={temperature: 0.2}"], args) \
        if size != "smoke" else None

    summary = []
    for name in objectives:
        for mode in modes:
            for M in Ms:
                sel = [r for r in rows if r["objective"] == name and r["M"] == M and r["status"] == "ok"
                       and (r["mode"] == mode or (M == 2 and "growing" in modes))]
                summary.append({
                    "objective": name, "mode": mode, "M": M,
                    "acc": sum(r["acc"] for r in sel) / len(sel) if sel else math.nan,
                    "erank": sum(r["erank"] for r in sel) / len(sel) if sel else math.nan,
                    "seeds": len(sel),
                })
    # Does the objective improve with M? (last M minus M = 2, per mode)
    trend = []
    for name in objectives:
        for mode in modes:
            pts = [s for s in summary if s["objective"] == name and s["mode"] == mode]
            if len(pts) >= 2:
                trend.append({"objective": name, "mode": mode,
                              f"acc_M{pts[0]['M']}": pts[0]["acc"], f"acc_M{pts[-1]['M']}": pts[-1]["acc"],
                              "delta_acc": pts[-1]["acc"] - pts[0]["acc"],
                              "delta_erank": pts[-1]["erank"] - pts[0]["erank"]})
    if base is not None:
        summary.append({"objective": "random-init encoder", "mode": "-", "M": "-", "acc": base["acc"], "erank": base["erank"]})
    C.write_table(summary, out, "summary")
    if trend:
        C.write_table(trend, out, "trend")
    C.write_table(rows, out, "results")

    plt = C.pyplot()
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 7), squeeze=False)
    for j, mode in enumerate(modes):
        for name in objectives:
            pts = [s for s in summary if s["objective"] == name and s["mode"] == mode]
            axes[0][j].plot([s["M"] for s in pts], [s["acc"] for s in pts], marker="o", label=name)
            axes[1][j].plot([s["M"] for s in pts], [s["erank"] for s in pts], marker="o", label=name)
        if base is not None:
            axes[0][j].axhline(base["acc"], color="gray", ls="--", lw=1, label="random-init encoder")
            axes[1][j].axhline(base["erank"], color="gray", ls="--", lw=1, label="random-init encoder")
        axes[0][j].set_title(f"{mode} batch", fontsize=9)
        axes[0][j].set_ylabel("linear probe accuracy (test)")
        axes[1][j].set_ylabel("effective rank (test, fused)")
        for i in range(2):
            axes[i][j].set_xlabel("views M")
            axes[i][j].set_xticks(Ms)
            axes[i][j].grid(alpha=0.3)
            axes[i][j].legend(fontsize=7)
    fig.suptitle(TITLE, fontsize=9)
    C.save_figure(fig, out / "view_multiplicity.png")
    if size != "smoke":  # mmviews compare over the runs (skipped in the quick test mode)
        C.compare_runs([r["run_dir"] for r in rows], out / "comparison")
    print(C.markdown_table(summary, ["objective", "mode", "M", "acc", "erank", "seeds"]))
    if trend:
        print(C.markdown_table(trend, list(trend[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
