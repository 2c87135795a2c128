"""flowrl: reinforcement learning for flow-matching text-to-image models.

Three separate steps, each usable alone::

    import flowrl
    model = flowrl.wrap(pipe)                                   # diffusers pipeline → FlowModel
    out = flowrl.sample(model, ["a red circle"], flowrl.Chains(group_size=8, kernel="flow_grpo", eta=0.7, steps=10))
    out.images, out.forest                                      # images per leaf; log-probs per edge
    trainer = flowrl.Trainer(flowrl.TrainConfig.from_yaml("configs/shapes/grpo.yaml"), model=model, reward="shapes")
    trainer.train()
"""

from __future__ import annotations

from flowrl.core import wiring as _wiring
from flowrl.version import __version__ as __version__

_LAZY = {
    "wrap": "flowrl.models:wrap",
    "load_model": "flowrl.models:load_model",
    "FlowModel": "flowrl.models.base:FlowModel",
    "Chains": "flowrl.rollout.chains:Chains",
    "SDEWindow": "flowrl.rollout.chains:SDEWindow",
    "Tree": "flowrl.rollout.tree:Tree",
    "Explore": "flowrl.rollout.explore:Explore",
    "Probed": "flowrl.rollout.probes:Probed",
    "Forest": "flowrl.rollout.forest:Forest",
    "RolloutContext": "flowrl.rollout.base:RolloutContext",
    "sample": "flowrl.rollout.sampling:sample_with_plan",
    "ode_sample": "flowrl.rollout.sampling:ode_sample",
    "GroupAdvantage": "flowrl.credit.group:GroupAdvantage",
    "TreeAdvantage": "flowrl.credit.tree:TreeAdvantage",
    "TurningPoint": "flowrl.credit.turning_point:TurningPoint",
    "ValueAnchor": "flowrl.credit.value_anchor:ValueAnchor",
    "PolicyLoss": "flowrl.objectives.policy:PolicyLoss",
    "LayerTuningLoss": "flowrl.objectives.policy:LayerTuningLoss",
    "NFTLoss": "flowrl.objectives.nft:NFTLoss",
    "AWMLoss": "flowrl.objectives.awm:AWMLoss",
    "RAFTLoss": "flowrl.objectives.best_of_n:RAFTLoss",
    "GRPOGuardLoss": "flowrl.objectives.grpo_guard:GRPOGuardLoss",
    "DPOLoss": "flowrl.objectives.dpo:DPOLoss",
    "DGPOLoss": "flowrl.objectives.dgpo:DGPOLoss",
    "CRDLoss": "flowrl.objectives.crd:CRDLoss",
    "GDROLoss": "flowrl.objectives.gdro:GDROLoss",
    "TeacherSpec": "flowrl.objectives.teacher:TeacherSpec",
    "ODEChains": "flowrl.rollout.chains:ODEChains",
    "Offline": "flowrl.rollout.offline:Offline",
    "Objective": "flowrl.objectives.base:Objective",
    "TrainConfig": "flowrl.config.schema:TrainConfig",
    "Trainer": "flowrl.training.trainer:Trainer",
    "load_shapes_model": "flowrl.shapes.model:load_shapes_model",
}


def __getattr__(name: str):
    """Import public names on first use, so ``import flowrl`` stays light."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


__all__ = list(_LAZY)

# The built-ins of the registries of lower layers that name modules above them, wired from here, above every layer
# (flowrl.core.wiring): each registry imports its declaration when it is first used.
_wiring.wire("rollout.plan", "flowrl.rollout.registry:PLANS")
_wiring.wire("credit.rule", "flowrl.credit.registry:RULES")
_wiring.wire("loss.objective", "flowrl.objectives.registry:OBJECTIVES")
_wiring.wire("model.family", "flowrl.shapes.family:FAMILIES")
