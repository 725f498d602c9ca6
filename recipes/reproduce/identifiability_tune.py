#!/usr/bin/env python
"""Identifiability on a CPU budget: the search for the settings of ``recipes/identifiability.yaml``.

The question (Daunhawer et al., ICLR 2023, numerical simulation, M = 2, p = 0.75, statistical and
content-dependent style dependences): which training settings bring the content's kernel ridge
R^2 near 1 and the modality-specific block's near 0 within minutes of one CPU core, where the
paper trained 300,000 steps of K = 6144. The axes: learning rate and schedule, temperature,
embedding size, the sphere (cosine critic, the library's) against an unnormalised encoding with a
squared-L2 critic (the paper's), batch size K and the encoder's width.

Stages (``--stage``):

- ``screen``: one seed, short runs, one axis changed at a time from a base setting; each run's
  R^2 (content, style, specific; kernel ridge and linear, mean over the two modalities) at a few
  steps, and its training CPU time.
- ``curve``: the candidate settings (``--settings``, default: the candidate and the paper's
  critic at the same budget), 3 seeds, R^2 of every block against optimiser steps.
- ``authors``: the authors' ``main_mlp.py`` (github.com/imantdaunhawer/multimodal-contrastive-
  learning, a checkout you give with ``--authors-code DIR``; it is imported from there, not
  shipped here) at the same K and steps, its own settings otherwise (lr 1e-4, squared L2 critic
  at temperature 1 with negatives from a second batch of the same modality, 5-d encoding, 6
  hidden layers up to 750 wide, gradient clipping at norm 2), scored at its log steps with the
  same protocol as the curve.
- ``protocol``: one trained embedding (``--encoders``, a file that ``--stage curve
  --save-encoders`` wrote) scored under several evaluation protocols (``--protocols``: the
  task's defaults, more fit samples, wider alpha / gamma grids, the paper's sample sizes) and,
  beside it, oracle inputs under the same protocols (``--oracles``: the true content, through
  the identity and two known invertible maps, and the raw observation): is the evaluation or
  the encoder what holds the content's R^2 down.
- ``sweep``: M = 2, 3, 4 at equal compute (K * M = 512 encoded inputs a step, K rounded; the
  same 3000 steps), every objective of the reproduction's part (b) on the sphere and geometric
  poly-view with the squared-L2 critic (``--objectives``), 3 seeds each with its own generative
  process and random init; every block's R^2 at the end (mean over the M modalities), and the
  encoder as initialised once per seed, M and encoder shape. Besides content, style and
  specific, ``style_residual``: each modality's style less the content's affine shift, the part
  of the style the content does not determine (the style's own R^2 counts the content's share).
- ``settings``: the settings the paper varies, M = 2 (the four dependence settings at p = 0.75,
  and p in {0.25, 0.5, 1.0} with both dependences), at a curve setting (``--curve``, default the
  squared-L2 critic of round two), each beside its encoder as initialised.

The loop is a lean copy of the trainer's (``mmviews.train``): the ``identifiability`` dataset's
samples by index (fresh at every step), the recipe's ``mlp`` adapters built by
:func:`mmviews.modalities.build_adapter`, the registered ``simclr`` objective (its cosine critic on
the sphere), AdamW with :func:`mmviews.train.optim.warmup_then_decay`; the evaluation is the
``identifiability`` task's (:mod:`mmviews.eval.identifiability`: RBF kernel ridge fitted on
2048 valid samples, least squares on all 4096, scored on 4096 test samples; the screen fits on
1024 and scores on 2048). It skips the trainer's per-sample items and their collation (measured:
0.025 CPU-s for the items of 1024 samples, against 0.08 for a training step of width 256 at
K = 1024), so that a grid fits the budget; the chosen settings are then run through the trainer
itself (``stage confirm``: ``mmviews train identifiability`` with the recipe as committed).

The squared-L2 critic of the unnormalised encoding, ``S[i,a,j,b] = -||z_ia - z_jb||^2 / tau``, is
the library's: ``simclr`` with ``critic: squared_l2`` (the 2K anchors of both modalities, the
other modality's view the positive, the 2(K - 1) views of the other samples the negatives) on
the adapters' unnormalised output (``l2_normalize: false``).

Usage::

    python recipes/reproduce/identifiability_tune.py --stage screen
    python recipes/reproduce/identifiability_tune.py --stage curve --seeds 0 1 2
    python recipes/reproduce/identifiability_tune.py --stage authors --authors-code /path/to/checkout --steps 1000
    python recipes/reproduce/identifiability_tune.py --stage confirm --seeds 0 1 2
    python recipes/reproduce/identifiability_tune.py --stage curve --settings l2_d5_lr3e-3 --steps 6000 --seeds 1 --save-encoders
    python recipes/reproduce/identifiability_tune.py --stage protocol --encoders OUT/encoders/l2_d5_lr3e-3_seed1.safetensors
    python recipes/reproduce/identifiability_tune.py --stage sweep --seeds 0 1 2
    python recipes/reproduce/identifiability_tune.py --stage settings --seeds 0 1 2
    python recipes/reproduce/identifiability_tune.py --smoke         # seconds (tests)

Every stage writes into ``runs/reproduce/identifiability_tune/`` under the current directory,
or ``--out DIR``; the tables shipped in ``recipes/reproduce/results/identifiability_tune/``
are rewritten only with ``--update-shipped`` (never at ``--smoke`` size).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RECIPE = C.REPRO_DIR.parent / "identifiability.yaml"
NAME = "identifiability_tune"  # the output folder under runs/reproduce/ and the shipped tables
BLOCKS = ("content", "style", "specific")
MODALITIES = ("x1", "x2")

# The screen: two bases, one axis changed at a time. "wide": the earlier recipe's encoders (width
# 256) at K = 512 for 600 steps; "cheap": width 128 at K = 256 for 3000 steps (a step about 6
# times cheaper). Evaluated with the kernel fitted on 1024 samples, scored on 2048.
WIDE: dict[str, Any] = {"critic": "cosine", "embed_dim": 16, "tau": 0.1, "lr": 1e-3, "schedule": "cosine",
                        "K": 512, "hidden": 256, "steps": 600}
CHEAP: dict[str, Any] = {"critic": "cosine", "embed_dim": 16, "tau": 0.1, "lr": 1e-3, "schedule": "constant",
                         "K": 256, "hidden": 128, "steps": 3000}
SCREEN: dict[str, dict[str, Any]] = {
    "wide": WIDE,
    "wide_constant": {**WIDE, "schedule": "constant"},
    "wide_lr_3e-3": {**WIDE, "lr": 3e-3},
    "wide_tau_0.3": {**WIDE, "tau": 0.3},
    "wide_tau_0.05": {**WIDE, "tau": 0.05},
    "wide_l2_d5": {**WIDE, "critic": "l2", "embed_dim": 5, "tau": 1.0},
    "wide_l2_d16": {**WIDE, "critic": "l2", "tau": 1.0},
    "cheap": CHEAP,
    "cheap_tau_0.3": {**CHEAP, "tau": 0.3},
    "cheap_l2_d5": {**CHEAP, "critic": "l2", "embed_dim": 5, "tau": 1.0},
}
SCREEN_FIT, SCREEN_SCORE = 1024, 2048
# The candidate settings of the curves: width 128, K = 256, AdamW lr 1e-3 with a cosine decay over
# 12,000 steps, temperature 0.1, d = 16 on the sphere.
CANDIDATE: dict[str, Any] = {"critic": "cosine", "embed_dim": 16, "tau": 0.1, "lr": 1e-3, "schedule": "cosine",
                             "warmup": 0, "K": 256, "hidden": 128, "steps": 12000}
# The curve's settings: the candidate, and the paper's critic on the same budget.
CURVES: dict[str, dict[str, Any]] = {
    "candidate": {},
    "l2_d5": {"critic": "l2", "embed_dim": 5, "tau": 1.0},
    "l2_d5_lr3e-3": {"critic": "l2", "embed_dim": 5, "tau": 1.0, "lr": 3e-3},
    "l2_d5_K1024": {"critic": "l2", "embed_dim": 5, "tau": 1.0, "lr": 2e-3, "K": 1024},
    "l2_d5_lr3e-3_tau0.3": {"critic": "l2", "embed_dim": 5, "tau": 0.3, "lr": 3e-3},
    "l2_d5_K1024_lr3e-3": {"critic": "l2", "embed_dim": 5, "tau": 1.0, "lr": 3e-3, "K": 1024},
    "l2_d10_lr3e-3": {"critic": "l2", "embed_dim": 10, "tau": 1.0, "lr": 3e-3},
    "l2_d16_lr3e-3": {"critic": "l2", "embed_dim": 16, "tau": 1.0, "lr": 3e-3},
}
SIZES: dict[str, dict[str, Any]] = {
    "smoke": {"steps": 6, "evals": [3, 6], "K": 16, "hidden": 16, "fit": 96, "score": 128},
    "default": {"steps": None, "evals": None, "K": None, "hidden": None, "fit": 2048, "score": 4096},
}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def candidate_setting() -> dict[str, Any]:
    """The candidate settings the curves follow (cheap steps, long cosine decay), in the study's
    keys. Not (yet) the defaults of ``recipes/identifiability.yaml``: one seed of three was
    measured to the end, and it ties the recipe's defaults on the content."""
    return dict(CANDIDATE)


