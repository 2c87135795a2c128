"""`FlowModel` adapter for ``LTX2Pipeline`` (LTX-2 text-to-video), video only: the audio branch is off.

LTX-2 is one transformer with two streams, video and audio, joined in every block by audio→video and video→audio
cross-attention; ``LTX2Pipeline`` always samples both. flowrl trains and samples the video alone: the transformer
runs with ``isolate_modalities=True`` (both cross-modal attentions skipped in every block, as the pipeline's own
modality-isolation guidance pass runs it), so the video stream never reads the audio stream. The transformer still
needs audio inputs: a stand-in of one zero audio token and one zero audio text token (its output discarded; the video
output does not depend on it). Asking for audio (``audio=True``, any ``audio_*`` keyword) is refused by name.

Conventions, as ``LTX2Pipeline.__call__`` applies them:

- latents are videos: the adapter takes and returns ``[B, C, F, h, w]`` (C = the transformer's ``in_channels``, 128;
  F = (``num_frames`` − 1) / t + 1 latent frames with the VAE's temporal factor t = 8, the first frame alone in the
  first latent frame; h, w = height, width / 32), in the normalised latent space the pipeline denoises in (the VAE's
  per-channel ``latents_mean`` / ``latents_std`` buffers applied). :meth:`FlowModel.noise` draws that shape from each
  seed (the pipeline's ``prepare_latents`` with the same generator draws the same numbers first, then the audio
  noise). The transformer sees them packed: a token per (``patch_size_t``, ``patch_size``²) patch, (1, 1, 1) for
  LTX-2 (the pipeline's ``_pack_latents`` / ``_unpack_latents``).
- text: the pipeline's own ``encode_prompt`` (Gemma 3: every layer's hidden states stacked, left-padded to
  ``max_sequence_length``, 1024 in the pipeline's call) and its ``connectors`` (a normalisation, a projection and the
  video connector, whose learnable registers replace the padding), one prompt at a time; cached: the video connector's
  embedding and mask. ``max_sequence_length`` must be a multiple of the connector's registers (128).
- transformer timestep = σ · ``num_train_timesteps`` (1000), given as ``timestep`` and ``sigma`` (LTX-2.3's prompt
  modulation reads it); RoPE positions from (F, h, w) and ``frame_rate`` (the pipeline's 24 fps).
- CFG: ``guidance`` is the pipeline's ``guidance_scale`` (3.0) against ``negative_prompt`` (``""``); ``guidance`` ≠ 1
  runs ``[uncond; cond]`` in one forward and returns ``v_u + g·(v_c − v_u)``, which is the pipeline's x0-space
  combination rewritten in velocities (x0 = x − σv is affine in v). The pipeline's other guidance terms are not
  applied: spatio-temporal guidance (``stg_scale``), modality-isolation guidance (``modality_scale``, which needs the
  joint audio-video pass) and ``guidance_rescale``; flowrl's samples are the pipeline's with those off.
- schedule: ``linspace(1, 1/steps, steps)`` shifted by the scheduler's dynamic shift with ``mu`` from the video token
  count (base 0.95 at 1024 tokens, max 2.05 at 4096, as the pipeline's ``calculate_shift`` call), stretched to the
  scheduler's ``shift_terminal``, then 0.
- decode: the latent statistics undone (``latents · std / scaling_factor + mean``), the video VAE (at decode timestep
  0 when it is timestep-conditioned, the pipeline's default), [-1, 1] → [0, 1]: ``[B, num_frames, 3, H, W]``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from flowrl.models.base import Conditioning
from flowrl.models.estimate_spec import EstimateSpec, Shapes
from flowrl.models.wan import WanFlowModel

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

LTX2_LORA_TARGETS = [
    f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v", "to_out.0")
] + ["ff.net.0.proj", "ff.net.2"]
"""The video stream's self-attention (attn1), text cross-attention (attn2) and feed-forward in every block. peft
matches a target after a dot, so ``attn1.to_q`` does not reach ``audio_attn1.to_q``: the audio stream and the
cross-modal attentions get no LoRA."""

AUDIO_REFUSED = (
    "flowrl trains LTX-2 video only: its audio branch is off (the transformer runs with isolate_modalities=True "
    "and the audio output is discarded)"
)


def refuse_audio(key: str, value) -> None:
    """Raise for a keyword that would turn the audio branch on, naming it."""
    raise ValueError(f"{key}={value!r}: {AUDIO_REFUSED}; accepted: leave {key} unset (audio=False)")


class LTX2FlowModel(WanFlowModel):
    """Adapter over an ``LTX2Pipeline``, video only (module docstring).

    Args (``pipe``, ``device``, ``dtype``, ``gradient_checkpointing``: as for every adapter, see
    :meth:`FlowModel._init_pipeline`):
        guidance: CFG scale (the pipeline's ``guidance_scale``, 3.0); 1.0 = no CFG, no uncond forward.
        height, width: frame size in pixels; None → the pipeline's 512 × 768. Multiples of 32 (the pipeline's rule;
            the VAE's spatial factor × the transformer's patch).
        num_frames: video frames (the pipeline's 121); ``num_frames`` − 1 must be a multiple of the VAE's temporal
            factor (8): 1, 9, 17, …, 121.
        max_sequence_length: Gemma tokens (the pipeline's 1024); a multiple of the connectors' learnable registers.
        frame_rate: frames per second the RoPE positions are built for (the pipeline's ``frame_rate``, 24).
        audio: must stay False (the audio branch is off; True is refused, as is any ``audio_*`` keyword).
    """

    family = "ltx2"
    pipeline_class = "LTX2Pipeline"
    default_lora_targets = LTX2_LORA_TARGETS
    frozen = ("text_encoder", "connectors", "vae", "audio_vae", "vocoder")
    shift_defaults = {"base_image_seq_len": 1024, "max_image_seq_len": 4096, "base_shift": 0.95, "max_shift": 2.05}

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 3.0,
        num_frames: int = 121,
        max_sequence_length: int = 1024,
        frame_rate: float = 24.0,
        audio: bool = False,
        **options: Unpack[AdapterOptions],
    ):
        if audio is not False:
            refuse_audio("audio (model.kwargs.audio)", audio)
        for key in [k for k in options if k.startswith("audio")]:
            refuse_audio(f"{key} (model.kwargs.{key})", options[key])
        temporal = pipe.vae_temporal_compression_ratio
        frames = int(num_frames) if not isinstance(num_frames, bool) else 0
        if frames != num_frames or frames < 1 or (frames - 1) % temporal:
            raise ValueError(
                f"num_frames (model.kwargs.num_frames) must be {temporal}·k + 1 — 1, {temporal + 1}, "
                f"{2 * temporal + 1}, …, 121 — as the VAE compresses {temporal} frames into each latent frame "
                f"after the first; got {num_frames!r}"
            )
        registers = pipe.connectors.video_connector.num_learnable_registers or 1
        if int(max_sequence_length) < 1 or int(max_sequence_length) % registers:
            raise ValueError(
                f"max_sequence_length (model.max_sequence_length) must be a positive multiple of {registers} (the "
                f"text connector's learnable registers replace the padding in blocks of {registers}); got "
                f"{max_sequence_length}"
            )
        if not float(frame_rate) > 0:
            raise ValueError(f"frame_rate (model.kwargs.frame_rate) must be > 0 frames per second; got {frame_rate}")
        self.vae_scale_factor_temporal = temporal
        self.num_frames = frames
        self.frame_rate = float(frame_rate)
        options = {**options, "height": options.get("height") or 512, "width": options.get("width") or 768}
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _latent_scale(self, pipe) -> int:
        """Pixels per latent cell: the VAE's spatial compression (32 for LTX-2)."""
        return pipe.vae_spatial_compression_ratio

    def _size_rule(self) -> tuple[int, int, str]:
        """512 × 768 by default (set in ``__init__``); multiples of 32 (``LTX2Pipeline.check_inputs``) and of whole
        patches."""
        _, patch_h, _ = self.patch_size
        return 0, math.lcm(32, self.vae_scale_factor * patch_h), "32 and the VAE's spatial factor × the patch size"

    @property
    def patch_size(self) -> tuple[int, int, int]:
        """The transformer's (frames, height, width) patch: (1, 1, 1) for LTX-2."""
        config = self.pipe.transformer.config
        return (config.patch_size_t, config.patch_size, config.patch_size)

    @property
    def text_encoders(self) -> list:
        """Gemma and the text connectors: both only encode prompts (offloaded together)."""
        return [*super().text_encoders, self.pipe.connectors]

    def _schedule_sigmas(self, steps: int):
        """``linspace(1, 1/steps, steps)``, as the pipeline's call passes them before the shift."""
        return np.linspace(1.0, 1 / steps, steps)

    def _vae_scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scaling_factor / latents_std, latents_mean), each [1, C, 1, 1, 1]: the VAE's statistic buffers."""
        vae = self.pipe.vae
        view = (1, -1, 1, 1, 1)
        return vae.config.scaling_factor / vae.latents_std.view(view), vae.latents_mean.view(view)

    def decode_video(self, x0: torch.Tensor) -> torch.Tensor:
        """Videos [B, num_frames, 3, H, W] fp32 in [0, 1] from latents [B, C, F, h, w], with the pipeline's own
        arithmetic: its ``_denormalize_latents``, the VAE's decode (decode timestep 0 if it is
        timestep-conditioned), [-1, 1] → [0, 1], frames before channels (``output_type="pt"``)."""
        vae = self.pipe.vae
        latents = self.pipe._denormalize_latents(
            x0.to(self.device), vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        ).to(vae.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(len(latents), device=self.device, dtype=latents.dtype)
        video = vae.decode(latents, timestep, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2)

    # ---- contract ------------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] (the video connector's output; L = ``max_sequence_length``, D = the
        transformer's ``caption_channels`` for LTX-2.0) and ``prompt_attention_mask`` [1, L] (the connector's)."""
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(
            [prompt],
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        video, _, video_mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
        return {"prompt_embeds": video, "prompt_attention_mask": video_mask}

    def _audio_stand_in(self, rows: int) -> dict:
        """The audio inputs the transformer requires, video-only: one zero audio token [rows, 1, audio_in] and one
        zero audio text token [rows, 1, D] (D: the audio caption projection's input, or the audio cross-attention
        width when the connectors project per modality). Cross-modal attention is off: the video ignores them."""
        config = self.pipe.transformer.config
        width = config.caption_channels if config.use_prompt_embeddings else config.audio_cross_attention_dim
        zeros = lambda *shape: torch.zeros(*shape, device=self.device, dtype=self.dtype)
        return {
            "audio_hidden_states": zeros(rows, 1, config.audio_in_channels),
            "audio_encoder_hidden_states": zeros(rows, 1, width),
            "audio_num_frames": 1,
            "isolate_modalities": True,
        }

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, F, h, w]) of latents ``x`` [B, C, F, h, w] at ``sigma`` ([B] or a
        scalar), the video stream alone. guidance g (None → ``self.guidance``): g ≠ 1 runs ``[uncond; cond]`` in one
        transformer call and returns ``v_u + g·(v_c − v_u)``; g = 1 the conditional velocity."""
        g, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond) * self.pipe.scheduler.config.num_train_timesteps
        rows = (2 if cfg else 1) * x.shape[0]
        text = self._cfg_text(cond, cfg)
        _, frames, h, w = self.latent_shape
        p_t, p, _ = self.patch_size
        hidden = self.pipe._pack_latents(x.to(device=self.device, dtype=self.dtype), p, p_t)
        timestep = timestep.repeat(2 if cfg else 1)
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=hidden.repeat(2, 1, 1) if cfg else hidden,
                encoder_hidden_states=text["prompt_embeds"].to(device=self.device, dtype=self.dtype),
                encoder_attention_mask=text["prompt_attention_mask"].to(self.device),
                timestep=timestep,
                sigma=timestep,
                num_frames=frames // p_t,
                height=h // p,
                width=w // p,
                fps=self.frame_rate,
                **self._audio_stand_in(rows),
                return_dict=False,
            )[0]
        out = self.pipe._unpack_latents(out.float(), frames // p_t, h // p, w // p, p, p_t)
        return self._cfg_combine(out, g) if cfg else out


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: a token per latent cell; the video stream alone, one zero audio token as
    stand-in."""
    h, w = shapes.latent[-2], shapes.latent[-1]
    L, meta = shapes.text_tokens, {"device": "meta"}
    timestep = torch.empty(rows, dtype=torch.float32, **meta)
    audio_text = (
        config["caption_channels"] if config.get("use_prompt_embeddings", True) else config["audio_cross_attention_dim"]
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


def vae_factors(config: dict) -> dict:
    """The VAE's spatial and temporal factors from its ``config.json``: its compression ratios, or where a ratio is
    null (a config that leaves it to the model) the value the VAE derives: its patch size (4; in time 1) × 2 per
    scaling stage (``spatio_temporal_scaling``, four by default)."""
    scaling = config.get("spatio_temporal_scaling", (True,) * 4)
    if isinstance(scaling, bool):  # one flag for every down block but the last, as the VAE reads it
        scaling = (scaling,) * (len(config.get("layers_per_block", (4, 6, 6, 2, 2))) - 1)
    stages = 2 ** sum(bool(s) for s in scaling)
    return {
        "scale_factor": int(config.get("spatial_compression_ratio") or config.get("patch_size", 4) * stages),
        "temporal_factor": int(config.get("temporal_compression_ratio") or config.get("patch_size_t", 1) * stages),
    }


LTX2FlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs,
    to_tokens=lambda hidden, shapes: hidden.flatten(2).transpose(1, 2),  # [B, C, F, h, w] → a token per cell
    from_tokens=lambda out, shapes: out.transpose(1, 2).reshape(out.shape[0], *shapes.latent),
    video=True,
    masked_text=True,
    text_limit=1024,
    folder_vae=lambda config: vae_factors(config),
    pipeline_vae=lambda pipe: {"temporal_factor": int(pipe.vae_temporal_compression_ratio)},
)
