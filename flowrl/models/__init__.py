"""Model adapters: diffusers flow-matching pipelines behind the :class:`FlowModel` contract.

``wrap(pipe)`` picks the adapter by the pipeline's class (SD3/SD3.5, FLUX.1, SANA); ``load_model(family,
path)`` loads a pipeline (hub id or local folder) and wraps it. Importing this package does not import diffusers.
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from dataclasses import dataclass

import torch

from flowrl.core.registry import Registry
from flowrl.models.base import Conditioning, FlowModel, LoraSpec


@dataclass(frozen=True)
class ModelFamily:
    """A model family (``model.family``): the diffusers pipeline class it wraps (None: not picked by
    :func:`wrap`), its adapter (a :class:`FlowModel` subclass or its ``"module:Class"``) and how a model is loaded:
    ``loader`` (``"module:function"``, called as ``loader(path, dtype=..., **kw)``) or else the adapter's
    ``from_pretrained(path, dtype=..., **kw)``; ``needs_path``: whether ``model.path`` must be set."""

    pipeline: str | None
    adapter: str | type[FlowModel]
    loader: str | None = None
    needs_path: bool = True

    def adapter_class(self) -> type[FlowModel]:
        from flowrl.core.plugins import load_target

        if isinstance(self.adapter, type):
            return self.adapter
        return load_target(self.adapter, f"model.family adapter {self.adapter!r}", "model adapter file", FlowModel)

    def entry(self):
        """What :meth:`load` calls: the ``loader`` function (imported, not called), else the adapter's
        ``from_pretrained``."""
        if self.loader is not None:
            module, _, name = self.loader.rpartition(":")
            return getattr(importlib.import_module(module), name)
        return self.adapter_class().from_pretrained

    def load(self, path, *, dtype: torch.dtype, **kw) -> FlowModel:
        return self.entry()(path, dtype=dtype, **kw)

    def keywords(self) -> tuple[str, ...] | None:
        """The keywords :meth:`load` accepts beside ``path`` and ``dtype``, read from signatures (nothing is loaded):
        the entry's (:meth:`entry`) named keywords and, where it passes the rest on (an unannotated ``**kw``), the
        adapter ``__init__``'s, with the keys of the TypedDict its ``**options: Unpack[...]`` declares
        (:class:`flowrl.models.setup.AdapterOptions`). None: a function on the way takes any keyword."""
        entry_named, passes_on = _named_keywords(self.entry())
        if entry_named is None:
            return None
        if passes_on is None:
            return tuple(entry_named)
        if passes_on is not True:  # the entry's own **kw declares its keys
            return tuple(entry_named + passes_on)
        init_named, options = _named_keywords(self.adapter_class())
        if init_named is None or options is True:  # the adapter's __init__ takes any keyword
            return None
        return tuple(dict.fromkeys(entry_named + init_named + list(options or ())))


def _named_keywords(fn) -> tuple[list[str] | None, list[str] | bool | None]:
    """``(names, rest)`` of ``fn``'s signature: the keywords it names (its first positional parameter, the path or
    the pipeline, and ``dtype`` left out) and what its ``**`` parameter takes: None (there is none), the keys of the
    TypedDict it unpacks (``**options: Unpack[AdapterOptions]``) or True (any keyword). ``(None, True)`` when ``fn``
    has no signature to read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read: it may take any keyword
        return None, True
    if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "dtype"]
    rest = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    if rest is None:
        return names, None
    keys = _unpacked_keys(fn, rest.annotation)
    return names, keys if keys is not None else True


def _unpacked_keys(fn, annotation) -> list[str] | None:
    """The keys of the TypedDict that ``**kw: Unpack[TD]`` declares (the annotation may be a string, with ``Unpack``
    and ``AdapterOptions`` imported only for type checkers), else None."""
    from flowrl.models.setup import AdapterOptions

    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        owner = fn.__init__ if isinstance(fn, type) else fn
        names = {**getattr(owner, "__globals__", {}), "Unpack": typing.Unpack, "AdapterOptions": AdapterOptions}
        try:
            annotation = eval(annotation, names)  # noqa: S307 — a signature's own annotation, as typing.get_type_hints
        except Exception:  # noqa: BLE001 — an annotation that does not evaluate declares nothing
            return None
    args = typing.get_args(annotation)
    if args and typing.is_typeddict(args[0]):
        return list(typing.get_type_hints(args[0]))
    return None


def _check_family(family, label: str) -> None:
    """A registered :class:`ModelFamily`, or an adapter class (a ``module:Class`` name)."""
    if not (isinstance(family, ModelFamily) or (isinstance(family, type) and issubclass(family, FlowModel))):
        raise TypeError(
            f"{label} resolves to {family!r}, which is neither a ModelFamily nor a subclass of "
            "flowrl.FlowModel (an adapter)"
        )


