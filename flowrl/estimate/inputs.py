"""The transformer's inputs at a preset's shapes: latent and token counts of an image size
(:class:`Shapes`), the meta tensors of one transformer call as the adapters build them, and one adapter
``velocity`` call (CFG rows, flux packing) on them."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn

from flowrl.errors import ConfigError


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


PACKED_2X2 = ("flux", "qwen_image")
"""Families whose adapter packs 2×2 latent patches into tokens of 4C channels (``in_channels``)."""
VIDEO_FAMILIES = ("wan", "ltx2")
"""Families whose latent is a video [C, F, h, w] (F = (frames − 1)/t + 1, t the VAE's ``temporal_factor``)."""
EDIT_FAMILIES = {"qwen_image_edit": "qwen_image", "qwen_image_edit_plus": "qwen_image", "flux_kontext": "flux"}
"""Image-editing families and the family whose transformer they drive: each source image's latent tokens follow
the generated ones (as many again per source: ``arch["text"]["sources"]``, default 1); a family of
:data:`VISION_EDITS` adds each source's vision tokens to the text."""
VISION_EDITS = ("qwen_image_edit", "qwen_image_edit_plus")
"""Edit families whose text encoder sees the source images (their vision tokens join the text; FLUX.1 Kontext's T5
does not)."""
VARIANT_FAMILIES = {"flux2_klein": "flux2", "wan_i2v": "wan"}
"""Families whose transformer inputs and decode are another family's (FLUX.2 klein: FLUX.2's; Wan 2.2 I2V: Wan's, its
input channels the noise's and the first frame's condition, which the latent shape here counts)."""


def base_family(family: str) -> str:
    """The family whose transformer, inputs and decode ``family`` has (an edit family's text-to-image base, a
    variant's family)."""
    return EDIT_FAMILIES.get(family) or VARIANT_FAMILIES.get(family, family)


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
    if arch["family"] not in EDIT_FAMILIES:
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
    if family in VARIANT_FAMILIES:
        return preset_shapes({**arch, "family": base_family(family)}, height, width, max_sequence_length, frames)
    if family in EDIT_FAMILIES:
        base = preset_shapes({**arch, "family": base_family(family)}, height, width, max_sequence_length)
        sources, area = int(arch["text"].get("sources", 1)), arch["text"].get("condition_area")
        ch, cw = (height, width) if area is None else condition_size(int(area), height, width)
        vision = vision_tokens(arch["text"].get("vision", VISION_DEFAULT), ch, cw) if family in VISION_EDITS else 0
        return dataclasses.replace(
            base, text_tokens=base.text_tokens + sources * vision, source_tokens=sources * base.image_tokens
        )
    f = int(arch["vae"]["scale_factor"])
    patch = config.get("patch_size", 1) or 1
    patch = int(max(patch[1:]) if isinstance(patch, (list, tuple)) else patch)
    multiple = f * (
        2 if family in PACKED_2X2 or family in ("flux2", "qwen_image21", "zimage", "hunyuan_image") else patch
    )
    if family == "sana":
        multiple = math.lcm(32, multiple)
    if height % multiple or width % multiple:
        raise ConfigError(f"model.height/width = {height}×{width}: must be multiples of {multiple} for {arch['name']}")
    limit = arch["text"].get("max_sequence_length_limit")
    if limit and max_sequence_length > limit:
        raise ConfigError(f"model.max_sequence_length={max_sequence_length} exceeds {arch['name']}'s limit {limit}")
    h, w = height // f, width // f
    text = max_sequence_length + (int(arch["text"].get("clip_tokens", 0)) if family == "sd3" else 0)
    text += int(arch["text"].get("glyph_tokens", 0))  # HunyuanImage's ByT5 glyph tokens join the text
    if family in PACKED_2X2:
        return Shapes(height, width, (int(config["in_channels"]) // 4, h, w), (h // 2) * (w // 2), text)
    if family == "flux2":  # the VAE latent patchified 2×2 is the model's latent: [4z, H/2f, W/2f], a token per cell
        return Shapes(height, width, (int(config["in_channels"]), h // 2, w // 2), (h // 2) * (w // 2), text)
    if family == "qwen_image21":  # a token per latent cell (sizes: multiples of 32 px); the text joins its sequence
        return Shapes(height, width, (int(config["in_channels"]), h, w), h * w, text)
    if family == "zimage":  # 2×2 patches of the latent [C, h, w]
        return Shapes(height, width, (int(config["in_channels"]), h, w), (h // 2) * (w // 2), text)
    if family in VIDEO_FAMILIES:
        t = int(arch["vae"].get("temporal_factor", 4))
        if frames is None or frames < 1 or (frames - 1) % t:
            raise ConfigError(f"model.kwargs.num_frames={frames}: must be {t}·k + 1 for {arch['name']}")
        latent_frames = (frames - 1) // t + 1
        return Shapes(
            height,
            width,
            (int(config["in_channels"]), latent_frames, h, w),
            latent_frames * (h // patch) * (w // patch),
            text,
        )
    return Shapes(height, width, (int(config["in_channels"]), h, w), (h // patch) * (w // patch), text)


def transformer_inputs(arch: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """Keyword arguments of one transformer call over ``rows`` rows as the adapters build them (meta tensors):

    - sd3: ``hidden_states`` [B, C, h, w], ``timestep`` [B] fp32, ``encoder_hidden_states`` [B, L, joint_dim],
      ``pooled_projections`` [B, pooled_dim];
    - flux: ``hidden_states`` [B, (h/2)(w/2), 4C] (2×2 packing), ``timestep`` and ``guidance`` [B] fp32,
      ``pooled_projections`` [B, pooled_dim], ``encoder_hidden_states`` [B, L, joint_dim], ``txt_ids`` [L, 3],
      ``img_ids`` [(h/2)(w/2), 3]; flux_kontext: the same with the source's tokens appended ([B, 2(h/2)(w/2), 4C],
      ``img_ids`` [2(h/2)(w/2), 3]);
    - sana: ``hidden_states`` [B, C, h, w], ``encoder_hidden_states`` [B, L, caption_channels],
      ``encoder_attention_mask`` [B, L] int64, ``timestep`` [B] fp32;
    - qwen_image: ``hidden_states`` [B, (h/2)(w/2), 4C] (2×2 packing), ``timestep`` [B] fp32,
      ``encoder_hidden_states`` [B, L, joint_dim], ``encoder_hidden_states_mask`` [B, L] int64, ``img_shapes``;
      qwen_image_edit(_plus): the same with each source's tokens appended ([B, (1 + k)(h/2)(w/2), 4C], 1 + k
      ``img_shapes``, k sources);
    - qwen_image21: ``hidden_states`` [B, h·w, C] (a token per cell), ``timestep`` [B] fp32,
      ``encoder_hidden_states`` [B, L, context_in_dim], ``img_shapes`` [(1, h, w)], ``img_mask`` [B, L + h·w/4] bool
      (a real host tensor: the transformer reads the token layout from it on the host);
    - flux2: ``hidden_states`` [B, h·w, C] (a token per cell), ``timestep`` and ``guidance`` [B] fp32,
      ``encoder_hidden_states`` [B, L, joint_dim], ``txt_ids`` [1, L, 4], ``img_ids`` [1, h·w, 4] (flux2_klein: the
      same, its transformer without a guidance input);
    - wan: ``hidden_states`` [B, C, F, h, w], ``timestep`` [B] fp32, ``encoder_hidden_states`` [B, L, text_dim].
    """
    config = arch["transformer"]["config"]
    family = base_family(arch["family"])
    c, h, w = shapes.latent[0], shapes.latent[-2], shapes.latent[-1]
    L = shapes.text_tokens
    meta = {"device": "meta"}
    timestep = torch.empty(rows, dtype=torch.float32, **meta)
    if family == "sd3":
        return {
            "hidden_states": torch.empty(rows, c, h, w, dtype=dtype, **meta),
            "timestep": timestep,
            "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
            "pooled_projections": torch.empty(rows, config["pooled_projection_dim"], dtype=dtype, **meta),
        }
    if family == "flux":
        tokens = shapes.image_tokens + shapes.source_tokens
        out = {
            "hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
            "timestep": timestep,
            "pooled_projections": torch.empty(rows, config["pooled_projection_dim"], dtype=dtype, **meta),
            "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
            "txt_ids": torch.empty(L, 3, dtype=dtype, **meta),
            "img_ids": torch.empty(tokens, 3, dtype=dtype, **meta),
        }
        if config.get("guidance_embeds"):
            out["guidance"] = torch.empty(rows, dtype=torch.float32, **meta)
        return out
    if family == "sana":
        return {
            "hidden_states": torch.empty(rows, c, h, w, dtype=dtype, **meta),
            "encoder_hidden_states": torch.empty(rows, L, config["caption_channels"], dtype=dtype, **meta),
            "encoder_attention_mask": torch.ones(rows, L, dtype=torch.long, **meta),
            "timestep": timestep,
        }
    if family == "qwen_image":
        tokens = shapes.image_tokens + shapes.source_tokens
        return {
            "hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
            "timestep": timestep,
            "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
            "encoder_hidden_states_mask": torch.ones(rows, L, dtype=torch.long, **meta),
            "img_shapes": [[(1, h // 2, w // 2)] * (1 + shapes.source_tokens // shapes.image_tokens)] * rows,
        }
    if family == "qwen_image21":
        img_mask = torch.zeros(rows, L + shapes.image_tokens // 4, dtype=torch.bool)  # a slot per 2×2 latent tokens
        img_mask[:, L:] = True  # the target image's slots after the text
        return {
            "hidden_states": torch.empty(rows, shapes.image_tokens, config["in_channels"], dtype=dtype, **meta),
            "timestep": timestep,
            "encoder_hidden_states": torch.empty(rows, L, config["context_in_dim"], dtype=dtype, **meta),
            "img_shapes": [[(1, h, w)]] * rows,
            "img_mask": img_mask,
        }
    if family == "flux2":
        tokens = shapes.image_tokens
        out = {
            "hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
            "timestep": timestep,
            "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
            "txt_ids": torch.zeros(1, L, 4, dtype=torch.long, **meta),
            "img_ids": torch.zeros(1, tokens, 4, dtype=torch.long, **meta),
        }
        if config.get("guidance_embeds"):
            out["guidance"] = torch.empty(rows, dtype=torch.float32, **meta)
        return out
    if family == "wan":
        return {
            "hidden_states": torch.empty(rows, *shapes.latent, dtype=dtype, **meta),
            "timestep": timestep,
            "encoder_hidden_states": torch.empty(rows, L, config["text_dim"], dtype=dtype, **meta),
        }
    # ltx2: a token per latent cell; the video stream alone, one zero audio token as stand-in (flowrl/models/ltx2.py)
    if family == "ltx2":
        audio_text = (
            config["caption_channels"]
            if config.get("use_prompt_embeddings", True)
            else config["audio_cross_attention_dim"]
        )
        return {
            "hidden_states": torch.empty(rows, shapes.image_tokens, config["in_channels"], dtype=dtype, **meta),
            "audio_hidden_states": torch.zeros(rows, 1, config["audio_in_channels"], dtype=dtype, **meta),
            "encoder_hidden_states": torch.empty(rows, L, config["caption_channels"], dtype=dtype, **meta),
            "audio_encoder_hidden_states": torch.zeros(rows, 1, audio_text, dtype=dtype, **meta),
            "encoder_attention_mask": torch.ones(rows, L, dtype=torch.long, **meta),
            "timestep": timestep,
            "sigma": timestep,
            "num_frames": shapes.latent[1],
            "height": h,
            "width": w,
            "audio_num_frames": 1,
            "isolate_modalities": True,
        }
    if family == "zimage":  # a list of [C, 1, h, w] latents and of [L, D] caption features, one per row
        return {
            "x": [torch.empty(config["in_channels"], 1, h, w, dtype=dtype, **meta)] * rows,
            "t": timestep,
            "cap_feats": [torch.empty(L, config["cap_feat_dim"], dtype=dtype, **meta)] * rows,
        }
    if family == "hunyuan_image":
        return {
            "hidden_states": torch.empty(rows, *shapes.latent, dtype=dtype, **meta),
            "timestep": timestep,
            "encoder_hidden_states": torch.empty(rows, L, config["text_embed_dim"], dtype=dtype, **meta),
            "encoder_attention_mask": torch.ones(rows, L, dtype=torch.long, **meta),
        }
    raise ConfigError(
        f"no estimate for model family {family!r}; supported: sd3, shapes, flux, sana, qwen_image, "
        "qwen_image21, flux2, wan, ltx2, zimage, hunyuan_image"
    )


def velocity(module: nn.Module, arch: dict, shapes: Shapes, states: int, cfg: bool, dtype: torch.dtype) -> torch.Tensor:
    """v [states, *latent] fp32 of one adapter ``velocity`` call: latents fp32 → model dtype, CFG rows
    ``[uncond; cond]`` in one forward, output back to fp32, guidance combined in fp32 (FLUX / Qwen-Image: 2×2
    packing; FLUX.2, Qwen-Image 2.1: a token per latent cell; Wan: the 5-D video latent as is; an edit model: the
    sources' cached tokens appended, the output cut back to the generated tokens; Qwen-Image 2.1: the output's last
    tokens, after the text's)."""
    rows = states * (2 if cfg else 1)
    family = base_family(arch["family"])
    x = torch.empty(states, *shapes.latent, dtype=torch.float32, device="meta")
    inputs = transformer_inputs(arch, shapes, rows, dtype)
    hidden = x.to(dtype)
    c, h, w = shapes.latent[0], shapes.latent[-2], shapes.latent[-1]
    if family in PACKED_2X2:
        hidden = hidden.view(states, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(states, -1, 4 * c)
    elif family in ("flux2", "qwen_image21"):
        hidden = hidden.reshape(states, c, h * w).transpose(1, 2)
    elif family == "ltx2":  # [B, C, F, h, w] → a token per latent cell [B, F·h·w, C]
        hidden = hidden.flatten(2).transpose(1, 2)
    if shapes.source_tokens:
        source = torch.empty(states, shapes.source_tokens, hidden.shape[-1], dtype=dtype, device="meta")
        hidden = torch.cat([hidden, source], dim=1)
    hidden = torch.cat([hidden, hidden]) if cfg else hidden
    if family == "zimage":  # one [C, 1, h, w] latent per row in, one per row out
        inputs["x"] = list(hidden.unsqueeze(2).unbind(0))
        out = torch.stack(module(**inputs, return_dict=False)[0]).squeeze(2)
    else:
        inputs["hidden_states"] = hidden
        out = module(**inputs, return_dict=False)[0]
    if shapes.source_tokens:
        out = out[:, : shapes.image_tokens]
    if family == "qwen_image21":  # the joint sequence: the text's tokens, then the image's
        out = out[:, -shapes.image_tokens :]
    if family in PACKED_2X2:
        out = out.view(rows, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(rows, c, h, w)
    elif family in ("flux2", "qwen_image21"):
        out = out.transpose(1, 2).reshape(rows, c, h, w)
    elif family == "ltx2":
        out = out.transpose(1, 2).reshape(rows, *shapes.latent)
    elif out.shape[1] == 2 * shapes.latent[0]:  # learned sigma: the velocity half
        out = out.chunk(2, dim=1)[0]
    v = out.float()
    if cfg:
        v_u, v_c = v.chunk(2)
        v = v_u + 4.5 * (v_c - v_u)
    return v


def decode_latents(vae: nn.Module, arch: dict, latents: torch.Tensor) -> torch.Tensor:
    """The adapter's VAE decode of ``latents`` [B, *latent] (model dtype): Qwen-Image (and 2.1) one frame of its video
    VAE (``[B, C, 1, h, w]``), FLUX.2 its 2×2 patches unpatchified to the VAE's [B, C/4, 2h, 2w] first, Wan the whole
    video ``[B, C, F, h, w]``; the others as is. Returns the decoded pixels (model dtype)."""
    family = base_family(arch["family"])
    channels = arch["vae"].get("latent_channels")
    if (
        channels and family == "wan" and latents.shape[1] > int(channels)
    ):  # Wan I2V: the noise latent, not the condition
        latents = latents[:, : int(channels)]
    if family in ("qwen_image", "qwen_image21"):
        return vae.decode(latents.unsqueeze(2), return_dict=False)[0][:, :, 0]
    if family == "flux2":
        b, c, h, w = latents.shape
        latents = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, 2 * h, 2 * w)
    return vae.decode(latents, return_dict=False)[0]
