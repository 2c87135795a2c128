"""`FlowModel` adapter for ``Flux2Pipeline`` (FLUX.2-dev and its fine-tunes).

Conventions, as ``Flux2Pipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt``: the prompt as the user turn after FLUX.2's system message in the
  Mistral chat template, tokenized with ``padding="max_length"`` (and truncation) to ``max_sequence_length``, through
  the Mistral 3 text encoder; the hidden states of layers ``text_encoder_out_layers`` (10, 20, 30) concatenated per
  token → ``prompt_embeds`` [1, L, 3D]. Every prompt is padded to L by the tokenizer, so a cached prompt never
  depends on its batch; the pipeline passes no mask to the transformer (padding tokens are attended to), neither
  does the adapter. Text position ids (t, h, w, l) = (0, 0, 0, l) (the pipeline's ``_prepare_text_ids``).
- latents: FLUX.2's latent space is the VAE's 2×2-patchified latent (4·z channels, 128 for FLUX.2) normalised by
  the VAE's batch-norm statistics (``vae.bn``): the pipeline draws its noise there, ``[B, 4z, H/2f, W/2f]``
  (f = the pipeline's ``vae_scale_factor``), and the transformer sees it one cell per token (``patch_size`` 1,
  the pipeline's ``_pack_latents``; image ids (0, h, w, 0) from ``_prepare_latent_ids``). The adapter takes and
  returns exactly these latents: its ``vae_scale_factor`` is 2f (pixels per latent cell), ``latent_shape``
  ``(in_channels, H/2f, W/2f)``, and ``noise([s])`` equals the pipeline's noise from
  ``torch.Generator().manual_seed(s)``. FLUX.1's 2×2 packing (``Packed2x2``) does not apply: the patchify is the
  VAE's side of the latent space here (undone in ``decode``), and the batch-norm statistics are per patchified
  channel.
- transformer timestep = σ (the transformer multiplies by 1000 itself).
- guidance: FLUX.2-dev is guidance-distilled: ``guidance`` is the value of the guidance embedding (the pipeline's
  ``guidance_scale``, default 4.0), fed on every row at no cost; the pipeline has no true CFG, so there is never an
  unconditional branch (:meth:`Flux2FlowModel.uses_cfg` is False) and ``negative_prompt`` is unused. A transformer
  without ``guidance_embeds`` ignores the value, as in the pipeline.
- schedule: ``linspace(1, 1/steps, steps)`` shifted by the scheduler with ``mu`` = the pipeline's
  ``compute_empirical_mu(image tokens, steps)`` (FLUX.2's fit: ``mu`` depends on the number of steps too), then 0.
- decode: the batch-norm statistics undone (``latent · sqrt(running_var + eps) + running_mean`` per channel), the
  2×2 patches unpatchified (``_unpatchify_latents``), the VAE decoded, [-1, 1] → [0, 1].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.dtypes import dropped_log_messages
from flowrl.models.estimate_spec import EstimateSpec, Shapes, cells_to_tokens, tokens_to_cells
from flowrl.models.sd3 import SD3_LORA_TARGETS

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

FLUX2_SINGLE_BLOCKS = 48
"""Single-stream blocks of FLUX.2-dev (the smaller FLUX.2 transformers have fewer): see FLUX2_LORA_TARGETS."""

FLUX2_LORA_TARGETS = [
    *SD3_LORA_TARGETS,  # double-stream attention: to_q/k/v, to_out.0 (image) and add_q/k/v_proj, to_add_out (text)
    "linear_in",
    "linear_out",  # double-stream SwiGLU feed-forwards of both streams (ff, ff_context)
    "to_qkv_mlp_proj",  # single-stream blocks: fused q/k/v and MLP input
    # single-stream blocks' output Linear `attn.to_out`: the suffix "attn.to_out" also names the double-stream blocks'
    # ModuleList, which peft refuses, so each block is named (peft ignores names a smaller transformer lacks)
    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(FLUX2_SINGLE_BLOCKS)),
]


class Flux2FlowModel(FlowModel):
    """Adapter over a ``Flux2Pipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoder and VAE frozen, all modules in eval mode; on CPU,
            unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``).
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
        guidance: the distilled guidance embedding value (the pipeline's ``guidance_scale``, 4.0); never a CFG branch.
        height, width: image size in pixels; None → ``pipe.default_sample_size * pipe.vae_scale_factor`` (1024).
            Must be multiples of ``2 * pipe.vae_scale_factor`` (16).
        max_sequence_length: text tokens, system message and chat template included (the pipeline's 512); every
            prompt is padded to it. A prompt beyond it is truncated, as by the pipeline.
        text_encoder_out_layers: the text encoder's hidden states concatenated per token (the pipeline's (10, 20, 30)).
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "flux2"
    pipeline_class = "Flux2Pipeline"
    default_lora_targets = FLUX2_LORA_TARGETS

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 4.0,
        max_sequence_length: int = 512,
        text_encoder_out_layers=(10, 20, 30),
        **options: Unpack[AdapterOptions],
    ):
        layers = pipe.text_encoder.config.get_text_config().num_hidden_layers
        self.text_encoder_out_layers = tuple(int(k) for k in text_encoder_out_layers)
        if not all(-layers - 1 <= k <= layers for k in self.text_encoder_out_layers):
            raise ValueError(
                f"text_encoder_out_layers must index the text encoder's {layers + 1} hidden states; "
                f"got {self.text_encoder_out_layers}"
            )
        if int(max_sequence_length) < 1:
            raise ValueError(f"max_sequence_length must be ≥ 1; got {max_sequence_length}")
        if options.get("negative_prompt"):
            raise ValueError("negative_prompt does nothing for FLUX.2: Flux2Pipeline has no classifier-free guidance")
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _latent_scale(self, pipe) -> int:
        """Pixels per cell of the patchified latent: 2 × the pipeline's ``vae_scale_factor``."""
        return 2 * pipe.vae_scale_factor

    def _size_rule(self) -> tuple[int, int, str]:
        """``default_sample_size`` VAE latent cells; whole 2×2 patches."""
        return (
            self.pipe.default_sample_size * self.pipe.vae_scale_factor,
            self.vae_scale_factor,
            "2 × the pipeline's vae_scale_factor",
        )

    # ---- latents: tokens, schedule, decode ---------------------------------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → tokens [B, h·w, C], one per cell (the pipeline's ``_pack_latents``)."""
        return self.pipe._pack_latents(x)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, h·w, C] → latents [B, C, h, w] at the adapter's latent size (inverse of :meth:`pack`)."""
        return tokens.transpose(1, 2).reshape(tokens.shape[0], *self.latent_shape)

    def schedule(self, steps: int) -> torch.Tensor:
        """Sigmas [steps + 1] fp32 (CPU), 1 → 0: the pipeline's ``linspace(1, 1/steps, steps)`` (the scheduler's own
        spacing when it uses flow sigmas) shifted by a fresh copy of ``pipe.scheduler`` with FLUX.2's empirical
        ``mu`` of the image tokens and the number of steps, then 0."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        if int(steps) < 1:
            raise ValueError(f"steps must be ≥ 1; got {steps}")
        steps = int(steps)
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(steps, device="cpu", sigmas=sigmas, mu=compute_empirical_mu(self.image_seq_len, steps))
        return scheduler.sigmas.to(torch.float32).clone()

    def _vae_scale_shift(self) -> tuple[float, None]:
        """(1, None): :meth:`decode` undoes the batch-norm statistics itself, before the VAE's unpatchify."""
        return 1.0, None

    def latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) [1, C, 1, 1] of the patchified VAE latent, in the VAE's dtype: ``vae.bn``'s running mean and
        ``sqrt(running_var + batch_norm_eps)`` (latent = (patchified VAE latent − mean) / std)."""
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        return mean.to(self.device, vae.dtype), std.to(self.device, vae.dtype)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] fp32 in [0, 1] from latents [B, C, h, w]: batch-norm statistics undone, 2×2 patches
        unpatchified to the VAE's [B, C/4, 2h, 2w], then :meth:`FlowModel.decode` (no further scaling)."""
        mean, std = self.latent_stats()
        latents = x0.to(device=self.device, dtype=mean.dtype) * std + mean
        return super().decode(self.pipe._unpatchify_latents(latents))

    # ---- contract ------------------------------------------------------------------------------------
    def uses_cfg(self, guidance: float | None = None) -> bool:
        """Never: ``guidance`` is the distilled guidance embedding; ``Flux2Pipeline`` has no true CFG."""
        return False

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, len(text_encoder_out_layers)·D], L = ``max_sequence_length`` (the tokenizer
        pads). The pipeline hands padding and truncation to ``apply_chat_template`` as legacy keywords, honoured but
        warned about on every call by transformers: that warning (only) is dropped."""
        layers, length = self.text_encoder_out_layers, self.max_sequence_length
        with dropped_log_messages(("transformers.processing_utils",), "Kwargs passed to `processor.__call__`"):
            embeds, _ = self.pipe.encode_prompt(
                [prompt], device=self.device, max_sequence_length=length, text_encoder_out_layers=layers
            )
        return {"prompt_embeds": embeds}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, h, w]) of latents ``x`` [B, C, h, w] at ``sigma`` ([B] or a scalar),
        with the guidance embedding at ``guidance`` (None → ``self.guidance``) on every row; one transformer call."""
        g = self.guidance_or_default(guidance)
        timestep = self._check_inputs(x, sigma, cond)  # the transformer takes σ (it multiplies by 1000)
        latents = x.to(device=self.device, dtype=self.dtype)
        text = cond.cond["prompt_embeds"].to(device=self.device, dtype=self.dtype)
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=self.pack(latents),
                timestep=timestep,
                guidance=torch.full_like(timestep, g),
                encoder_hidden_states=text,
                txt_ids=self.pipe._prepare_text_ids(text[:1]).to(self.device),  # the same ids for every row
                img_ids=self.pipe._prepare_latent_ids(latents[:1]).to(self.device),
                return_dict=False,
            )[0]
        return self.unpack(out.float())


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_latent(config: dict, h: int, w: int, patch: int, frames: int | None) -> tuple[tuple[int, ...], int]:
    """The VAE latent patchified 2×2 is the model's latent: [4z, H/2f, W/2f], a token per cell."""
    return (int(config["in_channels"]), h // 2, w // 2), (h // 2) * (w // 2)


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, h·w, C] (a token per cell), ``timestep`` and
    ``guidance`` [B] fp32, ``encoder_hidden_states`` [B, L, joint_dim], ``txt_ids`` [1, L, 4], ``img_ids``
    [1, h·w, 4] (FLUX.2 klein: the same, its transformer without a guidance input)."""
    L, meta = shapes.text_tokens, {"device": "meta"}
    tokens = shapes.image_tokens
    out = {
        "hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
        "txt_ids": torch.zeros(1, L, 4, dtype=torch.long, **meta),
        "img_ids": torch.zeros(1, tokens, 4, dtype=torch.long, **meta),
    }
    if config.get("guidance_embeds"):
        out["guidance"] = torch.empty(rows, dtype=torch.float32, **meta)
    return out


def estimate_decode(vae, arch: dict, latents: torch.Tensor) -> torch.Tensor:
    """The 2×2 patches unpatchified to the VAE's [B, C/4, 2h, 2w], then decoded."""
    b, c, h, w = latents.shape
    latents = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, 2 * h, 2 * w)
    return vae.decode(latents, return_dict=False)[0]


Flux2FlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs,
    latent=estimate_latent,
    token_patch=2,
    to_tokens=cells_to_tokens,
    from_tokens=tokens_to_cells,
    decode=estimate_decode,
    guidance="embedding",
)