MODEL_FAMILIES = Registry(
    "model.family",
    {
        "sd3": ModelFamily("StableDiffusion3Pipeline", "flowrl.models.sd3:SD3FlowModel"),
        "flux": ModelFamily("FluxPipeline", "flowrl.models.flux:FluxFlowModel"),
        "sana": ModelFamily("SanaPipeline", "flowrl.models.sana:SanaFlowModel"),
        "qwen_image": ModelFamily("QwenImagePipeline", "flowrl.models.qwen_image:QwenImageFlowModel"),
        "qwen_image_edit": ModelFamily("QwenImageEditPipeline", "flowrl.models.qwen_image_edit:QwenImageEditFlowModel"),
        "flux2": ModelFamily("Flux2Pipeline", "flowrl.models.flux2:Flux2FlowModel"),
        "wan": ModelFamily("WanPipeline", "flowrl.models.wan:WanFlowModel"),
        "wan_i2v": ModelFamily("WanImageToVideoPipeline", "flowrl.models.wan_i2v:WanI2VFlowModel"),
        "zimage": ModelFamily("ZImagePipeline", "flowrl.models.zimage:ZImageFlowModel"),
        "flux_kontext": ModelFamily("FluxKontextPipeline", "flowrl.models.flux_kontext:FluxKontextFlowModel"),
        "flux2_klein": ModelFamily("Flux2KleinPipeline", "flowrl.models.flux2_klein:Flux2KleinFlowModel"),
        "qwen_image21": ModelFamily("QwenImage21Pipeline", "flowrl.models.qwen_image21:QwenImage21FlowModel"),
        "qwen_image_edit_plus": ModelFamily(
            "QwenImageEditPlusPipeline", "flowrl.models.qwen_image_edit_plus:QwenImageEditPlusFlowModel"
        ),
        "hunyuan_image": ModelFamily("HunyuanImagePipeline", "flowrl.models.hunyuan_image:HunyuanImageFlowModel"),
        "ltx2": ModelFamily("LTX2Pipeline", "flowrl.models.ltx2:LTX2FlowModel"),
    },
    base=FlowModel,
    check=_check_family,
)
"""Family name → how to load and wrap it (a :class:`~flowrl.core.registry.Registry`). SD3 and SD3.5 are "sd3";
"shapes", the embedded model (an SD3 pipeline; ``model.path`` None → the shipped weights), sits in the shapes layer
above this one: :data:`flowrl.shapes.family.FAMILIES` declares it and the package facade wires it here
(:mod:`flowrl.core.wiring`), first of the families from the registry's first use. :func:`register_model_family` adds
one."""


def register_model_family(name: str, family: ModelFamily) -> None:
    """Make ``family`` available as ``model.family: name`` (and to :func:`wrap`, by its pipeline class)."""
    MODEL_FAMILIES.register(name, family)


def model_family(name: str) -> ModelFamily:
    """The registered family ``name``, or for ``package.module:Class`` / ``path/file.py:Class`` an out-of-tree
    adapter (a :class:`FlowModel` subclass) loaded with its ``from_pretrained``; an unknown name raises
    :class:`~flowrl.config.registry.NotRegistered` (a ValueError)."""
    family = MODEL_FAMILIES.resolve(name)  # a module:Class is imported and checked now: a bad name fails at load
    return family if isinstance(family, ModelFamily) else ModelFamily(None, family)


def adapter_keywords(family: str) -> tuple[str, ...] | None:
    """The keywords :func:`load_model` accepts for ``family`` beside ``path`` and ``dtype``
    (:meth:`ModelFamily.keywords`,
    from signatures: the adapter is imported, nothing loaded); None: it takes any keyword."""
    return model_family(family).keywords()


def wrap(pipe, **kw) -> FlowModel:
    """The adapter for a diffusers pipeline, picked by its class (or a base class); ``kw`` go to the adapter."""
    names = [cls.__name__ for cls in type(pipe).__mro__]
    families = [f for f in MODEL_FAMILIES.values() if isinstance(f, ModelFamily)]
    for family in families:
        if family.pipeline is not None and family.pipeline in names:
            return family.adapter_class()(pipe, **kw)
    supported = ", ".join(f.pipeline for f in families if f.pipeline)
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


__all__ = [
    "Conditioning",
    "FlowModel",
    "LoraSpec",
    "MODEL_FAMILIES",
    "ModelFamily",
    "adapter_keywords",
    "load_model",
    "model_family",
    "register_model_family",
    "wrap",
]
