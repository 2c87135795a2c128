"""`FlowModel` adapter for ``FluxKontextPipeline`` (FLUX.1 Kontext [dev]): an instruction edits a source image.

A prompt carries its source image: ``"[image: PATH] INSTRUCTION"`` (:mod:`flowrl.models.image_prompts`). Everything
else is :class:`~flowrl.models.flux.FluxFlowModel`'s (the FLUX.1 transformer, T5 + CLIP text, 2×2 packing, σ as the
timestep, the distilled guidance embedding and the optional true CFG, the dynamically shifted schedule, decode); what
the Kontext pipeline adds, as ``FluxKontextPipeline.__call__`` applies it:

- source latents: the source image's VAE latent (the posterior's mode, ``(z − shift_factor)·scaling_factor``, as the
  generated latent), 2×2-packed, ``image_latents`` [1, (h/2)(w/2), 4C] in the prompt's conditioning, appended after
  the noisy latent's tokens in every transformer call. Their position ids are the generated grid's with the first
  axis set to 1 (the generated tokens' is 0); the output is cut back to the generated tokens.
- text: the instruction alone through ``encode_prompt`` (T5 sequence, CLIP pooled vector): the image does not enter
  the text encoders. True CFG's negative prompt edits the same source (its rows carry the same source tokens).
- the schedule's ``mu`` counts the generated tokens only (the pipeline's ``image_seq_len``).
- the source image is resized to the generated image's ``height`` × ``width`` (Lanczos): one source size per run, so
  prompts batch together. (The pipeline picks the generated size from ``max_area`` and the source from Kontext's
  preferred resolutions, ``_auto_resize``; with ``_auto_resize=False`` and ``max_area`` = height·width at the same
  aspect ratio the two agree.)

Everything is cached per prompt string — the instruction with its image path — so each source is encoded once.
"""

from __future__ import annotations

import torch

from flowrl.models.base import Conditioning
from flowrl.models.estimate_spec import EstimateSpec
from flowrl.models.flux import FluxFlowModel
from flowrl.models.image_prompts import FORM, image_prompt, source_pil, split_image_prompt


class FluxKontextFlowModel(FluxFlowModel):
    """Adapter over a ``FluxKontextPipeline``; arguments as :class:`FluxFlowModel`'s (``guidance``: the distilled
    guidance embedding, the pipeline's ``guidance_scale`` 3.5; FLUX.1 Kontext [dev]'s model card samples at 2.5)."""

    family = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    takes_source_image = True

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The negative prompt on each prompt's own source image (the CFG rows edit the same source)."""
        return [image_prompt(self.negative_prompt, self._split(p)[1]) for p in prompts]

    def _split(self, prompt: str) -> tuple[str, str]:
        """(instruction, source image path) of ``prompt``; a prompt without an image is refused."""
        text, path = split_image_prompt(prompt)
        if path is None:
            raise ValueError(
                f"model family {self.family!r} edits an image, and the prompt {prompt!r} carries none; accepted: {FORM}"
            )
        return text, path

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] (T5) and ``pooled`` [1, D_pool] (CLIP) of the instruction, and the packed
        source latent ``image_latents`` [1, (h/2)(w/2), 4C] of its image at ``height`` × ``width``."""
        text, path = self._split(prompt)
        pipe = self.pipe
        pixels = pipe.image_processor.preprocess(source_pil(path, self.height, self.width), self.height, self.width)
        latents = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None)  # [1, C, h, w]
        return {**super()._encode_one(text), "image_latents": self.pack(latents)}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """v ≈ ε − x0 [B, C, H, W] fp32 for latents ``x`` [B, C, H, W] at ``sigma`` [B] or scalar: the latent's
        tokens then the source's, one transformer call, the output cut to the latent's tokens. ``guidance`` (None →
        ``self.guidance``) is the distilled guidance embedding; with ``true_cfg`` ≠ 1 the rows ``[uncond; cond]``
        run in the same call and the result is ``v_u + true_cfg·(v_c − v_u)``."""
        g_embed = self.guidance_or_default(guidance)
        timestep = self._check_inputs(x, sigma, cond)  # FLUX's transformer takes σ (it multiplies by 1000)
        cfg = self.uses_cfg()
        if cfg and cond.uncond is None:
            raise ValueError(f"true_cfg {self.true_cfg} needs the unconditional branch: call encode(prompts)")
        text = self._cfg_text(cond, cfg)
        hidden = self.pack(x.to(device=self.device, dtype=self.dtype))
        if cfg:
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        rows, tokens = hidden.shape[:2]
        source = text["image_latents"].to(device=self.device, dtype=self.dtype)
        _, h, w = self.latent_shape
        ids = self.pipe._prepare_latent_image_ids(rows, h // 2, w // 2, self.device, self.dtype)
        source_ids = ids.clone()
        source_ids[:, 0] = 1  # the source's tokens: first position axis 1 (the generated ones': 0)
        guidance_vec = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance_vec = torch.full([rows], g_embed, device=self.device, dtype=torch.float32)
        prompt_embeds = text["prompt_embeds"]
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=torch.cat([hidden, source], dim=1),
                timestep=timestep,
                guidance=guidance_vec,
                pooled_projections=text["pooled"].to(device=self.device, dtype=self.dtype),
                encoder_hidden_states=prompt_embeds.to(device=self.device, dtype=self.dtype),
                txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=self.device, dtype=self.dtype),
                img_ids=torch.cat([ids, source_ids]),
                return_dict=False,
            )[0]
        v = self.unpack(out[:, :tokens]).float()
        return self._cfg_combine(v, self.true_cfg) if cfg else v


# the estimate's data (flowrl.models.estimate_spec): FLUX.1's transformer, the source's tokens after the generated ones
FluxKontextFlowModel.estimate_spec = EstimateSpec(base="flux", edit=True, guidance="true_cfg")
