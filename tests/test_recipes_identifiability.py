"""The built-in ``identifiability`` recipe: it trains on fresh samples of two modalities, a short
run recovers the content better than its randomly initialised encoders do (the identifiability
evaluation, trained beside random init), and results.json / report.md record the global batch,
the optimiser steps and the paper's finding."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from test_train_utils import train_in_process

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "identifiability.yaml"


def test_the_recipe_is_the_papers_setting():
    recipe = yaml.safe_load(RECIPE.read_text())
    options = recipe["data"]["options"]
    assert options == {"num_modalities": 2, "style_change_prob": 0.75, "statistical_dependence": True,
                       "content_dependent_style": True}
    assert [v["modality"] for v in recipe["views"]] == ["x1", "x2"]
    assert {a["type"] for a in recipe["adapters"].values()} == {"mlp"}
    assert recipe["objective"]["name"] == "simclr"
    # the paper's critic on the content's size: 5 unnormalised numbers compared by squared L2 distance
    assert recipe["objective"]["params"] == {"temperature": 1.0, "critic": "squared_l2"}
    assert recipe["encoder"]["embed_dim"] == 5 and {a["l2_normalize"] for a in recipe["adapters"].values()} == {False}
    assert recipe["evaluation"]["random_baseline"] is True and recipe["evaluation"]["tasks"] == ["identifiability"]


def test_a_short_run_recovers_the_content_better_than_its_random_init(tmp_path):
    """100 steps of K = 256 with small encoders (about 6 s of CPU): the content's linear R^2 rises
    above the random init's in both modalities (by 0.28 and 0.13 with the recipe's squared-L2 critic)."""
    adapter = ("{type: mlp, input_dim: 15, hidden_dim: 64, num_layers: 2, activation: leaky_relu, head: {kind: linear}, "
               "l2_normalize: false}")
    result = train_in_process(
        str(RECIPE), "--output", str(tmp_path / "run"),
        "--set", "data.batch_size=256", "--set", f"adapters={{x1: {adapter}, x2: {adapter}}}",
        "--set", "optimisation.max_steps=100",
        "--set", "data.split_options={valid: {num_samples: 1024}, test: {num_samples: 1024}}",
        "--set", "evaluation.tasks=[{kind: identifiability, fit_samples: 256, blocks: [content, specific]}]",
        "--set", "evaluation.plots=false", "--set", "output.progress_bar=false")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "results.json").read_text())
    assert summary["steps"] == 100 and summary["global_batch_size"] == 256 and summary["grad_accum_steps"] == 1
    trained, random_init = summary["eval"], summary["eval_random"]
    for m in ("x1", "x2"):
        key = f"test/identifiability/{m}/content/r2_linear"
        assert trained[key] > random_init[key] + 0.04, (m, trained[key], random_init[key])
    assert {h["metric"] for h in summary["headline"]} == {
        f"test/identifiability/{m}/{b}/{k}" for m in ("x1", "x2") for b in ("content", "specific")
        for k in ("r2_linear", "r2_nonlinear")}
    report = (tmp_path / "run" / "report.md").read_text()
    assert "global batch 256 x 1 micro-batch(es)" in report
    # 100 steps of 256 fresh samples from a split of 2^24: no epoch completed, a fraction seen
    assert summary["epochs"] == 0 and summary["epochs_trained"] == round(100 * 256 / 2 ** 24, 6)
    assert "- optimiser steps: 100 (0.00153 of an epoch, 25600 samples" in report and "0 epochs" not in report
    card = (tmp_path / "run" / "encoder" / "README.md").read_text()
    assert "100 optimiser steps, 0.00153 of an epoch, 25600 samples seen" in card
    assert "Paper's finding (Daunhawer et al., ICLR 2023)" in report and "This run " in report
