"""The embedded model as a model family: ``model.family: shapes`` (the default), an SD3 pipeline loaded by
:func:`flowrl.shapes.model.load_shapes_model` (``model.path`` None → the shipped weights). It is declared here, in the
layer of its loader, and wired to :data:`flowrl.models.MODEL_FAMILIES` by the package facade
(:mod:`flowrl.core.wiring`): the models layer below names no module of this one."""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.core.registry import Builtins
from flowrl.models import ModelFamily


@dataclass(frozen=True)
class ShippedFamily(ModelFamily):
    """A family whose model ships with flowrl: without ``model.path`` the estimate reads its architecture from the
    shipped pipeline folder (:data:`flowrl.shapes.pipeline.SHIPPED_DIR`), as a pipeline of ``arch_family`` (the family
    whose adapter and estimate data it has: :func:`flowrl.estimate.archs.arch_for_model`)."""

    arch_family: str = "sd3"


FAMILIES = Builtins(
    {
        "shapes": ShippedFamily(
            None,
            "flowrl.models.sd3:SD3FlowModel",
            loader="flowrl.shapes.model:load_shapes_model",
            needs_path=False,
            arch_family="sd3",
        ),
    }
)
