"""The built-in rollout plans by name (``rollout.plan``, :data:`flowrl.core.components.PLAN`) and the class every plan
subclasses, each a ``"module:Class"`` imported when a config names it. They are declared here, in the layer of what
they name, and wired to the kind by the package facade (:mod:`flowrl.core.wiring`); out-of-tree plans are added with
:func:`flowrl.core.components.register`."""

from __future__ import annotations

from flowrl.core.registry import Builtins

PLANS = Builtins(
    {
        "chains": "flowrl.rollout.chains:Chains",
        "tree": "flowrl.rollout.tree:Tree",
        "explore": "flowrl.rollout.explore:Explore",
        "probed": "flowrl.rollout.probes:Probed",
        "ode": "flowrl.rollout.chains:ODEChains",
        "offline": "flowrl.rollout.offline:Offline",
    },
    base="flowrl.rollout.base:RolloutPlan",
)
