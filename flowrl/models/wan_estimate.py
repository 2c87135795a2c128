"""The estimate's data of the Wan family (:mod:`flowrl.models.estimate_spec`), for
:class:`flowrl.models.wan.WanFlowModel` to name as its ``estimate_spec`` (until it does,
:data:`flowrl.models.estimate_spec.PENDING` points to it)."""

from __future__ import annotations

import torch

from flowrl.models.estimate_spec import EstimateSpec, Shapes


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, C, F, h, w], ``timestep`` [B] fp32,
    ``encoder_hidden_states`` [B, L, text_dim]."""
    meta = {"device": "meta"}
    return {
        "hidden_states": torch.empty(rows, *shapes.latent, dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "encoder_hidden_states": torch.empty(rows, shapes.text_tokens, config["text_dim"], dtype=dtype, **meta),
    }


def estimate_decode(vae, arch: dict, latents: torch.Tensor) -> torch.Tensor:
    """The whole video [B, C, F, h, w] decoded (Wan I2V: the noise latent, not the first frame's condition)."""
    channels = arch["vae"].get("latent_channels")
    if channels and latents.shape[1] > int(channels):
        latents = latents[:, : int(channels)]
    return vae.decode(latents, return_dict=False)[0]


def folder_vae(config: dict) -> dict:
    """The video VAE's temporal factor: one ×2 per ``temperal_downsample`` stage that downsamples."""
    downsample = config.get("temperal_downsample")
    return {} if downsample is None else {"temporal_factor": 2 ** sum(bool(d) for d in downsample)}


WAN_ESTIMATE = EstimateSpec(
    inputs=estimate_inputs,
    decode=estimate_decode,
    video=True,
    folder_vae=folder_vae,
    pipeline_vae=lambda pipe: {"temporal_factor": int(pipe.vae_scale_factor_temporal)},
)
"""Wan's estimate data: the 5-D video latent as is, a token per patch_size cells per frame."""
