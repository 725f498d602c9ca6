"""``host_memory`` (mmviews.train.host_memory): whether glibc's malloc keeps the memory a step
frees. Observed from what it is for, the page faults of memory allocated, written and freed
again and again: one 64 MiB block (above glibc's largest mmap threshold: a mapping of its own,
unmapped when freed, unless everything comes from the heap) and four 16 MiB blocks alive
together (from the heap once glibc's threshold has risen; the heap's free top, 64 MiB, is
trimmed under glibc's defaults and kept otherwise)."""

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

# The module is loaded from its file (it needs only the standard library): a fresh process per
# case, each well under a second, instead of importing torch in each.
FAULTS_AFTER_SETTING = f"""
import importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("host_memory", {str(REPO / "mmviews/train/host_memory.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
state = module.configure_host_memory(sys.argv[1], owns_process=sys.argv[2] == "1", on_cpu=sys.argv[3] == "1")

def faults(make):
    counts = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = make()  # written: every page touched
        del blocks
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts[1:])

print(json.dumps({{"state": state, "large": faults(lambda: bytearray(b"\\x01") * 2**26),
                  "heap": faults(lambda: [bytearray(b"\\x01") * 2**24 for _ in range(4)])}}))
"""


def _clean_environment(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return {**environ, **extra}


def _faults_after(setting: str, owns_process: bool, on_cpu: bool, **environ: str) -> dict:
    done = subprocess.run([sys.executable, "-c", FAULTS_AFTER_SETTING, setting, str(int(owns_process)), str(int(on_cpu))],
                          env=_clean_environment(**environ), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


pytestmark = pytest.mark.skipif(not host_memory.is_glibc(), reason="host_memory acts on glibc's malloc only")
PAGES_OF_64_MIB = 2**26 // os.sysconf("SC_PAGE_SIZE")
#: which of the two patterns' memory is kept: (the 64 MiB block, the four 16 MiB blocks)
KEPT = {"system": (False, False), "environment": (False, False), "heap": (False, True), "hold": (True, True)}


@pytest.mark.parametrize("setting, owns_process, on_cpu, environ, expected", [
    ("auto", True, True, {}, "heap"),  # mmviews train on the CPU
    ("auto", True, False, {}, "system"),  # the step runs on a GPU: host memory is not the step's
    ("auto", False, True, {}, "system"),  # train() called from a user's program: its allocator is the user's
    ("heap", False, False, {}, "heap"),  # asked for explicitly
    ("hold", False, True, {}, "hold"),
    ("system", True, True, {}, "system"),
    ("auto", True, True, {"MALLOC_MMAP_THRESHOLD_": "131072"}, "environment"),  # the user's own malloc setting stands
])
def test_the_setting_decides_which_freed_memory_is_kept(
        setting: str, owns_process: bool, on_cpu: bool, environ: dict, expected: str) -> None:
    result = _faults_after(setting, owns_process, on_cpu, **environ)
    assert result["state"] == expected
    for pattern, kept in zip(("large", "heap"), KEPT[expected]):
        if kept:
            assert result[pattern] < 0.05 * PAGES_OF_64_MIB, (pattern, result)
        else:  # every page faulted in again
            assert result[pattern] >= 0.9 * PAGES_OF_64_MIB, (pattern, result)


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="host_memory must be one of auto, heap, hold, system, got 'keep'"):
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
    its allocator. (The ``mmviews`` program's processes record ``heap``:
    test_reliability.py::test_two_processes_resume_after_the_last_checkpoint_end_as_one_does.)"""
    from test_train_utils import tiny_config, train_in_process

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_config(num_samples=16, batch_size=8, epochs=1, image=False, text=False)))
    run = tmp_path / "run"
    done = train_in_process(str(recipe), "--output", str(run), "--set", "evaluation.plots=false")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run / "results.json").read_text())["host_memory"] in ("system", "environment")
    assert host_memory._applied is None



class _MalloptSpy:
    """glibc's real ``mallopt``, with each call recorded (``answers`` replaces what it returns)."""

    def __init__(self, answers: list[int] | None = None) -> None:
        import ctypes

        self.real = ctypes.CDLL(None).mallopt
        self.calls: list[tuple[int, int]] = []
        self.answers = answers

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        done = self.real(parameter, value)
        return self.answers.pop(0) if self.answers else done


def _spy_on_mallopt(monkeypatch: pytest.MonkeyPatch, answers: list[int] | None = None) -> _MalloptSpy:
    """A fresh process's state (nothing applied yet) with :class:`_MalloptSpy` as the library's
    ``mallopt``. Only ``heap`` is applied for real in this process (what ``mmviews train`` on the
    CPU runs with); ``hold``'s calls are recorded with a no-op answer of 1."""
    import types

    spy = _MalloptSpy(answers)
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "ctypes", types.SimpleNamespace(CDLL=lambda name: spy))
    return spy


