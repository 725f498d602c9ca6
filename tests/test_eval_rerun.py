"""`mmviews eval RUN` reproduces the run's own report: it evaluates with the
run's recorded precision (bf16 autocast here, on CPU), seed, fusion and views, so that with the
run's tasks it prints report.md's numbers to the printed digits; and it writes a new folder
(`RUN/eval-N`, named in its output), never the run's final evaluation that report.md links to."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from test_train_utils import tiny_config, train_in_process, write_recipe

from mmviews.cli import main
from mmviews.eval.report import format_metric

TASKS = ["linear:class", "knn:class", "retrieval", "diagnostics"]
_ROW = re.compile(r"^\| (\S+) \| ([^|]*) \|")
TRAIN_OUTPUT: dict[str, str] = {}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny finished run trained and evaluated under bf16 autocast on CPU, with seed 3 (a
    seed other than the eval command's old default 0). Its terminal output: TRAIN_OUTPUT."""
    tmp = tmp_path_factory.mktemp("bf16")
    raw = tiny_config(num_samples=64, epochs=2, tasks=TASKS)
    raw["seed"] = 3
    raw["cpu"] = True
    raw["optimisation"]["mixed_precision"] = "bf16"
    raw["output"]["checkpoint_every"] = 0
    raw["evaluation"]["plots"] = False  # numbers only (the PNGs of its two reports: about 2 s of matplotlib)
    recipe = write_recipe(tmp / "bf16.yaml", raw)
    run = tmp / "run"
    r = train_in_process(str(recipe), "--output", str(run))  # its terminal output: what it prints to sys.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    TRAIN_OUTPUT["stdout"] = r.stdout
    return run


def table(path: Path) -> dict[str, str]:
    """First value column of a Markdown metric table (report.md: trained; summary.md: value)."""
    rows = {}
    for line in path.read_text().splitlines():
        found = _ROW.match(line)
        if found and found.group(1) not in ("metric", "---"):
            rows[found.group(1)] = found.group(2).strip()
    return rows


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def check_eval_reproduces_report(run: Path, capsys: pytest.CaptureFixture[str], *options: str) -> Path:
    """The guard's check: ``mmviews eval RUN`` (no options but ``options``) gives every number
    of report.md."""
    before = folder_digest(run / "eval")
    report = table(run / "report.md")
    assert report and {"test/linear/class/acc", "test/knn/class/top1", "test/diag/unif"} <= set(report), report
    capsys.readouterr()
    assert main(["eval", str(run), *options]) == 0
    out = capsys.readouterr().out
    written = re.search(r"report written to (\S+)", out)
    assert written is not None, out
    new = Path(written.group(1))
    assert new.parent == run and new.name.startswith("eval-"), new
    again = table(new / "summary.md")
    assert {k: again.get(k) for k in report} == report
    assert folder_digest(run / "eval") == before  # the final evaluation report.md links to is untouched
    return new


def test_eval_reproduces_the_report_of_a_bf16_run_in_a_new_folder(bf16_run: Path, capsys):
    first = check_eval_reproduces_report(bf16_run, capsys)
    assert first.name == "eval-1"
    meta = json.loads((first / "metrics.json").read_text())["meta"]
    assert (meta["precision"], meta["seed"]) == ("bf16", 3)  # the run's, recorded beside the numbers
    # the next evaluation takes the next free folder
    from mmviews.cli.eval import default_output

    assert default_output(bf16_run) == bf16_run / "eval-2"


@pytest.mark.parametrize("name", ["eval", "eval_random", "eval_epoch_1"])
def test_eval_refuses_the_runs_own_evaluation_folders(bf16_run: Path, capsys, name: str):
    before = folder_digest(bf16_run)
    assert main(["eval", str(bf16_run), "--out", str(bf16_run / name)]) == 2  # the old spelling still works
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bf16_run / name} is the run's own evaluation" in err, err
    assert folder_digest(bf16_run) == before


def test_eval_reproduction_check_fails_when_eval_runs_in_float32(bf16_run: Path, capsys, monkeypatch, tmp_path):
    """Mutation test: with the encoder's forward in float32 (the old behaviour), the check fails."""
    from mutations import apply_break

    apply_break("eval_in_float32", monkeypatch.setattr)
    with pytest.raises(AssertionError):  # (no training-curve plot: it changes no number and takes time)
        check_eval_reproduces_report(bf16_run, capsys, "--log-csv", str(tmp_path / "no-log.csv"))


