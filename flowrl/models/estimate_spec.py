"""What the estimate (:mod:`flowrl.estimate`) needs to know of a model family, declared beside its adapter.

A family is one adapter module plus its data: the adapter class names an :class:`EstimateSpec` as its
``estimate_spec`` class attribute (a subclass registered under another family name inherits it), and
:func:`estimate_spec` finds it from the family registry (:data:`flowrl.models.MODEL_FAMILIES`). The estimate's
modules (``flowrl/estimate/inputs.py``, ``iteration.py``, ``archs.py``) hold no family name: the transformer's meta
inputs, the latent layout, the size multiple, the text limit, the VAE's factors, the decode and the guidance kind come
from the spec; ``max_sequence_length`` and ``guidance`` defaults from the adapter's constructor signature
(:func:`adapter_default`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Shapes:
    """Sizes of one preset: image ``height``×``width`` px, latent ``latent`` (C, h, w; a video: C, F, h, w),
    ``image_tokens`` (generated) and ``text_tokens`` the transformer sees per row; an edit model's
    ``source_tokens`` (the source image's latent tokens, after the generated ones)."""

    height: int
    width: int
    latent: tuple[int, ...]
    image_tokens: int
    text_tokens: int
    source_tokens: int = 0


def grid_latent(config: dict, h: int, w: int, patch: int, frames: int | None) -> tuple[tuple[int, ...], int]:
    """The default latent layout: [C, h, w] (a video: [C, F, h, w]), a token per ``patch``×``patch`` cells (per
    frame)."""
    c = int(config["in_channels"])
    if frames is None:
        return (c, h, w), (h // patch) * (w // patch)
    return (c, frames, h, w), frames * (h // patch) * (w // patch)


def packed_latent(config: dict, h: int, w: int, patch: int, frames: int | None) -> tuple[tuple[int, ...], int]:
    """2×2 latent patches packed into tokens of 4C channels (``in_channels`` = 4C): [C, h, w], (h/2)(w/2) tokens."""
    return (int(config["in_channels"]) // 4, h, w), (h // 2) * (w // 2)


def pack_2x2(hidden: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[B, C, h, w] → [B, (h/2)(w/2), 4C] (the adapters' 2×2 packing)."""
    c, h, w = shapes.latent[0], shapes.latent[-2], shapes.latent[-1]
    b = hidden.shape[0]
    return hidden.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, 4 * c)


def unpack_2x2(out: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[B, (h/2)(w/2), 4C] → [B, C, h, w]."""
    c, h, w = shapes.latent[0], shapes.latent[-2], shapes.latent[-1]
    return out.view(out.shape[0], h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(out.shape[0], c, h, w)


def cells_to_tokens(hidden: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[B, C, h, w] → a token per latent cell [B, h·w, C]."""
    c, h, w = shapes.latent[0], shapes.latent[-2], shapes.latent[-1]
    return hidden.reshape(hidden.shape[0], c, h * w).transpose(1, 2)


def tokens_to_cells(out: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[B, h·w, C] → [B, C, h, w]."""
    c, h, w = shapes.latent[0], shapes.latent[-2], shapes.latent[-1]
    return out.transpose(1, 2).reshape(out.shape[0], c, h, w)


def velocity_half(out: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """The transformer's output as the latent: a learned-sigma output's velocity half (2C channels → C)."""
    return out.chunk(2, dim=1)[0] if out.shape[1] == 2 * shapes.latent[0] else out


def vae_decode(vae, arch: dict, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's own decode of ``latents`` [B, *latent] (pixels, model dtype)."""
    return vae.decode(latents, return_dict=False)[0]


@dataclass(frozen=True)
class EstimateSpec:
    """A family's estimate data (see the module's docstring).

    - ``inputs(config, shapes, rows, dtype)``: the keyword arguments of one transformer call over ``rows`` rows as
      the adapter builds them (meta tensors; ``config`` the transformer's config);
    - ``latent(config, h, w, patch, frames)``: (latent shape, generated image tokens) at ``h``×``w`` latent cells
      (``frames`` latent frames of a video, else None; ``patch`` the config's spatial ``patch_size``);
    - ``token_patch``: latent cells per side one token covers, for the size multiple (None: ``patch``);
      ``size_multiple``: px the height and width must also be multiples of;
    - ``to_tokens(hidden, shapes)`` / ``from_tokens(out, shapes)``: the latent [B, *latent] to the transformer's
      ``hidden_states`` and its output back (the sources' tokens already cut, for an edit model);
      ``forward(module, inputs, hidden)``: the transformer's call when it is not ``module(**inputs,
      hidden_states=hidden)``;
    - ``decode(vae, arch, latents)``: the adapter's VAE decode;
    - ``base``: the family whose transformer, inputs and decode this one has (an edit family's text-to-image base,
      a variant's family), None: its own; ``edit``: the source images' latent tokens follow the generated ones;
      ``vision``: the text encoder sees the sources (their vision tokens join the text);
    - ``video``: the latent is a video [C, F, h, w]; ``clip_tokens``: the CLIP tokens join the text (SD3);
    - ``guidance``: ``"cfg"`` (a CFG scale), ``"embedding"`` (a distilled embedding, no CFG branch) or
      ``"true_cfg"`` (an embedding, CFG from ``model.true_cfg``); ``masked_text``: an int64 text attention mask is
      cached with each prompt; ``text_limit``: the ``max_sequence_length`` the pipeline allows;
    - ``folder_vae(vae_config)`` / ``pipeline_vae(pipe)``: the VAE's factors (``scale_factor``,
      ``temporal_factor``) a folder's config or a live pipeline states beyond the spatial default;
    - ``defaults``: constructor defaults the estimate takes where the adapter's signature says None (the value the
      adapter resolves None to).
    """

    inputs: Callable[..., dict] | None = None
    latent: Callable[..., tuple[tuple[int, ...], int]] = grid_latent
    token_patch: int | None = None
    size_multiple: int = 1
    to_tokens: Callable[[torch.Tensor, Shapes], torch.Tensor] | None = None
    from_tokens: Callable[[torch.Tensor, Shapes], torch.Tensor] = velocity_half
    forward: Callable[..., torch.Tensor] | None = None
    decode: Callable[..., torch.Tensor] = vae_decode
    base: str | None = None
    edit: bool = False
    vision: bool = False
    video: bool = False
    clip_tokens: bool = False
    guidance: str = "cfg"
    masked_text: bool = False
    text_limit: int = 512
    folder_vae: Callable[[dict], dict] | None = None
    pipeline_vae: Callable[[Any], dict] | None = None
    defaults: dict = field(default_factory=dict)


def adapter_spec(cls: type) -> EstimateSpec | None:
    """The :class:`EstimateSpec` of adapter class ``cls`` (its own or the nearest base class's), else None."""
    for klass in cls.__mro__:
        spec = klass.__dict__.get("estimate_spec")
        if isinstance(spec, EstimateSpec):
            return spec
    return None


def estimate_spec(family: str) -> EstimateSpec:
    """The :class:`EstimateSpec` of the registered family ``family`` (read from its adapter class); raises
    :class:`~flowrl.errors.ConfigError` when its adapter declares none."""
    from flowrl.errors import ConfigError
    from flowrl.models import model_family

    cls = model_family(family).adapter_class()
    spec = adapter_spec(cls)
    if spec is None:
        raise ConfigError(
            f"no estimate for model family {family!r}: its adapter {cls.__qualname__} declares no estimate_spec "
            "(a flowrl.models.estimate_spec.EstimateSpec; docs/extending.md)"
        )
    return spec


def base_family(family: str) -> str:
    """The family whose transformer, inputs and decode ``family`` has (``base`` of its spec, else itself)."""
    return estimate_spec(family).base or family


def base_spec(family: str) -> EstimateSpec:
    """The spec of :func:`base_family` of ``family`` (the transformer's inputs, latent layout, decode, VAE)."""
    return estimate_spec(base_family(family))


def adapter_default(family: str, name: str) -> Any:
    """The default of the adapter's constructor keyword ``name`` for ``family`` (its signature, or the spec's
    ``defaults`` where the signature says None)."""
    from flowrl.models import model_family

    params = inspect.signature(model_family(family).adapter_class()).parameters
    value = params[name].default if name in params else None
    if value is None or value is inspect.Parameter.empty:
        value = estimate_spec(family).defaults.get(name)
    return value
