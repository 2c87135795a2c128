"""`FlowModel` adapter for ``ZImagePipeline`` (Z-Image, Z-Image-Turbo and their fine-tunes).

Conventions, as ``ZImagePipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt``: the prompt as a user turn in the Qwen3 chat template (with the
  assistant header; ``enable_thinking=True`` adds no think block), tokenized to ``max_sequence_length`` (padding and
  truncation) through the Qwen3 text encoder, the hidden state before its last layer (``hidden_states[-2]``), of the
  real tokens only: a prompt is a variable-length sequence [n, D]. The adapter caches it zero-padded to
  ``max_sequence_length`` with ``prompt_embeds_mask`` [1, L] and hands the transformer each row's n real tokens, as
  the pipeline does (the transformer pads captions to a multiple of 32 itself, and the image tokens' RoPE positions
  follow the caption: padding it here would change them).
- latents: ``[B, C, H/f, W/f]`` (f = ``vae_scale_factor`` = 8, C = 16), the pipeline's own noise; the transformer
  takes a list of ``[C, 1, H/f, W/f]`` (one frame) and cuts 2×2 patches itself, so no packing here.
- transformer timestep = 1 − σ (the pipeline's ``(1000 − t) / 1000``); its output is −v (the pipeline negates it).
- CFG: ``ZImagePipeline`` combines ``pos + s·(pos − neg)`` with its ``guidance_scale`` s (0 = off). flowrl's
  ``guidance`` g is a CFG scale whose 1.0 is "off" (``loss.cfg: free`` samples at 1), so **g = s + 1**: Z-Image's
  recommended s = 4 is g = 5, Turbo's s = 0 is g = 1 (no unconditional branch, one forward). g ≠ 1 runs
  ``[uncond; cond]`` in one forward and returns ``pos + (g − 1)·(pos − neg)``; ``cfg_normalization`` k > 0 caps each
  row's norm at k·‖pos‖ and ``cfg_truncation`` τ < 1 drops the guidance where 1 − σ > τ, both as the pipeline's
  arguments of those names (defaults: off).
- schedule: the pipeline's ``linspace(1, 1/steps, steps)`` (float32, ``get_default_z_image_sigmas``) shifted by the
  scheduler (Z-Image: static shift 6, Turbo: 3; ``mu`` of the image tokens when it shifts dynamically), then 0.
- decode: ``latent / scaling_factor + shift_factor`` (FLUX.1's VAE), decoded, [-1, 1] → [0, 1].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.estimate_spec import EstimateSpec, Shapes

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

ZIMAGE_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",  # attention of every block: main layers and the noise / context refiners
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",  # their SwiGLU feed-forwards
]


class ZImageFlowModel(FlowModel):
    """Adapter over a ``ZImagePipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoder and VAE frozen, all modules in eval mode; on CPU,
            unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``).
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
        guidance: CFG scale, 1.0 = off: the pipeline's ``guidance_scale`` + 1 (its default 5.0 → 6.0; Z-Image's
            recommended 4 → 5.0; Z-Image-Turbo's 0 → 1.0).
        cfg_normalization: the pipeline's ``cfg_normalization``: k > 0 caps a guided row's norm at k × its
            conditional velocity's (True = 1.0); 0 / False = off.
        cfg_truncation: the pipeline's ``cfg_truncation`` τ: no guidance where 1 − σ > τ; 1.0 = guided everywhere.
        height, width: image size in pixels; None → 1024 (the pipeline's). Multiples of ``2 * vae_scale_factor``.
        max_sequence_length: text tokens, chat template included (the pipeline's 512); a longer prompt is truncated.
        negative_prompt: the unconditional prompt of CFG (the pipeline's "").
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "zimage"
    pipeline_class = "ZImagePipeline"
    default_lora_targets = ZIMAGE_LORA_TARGETS

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 6.0,
        max_sequence_length: int = 512,
        cfg_normalization: float | bool = 0.0,
        cfg_truncation: float = 1.0,
        **options: Unpack[AdapterOptions],
    ):
        if int(max_sequence_length) < 1:
            raise ValueError(f"model.max_sequence_length must be ≥ 1 for Z-Image; got {max_sequence_length}")
        if float(cfg_normalization) < 0:
            raise ValueError(
                f"model.kwargs.cfg_normalization={cfg_normalization}: must be ≥ 0 (0 = off, k > 0 caps a guided "
                "velocity's norm at k × the conditional one's)"
            )
        if not 0 <= float(cfg_truncation) <= 1:
            raise ValueError(
                f"model.kwargs.cfg_truncation={cfg_truncation}: must be in [0, 1] (1 = guided at every step; "
                "τ < 1 drops the guidance where 1 − σ > τ)"
            )
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _size_rule(self) -> tuple[int, int, str]:
        """1024 px (the pipeline's default); whole 2×2 patches of the VAE latent."""
        return 1024, 2 * self.vae_scale_factor, "2 × vae_scale_factor"

    @property
    def image_seq_len(self) -> int:
        """Image tokens: (h/2)·(w/2) of the latent (the transformer's 2×2 patches; ``mu`` of dynamic shifting)."""
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    def _schedule_sigmas(self, steps: int):
        """The pipeline's ``get_default_z_image_sigmas``: ``linspace(1, 1/steps, steps)`` in float32."""
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        return get_default_z_image_sigmas(steps)

    # ---- contract ------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] (the n real tokens, zero-padded to L = ``max_sequence_length``) and
        ``prompt_embeds_mask`` [1, L] (1 for the n tokens)."""
        length = self.max_sequence_length
        (embeds,), _ = self.pipe.encode_prompt(
            [prompt], device=self.device, do_classifier_free_guidance=False, max_sequence_length=length
        )
        n = embeds.shape[0]
        padded = embeds.new_zeros(1, length, embeds.shape[1])
        padded[0, :n] = embeds
        mask = (torch.arange(length, device=embeds.device) < n).long()[None]
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, h, w]) of latents ``x`` [B, C, h, w] at ``sigma`` ([B] or a scalar).

        guidance g (None → ``self.guidance``): g ≠ 1 runs ``[uncond; cond]`` in one transformer call and returns
        Z-Image's ``pos + (g − 1)·(pos − neg)`` (with the model's ``cfg_normalization`` and ``cfg_truncation``);
        g = 1 the conditional velocity alone."""
        g, cfg = self._cfg_of(cond, guidance)
        sigma = self._check_inputs(x, sigma, cond)
        t = (1000 - sigma * 1000) / 1000  # the pipeline's (1000 − timestep) / 1000, timestep = σ·1000
        cfg = cfg and bool((t <= self.cfg_truncation).any())  # every row past the truncation: no guided row left
        text = self._cfg_text(cond, cfg)
        rows = 2 if cfg else 1
        latents = x.to(device=self.device, dtype=self.dtype).unsqueeze(2).repeat(rows, 1, 1, 1, 1)
        embeds = text["prompt_embeds"].to(device=self.device, dtype=self.dtype)
        masks = text["prompt_embeds_mask"].to(self.device).bool()
        with self.autocast_context():
            out = self.forward_module(
                list(latents.unbind(0)),
                t.repeat(rows),
                [e[m] for e, m in zip(embeds, masks)],  # each row's real tokens, as the pipeline passes them
                return_dict=False,
            )[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)  # −v per row
        if cfg:
            neg, pos = self._cfg_split(out)
            out = self._guided(pos, neg, g, t)
        return -out

    def _guided(self, pos: torch.Tensor, neg: torch.Tensor, g: float, t: torch.Tensor) -> torch.Tensor:
        """``ZImagePipeline``'s guidance of the transformer outputs ``pos`` / ``neg`` [B, C, h, w] (fp32) at scale
        s = g − 1: ``pos + s·(pos − neg)``, its norm capped at ``cfg_normalization``·‖pos‖ per row (k > 0), and
        ``pos`` alone on the rows whose 1 − σ = ``t`` [B] exceeds ``cfg_truncation``."""
        pred = pos + (g - 1) * (pos - neg)
        if self.cfg_normalization > 0:
            limit = pos.flatten(1).norm(dim=1) * self.cfg_normalization
            norm = pred.flatten(1).norm(dim=1)
            scale = torch.where(norm > limit, limit / norm, torch.ones_like(norm))
            pred = torch.where((norm > limit).view(-1, 1, 1, 1), pred * scale.view(-1, 1, 1, 1), pred)
        return torch.where((t > self.cfg_truncation).view(-1, 1, 1, 1), pos, pred)


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: a list of [C, 1, h, w] latents and of [L, D] caption features, one per
    row."""
    h, w = shapes.latent[-2], shapes.latent[-1]
    meta = {"device": "meta"}
    return {
        "x": [torch.empty(config["in_channels"], 1, h, w, dtype=dtype, **meta)] * rows,
        "t": torch.empty(rows, dtype=torch.float32, **meta),
        "cap_feats": [torch.empty(shapes.text_tokens, config["cap_feat_dim"], dtype=dtype, **meta)] * rows,
    }


def estimate_forward(module, inputs: dict, hidden: torch.Tensor) -> torch.Tensor:
    """One [C, 1, h, w] latent per row in, one per row out."""
    inputs["x"] = list(hidden.unsqueeze(2).unbind(0))
    return torch.stack(module(**inputs, return_dict=False)[0]).squeeze(2)


def estimate_latent(config: dict, h: int, w: int, patch: int, frames: int | None) -> tuple[tuple[int, ...], int]:
    """2×2 patches of the latent [C, h, w]."""
    return (int(config["in_channels"]), h, w), (h // 2) * (w // 2)


ZImageFlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs, latent=estimate_latent, token_patch=2, forward=estimate_forward, masked_text=True
)