def test_train_ends_with_the_headline_metrics_on_the_terminal(bf16_run: Path):
    """`mmviews train` prints the probes and R@1, trained against random init (and chance),
    the numbers of results.json."""
    out = TRAIN_OUTPUT["stdout"]
    results = json.loads((bf16_run / "results.json").read_text())
    assert "test metrics, trained vs random init:" in out, out
    headline = {h["metric"]: h for h in results["headline"]}
    assert {"test/linear/class/acc", "test/knn/class/top1", "test/retrieval/text_0->image_0/R@1"} <= set(headline)
    for key in ("test/linear/class/acc", "test/retrieval/text_0->image_0/R@1"):
        t, r = results["eval"][key], results["eval_random"][key]
        line = next(line for line in out.splitlines() if line.strip().startswith(key + " "))
        assert (f"trained {format_metric(t)}" in line and f"random init {format_metric(r)}" in line
                and f"({format_metric(t - r, signed=True)})" in line), line
    n = results["eval"]["test/retrieval/text_0->image_0/n"]
    assert headline["test/retrieval/text_0->image_0/R@1"]["chance"] == 1 / n
    assert f"chance {format_metric(1 / n)}" in next(line for line in out.splitlines() if "text_0->image_0/R@1" in line)
    # the class probe's chance: the training majority class's share of the test labels, recorded by the evaluation
    chance = results["eval"]["chance/test/linear/class/acc"]
    assert headline["test/linear/class/acc"]["chance"] == chance and 0 < chance < 1
    assert f"chance {format_metric(chance)}" in next(line for line in out.splitlines()
                                                    if line.strip().startswith("test/linear/class/acc "))


def test_embed_writes_every_view_of_every_sample_to_parquet(bf16_run: Path, tmp_path: Path, capsys):
    import datasets
    import torch

    from mmviews.data.loaders import build_eval_loaders, eval_view_config
    from mmviews.modalities.multiview import MultiViewEncoder
    from mmviews.config import load_config

    out = tmp_path / "emb.parquet"
    assert main(["embed", str(bf16_run), str(bf16_run / "config.yaml"), "--output", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    table = datasets.Dataset.from_parquet(str(out))
    config = load_config(bf16_run / "config.yaml")
    loaders = build_eval_loaders(config.data, eval_view_config(config.view_spec), config.seed)
    sizes = {split: len(loader.dataset) for split, loader in loaders.items() if loader is not None}
    assert table.num_rows == sum(sizes.values())
    # the splits named as the dataset names them (the recipe's data.*_split: "valid", not "val")
    named = {"train": config.data.train_split, "val": config.data.val_split, "test": config.data.test_split}
    assert config.data.val_split == "valid" and set(table["split"]) == {named[key] for key in sizes}
    assert [table["split"].count(named[key]) for key in sizes] == list(sizes.values())
    # every label of the synthetic data (its content too) and each view's embedding
    assert set(table.column_names) == {"split", "sample_id", "class", "sentiment", "content_u", "content_v", "text_0",
                                       "image_0"}
    # stored as float32 lists (the encoder's precision), not float64
    import pyarrow.parquet as pq

    schema = pq.read_schema(out)
    assert {str(schema.field(name).type) for name in ("text_0", "image_0")} == {"list<element: float>"}, schema
    # the reference: the saved encoder run by hand under the run's bf16 autocast, batch by batch
    encoder = MultiViewEncoder.from_pretrained(bf16_run / "encoder").eval()
    test_rows = table.filter(lambda row: row["split"] == "test")
    got = {name: torch.tensor(test_rows[name]) for name in ("text_0", "image_0")}
    start = 0
    with torch.no_grad():
        for batch in loaders["test"]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z, mask = encoder(batch)
            k = batch.num_samples
            assert test_rows["sample_id"][start:start + k] == batch.index.tolist()
            assert test_rows["class"][start:start + k] == batch.labels["class"].tolist()
            for m, name in enumerate(("text_0", "image_0")):
                torch.testing.assert_close(got[name][start:start + k], z[:, m].float(), rtol=0, atol=1e-6)
            start += k
    assert start == len(test_rows)
    # a dataset folder instead of a recipe: read with the run's own data section (the synthetic
    # data ignores data.root, so the same samples)
    (tmp_path / "data").mkdir()
    again = tmp_path / "again.parquet"
    assert main(["embed", str(bf16_run), str(tmp_path / "data"), "--output", str(again)]) == 0
    assert datasets.Dataset.from_parquet(str(again))["image_0"] == table["image_0"]
    # refuses to replace the file without --overwrite
    assert main(["embed", str(bf16_run), str(bf16_run / "config.yaml"), "--output", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
