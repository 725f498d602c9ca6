"""Reports, plots, evaluate_encoder end to end, `mmviews eval` and `mmviews compare`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from mmviews.data.batch import ViewBatch, ViewInfo
from mmviews.eval import evaluate_encoder, parse_tasks, write_report
from mmviews.eval.compare import compare_runs

VIEWS = [ViewInfo("text_0", "text", 0), ViewInfo("audio_0", "audio", 0), ViewInfo("audio_1", "audio", 1, natural=False)]


class Clusters(Dataset):
    """Sample i: class c = i % 3, sentiment score tied to c; 3 views = class centre + noise."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.arange(n) % 3
        centre = torch.zeros(n, 8)
        centre[torch.arange(n), self.y] = 3.0
        self.x = centre[:, None, :] + 0.5 * torch.randn(n, 3, 8, generator=g)
        self.s = self.y.double() - 0.7 + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], self.s[i], i


def collate(items) -> ViewBatch:
    x = torch.stack([it[0] for it in items])  # [K, 3, 8]
    k = x.shape[0]
    mask = torch.ones(k, 3, dtype=torch.bool)
    idx = torch.tensor([it[3] for it in items])
    mask[:, 2] = idx % 4 != 0  # some augmented audio views absent
    return ViewBatch(
        inputs={"text": {"values": x[:, 0]}, "audio": {"values": x[:, 1:].reshape(2 * k, 8)}},
        views=VIEWS,
        mask=mask,
        labels={"class": torch.stack([it[1] for it in items]), "sentiment": torch.stack([it[2] for it in items])},
        index=idx,
    )


def encoder(batch: ViewBatch):
    k = batch.num_samples
    z = torch.cat([batch.inputs["text"]["values"][:, None], batch.inputs["audio"]["values"].reshape(k, 2, 8)], 1)
    return z, batch.mask


def loader(n: int, seed: int) -> DataLoader:
    return DataLoader(Clusters(n, seed), batch_size=32, collate_fn=collate)


def check_png(path: Path, min_side: int = 100) -> None:
    assert path.is_file() and path.stat().st_size > 2000, path
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert min(im.size) >= min_side, im.size
        # not a blank canvas
        assert len(set(np.asarray(im.convert("L")).ravel().tolist())) > 5


