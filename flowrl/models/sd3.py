"""`FlowModel` adapter for ``StableDiffusion3Pipeline``: SD3, SD3.5 and the embedded "shapes" model.

Conventions, as ``StableDiffusion3Pipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt`` (two CLIP encoders + T5, or zeros in T5's place when
  the pipeline has no ``text_encoder_3``); ``prompt_embeds`` [B, L, D] with L = CLIP
  ``model_max_length`` + ``max_sequence_length``, ``pooled`` [B, D_pool].
- transformer timestep = σ · ``num_train_timesteps`` (= σ·1000), fp32.
- CFG: ``[uncond; cond]`` in one forward, ``v_u + g·(v_c − v_u)`` (composed in fp32 here).
- schedule: the scheduler's own ``set_timesteps(steps)`` with its static ``shift`` (or ``mu`` from the
  image sequence length when the scheduler uses dynamic shifting), final 0 appended by the scheduler.
- latents: ``[B, C, H/f, W/f]`` (f = ``vae_scale_factor``); decode undoes ``scaling_factor`` and
  ``shift_factor``.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn

from flowrl.models.base import Conditioning, FlowModel

SD3_LORA_TARGETS = [
    "to_q", "to_k", "to_v", "to_out.0",
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
]


class SD3FlowModel(FlowModel):
    """Adapter over a ``StableDiffusion3Pipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoders and VAE frozen, all modules put in eval
            mode; on CPU, unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``).
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
            Text encoders and the VAE keep their dtype.
        guidance: default CFG scale (1.0 = no CFG, the uncond branch is never run).
        height, width: image size in pixels; None → ``transformer.config.sample_size * vae_scale_factor``.
        max_sequence_length: T5 tokens (appended as zeros when the pipeline has no T5).
        negative_prompt: the unconditional prompt of CFG.
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "sd3"
    default_lora_targets = SD3_LORA_TARGETS

    def __init__(
        self,
        pipe,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        guidance: float = 1.0,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int = 16,
        negative_prompt: str = "",
        gradient_checkpointing: bool = False,
    ):
        self._init_pipeline(pipe, device, dtype, ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"),
                            gradient_checkpointing)
        self.guidance = float(guidance)
        self.negative_prompt = negative_prompt
        self.max_sequence_length = int(max_sequence_length)
        self.vae_scale_factor = pipe.vae_scale_factor
        config = pipe.transformer.config
        self._init_size(height, width, config.sample_size * self.vae_scale_factor,
                        self.vae_scale_factor * config.patch_size, "vae_scale_factor × patch_size")

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, pipeline_kwargs: dict | None = None, **kw
    ) -> "SD3FlowModel":
        """Load a ``StableDiffusion3Pipeline`` (hub id or local folder) in ``dtype`` and wrap it.

        A pipeline saved without T5 (``text_encoder_3`` null in ``model_index.json``) is loaded with
        ``text_encoder_3=None, tokenizer_3=None``. ``pipeline_kwargs`` go to ``from_pretrained``; the
        remaining keywords to the adapter.
        """
        from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

        pipeline_kwargs = dict(pipeline_kwargs or {})
        index = DiffusionPipeline.load_config(str(path))
        for name in ("text_encoder_3", "tokenizer_3"):
            entry = index.get(name)
            if name not in pipeline_kwargs and (entry is None or entry == [None, None]):
                pipeline_kwargs[name] = None
        pipe = StableDiffusion3Pipeline.from_pretrained(str(path), dtype=dtype, **pipeline_kwargs)
        return cls(pipe, dtype=dtype, **kw)

    # ---- contract -------------------------------------------------------------------------
    @property
    def trainable(self) -> nn.Module:
        return self.pipe.transformer

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        c = self.pipe.transformer.config.in_channels
        return (c, self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] and ``pooled`` [1, D_pool] from the pipeline's ``encode_prompt``."""
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt],
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled": pooled}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """v ≈ ε − x0 [B, C, H, W] fp32 for latents ``x`` [B, C, H, W] at ``sigma`` [B] or scalar.

        guidance g (None → ``self.guidance``): g ≠ 1 runs ``[uncond; cond]`` in one transformer call
        and returns ``v_u + g·(v_c − v_u)``; g = 1 runs the conditional rows only.
        """
        g = self.guidance if guidance is None else float(guidance)
        batch = x.shape[0]
        if tuple(x.shape[1:]) != self.latent_shape:
            raise ValueError(f"x must be [B, {', '.join(map(str, self.latent_shape))}]; got {list(x.shape)}")
        if len(cond) != batch:
            raise ValueError(f"cond has {len(cond)} rows but x has {batch}")
        sigma = _sigma_vector(sigma, batch, self.device)
        timestep = sigma * self.pipe.scheduler.config.num_train_timesteps

        hidden = x.to(device=self.device, dtype=self.dtype)
        prompt_embeds = cond.cond["prompt_embeds"]
        pooled = cond.cond["pooled"]
        cfg = self.uses_cfg(g)
        if cfg:
            if cond.uncond is None:
                raise ValueError(f"guidance {g} needs the unconditional branch: call encode(prompts, guidance={g})")
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
            prompt_embeds = torch.cat([cond.uncond["prompt_embeds"], prompt_embeds])
            pooled = torch.cat([cond.uncond["pooled"], pooled])

        out = self.forward_module(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=prompt_embeds.to(device=self.device, dtype=self.dtype),
            pooled_projections=pooled.to(device=self.device, dtype=self.dtype),
            return_dict=False,
        )[0].float()

        if cfg:
            v_uncond, v_cond = out.chunk(2)
            return v_uncond + g * (v_cond - v_uncond)
        return out

    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1] fp32 on the CPU, 1 → 0: ``StableDiffusion3Pipeline``'s own schedule.

        Computed on a fresh copy of the pipeline's scheduler (the pipeline's scheduler is not touched).
        """
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        if int(steps) < 1:
            raise ValueError(f"steps must be ≥ 1; got {steps}")
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            patch = self.pipe.transformer.config.patch_size
            _, h, w = self.latent_shape
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(int(steps), device="cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32).clone()

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] fp32 in [0, 1] from clean latents ``x0`` [B, C, h, w] (fp32)."""
        vae = self.pipe.vae
        latents = x0.to(device=self.device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


def _sigma_vector(sigma: torch.Tensor | float, batch: int, device: torch.device) -> torch.Tensor:
    """σ as an fp32 vector [batch] on ``device`` (from a scalar, a 0-d tensor or a [batch] tensor)."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32).to(device)
    if sigma.ndim == 0:
        return sigma.expand(batch)
    if sigma.shape != (batch,):
        raise ValueError(f"sigma must be a scalar or [B={batch}]; got shape {list(sigma.shape)}")
    return sigma
