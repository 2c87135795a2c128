"""The embedded model as a model family: ``model.family: shapes`` (the default), an SD3 pipeline loaded by
:func:`flowrl.shapes.model.load_shapes_model` (``model.path`` None → the shipped weights). It is declared here, in the
layer of its loader, and wired to :data:`flowrl.models.MODEL_FAMILIES` by the package facade
(:mod:`flowrl.core.wiring`): the models layer below names no module of this one."""

from __future__ import annotations

from flowrl.core.registry import Builtins
from flowrl.models import ModelFamily

FAMILIES = Builtins(
    {
        "shapes": ModelFamily(
            None, "flowrl.models.sd3:SD3FlowModel", loader="flowrl.shapes.model:load_shapes_model", needs_path=False
        ),
    }
)
