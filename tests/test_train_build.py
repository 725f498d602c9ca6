"""The objective a run builds from its recipe (:func:`mmviews.train.build.build_objective`): the
key each refusal names (the recipe's ``objective.name``, ``objective.params`` or
``objective.ema_teacher``) with the message of the check that refused, and the dataset size
filled in for the objectives that take one. The recipes load in milliseconds; nothing trains."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mmviews.config import ConfigError, config_from_dict
from mmviews.train.build import build_objective
from test_train_sync import gaussian_config


def _config(name: str, params: dict[str, Any] | None = None, **objective: Any) -> Any:
    raw = gaussian_config({"name": name, "params": dict(params or {})})
    raw["objective"].update(objective)
    return config_from_dict(raw)


def _refusal(config: Any, num_views: int, *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        build_objective(config, num_views, *args, **kwargs)
    return caught.value


def test_an_objective_parameter_the_objective_refuses_names_objective_params() -> None:
    error = _refusal(_config("mv_dhel", {"temp": 0.2}), 4)
    assert isinstance(error.__cause__, (TypeError, ValueError))
    assert str(error) == f"recipe: key 'objective.params': {error.__cause__}"  # the recipe by default
    assert "'temp'" in str(error.__cause__)
    error = _refusal(_config("mv_dhel", {"temperature": -1.0}), 4, "runs/x/config.yaml")
    assert str(error) == f"runs/x/config.yaml: key 'objective.params': {error.__cause__}"


def test_an_unknown_objective_names_objective_name() -> None:
    """A name no objective has (the recipe's own check runs first; a config changed after loading
    reaches build_objective): ``objective.name``, even when a dataset size is given."""
    config = _config("mv_dhel")
    config = dataclasses.replace(config, objective=dataclasses.replace(config.objective, name="nope"))
    for dataset_size in (None, 100):
        error = _refusal(config, 4, dataset_size=dataset_size)
        assert isinstance(error.__cause__, ValueError) and "unknown objective 'nope'" in str(error.__cause__)
        assert str(error) == f"recipe: key 'objective.name': {error.__cause__}"


def test_a_view_count_the_objective_does_not_take_names_objective_name_and_m() -> None:
    error = _refusal(_config("simclr"), 3)
    assert isinstance(error.__cause__, ValueError) and "M = 3" in str(error.__cause__)
    assert str(error) == f"recipe: key 'objective.name': {error.__cause__}; the recipe's views give M = 3"
    assert build_objective(_config("simclr"), 2).name == "simclr"


def test_a_teacher_for_an_objective_without_one_names_objective_ema_teacher() -> None:
    error = _refusal(_config("mv_dhel", ema_teacher=True), 4, "r.yaml")
    assert str(error) == ("r.yaml: key 'objective.ema_teacher': objective 'mv_dhel' takes no teacher embeddings "
                          "(its loss has no 'teacher' argument)")
    objective = build_objective(_config("er", ema_teacher=True), 4)  # ER's loss takes the teacher's
    assert objective.takes_teacher and objective.name == "er"


def test_the_dataset_size_fills_only_an_objective_that_takes_one_and_only_when_the_recipe_leaves_it_out() -> None:
    """IPMC's view filter keeps a row per dataset sample: build_run gives the training split's
    size; a recipe's own value wins; objectives without such a parameter never get it."""
    ipmc = {"view_filter_k": 1}
    assert build_objective(_config("ipmc", ipmc), 4, dataset_size=100).dataset_size == 100
    assert build_objective(_config("ipmc", {**ipmc, "dataset_size": 50}), 4, dataset_size=100).dataset_size == 50
    # without a size from the run, the recipe's (or the constructor's refusal) decides
    assert build_objective(_config("ipmc", {**ipmc, "dataset_size": 50}), 4).dataset_size == 50
    with pytest.raises(ConfigError, match=r"^recipe: key 'objective.params': .*needs dataset_size"):
        build_objective(_config("ipmc", ipmc), 4)
    assert build_objective(_config("mv_dhel"), 4, dataset_size=100).name == "mv_dhel"  # takes none: not passed
