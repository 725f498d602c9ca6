"""Dependencies between the parts of the package point one way.

Every module of ``mmviews/`` is parsed with ``ast`` and each of its imports (module level,
inside functions, under ``TYPE_CHECKING``, relative ones resolved) is checked against the
layer order below: a module may import its own layer or a lower one, never a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mmviews"

# Lowest first. A module belongs to the longest prefix listed; the package itself
# (``mmviews/__init__.py``: the version) is below them all.
LAYERS: list[tuple[str, ...]] = [
    ("mmviews.registry", "mmviews.fileio", "mmviews.resources"),
    ("mmviews.objectives",),
    ("mmviews.data",),
    ("mmviews.modalities",),
    ("mmviews.config", "mmviews.run"),
    ("mmviews.eval",),
    ("mmviews.train",),
    ("mmviews.cli",),
    ("mmviews.bench", "mmviews.demo"),
]
LEVEL = {prefix: level for level, prefixes in enumerate(LAYERS) for prefix in prefixes}


def layer_of(module: str) -> int:
    """The layer of a dotted ``mmviews`` module name (ValueError if no layer covers it)."""
    parts = module.split(".")
    if parts[0] == "mmviews" and (len(parts) == 1 or parts[1].startswith("__")):  # mmviews, mmviews.__version__
        return -1
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LEVEL:
            return LEVEL[prefix]
    raise ValueError(f"module {module} is in no layer of tests/test_layers.py")


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every ``mmviews`` module imported anywhere in ``source``
    (``from X import y`` counts as ``X.y``, which may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return sorted((line, name) for line, name in found if name == "mmviews" or name.startswith("mmviews."))


def _module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def violations(root: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        module, is_package = _module_name(path)
        own = layer_of(module)
        for line, name in imported_modules(path.read_text(), module, is_package):
            if layer_of(name) > own:
                out.append(f"{path.relative_to(root.parent)}:{line}: {module} (layer {own}) imports {name} "
                           f"(layer {layer_of(name)})")
    return out


def test_no_lower_layer_imports_a_higher_one():
    assert violations() == []


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(_module_name(path)[0])  # raises for a module no layer covers


def test_the_checker_sees_imports_inside_functions_and_relative_ones():
    source = "import torch\n\ndef f():\n    from mmviews.train import train\n\nfrom ..run import load_run\n"
    names = imported_modules(source, "mmviews.eval.compare", is_package=False)
    assert names == [(4, "mmviews.train.train"), (6, "mmviews.run.load_run")]
    assert layer_of("mmviews.train.train") > layer_of("mmviews.eval.compare") > layer_of("mmviews.run.load_run")
    assert imported_modules("from . import ipmc\n", "mmviews.objectives", is_package=True) == [
        (1, "mmviews.objectives.ipmc")]
    with pytest.raises(ValueError, match="mmviews.nowhere"):
        layer_of("mmviews.nowhere.x")
