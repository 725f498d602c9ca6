"""The `mmviews` command line: help, version, unknown commands, and the demo's falling loss."""

import re
import subprocess
import sys

import pytest

from mmviews.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_names_it(capsys):
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "trian" in capsys.readouterr().err


def test_console_script_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "mmviews.cli", "--version"], capture_output=True, text=True, check=True)
    assert re.fullmatch(r"\d+\.\d+\.\d+\s*", out.stdout)


def test_demo_loss_falls(capsys):
    assert main(["demo", "--steps", "60", "--batch", "64", "--views", "3"]) == 0
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", capsys.readouterr().out)]
    assert len(losses) >= 5
    assert losses[-1] < losses[0] - 0.5


def test_demo_picks_the_views_a_two_view_objective_needs(capsys):
    # simclr is defined for M = 2 only; the demo's default of 4 views would fail.
    assert main(["demo", "--objective", "simclr", "--steps", "2", "--batch", "16"]) == 0
    assert "M = 2" in capsys.readouterr().out


def test_ctrl_c_is_one_line_with_status_130(capsys, monkeypatch):
    import mmviews.demo

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mmviews.demo, "run", interrupted)
    try:
        status = main(["demo"])
    except KeyboardInterrupt:  # caught here: left to pytest it would end the session as a Ctrl-C
        pytest.fail("Ctrl-C without --debug is the command's status, not a KeyboardInterrupt out of main")
    assert status == 130
    assert capsys.readouterr().err == "mmviews demo: interrupted\n"


@pytest.mark.parametrize("what, expected", [("objectives", "mv_dhel"), ("recipes", "quickstart"), ("datasets", "synthetic")])
def test_list(capsys, what, expected):
    assert main(["list", what]) == 0
    assert expected in capsys.readouterr().out.split()


def _listed(capsys, what):
    assert main(["list", what]) == 0
    lines = capsys.readouterr().out.splitlines()
    # "name  description" lines, each followed by an indented "param: default, ..." line
    entries, name = {}, None
    for line in lines:
        if line.startswith("    "):
            entries[name] = line.strip()
        else:
            name = line.split("  ")[0].strip()
            entries[name] = ""
    return entries


def test_list_augmentations_shows_every_parameter_with_its_default(capsys):
    import inspect

    from mmviews.data import list_augmentations
    from mmviews.data.augment import _AUGMENTATIONS

    entries = _listed(capsys, "augmentations")
    assert set(entries) == set(list_augmentations())
    for name in list_augmentations():  # read from the factories' signatures, nothing hand-kept
        for parameter in inspect.signature(_AUGMENTATIONS.get(name)).parameters.values():
            assert f"{parameter.name}: " in entries[name], (name, parameter.name)
    assert "strength: 1.0" in entries["simclr"] and "scale: [0.08, 1.0]" in entries["simclr"]


def test_list_adapters_and_tasks_show_their_parameters(capsys):
    import dataclasses

    from mmviews.modalities import adapter_class, list_adapters
    from mmviews.modalities.config import AdapterConfig

    entries = _listed(capsys, "adapters")
    common = {field.name for field in dataclasses.fields(AdapterConfig)}
    for name in common:  # embed_dim, head, finetune, gradient_checkpointing...: listed once
        assert f"{name}: " in entries["(every adapter)"], name
    for type_name in list_adapters():
        config = adapter_class(type_name).config_class()
        for field in dataclasses.fields(config):
            if field.name not in common:
                assert f"{field.name}: " in entries[type_name], (type_name, field.name)
    assert "channels: [32, 64, 128]" in entries["small_cnn"]
    assert "embed_dim: 128" in entries["(every adapter)"] and "head: {kind: mlp" in entries["(every adapter)"]
    tasks = _listed(capsys, "tasks")
    assert tasks["knn"] == "k: 200, temperature: 0.07"
    assert tasks["diagnostics"] == "kappa: 10.0, max_samples: 4096"
    assert "weight_decays: [1e-05" in tasks["linear"] and "max_iter: 100" in tasks["linear"]


def test_list_objectives_shows_defaults_and_presets(capsys):
    entries = _listed(capsys, "objectives")
    assert "temperature: 0.1" in entries["mv_dhel"]
    assert "gamma: 4.0 (measured) / 64.0 (paper)" in entries["ipmc"] and "preset: measured" in entries["ipmc"]
    assert "divergence: pearson" in entries["fmicl"]


def test_every_registered_dataset_has_a_card(capsys):
    from mmviews.data import list_datasets
    from mmviews.resources import data_card

    assert [name for name in list_datasets() if data_card(name) is None] == []
    assert main(["list", "datasets"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert all("card: " in row for row in rows) and any(row.startswith("hf ") for row in rows)