def score_blocks(emb_fit: Mapping[str, Any], lat_fit: Mapping[str, np.ndarray], emb_score: Mapping[str, Any],
                 lat_score: Mapping[str, np.ndarray], fit: int) -> dict[str, float]:
    """Per modality and block, the ``identifiability`` task's kernel ridge (on ``fit`` samples) and
    linear R^2, and their means over the modalities (``<block>`` / ``<block>_lin``). Where the
    latents hold ``style_residual_<modality>`` (:func:`style_residuals`), that block is scored too."""
    import torch

    from mmviews.eval.identifiability import kernel_ridge_r2, linear_r2, standardise

    row: dict[str, float] = {}
    blocks = [*BLOCKS, *(["style_residual"] if all(f"style_residual_{m}" in lat_fit for m in emb_fit) else [])]
    for m in emb_fit:
        x_fit, x_score = standardise(torch.as_tensor(emb_fit[m]), torch.as_tensor(emb_score[m]))
        keys = {"content": "content", "style": f"style_{m}", "specific": f"specific_{m}",
                "style_residual": f"style_residual_{m}"}
        y_fit = {b: torch.as_tensor(lat_fit[keys[b]]) for b in blocks}
        y_score = {b: torch.as_tensor(lat_score[keys[b]]) for b in blocks}
        kernel = kernel_ridge_r2(x_fit[:fit], {b: y[:fit] for b, y in y_fit.items()}, x_score, y_score)
        for b in blocks:
            row[f"{m}_{b}"] = kernel.r2[b]
            row[f"{m}_{b}_lin"] = linear_r2(x_fit, y_fit[b], x_score, y_score[b])
    for b in blocks:
        for leaf in ("", "_lin"):
            row[f"{b}{leaf}"] = sum(row[f"{m}_{b}{leaf}"] for m in emb_fit) / len(emb_fit)
    return row


def style_residuals(latents: dict[str, np.ndarray], process: Any) -> dict[str, np.ndarray]:
    """``latents`` with ``style_residual_<modality>``: each modality's style less the content's
    affine shift ``B c + a`` (the style itself without content-dependent style), the part of the
    style that the content does not determine. Its R^2 is what an embedding holds of the style
    beyond the content; the style's own R^2 counts the content's share too."""
    shift = 0.0 if process.shift is None else latents["content"] @ process.shift[0].T + process.shift[1]
    out = dict(latents)
    for key in [k for k in latents if k.startswith("style_x")]:
        out[f"style_residual_{key[len('style_'):]}"] = latents[key] - shift
    return out


def data_options(setting: Mapping[str, Any]) -> dict[str, Any]:
    """The ``identifiability`` dataset's options of ``setting``: M modalities (``M``, default 2),
    p (``p``, default 0.75) and the two dependences (``statistical``, ``content_style``, default
    both on: the paper's hardest setting)."""
    return {"num_modalities": int(setting.get("M", 2)), "style_change_prob": float(setting.get("p", 0.75)),
            "statistical_dependence": bool(setting.get("statistical", True)),
            "content_dependent_style": bool(setting.get("content_style", True))}


def objective_of(setting: Mapping[str, Any]) -> Any:
    """The registered objective of ``setting`` (``objective``, default ``simclr``) at its temperature;
    the squared-L2 critic where ``critic`` is ``l2`` (``simclr`` and ``geometric_pvc`` have it).
    f-MICL keeps its own defaults (its Gaussian similarity has no temperature of this kind)."""
    from mmviews.objectives import get_objective

    name = setting.get("objective", "simclr")
    params: dict[str, Any] = {} if name == "fmicl" else {"temperature": setting["tau"]}
    if setting["critic"] == "l2":
        params["critic"] = "squared_l2"
    return get_objective(name, **params)


