"""Process-level settings of a run: the process group's timeout and deterministic algorithms.

**Timeout** (``distributed.timeout_s``, default 3600 s). With several processes, a process
that reaches a collective waits there for the others; past the process group's timeout the run
fails. mmviews evaluates on the main process while the others wait (a broadcast), which can
outlast NCCL's default of 10 minutes. The timeout is given to the process group when it is
created, both by the first :class:`accelerate.PartialState` (:func:`process_state`) and by the
``Accelerator`` (:func:`process_group_kwargs`, an ``InitProcessGroupKwargs`` handler).

**Determinism** (``deterministic: true``). By default a run is repeatable on CPU (same seed,
same data order, same augmentations, same weights), and a resumed run equals an uninterrupted
one there; on CUDA both hold up to the nondeterminism of some kernels (atomic adds in
scatter/index backward passes, cuBLAS's split-K reductions, cuDNN's autotuned algorithms), so
two runs of one recipe drift apart in the last bits and then further. ``deterministic: true``
sets ``torch.use_deterministic_algorithms(True)`` (an operation without a deterministic
implementation then raises, naming itself), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (which cuBLAS
reads when CUDA starts, so it is set before: :func:`configure_determinism` runs first in
:func:`mmviews.train.train`) and turns off cuDNN's autotuning: runs are bitwise repeatable on
CUDA too, at some cost in speed.
"""

from __future__ import annotations

import datetime
import os
import shlex
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from mmviews.config import ConfigError, TrainConfig
from mmviews.notices import MMViewsRuntimeWarning

#: The cuBLAS workspace setting that makes its results deterministic (see the CUDA docs on
#: cuBLAS reproducibility); ":16:8" would also do, using less memory and more time.
CUBLAS_WORKSPACE = ":4096:8"


def steps_on_cpu(config: TrainConfig) -> bool:
    """Whether the run's training step runs on the CPU: ``cpu: true``, or no CUDA device."""
    return config.cpu or not torch.cuda.is_available()


def timeout_of(config: TrainConfig) -> datetime.timedelta:
    """``distributed.timeout_s`` as a timedelta; ``ConfigError`` unless positive."""
    seconds = config.distributed.timeout_s
    if not seconds > 0:
        raise ConfigError(f"distributed.timeout_s must be > 0 seconds, got {seconds!r}")
    return datetime.timedelta(seconds=seconds)


def process_group_kwargs(config: TrainConfig) -> Any:
    """The ``Accelerator``'s ``kwargs_handlers`` entry that sets the process group's timeout."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=timeout_of(config))


def process_state(config: TrainConfig) -> Any:
    """Accelerate's :class:`~accelerate.PartialState`, creating the process group (when launched
    with several processes) with the recipe's timeout; the first call in a process decides."""
    from accelerate import PartialState

    return PartialState(cpu=config.cpu, **process_group_kwargs(config).to_kwargs())


class CollectiveFailure(TimeoutError):
    """A collective failed because another process stopped answering (hung, stopped, or dead);
    the message names this process, the step, the timeout and the newest complete checkpoint."""


# What the process-group backends say when a peer stops answering (a timeout) or is gone (its
# sockets closed): gloo's "Timed out waiting 5000ms for recv operation", "Connection closed by
# peer", NCCL's watchdog "collective operation timeout".
_TIMED_OUT = ("timed out", "timeout")
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def collective_failure(error: BaseException, timeout_s: float, step: int | None, checkpoint: str | None) -> \
        CollectiveFailure | None:
    """The one-line :class:`CollectiveFailure` of ``error`` when it is a collective that failed
    because a peer hung (past ``timeout_s``) or is gone, else None. ``step``: the last optimiser
    step this process finished; ``checkpoint``: the newest complete checkpoint (None: none yet)."""
    import torch.distributed as dist

    text = str(error).lower()
    if not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    if any(word in text for word in _PEER_GONE):
        what = "another process left (it died or was killed)"
    elif any(word in text for word in _TIMED_OUT) and ("gloo" in text or "nccl" in text or "operation" in text
                                                       or isinstance(error, dist.DistError)):
        what = (f"it waited more than distributed.timeout_s = {timeout_s:g} s for the other processes in a collective "
                "(one of them hung, was stopped, or died)")
    else:
        return None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    world = (dist.get_world_size() if dist.is_available() and dist.is_initialized()
             else int(os.environ.get("WORLD_SIZE", "1")))
    where = f"after step {step}" if step is not None else "before its first step"
    newest = f"newest complete checkpoint: {checkpoint}" if checkpoint else "no checkpoint yet"
    return CollectiveFailure(f"process {rank} of {world} stopped {where}: {what}; {newest}")


