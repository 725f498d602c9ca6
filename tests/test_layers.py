"""Dependencies between the parts of the package point one way.

Every module of ``mmviews/`` is parsed with ``ast`` and each of its imports (module level,
inside functions, under ``TYPE_CHECKING``, relative ones resolved) is checked against the
layer order below: a module may import its own layer or a lower one, never a higher one.
Within a layer, no two modules import each other (:func:`two_module_circles`): following one
piece of work never bounces between two files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mmviews"

# Lowest first. A module belongs to the longest prefix listed; the package itself
# (``mmviews/__init__.py``: the version) is below them all.
LAYERS: list[tuple[str, ...]] = [
    ("mmviews.registry", "mmviews.fileio", "mmviews.resources", "mmviews.notices", "mmviews.hub", "mmviews.schema",
     "mmviews.process_memory"),
    ("mmviews.objectives",),
    ("mmviews.data",),
    ("mmviews.modalities",),
    # the evaluation tasks' schema sits with the recipe's: loading a recipe resolves its tasks
    ("mmviews.config", "mmviews.run", "mmviews.eval.tasks"),
    ("mmviews.eval",),
    ("mmviews.train",),
    ("mmviews.export",),
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


# --------------------------------------------------------------------------- two-module circles
# A module that imports another which imports it back (at module level or not) can only be
# understood, tested and moved together with it. The package-wide rule (no such pair at all) is
# turned on once the last pairs are gone; until then the modules listed below are held to it.


def _dotted_name(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted module name of ``path`` in the package at ``root`` and whether it is a package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """For each module of the package at ``root`` (named ``mmviews``), the modules of the package
    it imports anywhere (:func:`imported_modules`). ``from X import y`` is an import of ``X.y``
    when that is a module, else of ``X``. Importing ``a.b.c`` also runs ``a/__init__`` and
    ``a/b/__init__``; that is not counted, so that a package re-exporting its own parts does
    not form a circle with each of them."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        name, is_package = _dotted_name(path, root)
        sources[name] = (path, is_package)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in sources.items():
        targets = set()
        for _, name in imported_modules(path.read_text(), module, is_package):
            while name not in sources and "." in name:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name in sources and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def two_module_circles(root: Path = PACKAGE, graph: dict[str, set[str]] | None = None) -> list[tuple[str, str]]:
    """Every pair of modules of the package at ``root`` (or of its :func:`import_graph`, when
    given) that import each other, ``(a, b)`` with ``a < b``, sorted."""
    graph = import_graph(root) if graph is None else graph
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ()))