def train_curve(setting: Mapping[str, Any], seed: int, evals: Sequence[int], fit: int, score: int,
                on_row: Callable[[dict[str, Any]], None] | None = None,
                save: Path | None = None) -> list[dict[str, Any]]:
    """Train one setting (by default M = 2, p = 0.75, both dependences: :func:`data_options`)
    from seed ``seed``; the R^2 rows at the steps ``evals`` (0: the encoder as initialised) and at
    the last step, each with the training CPU seconds so far (evaluation excluded). With
    ``save``, the trained encoders' weights go there (safetensors, keys
    ``<modality>.<parameter>``) with the setting beside them (``<save>.json``), for
    :func:`load_encoders`."""
    import torch

    from mmviews.data.identifiability import IdentifiabilityData
    from mmviews.modalities import build_adapter
    from mmviews.train.optim import warmup_then_decay

    torch.manual_seed(seed)
    options = data_options(setting)
    train = IdentifiabilityData(1 << 24, seed, 0, **options)
    valid, test = IdentifiabilityData(4096, seed, 1, **options), IdentifiabilityData(4096, seed, 2, **options)
    modalities = valid.modalities
    lat_fit, lat_score = valid.latents(np.arange(4096)), test.latents(np.arange(score))
    x_fit = {m: torch.from_numpy(v.astype(np.float32))[:, None] for m, v in valid.observations(lat_fit).items()}
    x_score = {m: torch.from_numpy(v.astype(np.float32))[:, None] for m, v in test.observations(lat_score).items()}
    lat_fit, lat_score = style_residuals(lat_fit, valid.process), style_residuals(lat_score, test.process)
    # the sphere: the adapters' normalised output, scored by the cosine critic; the L2 critic: the
    # head's output as it is (l2_normalize false), scored by the objective's squared_l2 critic
    adapters = torch.nn.ModuleList(build_adapter(_adapter_spec(setting)) for _ in modalities)

    def embed(adapter: Any, values: Any) -> Any:
        return adapter({"values": values})

    objective = objective_of(setting)
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=setting["lr"], weight_decay=0.0)
    steps, K = int(setting["steps"]), int(setting["K"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: warmup_then_decay(
        t, warmup=int(setting.get("warmup", 0)), total=steps, cosine=setting["schedule"] == "cosine"))
    rows: list[dict[str, Any]] = []
    started, evaluating = cpu_seconds(), 0.0

    def evaluate(step: int) -> None:
        nonlocal evaluating
        t0 = cpu_seconds()
        adapters.eval()
        with torch.no_grad():
            fit_emb = {m: embed(a, x_fit[m]).double() for a, m in zip(adapters, modalities)}
            score_emb = {m: embed(a, x_score[m]).double() for a, m in zip(adapters, modalities)}
        adapters.train()
        row = {"seed": seed, "step": step, **score_blocks(fit_emb, lat_fit, score_emb, lat_score, fit)}
        evaluating += cpu_seconds() - t0
        row["train_cpu_s"] = round(cpu_seconds() - started - evaluating, 2)
        rows.append(row)
        if on_row is not None:
            on_row(row)

    if 0 in evals:
        evaluate(0)
    for step in range(1, steps + 1):
        index = np.arange((step - 1) * K, step * K)
        x = train.observations(train.latents(index))
        z = torch.stack([embed(a, torch.from_numpy(x[m].astype(np.float32))[:, None])
                         for a, m in zip(adapters, modalities)], dim=1)
        loss = objective(z)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step in evals or step == steps:
            evaluate(step)
    if save is not None:
        save_encoders(adapters, setting, seed, save)
    return rows


def _adapter_spec(setting: Mapping[str, Any]) -> dict[str, Any]:
    """The ``mlp`` adapter of one modality in ``setting`` (the sphere for the cosine critic, the
    head's output as it is for the L2 critic)."""
    return {"type": "mlp", "input_dim": 15, "hidden_dim": setting["hidden"], "num_layers": int(setting.get("layers", 3)),
            "activation": "leaky_relu", "head": {"kind": "linear"}, "embed_dim": setting["embed_dim"],
            "l2_normalize": setting["critic"] == "cosine"}


def save_encoders(adapters: Any, setting: Mapping[str, Any], seed: int, path: Path) -> Path:
    """The two modalities' encoders to ``path`` (safetensors) and their setting and seed to
    ``path.with_suffix('.json')``, each written atomically."""
    from safetensors.torch import save as save_bytes

    from mmviews.fileio import atomic_write_bytes, atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"x{i + 1}.{k}": v.detach().cpu().contiguous() for i, a in enumerate(adapters)
               for k, v in a.state_dict().items()}
    atomic_write_bytes(path, save_bytes(tensors))
    atomic_write_text(path.with_suffix(".json"), json.dumps({"setting": dict(setting), "seed": seed}, indent=1))
    return path


def load_encoders(path: Path) -> tuple[Any, dict[str, Any], int]:
    """The encoders :func:`save_encoders` wrote (a ``ModuleList`` of the two adapters, in eval
    mode), their setting and seed; a clear error for a missing or mismatched file."""
    import torch
    from safetensors.torch import load_file

    from mmviews.modalities import build_adapter

    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise SystemExit(f"--encoders {path}: needs the weights file and {meta_path.name} beside it "
                         "(written by --stage curve --save-encoders)")
    meta = json.loads(meta_path.read_text())
    setting = meta["setting"]
    tensors = load_file(str(path))
    adapters = torch.nn.ModuleList(build_adapter(_adapter_spec(setting)) for _ in MODALITIES)
    for adapter, m in zip(adapters, MODALITIES):
        own = {k[len(m) + 1:]: v for k, v in tensors.items() if k.startswith(f"{m}.")}
        try:
            adapter.load_state_dict(own)
        except RuntimeError as err:
            raise SystemExit(f"--encoders {path}: the weights of {m} do not fit the setting in {meta_path.name}: "
                             f"{str(err).splitlines()[0]}") from None
    adapters.eval()
    return adapters, setting, int(meta["seed"])


def log_steps(steps: int, points: int = 6) -> list[int]:
    """0 and about ``points`` steps spaced geometrically up to ``steps``."""
    out = {0, steps}
    for k in range(1, points):
        out.add(int(round(steps ** (k / points) / 50)) * 50 or 50)
    return sorted(s for s in out if s <= steps)


def _table(rows: Sequence[Mapping[str, Any]], out: Path, stem: str) -> None:
    C.write_table([dict(r) for r in rows], out, stem)


