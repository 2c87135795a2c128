"""`FlowModel` adapter for ``SanaPipeline`` (SANA 600M/1600M and fine-tunes; one of Sol-RL's models).

Conventions, as ``SanaPipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt`` (Gemma-2 last hidden state): ``prompt_embeds`` [B, L, D]
  and ``prompt_attention_mask`` [B, L] (L = ``max_sequence_length``), passed to the transformer as
  ``encoder_attention_mask``. ``complex_human_instruction`` (SANA's prompt-enhancing preamble, a list
  of lines) is prepended to the conditional prompts only, as the pipeline does; default None (the
  pipeline's default is a long preamble; pass ``SanaPipeline``'s own to reproduce its images). The
  negative prompt is encoded without it, as the pipeline encodes it (cached apart).
- latents: ``[B, C, H/f, W/f]`` with f = ``vae_scale_factor`` (DC-AE: 32 for SANA, 2^(blocks−1));
  decode divides by ``scaling_factor`` (DC-AE has no shift; :meth:`FlowModel.decode`).
- transformer timestep = σ · ``num_train_timesteps`` · ``timestep_scale`` (SANA: σ·1000·1).
- CFG: ``[uncond; cond]`` in one forward, ``v_u + g·(v_c − v_u)`` in fp32; a transformer with learned
  sigma (``out_channels`` = 2·``in_channels``) returns its first half, as the pipeline does.
- schedule: SANA ships ``DPMSolverMultistepScheduler`` with flow sigmas, whose grid starts at
  shift(0.999) < 1; the SDE kernels need σ_0 = 1, so the adapter takes the same shifted flow grid from 1:
  σ_i = s·t_i / (1 + (s − 1)·t_i), t = linspace(1, 0, steps + 1), s = ``flow_shift``. With a
  ``FlowMatchEulerDiscreteScheduler`` in the pipeline its own schedule is used (:meth:`FlowModel.schedule`).
- resolution binning is a ``__call__`` option only (it resizes after decoding); the adapter samples
  at exactly ``height`` × ``width`` (multiples of 32 as the pipeline requires, and of f·patch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.estimate_spec import EstimateSpec, Shapes

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

SANA_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # self- and cross-attention projections
_NEGATIVE = "negative"  # cache key prefix of the negative prompt (encoded without the instruction)


class SanaFlowModel(FlowModel):
    """Adapter over a ``SanaPipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoder and VAE frozen, all modules in eval mode;
            on CPU, unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``).
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
        guidance: default CFG scale (SANA: 4.5; 1.0 = no CFG, the uncond branch is never run).
        height, width: image size in pixels; None → ``transformer.config.sample_size * vae_scale_factor``.
        max_sequence_length: Gemma tokens (SANA uses 300).
        negative_prompt: the unconditional prompt of CFG.
        complex_human_instruction: lines prepended to every conditional prompt (None: none).
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "sana"
    pipeline_class = "SanaPipeline"
    default_lora_targets = SANA_LORA_TARGETS

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 4.5,
        max_sequence_length: int = 300,
        complex_human_instruction: Sequence[str] | None = None,
        **options: Unpack[AdapterOptions],
    ):
        self._init_adapter(pipe, guidance, max_sequence_length, **options)
        self.complex_human_instruction = list(complex_human_instruction) if complex_human_instruction else None

    def _size_rule(self) -> tuple[int, int, str]:
        """``sample_size`` latent cells; multiples of lcm(32, vae_scale_factor × patch_size)
        (SanaPipeline.check_inputs)."""
        config = self.pipe.transformer.config
        return (
            config.sample_size * self.vae_scale_factor,
            math.lcm(32, self.vae_scale_factor * config.patch_size),
            "lcm(32, vae_scale_factor × patch_size)",
        )

    # ---- schedule (decode, trainable, latent_shape: FlowModel's defaults) ---------------------
    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1] fp32 from 1 to 0 (module docstring): the pipeline's own schedule for a
        flow-matching Euler scheduler, else SANA's shifted flow grid started at σ = 1."""
        scheduler = self.pipe.scheduler
        if type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler":
            return super().schedule(steps)
        steps = int(steps)
        if steps < 1:
            raise ValueError(f"steps must be ≥ 1; got {steps}")
        shift = float(scheduler.config.get("flow_shift", None) or scheduler.config.get("shift", 1.0))
        t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        return (shift * t / (1 + (shift - 1) * t)).float()

    # ---- contract ----------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] and ``prompt_attention_mask`` [1, L] from ``encode_prompt``."""
        return self._gemma(prompt, self.complex_human_instruction)

    def _gemma(self, prompt: str, instruction: list[str] | None) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.pipe.encode_prompt(
            [prompt],
            do_classifier_free_guidance=False,
            device=self.device,
            clean_caption=False,
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=instruction,
        )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def encode(self, prompts: Sequence[str], guidance: float | None = None) -> Conditioning:
        """As :meth:`FlowModel.encode`; the negative prompt is encoded without the instruction (cached
        under its own key), as ``SanaPipeline.encode_prompt`` encodes it."""
        cond = super().encode(prompts, 1.0).cond  # guidance 1: conditional rows only
        uncond = None
        if self.uses_cfg(guidance):

            def encoded():
                with torch.no_grad():
                    return {k: v.detach().to(self.device) for k, v in self._gemma(self.negative_prompt, None).items()}

            negative = self.prompt_cache.get((_NEGATIVE, self.negative_prompt), encoded)
            uncond = {k: v.expand(len(cond["prompt_embeds"]), *v.shape[1:]) for k, v in negative.items()}
        return Conditioning(cond, uncond)

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """:meth:`FlowModel.velocity` [B, C, H, W] fp32: SANA's transformer takes σ·1000·``timestep_scale`` and the
        text mask; with guidance g ≠ 1 the rows ``[uncond; cond]`` run in one call (``v_u + g·(v_c − v_u)``)."""
        g, cfg = self._cfg_of(cond, guidance)
        config = self.pipe.transformer.config
        timestep = (
            self._check_inputs(x, sigma, cond) * self.pipe.scheduler.config.num_train_timesteps * config.timestep_scale
        )
        rows = 2 if cfg else 1  # [uncond; cond] in one forward
        text = self._cfg_text(cond, cfg)
        hidden = x.to(device=self.device, dtype=self.dtype).repeat(rows, 1, 1, 1)
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=hidden,
                encoder_hidden_states=text["prompt_embeds"].to(device=self.device, dtype=self.dtype),
                encoder_attention_mask=text["prompt_attention_mask"].to(self.device),
                timestep=timestep.repeat(rows),
                return_dict=False,
            )[0]
        out = out.float()
        if config.out_channels // 2 == self.latent_channels:  # learned sigma: keep the velocity half
            out = out.chunk(2, dim=1)[0]
        return self._cfg_combine(out, g) if cfg else out


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, C, h, w], ``encoder_hidden_states``
    [B, L, caption_channels], ``encoder_attention_mask`` [B, L] int64, ``timestep`` [B] fp32."""
    c, h, w = shapes.latent
    L, meta = shapes.text_tokens, {"device": "meta"}
    return {
        "hidden_states": torch.empty(rows, c, h, w, dtype=dtype, **meta),
        "encoder_hidden_states": torch.empty(rows, L, config["caption_channels"], dtype=dtype, **meta),
        "encoder_attention_mask": torch.ones(rows, L, dtype=torch.long, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
    }


SanaFlowModel.estimate_spec = EstimateSpec(inputs=estimate_inputs, size_multiple=32, masked_text=True)
