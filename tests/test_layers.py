"""The layers of flowrl and flowrl_rewards, bottom to top (the layer table of the design, ordered by what imports
what)::

    core      flowrl/errors.py, flowrl/paths.py, flowrl/version.py, flowrl/core/ (seeding, the registry and its
              wiring, the choices)
    models    flowrl/models/           the adapters, the FlowModel contract, the stored architectures, the image-prompt
                                       form
    shapes    flowrl/shapes/           the embedded world and its model (an SD3 adapter of models/)
    rewards   rewards/ (flowrl_rewards) the Scorer port, the rewards, the background scorer (the shapes reward reads
                                       the world; rewards use models' dtypes)
    prompts   flowrl/prompts/          prompt sources and sets (OCR's sets parse targets as its reward does; the
                                       checks ask the model families; the shapes source draws from the world)
    methods   flowrl/rollout/, flowrl/credit/, flowrl/objectives/   plans, credit rules, objectives; scoring a forest
    config    flowrl/config/           the schema and its checks; builds models, methods and rewards by name
    run       flowrl/run/, flowrl/distributed/   the run folder (which reads its config), checkpoints, metrics.jsonl,
                                       outputs; the process group and FSDP2
    training  flowrl/training/         the loop: trainer, updater, evals, callbacks
    tools     flowrl/estimate/, flowrl/commands/, flowrl/__main__.py
    api       flowrl (the package facade: its public names, each a "module:attr" imported on first use, name every
              layer; it wires the registries' built-ins that name a layer above the registry's, flowrl/core/wiring.py)

A module may import its own layer and the layers below it. An import of a layer above fails
:func:`test_no_import_runs_up_the_layers`, at module level, inside a function or under ``if TYPE_CHECKING:`` alike
(the AST walk of tests/test_import_graph.py: a function-level or type-only import is a dependency all the same),
naming the importing file and line and both layers. A string literal ``"package.module:attr"`` naming a module of the
packages (a registry's lazy target, :func:`string_sites`) is an import of that module by another name, and counts as
one. Fix one by moving the code (or the registry entry) to the layer it belongs to, not by importing it lazily. Every
module must sit in a layer (:func:`test_every_module_has_a_layer`).

:data:`NOT_YET_MOVED` lists the upward imports that remain in files whose owners are rewriting them now, each with the
move that removes it; an entry that no longer climbs fails :func:`test_the_moves_not_yet_made_are_still_needed` until it
is deleted, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import tests.test_import_graph as graph

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("flowrl.errors", "flowrl.paths", "flowrl.version", "flowrl.core.*")),
    ("models", ("flowrl.models.*",)),
    ("shapes", ("flowrl.shapes.*",)),
    ("rewards", ("flowrl_rewards.*",)),
    ("prompts", ("flowrl.prompts.*",)),
    ("methods", ("flowrl.rollout.*", "flowrl.credit.*", "flowrl.objectives.*")),
    ("config", ("flowrl.config.*",)),
    ("run", ("flowrl.run.*", "flowrl.distributed.*")),
    ("training", ("flowrl.training.*",)),
    ("tools", ("flowrl.estimate.*", "flowrl.commands.*", "flowrl.__main__")),
    ("api", ("flowrl",)),
]
"""Layer name → the modules in it, bottom to top: ``pkg.*`` is the package ``pkg`` and every module under it; a name
without ``.*`` is that module alone."""

NOT_YET_MOVED: dict[tuple[str, str], str] = {}
"""(importing module, imported module) → the move that removes the upward import (see the module docstring)."""


class Climb(NamedTuple):
    """One import that runs up the layers."""

    file: str
    line: int
    module: str
    layer: str
    imported: str
    imported_layer: str
    string: str = ""  # the "module:attr" string literal that names it, when it is not an import statement

    def __str__(self) -> str:
        return (
            f"{self.file}:{self.line}: {self.module} (layer {self.layer!r}) imports {self.imported} (layer "
            f"{self.imported_layer!r}, above it)" + (f" by the string {self.string!r}" if self.string else "")
        )


def _in(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        package = pattern[:-2]
        return module == package or module.startswith(package + ".")
    return module == pattern


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    """The index in ``layers`` of ``module``'s layer (its most specific pattern), or None when no layer holds it."""
    best: tuple[int, int] | None = None  # (pattern length, layer index)
    for index, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if _in(module, pattern) and (best is None or len(pattern) > best[0]):
                best = (len(pattern), index)
    return None if best is None else best[1]


