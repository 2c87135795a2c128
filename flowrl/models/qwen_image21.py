"""`FlowModel` adapter for ``QwenImage21Pipeline`` (Qwen-Image 2.1): text-to-image.

What 2.1 changes against ``QwenImagePipeline`` (:class:`~flowrl.models.qwen_image.QwenImageFlowModel`, whose decode,
negative prompt and set-up this adapter keeps), as ``QwenImage21Pipeline.__call__`` applies it:

- text: Qwen3-VL (not Qwen2.5-VL). The prompt in the 2.1 template (system turn "Comprehend and analyze the provided
  prompt.", a user turn), the last decoder layer's output *before* the final norm (the pipeline's forward hook), the
  system turn's tokens dropped (``_drop_idx``). The pipeline never truncates; here a prompt longer than
  ``max_sequence_length`` tokens is refused. Each prompt is encoded alone and zero-padded to ``max_sequence_length``
  with its mask ``prompt_embeds_mask`` [1, L].
- transformer: ``QwenImage21Transformer2DModel``, one block-causal single stream: the text tokens, then the target
  image's tokens in the slots the mask ``img_mask`` appends (one slot per 2×2 latent tokens); the output's last h·w
  tokens are the velocity. Its RoPE counts text positions on every axis and places the image after the text, so a
  row's result depends on its text length: padding would change it. :meth:`velocity` therefore runs one transformer
  call per text length in the batch, each on exactly that many tokens and no mask, as the pipeline calls it for one
  prompt; rows never depend on their batch companions. (With CFG the negative prompt's rows are one such group.)
- latents: the 64-channel VAE at 16× (``vae_scale_factor`` 16), one token per latent cell: ``[B, C, H/16, W/16]``
  ↔ tokens ``[B, (H/16)(W/16), C]`` (the pipeline's ``_pack_latents``: a flatten); sizes are multiples of 32 px.
- timestep σ; CFG: ``true_cfg_scale`` against the negative prompt, ``v_u + g·(v_c − v_u)`` with *no* norm rescale.
  The pipeline's default is no guidance (``true_cfg_scale`` 1.0: 2.1 is meant to be sampled without CFG), and so is
  this adapter's.
- schedule: the pipeline's configured ``sample_sigmas`` when the step count is theirs, else
  ``linspace(1, 1/steps, steps)``, shifted with ``mu`` from the h·w image tokens (:meth:`FlowModel.schedule`).
- decode: as Qwen-Image's (per-channel statistics undone, one frame of the video VAE); the 2.1 VAE decodes RGBA: the
  RGB channels are the image (the alpha dropped, as PIL's ``convert("RGB")``).

The pipeline's prefix KV cache (``use_kv_cache``) is an inference shortcut with the same result; training recomputes
the text tokens (they pass through the trained blocks) in every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from flowrl.models.estimate_spec import EstimateSpec, Shapes, cells_to_tokens, tokens_to_cells
from flowrl.models.qwen_image import QwenImageFlowModel, decode_frame

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.base import Conditioning
    from flowrl.models.setup import AdapterOptions

QWEN_IMAGE21_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.proj",
    "img_mlp.gate_layer",
    "img_mlp.out",
]
"""The single-stream blocks' attention and SwiGLU projections (text and image tokens share them)."""


