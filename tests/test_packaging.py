"""The wheel: it carries the recipes and the data cards (not the reproduction scripts nor their
results), and an installed copy finds them from any folder.

The wheel is built offline from a copy of the source files (``pip wheel --no-build-isolation``
with the environment's setuptools), installed with ``pip install --target`` (its console script
included), and run from an empty temporary folder with that target first on ``PYTHONPATH``, so
that ``mmviews`` is imported from the wheel and not from this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What building needs; the recipes' result folders and caches are left behind on purpose, so
# that the test fails if the build reached for something outside these.
SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "mmviews", "recipes", "data_cards"]


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    import setuptools  # the dev extra's (declared: imported, not skipped); the build backend, offline

    version = setuptools.__version__
    assert int(version.split(".")[0]) >= 77, f"the dev extra needs setuptools>=77, got {version}"
    root = tmp_path_factory.mktemp("build")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results", "*.egg-info")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    r = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(root / "dist"), ".", cwd=src)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (built,) = (root / "dist").glob("mmviews-*.whl")
    return built


def test_wheel_holds_recipes_and_cards_but_no_reproductions(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = {Path(n).name for n in names if n.startswith("mmviews/_resources/recipes/")}
    assert recipes == {p.name for p in (REPO / "recipes").glob("*.yaml")} | {"README.md"}
    cards = {Path(n).name for n in names if n.startswith("mmviews/_resources/data_cards/")}
    assert cards == {p.name for p in (REPO / "data_cards").glob("*.md")}
    assert not [n for n in names if "reproduce" in n or "/results/" in n]
    assert "mmviews/py.typed" in names and "mmviews/cli/__init__.py" in names
    assert wheel.stat().st_size < 1_000_000, wheel.stat().st_size  # code and text only


def test_ci_constraints_pin_one_triple_inside_the_declared_range():
    """pyproject.toml declares ranges; constraints/ci.txt pins the tested torch triple inside
    them, and CI and the README's install commands use it."""
    import tomllib

    from packaging.requirements import Requirement

    declared = {Requirement(r).name: Requirement(r).specifier
                for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    pins = {}
    for line in (REPO / "constraints" / "ci.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name] = spec.version
    assert set(pins) == {"torch", "torchvision", "torchaudio"}
    for name, version in pins.items():
        assert not any(s.operator == "==" for s in declared[name]), f"{name} is pinned in pyproject.toml"
        assert version in declared[name], f"constraints/ci.txt {name}=={version} is outside {declared[name]}"
    assert "-c constraints/ci.txt" in (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert readme.count("pip install -c constraints/ci.txt") + readme.count("pip install -q -c constraints/ci.txt") == 2


def test_checkout_install_finds_the_top_level_recipes(tmp_path):
    """The development install (``pip install -e .``, as in CI) has no packaged copy: the
    checkout's own ``recipes/`` and ``data_cards/`` are used, from any folder."""
    env = {k: v for k, v in os.environ.items() if k != "MMVIEWS_RECIPES"}
    code = "import mmviews, mmviews.resources as r; print(mmviews.__file__); print(r.resource_dir('data_cards'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    if Path(out[0]).resolve().parent != REPO / "mmviews":
        pytest.skip(f"mmviews is not imported from this checkout here ({out[0]})")
    assert out[1] == repr((REPO / "data_cards", "checkout"))
    assert not (REPO / "mmviews" / "_resources").exists()  # no second copy in the source tree
    listed = subprocess.run([sys.executable, "-m", "mmviews.cli", "list", "recipes"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, check=True).stdout
    rows = {line.split()[0]: line.split()[1:] for line in listed.splitlines()}
    assert rows["quickstart"] == ["checkout", str(REPO / "recipes" / "quickstart.yaml")]


def test_installed_wheel_lists_and_checks_recipes_from_any_folder(wheel, tmp_path):
    target = tmp_path / "site"
    r = _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "elsewhere"  # no recipes/ here, and not the checkout
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    env.pop("MMVIEWS_RECIPES", None)

    def mmviews(*args: str) -> subprocess.CompletedProcess:
        # The console script pip wrote for the wheel (its shebang is this interpreter).
        return subprocess.run([str(target / "bin" / "mmviews"), *args], cwd=work, capture_output=True, text=True,
                              env=env, timeout=300)

    where = subprocess.run([sys.executable, "-c", "import mmviews; print(mmviews.__file__)"], cwd=work,
                           capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert Path(where).is_relative_to(target), where  # the wheel, not the checkout

    listed = mmviews("list", "recipes")
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in listed.stdout.splitlines()}
    assert set(rows) == {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    origin, path = rows["quickstart"]
    assert origin == "packaged" and Path(path).is_relative_to(target), rows["quickstart"]

    datasets = mmviews("list", "datasets")
    assert datasets.returncode == 0, datasets.stderr[-3000:]
    card = next(line for line in datasets.stdout.splitlines() if line.startswith("mosi "))
    assert Path(card.split("card: ")[1]).is_relative_to(target) and Path(card.split("card: ")[1]).is_file()

    checked = mmviews("train", "quickstart", "--check")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "OK" in checked.stdout and str(target) in checked.stdout, checked.stdout

    # A local ./recipes folder comes first, and is reported as such.
    (work / "recipes").mkdir()
    (work / "recipes" / "quickstart.yaml").write_text((REPO / "recipes" / "quickstart.yaml").read_text())
    listed = mmviews("list", "recipes")
    origin, path = {line.split()[0]: line.split()[1:] for line in listed.stdout.splitlines()}["quickstart"]
    assert origin == "local" and Path(path).resolve() == (work / "recipes" / "quickstart.yaml").resolve()
