"""``host_memory`` (mmviews.train.host_memory): whether glibc's malloc keeps the memory a step
frees. Observed from what it is for: a 64 MiB block allocated, written and freed again and again
faults in every page each time under glibc's defaults (mapped and unmapped), and almost never
once malloc keeps what is freed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmviews.train import host_memory

REPO = Path(__file__).resolve().parents[1]
LARGE_BLOCK = 2**26  # 64 MiB: above glibc's largest mmap threshold (32 MiB)

# The module is loaded from its file (it needs only the standard library): a fresh process per
# case, each well under a second, instead of importing torch six times.
FAULTS_AFTER_SETTING = f"""
import importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("host_memory", {str(REPO / "mmviews/train/host_memory.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
state = module.configure_host_memory(sys.argv[1], owns_process=sys.argv[2] == "1", on_cpu=sys.argv[3] == "1")
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(b"\\x01") * {LARGE_BLOCK}  # written: every page touched
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"state": state, "faults": min(faults[1:])}}))
"""


def _clean_environment(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return {**environ, **extra}


def _faults_after(setting: str, owns_process: bool, on_cpu: bool, **environ: str) -> dict:
    done = subprocess.run([sys.executable, "-c", FAULTS_AFTER_SETTING, setting, str(int(owns_process)), str(int(on_cpu))],
                          env=_clean_environment(**environ), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


pytestmark = pytest.mark.skipif(not host_memory.is_glibc(), reason="host_memory acts on glibc's malloc only")


@pytest.mark.parametrize("setting, owns_process, on_cpu, environ, expected", [
    ("auto", True, True, {}, "hold"),  # mmviews train on the CPU
    ("auto", True, False, {}, "system"),  # the step runs on a GPU: host memory is not the step's
    ("auto", False, True, {}, "system"),  # train() called from a user's program: its allocator is the user's
    ("hold", False, False, {}, "hold"),  # asked for explicitly
    ("system", True, True, {}, "system"),
    ("auto", True, True, {"MALLOC_MMAP_THRESHOLD_": "131072"}, "environment"),  # the user's own malloc setting stands
])
def test_the_setting_decides_whether_freed_large_blocks_are_kept(
        setting: str, owns_process: bool, on_cpu: bool, environ: dict, expected: str) -> None:
    result = _faults_after(setting, owns_process, on_cpu, **environ)
    pages = LARGE_BLOCK // os.sysconf("SC_PAGE_SIZE")
    assert result["state"] == expected
    if expected == "hold":
        assert result["faults"] < 0.05 * pages, result
    else:
        assert result["faults"] >= 0.9 * pages, result


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="host_memory must be one of auto, hold, system, got 'keep'"):
        host_memory.configure_host_memory("keep", owns_process=True, on_cpu=True)


def test_the_environment_is_read_for_malloc_settings() -> None:
    assert not host_memory.allocator_set_by_environment({"PATH": "/bin", "OMP_NUM_THREADS": "1"})
    assert host_memory.allocator_set_by_environment({"MALLOC_ARENA_MAX": "2"})
    assert host_memory.allocator_set_by_environment({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert host_memory.allocator_set_by_environment({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"})
    assert not host_memory.allocator_set_by_environment({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})


def test_mmviews_train_called_from_a_program_leaves_its_allocator(tmp_path: Path) -> None:
    """``mmviews.cli.main([...])`` with an argument list (a program of the user's, this test
    process) does not take ``host_memory: auto`` as its own: results.json says the process kept
    its allocator. (The ``mmviews`` program's processes record ``hold``:
    test_reliability.py::test_two_processes_resume_after_the_last_checkpoint_end_as_one_does.)"""
    from test_train_utils import tiny_config, train_in_process

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_config(num_samples=16, batch_size=8, epochs=1, image=False, text=False)))
    run = tmp_path / "run"
    done = train_in_process(str(recipe), "--output", str(run), "--set", "evaluation.plots=false")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run / "results.json").read_text())["host_memory"] in ("system", "environment")
    assert not host_memory._held_by_mmviews
