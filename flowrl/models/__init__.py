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
    """A model family (``model.family``): the diffusers pipeline class it wraps (None: not picked by
    :func:`wrap`), its adapter (``"module:Class"``, a :class:`FlowModel` subclass) and how a model is loaded:
    ``loader`` (``"module:function"``, called as ``loader(path, dtype=..., **kw)``) or else the adapter's
    ``from_pretrained(path, dtype=..., **kw)``; ``needs_path``: whether ``model.path`` must be set."""

    pipeline: str | None
    adapter: str
    loader: str | None = None
    needs_path: bool = True

    def adapter_class(self) -> type[FlowModel]:
        from flowrl.plugins import load_target

        return load_target(self.adapter, f"model.family adapter {self.adapter!r}", "model adapter file", FlowModel)

    def load(self, path, *, dtype: torch.dtype, **kw) -> FlowModel:
        if self.loader is not None:
            module, _, name = self.loader.rpartition(":")
            return getattr(importlib.import_module(module), name)(path, dtype=dtype, **kw)
        return self.adapter_class().from_pretrained(path, dtype=dtype, **kw)


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "shapes": ModelFamily(None, "flowrl.models.sd3:SD3FlowModel", loader="flowrl.shapes.model:load_shapes_model",
                          needs_path=False),
    "sd3": ModelFamily("StableDiffusion3Pipeline", "flowrl.models.sd3:SD3FlowModel"),
    "flux": ModelFamily("FluxPipeline", "flowrl.models.flux:FluxFlowModel"),
    "sana": ModelFamily("SanaPipeline", "flowrl.models.sana:SanaFlowModel"),
}
"""Family name → how to load and wrap it. SD3 and SD3.5 are "sd3"; "shapes" is the embedded model (an SD3
pipeline; ``model.path`` None → the shipped weights). :func:`register_model_family` adds one."""


def register_model_family(name: str, family: ModelFamily) -> None:
    """Make ``family`` available as ``model.family: name`` (and to :func:`wrap`, by its pipeline class)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"model family name {name!r} must be a non-empty string without ':'")
    MODEL_FAMILIES[name] = family


def model_family(name: str) -> ModelFamily:
    """The registered family ``name``, or for ``package.module:Class`` / ``path/file.py:Class`` an out-of-tree
    adapter (a :class:`FlowModel` subclass) loaded with its ``from_pretrained``."""
    if name in MODEL_FAMILIES:
        return MODEL_FAMILIES[name]
    if ":" in str(name):
        family = ModelFamily(None, str(name))
        family.adapter_class()  # import and check it now: a bad name fails at load, naming the key
        return family
    raise ValueError(f"model family {name!r} is not supported; choose one of {sorted(MODEL_FAMILIES)}, or an adapter "
                     "'package.module:Class' / 'path/file.py:Class' (a flowrl.FlowModel subclass)")


def wrap(pipe, **kw) -> FlowModel:
    """The adapter for a diffusers pipeline, picked by its class (or a base class); ``kw`` go to the adapter."""
    names = [cls.__name__ for cls in type(pipe).__mro__]
    for family in MODEL_FAMILIES.values():
        if family.pipeline is not None and family.pipeline in names:
            return family.adapter_class()(pipe, **kw)
    supported = ", ".join(f.pipeline for f in MODEL_FAMILIES.values() if f.pipeline)
    raise TypeError(f"no flowrl adapter for {type(pipe).__name__}; supported pipelines: {supported}")


def load_model(family: str, path: str | os.PathLike | None, *, dtype: torch.dtype = torch.float32, **kw) -> FlowModel:
    """Load the ``family`` model (:func:`model_family`) from ``path`` (hub id or local folder) in ``dtype``.

    ``pipeline_kwargs={...}`` go to the pipeline's ``from_pretrained``; other keywords to the adapter
    (``device``, ``guidance``, ``height``, ...).
    """
    fam = model_family(family)
    if path is None and fam.needs_path:
        raise ValueError(f"model.path must name a hub id or a local folder for model.family={family!r}")
    return fam.load(path, dtype=dtype, **kw)


__all__ = ["Conditioning", "FlowModel", "LoraSpec", "MODEL_FAMILIES", "ModelFamily", "load_model", "model_family",
           "register_model_family", "wrap"]
