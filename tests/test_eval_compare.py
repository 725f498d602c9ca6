"""``mmviews compare``'s numbers (mmviews.eval.compare), each against a value the test computes
itself: mean and sample standard deviation over seeds (``statistics``), the "within noise" band
(two standard errors of the difference of the means), which runs are seeds of one configuration,
and what is read from a run folder. (The comparison's tables end to end: test_eval_chance.py
and test_eval_report.py.)"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmviews.eval import compare

# headline metrics as the trainer names them (the probes' and retrieval's)
ACC = "test/linear/class/acc"
R1 = "test/retrieval/mean/R@1"


@pytest.mark.parametrize("values", [[0.5], [0.70, 0.74, 0.72], [1.0, 2.0], [0.1, 0.4, 0.2, 0.9, 0.3]])
def test_mean_and_sample_std(values):
    mean, std = compare.mean_and_std(values)
    assert mean == pytest.approx(statistics.fmean(values))
    if len(values) == 1:
        assert std is None
    else:
        assert std == pytest.approx(statistics.stdev(values))


def _band(a: list[float], b: list[float]) -> float:
    """Two standard errors of the difference of the means (Welch): 2 sqrt(s_a^2/n_a + s_b^2/n_b)."""
    return 2 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def test_within_noise_is_two_standard_errors_of_the_difference():
    a = [0.70, 0.74, 0.72, 0.71, 0.73]
    b = [0.73, 0.77, 0.75, 0.74, 0.76]  # the means differ by 0.03
    # standard errors put 0.03 outside the band (0.020); standard deviations (2 sqrt(s_a^2 + s_b^2) = 0.045) would not
    assert _band(a, b) < 0.03 < 2 * math.sqrt(statistics.variance(a) + statistics.variance(b))
    within, band = compare.within_noise(a, b)
    assert band == pytest.approx(_band(a, b)) and within is False
    close = [0.71, 0.75, 0.73, 0.72, 0.74]  # 0.01 apart
    within, band = compare.within_noise(a, close)
    assert band == pytest.approx(_band(a, close)) and within is True
    # at the band's edge: equal is within
    edge_a, edge_b = [0.0, 2.0], [3.0, 5.0]
    assert _band(edge_a, edge_b) == pytest.approx(2 * math.sqrt(2 / 2 + 2 / 2))
    assert compare.within_noise(edge_a, [v - 3 + _band(edge_a, edge_b) for v in edge_b])[0] is True
    assert compare.within_noise(edge_a, [v - 3 + _band(edge_a, edge_b) + 1e-9 for v in edge_b])[0] is False
    assert compare.within_noise([0.5], b) is None and compare.within_noise(a, [0.5]) is None
    assert compare.NOISE_STANDARD_ERRORS == 2.0


def test_noise_guard_fails_when_the_band_is_of_standard_deviations(monkeypatch):
    from mutations import apply_break

    apply_break("noise_band_of_standard_deviations", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_within_noise_is_two_standard_errors_of_the_difference()


# --- what is read from a run, and how runs are grouped -------------------------------------------


def write_run(root: Path, name: str, metrics: dict, *, meta: dict | None = None, config: dict | None = None,
              results: dict | None = None, random_init: dict | None = None, log: str | None = None,
              where: str = "eval") -> Path:
    """A run folder as the trainer leaves one (only the files given)."""
    run = root / name
    folder = run / where if where else run
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"metrics": metrics, "meta": meta or {}}))
    if config is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    if results is not None:
        (run / "results.json").write_text(json.dumps(results))
    if random_init is not None:
        (run / "eval_random").mkdir()
        (run / "eval_random" / "metrics.json").write_text(json.dumps({"metrics": random_init}))
    if log is not None:
        (run / "metrics.csv").write_text(log)
    return run


def test_a_run_folder_is_read_with_what_the_trainer_wrote_beside_it(tmp_path: Path):
    run = write_run(tmp_path, "r1", {"test/knn/class/top1": 0.5, "flag": True, "missing": None, "text": "x", "n": 3},
                    meta={"objective": "mv_dhel", "num_views": 3}, config={"name": "toy", "seed": 4, "lr": 0.1},
                    results={"steps": 10, "final_loss": 1.5, "warnings": ["collapse: one", 7]},
                    random_init={"test/knn/class/top1": 0.25, "flag": False, "s": "x"},
                    log="step,loss,pos_sim,neg_sim,other\n1,2.0,0.5,x,9\n2,1.5,0.6,0.1,9\n")
    loaded = compare.load_run_metrics(run)
    assert loaded.label == "r1" and loaded.path == run
    assert set(loaded.metrics) == {"test/knn/class/top1", "missing", "n"}
    assert loaded.metrics["test/knn/class/top1"] == 0.5 and math.isnan(loaded.metrics["missing"])
    assert loaded.metrics["n"] == 3.0 and isinstance(loaded.metrics["n"], float)
    assert loaded.random_init == {"test/knn/class/top1": 0.25}
    assert loaded.results["steps"] == 10 and loaded.warnings == ["collapse: one", "7"]
    assert loaded.objective == "mv_dhel" and loaded.num_views == 3.0
    assert loaded.curves["step"] == [1.0, 2.0] and loaded.curves["loss"] == [2.0, 1.5]
    assert math.isnan(loaded.curves["neg_sim"][0]) and "other" not in loaded.curves
    assert json.loads(loaded.configuration) == {"name": "toy", "lr": 0.1} and loaded.config_name == "toy"
    # the metrics file itself, and an evaluation folder: the run is the file's folder
    direct = compare.load_run_metrics(run / "eval" / "metrics.json")
    assert direct.path == run and direct.metrics.keys() == loaded.metrics.keys()


def test_a_runs_latest_evaluation_is_read_when_it_has_no_final_one(tmp_path: Path):
    run = tmp_path / "r"
    for n, value in ((2, 0.2), (10, 0.9), (3, 0.3)):
        write_run(run, f"eval-{n}", {"m": value}, where="")
    (run / "eval-x").mkdir()
    loaded = compare.load_run_metrics(run)
    assert loaded.metrics == {"m": 0.9} and loaded.path == run and loaded.label == "r"
    (run / "eval").mkdir()
    (run / "eval" / "metrics.json").write_text(json.dumps({"metrics": {"m": 0.5}}))
    assert compare.load_run_metrics(run).metrics == {"m": 0.5}  # the run's own final evaluation first
    folder = write_run(tmp_path, "alone", {"m": 0.1}, where="")
    assert compare.load_run_metrics(folder).path == folder


def test_what_is_not_a_run_is_named(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path / 'none'}: no such run folder or metrics file$"):
        compare.load_run_metrics(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"^no metrics.json in {tmp_path / 'empty'} or {tmp_path / 'empty' / 'eval'} "
                                                rf"\(run 'mmviews eval {tmp_path / 'empty'}' first\)$"):
        compare.load_run_metrics(tmp_path / "empty")
    (tmp_path / "bad.json").write_text(json.dumps({"metrics": [1]}))
    with pytest.raises(ValueError, match=r"bad.json: expected an evaluation report"):
        compare.load_run_metrics(tmp_path / "bad.json")
    run = write_run(tmp_path, "badyaml", {"m": 1.0})
    (run / "config.yaml").write_text("a: [\n")
    with pytest.raises(ValueError, match=r"config.yaml: cannot read the run's configuration \(ScannerError|ParserError"):
        compare.load_run_metrics(run)
    (run / "config.yaml").write_text("- a list\n")
    assert compare.read_configuration(run / "config.yaml") == (None, None)
    (run / "config.yaml").write_text("seed: 1\n")
    assert compare.read_configuration(run / "config.yaml") == ("{}", None)
    (run / "metrics.csv").write_text("loss\n1\n")  # no step column: no curves
    assert compare.read_training_curves(run / "metrics.csv") == {}
    (run / "metrics.csv").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match=r"metrics.csv: cannot read the training log \(UnicodeDecodeError"):
        compare.read_training_curves(run / "metrics.csv")


def test_runs_differing_only_in_seed_and_output_are_one_configuration(tmp_path: Path):
    base = {"name": "toy", "optimisation": {"lr": 0.1}}
    paths = [write_run(tmp_path, "a0", {"m": 1.0}, config={**base, "seed": 0, "output": {"dir": "a0"}}),
             write_run(tmp_path, "b0", {"m": 2.0}, config={**base, "optimisation": {"lr": 0.2}, "seed": 0}),
             write_run(tmp_path, "a1", {"m": 3.0}, config={**base, "seed": 1, "output": {"dir": "a1"}}),
             write_run(tmp_path, "plain", {"m": 4.0}),
             write_run(tmp_path, "plain2", {"m": 5.0}),
             write_run(tmp_path, "noname", {"m": 6.0}, config={"seed": 3})]
    runs = [compare.load_run_metrics(p) for p in paths]
    groups = compare.group_by_configuration(runs)
    assert [(g.label, [r.label for r in g.runs]) for g in groups] == [
        ("toy", ["a0", "a1"]), ("toy#1", ["b0"]), ("plain", ["plain"]), ("plain2", ["plain2"]), ("noname", ["noname"])]
    assert groups[0].values("m") == [1.0, 3.0] and groups[0].values("other") == []
    runs[0].metrics["m"] = float("nan")
    assert groups[0].values("m") == [3.0]  # a value that is not finite is no seed's value


def test_labels_metrics_and_headline(tmp_path: Path):
    runs = [compare.RunMetrics(name, tmp_path, {}) for name in ("a", "b", "a", "a", "b")]
    compare._unique_labels(runs)
    assert [r.label for r in runs] == ["a", "b", "a#1", "a#2", "b#1"]
    assert compare.is_metric("test/x/acc") and not compare.is_metric("linear/class/weight_decay")
    assert not compare.is_metric("chance/test/x/acc")
    run = compare.RunMetrics("x", tmp_path, {}, meta={"num_views": True, "objective": 3})
    assert run.num_views is None and run.objective == "run" and run.warnings == []
    assert compare.RunMetrics("x", tmp_path, {}, results={"warnings": "one"}).warnings == []
    assert compare._to_float("1.5") == 1.5 and math.isnan(compare._to_float(None)) and math.isnan(compare._to_float("x"))


def test_seeds_section_gives_mean_std_and_n_and_the_unresolved_differences():
    def config(label: str, values: list[float]) -> compare.Configuration:
        return compare.Configuration(label, [compare.RunMetrics(f"{label}{i}", Path("."), {"m/acc": v, "o": v})
                                             for i, v in enumerate(values)])

    low, close, far, single = [0.70, 0.74, 0.72], [0.71, 0.75, 0.73], [0.95, 0.96, 0.97], [0.5]
    lines = compare.seeds_lines([config("low", low), config("close", close), config("far", far),
                                 config("one", single)], ["m/acc", "o", "absent"], ["m/acc"])
    text = "\n".join(lines)
    row = next(line for line in lines if line.startswith("| m/acc |"))
    for values in (low, close, far):
        cell = f"{statistics.mean(values):.4f} ± {compare.format_metric(statistics.stdev(values))} (n={len(values)})"
        assert cell in row
    assert "0.5000 (n=1)" in row
    assert next(line for line in lines if line.startswith("| absent |")) == "| absent | - | - | - | - |"
    assert "| seeds | 3 | 3 | 3 | 1 |" in lines
    notes = [line for line in lines if line.startswith("- m/acc:")]
    band = compare.format_metric(_band(low, close))
    within = [n for n in notes if n.startswith("- m/acc: low - close = -0.01")]
    assert len(within) == 1 and within[0].endswith(f" is within noise (2 standard errors: {band})"), notes
    assert not any("far" in n and "within noise" in n for n in notes)  # resolved: not listed
    unknown = [n for n in notes if "noise unknown" in n]
    assert len(unknown) == 3 and all(" - one = " in n for n in unknown)
    assert not any(n.startswith("- o:") for n in lines)  # only the compared metrics get notes
    assert "Differences that the seeds do not resolve:" in text and lines[-1] == ""
    quiet = compare.seeds_lines([config("low", low), config("far", far)], ["m/acc"], ["m/acc"])
    assert "Differences that the seeds do not resolve:" not in "\n".join(quiet)


def test_compare_writes_its_table_csv_json_and_plots(tmp_path: Path):
    runs = [write_run(tmp_path, "r1", {"test/knn/class/top1": 0.5, "test/retrieval/a->b/R@1": 0.25,
                                       "test/retrieval/a->b/n": 8, "linear/class/weight_decay": 0.1,
                                       "chance/test/knn/class/top1": 0.25},
                      meta={"objective": "mv_dhel", "num_views": 2}, results={"steps": 4, "final_loss": 1.25,
                                                                              "wall_time_s": 2.5, "warnings": ["w1"]},
                      random_init={"test/knn/class/top1": 0.3, "test/retrieval/a->b/n": 8},
                      log="step,loss,mi_lower_bound\n1,2,0.1\n2,1,0.2\n"),
            write_run(tmp_path, "r1x", {"test/knn/class/top1": 0.75, "extra/acc": 0.1},
                      meta={"objective": "mv_infonce", "num_views": 3})]
    written = compare.compare_runs(runs, tmp_path / "cmp")
    assert set(written) == {"csv", "json", "markdown", "metrics_bar", "metric_vs_views", "training_curves"}
    assert all(p.is_file() and p.parent == tmp_path / "cmp" for p in written.values())
    table = written["markdown"].read_text()
    assert table.startswith("# Run comparison\n\n## Warnings: did it learn?\n\n- r1: w1\n")
    assert "- r1: w1" in table and table.index("- r1: w1") < table.index("| test/knn/class/top1 |")
    assert "| test/knn/class/top1 | 0.5000 | 0.7500 | 0.2500 |" in table
    assert "| test/retrieval/a->b/R@1 | 0.2500 | - | 0.1250 |" in table  # chance 1 / n
    assert "| extra/acc | - | 0.1000 |  |" in table
    assert "weight_decay" not in table and "| chance/" not in table
    assert "\n## Per run\n\n| metric | r1 | r1x | chance |\n|---|---|---|---|\n| objective |" in table
    assert "| objective | mv_dhel | mv_infonce | |" in table and "| num_views | 2 | 3 | |" in table
    assert "| final training loss | 1.2500 | - | |" in table
    assert "| steps | 4 | - | |" in table and "| wall time (s) | 2.5000 | - | |" in table
    assert "| warnings | 1 | 0 | |" in table
    assert "| test/knn/class/top1 | +0.2000 (0.3000) | - |" in table  # trained minus random init
    assert "| test/retrieval/a->b/n | +" not in table
    assert f"Runs: r1 = `{runs[0]}`, r1x = `{runs[1]}`" in table and "## Over seeds" not in table
    assert "Plots: [metrics_bar.png](metrics_bar.png)" in table
    saved = json.loads(written["json"].read_text())
    assert saved["r1"]["metrics"] == {"test/knn/class/top1": 0.5, "test/retrieval/a->b/R@1": 0.25,
                                      "test/retrieval/a->b/n": 8.0}
    assert saved["r1"]["random_init"] == {"test/knn/class/top1": 0.3, "test/retrieval/a->b/n": 8.0}
    assert saved["r1"]["warnings"] == ["w1"] and saved["r1"]["configuration"] == "r1" and saved["r1x"]["steps"] is None
    assert (saved["r1"]["objective"], saved["r1"]["num_views"], saved["r1"]["final_loss"]) == ("mv_dhel", 2.0, 1.25)
    rows = list(csv.reader(written["csv"].read_text().splitlines()))
    assert rows[0] == ["run", "path", "objective", "num_views", "steps", "final_loss", "wall_time_s", "extra/acc",
                       "test/knn/class/top1", "test/retrieval/a->b/R@1", "test/retrieval/a->b/n",
                       "random_init/test/knn/class/top1"]
    assert rows[1] == ["r1", str(runs[0]), "mv_dhel", "2.0", "4", "1.25", "2.5", "", "0.5", "0.25", "8.0", "0.3"]
    assert rows[2][:3] == ["r1x", str(runs[1]), "mv_infonce"] and rows[2][-1] == ""


def test_compare_asks_for_runs_and_known_metrics(tmp_path: Path):
    with pytest.raises(ValueError, match="^compare needs at least one run$"):
        compare.compare_runs([], tmp_path / "cmp")
    run = write_run(tmp_path, "r", {"a/acc": 0.5})
    with pytest.raises(ValueError, match=r"^metrics \['b/acc'\] are in none of the runs; known: \['a/acc'\]$"):
        compare.compare_runs([run], tmp_path / "cmp", ["b/acc"])
    written = compare.compare_runs([run, run], tmp_path / "cmp", ["a/acc"])
    assert set(written) == {"csv", "json", "markdown", "metrics_bar"}
    assert "| a/acc | 0.5000 | 0.5000 |  |" in written["markdown"].read_text()
    assert list(json.loads(written["json"].read_text())) == ["r", "r#1"]


# --- the plots: what each figure shows (captured before it is saved) --------------------------------


@pytest.fixture
def figures(monkeypatch) -> dict:
    """The figures compare draws, by file name, kept open (each is also saved as usual)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    kept: dict = {}
    real = compare._save_figure

    def keep(fig, path):
        kept[Path(path).name] = {"size": tuple(fig.get_size_inches()), "axes": fig.axes,
                                 "ax_lines": [[(list(l.get_xdata()), list(l.get_ydata()), l.get_linestyle(), l.get_color(),
                                                l.get_label(), l.get_marker()) for l in ax.get_lines()] for ax in fig.axes]}
        kept[Path(path).name]["titles"] = [ax.get_title() for ax in fig.axes]
        kept[Path(path).name]["xlabels"] = [ax.get_xlabel() for ax in fig.axes]
        kept[Path(path).name]["legends"] = [[t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else None
                                            for ax in fig.axes]
        kept[Path(path).name]["figure_legends"] = [[t.get_text() for t in legend.get_texts()] for legend in fig.legends]
        kept[Path(path).name]["patches"] = [[(p.get_height(), p.get_facecolor()) for p in ax.patches] for ax in fig.axes]
        kept[Path(path).name]["ticks"] = [([t.get_text() for t in ax.get_xticklabels()],
                                           [t.get_rotation() for t in ax.get_xticklabels()]) for ax in fig.axes]
        kept[Path(path).name]["scatter"] = [[list(map(list, c.get_offsets())) for c in ax.collections] for ax in fig.axes]
        return real(fig, path)

    monkeypatch.setattr(compare, "_save_figure", keep)
    return kept


def _plotted_runs(tmp_path: Path) -> list[Path]:
    log = "step,loss,pos_sim,neg_sim,mi_lower_bound\n1,3.0,0.2,0.1,0.5\n2,2.0,0.4,0.0,1.0\n"
    # the class probe's chance is the same for the three runs, the retrieval's differs (other test sizes)
    return [write_run(tmp_path, "r0", {ACC: 0.5, R1: 0.2, "chance/" + ACC: 0.25, "chance/" + R1: 0.1},
                      meta={"objective": "a", "num_views": 2}, random_init={ACC: 0.3}, log=log),
            write_run(tmp_path, "r1", {ACC: 0.7, R1: 0.4, "chance/" + ACC: 0.25, "chance/" + R1: 0.05},
                      meta={"objective": "a", "num_views": 4}, log="step,loss\n1,5.0\n"),
            write_run(tmp_path, "r2", {ACC: 0.6, "chance/" + ACC: 0.25}, meta={"objective": "b", "num_views": 3})]


def test_the_bars_show_each_runs_value_and_its_random_init_tick(tmp_path: Path, figures):
    import matplotlib.colors as mcolors

    compare.compare_runs(_plotted_runs(tmp_path), tmp_path / "cmp")
    bars = figures["metrics_bar.png"]
    assert bars["size"] == pytest.approx((2.8 * 2, 3.6))  # two panels of at least 2.8 inches
    assert bars["titles"] == [ACC, "test/retrieval/\nmean/R@1"]  # the headline's order; a long name on two lines
    heights = [[h for h, _ in axis] for axis in bars["patches"]]
    assert heights[0] == [0.5, 0.7, 0.6] and heights[1][:2] == [0.2, 0.4] and math.isnan(heights[1][2])
    assert [mcolors.to_hex(c) for _, c in bars["patches"][0]] == [mcolors.to_hex(f"C{i}") for i in range(3)]
    assert bars["ticks"][0] == (["r0", "r1", "r2"], [45.0, 45.0, 45.0])
    # one legend under the panels (none in them): the random-init tick, the chance
    assert bars["legends"] == [None, None] and bars["figure_legends"] == [["random init", "chance"]]
    ticks = bars["scatter"][0][0]
    assert ticks[0] == [0.0, 0.3] and all(math.isnan(y) for _, y in ticks[1:])
    # one chance for every run: a grey dotted line across the panel
    (chance,) = bars["ax_lines"][0]
    assert chance[1] == [0.25, 0.25] and chance[2] == ":" and chance[4] == "chance"
    assert mcolors.to_hex(chance[3]) == mcolors.to_hex("grey")
    # runs with different chances (other test sizes): a grey tick per run, none where unknown
    assert bars["ax_lines"][1] == [] and len(bars["scatter"][1]) == 1
    per_run = bars["scatter"][1][0]
    assert per_run[:2] == [[0.0, 0.1], [1.0, 0.05]] and math.isnan(per_run[2][1])
    wide = compare.compare_runs(_plotted_runs(tmp_path / "w") + [write_run(tmp_path / "w", f"x{i}", {ACC: 0.1})
                                                                 for i in range(4)], tmp_path / "cmp2", [ACC])
    assert figures["metrics_bar.png"]["size"] == pytest.approx((0.45 * 7 + 1.2, 3.6)) and wide
    # a run without a chance for the metric at all: no line, no legend
    compare.compare_runs([write_run(tmp_path / "n", "a", {ACC: 0.5})], tmp_path / "cmp3")
    assert figures["metrics_bar.png"]["figure_legends"] == [] and figures["metrics_bar.png"]["ax_lines"] == [[]]
    # only a chance (no random init): the legend names it alone
    compare.compare_runs([write_run(tmp_path / "c", "a", {ACC: 0.5, "chance/" + ACC: 0.25})], tmp_path / "cmp4")
    assert figures["metrics_bar.png"]["figure_legends"] == [["chance"]]


def test_the_training_curves_show_each_logged_column_per_run(tmp_path: Path, figures):
    compare.compare_runs(_plotted_runs(tmp_path), tmp_path / "cmp")
    curves = figures["training_curves.png"]
    assert curves["titles"] == ["training loss", "similarity (solid: positive pairs, dashed: negative)",
                                "MI lower bound (nats)"]
    assert curves["size"] == pytest.approx((4.8 * 3, 3.6)) and curves["xlabels"] == ["optimiser step"] * 3
    loss, similarity, mi = curves["ax_lines"]
    assert [(x, y, style, colour, label) for x, y, style, colour, label, _ in loss] == [
        ([1.0, 2.0], [3.0, 2.0], "-", "C0", "r0"), ([1.0], [5.0], "-", "C1", "r1")]
    assert [(y, style, label) for _, y, style, _, label, _ in similarity] == [
        ([0.2, 0.4], "-", "r0"), ([0.1, 0.0], "--", "_child1")]
    assert mi[0][1] == [0.5, 1.0] and mi[1][1] == [0.0, 0.0]  # the run's bound, then the zero line (chance)
    assert curves["legends"] == [["r0", "r1"], ["r0"], ["r0"]]
    only_loss = [write_run(tmp_path / "l", "a", {ACC: 0.5}, log="step,loss\n1,1.0\n")]
    compare.compare_runs(only_loss, tmp_path / "cmp2")
    assert figures["training_curves.png"]["titles"] == ["training loss"]
    assert figures["training_curves.png"]["size"] == pytest.approx((4.8, 3.6))


def test_the_metric_against_views_plot_has_one_line_per_objective(tmp_path: Path, figures):
    compare.compare_runs(_plotted_runs(tmp_path), tmp_path / "cmp")
    views = figures["metric_vs_views.png"]
    assert views["titles"] == [ACC, R1] and views["xlabels"] == ["number of views M"] * 2
    assert views["size"] == pytest.approx((4.5 * 2, 3.6))
    acc = views["ax_lines"][0]
    assert [(x, y, label, marker) for x, y, _, _, label, marker in acc] == [
        ([2.0, 4.0], [0.5, 0.7], "a", "o"), ([3.0], [0.6], "b", "o")]
    assert views["legends"][0] == ["a", "b"] and [line[4] for line in views["ax_lines"][1]] == ["a"]
    same = [write_run(tmp_path / "s", n, {ACC: 0.5}, meta={"num_views": 2}) for n in ("a", "b")]
    assert "metric_vs_views" not in compare.compare_runs(same, tmp_path / "cmp2")


def test_mmviews_compare_writes_to_the_output_folder_it_is_given(tmp_path: Path, monkeypatch, capsys, figures):
    from mmviews.cli import main

    runs = [str(p) for p in _plotted_runs(tmp_path)]
    monkeypatch.chdir(tmp_path)
    for flag, folder in (("--output", "o1"), ("--out", "o2"), ("-o", "o3"), (None, "comparison")):
        assert main(["compare", *runs, *([flag, folder] if flag else []), "--all"]) == 0
        out = capsys.readouterr().out
        assert (tmp_path / folder / "comparison.md").read_text() in out
        assert f"written: {Path(folder) / 'comparison.csv'}" in out
    assert main(["compare", *runs, "--output", "o4", "--metrics", R1]) == 0
    capsys.readouterr()
    assert "| test/linear/class/acc |" in (tmp_path / "o4" / "comparison.md").read_text()
    assert figures["metrics_bar.png"]["titles"] == ["test/retrieval/\nmean/R@1"]  # --metrics: the plotted metrics
    with pytest.raises(SystemExit):
        main(["compare"])


def test_the_seeds_section_reads_as_written_here():
    def config(label: str, values: list[float]) -> compare.Configuration:
        return compare.Configuration(label, [compare.RunMetrics(f"{label}{i}", Path("."), {"m/acc": v})
                                             for i, v in enumerate(values)])

    lines = compare.seeds_lines([config("A", [0.5, 0.7]), config("B", [0.25])], ["m/acc"], ["m/acc"])
    std = compare.format_metric(statistics.stdev([0.5, 0.7]))
    assert lines == [
        "## Over seeds", "",
        "Runs that differ only in their seed are one configuration: mean ± standard deviation over its seeds "
        "(n - 1 in the denominator), with the number of seeds n.", "",
        "| metric | A | B |", "|---|---|---|", "| seeds | 2 | 1 |",
        f"| m/acc | 0.6000 ± {std} (n=2) | 0.2500 (n=1) |", "",
        "Differences that the seeds do not resolve:", "",
        "- m/acc: A - B = +0.3500; noise unknown (fewer than 2 seeds)", ""]
    empty = compare.seeds_lines([config("A", [0.5, 0.7]), compare.Configuration("C", []), config("D", [0.55, 0.75])],
                                ["m/acc"], ["m/acc"])
    assert empty[7] == f"| m/acc | 0.6000 ± {std} (n=2) | - | 0.6500 ± {std} (n=2) |"
    notes = [line for line in empty if line.startswith("- ")]  # nothing to compare with C; A and D within noise
    assert len(notes) == 1 and notes[0].startswith("- m/acc: A - D = -0.05")


def test_the_output_folder_is_named_by_any_of_its_spellings():
    import argparse

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    for spelling in ("--output", "--out", "-o"):
        assert parser.parse_args(["r1", spelling, "elsewhere"]).out == "elsewhere"
    plain = parser.parse_args(["r1", "r2"])
    assert (plain.runs, plain.out, plain.metrics, plain.all) == (["r1", "r2"], "comparison", None, False)
    assert parser.parse_args(["r1", "--all", "--metrics", "a/acc", "b/acc"]).metrics == ["a/acc", "b/acc"]


def _compared_figures(tmp_path: Path, monkeypatch) -> dict[str, Any]:
    """The figures ``compare_runs`` draws for :func:`_plotted_runs`, by file name (still saved)."""
    kept = {}
    real = compare._save_figure

    def keep(fig, path):
        kept[Path(path).name] = fig
        return real(fig, path)

    monkeypatch.setattr(compare, "_save_figure", keep)
    compare.compare_runs(_plotted_runs(tmp_path), tmp_path / "cmp")
    return kept


def test_the_plots_text_is_small_their_grid_faint_and_the_zero_line_grey(tmp_path: Path, monkeypatch):
    """Panel titles of 9 points and legends of 7 (the run labels and metric names are long), a
    faint grid, and the MI panel's line at zero (chance) grey and thinner than the runs' curves,
    in a colour none of them has."""
    import matplotlib.colors as mcolors

    kept = _compared_figures(tmp_path, monkeypatch)
    for name in ("training_curves.png", "metric_vs_views.png"):
        for ax in kept[name].axes:
            assert ax.title.get_fontsize() == 9, name
            assert all(t.get_fontsize() == 7 for t in ax.get_legend().get_texts()), name
            assert all(0 < line.get_alpha() < 1 for line in ax.get_xgridlines()), name
    mi = kept["training_curves.png"].axes[2]
    run_line, zero = mi.get_lines()
    assert list(zero.get_ydata()) == [0.0, 0.0] and mcolors.to_hex(zero.get_color()) == mcolors.to_hex("grey")
    assert zero.get_linewidth() < run_line.get_linewidth()
    assert mcolors.to_hex(zero.get_color()) not in {mcolors.to_hex(f"C{i}") for i in range(10)}


def test_the_help_says_what_each_argument_is():
    import argparse

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    text = " " + " ".join(parser.format_help().split()) + " "
    for said in ("runs run folders (or metrics.json files)",
                 "--all print the whole comparison.md (every metric, the random-init margins); by default the "
                 "terminal gets the over-seeds table and the per-run rows of the headline metrics",
                 "output folder (default: ./comparison)", "metrics to plot (default: headline metrics)"):
        assert f" {said} " in text, said


def test_the_warnings_and_the_random_init_table_read_as_written_here(tmp_path: Path):
    runs = [write_run(tmp_path, "r0", {ACC: 0.5}, results={"warnings": ["collapse: x"]}, random_init={ACC: 0.3}),
            write_run(tmp_path, "r1", {ACC: 0.7})]
    compare.compare_runs(runs, tmp_path / "cmp")
    lines = (tmp_path / "cmp" / "comparison.md").read_text().split("\n")
    assert lines[:7] == ["# Run comparison", "", "## Warnings: did it learn?", "", "- r0: collapse: x", "",
                         "## Per run"]
    start = lines.index("Trained minus random init (each run against its own encoder as initialised; "
                        "random-init value in brackets):")
    assert lines[start - 1:start + 6] == [
        "", "Trained minus random init (each run against its own encoder as initialised; random-init value in brackets):",
        "", "| metric | r0 | r1 |", "|---|---|---|", "| test/linear/class/acc | +0.2000 (0.3000) | - |", ""]


def test_the_terminal_summary_the_runs_line_and_empty_csv_cells_read_as_written_here(tmp_path: Path):
    runs = [write_run(tmp_path, "r0", {ACC: 0.5, "test/linear/other/acc": 0.1}, results={"warnings": ["collapse: x"]}),
            write_run(tmp_path, "r1", {ACC: 0.7})]
    summary: list[str] = []
    compare.compare_runs(runs, tmp_path / "cmp", [ACC], summary)
    assert summary[:5] == ["## Warnings: did it learn?", "", "- r0: collapse: x", "", "## Per run (headline metrics)"]
    assert summary[5] == ""
    lines = (tmp_path / "cmp" / "comparison.md").read_text().split("\n")
    at = lines.index(f"Runs: r0 = `{runs[0]}`, r1 = `{runs[1]}`")
    assert lines[at - 1:] == ["", f"Runs: r0 = `{runs[0]}`, r1 = `{runs[1]}`", "", "", "",
                              "Plots: [metrics_bar.png](metrics_bar.png)", ""]  # no Acc-2 note: no such metric
    with (tmp_path / "cmp" / "comparison.csv").open() as file:
        rows = list(csv.DictReader(file))
    # no results.json: steps, final loss and wall time are empty cells
    assert [(r["steps"], r["final_loss"], r["wall_time_s"]) for r in rows] == [("", "", ""), ("", "", "")]
    every: list[str] = []
    compare.compare_runs(runs, tmp_path / "all", [ACC, "test/linear/other/acc"], every)
    assert "## Per run" in every and "## Per run (headline metrics)" not in every
    seeds = [write_run(tmp_path / "s", f"s{seed}", {ACC: 0.5 + seed / 10}, config={"name": "toy", "seed": seed},
                       results={"warnings": ["collapse: x"]} if seed == 0 else None) for seed in (0, 1)]
    seeded: list[str] = []
    compare.compare_runs(seeds, tmp_path / "seeded", None, seeded)
    assert seeded[:4] == ["## Warnings: did it learn?", "", "- s0: collapse: x", ""] and seeded[4] == "## Over seeds"


def test_the_plots_line_and_the_json_record_of_each_run(tmp_path: Path):
    runs = _plotted_runs(tmp_path)
    compare.compare_runs(runs, tmp_path / "cmp")
    lines = (tmp_path / "cmp" / "comparison.md").read_text().split("\n")
    assert lines[-2] == ("Plots: [metrics_bar.png](metrics_bar.png), [metric_vs_views.png](metric_vs_views.png), "
                         "[training_curves.png](training_curves.png)")
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    run = write_run(tmp_path / "one", "r", {ACC: 0.5}, meta={"objective": "a", "num_views": 2},
                    results={"steps": 4, "final_loss": 1.5, "wall_time_s": 2.0})
    compare.compare_runs([run], tmp_path / "one_cmp")
    assert json.loads((tmp_path / "one_cmp" / "comparison.json").read_text()) == {"r": {
        "path": str(run), "objective": "a", "num_views": 2, "metrics": {ACC: 0.5}, "random_init": {},
        "steps": 4, "final_loss": 1.5, "wall_time_s": 2.0, "warnings": [], "configuration": "r"}}
    assert set(saved) == {"r0", "r1", "r2"}
    # nothing to plot (the run's only figures are settings and chances): no Plots line
    bare = write_run(tmp_path / "bare", "b", {"linear/class/weight_decay": 0.01, "chance/" + ACC: 0.5})
    compare.compare_runs([bare], tmp_path / "bare_cmp")
    assert "Plots:" not in (tmp_path / "bare_cmp" / "comparison.md").read_text()


def test_the_bars_random_init_ticks_labels_and_grid(tmp_path: Path, monkeypatch):
    """Each run's random-init value is a wide black tick drawn over its bar; run names at 8 points
    slanted to end under their bar; titles of 9 points, legends of 7, a faint horizontal grid only."""
    import matplotlib.colors as mcolors

    kept = _compared_figures(tmp_path, monkeypatch)
    ax = kept["metrics_bar.png"].axes[0]  # the class accuracy: r0 has a random-init value
    (ticks,) = ax.collections
    assert list(ticks.get_sizes()) == [400] and mcolors.to_hex(ticks.get_facecolor()[0]) == "#000000"
    assert ticks.get_zorder() > max(bar.get_zorder() for bar in ax.patches)
    marker = ticks.get_paths()[0].vertices  # "_": a horizontal line
    assert set(marker[:, 1].round(6)) == {0.0} and marker[:, 0].max() > 0
    (legend,) = kept["metrics_bar.png"].legends  # the figure's, under the panels
    assert all(t.get_fontsize() == 7 for t in legend.get_texts())
    assert ax.title.get_fontsize() == 9
    labels = ax.get_xticklabels()
    assert all(t.get_fontsize() == 8 and t.get_horizontalalignment() == "right" for t in labels)
    assert all(0 < line.get_alpha() < 1 and line.get_visible() for line in ax.get_ygridlines())
    assert not any(line.get_visible() for line in ax.get_xgridlines())


def test_the_latest_numbered_evaluation_with_a_report_is_read(tmp_path: Path):
    run = tmp_path / "run"
    for n, value in ((1, 0.1), (2, 0.2)):
        (run / f"eval-{n}").mkdir(parents=True)
        (run / f"eval-{n}" / "metrics.json").write_text(json.dumps({"metrics": {ACC: value}, "meta": "not a dict"}))
    (run / "eval-3").mkdir()  # started, never written
    loaded = compare.load_run_metrics(run)
    assert loaded.metrics == {ACC: 0.2} and loaded.meta == {}


# --- the headline: each run's own, as `mmviews train` printed it -----------------------------------

SENTIMENT = ("test/regression/sentiment/mae", "test/regression/sentiment/mse", "test/regression/sentiment/r2")
# what `mmviews train quickstart` prints (README): the class probe, the sentiment regression, mean R@1
QUICKSTART_HEADLINE = [ACC, *SENTIMENT, R1]


def _quickstart_metrics(acc: float) -> dict[str, float]:
    """A quickstart evaluation's metrics: probes, 12 retrieval directions with their counts and
    their mean, diagnostics."""
    metrics = {ACC: acc, SENTIMENT[0]: 0.25, SENTIMENT[1]: 0.1, SENTIMENT[2]: 0.7, R1: 0.03, "chance/" + R1: 0.002,
               "chance/" + ACC: 0.26, "test/diag/erank/fused": 30.0, "test/diag/align": 0.5}
    modalities = ("text", "audio", "image", "flow")
    for a in modalities:
        for b in modalities:
            if a != b:
                metrics[f"test/retrieval/{a}->{b}/R@1"] = 0.01
                metrics[f"test/retrieval/{a}->{b}/n"] = 512
    return metrics


def _headline(keys: list[str]) -> dict:
    return {"headline": [{"metric": k, "trained": 0.0, "random_init": None, "chance": None} for k in keys]}


def test_the_tables_and_bars_show_the_headline_the_trainer_printed(tmp_path: Path, monkeypatch):
    """The issue's case: class accuracy and five per-direction R@1 were shown, mean R@1 and the
    sentiment metrics left out. Two seeds of the quickstart: the over-seeds rows, the per-run
    rows and the bar panels are the five metrics `mmviews train` printed, in its order."""
    runs = [write_run(tmp_path, f"s{seed}", _quickstart_metrics(0.7 + seed / 10), config={"name": "quickstart",
                                                                                          "seed": seed},
                      results=_headline(QUICKSTART_HEADLINE)) for seed in (0, 1)]
    kept = {}
    real = compare._save_figure
    monkeypatch.setattr(compare, "_save_figure", lambda fig, path: kept.setdefault(Path(path).name, fig) and real(fig, path))
    summary: list[str] = []
    compare.compare_runs(runs, tmp_path / "cmp", None, summary)
    seeds = summary[:summary.index("## Per run (headline metrics)")]
    per_run = summary[summary.index("## Per run (headline metrics)"):]
    rows = lambda lines: [line.split(" | ")[0][2:] for line in lines if line.startswith("| test/")]  # noqa: E731
    assert rows(seeds) == QUICKSTART_HEADLINE and rows(per_run) == QUICKSTART_HEADLINE
    assert f"| {R1} | 0.0300 ± 0.0000 (n=2) |" in seeds
    assert f"| {R1} | 0.0300 | 0.0300 | 0.00200 |" in per_run  # with its chance
    titles = [ax.get_title() for ax in kept["metrics_bar.png"].axes if ax.get_visible()]
    assert [t.replace("\n(lower is better)", "").replace("\n", "") for t in titles] == QUICKSTART_HEADLINE
    assert titles[1].endswith("\n(lower is better)") and titles[2].endswith("\n(lower is better)")
    assert not titles[0].endswith("better)") and not titles[3].endswith("better)")
    # the whole comparison.md still lists every metric
    assert "| test/retrieval/text->audio/R@1 |" in (tmp_path / "cmp" / "comparison.md").read_text()


def test_a_run_without_a_recorded_headline_gets_the_trainers_choice(tmp_path: Path):
    """No results.json (a metrics.json file, mmviews eval's folder): the same choice the trainer
    makes, over the run's metrics: probes and the mean R@1, not the per-direction figures, not
    the diagnostics (shown only when nothing else is evaluated)."""
    run = compare.load_run_metrics(write_run(tmp_path, "r", _quickstart_metrics(0.7)))
    assert compare.run_headline(run) == QUICKSTART_HEADLINE
    diag = compare.load_run_metrics(write_run(tmp_path, "d", {"test/diag/erank/fused": 3.0, "test/diag/unif": -1.0,
                                                              "test/diag/rank": 4.0}))
    assert compare.run_headline(diag) == ["test/diag/erank/fused", "test/diag/unif"]


def test_the_recorded_headline_wins_and_the_runs_headlines_are_joined_in_order(tmp_path: Path):
    # the recorded order and choice, not a recomputed one; entries the evaluation lacks or that are not
    # entries at all are passed over
    recorded = _headline([R1, "test/gone/acc", ACC]) | {"headline": _headline([R1, "test/gone/acc", ACC])["headline"]
                                                        + ["x", {"metric": 3}]}
    a = compare.load_run_metrics(write_run(tmp_path, "a", _quickstart_metrics(0.7), results=recorded))
    assert compare.run_headline(a) == [R1, ACC]
    # a headline none of whose metrics the compared evaluation holds (a later `mmviews eval` with other
    # tasks): the choice over the metrics there
    stale = compare.load_run_metrics(write_run(tmp_path, "s", {"val/knn/class/top1": 0.4},
                                               results=_headline([ACC])))
    assert compare.run_headline(stale) == ["val/knn/class/top1"]
    not_a_list = compare.load_run_metrics(write_run(tmp_path, "n", {ACC: 0.4}, results={"headline": {"metric": R1}}))
    assert compare.run_headline(not_a_list) == [ACC]
    b = compare.load_run_metrics(write_run(tmp_path, "b", _quickstart_metrics(0.7), results=_headline([ACC, SENTIMENT[0]])))
    assert compare.headline_keys([b, a]) == [ACC, SENTIMENT[0], R1]
    # chance keys and chosen settings are never headline rows
    odd = compare.load_run_metrics(write_run(tmp_path, "o", {ACC: 0.5, "chance/" + ACC: 0.2},
                                             results=_headline(["chance/" + ACC, ACC])))
    assert compare.headline_keys([odd]) == [ACC]


def test_the_bar_titles_and_labels_do_not_overlap(tmp_path: Path, monkeypatch):
    """Rendered: no panel title meets another, nor any run label of the panels above; five
    headline metrics wrap onto a second row, whose unused panels are hidden."""
    runs = [write_run(tmp_path, name, _quickstart_metrics(0.7), results=_headline(QUICKSTART_HEADLINE))
            for name in ("quickstart-seed0-long-name", "quickstart-seed1-long-name", "q2")]
    kept = {}
    real = compare._save_figure
    monkeypatch.setattr(compare, "_save_figure", lambda fig, path: kept.setdefault(Path(path).name, fig) and real(fig, path))
    compare.compare_runs(runs, tmp_path / "cmp")
    fig = kept["metrics_bar.png"]
    assert [ax.get_visible() for ax in fig.axes] == [True] * 5 + [False] * 3  # 4 to a row
    assert tuple(fig.get_size_inches()) == pytest.approx((2.8 * 4, 3.6 * 2))  # each row as tall as one alone
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # the saved figure was closed: a canvas to measure on
    visible = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.title.get_window_extent(renderer) for ax in visible]
    labels = [t.get_window_extent(renderer) for ax in visible for t in ax.get_xticklabels()]
    for i, box in enumerate(titles):
        assert not any(box.overlaps(other) for other in titles[i + 1:]), visible[i].get_title()
        assert not any(box.overlaps(label) for label in labels), visible[i].get_title()
        assert box.width > 0
    assert all(ax.get_title().count("\n") <= 2 for ax in visible)
    # the saved PNG is the figure laid out as checked
    assert (tmp_path / "cmp" / "metrics_bar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_titles_break_at_the_slash_nearest_the_middle():
    assert compare.panel_title("test/linear/class/acc") == "test/linear/class/acc"  # 21 characters: one line
    assert compare.panel_title(R1) == "test/retrieval/\nmean/R@1"
    assert compare.panel_title("test/regression/sentiment/r2") == "test/regression/\nsentiment/r2"
    assert compare.panel_title("test/regression/sentiment/mae") == ("test/regression/\nsentiment/mae\n"
                                                                     "(lower is better)")
    assert compare.panel_title("a_very_long_metric_name_without_a_slash") == "a_very_long_metric_name_without_a_slash"
    assert compare.panel_title("abc/de", width=3) == "abc/\nde"
    assert compare.panel_title("ab/cdefgh", width=3) == "ab/\ncdefgh"  # the only slash
    assert compare.panel_title("val/loss") == "val/loss\n(lower is better)"