# glibc's malloc.h: M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3, M_MMAP_MAX -4 (written out here, not read from the module)
HEAP_CALLS = [(-3, 32 * 1024 * 1024), (-1, 2**31 - 1)]
HOLD_CALLS = [(-4, 0), (-1, 2**31 - 1)]


def test_keep_freed_memory_makes_the_settings_calls_and_refuses_a_second_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first setting applied stays: asking for another afterwards reports False (it was not
    applied) and calls nothing; asking for the same one again reports True."""
    spy = _spy_on_mallopt(monkeypatch)
    assert host_memory.host_memory_state() in ("system", "environment")
    assert host_memory.keep_freed_memory("heap") is True
    assert spy.calls == HEAP_CALLS
    assert host_memory.host_memory_state() == "heap"
    assert host_memory.keep_freed_memory("hold") is False
    assert host_memory.keep_freed_memory("heap") is True
    assert spy.calls == HEAP_CALLS  # nothing called again
    assert host_memory.host_memory_state() == "heap"


def test_hold_makes_its_own_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _spy_on_mallopt(monkeypatch)
    spy.real = lambda parameter, value: 1  # recorded, not applied: hold would stay for the rest of this process
    assert host_memory.configure_host_memory("hold", owns_process=False, on_cpu=False) == "hold"
    assert spy.calls == HOLD_CALLS


def test_a_setting_half_made_is_not_reported_as_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _spy_on_mallopt(monkeypatch, answers=[1, 0])  # glibc refused the second call
    assert host_memory.keep_freed_memory("heap") is False
    assert spy.calls == HEAP_CALLS
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    assert host_memory.host_memory_state() == "system"


def test_nothing_is_called_where_the_library_is_not_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _spy_on_mallopt(monkeypatch)
    monkeypatch.setattr(host_memory, "is_glibc", lambda: False)
    assert host_memory.keep_freed_memory("heap") is False
    assert spy.calls == []
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert host_memory.host_memory_state() == "system"  # not glibc: the variable configures nothing


@pytest.mark.parametrize("owns_process, on_cpu, environ, calls, state", [
    (True, True, {}, HEAP_CALLS, "heap"),
    (True, False, {}, [], "system"),
    (False, True, {}, [], "system"),
    (True, True, {"MALLOC_TRIM_THRESHOLD_": "0"}, [], "environment"),
    (True, True, {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, [], "environment"),
])
def test_auto_in_process(monkeypatch: pytest.MonkeyPatch, owns_process: bool, on_cpu: bool, environ: dict,
                         calls: list, state: str) -> None:
    spy = _spy_on_mallopt(monkeypatch)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert host_memory.configure_host_memory("auto", owns_process=owns_process, on_cpu=on_cpu) == state
    assert spy.calls == calls
    assert host_memory.configure_host_memory("system", owns_process=True, on_cpu=True) == state
    assert spy.calls == calls


def test_second_setting_guard_fails_when_any_setting_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from mutations import apply_break

    apply_break("host_memory_accepts_a_second_setting", monkeypatch.setattr)
    with pytest.raises(AssertionError):
        test_keep_freed_memory_makes_the_settings_calls_and_refuses_a_second_setting(monkeypatch)


@pytest.mark.parametrize("system, libc, expected", [
    ("linux", ("glibc", "2.39"), True), ("linux", ("musl", "1.2"), False), ("linux", ("", ""), False),
    ("darwin", ("glibc", "2.39"), False), ("win32", ("", ""), False),
])
def test_glibc_is_linux_with_glibc(monkeypatch: pytest.MonkeyPatch, system: str, libc: tuple, expected: bool) -> None:
    import platform

    monkeypatch.setattr(host_memory.sys, "platform", system)
    monkeypatch.setattr(platform, "libc_ver", lambda: libc)
    assert host_memory.is_glibc() is expected


def test_a_library_without_mallopt_applies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    def no_library(name: object) -> object:
        raise OSError("cannot load the C library")

    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "ctypes", types.SimpleNamespace(CDLL=no_library))
    assert host_memory.keep_freed_memory("heap") is False
    monkeypatch.setattr(host_memory, "ctypes", types.SimpleNamespace(CDLL=lambda name: object()))  # no mallopt
    assert host_memory.keep_freed_memory("heap") is False
    assert host_memory._applied is None