def write_log(path: Path) -> Path:
    lines = ["step,loss,lr,mi_bound"] + [f"{s},{2.0 / (s + 1)},{1e-3},{'' if s % 2 else s / 10}" for s in range(20)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_write_report_files_and_plots(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    data = {
        "sim_pos": (0.6 + 0.1 * torch.randn(500, generator=g)).numpy(),
        "sim_neg": (0.1 * torch.randn(2000, generator=g)).numpy(),
        "spectrum/fused": torch.linalg.svdvals(torch.randn(50, 20, generator=g)).numpy(),
    }
    metrics = {"test/msa/mosi/Has0_acc_2": 0.8, "test/msa/mosi/Corr": float("nan"), "test/knn/class/top1": 0.5}
    out = write_report(tmp_path / "rep", metrics, meta={"run": "x"}, data=data, log_csv=write_log(tmp_path / "log.csv"))
    for key in ("training_curves", "similarity_hist", "spectrum"):
        check_png(out[key])
    saved = json.loads((tmp_path / "rep" / "metrics.json").read_text())
    assert saved["metrics"]["test/msa/mosi/Has0_acc_2"] == 0.8
    assert saved["metrics"]["test/msa/mosi/Corr"] is None  # NaN is not valid JSON
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "Has0_acc_2" in summary and "Non0_acc_2" in summary and "negative vs non-negative" in summary
    assert "training_curves.png" in summary
    assert not list((tmp_path / "rep").glob("*.tmp"))
    # a report without binary-sentiment accuracies carries no Acc-2 note
    write_report(tmp_path / "cls", {"test/linear/class/acc": 0.7}, meta={"run": "y"})
    assert "Acc-2" not in (tmp_path / "cls" / "summary.md").read_text()


def test_training_log_without_step_column_is_rejected(tmp_path: Path):
    bad = tmp_path / "log.csv"
    bad.write_text("iteration,loss\n1,2\n")
    with pytest.raises(ValueError, match=r"log.csv: a training log needs a 'step' column"):
        write_report(tmp_path / "rep", {}, log_csv=bad)


def test_parse_tasks():
    tasks = parse_tasks(["linear", "knn:label2", "msa:mosi", {"kind": "linear_probe", "label": "class"}, "retrieval"])
    assert [(t.kind, t.label, t.dataset) for t in tasks] == [
        ("linear", "class", None), ("knn", "label2", None), ("msa", "sentiment", "mosi"),
        ("linear", "class", None), ("retrieval", None, None),
    ]
    with pytest.raises(ValueError, match="unknown evaluation task"):
        parse_tasks(["svm"])
    with pytest.raises(ValueError, match="msa needs a dataset"):
        parse_tasks(["msa"])
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['kk'\]; knn accepts \['k', 'temperature'\]"):
        parse_tasks([{"kind": "knn", "kk": 3}])


def test_evaluate_encoder_end_to_end(tmp_path: Path):
    metrics = evaluate_encoder(
        encoder, loader(150, 0), loader(60, 1), loader(90, 2),
        [{"kind": "linear", "weight_decays": [1e-3, 1e-2]}, {"kind": "knn", "k": 20}, "msa:mosi", "regression",
         "retrieval", "diagnostics"],
        out_dir=tmp_path / "eval", log_csv=write_log(tmp_path / "log.csv"), meta={"objective": "mv_dhel"},
    )
    assert metrics["test/linear/class/acc"] > 0.95
    assert metrics["test/knn/class/top1"] > 0.95
    assert metrics["test/msa/mosi/Has0_acc_2"] > 0.9
    assert set(k.rsplit("/", 1)[1] for k in metrics if "/msa/" in k) >= {"Has0_acc_2", "Non0_acc_2", "Acc_7", "Corr"}
    # default retrieval pairs: the first view of each modality, both directions
    assert "test/retrieval/text_0->audio_0/R@1" in metrics and "test/retrieval/audio_0->text_0/MedR" in metrics
    assert not any("audio_1" in k for k in metrics if "/retrieval/" in k)
    assert 0.0 <= metrics["test/diag/align"] and metrics["test/diag/unif"] < 0
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert saved["meta"]["eval_num_views"] == 3 and saved["meta"]["n_test"] == 90 and saved["meta"]["objective"] == "mv_dhel"
    assert saved["metrics"]["test/knn/class/top1"] == pytest.approx(metrics["test/knn/class/top1"])
    for name in ("training_curves.png", "similarity_hist.png", "spectrum.png"):
        check_png(tmp_path / "eval" / name)
    with pytest.raises(ValueError, match="label 'missing' is not in the train batches"):
        evaluate_encoder(encoder, loader(30, 0), None, loader(30, 1), ["linear:missing"])


def make_run(root: Path, name: str, objective: str, views: int, acc: float) -> Path:
    """A run folder as the trainer leaves it: ``eval/metrics.json`` with the objective and the
    training M in its meta."""
    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "metrics.json").write_text(json.dumps({
        "metrics": {"test/knn/class/top1": acc, "test/diag/unif": -acc, "test/msa/mosi/Corr": None},
        "meta": {"objective": objective, "num_views": views, "eval_num_views": 1},
    }))
    return run


def test_compare_runs_table_and_plots(tmp_path: Path):
    runs = [
        make_run(tmp_path, "pvc_m2", "geometric_pvc", 2, 0.6),
        make_run(tmp_path, "pvc_m4", "geometric_pvc", 4, 0.7),
        make_run(tmp_path, "dhel_m2", "mv_dhel", 2, 0.65),
        make_run(tmp_path, "dhel_m4", "mv_dhel", 4, 0.75),
    ]
    written = compare_runs(runs, tmp_path / "cmp")
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    for r in ("pvc_m2", "pvc_m4", "dhel_m2", "dhel_m4", "geometric_pvc", "test/knn/class/top1", "0.7500"):
        assert r in table
    assert "| num_views | 2 | 4 | 2 | 4 |" in table
    check_png(written["metrics_bar"])
    check_png(written["metric_vs_views"])
    rows = (tmp_path / "cmp" / "comparison.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("run,path,objective,num_views")
    with pytest.raises(FileNotFoundError, match="nothing: no such run folder"):
        compare_runs([tmp_path / "nothing"], tmp_path / "cmp2")
    (tmp_path / "empty").mkdir()  # a folder that exists but holds no evaluation: evaluate it first
    with pytest.raises(FileNotFoundError, match="no metrics.json .*mmviews eval"):
        compare_runs([tmp_path / "empty"], tmp_path / "cmp3")


def test_compare_reads_objective_and_views_from_meta_only(tmp_path: Path):
    from mmviews.eval.compare import load_run_metrics

    run = make_run(tmp_path, "r", "mv_dhel", 3, 0.5)
    assert load_run_metrics(run).num_views == 3.0 and load_run_metrics(run).objective == "mv_dhel"
    # a run folder's config is not read: without meta, the training M is unknown
    (run / "config.yaml").write_text(yaml.safe_dump({"objective": {"name": "simclr"}, "views": ["text", "audio"]}))
    (run / "eval" / "metrics.json").write_text(json.dumps({"metrics": {"test/diag/unif": -1.0}, "meta": {}}))
    assert load_run_metrics(run).num_views is None and load_run_metrics(run).objective == "run"
    # only the report form that evaluate_encoder writes is accepted
    (run / "eval" / "metrics.json").write_text(json.dumps({"test/diag/unif": -1.0}))
    with pytest.raises(ValueError, match=r"metrics\.json: expected an evaluation report"):
        load_run_metrics(run)


def test_training_curve_panels():
    from mmviews.eval.report import training_curve_panels

    columns = ["epoch", "loss", "critic_distance", "neg_sim", "pos_sim", "mi_lower_bound", "lr_backbone", "lr_head",
               "samples_per_s", "time_s"]
    assert training_curve_panels(columns) == [
        ("loss", ["loss"]), ("MI lower bound (nats)", ["mi_lower_bound"]), ("cosine similarity", ["pos_sim", "neg_sim"]),
        ("critic_distance", ["critic_distance"]), ("learning rate", ["lr_backbone", "lr_head"]),
        ("throughput (samples/s)", ["samples_per_s"]),
    ]
    # no MI bound for objectives without one; epoch and time_s never get a panel
    assert [t for t, _ in training_curve_panels(["epoch", "loss", "lr_head", "time_s"])] == ["loss", "learning rate"]


def test_cli_compare_dispatch(tmp_path: Path, capsys):
    from mmviews.cli import main

    runs = [make_run(tmp_path, f"r{m}", "mv_dhel", m, 0.5 + m / 10) for m in (2, 3)]
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    assert "r2" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2


def test_cli_eval_missing_run_fails_clearly(tmp_path: Path, capsys):
    from mmviews.cli import main

    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_eval_with_a_run_loader(tmp_path: Path, monkeypatch, capsys):
    from mmviews.cli import eval as eval_command
    from mmviews.cli import main
    from mmviews.config import config_from_dict

    seen = {}

    def load_run(path):
        seen["path"] = Path(path)
        config = config_from_dict({
            "name": "toy", "views": [{"modality": "text"}, {"modality": "audio", "copies": 2}],
            "adapters": {"text": {"type": "mlp"}, "audio": {"type": "mlp"}},
            "objective": {"name": "mv_dhel"}, "evaluation": {"tasks": [{"kind": "knn", "k": 10}, "diagnostics"]},
        })
        return encoder, config, {"train": loader(90, 0), "val": None, "test": loader(45, 1)}

    monkeypatch.setattr(eval_command, "load_run", load_run)
    run = tmp_path / "run"
    run.mkdir()
    write_log(run / "metrics.csv")
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    # the headline table as `mmviews train` prints it, not a dump of every metric
    assert out.splitlines()[0] == "test metrics:", out
    assert "test/knn/class/top1  trained " in out and "chance 0.3333" in out
    assert "{" not in out and "test/diag/" not in out and len(out.splitlines()) < 10, out
    assert seen["path"] == run
    saved = json.loads((run / "eval-1" / "metrics.json").read_text())  # a new folder: never the run's eval/
    assert saved["metrics"]["test/knn/class/top1"] > 0.9
    assert saved["meta"]["objective"] == "mv_dhel" and saved["meta"]["num_views"] == 3  # the training M
    check_png(run / "eval-1" / "training_curves.png")


def test_summary_keeps_the_digits_of_small_and_large_numbers():
    from mmviews.eval.report import markdown_summary

    text = markdown_summary({"test/linear/class/weight_decay": 1e-05, "test/linear/class/acc": 0.8125,
                             "test/x/zero": 0.0, "test/x/big": 123456.0})
    assert "| test/linear/class/weight_decay | 1e-05 |" in text  # not 0.0000
    assert "| test/linear/class/acc | 0.8125 |" in text
    assert "| test/x/zero | 0.0000 |" in text
    assert "| test/x/big | 1.235e+05 |" in text


def add_training_outputs(run: Path, final_loss: float, wall: float, random_acc: float, mi: bool) -> None:
    """What the trainer writes beside eval/: results.json, eval_random/metrics.json, metrics.csv."""
    (run / "results.json").write_text(json.dumps({"steps": 4, "final_loss": final_loss, "wall_time_s": wall}))
    (run / "eval_random").mkdir()
    (run / "eval_random" / "metrics.json").write_text(json.dumps({
        "metrics": {"test/knn/class/top1": random_acc}, "meta": {}}))
    header = "step,loss,neg_sim,pos_sim" + (",mi_lower_bound" if mi else "")
    rows = [f"{s},{final_loss + 4 - s},{0.1},{0.2 * s}" + (f",{0.5 * s - 1}" if mi else "") for s in range(1, 5)]
    (run / "metrics.csv").write_text("\n".join([header, *rows]) + "\n")


def test_compare_adds_training_curves_random_init_final_loss_and_wall_time(tmp_path: Path, capsys):
    from mmviews.cli import main

    a, b = make_run(tmp_path, "pvc", "geometric_pvc", 4, 0.7), make_run(tmp_path, "dhel", "mv_dhel", 4, 0.8)
    add_training_outputs(a, 17.25, 91.5, 0.55, mi=True)
    add_training_outputs(b, 12.5, 60.25, 0.6, mi=False)
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| final training loss | 17.2500 | 12.5000 |" in table
    assert "| wall time (s) | 91.5000 | 60.2500 |" in table
    assert "| steps | 4 | 4 |" in table
    assert "| test/knn/class/top1 | +0.1500 (0.5500) | +0.2000 (0.6000) |" in table  # trained minus its own random init
    assert "[training_curves.png](training_curves.png)" in table
    check_png(tmp_path / "cmp" / "training_curves.png")
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert saved["pvc"]["random_init"] == {"test/knn/class/top1": 0.55} and saved["dhel"]["final_loss"] == 12.5
    from mmviews.eval.compare import load_run_metrics

    curves = load_run_metrics(a).curves
    assert curves["step"] == [1.0, 2.0, 3.0, 4.0] and curves["mi_lower_bound"] == [-0.5, 0.0, 0.5, 1.0]
    assert "mi_lower_bound" not in load_run_metrics(b).curves
    header = (tmp_path / "cmp" / "comparison.csv").read_text().splitlines()[0]
    assert header.startswith("run,path,objective,num_views,steps,final_loss,wall_time_s") and "random_init/" in header


def test_spectrum_legend_names_the_views(monkeypatch, tmp_path: Path):
    """The singular-value plot's lines are labelled with the views' names, not view0/view1."""
    import mmviews.eval.report as report
    from mmviews.eval import evaluate_encoder

    seen: list[list[str]] = []
    original = report.plot_spectrum

    def spy(spectra, out_png):
        seen.append(list(spectra))
        return original(spectra, out_png)

    monkeypatch.setattr(report, "plot_spectrum", spy)
    evaluate_encoder(encoder, None, None, loader(45, 1), ["diagnostics"], out_dir=tmp_path / "e")
    assert seen == [["text_0", "audio_0", "audio_1", "fused"]]
