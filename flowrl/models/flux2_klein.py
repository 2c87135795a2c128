"""`FlowModel` adapter for ``Flux2KleinPipeline`` (FLUX.2 [klein] 4B / 9B, step-distilled, and their Base models).

Everything is :class:`~flowrl.models.flux2.Flux2FlowModel`'s (the FLUX.2 transformer, the VAE's patchified and
batch-normalised latent space and its noise, one token per latent cell, σ as the timestep, FLUX.2's empirical ``mu``
of the image tokens and the steps, decode); what klein changes, as ``Flux2KleinPipeline.__call__`` applies it:

- text: ``encode_prompt`` through Qwen3 (4B for klein 4B, 8B for 9B) instead of Mistral: the prompt as one user turn
  of Qwen3's chat template with the generation prompt and thinking off, padded (and truncated) to
  ``max_sequence_length`` tokens, the hidden states of layers ``text_encoder_out_layers`` (9, 18, 27) concatenated
  per token → ``prompt_embeds`` [1, L, 3D]; no mask reaches the transformer, as in FLUX.2.
- guidance: klein's transformers have no guidance embedding (the pipeline passes ``guidance=None``). The distilled
  models (the pipeline's ``is_distilled``, FLUX.2-klein-4B / -9B: 4 steps) sample without guidance: ``guidance`` is
  1.0 and another value is refused (the pipeline ignores it with a warning). The Base models (``is_distilled``
  false) use true CFG against the empty prompt: ``guidance`` ≠ 1 runs ``[uncond; cond]`` in one forward and returns
  ``v_u + g·(v_c − v_u)`` (the pipeline's ``guidance_scale``, 4.0; it runs the two branches as two calls, and only
  for ``guidance_scale > 1``). ``negative_prompt`` replaces the empty prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.base import Conditioning
from flowrl.models.estimate_spec import EstimateSpec
from flowrl.models.flux2 import Flux2FlowModel

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions


class Flux2KleinFlowModel(Flux2FlowModel):
    """Adapter over a ``Flux2KleinPipeline``.

    Args:
        pipe, device, dtype, height, width, gradient_checkpointing: as :class:`Flux2FlowModel`'s.
        guidance: None → the model's default: 1.0 for a step-distilled model (no CFG; another value is refused),
            4.0 (the pipeline's ``guidance_scale``) for a Base model, whose CFG it scales.
        max_sequence_length: Qwen3 tokens, chat template included (the pipeline's 512); every prompt is padded to it.
        text_encoder_out_layers: the text encoder's hidden states concatenated per token (the pipeline's (9, 18, 27)).
        negative_prompt: CFG's unconditional prompt (a Base model; the pipeline's is the empty prompt).
    """

    family = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"

    def __init__(
        self,
        pipe,
        *,
        guidance: float | None = None,
        max_sequence_length: int = 512,
        text_encoder_out_layers=(9, 18, 27),
        **options: Unpack[AdapterOptions],
    ):
        self.is_distilled = bool(pipe.config.get("is_distilled", False))
        if guidance is None:
            guidance = 1.0 if self.is_distilled else 4.0
        if self.is_distilled and float(guidance) != 1.0:
            raise ValueError(
                f"model.guidance={guidance}: this FLUX.2 klein model is step-distilled (the pipeline's is_distilled) "
                "and samples without guidance; accepted: 1.0 (or unset). CFG is the Base models'"
            )
        negative_prompt = options.pop("negative_prompt", None)
        super().__init__(
            pipe,
            guidance=guidance,
            max_sequence_length=max_sequence_length,
            text_encoder_out_layers=text_encoder_out_layers,
            **options,
        )
        self.negative_prompt = "" if negative_prompt is None else negative_prompt

    def uses_cfg(self, guidance: float | None = None) -> bool:
        """A Base model's true CFG at ``guidance`` ≠ 1 (None → ``self.guidance``); never for a distilled model."""
        return not self.is_distilled and self.guidance_or_default(guidance) != 1.0

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, h, w]) of latents ``x`` [B, C, h, w] at ``sigma`` ([B] or a scalar);
        one transformer call, without a guidance input. A Base model at ``guidance`` ≠ 1 (None → ``self.guidance``)
        runs the rows ``[uncond; cond]`` and returns ``v_u + g·(v_c − v_u)``; a distilled model refuses
        ``guidance`` ≠ 1."""
        if self.is_distilled and self.guidance_or_default(guidance) != 1.0:
            raise ValueError(
                f"guidance {guidance}: this FLUX.2 klein model is step-distilled and samples without guidance; "
                "accepted: 1.0"
            )
        g, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond)  # the transformer takes σ (it multiplies by 1000)
        latents = x.to(device=self.device, dtype=self.dtype)
        text = self._cfg_text(cond, cfg)["prompt_embeds"].to(device=self.device, dtype=self.dtype)
        hidden = self.pack(latents)
        if cfg:
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=hidden,
                timestep=timestep,
                guidance=None,
                encoder_hidden_states=text,
                txt_ids=self.pipe._prepare_text_ids(text[:1]).to(self.device),  # the same ids for every row
                img_ids=self.pipe._prepare_latent_ids(latents[:1]).to(self.device),
                return_dict=False,
            )[0]
        v = self.unpack(out.float())
        return self._cfg_combine(v, g) if cfg else v


# the estimate's data (flowrl.models.estimate_spec): FLUX.2's transformer inputs and decode; guidance a CFG scale
# (None → 4.0, a Base model's)
Flux2KleinFlowModel.estimate_spec = EstimateSpec(base="flux2", defaults={"guidance": 4.0})
