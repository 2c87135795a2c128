"""The embedded shapes model as a :class:`~flowrl.models.sd3.SD3FlowModel` (it is a small SD3 pipeline)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_shapes_model(
    path: str | Path | None = None, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kw
):
    """The shipped (or a saved) shapes pipeline wrapped by the SD3 adapter, with its generation
    defaults (32 px, ``max_sequence_length`` and guidance from ``flowrl_shapes.json``); ``kw``
    (guidance, height, width, max_sequence_length, gradient_checkpointing) override them."""
    from flowrl.models.sd3 import SD3FlowModel
    from flowrl.shapes.pipeline import SHIPPED_DIR, generation_defaults, load_shapes_pipeline

    path = Path(path) if path is not None else SHIPPED_DIR
    defaults = generation_defaults(path)
    pipe = load_shapes_pipeline(path, device=device, dtype=dtype)
    options = {
        "height": defaults["height"],
        "width": defaults["width"],
        "max_sequence_length": defaults["max_sequence_length"],
        "guidance": defaults["guidance_scale"],
    }
    options.update(kw)
    return SD3FlowModel(pipe, device=device, dtype=dtype, **options)