def configure_determinism(enabled: bool) -> None:
    """With ``enabled``, deterministic algorithms for the rest of the process (see the module
    docstring); nothing otherwise (the process's own settings are left as they are). Warns when
    CUDA has already started without ``CUBLAS_WORKSPACE_CONFIG``, which it then ignores."""
    if not enabled:
        return
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and torch.cuda.is_initialized():
        warnings.warn("deterministic: CUDA started before CUBLAS_WORKSPACE_CONFIG could be set; cuBLAS may stay "
                      f"nondeterministic (set CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} in the environment)",
                      MMViewsRuntimeWarning, stacklevel=2)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


# --- Launches that never silently shrink -------------------------------------------------------
#
# `accelerate launch --cpu --num_processes 2` (without --multi_gpu) starts ONE process and tells it
# nothing about the 2 asked for; under `--use_fsdp` on a machine without GPUs, Accelerate's state
# comes up as DistributedType.NO in each of the started processes, which then train alone. mmviews
# reads what the launcher was asked for (its command line, the process's parent) and the
# launcher's WORLD_SIZE, and stops before any work when it got fewer processes.

#: The working launch lines, named in the errors below and in docs/distributed.md.
CPU_LAUNCH = "accelerate launch --multi_gpu --num_processes {n} -m mmviews.cli train RECIPE --set cpu=true"
#: What `accelerate launch --use_fsdp` (or a config file with FSDP) sets in its processes' environment.
LAUNCHER_FSDP = "ACCELERATE_USE_FSDP"
GPU_LAUNCH = "accelerate launch --multi_gpu --num_processes {n} -m mmviews.cli train RECIPE"


@dataclass(frozen=True)
class AccelerateLaunch:
    """What ``accelerate launch`` was asked for, read from the launcher process's command line.

    ``options``: the launch options as typed (between ``launch`` and the script, ``-m`` included);
    ``script``: the script or module it runs; ``num_processes``: ``--num_processes`` or the
    Accelerate config file's (None when neither says)."""

    options: tuple[str, ...]
    script: str
    num_processes: int | None
    multi_gpu: bool
    cpu: bool
    use_fsdp: bool
    fsdp_version: str | None

    def command(self, *script_args: str) -> str:
        """The same launch, running ``script_args``: a line a user can paste."""
        return shlex.join(["accelerate", "launch", *self.options, self.script, *script_args])

    def mmviews_command(self, *mmviews_args: str) -> str:
        """The same launch options running ``mmviews MMVIEWS_ARGS`` (the launched script when it is
        mmviews's command, else ``-m mmviews.cli``)."""
        if self.script == "mmviews.cli" or os.path.basename(self.script) == "mmviews":
            return self.command(*mmviews_args)
        options = [option for option in self.options if option not in ("-m", "--module")]
        return shlex.join(["accelerate", "launch", *options, "-m", "mmviews.cli", *mmviews_args])


