"""Model adapters: diffusers flow-matching pipelines behind the :class:`FlowModel` contract.

``wrap(pipe)`` picks the adapter by the pipeline's class (SD3/SD3.5, FLUX.1, SANA); ``load_model(family,
path)`` loads a pipeline (hub id or local folder) and wraps it. Importing this package does not import diffusers.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

from flowrl.models.base import Conditioning, FlowModel, LoraSpec


@dataclass(frozen=True)
class ModelFamily:
    """A supported model family: the diffusers pipeline class it wraps and its adapter."""

    pipeline: str  # diffusers pipeline class name
    adapter: str  # "module:Class"

    def adapter_class(self) -> type[FlowModel]:
        module, name = self.adapter.split(":")
        return getattr(importlib.import_module(module), name)


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "sd3": ModelFamily("StableDiffusion3Pipeline", "flowrl.models.sd3:SD3FlowModel"),
    "flux": ModelFamily("FluxPipeline", "flowrl.models.flux:FluxFlowModel"),
    "sana": ModelFamily("SanaPipeline", "flowrl.models.sana:SanaFlowModel"),
}
"""Family name → pipeline class and adapter. SD3, SD3.5 and the embedded shapes model are "sd3"."""


def wrap(pipe, **kw) -> FlowModel:
    """The adapter for a diffusers pipeline, picked by its class (or a base class); ``kw`` go to the adapter."""
    names = [cls.__name__ for cls in type(pipe).__mro__]
    for family in MODEL_FAMILIES.values():
        if family.pipeline in names:
            return family.adapter_class()(pipe, **kw)
    supported = ", ".join(f.pipeline for f in MODEL_FAMILIES.values())
    raise TypeError(f"no flowrl adapter for {type(pipe).__name__}; supported pipelines: {supported}")


def load_model(family: str, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, **kw) -> FlowModel:
    """Load the ``family`` pipeline from ``path`` (hub id or local folder) in ``dtype`` and wrap it.

    ``pipeline_kwargs={...}`` go to the pipeline's ``from_pretrained``; other keywords to the adapter
    (``device``, ``guidance``, ``height``, ...).
    """
    if family not in MODEL_FAMILIES:
        raise ValueError(f"model family {family!r} is not supported; choose one of {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[family].adapter_class().from_pretrained(path, dtype=dtype, **kw)


__all__ = ["Conditioning", "FlowModel", "LoraSpec", "MODEL_FAMILIES", "ModelFamily", "load_model", "wrap"]
