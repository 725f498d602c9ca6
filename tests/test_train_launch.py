"""Launches that never silently shrink: a launch that asked for N > 1
processes and got fewer stops before any work with one line naming the flag that fixes it.

The launcher's request is read from its command line (the process's parent) and its
``WORLD_SIZE``; the cases are checked on those inputs in this process, and the case that only
the parent's command line reveals (``accelerate launch --cpu --num_processes 2``, which starts
one process and tells it nothing) once under a real ``accelerate launch``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_utils import env, free_port, tiny_config, write_recipe

from mmviews.config import ConfigError, TrainConfig
from mmviews.train.distributed import check_launch, parse_accelerate_launch

ACCELERATE = [sys.executable, str(Path(sys.executable).with_name("accelerate"))]


def test_launcher_command_lines_are_read_with_accelerates_parser():
    launch = parse_accelerate_launch(
        [*ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "1234", "-m",
         "mmviews.cli", "train", "recipe.yaml", "--set", "cpu=true"])
    assert launch is not None and launch.num_processes == 2 and launch.multi_gpu and not launch.use_fsdp
    assert launch.options == ("--multi_gpu", "--num_processes", "2", "--main_process_port", "1234", "-m")
    assert launch.command("train", "--resume", "runs/a b") == (
        "accelerate launch --multi_gpu --num_processes 2 --main_process_port 1234 -m mmviews.cli train --resume "
        "'runs/a b'")
    fsdp = parse_accelerate_launch(["/usr/bin/accelerate", "launch", "--use_fsdp", "--fsdp_version", "2",
                                    "--num_processes=4", "/bin/mmviews", "train", "r.yaml"])
    assert fsdp is not None and fsdp.use_fsdp and fsdp.fsdp_version == "2" and fsdp.num_processes == 4
    assert fsdp.script == "/bin/mmviews" and fsdp.options == ("--use_fsdp", "--fsdp_version", "2", "--num_processes=4")
    # Not a launcher: a plain interpreter, torchrun, a shell.
    for argv in ([sys.executable, "-m", "mmviews.cli", "train", "r.yaml"], ["/bin/bash"], []):
        assert parse_accelerate_launch(argv) is None


def test_a_launch_that_got_fewer_processes_stops_naming_the_fix(monkeypatch):
    cpu = TrainConfig(cpu=True)
    one_of_two = parse_accelerate_launch([*ACCELERATE, "launch", "--cpu", "--num_processes", "2", "x.py"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ConfigError, match=r"--num_processes 2\) but started one.*--multi_gpu --num_processes 2"):
        check_launch(1, cpu, one_of_two)
    check_launch(2, cpu, parse_accelerate_launch([*ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "x.py"]))
    check_launch(1, cpu, parse_accelerate_launch([*ACCELERATE, "launch", "--cpu", "x.py"]))  # one asked, one got
    # WORLD_SIZE larger than the group: Accelerate's FSDP state on a machine without GPUs...
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"processes with FSDP .*without a GPU and without cpu: true.*add --set cpu=true"):
        check_launch(1, TrainConfig(cpu=False), None)
    # ... or any other mismatch
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 but this process group has 1 process"):
        check_launch(1, cpu, None)
    check_launch(2, cpu, None)


def test_accelerate_launch_cpu_without_multi_gpu_stops_before_work(tmp_path):
    """The real launcher: ``--cpu --num_processes 2`` starts one process, which stops with rc 2
    before the run folder is written."""
    raw = tiny_config(image=False, batch_norm=False, num_samples=32, batch_size=16, epochs=1)
    raw["cpu"] = True
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                           str(free_port()), "-m", "mmviews.cli", "train", str(recipe), "--output", str(run)],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("mmviews train: error:")]
    assert len(line) == 1 and "--multi_gpu --num_processes 2" in line[0], proc.stderr[-3000:]
    assert "returned non-zero exit status 2" in proc.stderr
    assert not run.exists()


def test_accelerates_fsdp_request_means_sharding(monkeypatch):
    """``accelerate launch --use_fsdp --fsdp_version 2`` asks for what ``distributed.sharding:
    fsdp`` asks for; version 1 and unknown values are refused in one line."""
    from mmviews.train.sharding import requested_sharding, run_sharding

    config = TrainConfig(cpu=True, adapters={"text": {}})
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert requested_sharding(config) == "none"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert requested_sharding(config) == "fsdp" and run_sharding(config, 2) == "fsdp"
    assert run_sharding(config, 1) == "none"  # one process: nothing to shard
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="--fsdp_version 2"):
        requested_sharding(config)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    config.distributed.sharding = "zero3"
    with pytest.raises(ConfigError, match="distributed.sharding"):
        requested_sharding(config)
    config.distributed.sharding = "fsdp"
    config.optimisation.mixed_precision = "fp16"
    with pytest.raises(ConfigError, match="fp16 is not supported with distributed.sharding: fsdp"):
        run_sharding(config, 2)
    assert run_sharding(config, 1) == "none"
    config.distributed.fsdp_units = {"audio": "layers"}
    with pytest.raises(ConfigError, match="fsdp_units.audio"):
        requested_sharding(config)


def test_check_estimate_counts_the_shards(tmp_path):
    """``--check`` on N = 2 sharded processes: 1/2 of the encoder's gradients, optimiser state and
    parameters (buffers whole), plus twice the largest unit's parameters (the text backbone here,
    counted by the test from the module itself)."""
    from mmviews.config import load_config
    from mmviews.train import build_run
    from mmviews.train.memory import estimate_memory

    raw = tiny_config(image=False, batch_norm=False, num_samples=32, batch_size=16, epochs=1)
    raw["cpu"] = True
    estimates = {}
    for sharding in ("none", "fsdp"):
        raw["distributed"] = {"sharding": sharding}
        parts = build_run(load_config(write_recipe(tmp_path / f"{sharding}.yaml", raw)), 2, with_eval=False)
        estimates[sharding] = estimate_memory(parts, 2, activations=(0.0, 0.0), measure_slack=False)
    whole, sharded = estimates["none"], estimates["fsdp"]
    encoder = parts.encoder
    params = sum(p.numel() * p.element_size() for p in encoder.parameters())
    buffers = sum(b.numel() * b.element_size() for b in encoder.buffers())
    backbone = sum(p.numel() * p.element_size() for p in encoder.adapters["text"].backbone.parameters())
    assert not whole.sharded and whole.gathered == 0 and sharded.sharded
    assert sharded.gradients == -(-whole.gradients // 2) and sharded.optimizer_state < 0.51 * whole.optimizer_state
    assert sharded.parameters == buffers + -(-params // 2)
    assert sharded.gathered == 2 * backbone
    assert sharded.static < whole.static


def test_resume_hint_is_the_launch_read_back(monkeypatch):
    """The resume command after Ctrl-C is one to paste: the launcher's own
    options, ``-m mmviews.cli`` when the launched script was another (e.g. a wrapper), a working
    ``accelerate launch`` line under another launcher of N processes, else ``mmviews train``."""
    import mmviews.cli.train as cli_train

    launch = parse_accelerate_launch([*ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "-m",
                                      "mmviews.cli", "train", "r.yaml", "--set", "cpu=true"])
    monkeypatch.setattr(cli_train, "accelerate_launch", lambda: launch)
    assert cli_train.resume_command(Path("runs/a b")) == (
        "accelerate launch --multi_gpu --num_processes 2 -m mmviews.cli train --resume 'runs/a b'")
    wrapper = parse_accelerate_launch([*ACCELERATE, "launch", "--multi_gpu", "--num_processes=2", "wrap.py", "x"])
    monkeypatch.setattr(cli_train, "accelerate_launch", lambda: wrapper)
    assert cli_train.resume_command(Path("run"), allow_remote_models=True) == (
        "accelerate launch --multi_gpu --num_processes=2 -m mmviews.cli train --resume run --allow-remote-models")
    monkeypatch.setattr(cli_train, "accelerate_launch", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun
    assert cli_train.resume_command(Path("run")) == (
        "accelerate launch --multi_gpu --num_processes 4 -m mmviews.cli train --resume run")
    monkeypatch.delenv("WORLD_SIZE")
    assert cli_train.resume_command(Path("run")) == "mmviews train --resume run"
