"""Recipe files (``mmviews.config``): where a bare recipe name is looked up
(``$MMVIEWS_RECIPES``, then ``./recipes``, then the shipped recipes; a folder reached twice listed
once), where a recipe file comes from, how a missing one is reported (did-you-mean, the folders
searched, the known names), what ``read_yaml`` accepts, how ``save_config`` writes, and that the
views are resolved when the recipe loads with errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmviews.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    list_recipes,
    load_config,
    read_yaml,
    recipe_origin,
    recipe_sources,
    recipes_dirs,
    resolve_recipe,
    save_config,
)
from mmviews.resources import resource_dir

MINIMAL = {"views": ["x"], "adapters": {"x": {"type": "mlp", "input_dim": 4}}}


@pytest.fixture
def places(tmp_path, monkeypatch):
    """``$MMVIEWS_RECIPES`` -> tmp/env, the current folder tmp/cwd (its ./recipes made); each
    holds one recipe of its own, and both a ``shared`` one."""
    env, cwd = tmp_path / "env", tmp_path / "cwd"
    for folder, own in ((env, "from_env"), (cwd / "recipes", "from_cwd")):
        folder.mkdir(parents=True)
        (folder / f"{own}.yaml").write_text(yaml.safe_dump(MINIMAL))
        (folder / "shared.yaml").write_text(yaml.safe_dump({**MINIMAL, "name": own}))
    monkeypatch.setenv("MMVIEWS_RECIPES", str(env))
    monkeypatch.chdir(cwd)
    return env, cwd / "recipes"


def test_recipe_folders_are_searched_env_then_local_then_shipped(places):
    env, local = places
    shipped = resource_dir("recipes")
    assert shipped is not None and (shipped[0] / "quickstart.yaml").is_file()
    assert recipe_sources() == [(env, "MMVIEWS_RECIPES"), (Path.cwd() / "recipes", "local"), shipped]
    assert recipes_dirs() == [env, local, shipped[0]]
    assert resolve_recipe("shared") == env / "shared.yaml"  # the first folder wins
    assert resolve_recipe("from_cwd") == local / "from_cwd.yaml"
    found = {p.stem: p for p in list_recipes()}
    assert found["shared"] == env / "shared.yaml" and found["from_cwd"] == local / "from_cwd.yaml"
    assert found["quickstart"] == shipped[0] / "quickstart.yaml"
    assert list(found) == sorted(found)


def test_a_folder_reached_twice_is_listed_once_with_its_first_origin(places, monkeypatch):
    _, local = places
    monkeypatch.setenv("MMVIEWS_RECIPES", str(local))
    shipped = resource_dir("recipes")
    assert recipe_sources() == [(local, "MMVIEWS_RECIPES"), shipped]
    monkeypatch.delenv("MMVIEWS_RECIPES")
    assert recipe_sources() == [(local.resolve(), "local"), shipped]
    monkeypatch.setenv("MMVIEWS_RECIPES", "")  # set but empty: not a folder
    assert recipe_sources() == [(local.resolve(), "local"), shipped]


def test_a_recipe_file_names_where_it_comes_from(places, tmp_path):
    env, local = places
    shipped, shipped_origin = resource_dir("recipes")
    assert recipe_origin(env / "from_env.yaml") == "MMVIEWS_RECIPES"
    assert recipe_origin(local / "from_cwd.yaml") == "local"
    assert recipe_origin(Path("recipes") / "from_cwd.yaml") == "local"  # relative to the current folder
    assert recipe_origin(shipped / "quickstart.yaml") == shipped_origin
    assert recipe_origin(tmp_path / "elsewhere.yaml") == "path"


def test_a_bare_name_finds_a_yml_recipe_too(places):
    env, _ = places
    (env / "short.yml").write_text(yaml.safe_dump(MINIMAL))
    assert resolve_recipe("short") == env / "short.yml"
    (env / "short.yaml").write_text(yaml.safe_dump(MINIMAL))
    assert resolve_recipe("short") == env / "short.yaml"  # .yaml first


def test_only_a_bare_name_is_looked_up(places):
    """A name with a folder or a .yaml/.yml suffix is a path: missing, it is not searched for."""
    env, _ = places
    for odd in ("a.yaml.yaml", "b.yml.yaml", "c.yaml.yml"):
        (env / odd).write_text(yaml.safe_dump(MINIMAL))
    for path in ("a.yaml", "b.yml", "c.yaml", "sub/from_env"):
        with pytest.raises(FileNotFoundError, match=rf"^recipe '{path}' not found"):
            resolve_recipe(path)
    assert resolve_recipe(env / "from_env.yaml") == env / "from_env.yaml"  # an existing path as given


def test_a_missing_recipe_is_reported_with_a_hint_the_folders_and_the_known_names(places):
    names = [p.stem for p in list_recipes()]
    assert "from_env" in names and "quickstart" in names
    with pytest.raises(FileNotFoundError) as caught:
        resolve_recipe("quickstrat")
    assert str(caught.value) == (
        "recipe 'quickstrat' not found (did you mean 'quickstart'?) (not a file, nor a name in "
        f"{', '.join(str(d) for d in recipes_dirs())}); known recipes: {', '.join(names)}")


def test_no_recipe_anywhere_is_said(tmp_path, monkeypatch):
    """An installation without shipped recipes (a wheel built without them), none local."""
    monkeypatch.delenv("MMVIEWS_RECIPES", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mmviews.resources.resource_dir", lambda kind: None)
    assert recipe_sources() == [(tmp_path / "recipes", "local")]
    with pytest.raises(FileNotFoundError) as caught:
        resolve_recipe("quickstart")
    assert str(caught.value) == (f"recipe 'quickstart' not found (not a file, nor a name in {tmp_path / 'recipes'}); "
                                 "known recipes: none found")


def test_read_yaml_takes_a_mapping_or_an_empty_file(tmp_path):
    path = tmp_path / "r.yaml"
    with pytest.raises(FileNotFoundError) as caught:
        read_yaml(path)
    assert str(caught.value) == f"recipe not found: {path}"
    path.write_text("")
    assert read_yaml(path) == {}
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as caught:
        read_yaml(path)
    assert str(caught.value) == f"{path}: a recipe must be a YAML mapping, got list"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError) as caught:
        read_yaml(path)
    assert str(caught.value).startswith(f"{path}: not valid YAML: ")
    path.write_text("name: ok\nseed: 3\n")
    assert read_yaml(str(path)) == {"name": "ok", "seed": 3}


def test_an_empty_recipe_file_is_refused_for_its_missing_views(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: key 'views': at least one view entry is needed"


def test_a_saved_recipe_keeps_the_field_order_and_short_lists_inline(tmp_path):
    config = config_from_dict(MINIMAL, "r.yaml")
    text = save_config(config, tmp_path / "config.yaml").read_text()
    top = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith(" ")]
    assert top == list(TrainConfig.__dataclass_fields__)  # the schema's order, not sorted
    assert "  betas: [0.9, 0.999]\n" in text and "views: [x]\n" in text


def test_errors_without_a_source_name_the_config():
    with pytest.raises(ConfigError) as caught:
        config_from_dict({**MINIMAL, "seed": "x"})
    assert str(caught.value) == "<config>: key 'seed': expected int, got str 'x'"


def test_the_views_are_resolved_when_the_recipe_loads():
    config = config_from_dict({**MINIMAL, "evaluation": {"views": ["x"]}}, "r.yaml")
    assert {"view_spec", "eval_view_spec"} <= vars(config).keys()
    assert [v.name for v in vars(config)["view_spec"].views] == ["x_0"]


def test_an_empty_list_of_evaluation_views_is_refused_naming_the_file():
    with pytest.raises(ConfigError) as caught:
        config_from_dict({**MINIMAL, "evaluation": {"views": []}}, "r.yaml")
    assert str(caught.value) == "r.yaml: key 'evaluation.views': a ViewSpec needs at least one view"
    with pytest.raises(ConfigError) as caught:
        TrainConfig(views=[]).view_spec
    assert str(caught.value) == "recipe: key 'views': a ViewSpec needs at least one view"
