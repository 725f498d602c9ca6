"""``optimisation.mixed_precision: auto`` (the default): bf16 where the device computes it natively,
float32 elsewhere (a CPU with AVX2 only among them), said once and recorded in results.json; an
explicit bf16 on such a CPU trains as asked with one warning line, which ``--check`` gives too."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from test_train_utils import tiny_config, train_in_process, write_recipe

from mmviews.cli import main
from mmviews.config import OptimisationConfig, config_from_dict, load_config
from mmviews.eval.extract import AutocastEncoder
from mmviews.eval import precision as P
from mmviews.resources import resource_dir

NATIVE = P.cpu_has_native_bf16()


def test_auto_is_the_default() -> None:
    assert OptimisationConfig().mixed_precision == "auto"


def test_every_shipped_recipe_leaves_the_precision_to_auto() -> None:
    """A recipe that asks for bf16 by name runs several times slower on a CPU without it (the
    finetune recipe did): each shipped one takes auto, bf16 only where the hardware has it."""
    shipped = resource_dir("recipes")
    assert shipped is not None
    recipes = sorted(shipped[0].glob("*.yaml"))
    assert len(recipes) >= 10 and "finetune" in {r.stem for r in recipes}
    asked = {r.stem: load_config(r).optimisation.mixed_precision for r in recipes}
    assert {name: p for name, p in asked.items() if p != "auto"} == {}


@pytest.mark.parametrize("native,used", [(False, "no"), (True, "bf16")])
def test_auto_on_a_cpu_follows_its_bf16_support(monkeypatch, native: bool, used: str) -> None:
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: native)
    choice = P.choose_precision("auto", "cpu")
    assert (choice.asked, choice.used, choice.device) == ("auto", used, "cpu")
    if native:
        assert choice.line() == "mixed precision: auto -> bf16 (bf16): this CPU computes bf16 natively"
    else:
        assert choice.line() == ("mixed precision: auto -> no (float32): this CPU has no native bf16 (AVX512-BF16/AMX), "
                                 "where bf16 autocast runs several times slower than float32")


@pytest.mark.parametrize("supported,used", [(False, "no"), (True, "bf16")])
def test_auto_on_a_gpu_follows_its_bf16_support(monkeypatch, supported: bool, used: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert P.choose_precision("auto", "cuda").used == used
    assert P.choose_precision("auto", "mps").used == "no"  # not known to be native there


def test_explicit_values_are_kept_and_a_wrong_one_is_named() -> None:
    for asked in ("no", "bf16", "fp16"):
        assert P.choose_precision(asked, "cpu").used == asked
    with pytest.raises(ValueError, match="optimisation.mixed_precision must be one of auto, no, bf16, fp16, got 'fp8'"):
        P.choose_precision("fp8", "cpu")


def test_the_slow_bf16_line_only_for_bf16_on_a_cpu_without_it(monkeypatch) -> None:
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: False)
    line = P.slow_bf16_line("bf16", "cpu")
    assert line is not None and "several times slower" in line and "optimisation.mixed_precision=auto" in line
    assert "\n" not in line
    assert P.slow_bf16_line("no", "cpu") is None and P.slow_bf16_line("bf16", "cuda") is None
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: True)
    assert P.slow_bf16_line("bf16", "cpu") is None


def test_resolve_leaves_the_given_config_alone() -> None:
    raw = tiny_config(text=False)
    raw["optimisation"]["mixed_precision"] = "auto"
    config = config_from_dict(raw, "r.yaml")
    resolved, choice = P.resolve_precision(config, "cpu")
    assert config.optimisation.mixed_precision == "auto"
    assert resolved.optimisation.mixed_precision == choice.used == ("bf16" if NATIVE else "no")
    assert resolved.view_spec is config.view_spec  # resolved sections kept, not rebuilt
    same, _ = P.resolve_precision(resolved, "cpu")
    assert same is resolved


def test_an_evaluation_of_auto_runs_under_the_devices_choice(monkeypatch) -> None:
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, batch):
            seen.append(torch.is_autocast_enabled("cpu"))
            return self.w.expand(1, 1, 1), torch.ones(1, 1, dtype=torch.bool)

    for native in (False, True):
        monkeypatch.setattr(P, "cpu_has_native_bf16", lambda native=native: native)
        AutocastEncoder(Probe(), "auto")(None)
    assert seen == [False, True]


def _recipe(tmp_path: Path, precision: str | None) -> Path:
    """A tiny recipe asking for ``precision`` (None: no key, the default ``auto``)."""
    raw = tiny_config(text=False, num_samples=16, batch_size=8, epochs=1)
    raw["cpu"] = True
    raw["output"]["checkpoint_every"] = 0
    raw["optimisation"].pop("mixed_precision", None)
    if precision is not None:
        raw["optimisation"]["mixed_precision"] = precision
    return write_recipe(tmp_path / "r.yaml", raw)


# The CPU's capability is set, not read: the choice and its messages on either kind of CPU, on
# any machine (the run then computes in whatever precision was chosen, natively or emulated).
@pytest.mark.parametrize("native", [False, True], ids=["cpu-without-bf16", "cpu-with-bf16"])
@pytest.mark.parametrize("asked", [None, "bf16"])
def test_a_run_says_its_choice_once_and_records_it(tmp_path: Path, asked: str | None, native: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = train_in_process(str(_recipe(tmp_path, asked)), "--output", str(tmp_path / "run"))
    slow = [str(w.message) for w in caught if "several times slower than float32 here" in str(w.message)]
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    saved = (tmp_path / "run" / "config.yaml").read_text()
    if asked is None:
        used = "bf16" if native else "no"
        assert results["mixed_precision"] == used
        assert results["mixed_precision_choice"] == {"asked": "auto", "used": used, "device": "cpu",
                                                     "reason": P.choose_precision("auto", "cpu").reason}
        assert r.stdout.count(f"mixed precision: auto -> {used} ({'bf16' if native else 'float32'})") == 1
        assert slow == []
        assert f"mixed_precision: '{used}'" in saved or f"mixed_precision: {used}" in saved  # the precision used
    else:
        assert results["mixed_precision"] == "bf16"
        assert results["mixed_precision_choice"]["asked"] == "bf16"
        assert "mixed precision: auto" not in r.stdout
        # once, where bf16 is emulated; `mmviews train` shows it as one line
        assert slow == ([] if native else [P.slow_bf16_line("bf16", "cpu")])


def test_check_says_the_same(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: False)
    assert main(["train", str(_recipe(tmp_path, "bf16")), "--check", "--output", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert err.count(P.slow_bf16_line("bf16", "cpu")) == 1
    assert main(["train", str(_recipe(tmp_path, None)), "--check", "--output", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert out.count("mixed precision: auto -> no (float32)") == 1 and "several times slower than float32 here" not in err
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: True)  # a CPU with bf16: no warning for it
    assert main(["train", str(_recipe(tmp_path, "bf16")), "--check", "--output", str(tmp_path / "run")]) == 0
    assert "several times slower than float32 here" not in capsys.readouterr().err


def test_the_choice_and_its_reasons_in_full(monkeypatch) -> None:
    assert P.choose_precision("bf16", "cpu") == P.PrecisionChoice("bf16", "bf16", "cpu",
                                                                  "asked for by optimisation.mixed_precision")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert P.choose_precision("auto", "cuda").reason == "this GPU has no bf16 support"
    assert P.choose_precision("auto", "mps").reason == "bf16 is not known to be native on 'mps'"
    assert P.choose_precision("auto", "mps").to_dict() == {"asked": "auto", "used": "no", "device": "mps",
                                                           "reason": "bf16 is not known to be native on 'mps'"}


def test_the_cpu_answer_is_torchs_and_false_without_onednn(monkeypatch) -> None:
    assert P.cpu_has_native_bf16() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

    class NoOneDNN:
        class ops:
            mkldnn = object()  # no _is_mkldnn_bf16_supported: AttributeError

    monkeypatch.setattr(P, "torch", NoOneDNN)
    assert P.cpu_has_native_bf16() is False


def test_the_training_device_is_accelerates_pick(monkeypatch) -> None:
    config = config_from_dict(tiny_config(text=False), "r.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert P.training_device_type(config) == "cpu"
    assert P.resolve_precision(config)[1].device == "cpu"  # the device defaults to the run's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert P.training_device_type(config) == "cuda"
    config.cpu = True
    assert P.training_device_type(config) == "cpu"


def test_the_slow_line_in_full(monkeypatch) -> None:
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: False)
    assert P.slow_bf16_line("bf16", "cpu") == (
        "optimisation.mixed_precision: bf16 on a CPU without native bf16 (AVX512-BF16/AMX): torch emulates it, several "
        "times slower than float32 here (a ucf101 step measured 3.2x); train in float32 with --set "
        "optimisation.mixed_precision=auto (or =no)")


@pytest.mark.parametrize("asked,printed,warned", [("auto", True, False), ("bf16", False, True), ("no", False, False)])
def test_announce_prints_auto_once_and_warns_slow_bf16(monkeypatch, capsys, asked: str, printed: bool,
                                                       warned: bool) -> None:
    from mmviews.notices import MMViewsWarning

    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: False)
    choice = P.choose_precision(asked, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        P.announce_precision(choice)
    out = capsys.readouterr().out
    assert out == (choice.line() + "\n" if printed else "")
    assert [(w.category, str(w.message)) for w in caught] == (
        [(MMViewsWarning, P.slow_bf16_line("bf16", "cpu"))] if warned else [])


@pytest.mark.parametrize(("asked", "native", "dtype"), [
    ("no", True, None), ("bf16", False, torch.bfloat16), ("fp16", True, torch.float16),
    ("auto", True, torch.bfloat16), ("auto", False, None),
])
def test_autocast_dtype_is_the_precision_the_run_uses(asked: str, native: bool, dtype, monkeypatch) -> None:
    """The dtype a step computes in: an explicit precision as asked on any CPU, ``auto`` as the
    run resolves it (bf16 only where the CPU computes it natively)."""
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: native)
    raw = tiny_config(text=False)
    raw["cpu"] = True
    raw["optimisation"]["mixed_precision"] = asked
    assert P.autocast_dtype(config_from_dict(raw, "r.yaml")) is dtype


def test_an_explicit_precision_needs_no_device() -> None:
    """Only ``auto`` depends on the device: an explicit precision is read without asking which
    device trains (a config that names none, e.g. a measurement's stand-in, is enough)."""
    from types import SimpleNamespace

    for asked, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None)):
        assert P.autocast_dtype(SimpleNamespace(optimisation=SimpleNamespace(mixed_precision=asked))) is dtype
