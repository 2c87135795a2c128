"""`FlowModel` adapter for ``WanPipeline`` (Wan 2.1 text-to-video and fine-tunes with its layout).

Conventions, as ``WanPipeline.__call__`` applies them:

- latents are videos: the adapter takes and returns ``[B, C, F, h, w]`` (C = the transformer's ``in_channels``, 16;
  F = (``num_frames`` − 1) / t + 1 latent frames with the VAE's temporal factor t = 4, the first frame alone in the
  first latent frame; h, w = height, width / 8). :attr:`WanFlowModel.latent_shape` is (C, F, h, w) and
  :meth:`FlowModel.noise` draws that shape from each seed (the pipeline's ``prepare_latents`` with the same
  generator gives the same numbers). ``num_frames`` − 1 must be a multiple of t (checked at construction: the
  pipeline would silently round it).
- text: the pipeline's own ``encode_prompt`` (cleaned prompt, UMT5 last hidden state cut to the prompt's tokens
  and zero-padded to ``max_sequence_length``, 512 as in the pipeline's call), one prompt at a time; the transformer
  attends to the zero rows too, as in the pipeline, so every row has the same length and a prompt's embedding never
  depends on its batch companions.
- transformer timestep = σ · ``num_train_timesteps`` (1000), as a float; with Wan 2.2 TI2V's ``expand_timesteps`` one
  per latent token. ``FlowMatchEulerDiscreteScheduler`` gives the pipeline exactly these timesteps;
  ``UniPCMultistepScheduler`` (Wan 2.1's own) gives them truncated to integers, which the adapter does not copy (its
  velocity is a smooth function of σ, as every SDE kernel of flowrl assumes).
- CFG: ``guidance`` is the pipeline's ``guidance_scale`` (5.0) against ``negative_prompt`` (the pipeline's default
  ``""``); ``guidance`` ≠ 1 runs ``[uncond; cond]`` in one forward and returns ``v_u + g·(v_c − v_u)``, the
  pipeline's combination of its two calls.
- schedule: the pipeline's scheduler's own ``set_timesteps(steps)`` on a fresh copy (:meth:`FlowModel.schedule`):
  UniPC's flow sigmas shifted by ``flow_shift`` (its first σ, nudged to 1 − 1e-6, put back to 1 for the SDE
  kernels), or flow-match Euler's shifted by ``shift``; then 0.
- decode: per-channel ``latents_std`` / ``latents_mean`` of the VAE config undone, the causal video VAE decoded,
  [-1, 1] → [0, 1]; :meth:`WanFlowModel.decode_video` (and :meth:`WanFlowModel.decode`, so a caller gets the video)
  returns ``[B, 4(F − 1) + 1, 3, H, W]``, the layout of the pipeline's ``output_type="pt"``.

Two-stage Wan 2.2 pipelines (``transformer_2`` / ``boundary_ratio``: two transformers, one per noise range) are
refused: training would need both as the trainable module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.qwen_image import QwenImageFlowModel

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

WAN_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",  # self-attention (attn1) and text cross-attention (attn2) of every block
    "add_k_proj",
    "add_v_proj",  # image cross-attention of the I2V transformers (absent from text-to-video ones)
    "ffn.net.0.proj",
    "ffn.net.2",  # feed-forward
]


class WanFlowModel(FlowModel):
    """Adapter over a ``WanPipeline``.

    Args (``pipe``, ``device``, ``dtype``, ``gradient_checkpointing``: as for every adapter, see
    :meth:`FlowModel._init_pipeline`):
        guidance: CFG scale (the pipeline's ``guidance_scale``, 5.0); 1.0 = no CFG, no uncond forward.
        height, width: frame size in pixels; None → the pipeline's 480 × 832. Multiples of the VAE's spatial factor
            × the transformer's patch (16).
        num_frames: video frames (the pipeline's 81); ``num_frames`` − 1 must be a multiple of the VAE's temporal
            factor (4): 1, 5, 9, …, 81.
        max_sequence_length: UMT5 tokens (the pipeline's 512); every prompt is zero-padded to it.
        negative_prompt: the unconditional prompt of CFG (the pipeline's default ``""``).
    """

    modality = "video"

    family = "wan"
    pipeline_class = "WanPipeline"
    default_lora_targets = WAN_LORA_TARGETS
    _vae_scale_shift = QwenImageFlowModel._vae_scale_shift  # (1 / latents_std, latents_mean) [1, C, 1, 1, 1]

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 5.0,
        num_frames: int = 81,
        max_sequence_length: int = 512,
        **options: Unpack[AdapterOptions],
    ):
        if pipe.config.get("boundary_ratio") is not None or getattr(pipe, "transformer_2", None) is not None:
            raise ValueError(
                "WanFlowModel supports one-transformer Wan pipelines only (no transformer_2 / "
                "boundary_ratio: Wan 2.2's two-stage models)"
            )
        temporal = pipe.vae_scale_factor_temporal
        frames = int(num_frames) if not isinstance(num_frames, bool) else 0
        if frames != num_frames or frames < 1 or (frames - 1) % temporal:
            raise ValueError(
                f"num_frames (model.kwargs.num_frames) must be {temporal}·k + 1 — 1, {temporal + 1}, "
                f"{2 * temporal + 1}, …, 81 — as the VAE compresses {temporal} frames into each latent "
                f"frame after the first; got {num_frames!r}"
            )
        if int(max_sequence_length) < 1:
            raise ValueError(f"max_sequence_length must be ≥ 1; got {max_sequence_length}")
        self.vae_scale_factor_temporal = temporal
        self.num_frames = frames
        options = {**options, "height": options.get("height") or 480, "width": options.get("width") or 832}
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _latent_scale(self, pipe) -> int:
        """Pixels per latent cell: the VAE's spatial factor (Wan names its factors per axis)."""
        return pipe.vae_scale_factor_spatial

    def _size_rule(self) -> tuple[int, int, str]:
        """480 × 832 by default (set in ``__init__``); whole spatial patches."""
        _, patch_h, patch_w = self.patch_size
        return (
            0,
            self.vae_scale_factor * max(patch_h, patch_w),
            "the VAE's spatial factor × the transformer's patch size",
        )

    # ---- video latents ---------------------------------------------------------------------------------
    @property
    def patch_size(self) -> tuple[int, int, int]:
        """The transformer's (frames, height, width) patch: (1, 2, 2) for Wan."""
        return tuple(self.pipe.transformer.config.patch_size)

    @property
    def latent_frames(self) -> int:
        """F = (``num_frames`` − 1) / the VAE's temporal factor + 1."""
        return (self.num_frames - 1) // self.vae_scale_factor_temporal + 1

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, h, w) of one latent video (C = the transformer's ``in_channels``; h, w = height, width / 8)."""
        return (
            self.latent_channels,
            self.latent_frames,
            self.height // self.vae_scale_factor,
            self.width // self.vae_scale_factor,
        )

    @property
    def image_seq_len(self) -> int:
        """Video tokens the transformer sees: (F/p_t)·(h/p_h)·(w/p_w)."""
        _, frames, h, w = self.latent_shape
        p_t, p_h, p_w = self.patch_size
        return (frames // p_t) * (h // p_h) * (w // p_w)

    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1] fp32 (CPU), 1 → 0: the pipeline scheduler's own (:meth:`FlowModel.schedule`), with
        UniPC's first σ, 1 − 1e-6 (nudged there only to keep its log-SNR finite), put back to 1: the SDE kernels
        start from σ = 1 (Flow-GRPO's first-step case)."""
        sigmas = super().schedule(steps)
        if 0 < 1 - sigmas[0] < 1e-5:
            sigmas[0] = 1.0
        return sigmas

    def decode_video(self, x0: torch.Tensor) -> torch.Tensor:
        """Videos [B, num_frames, 3, H, W] fp32 in [0, 1] from latents [B, C, F, h, w]: :meth:`FlowModel.decode`
        (latents_std / latents_mean undone, the video VAE, [-1, 1] → [0, 1]) with frames before channels, as the
        pipeline's ``output_type="pt"``."""
        return super().decode(x0).transpose(1, 2)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """The video, [B, num_frames, 3, H, W] (:meth:`decode_video`): a video family decodes to videos; image
        rewards need a frame reduction first (not part of this adapter)."""
        return self.decode_video(x0)

    # ---- contract ------------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D], L = ``max_sequence_length``: the pipeline's UMT5 embedding, zero-padded."""
        embeds, _ = self.pipe.encode_prompt(
            [prompt],
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, F, h, w]) of latents ``x`` [B, C, F, h, w] at ``sigma`` ([B] or a
        scalar). guidance g (None → ``self.guidance``): g ≠ 1 runs ``[uncond; cond]`` in one transformer call and
        returns ``v_u + g·(v_c − v_u)``; g = 1 the conditional velocity."""
        g, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond) * self.pipe.scheduler.config.num_train_timesteps
        rows = 2 if cfg else 1  # [uncond; cond] in one forward
        text = self._cfg_text(cond, cfg)["prompt_embeds"].to(device=self.device, dtype=self.dtype)
        timestep = timestep.repeat(rows)
        if self.pipe.config.get("expand_timesteps", False):  # Wan 2.2 TI2V: one timestep per latent token
            timestep = timestep[:, None].expand(-1, self.image_seq_len)
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=x.to(device=self.device, dtype=self.dtype).repeat(rows, 1, 1, 1, 1),
                timestep=timestep,
                encoder_hidden_states=text,
                return_dict=False,
            )[0]
        out = out.float()
        return self._cfg_combine(out, g) if cfg else out
