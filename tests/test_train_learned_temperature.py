"""Training with learned objective parameters: a learned temperature
(``objective.params.learn_temperature: true``) and ``siglip``'s scale and bias.

The runs (each once per module): one process, plain and cached-embedding steps; two gloo
processes (one launch of 2 ranks). With plain SGD (the update is ``lr * gradient``), the learned
values of every step (``metrics.csv``), the final ones (``results.json``'s
``objective_learned``) and the encoder's weights are the same in all of them: the gradient
of the learned parameters is the one-process gradient whatever the step (cached or plain)
and the number of processes (their gradients are averaged over processes, not summed or left
per process). A resume from a mid-run checkpoint ends with the uninterrupted run's values and
weights. The optimiser holds them in a group of their own (``objective.lr``, no weight decay).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import train_series
from test_train_resume import _truncated_copy
from test_train_utils import load_weights, own_accelerate_state, run_ranks, tiny_config, write_recipe

TRAIN_SERIES = Path(__file__).resolve().parent / "train_series.py"
OBJECTIVES = {
    "siglip": {"name": "siglip", "params": {"temperature": 0.2, "bias": -2.0}, "lr": 0.2},
    "mv_dhel": {"name": "mv_dhel", "params": {"temperature": 0.2, "learn_temperature": True}, "lr": 0.2},
}


def _recipe(folder: Path, name: str, **optimisation: Any) -> Path:
    """Text views only, no BatchNorm and no dropout (the one- and two-process runs then compute
    the same function on CPU), K = 16, 3 batches per epoch, 2 epochs: 6 optimiser steps."""
    raw = tiny_config(image=False, batch_norm=False, dropout=0.0, num_samples=48, batch_size=16, epochs=2)
    raw["cpu"] = True
    raw["objective"] = dict(OBJECTIVES[name])
    raw["optimisation"].update({"optimizer": "sgd", "lr": 0.02, "momentum": 0.0, "max_grad_norm": None, **optimisation})
    raw["output"].update(checkpoint_every=2, keep_last=10)
    suffix = "".join(f"-{k}{v}" for k, v in optimisation.items())
    return write_recipe(folder / f"{name}{suffix}.yaml", raw)


def _series(runs: dict[str, tuple[Path, Path]]) -> list[str]:
    argv: list[str] = []
    for recipe, out in runs.values():
        argv += ["--", str(recipe), "--output", str(out), ":::"]
    return argv[:-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Run folders: ``one-<objective>``, ``cached-<objective>`` (one process, encoder chunks of
    4 samples) and ``two-<objective>`` (two processes)."""
    folder = tmp_path_factory.mktemp("learned")
    one = {f"one-{n}": (_recipe(folder, n), folder / f"one-{n}") for n in OBJECTIVES}
    one["cached-siglip"] = (_recipe(folder, "siglip", encode_chunk_size=4), folder / "cached-siglip")
    with own_accelerate_state():
        for run_argv in train_series.split_runs(_series(one)):
            assert train_series.run_one(run_argv) == 0, run_argv
    two = {f"two-{n}": (_recipe(folder, n), folder / f"two-{n}") for n in OBJECTIVES}
    ranks = run_ranks([sys.executable, str(TRAIN_SERIES), *_series(two)], folder)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-4000:]
    return {name: out for name, (_, out) in {**one, **two}.items()} | {"folder": folder}


def _rows(run: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run / "metrics.csv").open()))


def _learned(run: Path) -> dict[str, float]:
    return json.loads((run / "results.json").read_text())["objective_learned"]


def _check_same(a: Path, b: Path, columns: tuple[str, ...]) -> None:
    rows_a, rows_b = _rows(a), _rows(b)
    assert len(rows_a) == len(rows_b) == 6
    for ra, rb in zip(rows_a, rows_b):
        for column in ("loss", *columns):
            assert math.isclose(float(ra[column]), float(rb[column]), rel_tol=1e-5, abs_tol=1e-6), (column, ra, rb)
    learned_a, learned_b = _learned(a), _learned(b)
    assert learned_a.keys() == learned_b.keys()
    for key in learned_a:
        assert math.isclose(learned_a[key], learned_b[key], rel_tol=1e-5, abs_tol=1e-6), (key, learned_a, learned_b)
    wa, wb = load_weights(a / "encoder"), load_weights(b / "encoder")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")


