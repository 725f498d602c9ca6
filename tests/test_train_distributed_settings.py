"""The process-level settings of mmviews.train.distributed, in this process: where the step runs
(``steps_on_cpu``), the process group's timeout, deterministic algorithms, the launcher's FSDP
request read from its environment, and the launcher command lines read back. (The launches
themselves: test_train_launch.py; N processes == 1: test_train_distributed.py.)"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mmviews.config import ConfigError, TrainConfig
from mmviews.notices import MMViewsRuntimeWarning
from mmviews.train import distributed
from mmviews.train.distributed import (
    configure_determinism, fsdp_requested_by_launcher, parse_accelerate_launch, process_group_kwargs, steps_on_cpu,
    timeout_of,
)

ACCELERATE = [sys.executable, str(Path(sys.executable).with_name("accelerate"))]


@pytest.mark.parametrize("cpu, cuda, expected", [(True, True, True), (True, False, True), (False, False, True),
                                                 (False, True, False)])
def test_the_step_runs_on_the_cpu_when_asked_or_without_a_cuda_device(monkeypatch, cpu, cuda, expected) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert steps_on_cpu(TrainConfig(cpu=cpu)) is expected


def test_the_timeout_is_the_recipes_and_must_be_positive() -> None:
    config = TrainConfig()
    config.distributed.timeout_s = 90
    assert timeout_of(config) == datetime.timedelta(seconds=90)
    assert process_group_kwargs(config).to_kwargs() == {"timeout": datetime.timedelta(seconds=90)}
    for bad in (0, -5, float("nan")):
        config.distributed.timeout_s = bad
        with pytest.raises(ConfigError, match=rf"^distributed.timeout_s must be > 0 seconds, got {bad!r}$"):
            timeout_of(config)


@pytest.mark.parametrize("use_fsdp, version, expected", [
    (None, "2", None), ("false", "2", None), ("0", None, None), ("no", "2", None),
    ("true", "2", "2"), ("TRUE", "2", "2"), ("1", "2", "2"), ("yes", "1", "1"),
    ("true", None, "1"),  # Accelerate's own default version when it sets none
])
def test_the_launchers_fsdp_request_and_version(monkeypatch, use_fsdp, version, expected) -> None:
    for name, value in (("ACCELERATE_USE_FSDP", use_fsdp), ("FSDP_VERSION", version)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert fsdp_requested_by_launcher() == expected


def test_fsdp_requested_without_a_version_is_refused_as_version_1(monkeypatch) -> None:
    """Only ACCELERATE_USE_FSDP set (no FSDP_VERSION): Accelerate runs FSDP1, which mmviews
    refuses, naming the flag."""
    from mmviews.train.sharding import requested_sharding

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ConfigError, match=r"FSDP_VERSION=1: .*--fsdp_version 2"):
        requested_sharding(TrainConfig(cpu=True, adapters={"text": {}}))


@pytest.fixture
def determinism_restored(monkeypatch):
    """The process's deterministic settings put back after the test."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1], saved[2]


