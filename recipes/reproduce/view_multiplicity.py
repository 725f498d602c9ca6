#!/usr/bin/env python
"""View multiplicity: probe quality and effective rank as the number of views M grows.

Papers: poly-view contrastive learning (Shidani et al., ICLR 2024, sec. 3.2 and Figure 3):
with the batch growing with M (K fixed, K*M views) poly-view objectives improve with M, and in
the fixed-batch setting (K*M held constant, so fewer unique samples per batch) they still
improve, whereas Multi-Crop saturates. MV-DHEL (Figures 3-4): MV-DHEL's accuracy and effective
rank keep growing with M while MV-InfoNCE / pairwise objectives saturate or lose rank
(dimensional collapse).

Here: the embedded synthetic data with quickstart's four modalities and adapters; the views
are the natural text, audio, image and optical-flow views (M = 4) plus augmented copies, added
in the order image (SimCLR), flow, audio, text and round again: M = 6 adds an augmented image
and flow, M = 8 also an augmented audio and text. Objectives ``mv_dhel``, ``geometric_pvc``,
``mv_infonce``, ``multi_crop`` (temperature 0.2). Batch policies of the trainer
(``data.batch_mode``, ``mmviews.data.views.batch_size_for``): ``growing`` (K = batch_size for
every M, so K*M grows) and ``fixed`` (K = batch_size * 4 // M, so K*M stays at 4 * batch_size
and a larger M sees fewer distinct samples per batch). Same number of epochs for every run, so
``fixed`` also makes M / M0 times the optimiser steps of the reference M0. The third mode,
``fixed_steps``, separates views from steps: the batch of ``fixed`` (K*M constant) but the
number of optimiser steps of the reference M0 (``optimisation.max_steps``; the cosine schedule
follows it), so a larger M sees fewer samples in all (M0 / M of the epochs).
Linear-probe accuracy (class, chance 0.25) and effective rank of the mean of the natural views'
embeddings on the test split.

``--views image`` is the poly-view paper's own setting: the image modality alone, every view a
SimCLR-augmented copy of the image (M in {2, 4, 8}, fixed batch relative to M = 2), probed on the
un-augmented image. Augmentations never flip here: a horizontal flip turns the synthetic data's
45-degree stripes (class 1) into 135-degree ones (class 3).

Usage::

    python recipes/reproduce/view_multiplicity.py            # default: M in {4, 8}, < 15 min on 2 CPU cores
    python recipes/reproduce/view_multiplicity.py --Ms 4 6 8 # adds M = 6 (about 1.7x the time)
    python recipes/reproduce/view_multiplicity.py --views image   # augmented copies of the image only
    python recipes/reproduce/view_multiplicity.py --full     # M in {4, 6, 8, 12}, 4096 samples, 30 epochs, 3 seeds
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
# No flips: on the synthetic data a horizontal flip turns a 45-degree stripe or motion axis into a
# 135-degree one, i.e. class 1 into class 3, so flipped copies would be positives of another class.
IMAGE_AUG = {"modality": "image", "augment": "simclr", "params": {"strength": 0.5, "blur_p": 0.0, "flip_p": 0.0}}
AUGMENTED = (  # the order in which augmented copies are added beyond the natural views
    IMAGE_AUG,
    {"modality": "flow", "augment": "flow_default", "params": {"flip_p": 0.0}},
    {"modality": "audio", "augment": "audio_default"},
    {"modality": "text", "augment": "text_default"},
)


def views_for(M: int, natural: tuple[str, ...] = C.NATURAL) -> list[dict[str, Any]]:
    """The natural views, then augmented copies in the order of ``AUGMENTED`` (of the natural
    modalities only), round after round."""
    if M < len(natural):
        raise ValueError(f"M must be >= {len(natural)} (the natural views {list(natural)}), got {M}")
    augmented = [a for a in AUGMENTED if a["modality"] in natural]
    copies = [0] * len(augmented)
    for k in range(M - len(natural)):
        copies[k % len(augmented)] += 1
    views: list[dict[str, Any]] = [{"modality": m} for m in natural]
    views += [{**aug, "copies": n} for aug, n in zip(augmented, copies) if n]
    return views


def image_views_for(M: int) -> list[dict[str, Any]]:
    """``--views image``: M SimCLR-augmented copies of the image, no natural view (the poly-view
    paper's setting: every view an augmentation of one image)."""
    if M < 2:
        raise ValueError(f"M must be >= 2, got {M}")
    return [{**IMAGE_AUG, "copies": M}]


def _flow_yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_size_arguments(parser)
    parser.add_argument("--views", choices=["natural", "image"], default="natural",
                        help="natural: the four modalities plus augmented copies (default); image: M augmented "
                             "copies of the image only")
    parser.add_argument("--Ms", type=int, nargs="+", default=None, help="numbers of views (default 4 8; --views image: 2 4 8)")
    parser.add_argument("--objectives", nargs="+", default=None, choices=OBJECTIVES)
    parser.add_argument("--modes", nargs="+", default=["growing", "fixed", "fixed_steps"],
                        choices=["growing", "fixed", "fixed_steps"],
                        help="batch policies: growing (K fixed), fixed (K*M fixed, same epochs), fixed_steps "
                             "(K*M fixed, same optimiser steps as the reference M)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: 0; --full: 0 1 2)")
    parser.add_argument("--batch-size", type=int, default=None, help="K at the reference M (default 64; smoke 8)")
    C.add_output_arguments(parser, "view_multiplicity[_image]")
    args = parser.parse_args(argv)
    size = C.size_of(args)
    unimodal = args.views == "image"
    natural = ("image",) if unimodal else ("image", "flow") if size == "smoke" else C.NATURAL
    if unimodal:
        Ms = args.Ms or {"smoke": [2, 3], "default": [2, 4, 8], "full": [2, 4, 8, 16]}[size]
    else:
        Ms = args.Ms or {"smoke": [2, 3], "default": [4, 8], "full": [4, 6, 8, 12]}[size]
    objectives = args.objectives or (["mv_dhel"] if size == "smoke" else list(OBJECTIVES))
    modes = ["fixed"] if size == "smoke" and args.modes == ["growing", "fixed", "fixed_steps"] else args.modes
    seeds = args.seeds or ([0, 1, 2] if size == "full" else [0])
    K = args.batch_size or (8 if size == "smoke" else 64 if size == "default" else 256)
    out = C.output_dir(parser, args, "view_multiplicity_image" if unimodal else "view_multiplicity")
    recipe = C.small_recipe("view_multiplicity", modalities=natural, size=size, batch_size=K)
    M0 = Ms[0] if unimodal else len(natural)  # the reference M of the fixed-batch setting
    recipe["data"]["reference_views"] = M0
    if unimodal:
        recipe["views"] = image_views_for(M0)
    views_of = image_views_for if unimodal else (lambda M: views_for(M, natural))
    recipe_path = C.write_recipe(recipe, out / "recipes" / "base.yaml")
    # optimiser steps at the reference M (every mode's K there is K): the budget of fixed_steps
    reference_steps = recipe["optimisation"]["epochs"] * (C.SIZES[size]["train"] // K)  # the sampler drops the last batch

    specs = []
    for seed in seeds:
        for name in objectives:
            for M in Ms:
                for mode in modes:
                    if M == M0 and mode != "growing" and "growing" in modes:
                        continue  # identical to growing at the reference M
                    steps = [f"optimisation.max_steps={reference_steps}"] if mode == "fixed_steps" else []
                    specs.append({
                        "run": f"{name}_M{M}_{mode}_s{seed}", "objective": name, "M": M, "mode": mode, "seed": seed,
                        "K": K if mode == "growing" else max(1, K * M0 // M),
                        "overrides": [f"objective.name={name}", "objective.params={temperature: 0.2}",
                                      f"views={_flow_yaml(views_of(M))}",
                                      f"data.batch_mode={'growing' if mode == 'growing' else 'fixed'}",
                                      *steps, f"seed={seed}"],
                    })
    rows = C.run_sweep(specs, recipe_path, out, args)
    base = C.random_init_baseline(recipe_path, out, ["objective.params={temperature: 0.2}"], args) \
        if size != "smoke" else None

    summary = []
    for name in objectives:
        for mode in modes:
            for M in Ms:
                sel = [r for r in rows if r["objective"] == name and r["M"] == M and r["status"] == "ok"
                       and (r["mode"] == mode or (M == M0 and "growing" in modes))]
                acc, acc_std = C.mean_std([r["acc"] for r in sel])
                erank, erank_std = C.mean_std([r["erank"] for r in sel])
                summary.append({"objective": name, "mode": mode, "M": M, "K": sel[0]["K"] if sel else math.nan,
                                "acc": acc, "acc_std": acc_std, "erank": erank, "erank_std": erank_std,
                                "seeds": len(sel)})
    # Does the objective improve with M? (largest M minus the natural M, per mode)
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
            for i, key in enumerate(("acc", "erank")):  # error bars: std over seeds
                axes[i][j].errorbar([s["M"] for s in pts], [s[key] for s in pts], yerr=[s[f"{key}_std"] for s in pts],
                                    marker="o", capsize=3, label=name)
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
    fig.suptitle(f"{TITLE}\nviews: {'augmented copies of the image' if unimodal else 'four modalities + augmented copies'}"
                 f" (mean +- std over {len(seeds)} seed{'s' if len(seeds) > 1 else ''})", fontsize=9)
    C.save_figure(fig, out / "view_multiplicity.png")
    if size != "smoke":  # mmviews compare over the runs (skipped in the quick test mode)
        C.compare_runs([r["run_dir"] for r in rows], out / "comparison")
    print(C.markdown_table(summary, ["objective", "mode", "M", "K", "acc", "acc_std", "erank", "seeds"]))
    if trend:
        print(C.markdown_table(trend, list(trend[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
