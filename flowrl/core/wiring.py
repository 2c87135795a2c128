"""Where a registry's built-ins come from when they name modules above the registry's own layer.

A registry of a low layer (the component kinds of :mod:`flowrl.core.components`, the model families of
:mod:`flowrl.models`) may not name what sits above it: tests/test_layers.py reads a ``"module:attr"`` string as the
import it stands for. The built-ins such a registry lists are declared in the layer of what they name instead, as a
:class:`flowrl.core.registry.Builtins` (the plans in ``flowrl/rollout/registry.py``, the credit rules in
``flowrl/credit/registry.py``, the objectives in ``flowrl/objectives/registry.py``, the shapes model's family in
``flowrl/shapes/family.py``), and the package facade (:mod:`flowrl`: above every layer, and run before any module of
the package) wires each to its registry's kind here with :func:`wire`. A :class:`~flowrl.core.registry.Registry` of
that kind registers them before it is first used, read or written, importing only the module that declares them.

This module imports nothing, so ``import flowrl`` stays cheap.
"""

from __future__ import annotations

BUILTINS: dict[str, list[str]] = {}
"""Registry kind (``"rollout.plan"``) → the ``"module:attr"`` of each :class:`~flowrl.core.registry.Builtins` wired to
it, in the order they register."""


def wire(kind: str, target: str) -> None:
    """Have every registry of ``kind`` register the built-ins ``target`` names (``"module:attr"`` of a
    :class:`~flowrl.core.registry.Builtins`) before its next use; wiring one twice wires it once."""
    wired = BUILTINS.setdefault(kind, [])
    if target not in wired:
        wired.append(target)
