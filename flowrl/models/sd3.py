"""`FlowModel` adapter for ``StableDiffusion3Pipeline``: SD3, SD3.5 and the embedded "shapes" model.

Conventions, as ``StableDiffusion3Pipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt`` (two CLIP encoders + T5, or zeros in T5's place when
  the pipeline has no ``text_encoder_3``); ``prompt_embeds`` [B, L, D] with L = CLIP
  ``model_max_length`` + ``max_sequence_length``, ``pooled`` [B, D_pool].
- transformer timestep = σ · ``num_train_timesteps`` (= σ·1000), fp32.
- CFG: ``[uncond; cond]`` in one forward, ``v_u + g·(v_c − v_u)`` (composed in fp32 here).
- schedule: the scheduler's own ``set_timesteps(steps)`` with its static ``shift`` (or ``mu`` from the
  image sequence length (H/fp)(W/fp), p = ``patch_size``, when the scheduler uses dynamic shifting),
  final 0 appended by the scheduler (:meth:`FlowModel.schedule`).
- latents: ``[B, C, H/f, W/f]`` (f = ``vae_scale_factor``); decode undoes ``scaling_factor`` and
  ``shift_factor`` (:meth:`FlowModel.decode`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.estimate_spec import EstimateSpec, Shapes

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

SD3_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
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
    pipeline_class = "StableDiffusion3Pipeline"
    frozen = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")
    default_lora_targets = SD3_LORA_TARGETS
    shift_defaults = {**FlowModel.shift_defaults, "max_shift": 1.16}  # StableDiffusion3Pipeline's fallback

    def __init__(
        self, pipe, *, guidance: float = 1.0, max_sequence_length: int = 16, **options: Unpack[AdapterOptions]
    ):
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, pipeline_kwargs: dict | None = None, **kw
    ) -> "SD3FlowModel":
        """Load a ``StableDiffusion3Pipeline`` (hub id or local folder) in ``dtype`` and wrap it.

        A pipeline saved without T5 (``text_encoder_3`` null in ``model_index.json``) is loaded with
        ``text_encoder_3=None, tokenizer_3=None``. ``pipeline_kwargs`` go to ``from_pretrained``; the
        remaining keywords to the adapter.
        """
        from diffusers import DiffusionPipeline

        pipeline_kwargs = dict(pipeline_kwargs or {})
        index = DiffusionPipeline.load_config(str(path))
        for name in ("text_encoder_3", "tokenizer_3"):
            entry = index.get(name)
            if name not in pipeline_kwargs and (entry is None or entry == [None, None]):
                pipeline_kwargs[name] = None
        return super().from_pretrained(path, dtype=dtype, pipeline_kwargs=pipeline_kwargs, **kw)

    # ---- contract (schedule, decode, trainable, latent_shape: FlowModel's defaults) -------
    def largest_side(self) -> int | None:
        """SD3's learned position table covers ``pos_embed_max_size`` patches a side (None in the config: resized
        to any size)."""
        config = self.pipe.transformer.config
        cells = getattr(config, "pos_embed_max_size", None)
        return None if cells is None else int(cells) * int(config.patch_size) * self.vae_scale_factor

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
        """:meth:`FlowModel.velocity` [B, C, H, W] fp32: SD3's transformer takes σ·1000; with guidance g ≠ 1 the rows
        ``[uncond; cond]`` run in one call and give ``v_u + g·(v_c − v_u)``."""
        g, cfg = self._cfg_of(cond, guidance)
        sigma = self._check_inputs(x, sigma, cond)
        timestep = sigma * self.pipe.scheduler.config.num_train_timesteps
        text = self._cfg_text(cond, cfg)

        hidden = x.to(device=self.device, dtype=self.dtype)
        if cfg:
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])

        with self.autocast_context():
            out = self.forward_module(
                hidden_states=hidden,
                timestep=timestep,
                encoder_hidden_states=text["prompt_embeds"].to(device=self.device, dtype=self.dtype),
                pooled_projections=text["pooled"].to(device=self.device, dtype=self.dtype),
                return_dict=False,
            )[0]
        out = out.float()
        return self._cfg_combine(out, g) if cfg else out


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, C, h, w], ``timestep`` [B] fp32,
    ``encoder_hidden_states`` [B, L, joint_dim], ``pooled_projections`` [B, pooled_dim]."""
    c, h, w = shapes.latent
    meta = {"device": "meta"}
    return {
        "hidden_states": torch.empty(rows, c, h, w, dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "encoder_hidden_states": torch.empty(
            rows, shapes.text_tokens, config["joint_attention_dim"], dtype=dtype, **meta
        ),
        "pooled_projections": torch.empty(rows, config["pooled_projection_dim"], dtype=dtype, **meta),
    }


SD3FlowModel.estimate_spec = EstimateSpec(inputs=estimate_inputs, clip_tokens=True)
