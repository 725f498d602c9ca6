"""`mmviews/eval/report.py` below the report: the training log reader returns each column's
logged (step, value) points and names the line of a bad step; the plots draw what their titles
and legends say (the figures are read back from matplotlib as they are saved): the similarity
histograms as densities on the same 80 bins of [-1, 1], each training-log column against its
own steps in a grid of equal panels (4.5 x 3.2 inches), the spectrum normalised by its largest value on a log scale;
the report's summary, metrics file and plot links."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pytest

import mmviews.eval.report as report


@pytest.fixture
def saved_figures(monkeypatch) -> list:
    """Every figure report.py saves, kept for reading after it is written and closed."""
    figures = []
    save = report._save_figure

    def keep(fig, path):
        figures.append(fig)
        return save(fig, path)

    monkeypatch.setattr(report, "_save_figure", keep)
    return figures


# --- read_log_csv -----------------------------------------------------------------------------


def test_log_columns_are_the_logged_points_of_every_numeric_column(tmp_path: Path) -> None:
    log = tmp_path / "metrics.csv"
    # `lr` not logged at step 3 and `pos_sim` not at step 5: the columns after an empty cell
    # of the same row are still read; `note` is text and gives no column.
    log.write_text("step,lr,pos_sim,note\n3,,0.5,warm\n5,0.001,,x\n8,0.002,0.75,y\n")
    curves = report.read_log_csv(log)
    assert sorted(curves) == ["lr", "pos_sim"]
    assert curves["lr"][0].tolist() == [5.0, 8.0] and curves["lr"][1].tolist() == [0.001, 0.002]
    assert curves["pos_sim"][0].tolist() == [3.0, 8.0] and curves["pos_sim"][1].tolist() == [0.5, 0.75]


def test_log_reader_names_the_line_of_a_bad_step_and_a_missing_log(tmp_path: Path) -> None:
    log = tmp_path / "metrics.csv"
    log.write_text("step,loss\n1,2.0\nlater,1.0\n")
    with pytest.raises(ValueError, match=r"^.*metrics\.csv:3: step 'later' is not a number$"):
        report.read_log_csv(log)
    with pytest.raises(FileNotFoundError, match=r"^training log .*absent\.csv does not exist$"):
        report.read_log_csv(tmp_path / "absent.csv")


def test_log_reader_keeps_line_breaks_inside_a_quoted_column_name(tmp_path: Path) -> None:
    """Read as CSV wants it (no newline translation): a quoted name keeps its CR LF."""
    log = tmp_path / "metrics.csv"
    log.write_bytes(b'step,"loss\r\nhead"\r\n1,2.5\r\n')
    assert list(report.read_log_csv(log)) == ["loss\r\nhead"]


# --- plots ------------------------------------------------------------------------------------


def test_similarity_histograms_are_densities_on_80_bins_of_the_cosine_range(tmp_path: Path, saved_figures) -> None:
    rng = np.random.default_rng(0)
    pos, neg = np.clip(0.6 + 0.1 * rng.standard_normal(50), -1, 1), np.clip(0.1 * rng.standard_normal(200), -1, 1)
    report.plot_similarity_histograms(pos, neg, tmp_path / "hist.png")
    (fig,) = saved_figures
    (ax,) = fig.axes
    assert tuple(fig.get_size_inches()) == (6, 4)
    labels = [container.patches[0].get_label() for container in ax.containers]
    assert labels == ["negative pairs (n=200)", "positive pairs (n=50)"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    edges = np.linspace(-1.0, 1.0, 81)
    for container, values in zip(ax.containers, (neg, pos)):
        bars = container.patches
        assert len(bars) == 80
        assert [b.get_x() for b in bars] == pytest.approx(edges[:-1].tolist())
        assert [b.get_width() for b in bars] == pytest.approx(np.diff(edges).tolist())
        counts, _ = np.histogram(values, bins=edges)
        # a density: each bar's height is its share of the samples over the bar's width
        assert [b.get_height() for b in bars] == pytest.approx((counts / len(values) / 0.025).tolist())
        assert all(0 < b.get_alpha() < 1 for b in bars)  # see-through: the overlap shows both
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "cosine similarity", "density", "positive vs negative similarities")


def test_training_curves_plot_each_column_against_its_steps_in_equal_panels(tmp_path: Path, saved_figures) -> None:
    log = tmp_path / "metrics.csv"
    rows = ["step,epoch,loss,pos_sim,neg_sim,lr,critic,time_s"]
    rows += [f"{s},{s // 4},{4.0 / s},{0.1 * s},{-0.01 * s},{0.001 if s % 2 else ''},{s * s},{s}" for s in range(2, 12)]
    log.write_text("\n".join(rows) + "\n")
    report.plot_training_curves(log, tmp_path / "curves.png")
    (fig,) = saved_figures
    # 4 panels (loss, cosine similarity, critic, learning rate): 3 columns, 2 rows, the last 2 off
    panels = fig.axes
    assert len(panels) == 6
    grid = panels[0].get_subplotspec().get_gridspec()
    assert (grid.nrows, grid.ncols) == (2, 3)
    assert [ax.axison for ax in panels] == [True] * 4 + [False] * 2
    assert [ax.get_title() for ax in panels[:4]] == ["loss", "cosine similarity", "critic", "learning rate"]
    assert all(ax.get_xlabel() == "step" for ax in panels[:4])
    assert fig.get_suptitle() == "training curves"
    assert isinstance(fig.get_layout_engine(), matplotlib.layout_engine.ConstrainedLayoutEngine)
    similarity, learning_rate = panels[1], panels[3]
    assert [line.get_label() for line in similarity.get_lines()] == ["pos_sim", "neg_sim"]
    assert [t.get_text() for t in similarity.get_legend().get_texts()] == ["pos_sim", "neg_sim"]
    assert panels[0].get_legend() is None  # one curve: the title names it
    (lr,) = learning_rate.get_lines()
    assert lr.get_xdata().tolist() == [3.0, 5.0, 7.0, 9.0, 11.0] and lr.get_ydata().tolist() == [0.001] * 5
    # thinner lines than matplotlib's default, an 8-point legend, a faint grid
    assert lr.get_linewidth() < matplotlib.rcParams["lines.linewidth"]
    assert similarity.get_legend().get_texts()[0].get_fontsize() == 8
    assert all(0 < line.get_alpha() < 1 for line in panels[0].get_xgridlines())
    # every panel has the same size, whatever the grid
    one = tmp_path / "one.csv"
    one.write_text("step,loss\n1,2.0\n2,1.0\n")
    report.plot_training_curves(one, tmp_path / "one.png")
    single = saved_figures[1]
    (only,) = single.axes
    assert only.get_title() == "loss"
    assert tuple(single.get_size_inches()) == pytest.approx((4.5, 3.2))
    assert tuple(fig.get_size_inches()) == pytest.approx((3 * 4.5, 2 * 3.2))


def test_training_curves_need_a_column_to_plot(tmp_path: Path) -> None:
    log = tmp_path / "metrics.csv"
    log.write_text("step,epoch,time_s\n1,0,0.5\n")
    with pytest.raises(ValueError, match=r"metrics\.csv: no numeric column to plot besides 'step', 'epoch' and 'time_s'$"):
        report.plot_training_curves(log, tmp_path / "curves.png")


def test_a_column_named_lr_goes_to_the_learning_rate_panel() -> None:
    assert report.training_curve_panels(["loss", "lr", "lr_head"]) == [
        ("loss", ["loss"]), ("learning rate", ["lr", "lr_head"])]


def test_spectrum_is_normalised_by_its_largest_value_on_a_log_scale(tmp_path: Path, saved_figures) -> None:
    spectra = {"empty": np.array([]), "text_0": np.array([4.0, 2.0, 1.0, 0.0]), "zero": np.array([0.0, 0.0]),
               "one": np.array([2.0]), "drop": np.array([5.0, 0.0]), "small": np.array([0.75, 0.25], dtype=np.float32)}
    report.plot_spectrum(spectra, tmp_path / "spectrum.png")
    (fig,) = saved_figures
    (ax,) = fig.axes
    assert tuple(fig.get_size_inches()) == (6, 4)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["text_0", "one", "drop", "small"]  # nothing to draw for an empty or an all-zero one
    assert lines["text_0"].get_xdata().tolist() == [1, 2, 3, 4]
    assert lines["text_0"].get_ydata().tolist() == [1.0, 0.5, 0.25, 1e-16]  # a zero at the floor of the log scale
    assert lines["one"].get_ydata().tolist() == [1.0] and lines["drop"].get_ydata().tolist() == [1.0, 1e-16]
    assert lines["small"].get_ydata().tolist() == [1.0, 1 / 3]  # divided in double precision
    assert ax.get_yscale() == "log"
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "index", "singular value / largest", "singular-value spectrum")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)
    assert ax.get_legend().get_texts()[0].get_fontsize() == 8
    # a faint grid on the minor ticks of the log scale too
    for tick in (ax.yaxis.get_major_ticks(1)[0], ax.yaxis.get_minor_ticks(1)[0]):
        assert tick.gridline.get_visible() and 0 < tick.gridline.get_alpha() < 1
    with pytest.raises(ValueError, match="^plot_spectrum needs at least one spectrum$"):
        report.plot_spectrum({}, tmp_path / "none.png")


# --- the report -------------------------------------------------------------------------------


def test_report_without_plots_writes_the_summary_and_metrics_into_a_new_folder(tmp_path: Path) -> None:
    metrics = {"test/knn/class/top1": 0.5, "chance/test/knn/class/top1": 1 / 3, "test/diag/unif": -0.00021,
               "test/x/nan": float("nan")}
    data = {"sim_pos": np.array([0.5]), "sim_neg": np.array([0.1]), "spectrum/fused": np.array([2.0, 1.0])}
    out = tmp_path / "new" / "report"
    written = report.write_report(out, metrics, meta={"run": "x", "weight_decay": 1e-05, "views": ["a"]}, data=data,
                                  log_csv=tmp_path / "absent.csv", plots=False)
    assert written == {"metrics": out / "metrics.json", "summary": out / "summary.md"}
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "summary.md"]
    assert (out / "summary.md").read_text() == "\n".join([
        "# mmviews evaluation",
        "",
        "- run: x",
        "- weight_decay: 1e-05",
        "",
        "| metric | value | chance |",
        "|---|---|---|",
        "| test/diag/unif | -0.000210 |  |",
        "| test/knn/class/top1 | 0.5000 | 0.3333 |",
        "| test/x/nan | n/a |  |",
        "",
        "Accuracies, F1 and R@k are fractions in [0, 1].",
        "",
        "",
        "",
        "Plots not drawn (evaluation.plots: false).",
        "",
    ])
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == {"metrics": {**metrics, "test/x/nan": None},
                     "meta": {"run": "x", "weight_decay": 1e-05, "views": ["a"], "plots": []}}


def test_report_with_plots_lists_and_links_them(tmp_path: Path, saved_figures) -> None:
    log = tmp_path / "metrics.csv"
    log.write_text("step,loss\n1,2.0\n2,1.0\n")
    data = {"sim_pos": np.array([0.5, 0.6]), "sim_neg": np.array([0.1]), "spectrum/audio/x": np.array([2.0, 1.0])}
    written = report.write_report(tmp_path / "r", {"test/linear/class/acc": 0.75}, data=data, log_csv=log,
                                  title="run r")
    assert list(written) == ["training_curves", "similarity_hist", "spectrum", "metrics", "summary"]
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert summary.startswith("# run r\n\n\n| metric | value | chance |\n")
    assert summary.endswith("\n\nPlots: [training_curves.png](training_curves.png), "
                            "[similarity_hist.png](similarity_hist.png), [spectrum.png](spectrum.png)\n")
    meta = json.loads((tmp_path / "r" / "metrics.json").read_text())["meta"]
    assert meta == {"plots": ["similarity_hist.png", "spectrum.png", "training_curves.png"]}
    # the spectrum's name is everything after "spectrum/", slashes and all
    assert [line.get_label() for line in saved_figures[-1].axes[0].get_lines()] == ["audio/x"]
    # no training log there: a note instead of the curves; one similarity alone draws no histogram
    report.write_report(tmp_path / "s", {}, data={"sim_pos": np.array([0.5])}, log_csv=tmp_path / "absent.csv")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["metrics.json", "summary.md"]
    assert f"\nNo training log at {tmp_path / 'absent.csv'}; training curves not plotted.\n" in (
        tmp_path / "s" / "summary.md").read_text()


def test_summary_title_defaults_to_evaluation() -> None:
    assert report.markdown_summary({}).startswith("# Evaluation\n\n\n| metric | value | chance |\n")


# --- files and numbers ------------------------------------------------------------------------


def test_a_figure_is_saved_at_100_dpi_cropped_to_its_content_and_closed(tmp_path: Path) -> None:
    """Whatever the user's matplotlibrc says about resolution; the PNG is cropped to what is drawn
    (matplotlib's "tight" box: 0.1 inch of margin), and the figure saved, not pyplot's current one,
    is closed."""
    from PIL import Image

    plt = report._pyplot()
    with matplotlib.rc_context({"figure.dpi": 50, "savefig.dpi": 50}):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([0, 1], [0, 1])
        ax.set_title("title")
        other = plt.figure()  # the current figure now
        report._save_figure(fig, tmp_path / "f.png")
    assert not plt.fignum_exists(fig.number) and plt.fignum_exists(other.number)
    plt.close(other)
    with Image.open(tmp_path / "f.png") as image:
        assert image.format == "PNG" and [round(d) for d in image.info["dpi"]] == [100, 100]
        pixels = np.asarray(image.convert("L"))
    drawn_rows, drawn_cols = np.nonzero(pixels < 250)
    margins = (drawn_rows.min(), pixels.shape[0] - 1 - drawn_rows.max(), drawn_cols.min(),
               pixels.shape[1] - 1 - drawn_cols.max())
    assert max(margins) <= 15, margins  # 10 pixels of margin, a little more beside thin text


def test_json_values_are_plain_numbers_strings_and_none() -> None:
    import torch

    class Handle:  # an object with .item() but no array dimension: written as its str
        def item(self) -> float:
            return 1.0

        def __str__(self) -> str:
            return "handle"

    value = {1: np.float32(0.5), "t": torch.tensor(2), "z": np.array(3.0), "nan": np.float32("nan"),
             "list": [np.float32(1.5), (float("inf"), None, True)], "row": np.array([1, 2]), "path": Path("a/b"),
             "handle": Handle()}
    assert report._jsonable(value) == {"1": 0.5, "t": 2, "z": 3.0, "nan": None, "list": [1.5, [None, None, True]],
                                       "row": "[1 2]", "path": "a/b", "handle": "handle"}
    assert type(report._jsonable(np.float32(0.5))) is float


def test_json_file_is_sorted_and_indented(tmp_path: Path) -> None:
    report.atomic_write_json(tmp_path / "m.json", {"b": {"y": 1, "x": float("nan")}, "a": [np.float32(0.25)]})
    assert (tmp_path / "m.json").read_text() == (
        '{\n  "a": [\n    0.25\n  ],\n  "b": {\n    "x": null,\n    "y": 1\n  }\n}\n')


def test_acc2_note_names_the_conventions_only_for_binary_sentiment() -> None:
    from mmviews.eval.metrics import ACC2_CONVENTIONS

    note = "\n".join(["Acc-2 conventions (papers disagree on which one they print; both are reported):", ""]
                     + [f"- `{k}`: {v}" for k, v in ACC2_CONVENTIONS.items()])
    assert len(ACC2_CONVENTIONS) > 1
    assert report.acc2_note() == note
    assert report.acc2_note(["test/msa/mosi/Corr", "test/msa/mosi/Non0_acc_2"]) == note
    assert report.acc2_note(["Has0_acc_2"]) == note  # a bare name
    assert report.acc2_note(["test/linear/class/acc", "test/msa/mosi/Corr"]) == ""


@pytest.mark.parametrize("value, printed", [
    (0.1, "0.1000"), (9999.5, "9999.5000"), (1e4, "1e+04"), (10000.5, "1e+04"), (1e-4, "0.000100"),
    (9.99e-5, "9.99e-05"), ("text", "text"), (True, "True"), (0.25, "0.2500"),
])
def test_metric_digits_at_the_bounds_of_each_form(value, printed) -> None:
    assert report.format_metric(value) == printed
    if isinstance(value, float):
        assert report.format_metric(value, signed=True) == ("+" + printed)
