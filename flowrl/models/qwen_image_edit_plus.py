"""`FlowModel` adapter for ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit 2509 and 2511): an instruction edits one or
several source images.

A prompt carries its images as leading tags, in order: ``"[image: A] [image: B] INSTRUCTION"``, one tag for a single
source (the :mod:`flowrl.models.image_prompts` form). Everything else is
:class:`~flowrl.models.qwen_image_edit.QwenImageEditFlowModel`'s (latents, 2×2 packing, schedule, true CFG with the
norm rescale, decode, the negative prompt on the same sources); what the Plus pipeline changes, as
``QwenImageEditPlusPipeline.__call__`` applies it:

- text: the user turn is ``"Picture 1: <vision> Picture 2: <vision> … INSTRUCTION"`` (each image's vision tokens
  after its ``Picture i:`` label) through Qwen2.5-VL, the template's first 64 tokens dropped. The images the encoder
  sees are *condition images* of about ``condition_area`` pixels (the pipeline's ``CONDITION_IMAGE_SIZE``, 384²),
  here at the run's aspect ratio: ``calculate_dimensions(condition_area, width / height)`` (multiples of 32 px).
- source latents: each image's VAE latent (posterior mode, normalised, 2×2-packed) at the run's ``height`` ×
  ``width``, appended after the noisy latent's tokens in image order (``img_shapes``: the generated grid first, then
  one per source); the output is cut back to the generated tokens. The pipeline encodes each source at about 1024²
  pixels at its own aspect ratio (the same at 1024×1024 for square sources).
- Qwen-Image-Edit-2511's transformer (``zero_cond_t``: the source tokens modulated at t = 0) is accepted; the
  transformer applies it itself.

Rows of one batch may carry different numbers of images: each prompt's conditioning is padded to ``max_images``
sources (``image_latents`` [1, max_images·N, 4C], ``image_count`` [1]) and to ``max_sequence_length`` + max_images ×
the vision tokens of one condition image (``prompt_embeds`` with its mask), and :meth:`velocity` runs one transformer
call per image count present (the transformer takes one image layout per call). Everything is cached per prompt
string, so each set of sources is encoded once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flowrl.models.estimate_spec import EstimateSpec
from flowrl.models.image_prompts import FORM, image_prompt, source_pil, split_image_prompts
from flowrl.models.qwen_image_edit import QwenImageEditFlowModel

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.base import Conditioning
    from flowrl.models.setup import AdapterOptions

CONDITION_AREA = 384 * 384
"""Pixels of a condition image the vision encoder reads (``pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE``)."""
PLUS_FORM = "'[image: PATH] [image: PATH2] … INSTRUCTION' (one or more image tags, then the instruction)"


def image_prompts(text: str, paths: list[str]) -> str:
    """The prompt of instruction ``text`` on the images at ``paths`` (in order): ``[image: A] [image: B] text``."""
    for path in reversed(paths):
        text = image_prompt(text, path)
    return text


def condition_size(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) px of a condition image of about ``area`` pixels at ``width / height``, multiples of 32
    (the pipeline's ``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / ratio / 32) * 32, round(w / 32) * 32


class QwenImageEditPlusFlowModel(QwenImageEditFlowModel):
    source_images = None  # model.kwargs.max_images decides
    """Adapter over a ``QwenImageEditPlusPipeline``; arguments as :class:`QwenImageEditFlowModel`'s, and

    Args:
        max_images: the most source images a prompt may carry (default 3, the range Qwen-Image-Edit-2509 is shown
            with); every prompt's conditioning is padded to it.
        condition_area: pixels of each condition image the vision encoder reads (default 384², the pipeline's).
    """

    family = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 4.0,
        max_sequence_length: int = 512,
        max_images: int = 3,
        condition_area: int = CONDITION_AREA,
        **options: Unpack[AdapterOptions],
    ):
        if pipe.transformer.config.get("guidance_embeds", False):
            raise ValueError(
                "QwenImageEditPlusFlowModel supports Qwen-Image-Edit transformers without a guidance embedding "
                "(guidance_embeds off; 2509 and 2511 have none)"
            )
        if not 1 <= int(max_sequence_length) <= 1024:
            raise ValueError(f"max_sequence_length must be in [1, 1024] for Qwen-Image; got {max_sequence_length}")
        if int(max_images) < 1:
            raise ValueError(f"model.kwargs.max_images={max_images}: must be ≥ 1 (the most source images a prompt has)")
        if int(condition_area) < 32 * 32:
            raise ValueError(
                f"model.kwargs.condition_area={condition_area}: must be ≥ 1024 pixels (32 × 32, the smallest "
                "condition image); the pipeline's is 147456 (384²)"
            )
        self.max_images, self.condition_area = int(max_images), int(condition_area)
        self._init_adapter(pipe, guidance, max_sequence_length, **options)

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The negative prompt on each prompt's own source images (the pipeline encodes both with them)."""
        return [image_prompts(self.negative_prompt, self._split(p)[1]) for p in prompts]

    def _split(self, prompt: str) -> tuple[str, list[str]]:
        """(instruction, source image paths) of ``prompt``; one without an image, or with more than
        ``max_images``, is refused."""
        text, paths = split_image_prompts(prompt)
        if not paths:
            raise ValueError(
                f"model family {self.family!r} edits images, and the prompt {prompt!r} carries none; accepted: "
                f"{FORM}, or several: {PLUS_FORM}"
            )
        if len(paths) > self.max_images:
            raise ValueError(
                f"the prompt {prompt!r} carries {len(paths)} images, more than model.kwargs.max_images="
                f"{self.max_images}; raise it (accepted: 1 to max_images image tags)"
            )
        return text, paths

    def _vision_tokens(self, image) -> int:
        """Vision tokens of one condition image through the pipeline's processor."""
        processor = self.pipe.processor.image_processor
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
        return int(grid.prod()) // processor.merge_size**2

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] zero-padded to L = ``max_sequence_length`` + ``max_images`` × one condition
        image's vision tokens, ``prompt_embeds_mask`` [1, L], the packed source latents in order
        ``image_latents`` [1, max_images·N, 4C] (zeros past the prompt's k images) and ``image_count`` [1] = k."""
        (text, paths), pipe = self._split(prompt), self.pipe
        ch, cw = condition_size(self.condition_area, self.height, self.width)
        conditions = [source_pil(p, ch, cw) for p in paths]
        embeds, _ = pipe.encode_prompt([text], image=conditions, device=self.device)
        length = self.max_sequence_length + self.max_images * self._vision_tokens(conditions[0])
        if embeds.shape[1] > length:
            text_tokens = embeds.shape[1] - len(paths) * self._vision_tokens(conditions[0])
            raise ValueError(
                f"model.max_sequence_length={self.max_sequence_length}: the prompt {prompt!r} takes "
                f"{text_tokens} tokens besides its images'; raise it"
            )
        latents = []
        for path in paths:
            pixels = pipe.image_processor.preprocess(source_pil(path, self.height, self.width), self.height, self.width)
            latent = pipe._encode_vae_image(pixels.unsqueeze(2).to(self.device, pipe.vae.dtype), generator=None)
            latents.append(self.pack(latent[:, :, 0]))  # [1, N, 4C]
        sources = torch.cat(latents, dim=1)
        padded = sources.new_zeros(1, self.max_images * sources.shape[1] // len(paths), sources.shape[2])
        padded[:, : sources.shape[1]] = sources
        count = torch.tensor([len(paths)], device=self.device)
        return {**self._padded(embeds, length), "image_latents": padded, "image_count": count}

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Conditioning, guidance: float | None = None
    ) -> torch.Tensor:
        """Velocity v ≈ ε − x0 (fp32, [B, C, H, W]) of latents ``x`` [B, C, H, W] at ``sigma`` ([B] or a scalar):
        the rows ``[uncond; cond]`` (CFG) or ``cond`` in one transformer call per number of source images, each row
        its k sources' tokens after its latent's; CFG as :class:`QwenImageFlowModel` (norm-rescaled true CFG)."""
        g, cfg = self._cfg_of(cond, guidance)
        timestep = self._check_inputs(x, sigma, cond)  # the transformer takes σ (it multiplies by 1000)
        rows = 2 if cfg else 1
        text = self._cfg_text(cond, cfg)
        hidden = self.pack(x.to(device=self.device, dtype=self.dtype)).repeat(rows, 1, 1)
        timestep, tokens = timestep.repeat(rows), hidden.shape[1]
        _, h, w = self.latent_shape
        counts = text["image_count"].tolist()
        out = torch.empty(hidden.shape, dtype=torch.float32, device=self.device)
        for k in sorted(set(counts)):
            idx = torch.tensor([i for i, c in enumerate(counts) if c == k], device=self.device)
            sources = text["image_latents"][idx, : k * tokens].to(device=self.device, dtype=hidden.dtype)
            with self.autocast_context():
                part = self.forward_module(
                    hidden_states=torch.cat([hidden[idx], sources], dim=1),
                    timestep=timestep[idx],
                    encoder_hidden_states=text["prompt_embeds"][idx].to(device=self.device, dtype=self.dtype),
                    encoder_hidden_states_mask=text["prompt_embeds_mask"][idx].to(self.device),
                    img_shapes=[[(1, h // 2, w // 2)] * (1 + k)] * len(idx),
                    return_dict=False,
                )[0]
            out[idx] = part[:, :tokens].float()  # the generated image's tokens
        if cfg:
            v_cond = out.chunk(2)[1]
            out = self._cfg_combine(out, g)
            out = out * (v_cond.norm(dim=-1, keepdim=True) / out.norm(dim=-1, keepdim=True))
        return self.unpack(out)


# the estimate's data (flowrl.models.estimate_spec): Qwen-Image's transformer, max_images sources per prompt
QwenImageEditPlusFlowModel.estimate_spec = EstimateSpec(base="qwen_image", edit=True, vision=True)