class QwenImage21FlowModel(QwenImageFlowModel):
    """Adapter over a ``QwenImage21Pipeline``.

    Args:
        pipe: the pipeline (moved to ``device``; text encoder and VAE frozen, all modules in eval mode).
        guidance: true CFG scale (the pipeline's ``true_cfg_scale``, default 1.0: no CFG, no uncond forward).
        max_sequence_length: the most text tokens a prompt may take after the template (default 512); every prompt
            is padded to it in the cache (its rows are cut back to their own length for the transformer).
        the other keywords as :class:`QwenImageFlowModel`'s (height/width default 1024; multiples of 32).
    """

    family = "qwen_image21"
    pipeline_class = "QwenImage21Pipeline"
    default_lora_targets = QWEN_IMAGE21_LORA_TARGETS

    def __init__(
        self, pipe, *, guidance: float = 1.0, max_sequence_length: int = 512, **options: Unpack[AdapterOptions]
    ):
        if type(pipe.transformer).__name__ != "QwenImage21Transformer2DModel":
            raise ValueError(
                f"QwenImage21FlowModel drives a QwenImage21Transformer2DModel; got {type(pipe.transformer).__name__} "
                "(Qwen-Image and Qwen-Image-2512 are model.family=qwen_image)"
            )
        if not 1 <= int(max_sequence_length) <= 4096:
            raise ValueError(f"max_sequence_length must be in [1, 4096] for Qwen-Image 2.1; got {max_sequence_length}")
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _size_rule(self) -> tuple[int, int, str]:
        """1024 px (the pipeline's ``output_resolution``); whole 2×2 slots of 16-px latent cells."""
        return 1024, 2 * self.vae_scale_factor, "2 × vae_scale_factor"

    # ---- latents: a token per cell ------------------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        """C = the transformer's ``in_channels`` (the VAE's ``z_dim``, 64)."""
        return self.pipe.transformer.config.in_channels

    @property
    def image_seq_len(self) -> int:
        """h·w target tokens (``mu`` of dynamic shifting depends on it)."""
        _, h, w = self.latent_shape
        return h * w

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] → tokens [B, h·w, C] (row-major cells; the pipeline's ``_pack_latents``)."""
        return x.flatten(2).transpose(1, 2)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, h·w, C] → [B, C, h, w] at the adapter's latent size."""
        _, h, w = self.latent_shape
        return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)

    def _schedule_sigmas(self, steps: int) -> np.ndarray:
        """The pipeline's ``sample_sigmas`` when it has ``steps`` of them, else ``linspace(1, 1/steps, steps)``."""
        configured = self.pipe.config.get("sample_sigmas")
        if configured is not None and len(configured) == steps:
            return np.asarray(configured, dtype=np.float64)
        return np.linspace(1.0, 1 / steps, steps)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] fp32 in [0, 1] from latents [B, C, h, w]: Qwen-Image's decode, the RGB channels of the
        RGBA VAE output."""
        return super().decode(x0)[:, :3]

    # ---- text ---------------------------------------------------------------------------------------------------
    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] zero-padded to L = ``max_sequence_length`` and ``prompt_embeds_mask`` [1, L]
        (1 for the tokens the pipeline's ``encode_prompt`` returns)."""
        embeds, _, image_pad = self.pipe.encode_prompt([prompt], device=self.device)
        if bool(image_pad.any()):
            raise ValueError(f"the prompt {prompt!r} holds image tokens; Qwen-Image 2.1 here generates from text")
        if embeds.shape[1] > self.max_sequence_length:
            raise ValueError(
                f"model.max_sequence_length={self.max_sequence_length}: the prompt {prompt!r} takes "
                f"{embeds.shape[1]} tokens; raise it (the pipeline never truncates)"
            )
        return self._padded(embeds, self.max_sequence_length)

    # ---- velocity -----------------------------------------------------------------------------------------------
    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, H, W]) of latents ``x`` [B, C, H, W] at ``sigma`` ([B] or a scalar).

        The rows ``[uncond; cond]`` (guidance g ≠ 1) or ``cond`` in one transformer call per text length, each on its
        own tokens (module docstring); g ≠ 1 returns ``v_u + g·(v_c − v_u)``.
        """
        g, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond)  # the transformer takes σ
        rows = 2 if cfg else 1
        text = self._cfg_text(cond, cfg)
        hidden = self.pack(x.to(device=self.device, dtype=self.dtype)).repeat(rows, 1, 1)
        timestep, tokens = timestep.repeat(rows), hidden.shape[1]
        _, h, w = self.latent_shape
        lengths = text["prompt_embeds_mask"].sum(1).tolist()
        out = torch.empty(hidden.shape, dtype=torch.float32, device=self.device)
        for n in sorted(set(lengths)):
            idx = torch.tensor([i for i, length in enumerate(lengths) if length == n], device=self.device)
            img_mask = torch.zeros(len(idx), n + tokens // 4, dtype=torch.bool, device=self.device)
            img_mask[:, n:] = True  # the target image's slots after the text
            with self.autocast_context():
                part = self.forward_module(
                    hidden_states=hidden[idx],
                    timestep=timestep[idx],
                    encoder_hidden_states=text["prompt_embeds"][idx, :n].to(device=self.device, dtype=self.dtype),
                    encoder_hidden_states_mask=None,
                    img_shapes=[[(1, h, w)]] * len(idx),
                    img_mask=img_mask,
                    return_dict=False,
                )[0]
            out[idx] = part[:, -tokens:].float()  # the target image's tokens close the sequence
        if cfg:
            out = self._cfg_combine(out, g)
        return self.unpack(out)


# ---- the estimate's data (flowrl.models.estimate_spec) ----------------------------------------------


def estimate_latent(config: dict, h: int, w: int, patch: int, frames: int | None) -> tuple[tuple[int, ...], int]:
    """A token per latent cell (sizes: multiples of 32 px)."""
    return (int(config["in_channels"]), h, w), h * w


def estimate_inputs(config: dict, shapes: Shapes, rows: int, dtype: torch.dtype) -> dict:
    """One transformer call's meta inputs: ``hidden_states`` [B, h·w, C] (a token per cell), ``timestep`` [B] fp32,
    ``encoder_hidden_states`` [B, L, context_in_dim], ``img_shapes`` [(1, h, w)], ``img_mask`` [B, L + h·w/4] bool
    (a real host tensor: the transformer reads the token layout from it on the host)."""
    h, w = shapes.latent[-2], shapes.latent[-1]
    L, meta = shapes.text_tokens, {"device": "meta"}
    img_mask = torch.zeros(rows, L + shapes.image_tokens // 4, dtype=torch.bool)  # a slot per 2×2 latent tokens
    img_mask[:, L:] = True  # the target image's slots after the text
    return {
        "hidden_states": torch.empty(rows, shapes.image_tokens, config["in_channels"], dtype=dtype, **meta),
        "timestep": torch.empty(rows, dtype=torch.float32, **meta),
        "encoder_hidden_states": torch.empty(rows, L, config["context_in_dim"], dtype=dtype, **meta),
        "img_shapes": [[(1, h, w)]] * rows,
        "img_mask": img_mask,
    }


def estimate_output(out: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """The joint sequence's last tokens (the text's come first), a token per latent cell → [B, C, h, w]."""
    return tokens_to_cells(out[:, -shapes.image_tokens :], shapes)


QwenImage21FlowModel.estimate_spec = EstimateSpec(
    inputs=estimate_inputs,
    latent=estimate_latent,
    token_patch=2,
    to_tokens=cells_to_tokens,
    from_tokens=estimate_output,
    decode=decode_frame,
    masked_text=True,
    text_limit=4096,
)
