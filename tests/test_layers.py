"""The layers of flowrl and flowrl_rewards, bottom to top (the layer table of the design, ordered by what imports
what)::

    core      flowrl (the package: its public names are imported lazily, so it imports nothing), flowrl/errors.py,
              flowrl/paths.py, flowrl/core/ (seeding, the registry, the choices)
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

A module may import its own layer and the layers below it. An import of a layer above fails
:func:`test_no_import_runs_up_the_layers`, at module level, inside a function or under ``if TYPE_CHECKING:`` alike
(the AST walk of tests/test_import_graph.py: a function-level or type-only import is a dependency all the same),
naming the importing file and line and both layers. Fix one by moving the code to the layer it belongs to, not by
importing it lazily. Every module must sit in a layer (:func:`test_every_module_has_a_layer`).

:data:`NOT_YET_MOVED` lists the upward imports that remain in files whose owners are rewriting them now, each with the
move that removes it; an entry that no longer climbs fails :func:`test_the_moves_not_yet_made_are_still_needed` until it
is deleted, so the list only shrinks.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import tests.test_import_graph as graph

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("flowrl", "flowrl.errors", "flowrl.paths", "flowrl.core.*")),
    ("models", ("flowrl.models.*",)),
    ("shapes", ("flowrl.shapes.*",)),
    ("rewards", ("flowrl_rewards.*",)),
    ("prompts", ("flowrl.prompts.*",)),
    ("methods", ("flowrl.rollout.*", "flowrl.credit.*", "flowrl.objectives.*")),
    ("config", ("flowrl.config.*",)),
    ("run", ("flowrl.run.*", "flowrl.distributed.*")),
    ("training", ("flowrl.training.*",)),
    ("tools", ("flowrl.estimate.*", "flowrl.commands.*", "flowrl.__main__")),
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

    def __str__(self) -> str:
        return (
            f"{self.file}:{self.line}: {self.module} (layer {self.layer!r}) imports {self.imported} (layer "
            f"{self.imported_layer!r}, above it)"
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


def climbs(files: list[Path], layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[Climb]:
    """Every import in ``files`` of a module in a higher layer than the importing module's."""
    known = {graph.module_name(p) for p in files}
    names = [name for name, _ in layers]
    out = []
    for path in files:
        module = graph.module_name(path)
        own = layer_of(module, layers)
        for line, imported in graph.import_sites(path, known):
            theirs = layer_of(imported, layers)
            if own is not None and theirs is not None and theirs > own:
                out.append(Climb(str(path.relative_to(graph.ROOT)), line, module, names[own], imported, names[theirs]))
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