COLUMNS = {"siglip": ("temperature", "bias"), "mv_dhel": ("temperature",)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_two_processes_learn_the_one_process_values(trained, name):
    _check_same(trained[f"one-{name}"], trained[f"two-{name}"], COLUMNS[name])


@pytest.mark.slow
def test_cached_step_learns_the_plain_step_values(trained):
    _check_same(trained["one-siglip"], trained["cached-siglip"], COLUMNS["siglip"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_learned_values_moved_and_are_logged_and_reported(trained, name):
    rows = _rows(trained[f"one-{name}"])
    temperatures = [float(r["temperature"]) for r in rows]
    assert temperatures[0] == pytest.approx(0.2, rel=1e-6)  # logged as used by the step, from the start value
    assert abs(temperatures[-1] - 0.2) > 1e-4, temperatures  # trained: it moves
    learned = _learned(trained[f"one-{name}"])
    assert learned["temperature"] == pytest.approx(math.exp(-learned["logit_scale"]), rel=1e-12)
    assert learned["temperature"] != pytest.approx(temperatures[-1], rel=1e-9)  # after the last step, not before
    if name == "siglip":
        biases = [float(r["bias"]) for r in rows]
        assert biases[0] == -2.0 and abs(learned["bias"] + 2.0) > 1e-4
    # the checkpoints hold the parameter (the resume test shows it is restored)
    checkpoint = sorted((trained[f"one-{name}"] / "checkpoints").glob("checkpoint-*"))[-1]
    from safetensors.torch import load_file  # noqa: F401  (objective.pt is torch's format)

    state = torch.load(checkpoint / "objective.pt", weights_only=True)
    assert "logit_scale" in state


@pytest.mark.slow
def test_resume_continues_the_learned_values_exactly(trained, tmp_path):
    from mmviews.cli import main

    full = trained["one-siglip"]
    part = tmp_path / "part"
    _truncated_copy(full, part, 2)
    with own_accelerate_state():
        assert main(["train", "--resume", str(part)]) == 0
    assert _learned(part) == _learned(full)
    wa, wb = load_weights(full / "encoder"), load_weights(part / "encoder")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_the_optimiser_holds_them_in_their_own_group_without_weight_decay(tmp_path):
    from accelerate import Accelerator  # noqa: F401  (make_accelerator builds one)

    from mmviews.config import load_config
    from mmviews.train.build import build_run
    from mmviews.train.setup import make_accelerator, prepare_run

    recipe = _recipe(tmp_path, "siglip", optimizer="adamw", weight_decay=0.3)
    with own_accelerate_state():
        config = load_config(recipe)
        parts = build_run(config, with_eval=False)
        p = prepare_run(make_accelerator(config, tmp_path / "run"), parts)
        group = p.optimizer.param_groups[-1]
        assert group["name"] == "objective"
        assert group["params"] == [parts.objective.logit_scale, parts.objective.logit_bias]
        assert group["initial_lr"] == 0.2 and group["weight_decay"] == 0.0  # objective.lr, before the schedule
        decayed = [g for g in p.optimizer.param_groups if not g["name"].endswith("_no_decay") and g["name"] != "objective"]
        assert decayed and all(g["weight_decay"] == 0.3 for g in decayed)
        others = {id(q) for g in p.optimizer.param_groups[:-1] for q in g["params"]}
        assert id(parts.objective.logit_scale) not in others


def test_objective_lr_is_validated(tmp_path):
    from mmviews.config import ConfigError, load_config

    raw = tiny_config(image=False)
    raw["objective"]["lr"] = -1.0
    with pytest.raises(ConfigError, match=r"key 'objective.lr': must be >= 0, got -1.0"):
        load_config(write_recipe(tmp_path / "bad.yaml", raw))


def _open_clip_checkpoint(path: Path, logit_scale: float, logit_bias: float | None = None, **model: Any) -> Path:
    """A tiny CLIP's state dict with the given logit scale (and a SigLIP-style bias); ``model``:
    more of open_clip's model overrides."""
    import open_clip

    from mmviews.modalities.presets import TINY_CLIP_OVERRIDES

    overrides = {**TINY_CLIP_OVERRIDES, **model}
    if logit_bias is not None:
        overrides["init_logit_bias"] = 0.0  # a SigLIP-style model: it has a logit_bias
    model = open_clip.create_model("ViT-B-32", pretrained=None, **overrides)
    with torch.no_grad():
        model.logit_scale.fill_(logit_scale)
        if logit_bias is not None:
            model.logit_bias.fill_(logit_bias)
    torch.save(model.state_dict(), path)
    return path


def _pretrained_recipe(folder: Path, objective: dict[str, Any], checkpoint: Path | None, siglip_model: bool = False) -> Path:
    from mmviews.modalities.presets import TINY_CLIP_OVERRIDES
    from mmviews.modalities.presets import tiny_config as adapter_preset

    raw = tiny_config(text=False, batch_norm=False, num_samples=32, batch_size=8, epochs=1)
    head = raw["adapters"]["image"]["head"]
    raw["adapters"]["image"] = {**adapter_preset("open_clip", **({"pretrained": str(checkpoint)} if checkpoint else {})),
                                "head": head}
    if siglip_model:  # the architecture of a model with a logit_bias, as the checkpoint's
        raw["adapters"]["image"]["model_overrides"] = {**TINY_CLIP_OVERRIDES, "init_logit_bias": 0.0}
    raw["objective"] = objective
    return write_recipe(folder / "pretrained.yaml", raw)


@pytest.mark.parametrize("name,params,bias", [("siglip", {}, -6.5), ("mv_dhel", {"learn_temperature": True}, None),
                                              ("geometric_pvc", {}, -6.5), ("siglip", {"bias": -3.0}, None)])
def test_temperature_pretrained_starts_from_the_open_clip_checkpoint(tmp_path, name, params, bias):
    """The objective starts from the checkpoint's logit_scale (learned or fixed, as the recipe
    says) and siglip from its logit_bias where it has one (a SigLIP model); a CLIP checkpoint
    (no bias) leaves siglip's bias at the recipe's."""
    from mmviews.config import load_config
    from mmviews.train.build import build_run

    checkpoint = _open_clip_checkpoint(tmp_path / "clip.pt", math.log(42.0), bias)
    recipe = _pretrained_recipe(tmp_path, {"name": name, "params": {"temperature": "pretrained", **params}}, checkpoint,
                                siglip_model=bias is not None)
    objective = build_run(load_config(recipe), with_eval=False).objective
    # the checkpoint holds logit_scale in float32: equal to its rounding
    assert float(torch.as_tensor(objective.temperature)) == pytest.approx(1 / 42.0, rel=1e-6)
    if objective.logit_scale is not None:  # learned: the parameter starts there
        assert float(objective.logit_scale.detach()) == pytest.approx(math.log(42.0), rel=1e-7)
    else:
        assert isinstance(objective.temperature, float)
    if name == "siglip":
        assert float(objective.logit_bias.detach()) == pytest.approx(-6.5 if bias is not None else params["bias"], rel=1e-7)


def test_temperature_pretrained_for_an_objective_without_a_settable_temperature_is_refused(tmp_path):
    """ER's temperature is its kernel's bandwidth, not a CLIP logit scale: 'pretrained' is
    refused naming the key and the objective, before any step."""
    from mmviews.config import ConfigError, load_config
    from mmviews.train.build import build_run

    checkpoint = _open_clip_checkpoint(tmp_path / "clip.pt", math.log(42.0), None)
    recipe = _pretrained_recipe(tmp_path, {"name": "er", "params": {"temperature": "pretrained"}}, checkpoint)
    with pytest.raises(ConfigError, match=r"^recipe: key 'objective.params.temperature': 'pretrained' needs an objective "
                                          r"with a temperature; 'er' has none$"):
        build_run(load_config(recipe), with_eval=False)


def test_temperature_pretrained_without_an_open_clip_checkpoint_is_refused(tmp_path):
    from mmviews.config import ConfigError, load_config
    from mmviews.train.build import build_run

    recipe = _pretrained_recipe(tmp_path, {"name": "siglip", "params": {"temperature": "pretrained"}}, None)
    message = (r"^recipe: key 'objective.params.temperature': 'pretrained' starts from a pretrained open_clip model's "
               r"logit_scale, but no adapter was loaded from an open_clip checkpoint \(adapters: \['audio', 'image'\]; set "
               r"adapters.<modality>.pretrained of an open_clip adapter, or give a number\)$")
    with pytest.raises(ConfigError, match=message):
        build_run(load_config(recipe), with_eval=False)
    with pytest.raises(ConfigError, match=r"^runs/x/config.yaml: key 'objective.params.temperature': 'pretrained' starts"):
        build_run(load_config(recipe), 1, "runs/x/config.yaml", with_eval=False)  # the run's own source named
    # called on its own (it is public), the message names the recipe as build_run does
    from mmviews.objectives import get_objective
    from mmviews.train.build import build_encoder, start_from_pretrained

    config = load_config(recipe)
    with pytest.raises(ConfigError, match=message):
        start_from_pretrained(config, get_objective("siglip"), build_encoder(config))


@pytest.mark.slow
def test_the_encoder_folder_and_the_hf_export_carry_the_learned_values(trained, tmp_path):
    from mmviews.export import export_hf
    from mmviews.modalities.multiview import MultiViewEncoder

    run = trained["one-siglip"]
    expected = {"name": "siglip", **_learned(run)}
    assert json.loads((run / "encoder" / "encoder.json").read_text())["objective"] == expected
    assert MultiViewEncoder.from_pretrained(run / "encoder").objective_info == expected
    exported = export_hf(run, tmp_path / "hf")
    assert json.loads((exported / "encoder.json").read_text())["objective"] == expected
    # a fixed temperature learns nothing: no entry
    encoder = MultiViewEncoder.from_pretrained(run / "encoder")
    encoder.objective_info = None
    encoder.save_pretrained(tmp_path / "plain")
    assert "objective" not in json.loads((tmp_path / "plain" / "encoder.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("entry,message", [({"temperature": 0.1}, "string 'name'"), ("siglip", "string 'name'"),
                                           ({"name": "siglip", "temperature": "hot"}, "'objective.temperature' must be a finite number"),
                                           ({"name": "siglip", "bias": float("nan")}, "'objective.bias' must be a finite number")])
def test_a_malformed_objective_entry_in_encoder_json_is_named(trained, tmp_path, entry, message):
    import shutil

    from mmviews.modalities.multiview import MultiViewEncoder

    folder = tmp_path / "encoder"
    shutil.copytree(trained["one-siglip"] / "encoder", folder)
    data = json.loads((folder / "encoder.json").read_text())
    data["objective"] = entry
    (folder / "encoder.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        MultiViewEncoder.from_pretrained(folder)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_clipping_bounds_the_learned_parameters_with_the_encoder(tmp_path, name):
    """``optimisation.max_grad_norm`` clips the global norm over the encoder's gradients AND the
    objective's learned parameters' (open_clip clips logit_scale with the rest): a huge gradient
    of the scale (or bias) is scaled down so that the optimiser sees a total norm at the bound,
    and the encoder's gradients by the same coefficient (the gradients the optimiser's step
    receives are recorded by a step pre-hook)."""
    from mmviews.config import load_config
    from mmviews.train.build import build_run
    from mmviews.train.setup import make_accelerator, prepare_run
    from mmviews.train.step import optimizer_step

    max_norm = 0.5
    recipe = _recipe(tmp_path, name, max_grad_norm=max_norm)
    with own_accelerate_state():
        config = load_config(recipe)
        parts = build_run(config, with_eval=False)
        p = prepare_run(make_accelerator(config, tmp_path / "run"), parts)
        trained = [q for q in p.model.parameters() if q.requires_grad] + parts.objective.trained_parameters()
        assert len(parts.objective.trained_parameters()) == (2 if name == "siglip" else 1)
        generator = torch.Generator().manual_seed(0)
        for q in trained:
            q.grad = 1e-3 * torch.randn(q.shape, generator=generator, dtype=q.dtype)
        for i, q in enumerate(parts.objective.trained_parameters()):
            q.grad = torch.full_like(q, 300.0 * (i + 1))
        given = [q.grad.clone().double() for q in trained]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in given]))
        assert total > 100 * max_norm  # the learned parameters' gradients dominate the norm
        seen: list[torch.Tensor] = []
        optimiser = p.optimizer.optimizer  # the torch optimiser inside Accelerate's wrapper
        hook = optimiser.register_step_pre_hook(lambda *_: seen.extend(q.grad.clone().double() for q in trained))
        try:
            optimizer_step(p, config.optimisation.max_grad_norm)
        finally:
            hook.remove()
        assert len(seen) == len(trained)
        coefficient = max_norm / (float(total) + 1e-6)
        for q, g, s in zip(trained, given, seen):  # one global coefficient for every parameter
            assert torch.allclose(s, coefficient * g, rtol=1e-5, atol=1e-12), q.shape
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in seen]))
        assert float(clipped) == pytest.approx(max_norm, rel=1e-5)


