"""End to end on the synthetic data: a short `mmviews train` run trains (the loss falls),
checkpoints, evaluates against the randomly initialised encoder and writes its report; the
run loads back with `load_run`."""

from __future__ import annotations

import csv
import json

import torch
from test_train_utils import tiny_config, train_in_process, write_recipe

from mmviews.run import list_checkpoints, load_run


def test_short_run_trains_checkpoints_evaluates_and_reports(tmp_path):
    raw = tiny_config(num_samples=96, epochs=4, tasks=["linear:class", "regression:sentiment"])
    raw["optimisation"]["lr"] = 5e-3
    raw["output"]["checkpoint_every"] = 3
    recipe = write_recipe(tmp_path / "tiny.yaml", raw)
    run = tmp_path / "run"
    # the command's main in this process (a subprocess would pay ~3 s of imports first)
    r = train_in_process(str(recipe), "--output", str(run), "--set", "evaluation.fuse=mean")
    assert r.returncode == 0, r.stderr[-3000:]

    # Resolved config beside the run, with the override applied.
    saved = (run / "config.yaml").read_text()
    assert "fuse: mean" in saved

    # Per-step log: 6 batches/epoch x 4 epochs, the loss falls, lr and throughput are logged.
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    losses = [float(r["loss"]) for r in rows]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    assert float(rows[0]["samples_per_s"]) > 0 and "lr_head" in rows[0] and "pos_sim" in rows[0]
    assert float(rows[-1]["lr_head"]) < float(rows[len(rows) // 2]["lr_head"])  # cosine decay

    # Checkpoints: the last keep_last=2 complete ones, no temporary folder left.
    ckpts = list_checkpoints(run)
    assert [c.name for c in ckpts] == ["checkpoint-00000021", "checkpoint-00000024"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    train_state = json.loads((ckpts[-1] / "train_state.json").read_text())
    assert {k: v for k, v in train_state.items() if k not in ("files", "wall_time_s")} == {
        "epoch": 4, "batch_in_epoch": 0, "step": 24, "samples": 384}
    assert 0 < train_state["wall_time_s"] <= json.loads((run / "results.json").read_text())["wall_time_s"]
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "objective.pt"} <= set(train_state["files"])

    # Evaluation of the trained and of the randomly initialised encoder, and the report.
    results = json.loads((run / "results.json").read_text())
    trained, random_init = results["eval"], results["eval_random"]
    for key in ("test/linear/class/acc", "test/regression/sentiment/r2"):
        assert key in trained and key in random_init
    assert (run / "eval" / "summary.md").is_file() and (run / "eval_random" / "metrics.json").is_file()
    report = (run / "report.md").read_text()
    assert "test/linear/class/acc" in report and "random init" in report

    # load_run gives the final encoder, the config and unshuffled loaders; a checkpoint too.
    encoder, config, loaders = load_run(run)
    assert config.name == "tiny" and set(loaders) == {"train", "val", "test"}
    # The encoder folder holds the weights training ended with: those of the last checkpoint
    # (written separately, by Accelerate's save_state), read here straight from its file...
    from safetensors.torch import load_file

    at_end = load_file(str(ckpts[-1] / "model.safetensors"))
    loaded = encoder.state_dict()
    assert loaded.keys() == at_end.keys()
    for k, v in at_end.items():
        assert torch.equal(loaded[k], v), k
    # ...not those it started from (same seed, same initialisation).
    from mmviews.train import build_run

    initial = build_run(config, with_eval=False).encoder.state_dict()
    moved = [k for k, v in initial.items() if v.is_floating_point() and not torch.equal(v, loaded[k])]
    assert len(moved) > len(initial) // 2, moved
    from_ckpt, _, _ = load_run(ckpts[-1])  # a checkpoint folder loads as a run too
    for (k, a), b in zip(from_ckpt.state_dict().items(), encoder.state_dict().values()):
        assert torch.equal(a, b), k
    batch = next(iter(loaders["test"]))
    z, mask = encoder(batch)
    assert z.shape == (batch.num_samples, 2, 16) and [v.name for v in batch.views] == ["text_0", "image_0"]

    # `mmviews eval` loads the run itself and records the training M for `mmviews compare`.
    from mmviews.cli import main
    from mmviews.eval.compare import load_run_metrics

    assert main(["eval", str(run), "--tasks", "diagnostics", "--output", str(tmp_path / "again")]) == 0
    again = load_run_metrics(tmp_path / "again")
    assert again.num_views == 3 and again.objective == "mv_dhel" and "test/diag/unif" in again.metrics
    assert load_run_metrics(run).num_views == 3  # the trainer's final evaluation records it too
