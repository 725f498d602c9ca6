"""Recipes and configuration: typed loading, --set overrides, clear errors before any work,
and every shipped recipe parses and validates."""

from __future__ import annotations

import re

import pytest
import torch
from test_train_utils import REPO, run_train, tiny_config, write_recipe

from mmviews.config import (
    ConfigError,
    OptimisationConfig,
    apply_overrides,
    config_from_dict,
    list_recipes,
    load_config,
    resolve_recipe,
    save_config,
)
from mmviews.train.optim import LARS
from mmviews.train import build_run

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_load_override_and_save_round_trip(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", tiny_config())
    config = load_config(path, ["optimisation.lr=3e-4", "data.options.num_samples=32", "views.1.copies=3",
                                "optimisation.max_grad_norm=null", "objective.params={temperature: 0.5}"])
    assert config.optimisation.lr == pytest.approx(3e-4) and isinstance(config.optimisation.lr, float)
    assert config.data.options["num_samples"] == 32
    assert config.views[1]["copies"] == 3
    assert config.optimisation.max_grad_norm is None
    assert config.objective.params == {"temperature": 0.5}
    saved = save_config(config, tmp_path / "out" / "config.yaml")
    again = load_config(saved)
    assert again == config
    assert not list((tmp_path / "out").glob("*.tmp"))  # written atomically


def test_unknown_key_names_key_and_file(tmp_path):
    raw = tiny_config()
    raw["optimisation"]["lrr"] = 0.1
    path = write_recipe(tmp_path / "bad_key.yaml", raw)
    with pytest.raises(ConfigError, match=r"bad_key\.yaml.*'optimisation\.lrr'"):
        load_config(path)


@pytest.mark.parametrize("text,message", [
    ("name: a\ndata:\n  batch_size: 8\n  name: synthetic\n  batch_size: 16\n",
     "key 'data.batch_size' is given twice, on lines 3 and 5"),
    ("name: a\nseed: 1\nname: b\n", "key 'name' is given twice, on lines 1 and 3"),
    ("views:\n  - {modality: image, copies: 2, copies: 3}\n", "key 'views.0.copies' is given twice, on lines 2 and 2"),
    ("objective: {name: mv_dhel, params: {temperature: 0.1, temperature: 0.2}}\n",
     "key 'objective.params.temperature' is given twice, on lines 1 and 1"),
])
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, message):
    """YAML keeps the last of two equal keys silently: the first value was lost."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: {message} (YAML would keep the second silently): keep one"


def test_keys_that_differ_in_type_or_place_are_not_duplicates(tmp_path):
    path = tmp_path / "fine.yaml"
    path.write_text("name: a\ndata: {name: synthetic, options: {1: x, '1': y}}\n"
                    "views: [{modality: image}, {modality: image}]\nadapters: {image: {type: small_cnn, "
                    "head: {kind: linear}}}\n")
    from mmviews.config import read_yaml

    assert read_yaml(path)["data"]["options"] == {1: "x", "1": "y"}
    assert read_yaml(path)["views"] == [{"modality": "image"}, {"modality": "image"}]


def test_a_key_given_twice_inside_a_top_level_list_is_named_by_its_index(tmp_path):
    """A file whose top level is a list (no recipe) still names the duplicate by its path."""
    path = tmp_path / "list.yaml"
    path.write_text("- {a: 1, a: 2}\n")
    from mmviews.config import read_yaml

    with pytest.raises(ConfigError, match=r"key '0\.a' is given twice, on lines 1 and 1 "):
        read_yaml(path)


def test_a_mapping_used_as_a_key_is_invalid_yaml_in_one_line(tmp_path):
    """YAML's complex keys (`? [a, b]`) cannot be read into a recipe: the same one-line refusal
    as any invalid YAML, not a TypeError from the duplicate-key check."""
    path = tmp_path / "complex.yaml"
    path.write_text("? [a, b]\n: 1\nname: x\n")
    from mmviews.config import read_yaml

    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not valid YAML: while constructing a mapping"):
        read_yaml(path)


def test_wrong_type_names_key_and_file(tmp_path):
    raw = tiny_config()
    raw["data"]["batch_size"] = "sixteen"
    path = write_recipe(tmp_path / "bad_type.yaml", raw)
    with pytest.raises(ConfigError, match=r"bad_type\.yaml.*'data\.batch_size'.*expected int.*sixteen"):
        load_config(path)
    raw["data"]["batch_size"] = 16
    raw["optimisation"]["mixed_precision"] = "fp8"
    with pytest.raises(ConfigError, match=r"'optimisation\.mixed_precision'.*one of 'auto', 'no', 'bf16', 'fp16'"):
        load_config(write_recipe(tmp_path / "bad_literal.yaml", raw))


def test_a_misspelt_choice_gets_a_did_you_mean(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", tiny_config())
    with pytest.raises(ConfigError, match=r"'output\.trackers\.0'.*got str 'mlfow' \(did you mean 'mlflow'\?\)$"):
        load_config(path, ["output.trackers=[mlfow]"])
    with pytest.raises(ConfigError, match=r"got str 'bf61' \(did you mean 'bf16'\?\)$"):
        load_config(path, ["optimisation.mixed_precision=bf61"])
    with pytest.raises(ConfigError, match=r"got str 'zzz'$"):  # nothing close: no guess
        load_config(path, ["optimisation.mixed_precision=zzz"])


def test_fsdp_with_fp16_is_refused_at_load_on_any_number_of_processes(tmp_path):
    """Refused when the recipe is read (``--check`` of one process included), not only once a
    launch of several processes has started."""
    path = write_recipe(tmp_path / "r.yaml", tiny_config())
    with pytest.raises(ConfigError, match=r"'optimisation\.mixed_precision': fp16 is not supported with "
                                          r"distributed\.sharding: fsdp .*use bf16"):
        load_config(path, ["distributed.sharding=fsdp", "optimisation.mixed_precision=fp16"])
    for allowed in (["distributed.sharding=fsdp", "optimisation.mixed_precision=bf16"],
                    ["optimisation.mixed_precision=fp16"]):
        load_config(path, allowed)


def test_yaml_words_read_as_bools_mean_the_choice_spelled_so(tmp_path):
    """YAML 1.1 reads an unquoted `no` as False: `mixed_precision: no` in a recipe and
    `--set optimisation.mixed_precision=no` (the spelling the error message itself lists) are
    the choice 'no'; a bool no choice is spelled as is still refused by name."""
    path = tmp_path / "r.yaml"
    raw = tiny_config()
    del raw["optimisation"]["mixed_precision"]  # written below as a recipe author would
    path.write_text(write_recipe(tmp_path / "base.yaml", raw).read_text()
                    .replace("optimisation:\n", "optimisation:\n  mixed_precision: no\n", 1))
    assert "mixed_precision: no\n" in path.read_text()
    assert load_config(path).optimisation.mixed_precision == "no"
    assert load_config(path, ["optimisation.mixed_precision=bf16", "optimisation.mixed_precision=no"]
                       ).optimisation.mixed_precision == "no"
    with pytest.raises(ConfigError, match=r"--set 'optimisation\.mixed_precision=yes'.*one of 'auto', 'no', 'bf16', 'fp16', got bool True"):
        load_config(path, ["optimisation.mixed_precision=yes"])
    with pytest.raises(ConfigError, match=r"'optimisation\.schedule'.*got bool False"):
        load_config(path, ["optimisation.schedule=off"])


def test_bad_override_is_named(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", tiny_config())
    with pytest.raises(ConfigError, match=r"--set 'optimisation\.lrr=1'.*unknown key 'optimisation\.lrr'"):
        load_config(path, ["optimisation.lrr=1"])
    with pytest.raises(ConfigError, match=r"KEY=VALUE"):
        load_config(path, ["optimisation.lr"])
    # a bad value names the --set that gave it, not the recipe file
    with pytest.raises(ConfigError, match=r"^--set 'optimisation\.epochs=many': key 'optimisation\.epochs': expected int"):
        load_config(path, ["optimisation.epochs=many"])
    # Free-form sections accept new keys (their owner validates them).
    assert apply_overrides({"data": {}}, ["data.options.extra=1"])["data"]["options"] == {"extra": 1}


def test_value_ranges(tmp_path):
    with pytest.raises(ConfigError, match=r"'data\.batch_size'.*>= 2"):
        config_from_dict({**tiny_config(), "data": {**tiny_config()["data"], "batch_size": 1}}, "x.yaml")


def test_recipe_names_resolve():
    assert resolve_recipe("quickstart") == REPO / "recipes" / "quickstart.yaml"
    with pytest.raises(FileNotFoundError, match="quickstart"):  # lists the known recipes
        resolve_recipe("no_such_recipe")
    assert {p.stem for p in list_recipes()} >= {p.stem for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_parses_and_validates(recipe):
    config = load_config(recipe)
    assert config.views and config.adapters and config.evaluation.tasks, recipe
    if config.data.root is None:
        parts = build_run(config, source=str(recipe), with_eval=False)  # the objective fits the views
        assert len(parts.view_spec) >= 2
    else:
        # Data that is not here: a clear message pointing to the dataset's card.
        with pytest.raises(FileNotFoundError, match=rf"dataset '{config.data.name}' not found at .*data_cards/{config.data.name}\.md"):
            build_run(config, source=str(recipe))


def test_simclr_with_three_views_fails_before_work(tmp_path):
    raw = tiny_config()
    raw["objective"] = {"name": "simclr", "params": {}}
    path = write_recipe(tmp_path / "simclr3.yaml", raw)
    with pytest.raises(ConfigError, match=r"simclr3\.yaml.*simclr.*exactly 2 views.*M = 3"):
        build_run(load_config(path), source=str(path))


def test_cli_errors_are_clear_and_early(tmp_path, capsys):
    # simclr with M = 3, a missing dataset path, an unknown key: exit code 2, one clear line, no run folder.
    # (In this process, through the CLI's main: the errors are the CLI's own, not a fresh process's.)
    from crafted_files import cli

    raw = tiny_config()
    raw["objective"] = {"name": "simclr"}
    rc, _, err = cli(capsys, "train", str(write_recipe(tmp_path / "s.yaml", raw)), "--output", str(tmp_path / "run1"))
    assert rc == 2 and "needs exactly 2 views" in err and "Traceback" not in err
    rc, _, err = cli(capsys, "train", "mosi", "--set", f"data.root={tmp_path / 'nowhere.pkl'}", "--output",
                     str(tmp_path / "run2"))
    assert rc == 2 and f"not found at {tmp_path / 'nowhere.pkl'}" in err and "data_cards/mosi.md" in err
    rc, _, err = cli(capsys, "train", "quickstart", "--set", "optimisation.lrr=1", "--output", str(tmp_path / "run3"))
    assert rc == 2 and "unknown key 'optimisation.lrr'" in err
    assert not any((tmp_path / f"run{i}").exists() for i in (1, 2, 3))


def test_lars_matches_hand_computation():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(4))
    opt = LARS([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=0.5, momentum=0.9, eta=0.02)
    w0, b0 = w.detach().clone(), b.detach().clone()
    gw, gb = torch.randn(4, 3), torch.randn(4)
    w.grad, b.grad = gw.clone(), gb.clone()
    opt.step()
    u = gw + 0.1 * w0
    u = u * (0.02 * w0.norm() / u.norm())
    torch.testing.assert_close(w.detach(), w0 - 0.5 * u)
    torch.testing.assert_close(b.detach(), b0 - 0.5 * gb)  # no decay: plain momentum-SGD step
    # Second step: momentum buffer = 0.9 * previous update + new update.
    w1 = w.detach().clone()
    w.grad = gw.clone()
    opt.step()
    u2 = gw + 0.1 * w1
    u2 = u2 * (0.02 * w1.norm() / u2.norm())
    torch.testing.assert_close(w.detach(), w1 - 0.5 * (0.9 * u + u2))


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("warmup_steps, warmup_epochs, total", [(0, 0.0, 10), (3, 0.0, 10), (0, 0.5, 12), (2, 1.0, 5),
                                                                 (40, 0.0, 7), (1, 0.0, 1)])
def test_schedule_is_transformers_schedule_step_for_step(schedule, warmup_steps, warmup_epochs, total):
    """mmviews builds its warm-up + cosine/constant schedule itself (importing transformers'
    would cost every run seconds); it must be transformers' schedule at every step, and its state
    dict must load into transformers' scheduler (checkpoints written before keep resuming)."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    from mmviews.train.optim import build_scheduler

    steps_per_epoch = 4
    config = OptimisationConfig(lr=0.1, warmup_steps=warmup_steps, warmup_epochs=warmup_epochs, schedule=schedule)
    warmup = min(warmup_steps + int(round(warmup_epochs * steps_per_epoch)), max(total - 1, 0))

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    ours_opt, theirs_opt = optimizer(), optimizer()
    ours = build_scheduler(ours_opt, config, total, steps_per_epoch)
    theirs = (get_cosine_schedule_with_warmup(theirs_opt, num_warmup_steps=warmup, num_training_steps=total)
              if schedule == "cosine" else get_constant_schedule_with_warmup(theirs_opt, num_warmup_steps=warmup))
    for step in range(total + 2):
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=1e-12), f"step {step}"
        if step == total // 2:  # a checkpoint of ours resumes in theirs and back
            theirs.load_state_dict(ours.state_dict())
            ours.load_state_dict(theirs.state_dict())
        ours_opt.step(), theirs_opt.step()
        ours.step(), theirs.step()


def test_check_flag_validates_without_training(tmp_path, capsys):
    from mmviews.cli import main

    recipe = write_recipe(tmp_path / "ok.yaml", tiny_config())
    assert main(["train", str(recipe), "--check", "--output", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "OK (3 views: text_0, text_aug_0, image_0; objective mv_dhel; 64 training samples)" in out
    assert not (tmp_path / "run").exists()
