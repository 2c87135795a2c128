"""`FlowModel` adapter for ``FluxPipeline`` (FLUX.1-dev, FLUX.1-schnell and fine-tunes).

Conventions, as ``FluxPipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt``: CLIP pooled output ``pooled`` [B, D_pool] and the T5
  sequence ``prompt_embeds`` [B, L, D] (L = ``max_sequence_length``); text ids are zeros [L, 3].
- latents: the adapter takes and returns unpacked ``[B, C, H/f, W/f]`` (f = ``vae_scale_factor``);
  ``velocity`` packs 2×2 patches into tokens ``[B, (H/2f)(W/2f), 4C]`` for the transformer and
  unpacks its output. Image ids are the pipeline's ``_prepare_latent_image_ids``.
- transformer timestep = σ (the transformer multiplies by 1000 itself).
- two different "guidances" (as the pipeline's ``guidance_scale`` and ``true_cfg_scale``):
  ``guidance`` is the *distilled guidance embedding* value fed to FLUX.1-dev's guidance input
  (ignored by models without ``guidance_embeds``, e.g. schnell); it costs nothing and does not add
  an unconditional branch. ``true_cfg`` is real classifier-free guidance against the negative
  prompt: ``true_cfg > 1`` runs ``[uncond; cond]`` in one forward and returns
  ``v_u + true_cfg·(v_c − v_u)``. Default ``true_cfg = 1`` (off), as FLUX.1-dev is normally used.
  In ``encode(prompts, guidance)`` / ``velocity(..., guidance)`` the ``guidance`` argument is therefore
  the embedding value; whether the uncond branch exists is decided by ``true_cfg`` (see ``uses_cfg``).
- schedule: ``sigmas = linspace(1, 1/steps, steps)`` shifted by the scheduler with
  ``mu = calculate_shift(image_seq_len, ...)`` (resolution-dependent dynamic shifting), final 0
  (:meth:`FlowModel.schedule` with :meth:`FluxFlowModel._schedule_sigmas`).
- decode undoes ``scaling_factor`` and ``shift_factor`` of the unpacked latents (:meth:`FlowModel.decode`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.estimate_spec import EstimateSpec, Shapes, pack_2x2, packed_latent, unpack_2x2
from flowrl.models.packing import Packed2x2

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

FLUX_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]


class FluxFlowModel(Packed2x2, FlowModel):
    """Adapter over a ``FluxPipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoders and VAE frozen, all modules put in eval
            mode; on CPU, unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``).
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
        guidance: distilled guidance embedding value (FLUX.1-dev: 3.5); unused without ``guidance_embeds``.
        true_cfg: true classifier-free guidance scale; 1.0 = off (no unconditional forward).
        height, width: image size in pixels; None → ``pipe.default_sample_size * vae_scale_factor``
            (1024 for FLUX.1). Must be multiples of ``2 * vae_scale_factor``.
        max_sequence_length: T5 tokens (FLUX.1-dev allows up to 512).
        negative_prompt: the unconditional prompt of true CFG.
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "flux"
    pipeline_class = "FluxPipeline"
    frozen = ("text_encoder", "text_encoder_2", "vae")
    default_lora_targets = FLUX_LORA_TARGETS

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 3.5,
        true_cfg: float = 1.0,
        max_sequence_length: int = 16,
        **options: Unpack[AdapterOptions],
    ):
        if int(max_sequence_length) > 512:
            raise ValueError(f"max_sequence_length must be ≤ 512 for FLUX; got {max_sequence_length}")
        self._init_adapter(pipe, guidance, max_sequence_length, **options)
        self.true_cfg = float(true_cfg)

    def _size_rule(self) -> tuple[int, int, str]:
        """``default_sample_size`` latent cells (1024 px for FLUX.1); whole 2×2 patches."""
        return self.pipe.default_sample_size * self.vae_scale_factor, 2 * self.vae_scale_factor, "2 × vae_scale_factor"

    # ---- hooks: latent_channels, image_seq_len, _schedule_sigmas, pack / unpack from Packed2x2 -------
    def uses_cfg(self, guidance: float | None = None) -> bool:
        """True CFG is on when ``true_cfg`` ≠ 1; ``guidance`` (the embedding value) never adds a branch."""
        return self.true_cfg != 1.0

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] (T5) and ``pooled`` [1, D_pool] (CLIP) from ``encode_prompt``."""
        prompt_embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt],
            prompt_2=None,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled": pooled}

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        cond: Conditioning,
        guidance: float | None = None,
    ) -> torch.Tensor:
        """v ≈ ε − x0 [B, C, H, W] fp32 for latents ``x`` [B, C, H, W] at ``sigma`` [B] or scalar.

        ``guidance`` (None → ``self.guidance``) is the distilled guidance embedding value. With
        ``true_cfg`` ≠ 1 the rows ``[uncond; cond]`` run in one forward and the result is
        ``v_u + true_cfg·(v_c − v_u)``.
        """
        g_embed = self.guidance_or_default(guidance)
        timestep = self._check_inputs(x, sigma, cond)  # FLUX's transformer takes σ (it multiplies by 1000)
        cfg = self.uses_cfg()
        if cfg and cond.uncond is None:
            raise ValueError(f"true_cfg {self.true_cfg} needs the unconditional branch: call encode(prompts)")
        text = self._cfg_text(cond, cfg)
        prompt_embeds = text["prompt_embeds"]

        hidden = self.pack(x.to(device=self.device, dtype=self.dtype))
        if cfg:
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
        rows = hidden.shape[0]

        guidance_vec = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance_vec = torch.full([rows], g_embed, device=self.device, dtype=torch.float32)
        _, h, w = self.latent_shape
        img_ids = self.pipe._prepare_latent_image_ids(rows, h // 2, w // 2, self.device, self.dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=self.device, dtype=self.dtype)

        with self.autocast_context():
            out = self.forward_module(
                hidden_states=hidden,
                timestep=timestep,
                guidance=guidance_vec,
                pooled_projections=text["pooled"].to(device=self.device, dtype=self.dtype),
                encoder_hidden_states=prompt_embeds.to(device=self.device, dtype=self.dtype),
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
        v = self.unpack(out).float()
        return self._cfg_combine(v, self.true_cfg) if cfg else v


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, (h/2)(w/2), 4C] (2×2 packing), ``timestep`` and
    ``guidance`` [B] fp32, ``pooled_projections`` [B, pooled_dim], ``encoder_hidden_states`` [B, L, joint_dim],
    ``txt_ids`` [L, 3], ``img_ids`` [(h/2)(w/2), 3]; an edit model (FLUX.1 Kontext): the source's tokens appended
    ([B, 2(h/2)(w/2), 4C], ``img_ids`` [2(h/2)(w/2), 3])."""
    L, meta = shapes.text_tokens, {"device": "meta"}
    tokens = shapes.image_tokens + shapes.source_tokens
    out = {
        "hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "pooled_projections": torch.empty(rows, config["pooled_projection_dim"], dtype=dtype, **meta),
        "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
        "txt_ids": torch.empty(L, 3, dtype=dtype, **meta),
        "img_ids": torch.empty(tokens, 3, dtype=dtype, **meta),
    }
    if config.get("guidance_embeds"):
        out["guidance"] = torch.empty(rows, dtype=torch.float32, **meta)
    return out


FluxFlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs,
    latent=packed_latent,
    token_patch=2,
    to_tokens=pack_2x2,
    from_tokens=unpack_2x2,
    guidance="true_cfg",
)