def reachable_imports(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module of the package that importing ``module`` may run, directly or through
    other modules: :func:`import_graph` plus, for each import of ``a.b.c``, the ``__init__`` of
    its packages ``a.b`` and ``a`` (except the importer's own packages, already running). A
    longer circle, such as one through a package's ``__init__`` that re-exports its parts,
    shows as ``module`` in its own result. ``graph``: :func:`import_graph` of the package."""

    def with_packages(importer: str, target: str) -> set[str]:
        parts = target.split(".")
        packages = {".".join(parts[:n]) for n in range(1, len(parts))}
        own = {".".join(importer.split(".")[:n]) for n in range(1, importer.count(".") + 2)}
        return ({target} | packages) - own

    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        for target in graph.get(current, ()):
            for reached in with_packages(current, target) & graph.keys():
                if reached not in seen:
                    seen.add(reached)
                    todo.append(reached)
    return seen


# Modules that must be in no circle (the package-wide rule replaces this list later).
DROPOUT = ("mmviews.modalities.dropout", "mmviews.modalities.dropout.keys",
           "mmviews.modalities.dropout.hf_attention", "mmviews.modalities.dropout.layers")
MULTIVIEW = "mmviews.modalities.multiview"


def test_no_two_modules_of_the_package_import_each_other():
    circles = two_module_circles()
    assert circles == [], "modules that import each other (move the shared part below both): " + ", ".join(
        f"{a} <-> {b}" for a, b in circles)


def test_the_dropout_modules_and_multiview_are_in_no_circle():
    graph = import_graph()
    assert set(DROPOUT) <= graph.keys()  # the modules checked exist
    assert "mmviews.modalities.dropout" in graph[MULTIVIEW]  # and the import that must not come back is seen
    held = set(DROPOUT) | {MULTIVIEW}
    assert [pair for pair in two_module_circles(graph=graph) if held & set(pair)] == []
    # no longer circle either: the dropout modules sit below the encoders that use them
    for module in DROPOUT:
        reached = reachable_imports(module, graph)
        assert MULTIVIEW not in reached and module not in reached, (module, sorted(reached))


TRAIN_LOOP = ("mmviews.train.step", "mmviews.train.trainer", "mmviews.train.state", "mmviews.train.callbacks",
              "mmviews.train.checkpoint")


def test_the_step_loop_and_run_state_modules_are_in_no_circle():
    graph = import_graph()
    assert set(TRAIN_LOOP) <= graph.keys()  # the modules checked exist
    # the imports that must not come back are seen: the loop takes the step, everything takes the state
    assert "mmviews.train.step" in graph["mmviews.train.trainer"]
    assert {"mmviews.train.state"} <= graph["mmviews.train.callbacks"] & graph["mmviews.train.checkpoint"]
    assert [pair for pair in two_module_circles(graph=graph) if set(TRAIN_LOOP) & set(pair)] == []
    # no longer circle either: the step sits below the loop, the run state below all of them
    assert "mmviews.train.trainer" not in reachable_imports("mmviews.train.step", graph)
    for module in TRAIN_LOOP:
        reached = reachable_imports(module, graph)
        assert module not in reached, (module, sorted(reached))
    assert reachable_imports("mmviews.train.state", graph) & set(TRAIN_LOOP) == set()


def test_the_circle_finders_find_planted_circles(tmp_path):
    files = {
        "mmviews/__init__.py": "",
        "mmviews/a.py": "from .b import thing\n",  # a <-> b, b's side inside a function
        "mmviews/b.py": "thing = 1\n\ndef f():\n    from mmviews import a\n",
        "mmviews/uses_a.py": "import mmviews.a\n",  # one way only
        "mmviews/pkg/__init__.py": "from .c import C\nfrom .d import D\n",  # re-exports: no circle
        "mmviews/pkg/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mmviews.pkg.d import D\n"
                             "class C: ...\n"),
        "mmviews/pkg/d.py": "from . import c\nclass D: ...\n",  # c <-> d, c's side under TYPE_CHECKING
        "mmviews/low/__init__.py": "from .part import P\n",
        "mmviews/low/part.py": "def f():\n    from mmviews.high import H\n",  # part -> high -> low/__init__ -> part
        "mmviews/high.py": "from mmviews.low import P\nH = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    root = tmp_path / "mmviews"
    graph = import_graph(root)
    assert graph["mmviews.pkg"] == {"mmviews.pkg.c", "mmviews.pkg.d"}
    assert two_module_circles(root) == [("mmviews.a", "mmviews.b"), ("mmviews.pkg.c", "mmviews.pkg.d")]
    assert reachable_imports("mmviews.low.part", graph) == {"mmviews.high", "mmviews.low", "mmviews.low.part"}
    assert reachable_imports("mmviews.uses_a", graph) == {"mmviews.a", "mmviews.b"}  # a's own circle, not uses_a's
    assert "mmviews.pkg" not in reachable_imports("mmviews.pkg.c", graph)  # a part's own package is not a circle


# The decoders of stored values (images, audio, JPEG frames, flow images) sit below both the
# map-style readers (hf, the video folder and its store) and the Parquet shard readers (streaming).
DECODE = "mmviews.data.decode"
READERS = ("mmviews.data.hf", "mmviews.data.streaming", "mmviews.data.video", "mmviews.data.video_store")
# Calls that turn encoded bytes or files into pixels or samples: ``module alias -> functions``.
DECODING_CALLS = {"Image": {"open"}, "sf": {"read"}, "soundfile": {"read"}, "cv2": {"imdecode", "imread"}}


def test_decode_is_below_both_readers_and_in_no_circle():
    graph = import_graph()
    for reader in READERS:
        assert DECODE in graph[reader], reader  # every reader decodes with it
    assert "mmviews.data.streaming" in graph["mmviews.data.hf"]  # the import that must not come back is seen
    held = {DECODE, *READERS}
    assert [pair for pair in two_module_circles(graph=graph) if held & set(pair)] == []
    reached = reachable_imports(DECODE, graph)
    assert not reached & set(READERS), sorted(reached)  # decode imports no reader, directly or through others
    for module in (DECODE, "mmviews.data.hf", "mmviews.data.streaming"):  # no longer circle either
        assert module not in reachable_imports(module, graph), module


def decoding_calls(root: Path = PACKAGE) -> list[str]:
    """``path:line: alias.function`` of every :data:`DECODING_CALLS` call in the package at ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.attr in DECODING_CALLS.get(node.func.value.id, ()):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.func.value.id}.{node.func.attr}")
    return found


def test_images_and_audio_are_decoded_in_decode_alone():
    calls = decoding_calls()
    assert any(c.startswith("mmviews/data/decode.py:") for c in calls)  # the finder sees the decoders
    assert [c for c in calls if not c.startswith("mmviews/data/decode.py:")] == []


# --------------------------------------------------------------------------- private names, long functions
# A benchmark measures what the package's public functions do (e.g. the trainer's setup in
# mmviews.train.setup and its step): it imports no underscore name of another package of
# mmviews, so that what it relies on is declared public and cannot drift unseen.
BENCH = "mmviews.bench"


def private_imports(root: Path = PACKAGE, package: str = BENCH) -> list[str]:
    """``path:line: name`` of each underscore name that a module of ``package`` imports from
    another package of mmviews, or reads as an attribute of a module of one it imported."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module, _ = _dotted_name(path, root)
        if not (module == package or module.startswith(package + ".")):
            continue
        outside: set[str] = set()  # local names bound to modules of other packages
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmviews") and not node.level \
                    and not (node.module == package or (node.module or "").startswith(package + ".")):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.module}.{alias.name}")
                    outside.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                outside |= {alias.asname for alias in node.names
                            if alias.asname and alias.name.startswith("mmviews.") and not alias.name.startswith(package)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in outside \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_the_benchmarks_import_no_private_name_of_another_package():
    assert private_imports() == []


def test_the_private_import_finder_finds_planted_ones(tmp_path):
    files = {
        "mmviews/__init__.py": "",
        "mmviews/bench/__init__.py": "",
        "mmviews/bench/a.py": ("from mmviews.train.trainer import _prepare, train\n"  # line 1: _prepare
                               "from mmviews.bench.b import _own\n"  # its own package: allowed
                               "import mmviews.train.step as step\n"
                               "from mmviews.train import memory\n"
                               "def f():\n    return step._present_mask, memory._reset, memory.public, step.__doc__\n"),
        "mmviews/bench/b.py": "_own = 1\n",
        "mmviews/train/__init__.py": "from mmviews.train.trainer import _prepare\n",  # not a benchmark
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert private_imports(tmp_path / "mmviews") == [
        "mmviews/bench/a.py:1: mmviews.train.trainer._prepare", "mmviews/bench/a.py:6: step._present_mask",
        "mmviews/bench/a.py:6: memory._reset"]


#: The longest a function of the package may be, in lines (its ``def`` to its last line): a longer
#: one is split into named steps that read top to bottom.
MAX_FUNCTION_LINES = 120


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"path: name": lines}`` of every function (methods and nested ones too) of the package at
    ``root`` longer than ``limit`` lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{path.relative_to(root.parent)}: {node.name}"] = lines
    return found


def test_no_function_is_longer_than_the_limit():
    assert long_functions() == {}


def test_the_length_finder_counts_def_to_last_line(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    (tmp_path / "mmviews").mkdir()
    (tmp_path / "mmviews" / "m.py").write_text(f"def five():\n{body}\nclass C:\n    def three(self):\n"
                                               "        def two():\n            pass\n")
    assert long_functions(tmp_path / "mmviews", 2) == {"mmviews/m.py: five": 5, "mmviews/m.py: three": 3}
    assert long_functions(tmp_path / "mmviews", 5) == {}


# --------------------------------------------------------------------------- the recipe is read once
# A recipe's views are parsed where it loads (mmviews.config: TrainConfig.view_spec and
# eval_view_spec) and, for callers in Python that hand the collator a list of entries, by the
# collator (mmviews.data.views); every other module takes the resolved ViewSpec.
VIEW_PARSERS = ("mmviews/config.py", "mmviews/data/views.py")


def view_spec_parses(root: Path = PACKAGE) -> list[str]:
    """``path:line`` of every call ``ViewSpec.from_config(...)`` in the package at ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "from_config" and isinstance(node.func.value, ast.Name) and \
                    node.func.value.id == "ViewSpec":
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_the_recipe_s_views_are_parsed_in_two_places():
    calls = view_spec_parses()
    assert any(c.startswith("mmviews/config.py:") for c in calls)  # the finder sees the loader's call
    assert len(calls) <= 2 and all(c.startswith(VIEW_PARSERS) for c in calls), calls
