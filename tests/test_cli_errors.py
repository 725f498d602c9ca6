"""One spelling of the output flag across the commands (``--output``, old spellings kept as
aliases), and a bad argument exits with status 2 and one line (issue 29). (``mmviews prepare``
exits 1 when it finished but found problems in the data, which it lists on stdout.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmviews.cli import COMMANDS, main


@pytest.mark.parametrize("command", ["train", "eval", "compare", "prepare", "embed"])
def test_every_writing_command_takes_output(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as shown:
        main([command, "--help"])
    assert shown.value.code == 0
    assert "--output" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["train", "no-such-recipe"], "no-such-recipe"),
    (["eval", "{missing}"], "does not exist"),
    (["compare", "{missing}", "--output", "{tmp}/cmp"], "missing"),
    (["embed", "{missing}", "quickstart", "--output", "{tmp}/e.parquet"], "does not exist"),
    (["embed", "{missing}", "quickstart", "--output", "{tmp}/e.csv"], ".parquet"),
    (["eval", "{tmp}", "--device", "no-such-device"], "no-such-device"),
    (["prepare", "mosi", "{missing}"], "does not exist"),
    (["prepare", "mosi"], "needs PATH"),
    (["prepare", "mosi", "{tmp}", "--recipe", "quickstart"], "--recipe"),
])
def test_a_bad_argument_exits_2_with_one_line(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    argv = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmviews {argv[0]}: error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_option_exits_2(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as shown:
        main([command, "--no-such-option"])
    assert shown.value.code == 2
    assert f"mmviews {command}" in capsys.readouterr().err  # argparse's usage and error line
