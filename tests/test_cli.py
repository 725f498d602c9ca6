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
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "mmviews demo: interrupted\n"


@pytest.mark.parametrize("what, expected", [("objectives", "mv_dhel"), ("recipes", "quickstart"), ("datasets", "synthetic")])
def test_list(capsys, what, expected):
    assert main(["list", what]) == 0
    assert expected in capsys.readouterr().out.split()
