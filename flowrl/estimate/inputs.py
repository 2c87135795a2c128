"""The transformer's inputs at a preset's shapes: latent and token counts of an image size
(:class:`Shapes`), the meta tensors of one transformer call as the adapters build them, and one adapter
``velocity`` call (CFG rows, flux packing) on them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flowrl.errors import ConfigError


@dataclass(frozen=True)
class Shapes:
    """Sizes of one preset: image ``height``×``width`` px, latent ``latent`` (C, h, w), ``image_tokens`` and
    ``text_tokens`` the transformer sees per row."""

    height: int
    width: int
    latent: tuple[int, int, int]
    image_tokens: int
    text_tokens: int


def preset_shapes(arch: dict, height: int, width: int, max_sequence_length: int) -> Shapes:
    """The latent and token counts of ``arch`` at ``height``×``width`` px with ``max_sequence_length`` text
    tokens (SD3: plus the CLIP tokens); raises :class:`ConfigError` for a size the model cannot take."""
    family, config = arch["family"], arch["transformer"]["config"]
    f = int(arch["vae"]["scale_factor"])
    patch = int(config.get("patch_size", 1) or 1)
    multiple = f * (2 if family == "flux" else patch)
    if family == "sana":
        multiple = math.lcm(32, multiple)
    if height % multiple or width % multiple:
        raise ConfigError(f"model.height/width = {height}×{width}: must be multiples of {multiple} for {arch['name']}")
    limit = arch["text"].get("max_sequence_length_limit")
    if limit and max_sequence_length > limit:
        raise ConfigError(f"model.max_sequence_length={max_sequence_length} exceeds {arch['name']}'s limit {limit}")
    h, w = height // f, width // f
    if family == "flux":
        channels = int(config["in_channels"]) // 4
        image_tokens = (h // 2) * (w // 2)
    else:
        channels = int(config["in_channels"])
        image_tokens = (h // patch) * (w // patch)
    text = max_sequence_length + (int(arch["text"].get("clip_tokens", 0)) if family == "sd3" else 0)
    return Shapes(height, width, (channels, h, w), image_tokens, text)


def transformer_inputs(arch: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Keyword arguments of one transformer call over ``rows`` rows as the adapters build them (meta tensors):

    - sd3: ``hidden_states`` [B, C, h, w], ``timestep`` [B] fp32, ``encoder_hidden_states`` [B, L, joint_dim],
      ``pooled_projections`` [B, pooled_dim];
    - flux: ``hidden_states`` [B, (h/2)(w/2), 4C] (2×2 packing), ``timestep`` and ``guidance`` [B] fp32,
      ``pooled_projections`` [B, pooled_dim], ``encoder_hidden_states`` [B, L, joint_dim], ``txt_ids`` [L, 3],
      ``img_ids`` [(h/2)(w/2), 3];
    - sana: ``hidden_states`` [B, C, h, w], ``encoder_hidden_states`` [B, L, caption_channels],
      ``encoder_attention_mask`` [B, L] int64, ``timestep`` [B] fp32.
    """
    config = arch["transformer"]["config"]
    c, h, w = shapes.latent
    L = shapes.text_tokens
    meta = {"device": "meta"}
    timestep = torch.empty(rows, dtype=torch.float32, **meta)
    if arch["family"] == "sd3":
        return {"hidden_states": torch.empty(rows, c, h, w, dtype=dtype, **meta), "timestep": timestep,
                "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
                "pooled_projections": torch.empty(rows, config["pooled_projection_dim"], dtype=dtype, **meta)}
    if arch["family"] == "flux":
        tokens = shapes.image_tokens
        out = {"hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
               "timestep": timestep,
               "pooled_projections": torch.empty(rows, config["pooled_projection_dim"], dtype=dtype, **meta),
               "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
               "txt_ids": torch.empty(L, 3, dtype=dtype, **meta), "img_ids": torch.empty(tokens, 3, dtype=dtype, **meta)}
        if config.get("guidance_embeds"):
            out["guidance"] = torch.empty(rows, dtype=torch.float32, **meta)
        return out
    if arch["family"] == "sana":
        return {"hidden_states": torch.empty(rows, c, h, w, dtype=dtype, **meta),
                "encoder_hidden_states": torch.empty(rows, L, config["caption_channels"], dtype=dtype, **meta),
                "encoder_attention_mask": torch.ones(rows, L, dtype=torch.long, **meta), "timestep": timestep}
    raise ConfigError(f"no estimate for model family {arch['family']!r}; supported: sd3, shapes, flux, sana")


def velocity(module: nn.Module, arch: dict, shapes: Shapes, states: int, cfg: bool, dtype: torch.dtype) -> torch.Tensor:
    """v [states, C, h, w] fp32 of one adapter ``velocity`` call: latents fp32 → model dtype, CFG rows
    ``[uncond; cond]`` in one forward, output back to fp32, guidance combined in fp32."""
    rows = states * (2 if cfg else 1)
    x = torch.empty(states, *shapes.latent, dtype=torch.float32, device="meta")
    inputs = transformer_inputs(arch, shapes, rows, dtype)
    hidden = x.to(dtype)
    if arch["family"] == "flux":
        c, h, w = shapes.latent
        hidden = hidden.view(states, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(states, -1, 4 * c)
    inputs["hidden_states"] = torch.cat([hidden, hidden]) if cfg else hidden
    out = module(**inputs, return_dict=False)[0]
    if arch["family"] == "flux":
        c, h, w = shapes.latent
        out = out.view(rows, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(rows, c, h, w)
    elif out.shape[1] == 2 * shapes.latent[0]:  # learned sigma: the velocity half
        out = out.chunk(2, dim=1)[0]
    v = out.float()
    if cfg:
        v_u, v_c = v.chunk(2)
        v = v_u + 4.5 * (v_c - v_u)
    return v