def test_temperature_pretrained_from_two_open_clip_checkpoints_must_agree(tmp_path):
    """Two open_clip adapters loaded from checkpoints with different logit_scale: refused as
    ambiguous, naming each modality's values; from the same values, the objective starts there."""
    from mmviews.config import ConfigError, load_config
    from mmviews.modalities.base import build_adapter
    from mmviews.modalities.multiview import MultiViewEncoder
    from mmviews.modalities.presets import tiny_config as adapter_preset
    from mmviews.objectives import get_objective
    from mmviews.train.build import start_from_pretrained

    first = _open_clip_checkpoint(tmp_path / "a.pt", math.log(42.0), None)
    second = _open_clip_checkpoint(tmp_path / "b.pt", math.log(20.0), None)
    config = load_config(_pretrained_recipe(tmp_path, {"name": "mv_dhel", "params": {"temperature": "pretrained"}}, first))

    def encoder(*checkpoints: Path) -> MultiViewEncoder:
        return MultiViewEncoder({f"image{i}": build_adapter(adapter_preset("open_clip", pretrained=str(c)))
                                 for i, c in enumerate(checkpoints)})

    two = encoder(first, second)
    found = {"image0": (two.adapters["image0"].pretrained_logit_scale, None),
             "image1": (two.adapters["image1"].pretrained_logit_scale, None)}
    assert found["image0"][0] == pytest.approx(math.log(42.0)) and found["image1"][0] == pytest.approx(math.log(20.0))
    message = ("recipe: key 'objective.params.temperature': 'pretrained' is ambiguous: the open_clip adapters' "
               f"checkpoints disagree (logit_scale, logit_bias by modality: {found}); give a number")
    with pytest.raises(ConfigError) as caught:
        start_from_pretrained(config, get_objective("mv_dhel"), two)
    assert str(caught.value) == message
    # the same checkpoint's values twice (one tower under two names: no second model to build)
    same = MultiViewEncoder({"image0": two.adapters["image0"], "image1": two.adapters["image0"]})
    objective = get_objective("mv_dhel")
    start_from_pretrained(config, objective, same)
    assert objective.temperature == pytest.approx(1 / 42.0, rel=1e-6)
