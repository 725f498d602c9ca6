"""What ``mmviews compare`` puts first: the over-seeds table (mean ± std per setting), the table a
comparison of seeds is run for, before the per-run rows, in ``comparison.md`` and on the terminal;
the terminal gets the headline metrics only unless ``--all`` (every metric, the whole file)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_eval_compare import write_run

from mmviews.cli import main


@pytest.fixture
def seeded_runs(tmp_path: Path) -> list[str]:
    """Two settings (lr 0.1, lr 0.2) of two seeds each, with a headline metric, a count and
    a per-pair figure (not headline)."""
    runs = []
    for lr, values in ((0.1, (0.50, 0.70)), (0.2, (0.80, 0.84))):
        for seed, acc in enumerate(values):
            config = {"name": "toy", "optimisation": {"lr": lr}, "seed": seed}
            metrics = {"test/linear/class/acc": acc, "test/retrieval/a->b/n": 64.0, "test/retrieval/a->b/MedR": 3.0 + seed}
            runs.append(str(write_run(tmp_path, f"lr{lr}-s{seed}", metrics, config=config)))
    return runs


def test_the_seeds_table_leads_the_file_and_the_terminal(seeded_runs: list[str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cmp"
    assert main(["compare", *seeded_runs, "--output", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    # mean ± sample std per setting, computed here from the values written above
    first = "| test/linear/class/acc | 0.6000 ± 0.1414 (n=2) | 0.8200 ± 0.0283 (n=2) |"
    for text in (printed, (out_dir / "comparison.md").read_text()):
        assert text.index("## Over seeds") < text.index("## Per run"), text
        assert first in text, text
    # the terminal: headline metrics only (no count, no per-pair rank), and where the rest is
    assert "MedR" not in printed and "/n |" not in printed
    assert "| test/linear/class/acc | 0.5000 | 0.7000 | 0.8000 | 0.8400 |" in printed  # the per-run rows follow
    assert f"every metric and the random-init margins: {out_dir / 'comparison.md'} (or mmviews compare ... --all)" \
        in printed
    written = (out_dir / "comparison.md").read_text()
    assert "test/retrieval/a->b/MedR" in written
    # a count (/n) is the same for every seed: no row over seeds, a row per run
    seeds = written[written.index("## Over seeds"):written.index("## Per run")]
    assert "| test/retrieval/a->b/MedR |" in seeds and "/n |" not in seeds
    assert "| test/retrieval/a->b/n |" in written[written.index("## Per run"):]
    # one printed line per line of the summary, and the files written, comma-separated, last
    assert printed.startswith("## Over seeds\n\nRuns that differ only in their seed"), printed
    last = printed.splitlines()[-1]
    assert last.startswith("written: ") and sorted(last[len("written: "):].split(", ")) == sorted(
        str(out_dir / name) for name in ("comparison.csv", "comparison.json", "comparison.md", "metrics_bar.png"))


def test_all_prints_the_whole_comparison(seeded_runs: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cmp"
    assert main(["compare", *seeded_runs, "--output", str(out_dir), "--all"]) == 0
    printed = capsys.readouterr().out
    assert (out_dir / "comparison.md").read_text() in printed and "test/retrieval/a->b/MedR" in printed


def test_runs_without_seeds_lead_with_the_per_run_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [str(write_run(tmp_path, f"r{i}", {"test/linear/class/acc": 0.5 + i / 10})) for i in range(2)]
    assert main(["compare", *runs, "--output", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "Over seeds" not in printed and printed.startswith("## Per run")