def package_files() -> list[Path]:
    """Every module of flowrl/ and rewards/ (the packages of tests/test_import_graph.py)."""
    return sorted(p for package in graph.PACKAGES for p in (graph.ROOT / package).rglob("*.py"))


TARGET = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
"""A ``"package.module:attr"`` string (``attr`` may be dotted: ``Class.method``); group 1 is the module."""


def string_sites(path: Path, known: set[str]) -> list[tuple[int, str, str]]:
    """``(line, module, string)`` of every string literal in ``path`` that is all ``"package.module:attr"`` with a
    module of ``known`` (a registry's lazy target, a facade's lazy name): an import by another name. A string that only
    mentions one (a message, a docstring) and one naming a module outside ``known`` do not count."""
    this = graph.module_name(path)
    found: set[tuple[int, str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = TARGET.fullmatch(node.value)
            if match and match[1] in known and match[1] != this:
                found.add((node.lineno, match[1], node.value))
    return sorted(found)


def namespace_packages(files: list[Path]) -> set[str]:
    """The module names of the folders holding ``files`` that have no ``__init__.py`` (namespace packages: no code of
    their own)."""
    out = set()
    for path in files:
        folder = path.parent
        while folder != graph.ROOT and graph.ROOT in folder.parents:
            if not (folder / "__init__.py").is_file():
                out.add(graph.module_name(folder / "__init__.py"))
            folder = folder.parent
    return out


def climbs(files: list[Path], layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[Climb]:
    """Every import in ``files`` of a module in a higher layer than the importing module's: import statements and
    ``"module:attr"`` strings (:func:`string_sites`) alike. ``from flowrl.config import chosen`` imports
    ``flowrl.config.chosen``, not the package ``flowrl`` above the namespace package ``flowrl.config`` (the package
    facade, in the top layer: every import runs it, and it imports nothing at module level but the core)."""
    known = {graph.module_name(p) for p in files}
    namespaces = namespace_packages(files) - known
    names = [name for name, _ in layers]
    out = []
    for path in files:
        module = graph.module_name(path)
        own = layer_of(module, layers)
        sites = [
            (line, imported, "")
            for line, imported in graph.import_sites(path, known | namespaces)
            if imported not in namespaces
        ]
        for line, imported, string in sorted(sites + string_sites(path, known)):
            theirs = layer_of(imported, layers)
            if own is not None and theirs is not None and theirs > own:
                file = str(path.relative_to(graph.ROOT))
                out.append(Climb(file, line, module, names[own], imported, names[theirs], string))
    return out


# ---- the checker -------------------------------------------------------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> list[Path]:
    """The files of a package ``pkg`` made of ``files`` (name → source) under ``tmp_path``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, source in files.items():
        (pkg / name).write_text(source)
    return sorted(pkg.glob("*.py"))


def test_the_checker_names_an_upward_import_in_a_function_and_under_type_checking(tmp_path, monkeypatch):
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    files = _package(
        tmp_path,
        {
            "low.py": "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n\n"
            "if TYPE_CHECKING:\n    from pkg.high import High\n\n\n"
            "def make() -> High:\n    from pkg import high\n    return high.High()\n",
            "high.py": "from pkg.low import make\n\n\nclass High:\n    pass\n",
            "mid.py": "import pkg.low\n",
        },
    )
    layers = [("low", ("pkg", "pkg.low")), ("mid", ("pkg.mid",)), ("high", ("pkg.high",))]
    found = climbs(files, layers)
    assert [(c.file, c.line, c.imported) for c in found] == [
        ("pkg/low.py", 5, "pkg.high"),
        ("pkg/low.py", 9, "pkg.high"),
    ]
    assert str(found[0]) == "pkg/low.py:5: pkg.low (layer 'low') imports pkg.high (layer 'high', above it)"
    assert layer_of("pkg", layers) == 0 and layer_of("pkg.other", layers) is None  # "pkg": the package alone


def test_the_checker_reads_a_registry_string_as_an_import(tmp_path, monkeypatch):
    """A ``"module:Class"`` string a registry imports when it resolves it is an import of that module: a lower layer's
    registry naming a higher layer's class climbs as an import statement would, at the string's line."""
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    files = _package(
        tmp_path,
        {
            "low.py": "REGISTRY = {\n"
            '    "same": "pkg.low:Low",\n'
            '    "high": "pkg.high:High",\n'
            '    "method": "pkg.high:High.make",\n'
            '    "outside": "other.module:Thing",\n'
            '    "file": "plugins/high.py:High",\n'
            "}\n"
            'NOTE = "see pkg.high:High"\n'
            "\n\nclass Low:\n    pass\n",
            "high.py": 'BUILTINS = {"low": "pkg.low:Low"}\n\n\nclass High:\n    pass\n',
        },
    )
    layers = [("low", ("pkg", "pkg.low")), ("high", ("pkg.high",))]
    found = climbs(files, layers)
    assert [(c.file, c.line, c.imported, c.string) for c in found] == [
        ("pkg/low.py", 3, "pkg.high", "pkg.high:High"),
        ("pkg/low.py", 4, "pkg.high", "pkg.high:High.make"),
    ]
    assert str(found[0]) == (
        "pkg/low.py:3: pkg.low (layer 'low') imports pkg.high (layer 'high', above it) by the string 'pkg.high:High'"
    )
    assert string_sites(tmp_path / "pkg" / "high.py", {"pkg.low", "pkg.high"}) == [(1, "pkg.low", "pkg.low:Low")]


def test_an_import_through_a_namespace_package_is_not_one_of_the_package_above_it(tmp_path, monkeypatch):
    """``from pkg.ns import mod`` (``pkg/ns/`` without ``__init__.py``) imports ``pkg.ns.mod``; ``pkg``, the package
    facade in the top layer, only where it is named."""
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    files = _package(tmp_path, {"top.py": "", "low.py": "from pkg.ns import mod\n\n\ndef f():\n    import pkg\n"})
    (tmp_path / "pkg" / "ns").mkdir()
    (tmp_path / "pkg" / "ns" / "mod.py").write_text("")
    files = sorted((tmp_path / "pkg").rglob("*.py"))
    layers = [("low", ("pkg.low", "pkg.ns.*")), ("top", ("pkg",))]
    assert namespace_packages(files) == {"pkg.ns"}
    assert [(c.line, c.imported) for c in climbs(files, layers)] == [(5, "pkg")]


def test_the_most_specific_pattern_places_a_module():
    layers = [("low", ("a.b",)), ("high", ("a.*",))]
    assert layer_of("a.b", layers) == 0 and layer_of("a.b.c", layers) == 1 and layer_of("a", layers) == 1


# ---- flowrl -------------------------------------------------------------------------------------------------------
def test_the_layers_keep_the_design_order():
    """core → models → methods → run → training → tools, and the rewards below the methods that score with them: a
    reordered table would hide the imports it was meant to catch."""
    order = [name for name, _ in LAYERS]
    design = ["core", "models", "methods", "run", "training", "tools"]
    assert [name for name in order if name in design] == design
    assert order.index("rewards") < order.index("methods") and order.index("config") < order.index("run")


def test_importing_the_package_facade_imports_only_the_core():
    """Every import of a flowrl module runs the facade (flowrl/__init__.py) first: at the top of the layers by what it
    names, it may import at module level only what sits at the bottom, and nothing heavy."""
    code = "import sys, flowrl; print(' '.join(sorted(m for m in sys.modules if m.startswith('flowrl'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=graph.ROOT)
    modules = loaded.stdout.split()
    assert "flowrl" in modules and all(layer_of(m) == 0 for m in modules if m != "flowrl"), modules


def test_every_module_has_a_layer():
    homeless = sorted(graph.module_name(p) for p in package_files() if layer_of(graph.module_name(p)) is None)
    assert not homeless, f"modules in no layer (add their package to LAYERS in tests/test_layers.py): {homeless}"


def test_no_import_runs_up_the_layers():
    found = [c for c in climbs(package_files()) if (c.module, c.imported) not in NOT_YET_MOVED]
    assert not found, "imports that run up the layers (move the code to its layer):\n" + "\n".join(map(str, found))


def test_the_moves_not_yet_made_are_still_needed():
    climbing = {(c.module, c.imported) for c in climbs(package_files())}
    done = sorted(f"{a} -> {b}" for a, b in NOT_YET_MOVED if (a, b) not in climbing)
    assert not done, f"these imports no longer run up the layers: delete them from NOT_YET_MOVED: {done}"
