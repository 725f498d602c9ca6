"""One spelling of the output flag across the commands (``--output``, old spellings kept as
aliases), and a bad argument exits with status 2 and one line. (``mmviews prepare``
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


def test_a_misspelt_command_gets_a_did_you_mean(capsys) -> None:
    with pytest.raises(SystemExit) as shown:
        main(["trian"])
    assert shown.value.code == 2
    assert "unknown command 'trian' (did you mean 'train'?); choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["zzzz"])
    assert "unknown command 'zzzz'; choose from" in capsys.readouterr().err


def test_a_recipe_error_under_a_launch_is_printed_by_the_first_process_only(tmp_path: Path, capsys,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process of a launch reads the same recipe and fails alike: one line, not one per
    process (all of them exit with status 2)."""
    from test_train_utils import tiny_config, write_recipe

    recipe = str(write_recipe(tmp_path / "r.yaml", tiny_config()))
    argv = ["train", recipe, "--check", "--set", "distributed.sharding=fsdp", "--set", "optimisation.mixed_precision=fp16"]
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("fp16 is not supported with distributed.sharding: fsdp") == lines, err


@pytest.mark.parametrize("argv", [
    ["train", "{recipe}", "--output", "{folder}/run"],
    ["train", "{recipe}", "--output", "{folder}/run", "--check"],
    ["export", "{run}", "--format", "hf", "--output", "{folder}/export"],
    ["export", "{run}", "--format", "onnx", "--output", "{folder}/export"],
    ["embed", "{run}", "{recipe}", "--output", "{folder}/e.parquet"],
    ["eval", "{run}", "--output", "{folder}/eval"],
    ["compare", "{run}", "--output", "{folder}/comparison"],
])
def test_an_unwritable_output_names_the_folder_given_and_the_fix(argv: list[str], tiny_run: Path, tmp_path: Path,
                                                                 capsys, monkeypatch) -> None:
    """Before any work (nothing is computed first): the --output the user gave, the folder that
    refused, the system's reason and the fix, in one line (``--check`` adds no disk-space warning
    about a folder it cannot write, even on a full disk)."""
    import mmviews.fileio
    from crafted_files import unwritable_folder

    monkeypatch.setattr(mmviews.fileio, "free_bytes", lambda folder: 0)

    folder = unwritable_folder(tmp_path)
    argv = [a.format(recipe=tiny_run / "config.yaml", run=tiny_run, folder=folder) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    (line,) = [ln for ln in err.splitlines() if ": error: " in ln]
    assert "Traceback" not in err and "bytes free" not in err  # the only line is the refusal: no disk-space warning
    given = argv[argv.index("--output") + 1]
    assert line.startswith(f"mmviews {argv[0]}: error: cannot write {given}: {folder} refuses new files ("), line
    assert line.endswith("); choose a folder this user can write to with --output"), line
    assert "embeddings (" not in err  # refused before the work
    assert ("--check" in argv) == (": OK (" in out)  # a dry run checks the recipe first


@pytest.mark.parametrize(("argv", "line"), [
    (["bench", "objectivs"], "mmviews bench: error: argument VERB: invalid choice: 'objectivs' (did you mean "
                             "'objectives'?); choose from adapters, data, dropout, gpu, objectives, onnx, scale, train"),
    (["list", "objectves"], "mmviews list: error: argument what: invalid choice: 'objectves' (did you mean "
                            "'objectives'?); choose from objectives, recipes, datasets, augmentations, adapters, tasks"),
    (["bench", "gpu", "--only", "memry"], "mmviews bench gpu: error: argument --only: invalid choice: 'memry' (did you "
                                          "mean 'memory'?); choose from tests, memory, step-time"),
    (["bench", "gpu", "--only", "zzz"], "mmviews bench gpu: error: argument --only: invalid choice: 'zzz'; choose from "
                                        "tests, memory, step-time"),
])
def test_a_mistyped_choice_names_the_closest_one(argv: list[str], line: str, capsys) -> None:
    """Sub-verbs and options with choices answer a typo as the unknown command does: the
    closest choice (when one is close), then all of them, in argparse's usage error (exit 2)."""
    with pytest.raises(SystemExit) as shown:
        main(argv)
    assert shown.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == line


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_option_exits_2(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as shown:
        main([command, "--no-such-option"])
    assert shown.value.code == 2
    assert f"mmviews {command}" in capsys.readouterr().err  # argparse's usage and error line


def check_latest_checkpoint_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's check: a user error (here an OSError, as a file that cannot be read) after
    three checkpoints (checkpoint_every 1, keep_last 3): the one line says the latest,
    checkpoint 3, is kept."""
    from test_train_utils import tiny_config, train_in_process, write_recipe

    import mmviews.cli.train as train_command
    from mmviews.run import list_checkpoints
    from mmviews.train.callbacks import TrainCallback

    class FailAtStep4(TrainCallback):
        def on_step_end(self, state) -> None:
            if state.step == 4:
                raise OSError("data/shard-3.parquet: cannot read (disk gone)")

    command = train_command.run
    monkeypatch.setattr(train_command, "run", lambda args: command(args, callback=FailAtStep4()))
    raw = tiny_config(text=False, num_samples=32, batch_size=8, epochs=2)
    raw["views"], raw["data"]["options"]["modalities"] = [{"modality": "image", "copies": 2}], ["image"]
    del raw["adapters"]["audio"]
    raw["output"].update(checkpoint_every=1, keep_last=3)
    raw["evaluation"]["random_baseline"] = False
    run = tmp_path / "run"
    r = train_in_process(str(write_recipe(tmp_path / "r.yaml", raw)), "--output", str(run))
    assert r.returncode == 2, r.stderr[-3000:]
    checkpoints = list_checkpoints(run)
    assert [c.name for c in checkpoints] == ["checkpoint-00000001", "checkpoint-00000002", "checkpoint-00000003"]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("mmviews train: error: data/shard-3.parquet: cannot read (disk gone)"), line
    assert f"the latest checkpoint is kept ({checkpoints[-1]})" in line and f"--resume {run}" in line, line


def test_an_error_mid_run_names_the_latest_checkpoint_not_the_oldest(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    check_latest_checkpoint_named(tmp_path, monkeypatch)


def test_latest_checkpoint_check_fails_when_the_hint_names_the_oldest(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation test: the hint takes the first of the run's checkpoints (oldest first) as the latest."""
    from mutations import apply_break

    apply_break("name_oldest_checkpoint", monkeypatch.setattr)
    with pytest.raises(AssertionError, match="the latest checkpoint is kept"):
        check_latest_checkpoint_named(tmp_path, monkeypatch)