def _launch_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``launch`` when ``argv`` is an ``accelerate launch`` command line
    (the ``accelerate`` console script, or ``python -m accelerate.commands.launch``), else None."""
    for i, arg in enumerate(argv[:3]):
        name = os.path.basename(arg)
        if name in ("accelerate", "accelerate-launch") and argv[i + 1:i + 2] == ["launch"]:
            return argv[i + 2:]
        if name == "accelerate-launch" or arg in ("accelerate.commands.launch", "accelerate.commands.accelerate_cli"):
            rest = argv[i + 1:]
            return rest[1:] if rest[:1] == ["launch"] else rest
    return None


def parse_accelerate_launch(argv: list[str]) -> AccelerateLaunch | None:
    """:class:`AccelerateLaunch` of a launcher command line ``argv`` (None when it is not one, or
    Accelerate's own parser does not take it)."""
    rest = _launch_argv(argv)
    if rest is None:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(rest)
    except (SystemExit, Exception):  # argparse exits on what it cannot parse: not ours to judge
        return None
    script_args = list(args.training_script_args or [])
    options = rest[:len(rest) - len(script_args) - 1]
    num_processes = args.num_processes
    if num_processes is None:  # the config file's (--config_file, or Accelerate's default file)
        num_processes = _config_file_processes(args.config_file)
    return AccelerateLaunch(tuple(options), args.training_script, num_processes, bool(args.multi_gpu),
                            bool(args.cpu), bool(args.use_fsdp), args.fsdp_version)


def _config_file_processes(config_file: str | None) -> int | None:
    from accelerate.commands.config import default_config_file, load_config_from_file

    path = config_file or default_config_file
    if not os.path.isfile(path):
        return None
    try:
        return int(load_config_from_file(path).num_processes)
    except Exception:  # an unreadable config file: Accelerate itself says so at launch
        return None


def _parent_command_line(pid: int | None = None) -> list[str]:
    try:
        with open(f"/proc/{os.getppid() if pid is None else pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:  # not Linux, or the parent is gone
        return []


def accelerate_launch() -> AccelerateLaunch | None:
    """The ``accelerate launch`` that started this process (its parent), or None."""
    return parse_accelerate_launch(_parent_command_line())


def fsdp_requested_by_launcher() -> str | None:
    """``FSDP_VERSION`` ("1" or "2") when the launcher asked for FSDP (``accelerate launch
    --use_fsdp``, or an Accelerate config file with FSDP), else None."""
    if os.environ.get(LAUNCHER_FSDP, "false").lower() not in ("1", "true", "yes"):
        return None
    return os.environ.get("FSDP_VERSION", "1")


def check_launch(num_processes: int, config: TrainConfig, launch: AccelerateLaunch | None = None) -> None:
    """A :class:`ConfigError` (one line naming the flag that fixes it) when the launch asked for
    more processes than the run got: a ``WORLD_SIZE`` (torchrun, ``accelerate launch``) larger
    than the process group, or an ``accelerate launch --num_processes N`` (or its config file)
    that started one process. ``launch``: the launcher's arguments (default: read from the parent
    process)."""
    world = os.environ.get("WORLD_SIZE", "")
    asked = int(world) if world.isdigit() else None
    if asked is not None and asked > num_processes:
        if not config.cpu and not torch.cuda.is_available():
            what = "with FSDP " if fsdp_requested_by_launcher() else ""
            raise ConfigError(
                f"the launcher started {asked} processes {what}(WORLD_SIZE={asked}), but without a GPU and without "
                f"cpu: true each would train alone; add --set cpu=true ({CPU_LAUNCH.format(n=asked)}"
                + (" --set distributed.sharding=fsdp: mmviews then shards with FSDP2 over gloo itself)" if what else ")"))
        raise ConfigError(
            f"the launcher set WORLD_SIZE={asked} but this process group has {num_processes} process(es); launch with "
            f"{(CPU_LAUNCH if config.cpu else GPU_LAUNCH).format(n=asked)} (or torchrun --nproc_per_node {asked})")
    launch = launch if launch is not None else accelerate_launch()
    if launch is not None and (launch.num_processes or 1) > 1 and num_processes == 1:
        n = launch.num_processes
        raise ConfigError(
            f"accelerate launch asked for {n} processes (--num_processes {n}) but started one: without --multi_gpu "
            f"(also on CPU) Accelerate runs a single process; launch with "
            f"{(CPU_LAUNCH if config.cpu or launch.cpu else GPU_LAUNCH).format(n=n)}")
