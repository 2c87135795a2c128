"""The built-in objectives by name (``loss.objective``, :data:`flowrl.core.components.LOSS`) and the class every
objective subclasses, each a ``"module:Class"`` imported when a config names it. They are declared here, in the layer
of what they name, and wired to the kind by the package facade (:mod:`flowrl.core.wiring`); out-of-tree objectives are
added with :func:`flowrl.core.components.register` or named as ``loss.objective: file.py:Class``."""

from __future__ import annotations

from flowrl.core.registry import Builtins

OBJECTIVES = Builtins(
    {
        "clipped": "flowrl.objectives.policy:PolicyLoss",
        "layer_tuning": "flowrl.objectives.policy:LayerTuningLoss",
        "nft": "flowrl.objectives.nft:NFTLoss",
        "awm": "flowrl.objectives.awm:AWMLoss",
        "grpo_guard": "flowrl.objectives.grpo_guard:GRPOGuardLoss",
        "dpo": "flowrl.objectives.dpo:DPOLoss",
        "gdro": "flowrl.objectives.gdro:GDROLoss",
        "dgpo": "flowrl.objectives.dgpo:DGPOLoss",
        "crd": "flowrl.objectives.crd:CRDLoss",
        "raft": "flowrl.objectives.best_of_n:RAFTLoss",
    },
    base="flowrl.objectives.base:Objective",
)
