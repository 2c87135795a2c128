"""The transformer's inputs at a preset's shapes: latent and token counts of an image size
(:class:`Shapes`), the meta tensors of one transformer call as the adapters build them, and one adapter
``velocity`` call (CFG rows, flux packing) on them."""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn

from flowrl.errors import ConfigError
from flowrl.models.estimate_spec import Shapes, base_family, base_spec, estimate_spec


class _EditFamilies:
    """The image-editing families (``family in EDIT_FAMILIES``): those whose spec declares ``edit`` (each source image's
    latent tokens follow the generated ones; ``arch["text"]["sources"]`` per prompt, default 1)."""

    def __contains__(self, family: object) -> bool:
        return isinstance(family, str) and estimate_spec(family).edit


EDIT_FAMILIES = _EditFamilies()
"""Image-editing families (their adapters' :class:`~flowrl.models.estimate_spec.EstimateSpec` ``edit``)."""


VISION_DEFAULT = {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056}
"""Qwen2-VL's image processor (Qwen-Image-Edit's): 14 px patches merged 2×2, 4 to 16384 vision tokens."""


def vision_tokens(vision: dict, height: int, width: int) -> int:
    """Vision tokens of a ``height``×``width`` source through a Qwen2-VL image processor (``vision``: its
    :data:`VISION_DEFAULT` settings): resized to multiples of patch·merge px within the pixel bounds, then a
    token per merged patch."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    factor = vision["patch_size"] * vision["merge_size"]
    h, w = smart_resize(height, width, factor=factor, min_pixels=vision["min_pixels"], max_pixels=vision["max_pixels"])
    return (h // factor) * (w // factor)


def condition_size(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) px of the image of about ``area`` px at ``width / height`` that a Qwen-Image-Edit-Plus text
    encoder sees of each source (the adapter's :func:`flowrl.models.qwen_image_edit_plus.condition_size`)."""
    from flowrl.models.qwen_image_edit_plus import condition_size as size

    return size(area, height, width)


def with_sources(arch: dict, kwargs: dict) -> dict:
    """``arch`` as a run with ``model.kwargs`` = ``kwargs`` holds it: an edit family whose adapter takes several
    sources per prompt (``max_images``: Qwen-Image-Edit-Plus) pads every prompt's conditioning to ``max_images``
    sources, the text encoder seeing each as a condition image of about ``condition_area`` px (the kwargs, else the
    adapter's defaults); ``arch`` itself for any other family."""
    if not estimate_spec(arch["family"]).edit:
        return arch
    from flowrl.models import model_family

    params = inspect.signature(model_family(arch["family"]).adapter_class()).parameters
    if "max_images" not in params:
        return arch
    sources, area = (int(kwargs.get(k) or params[k].default) for k in ("max_images", "condition_area"))
    return {**arch, "text": {**arch["text"], "sources": sources, "condition_area": area}}


def preset_shapes(arch: dict, height: int, width: int, max_sequence_length: int, frames: int | None = None) -> Shapes:
    """The latent and token counts of ``arch`` at ``height``×``width`` px with ``max_sequence_length`` text
    tokens (SD3: plus the CLIP tokens) and, for a video family, ``frames`` frames (latent [C, F, h, w] with
    F = (frames − 1)/t + 1, image tokens F·(h/2)·(w/2)); raises :class:`ConfigError` for a size the model
    cannot take. An edit family: its base family's shapes, the sources' latent tokens and vision tokens added
    (``arch["text"]``: ``sources`` per prompt, default 1; ``condition_area``: the px of the image the text encoder
    sees of each, at the run's aspect ratio, default the source itself)."""
    family, config = arch["family"], arch["transformer"]["config"]
    spec = estimate_spec(family)
    if spec.base is not None and not spec.edit:  # a variant: its base family's shapes
        return preset_shapes({**arch, "family": spec.base}, height, width, max_sequence_length, frames)
    if spec.edit:
        base = preset_shapes({**arch, "family": base_family(family)}, height, width, max_sequence_length)
        sources, area = int(arch["text"].get("sources", 1)), arch["text"].get("condition_area")
        ch, cw = (height, width) if area is None else condition_size(int(area), height, width)
        vision = vision_tokens(arch["text"].get("vision", VISION_DEFAULT), ch, cw) if spec.vision else 0
        return dataclasses.replace(
            base, text_tokens=base.text_tokens + sources * vision, source_tokens=sources * base.image_tokens
        )
    f = int(arch["vae"]["scale_factor"])
    patch = config.get("patch_size", 1) or 1
    patch = int(max(patch[1:]) if isinstance(patch, (list, tuple)) else patch)
    multiple = f * (spec.token_patch or patch)
    if spec.size_multiple > 1:
        multiple = math.lcm(spec.size_multiple, multiple)
    if height % multiple or width % multiple:
        raise ConfigError(f"model.height/width = {height}×{width}: must be multiples of {multiple} for {arch['name']}")
    limit = arch["text"].get("max_sequence_length_limit")
    if limit and max_sequence_length > limit:
        raise ConfigError(f"model.max_sequence_length={max_sequence_length} exceeds {arch['name']}'s limit {limit}")
    h, w = height // f, width // f
    text = max_sequence_length + (int(arch["text"].get("clip_tokens", 0)) if spec.clip_tokens else 0)
    text += int(arch["text"].get("glyph_tokens", 0))  # HunyuanImage's ByT5 glyph tokens join the text
    latent_frames = None
    if spec.video:
        t = int(arch["vae"].get("temporal_factor", 4))
        if frames is None or frames < 1 or (frames - 1) % t:
            raise ConfigError(f"model.kwargs.num_frames={frames}: must be {t}·k + 1 for {arch['name']}")
        latent_frames = (frames - 1) // t + 1
    latent, tokens = spec.latent(config, h, w, patch, latent_frames)
    return Shapes(height, width, tuple(latent), tokens, text)