def stage_screen(args: Any, out: Path) -> list[dict[str, Any]]:
    sz = SIZES[args.size]
    rows: list[dict[str, Any]] = []
    names = args.settings or list(SCREEN)
    for name in names:
        setting = dict(SCREEN[name])
        if args.size == "smoke":
            setting.update(steps=sz["steps"], K=sz["K"], hidden=sz["hidden"])
        evals = sz["evals"] or sorted({setting["steps"] // 4, setting["steps"] // 2, setting["steps"]})
        fit, score = (sz["fit"], sz["score"]) if args.size == "smoke" else (SCREEN_FIT, SCREEN_SCORE)

        def report(row: dict[str, Any], name: str = name, setting: dict[str, Any] = setting) -> None:
            rows.append({"setting": name, **setting, **row})
            print(f"screen {name} step {row['step']}: content {row['content']:.3f} (linear {row['content_lin']:.3f}), "
                  f"specific {row['specific']:.3f}, train CPU {row['train_cpu_s']} s", flush=True)
            _table(rows, out, "screen")

        for seed in args.seeds or [0]:
            train_curve(setting, seed, evals, fit, score, report)
    return rows


def stage_curve(args: Any, out: Path) -> list[dict[str, Any]]:
    sz = SIZES[args.size]
    rows: list[dict[str, Any]] = []
    for name in args.settings or list(CURVES):
        setting = {**candidate_setting(), **CURVES[name]}
        if args.steps:
            setting["steps"] = args.steps
        if args.size == "smoke":
            setting.update(steps=sz["steps"], K=sz["K"], hidden=sz["hidden"])
        evals = sz["evals"] or args.evals or log_steps(setting["steps"])

        def report(row: dict[str, Any], name: str = name, setting: dict[str, Any] = setting) -> None:
            rows.append({"setting": name, **setting, **row})
            print(f"curve {name} seed {row['seed']} step {row['step']}: content {row['content']:.3f}, "
                  f"specific {row['specific']:.3f}, style {row['style']:.3f}, train CPU {row['train_cpu_s']} s",
                  flush=True)
            _table(rows, out, "curve")

        for seed in args.seeds or [0, 1, 2]:
            save = out / "encoders" / f"{name}_seed{seed}.safetensors" if args.save_encoders else None
            train_curve(setting, seed, evals, sz["fit"], sz["score"], report, save)
    return rows


# The sweep: M = 2, 3, 4 at equal compute (K * M = SWEEP_INPUTS encoded
# inputs per step, the same steps), every objective of the reproduction's part (b) on the sphere
# (d 16, temperature 0.1, lr 1e-3 cosine) and geometric poly-view with the squared-L2 critic (d 5,
# lr 3e-3), the setting of the curves; 3 seeds, each its own generative process and random init.
SWEEP_OBJECTIVES = ("multi_crop", "geometric_pvc", "arithmetic_pvc", "mv_infonce", "mv_dhel", "er", "fmicl",
                    "geometric_pvc_l2")
SWEEP_INPUTS, SWEEP_STEPS = 512, 3000


def sweep_setting(objective: str, M: int, steps: int = SWEEP_STEPS, inputs: int = SWEEP_INPUTS) -> dict[str, Any]:
    """The study's setting of one sweep run: ``objective`` (a registered name, or
    ``geometric_pvc_l2`` for geometric poly-view with the squared-L2 critic), M modalities,
    K = round(inputs / M) samples a step."""
    l2 = objective == "geometric_pvc_l2"
    return {**candidate_setting(), **(CURVES["l2_d5_lr3e-3"] if l2 else {}),
            "objective": "geometric_pvc" if l2 else objective, "M": M, "K": int(round(inputs / M)), "steps": steps}


def stage_sweep(args: Any, out: Path) -> list[dict[str, Any]]:
    """M = 2, 3, 4 x the objectives x seeds (``sweep.csv``): every block's R^2 at the end, and the
    encoder as initialised once per (seed, M, encoder shape) (``objective`` ``random_init``)."""
    sz = SIZES[args.size]
    rows: list[dict[str, Any]] = []
    done_init: set[tuple[Any, ...]] = set()
    objectives = args.objectives or list(SWEEP_OBJECTIVES)
    for seed in args.seeds or [0, 1, 2]:
        for M in args.Ms or [2, 3, 4]:
            for name in objectives:
                setting = sweep_setting(name, M, args.steps or SWEEP_STEPS)
                if args.size == "smoke":
                    setting.update(steps=sz["steps"], K=max(4, sz["K"] // M), hidden=sz["hidden"])
                shape = (seed, M, setting["embed_dim"], setting["critic"])
                evals = [setting["steps"]] if shape in done_init else [0, setting["steps"]]
                done_init.add(shape)

                def report(row: dict[str, Any], name: str = name, setting: dict[str, Any] = setting) -> None:
                    label = "random_init" if row["step"] == 0 else name
                    rows.append({"objective": label, "encoder": f"d{setting['embed_dim']}_{setting['critic']}",
                                 "M": setting["M"], "K": setting["K"], **row})
                    print(f"sweep {label} M {setting['M']} seed {row['seed']} step {row['step']}: content "
                          f"{row['content']:.3f}, style {row['style']:.3f}, specific {row['specific']:.3f}, "
                          f"train CPU {row['train_cpu_s']} s", flush=True)
                    _table(rows, out, args.table or "sweep")

                train_curve(setting, seed, evals, sz["fit"], sz["score"], report)
    return rows


# The settings the paper varies: the four dependence settings at p = 0.75 and p in
# {0.25, 0.5, 0.75, 1.0} with both dependences, M = 2, at the curves' L2 setting.
PAPER_SETTINGS: dict[str, dict[str, Any]] = {
    "independent": {"statistical": False, "content_style": False},
    "statistical": {"statistical": True, "content_style": False},
    "content_dependent_style": {"statistical": False, "content_style": True},
    "both": {},
    "both_p0.25": {"p": 0.25}, "both_p0.5": {"p": 0.5}, "both_p1.0": {"p": 1.0},
}


def stage_settings(args: Any, out: Path) -> list[dict[str, Any]]:
    """The paper's settings (``PAPER_SETTINGS``) x seeds (``settings.csv``), each beside its
    encoder as initialised."""
    sz = SIZES[args.size]
    rows: list[dict[str, Any]] = []
    for seed in args.seeds or [0, 1, 2]:
        for name in args.settings or list(PAPER_SETTINGS):
            setting = {**candidate_setting(), **CURVES[args.curve], **PAPER_SETTINGS[name]}
            setting["steps"] = args.steps or SWEEP_STEPS
            if args.size == "smoke":
                setting.update(steps=sz["steps"], K=sz["K"], hidden=sz["hidden"])

            def report(row: dict[str, Any], name: str = name, setting: dict[str, Any] = setting) -> None:
                rows.append({"setting": name, "trained": row["step"] > 0, "p": setting.get("p", 0.75),
                             "statistical": setting.get("statistical", True),
                             "content_style": setting.get("content_style", True), **row})
                print(f"settings {name} seed {row['seed']} step {row['step']}: content {row['content']:.3f} "
                      f"(linear {row['content_lin']:.3f}), style {row['style']:.3f}, specific {row['specific']:.3f}, "
                      f"train CPU {row['train_cpu_s']} s", flush=True)
                _table(rows, out, "settings")

            train_curve(setting, seed, [0, setting["steps"]], sz["fit"], sz["score"], report)
    return rows


def stage_authors(args: Any, out: Path) -> list[dict[str, Any]]:
    """The authors' main_mlp.py, imported from ``--authors-code``, at the candidate's K and ``--steps``
    (default the candidate's): its training loop unchanged; at each of its log steps its encoders are
    scored with :func:`score_blocks` on 4096 fresh samples of its own latent space for fitting
    and 4096 for scoring (torch's RNG state restored afterwards, so training draws what an
    unpatched run draws)."""
    if args.authors_code is None:
        raise SystemExit("--stage authors needs --authors-code DIR (a checkout of "
                         "github.com/imantdaunhawer/multimodal-contrastive-learning)")
    import torch

    code = Path(args.authors_code).resolve()
    if not (code / "main_mlp.py").is_file():
        raise SystemExit(f"--authors-code {code}: no main_mlp.py there")
    sys.path.insert(0, str(code))
    import main_mlp  # type: ignore[import-not-found]

    setting = candidate_setting()
    steps = args.steps or setting["steps"]
    K = setting["K"] if args.size != "smoke" else SIZES["smoke"]["K"]
    steps = steps if args.size != "smoke" else SIZES["smoke"]["steps"]
    every = max(1, steps // 6) if args.size != "smoke" else 3
    generate, step_fn = main_mlp.generate_data, main_mlp.train_step
    rows: list[dict[str, Any]] = []
    state = {"step": 0, "evaluating": 0.0, "started": cpu_seconds()}

    def counting_step(data: Any, h1: Any, h2: Any, loss_func: Any, optimizer: Any, params: Any) -> Any:
        if optimizer is not None:
            state["step"] += 1
        return step_fn(data, h1, h2, loss_func, optimizer, params)

    def scoring_generate(latent_space: Any, h1: Any, h2: Any, device: Any, num_batches: int = 1,
                         batch_size: int = 4096, loss_func: Any = None, permuted_content: bool = False) -> Any:
        result = generate(latent_space, h1, h2, device, num_batches, batch_size, loss_func, permuted_content)
        if loss_func is None or num_batches != 1:  # only the training loop's log-step calls are scored
            return result
        t0, rng = cpu_seconds(), torch.get_rng_state()
        fit = generate(latent_space, h1, h2, device, 1, 4096)
        score = generate(latent_space, h1, h2, device, 1, SIZES[args.size]["score"])
        torch.set_rng_state(rng)
        names = {"content": "c", "specific_x1": "m1", "specific_x2": "m2", "style_x1": "s", "style_x2": "s~"}
        row = {"seed": args.seeds[0] if args.seeds else 0, "step": state["step"],
               **score_blocks({"x1": fit["hz1"], "x2": fit["hz2"]}, {k: fit[v] for k, v in names.items()},
                              {"x1": score["hz1"], "x2": score["hz2"]}, {k: score[v] for k, v in names.items()},
                              SIZES[args.size]["fit"])}
        state["evaluating"] += cpu_seconds() - t0
        row["train_cpu_s"] = round(cpu_seconds() - state["started"] - state["evaluating"], 2)
        rows.append({"setting": "authors main_mlp.py", "K": K, **row})
        print(f"authors step {row['step']}: content {row['content']:.3f}, specific {row['specific']:.3f}, "
              f"train CPU {row['train_cpu_s']} s", flush=True)
        _table(rows, out, "authors")
        return result

    main_mlp.generate_data, main_mlp.train_step = scoring_generate, counting_step
    torch.set_num_threads(args.threads)
    argv = sys.argv
    sys.argv = ["main_mlp.py", "--model-dir", str(out / "authors_models"), "--model-id", "run",
                "--style-change-prob", "0.75", "--statistical-dependence", "--content-dependent-style",
                "--seed", str(args.seeds[0] if args.seeds else 0), "--batch-size", str(K),
                "--train-steps", str(steps), "--log-steps", str(every), "--no-cuda"]
    try:
        main_mlp.main()
    finally:
        sys.argv = argv
        main_mlp.generate_data, main_mlp.train_step = generate, step_fn
    return rows


def stage_confirm(args: Any, out: Path) -> list[dict[str, Any]]:
    """``mmviews train identifiability`` (the recipe as committed, or with the ``--set``
    overrides) for each seed, through the trainer in this process; its final R^2 and the CPU
    seconds of the whole run. The runs go to ``OUT/confirm/[<name>_]seed<seed>``, the table to
    ``OUT/confirm[_<name>].csv``."""
    import torch

    rows = []
    for seed in args.seeds or [0, 1, 2]:
        # float32 on every machine (auto picks bf16 on a CPU with native bf16), as the tables
        overrides = [f"seed={seed}", f"data.options.seed={seed}", "output.progress_bar=false",
                     "optimisation.mixed_precision=no", *(args.set or [])]
        if args.size == "smoke":
            overrides += ["optimisation.max_steps=3", "data.batch_size=32", "evaluation.plots=false",
                          "data.split_options={valid: {num_samples: 256}, test: {num_samples: 256}}",
                          "evaluation.tasks=[{kind: identifiability, fit_samples: 96}]"]
        t0 = cpu_seconds()
        run_dir = out / "confirm" / (f"{args.name}_seed{seed}" if args.name else f"seed{seed}")
        row = C.train_run(RECIPE, run_dir, overrides, threads=args.threads, reuse=not args.no_reuse)
        cpu = cpu_seconds() - t0
        results = json.loads((run_dir / "results.json").read_text())
        entry: dict[str, Any] = {"name": args.name or "recipe", "seed": seed, "steps": row["steps"],
                                 "cpu_s": round(cpu, 1), "status": row["status"]}
        for key, label in (("eval", ""), ("eval_random", "random_")):
            metrics = results.get(key) or {}
            for b in BLOCKS:
                for leaf, short in (("r2_nonlinear", ""), ("r2_linear", "_lin")):
                    vals = [metrics.get(f"test/identifiability/{m}/{b}/{leaf}", math.nan) for m in MODALITIES]
                    entry[f"{label}{b}{short}"] = sum(vals) / len(vals)
        entry["command"] = row["command"]
        rows.append(entry)
        print(f"confirm seed {seed}: content {entry['content']:.3f}, specific {entry['specific']:.3f} "
              f"(random init {entry['random_content']:.3f} / {entry['random_specific']:.3f}), CPU {entry['cpu_s']} s",
              flush=True)
        _table(rows, out, f"confirm_{args.name}" if args.name else "confirm")
    torch.set_num_threads(args.threads)
    return rows


# The evaluation protocols the ``protocol`` stage compares on one trained embedding: the task's
# defaults; more fit samples; wider alpha / gamma grids; the paper's (scikit-learn's GridSearchCV
# of KernelRidge over the task's grid, fitted on 5 batches of 4096 samples and scored on 5 more).
TASK_GRID = {"alphas": (1.0, 0.1, 0.01, 0.001), "gammas": tuple(10.0 ** (-2 + 4 * k / 3) for k in range(4))}
WIDE_GRID = {"alphas": tuple(10.0 ** -k for k in range(7)), "gammas": tuple(10.0 ** (-3 + k / 2) for k in range(9))}
PROTOCOLS: dict[str, dict[str, Any]] = {
    "task": {"fit": 2048, "score": 4096, **TASK_GRID},
    "fit4096": {"fit": 4096, "score": 4096, **TASK_GRID},
    "fit8192": {"fit": 8192, "score": 4096, **TASK_GRID},
    "wide": {"fit": 2048, "score": 4096, **WIDE_GRID},
    "wide_fit4096": {"fit": 4096, "score": 4096, **WIDE_GRID},
    "wide_fit8192": {"fit": 8192, "score": 4096, **WIDE_GRID},
    # the paper's sizes; alpha and gamma chosen by the grid's 3-fold CV on the first 4096 fit
    # samples (the paper's CV on all 20480 holds 16 GB of kernels), then one refit of the content
    # on all 20480 (about 3 CPU-minutes a modality; the other blocks keep the CV set's fit)
    "paper": {"fit": 20480, "score": 20480, "cv_samples": 4096, "refit_blocks": ("content",), **TASK_GRID},
}
# The inputs scored beside the embedding: the true content through known maps (a ceiling of the
# protocol for an exact recovery) and the raw observations of each modality.
ORACLES = ("embedding", "content", "content_tanh", "content_mix", "observation")


def oracle_inputs(kind: str, latents: Mapping[str, np.ndarray], observations: Mapping[str, np.ndarray],
                  modality: str, process: Any) -> np.ndarray:
    """The regression's input for ``kind``: ``content`` itself; ``content_tanh``, tanh of a fixed
    rotation of the content scaled to unit variance times 1.5 (smooth, invertible, saturating
    as a trained encoder may); ``content_mix``, the modality's own mixing MLP applied to
    (content, 0, 0) (piecewise linear, invertible on the content); ``observation``, the
    modality's raw 15-d observation (which holds every block)."""
    c = latents["content"]
    if kind == "content":
        return c
    if kind == "content_tanh":
        rotation = np.linalg.qr(np.random.default_rng(0).standard_normal((c.shape[1], c.shape[1])))[0]
        return np.tanh(1.5 * (c / np.sqrt(np.diag(process.chol["content"] @ process.chol["content"].T))) @ rotation)
    if kind == "content_mix":
        z = np.zeros((len(c), process.dim))
        z[:, :c.shape[1]] = c
        return process.mix(MODALITIES.index(modality), z)
    if kind == "observation":
        return observations[modality]
    raise ValueError(f"oracle input {kind!r}: choose from {', '.join(ORACLES)}")


def score_protocol(inputs_fit: Mapping[str, np.ndarray], lat_fit: Mapping[str, np.ndarray],
                   inputs_score: Mapping[str, np.ndarray], lat_score: Mapping[str, np.ndarray],
                   protocol: Mapping[str, Any]) -> dict[str, float]:
    """Kernel ridge R^2 of every block per modality (``<m>_<block>``) and the means over the
    modalities (``<block>``) under ``protocol`` (its fit and score sizes, alpha and gamma
    grids), with the alpha and gamma the content's cross-validation chose (``<m>_alpha``,
    ``<m>_gamma``); the inputs standardised on the fit set, as the task does."""
    import torch

    from mmviews.eval.identifiability import kernel_ridge_r2, standardise

    fit, score = int(protocol["fit"]), int(protocol["score"])
    cv = int(protocol.get("cv_samples", fit))
    row: dict[str, float] = {}
    for m in inputs_fit:
        x_fit, x_score = standardise(torch.as_tensor(inputs_fit[m][:fit]), torch.as_tensor(inputs_score[m][:score]))
        keys = {"content": "content", "style": f"style_{m}", "specific": f"specific_{m}"}
        y_fit = {b: torch.as_tensor(lat_fit[k][:fit]).double() for b, k in keys.items()}
        y_score = {b: torch.as_tensor(lat_score[k][:score]).double() for b, k in keys.items()}
        result = kernel_ridge_r2(x_fit[:cv], {b: y[:cv] for b, y in y_fit.items()}, x_score, y_score,
                                 protocol["alphas"], protocol["gammas"])
        if cv < fit:  # refit on the whole fit set with the alpha and gamma each block's CV chose
            for b in protocol.get("refit_blocks", BLOCKS):
                result.r2[b] = refit_r2(x_fit, y_fit[b], x_score, y_score[b], result.alpha[b], result.gamma[b])
        for b in BLOCKS:
            row[f"{m}_{b}"] = result.r2[b]
        row[f"{m}_alpha"], row[f"{m}_gamma"] = result.alpha["content"], result.gamma["content"]
    for b in BLOCKS:
        row[b] = sum(row[f"{m}_{b}"] for m in inputs_fit) / len(inputs_fit)
    return row


def direction_r2(inputs_fit: Mapping[str, np.ndarray], content_fit: np.ndarray, inputs_score: Mapping[str, np.ndarray],
                 content_score: np.ndarray, covariance: np.ndarray, protocol: Mapping[str, Any]) -> list[dict[str, float]]:
    """Where the content is lost: one row per principal direction of the content's
    ``covariance`` (smallest variance first), its variance and, per modality (``<m>``), the
    kernel ridge R^2 of the content's coordinate along it under ``protocol`` (fit and score
    sizes, grids; the inputs standardised on the fit set)."""
    import torch

    from mmviews.eval.identifiability import kernel_ridge_r2, standardise

    fit, score = int(protocol["fit"]), int(protocol["score"])
    variances, axes = np.linalg.eigh(covariance)
    along_fit, along_score = content_fit[:fit] @ axes, content_score[:score] @ axes
    names = [f"pc{k}" for k in range(len(variances))]
    rows = [{"direction": k, "variance": float(v)} for k, v in enumerate(variances)]
    for m in inputs_fit:
        x_fit, x_score = standardise(torch.as_tensor(inputs_fit[m][:fit]), torch.as_tensor(inputs_score[m][:score]))
        result = kernel_ridge_r2(x_fit, {n: torch.as_tensor(along_fit[:, k]) for k, n in enumerate(names)}, x_score,
                                 {n: torch.as_tensor(along_score[:, k]) for k, n in enumerate(names)},
                                 protocol["alphas"], protocol["gammas"])
        for row, n in zip(rows, names):
            row[m] = result.r2[n]
    return rows


def refit_r2(x_fit: Any, y_fit: Any, x_score: Any, y_score: Any, alpha: float, gamma: float,
             chunk: int = 2048) -> float:
    """Score-set R^2 of one RBF kernel ridge fit (``alpha``, ``gamma``) on all of ``x_fit``,
    holding one [fit, fit] float64 kernel and its Cholesky factor (built in place; the score
    set's kernel rows ``chunk`` at a time): the paper's fit size without its 16 GB of CV."""
    import torch

    from mmviews.eval.identifiability import r2_score, rbf_kernel

    x_fit = x_fit.double()
    kernel = x_fit @ x_fit.T
    sq = (x_fit * x_fit).sum(1)
    kernel.mul_(-2.0).add_(sq[:, None]).add_(sq[None, :]).clamp_(min=0.0).mul_(-gamma).exp_()
    kernel.diagonal().add_(alpha)
    factor, info = torch.linalg.cholesky_ex(kernel)
    del kernel
    if int(info):
        raise RuntimeError(f"kernel ridge refit: the kernel (gamma {gamma}, alpha {alpha}) is not positive definite")
    dual = torch.cholesky_solve(y_fit.double().reshape(len(x_fit), -1), factor)
    del factor
    pred = torch.cat([rbf_kernel(x_score[i:i + chunk], x_fit, gamma) @ dual for i in range(0, len(x_score), chunk)])
    return r2_score(y_score, pred)


def stage_protocol(args: Any, out: Path) -> list[dict[str, Any]]:
    """One trained embedding (``--encoders``, from ``--stage curve --save-encoders``) scored under
    each protocol of ``--protocols`` (default all but ``paper``), and beside it the oracle inputs
    of ``--oracles`` under the same protocols; one row per (input, protocol) with its CPU
    seconds."""
    import torch

    from mmviews.data.identifiability import IdentifiabilityData

    if args.encoders is None:
        raise SystemExit("--stage protocol needs --encoders FILE (written by --stage curve --save-encoders)")
    adapters, setting, seed = load_encoders(Path(args.encoders))
    names = args.protocols or [p for p in PROTOCOLS if p != "paper"]
    for name in names:
        if name not in PROTOCOLS:
            raise SystemExit(f"--protocols {name}: choose from {', '.join(PROTOCOLS)}")
    protocols = {n: dict(PROTOCOLS[n]) for n in names}
    if args.size == "smoke":
        for p in protocols.values():
            p.update(fit=min(p["fit"], SIZES["smoke"]["fit"]), score=min(p["score"], SIZES["smoke"]["score"]))
    n_fit, n_score = max(p["fit"] for p in protocols.values()), max(p["score"] for p in protocols.values())
    valid, test = IdentifiabilityData(n_fit, seed, 1), IdentifiabilityData(n_score, seed, 2)
    lat_fit, lat_score = valid.latents(np.arange(n_fit)), test.latents(np.arange(n_score))
    obs_fit, obs_score = valid.observations(lat_fit), test.observations(lat_score)

    def inputs(kind: str, latents: Mapping[str, np.ndarray], obs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if kind != "embedding":
            return {m: oracle_inputs(kind, latents, obs, m, valid.process) for m in MODALITIES}
        with torch.no_grad():
            return {m: a({"values": torch.from_numpy(obs[m].astype(np.float32))[:, None]}).double().numpy()
                    for a, m in zip(adapters, MODALITIES)}

    rows: list[dict[str, Any]] = []
    for kind in args.oracles or list(ORACLES):
        fit_in, score_in = inputs(kind, lat_fit, obs_fit), inputs(kind, lat_score, obs_score)
        for name, protocol in protocols.items():
            t0 = cpu_seconds()
            row = {"input": kind, "protocol": name, "seed": seed, "fit": protocol["fit"], "score": protocol["score"],
                   **score_protocol(fit_in, lat_fit, score_in, lat_score, protocol)}
            row["cpu_s"] = round(cpu_seconds() - t0, 1)
            rows.append(row)
            print(f"protocol {name} ({protocol['fit']} fit / {protocol['score']} scored), {kind}: content "
                  f"{row['content']:.3f} (x1 {row['x1_content']:.3f}, x2 {row['x2_content']:.3f}), specific "
                  f"{row['specific']:.3f}, style {row['style']:.3f}; gamma {row['x1_gamma']:.3g}/{row['x2_gamma']:.3g}, "
                  f"alpha {row['x1_alpha']:.3g}/{row['x2_alpha']:.3g}; {row['cpu_s']} CPU-s", flush=True)
            _table(rows, out, "protocol")
    if args.directions:
        content = valid.process.chol["content"]
        fit_in, score_in = inputs("embedding", lat_fit, obs_fit), inputs("embedding", lat_score, obs_score)
        protocol = protocols[names[0]]
        directions = [{"protocol": names[0], "seed": seed, **r} for r in direction_r2(
            fit_in, lat_fit["content"], score_in, lat_score["content"], content @ content.T, protocol)]
        for r in directions:
            print(f"content direction {r['direction']} (variance {r['variance']:.3f}), {names[0]}: "
                  + ", ".join(f"{m} {r[m]:.3f}" for m in MODALITIES), flush=True)
        _table(directions, out, "protocol_directions")
    return rows


def plot_curves(out: Path) -> Path | None:
    """R^2 of every block against optimiser steps, one line per setting and seed (the seeds may
    reach different steps), the authors' code beside them."""
    series: dict[str, list[dict[str, Any]]] = {}
    for stem in ("curve", "authors"):
        path = out / f"{stem}.json"
        if path.is_file():
            for row in json.loads(path.read_text()):
                series.setdefault(f"{row['setting']}, seed {row['seed']}", []).append(row)
    if not series:
        return None
    plt = C.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax in axes:  # more series than the default cycle's 10 colours
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for name, rows in series.items():
        rows = sorted(rows, key=lambda r: int(r["step"]))
        for ax, block in zip(axes, BLOCKS):
            ax.plot([max(int(r["step"]), 1) for r in rows], [r[block] for r in rows], marker="o", ms=3,
                    ls="--" if name.startswith("authors") else "-", label=name)
    for ax, block in zip(axes, BLOCKS):
        ax.set_xscale("log")
        ax.set_xlabel("optimiser steps (step 0 drawn at 1)")
        ax.set_ylabel(f"{block}: kernel ridge R^2 (test, mean of x1, x2)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].axhline(0.95, color="gray", ls=":", lw=1)
    axes[2].axhline(0.05, color="gray", ls=":", lw=1)
    fig.suptitle("Identifiability, M = 2, p = 0.75, both dependences: R^2 against optimiser steps", fontsize=9)
    return C.save_figure(fig, out / "curve.png")


def plot_sweep(out: Path, stem: str = "sweep") -> Path | None:
    """One panel per block (the style's residual too where the rows have it): R^2 (mean over the
    modalities; mean +- std over the seeds) against M, one line per objective, the encoders as
    initialised dashed."""
    path = out / f"{stem}.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())
    blocks = [b for b in (*BLOCKS, "style_residual") if all(b in r for r in rows)]
    plt = C.pyplot()
    fig, axes = plt.subplots(1, len(blocks), figsize=(5 * len(blocks), 4.2))
    lines = sorted({(r["objective"], r["encoder"]) for r in rows})
    for objective, encoder in lines:
        mine = [r for r in rows if (r["objective"], r["encoder"]) == (objective, encoder)]
        Ms = sorted({int(r["M"]) for r in mine})
        label = f"random init ({encoder})" if objective == "random_init" else (
            "geometric_pvc, L2 critic d 5" if encoder.endswith("_l2") else objective)
        for ax, block in zip(axes, blocks):
            stats = [C.mean_std([r[block] for r in mine if int(r["M"]) == M]) for M in Ms]
            ax.errorbar(Ms, [m for m, _ in stats], yerr=[e for _, e in stats], marker="o", ms=3, capsize=2,
                        ls="--" if objective == "random_init" else "-", label=label)
    for ax, block in zip(axes, blocks):
        ax.set_xticks([2, 3, 4])
        ax.set_xlabel("modalities M (K * M fixed)")
        ax.set_ylabel(f"{block}: kernel ridge R^2 (test, mean over modalities)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Identifiability, p = 0.75, both dependences: R^2 against M at equal compute "
                 "(mean +- std over seeds)", fontsize=9)
    return C.save_figure(fig, out / f"{stem}.png")


def plot_settings(out: Path) -> Path | None:
    """Per block, the trained and the initialised R^2 of each of the paper's settings (mean +- std
    over the seeds), kernel ridge and linear."""
    path = out / "settings.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())
    names = [n for n in PAPER_SETTINGS if any(r["setting"] == n for r in rows)]
    plt = C.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.2
    for ax, block in zip(axes, BLOCKS):
        for k, (trained, leaf, label) in enumerate(((True, "", "trained, kernel"), (True, "_lin", "trained, linear"),
                                                    (False, "", "initialised, kernel"),
                                                    (False, "_lin", "initialised, linear"))):
            stats = [C.mean_std([r[f"{block}{leaf}"] for r in rows if r["setting"] == n and r["trained"] == trained])
                     for n in names]
            ax.bar(np.arange(len(names)) + (k - 1.5) * width, [m for m, _ in stats], width,
                   yerr=[e for _, e in stats], capsize=2, label=label, alpha=1.0 if trained else 0.45)
        ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(f"{block}: R^2 (test, mean of x1, x2)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle("Identifiability, M = 2: the paper's settings (dependences at p = 0.75; p with both)", fontsize=9)
    fig.tight_layout()
    return C.save_figure(fig, out / "settings.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["screen", "curve", "authors", "confirm", "protocol", "sweep", "settings",
                                            "plot"], default="screen")
    parser.add_argument("--smoke", action="store_true", help="a few steps of tiny runs (tests)")
    parser.add_argument("--settings", nargs="+", default=None,
                        help=f"screen: among {', '.join(SCREEN)}; curve: among {', '.join(CURVES)}; "
                             f"settings: among {', '.join(PAPER_SETTINGS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--objectives", nargs="+", default=None, choices=SWEEP_OBJECTIVES,
                        help="sweep: the objectives (default all)")
    parser.add_argument("--Ms", type=int, nargs="+", default=None, help="sweep: the numbers of modalities (default 2 3 4)")
    parser.add_argument("--table", default=None, help="sweep: the table's name in OUT (default sweep)")
    parser.add_argument("--curve", default="l2_d5_lr3e-3", choices=list(CURVES),
                        help="settings: the curve setting every paper setting is trained with")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"curve / authors / sweep / settings: optimiser steps (default the candidate's; "
                             f"sweep and settings {SWEEP_STEPS})")
    parser.add_argument("--evals", type=int, nargs="+", default=None,
                        help="curve: the steps scored (0: the encoder as initialised; default about 6, spaced geometrically)")
    parser.add_argument("--save-encoders", action="store_true",
                        help="curve: keep each run's trained encoders (OUT/encoders/<setting>_seed<seed>.safetensors)")
    parser.add_argument("--encoders", type=Path, default=None, help="protocol: a file of --save-encoders")
    parser.add_argument("--protocols", nargs="+", default=None,
                        help=f"protocol: among {', '.join(PROTOCOLS)} (default all but paper)")
    parser.add_argument("--oracles", nargs="+", default=None, choices=ORACLES,
                        help="protocol: the inputs scored (default all: the embedding and the oracles)")
    parser.add_argument("--directions", action="store_true",
                        help="protocol: also the embedding's R^2 of each principal direction of the content "
                             "(under the first protocol; OUT/protocol_directions.csv)")
    parser.add_argument("--authors-code", type=Path, default=None, help="a checkout of the authors' repository")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--no-reuse", action="store_true", help="confirm: retrain runs that already hold a result")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help="confirm: an override of the recipe (repeatable), as mmviews train --set")
    parser.add_argument("--name", default="", help="confirm: a name for the runs' folders and the table (default none: the recipe's)")
    C.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)
    args.size = "smoke" if args.smoke else "default"
    for name in args.settings or []:
        known = {"screen": SCREEN, "settings": PAPER_SETTINGS}.get(args.stage, CURVES)
        if args.stage in ("screen", "curve", "settings") and name not in known:
            parser.error(f"--settings {name}: not a {args.stage} setting; choose from {', '.join(known)}")
    out = C.output_dir(parser, args, NAME)  # refused in one line before anything is written
    import torch

    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    stage = {"screen": stage_screen, "curve": stage_curve, "authors": stage_authors, "confirm": stage_confirm,
             "protocol": stage_protocol, "sweep": stage_sweep, "settings": stage_settings,
             "plot": lambda a, o: []}[args.stage]
    stage(args, out)
    if args.stage in ("curve", "authors", "plot"):
        plot_curves(out)
    if args.stage in ("sweep", "plot"):
        plot_sweep(out, args.table or "sweep")
        if args.stage == "plot" and args.table is None:
            plot_sweep(out, "sweep_style")
    if args.stage in ("settings", "plot"):
        plot_settings(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
