"""`FlowModel` adapter for ``QwenImagePipeline`` (Qwen-Image and its fine-tunes).

Conventions, as ``QwenImagePipeline.__call__`` applies them:

- text: the pipeline's own ``encode_prompt``: the prompt inside Qwen-Image's chat template (a system line
  "Describe the image by detailing …" and a user turn) through the Qwen2.5-VL text encoder, its last hidden
  state without the template's first ``prompt_template_encode_start_idx`` (34) tokens, truncated to
  ``max_sequence_length``. Each prompt is encoded alone, then zero-padded here to exactly
  ``max_sequence_length`` rows with ``prompt_embeds_mask`` [B, L] (1 = a real token), passed to the
  transformer as ``encoder_hidden_states_mask``: a row never depends on the lengths of its batch companions
  (replays are bit-exact whatever the batching) and ``[uncond; cond]`` fit one forward. Masked padding leaves
  the image tokens unchanged (text RoPE positions count from the same start in every row).
- latents: the adapter takes and returns ``[B, C, H/f, W/f]`` (f = ``vae_scale_factor`` = 8, C =
  ``in_channels / 4`` = 16); ``velocity`` packs 2×2 patches into tokens ``[B, (H/2f)(W/2f), 4C]``
  (:class:`~flowrl.models.packing.Packed2x2`) with ``img_shapes`` ``[(1, H/2f, W/2f)]`` per row, and unpacks.
- transformer timestep = σ (the transformer multiplies by 1000 itself).
- CFG: ``guidance`` is the pipeline's ``true_cfg_scale`` against the negative prompt (default 4.0, the
  pipeline's; negative prompt ``" "`` as in Qwen-Image's examples). ``guidance`` ≠ 1 runs ``[uncond; cond]`` in
  one forward and returns ``v_u + g·(v_c − v_u)`` rescaled, per packed token, to the norm of ``v_c`` over the
  token's 4C channels (the pipeline's ``comb_pred * (cond_norm / noise_norm)``); 1 runs the conditional rows
  only. Guidance-distilled transformers (``guidance_embeds``) are refused: this diffusers' transformer cannot
  run them.
- schedule: ``linspace(1, 1/steps, steps)`` shifted by the scheduler with ``mu`` from the number of image
  tokens (Qwen-Image: exponential time shift, ``shift_terminal`` 0.02), then 0 (:meth:`FlowModel.schedule`).
- decode: per-channel ``latents_std`` / ``latents_mean`` of the VAE config undone, the video VAE decoded
  with one frame (:meth:`QwenImageFlowModel.decode`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.models.estimate_spec import EstimateSpec, Shapes, pack_2x2, packed_latent, unpack_2x2
from flowrl.models.packing import Packed2x2
from flowrl.models.sd3 import SD3_LORA_TARGETS

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions

QWEN_IMAGE_LORA_TARGETS = [
    *SD3_LORA_TARGETS,  # joint attention: to_q/k/v, to_out.0 (image) and add_q/k/v_proj, to_add_out (text)
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]


class QwenImageFlowModel(Packed2x2, FlowModel):
    """Adapter over a ``QwenImagePipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoder and VAE frozen, all modules in eval mode; on CPU,
            unaligned (mmap-loaded) weights copied to aligned memory, see ``align_cpu_tensors``).
        device: where the pipeline runs; None → where its transformer already is.
        dtype: compute dtype of the transformer (it is cast when different); None → its current dtype.
        guidance: true CFG scale (the pipeline's ``true_cfg_scale``, 4.0); 1.0 = no CFG, no uncond forward.
        height, width: image size in pixels; None → ``pipe.default_sample_size * vae_scale_factor`` (1024).
            Must be multiples of ``2 * vae_scale_factor``.
        max_sequence_length: text tokens after the template (the pipeline's default 512); every prompt is
            padded to it (with its mask), so a smaller value is faster when prompts are short.
        negative_prompt: the unconditional prompt of CFG.
        gradient_checkpointing: enable the transformer's gradient checkpointing.
    """

    family = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    default_negative_prompt = " "  # Qwen-Image's examples
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS

    def __init__(
        self, pipe, *, guidance: float = 4.0, max_sequence_length: int = 512, **options: Unpack[AdapterOptions]
    ):
        config = pipe.transformer.config
        if config.get("guidance_embeds", False) or config.get("zero_cond_t", False):
            raise ValueError(
                "QwenImageFlowModel supports text-to-image Qwen-Image transformers only "
                "(guidance_embeds and zero_cond_t off)"
            )
        if not 1 <= int(max_sequence_length) <= 1024:
            raise ValueError(f"max_sequence_length must be in [1, 1024] for Qwen-Image; got {max_sequence_length}")
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _size_rule(self) -> tuple[int, int, str]:
        """``default_sample_size`` latent cells (1024 px); whole 2×2 patches."""
        return self.pipe.default_sample_size * self.vae_scale_factor, 2 * self.vae_scale_factor, "2 × vae_scale_factor"

    # ---- decode (schedule, packing: Packed2x2 and FlowModel) ------------------------------------
    def _vae_scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 / latents_std, latents_mean) per channel, shaped [1, C, 1, 1, 1] in the VAE's dtype, as the
        pipeline builds them (latent = (vae latent − mean) / std)."""
        vae = self.pipe.vae
        view = lambda values: torch.tensor(values).view(1, vae.config.z_dim, 1, 1, 1).to(self.device, vae.dtype)
        return 1.0 / view(vae.config.latents_std), view(vae.config.latents_mean)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] fp32 in [0, 1] from latents [B, C, h, w]: :meth:`FlowModel.decode` on a single
        frame of the video VAE (``[B, C, 1, h, w]``), as ``QwenImagePipeline`` decodes."""
        return super().decode(x0.unsqueeze(2))[:, :, 0]

    # ---- contract ------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] zero-padded to L = ``max_sequence_length`` and ``prompt_embeds_mask``
        [1, L] (1 for the tokens ``encode_prompt`` returned, 0 for the padding)."""
        embeds, _ = self.pipe.encode_prompt([prompt], device=self.device, max_sequence_length=self.max_sequence_length)
        return self._padded(embeds, self.max_sequence_length)

    @staticmethod
    def _padded(embeds: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, n, D] zero-padded to [1, ``length``, D] and its ``prompt_embeds_mask`` [1, length]
        (1 for the n tokens, 0 for the padding): every prompt the same length, so rows never depend on their batch."""
        n = embeds.shape[1]
        padded = embeds.new_zeros(1, length, embeds.shape[2])
        padded[:, :n] = embeds
        mask = (torch.arange(length, device=embeds.device) < n).long()[None]
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    def _image_tokens(self, hidden: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
        """(image tokens, ``img_shapes``) of a transformer call on packed latents ``hidden`` [R, N, 4C]: the latents
        alone, each row one image of (1, h/2, w/2) patches (an editing family appends its source image's tokens)."""
        _, h, w = self.latent_shape
        return hidden, [[(1, h // 2, w // 2)]] * hidden.shape[0]

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, H, W]) of latents ``x`` [B, C, H, W] at ``sigma`` ([B] or a scalar).

        guidance g (None → ``self.guidance``): g ≠ 1 runs ``[uncond; cond]`` in one transformer call and
        returns Qwen-Image's norm-rescaled true CFG (module docstring); g = 1 the conditional velocity.
        """
        g, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond)  # the transformer takes σ (it multiplies by 1000)
        rows = 2 if cfg else 1  # [uncond; cond] in one forward
        text = self._cfg_text(cond, cfg)
        hidden = self.pack(x.to(device=self.device, dtype=self.dtype)).repeat(rows, 1, 1)
        tokens = hidden.shape[1]
        hidden, img_shapes = self._image_tokens(hidden, text)
        with self.autocast_context():
            out = self.forward_module(
                hidden_states=hidden,
                timestep=timestep.repeat(rows),
                encoder_hidden_states=text["prompt_embeds"].to(device=self.device, dtype=self.dtype),
                encoder_hidden_states_mask=text["prompt_embeds_mask"].to(self.device),
                img_shapes=img_shapes,
                return_dict=False,
            )[0]
        out = out[:, :tokens].float()  # the generated image's tokens (an editing family appends its source's)
        if cfg:
            v_cond = out.chunk(2)[1]
            out = self._cfg_combine(out, g)
            out = out * (v_cond.norm(dim=-1, keepdim=True) / out.norm(dim=-1, keepdim=True))
        return self.unpack(out)


QwenImageModel = QwenImageFlowModel  # the name issue 37 uses; the class follows the other adapters' naming


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def decode_frame(vae, arch: dict, latents: torch.Tensor) -> torch.Tensor:
    """One frame of the video VAE: ``[B, C, 1, h, w]`` in, the frame's pixels out."""
    return vae.decode(latents.unsqueeze(2), return_dict=False)[0][:, :, 0]


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, (h/2)(w/2), 4C] (2×2 packing), ``timestep`` [B]
    fp32, ``encoder_hidden_states`` [B, L, joint_dim], ``encoder_hidden_states_mask`` [B, L] int64, ``img_shapes``;
    an edit model: each source's tokens appended ([B, (1 + k)(h/2)(w/2), 4C], 1 + k ``img_shapes``, k sources)."""
    h, w = shapes.latent[-2], shapes.latent[-1]
    L, meta = shapes.text_tokens, {"device": "meta"}
    tokens = shapes.image_tokens + shapes.source_tokens
    return {
        "hidden_states": torch.empty(rows, tokens, config["in_channels"], dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "encoder_hidden_states": torch.empty(rows, L, config["joint_attention_dim"], dtype=dtype, **meta),
        "encoder_hidden_states_mask": torch.ones(rows, L, dtype=torch.long, **meta),
        "img_shapes": [[(1, h // 2, w // 2)] * (1 + shapes.source_tokens // shapes.image_tokens)] * rows,
    }


QwenImageFlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs,
    latent=packed_latent,
    token_patch=2,
    to_tokens=pack_2x2,
    from_tokens=unpack_2x2,
    decode=decode_frame,
    masked_text=True,
    text_limit=1024,
)
