"""The built-in credit rules by name (``credit.rule``, :data:`flowrl.core.components.CREDIT`) and the class every rule
subclasses, each a ``"module:Class"`` imported when a config names it. They are declared here, in the layer of what
they name, and wired to the kind by the package facade (:mod:`flowrl.core.wiring`); out-of-tree rules are added with
:func:`flowrl.core.components.register`."""

from __future__ import annotations

from flowrl.core.registry import Builtins

RULES = Builtins(
    {
        "group": "flowrl.credit.group:GroupAdvantage",
        "tree": "flowrl.credit.tree:TreeAdvantage",
        "turning_point": "flowrl.credit.turning_point:TurningPoint",
        "value_anchor": "flowrl.credit.value_anchor:ValueAnchor",
    },
    base="flowrl.credit.base:CreditRule",
)