def transformer_inputs(arch: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """Keyword arguments of one transformer call over ``rows`` rows as the adapters build them (meta tensors): the
    ``inputs`` of the base family's :class:`~flowrl.models.estimate_spec.EstimateSpec` (each adapter module
    documents its own). Raises :class:`ConfigError` for a family whose adapter declares none."""
    spec = base_spec(arch["family"])
    if spec.inputs is None:
        raise ConfigError(
            f"no estimate for model family {arch['family']!r}: its adapter's estimate_spec declares no inputs"
        )
    return spec.inputs(arch["transformer"]["config"], shapes, rows, dtype)


def velocity(module: nn.Module, arch: dict, shapes: Shapes, states: int, cfg: bool, dtype: torch.dtype) -> torch.Tensor:
    """v [states, *latent] fp32 of one adapter ``velocity`` call: latents fp32 → model dtype, CFG rows
    ``[uncond; cond]`` in one forward, output back to fp32, guidance combined in fp32 (FLUX / Qwen-Image: 2×2
    packing; FLUX.2, Qwen-Image 2.1: a token per latent cell; Wan: the 5-D video latent as is; an edit model: the
    sources' cached tokens appended, the output cut back to the generated tokens; Qwen-Image 2.1: the output's last
    tokens, after the text's)."""
    rows = states * (2 if cfg else 1)
    spec = base_spec(arch["family"])
    x = torch.empty(states, *shapes.latent, dtype=torch.float32, device="meta")
    inputs = transformer_inputs(arch, shapes, rows, dtype)
    hidden = x.to(dtype)
    if spec.to_tokens is not None:
        hidden = spec.to_tokens(hidden, shapes)
    if shapes.source_tokens:
        source = torch.empty(states, shapes.source_tokens, hidden.shape[-1], dtype=dtype, device="meta")
        hidden = torch.cat([hidden, source], dim=1)
    hidden = torch.cat([hidden, hidden]) if cfg else hidden
    if spec.forward is not None:
        out = spec.forward(module, inputs, hidden)
    else:
        inputs["hidden_states"] = hidden
        out = module(**inputs, return_dict=False)[0]
    if shapes.source_tokens:
        out = out[:, : shapes.image_tokens]
    out = spec.from_tokens(out, shapes)
    v = out.float()
    if cfg:
        v_u, v_c = v.chunk(2)
        v = v_u + 4.5 * (v_c - v_u)
    return v


def decode_latents(vae: nn.Module, arch: dict, latents: torch.Tensor) -> torch.Tensor:
    """The adapter's VAE decode of ``latents`` [B, *latent] (model dtype): Qwen-Image (and 2.1) one frame of its video
    VAE (``[B, C, 1, h, w]``), FLUX.2 its 2×2 patches unpatchified to the VAE's [B, C/4, 2h, 2w] first, Wan the whole
    video ``[B, C, F, h, w]``; the others as is. Returns the decoded pixels (model dtype)."""
    return base_spec(arch["family"]).decode(vae, arch, latents)