def test_determinism_off_changes_nothing(determinism_restored) -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    configure_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_determinism_on_sets_algorithms_cudnn_and_cublas(determinism_restored, monkeypatch) -> None:
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure_determinism(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # a user's own workspace setting stands
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    configure_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_determinism_warns_when_cuda_started_without_the_cublas_setting(determinism_restored, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(MMViewsRuntimeWarning, match=r"CUDA started before CUBLAS_WORKSPACE_CONFIG could be set.*"
                      r"CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        configure_determinism(True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure_determinism(True)  # set by the user before CUDA started: nothing to say


@pytest.mark.parametrize("argv, rest", [
    (["accelerate", "launch", "--cpu", "x.py"], ["--cpu", "x.py"]),
    (["/usr/bin/accelerate-launch", "--cpu", "x.py"], ["--cpu", "x.py"]),
    (["python", "-m", "accelerate.commands.launch", "--cpu", "x.py"], ["--cpu", "x.py"]),
    (["python", "-m", "accelerate.commands.accelerate_cli", "launch", "--cpu", "x.py"], ["--cpu", "x.py"]),
    (["python", "-m", "accelerate.commands.launch", "launch", "x.py"], ["x.py"]),
    (["accelerate", "env"], None),
    (["python", "accelerate", "launch", "x.py"], ["x.py"]),
    (["a", "b", "c", "accelerate", "launch", "x.py"], None),  # only the first three words name the launcher
    (["python", "-m", "mmviews.cli", "train"], None),
])
def test_launcher_command_lines(argv, rest) -> None:
    assert distributed._launch_argv(argv) == rest


def test_a_launch_read_back_gives_paste_ready_lines(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(distributed, "_config_file_processes", lambda path: None)
    launch = parse_accelerate_launch([*ACCELERATE, "launch", "--cpu", "--use_fsdp", "/bin/mmviews", "train", "r"])
    assert launch is not None and launch.num_processes is None and launch.cpu and launch.use_fsdp
    assert not launch.multi_gpu and launch.fsdp_version is not None
    assert launch.mmviews_command("train", "--resume", "r") == "accelerate launch --cpu --use_fsdp /bin/mmviews train --resume r"
    wrapper = parse_accelerate_launch([*ACCELERATE, "launch", "--module", "wrap", "x"])
    assert wrapper is not None and wrapper.script == "wrap"
    assert wrapper.mmviews_command("embed", "a b") == "accelerate launch -m mmviews.cli embed 'a b'"
    assert parse_accelerate_launch([*ACCELERATE, "launch", "--num_processes", "two", "x.py"]) is None


def test_the_config_files_process_count_is_read(monkeypatch, tmp_path) -> None:
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 3\n")
    launch = parse_accelerate_launch([*ACCELERATE, "launch", "--config_file", str(config), "x.py"])
    assert launch is not None and launch.num_processes == 3
    assert distributed._config_file_processes(str(tmp_path / "missing.yaml")) is None
    (tmp_path / "bad.yaml").write_text("num_processes: [\n")
    assert distributed._config_file_processes(str(tmp_path / "bad.yaml")) is None


def test_the_parent_command_line_is_read_from_proc(monkeypatch) -> None:
    parent = distributed._parent_command_line()
    assert parent and parent == Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:len(parent)]
    monkeypatch.setattr(os, "getppid", lambda: 2**22 + 12345)  # no such process
    assert distributed._parent_command_line() == []
    assert distributed.accelerate_launch() is None


def test_fsdp_version_guard_fails_when_a_missing_version_means_2(monkeypatch) -> None:
    from mutations import apply_break

    apply_break("launcher_fsdp_defaults_to_version_2", monkeypatch.setattr)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_fsdp_requested_without_a_version_is_refused_as_version_1(monkeypatch)


def test_a_timeout_below_one_second_is_a_timeout() -> None:
    config = TrainConfig()
    config.distributed.timeout_s = 0.5
    assert timeout_of(config) == datetime.timedelta(seconds=0.5)


def test_the_parent_command_line_keeps_bytes_that_are_not_utf8(monkeypatch) -> None:
    import subprocess
    import time

    # a shell waiting on its input, with an argument that is not UTF-8 in its command line
    child = subprocess.Popen(["/bin/sh", "-c", "read line", "sh", b"caf\xe9"], stdin=subprocess.PIPE)
    try:
        # the child's pid given, not os.getppid patched: a video-store watcher thread left in this
        # process by another test ends the process when os.getppid() changes
        deadline = time.monotonic() + 10
        while not distributed._parent_command_line(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # /proc shows an empty command line while the child is still being exec'd
        assert distributed._parent_command_line(child.pid) == ["/bin/sh", "-c", "read line", "sh", "caf\ufffd"]
    finally:
        child.communicate(b"\n")


def test_the_launch_line_keeps_mmviews_own_module_and_drops_anothers(monkeypatch) -> None:
    monkeypatch.setattr(distributed, "_config_file_processes", lambda path: None)
    own = parse_accelerate_launch([*ACCELERATE, "launch", "--multi_gpu", "-m", "mmviews.cli", "train", "r"])
    assert own.mmviews_command("train", "x") == "accelerate launch --multi_gpu -m mmviews.cli train x"
    other = parse_accelerate_launch([*ACCELERATE, "launch", "--multi_gpu", "-m", "wrap", "train"])
    assert other.mmviews_command("train", "x") == "accelerate launch --multi_gpu -m mmviews.cli train x"
    script = parse_accelerate_launch([*ACCELERATE, "launch", "/opt/bin/mmviews", "train"])
    assert script.mmviews_command("embed") == "accelerate launch /opt/bin/mmviews embed"


CPU_LINE = "accelerate launch --multi_gpu --num_processes {n} -m mmviews.cli train RECIPE --set cpu=true"
GPU_LINE = "accelerate launch --multi_gpu --num_processes {n} -m mmviews.cli train RECIPE"


@pytest.mark.parametrize("cpu, fsdp, message", [
    (False, True, "the launcher started 3 processes with FSDP (WORLD_SIZE=3), but without a GPU and without cpu: true "
                  "each would train alone; add --set cpu=true (" + CPU_LINE.format(n=3)
     + " --set distributed.sharding=fsdp: mmviews then shards with FSDP2 over gloo itself)"),
    (False, False, "the launcher started 3 processes (WORLD_SIZE=3), but without a GPU and without cpu: true each "
                   "would train alone; add --set cpu=true (" + CPU_LINE.format(n=3) + ")"),
])
def test_world_size_without_a_gpu_names_the_cpu_launch(monkeypatch, cpu, fsdp, message) -> None:
    from mmviews.train.distributed import check_launch

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if fsdp:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        monkeypatch.setenv("FSDP_VERSION", "2")
    else:
        monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ConfigError) as raised:
        check_launch(1, TrainConfig(cpu=cpu), None)
    assert str(raised.value) == message


@pytest.mark.parametrize("cpu, line", [(True, CPU_LINE), (False, GPU_LINE)])
def test_world_size_larger_than_the_group_names_the_launch(monkeypatch, cpu, line) -> None:
    from mmviews.train.distributed import check_launch

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as raised:
        check_launch(2, TrainConfig(cpu=cpu), None)
    assert str(raised.value) == (f"the launcher set WORLD_SIZE=4 but this process group has 2 process(es); launch with "
                                 f"{line.format(n=4)} (or torchrun --nproc_per_node 4)")


@pytest.mark.parametrize("config_cpu, launch_cpu, line", [(True, False, CPU_LINE), (False, True, CPU_LINE),
                                                           (False, False, GPU_LINE)])
def test_a_launch_of_one_process_read_from_the_parent_names_the_launch(monkeypatch, config_cpu, launch_cpu,
                                                                        line) -> None:
    """Without a launch given, check_launch reads the parent's (here: one that asked for 2)."""
    from mmviews.train.distributed import check_launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    asked = parse_accelerate_launch([*ACCELERATE, "launch", *(["--cpu"] if launch_cpu else []), "--num_processes", "2",
                                     "x.py"])
    monkeypatch.setattr(distributed, "accelerate_launch", lambda: asked)
    with pytest.raises(ConfigError) as raised:
        check_launch(1, TrainConfig(cpu=config_cpu))
    assert str(raised.value) == (
        "accelerate launch asked for 2 processes (--num_processes 2) but started one: without --multi_gpu (also on "
        f"CPU) Accelerate runs a single process; launch with {line.format(n=2)}")


def test_determinisms_warning_points_at_the_caller(determinism_restored, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(MMViewsRuntimeWarning) as caught:
        configure_determinism(True)
    assert str(caught[0].message) == ("deterministic: CUDA started before CUBLAS_WORKSPACE_CONFIG could be set; cuBLAS "
                                      "may stay nondeterministic (set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment)")
    # (under mutation testing, mutmut's trampoline is the extra frame between: stacklevel cannot be seen there)
    assert caught[0].filename == __file__ or "mutmut" in Path(caught[0].filename).parts


class _Gloo(RuntimeError):
    pass


@pytest.mark.parametrize("error, expected", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
     "process 1 of 4 stopped after step 7: another process left (it died or was killed); newest complete checkpoint: "
     "runs/x/checkpoints/checkpoint-6"),
    (RuntimeError("Broken pipe"), "another process left"),
    (RuntimeError("Connection reset by peer"), "another process left"),
    (RuntimeError("connection refused"), "another process left"),
    (RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete"),
     "process 1 of 4 stopped after step 7: it waited more than distributed.timeout_s = 90 s for the other processes in "
     "a collective (one of them hung, was stopped, or died); newest complete checkpoint: runs/x/checkpoints/checkpoint-6"),
    (RuntimeError("NCCL watchdog: collective operation timeout"), "it waited more than distributed.timeout_s = 90 s"),
    (RuntimeError("Timeout in nccl"), "it waited more than"),
    (RuntimeError("timed out (no backend named)"), None),
    (RuntimeError("CUDA out of memory"), None),
    (ValueError("connection closed by peer"), None),
    (_Gloo("timed out in gloo"), "it waited more than"),
])
def test_a_collective_that_lost_a_peer_is_one_line(monkeypatch, error, expected) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    failure = distributed.collective_failure(error, 90.0, 7, "runs/x/checkpoints/checkpoint-6")
    if expected is None:
        assert failure is None
    else:
        assert isinstance(failure, distributed.CollectiveFailure) and isinstance(failure, TimeoutError)
        assert expected in str(failure) and str(failure).startswith("process 1 of 4 stopped after step 7: ")


def test_a_collective_failure_says_when_nothing_was_saved_yet(monkeypatch) -> None:
    import torch.distributed as dist

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    failure = distributed.collective_failure(RuntimeError("broken pipe"), 1.5, None, None)
    assert str(failure) == ("process 0 of 1 stopped before its first step: another process left (it died or was "
                            "killed); no checkpoint yet")
    timed = distributed.collective_failure(dist.DistError("wait timeout"), 1.5, 0, None)
    assert str(timed) == ("process 0 of 1 stopped after step 0: it waited more than distributed.timeout_s = 1.5 s for "
                          "the other processes in a collective (one of them hung, was stopped, or died); no checkpoint yet")
