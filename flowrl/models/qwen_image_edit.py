"""`FlowModel` adapter for ``QwenImageEditPipeline`` (Qwen-Image-Edit): an instruction edits a source image.

A prompt carries its source image: ``"[image: PATH] INSTRUCTION"`` (:mod:`flowrl.models.image_prompts`). Everything
else is :class:`~flowrl.models.qwen_image.QwenImageFlowModel`'s (latents, packing, schedule, true CFG with the
norm rescale, decode); what the edit pipeline adds, as ``QwenImageEditPipeline.__call__`` applies it:

- text: ``encode_prompt(instruction, image=source)``: the edit chat template with the source image's vision
  tokens, through the Qwen2.5-VL encoder (vision tower included), the template's first 64 tokens dropped. Each
  prompt is encoded alone and zero-padded to ``max_sequence_length`` + the image's vision tokens, with its mask
  (as :class:`QwenImageFlowModel`, so rows never depend on their batch). The negative prompt of CFG is encoded
  with the same source image (:meth:`_negative_prompts`).
- source latents: the source's VAE latent (``argmax`` of the posterior, normalised per channel, 2×2-packed),
  ``image_latents`` [1, N, 4C] in the prompt's conditioning, appended after the noisy latent's tokens in every
  transformer call (``img_shapes`` gets the source's shape second); the output is cut back to the generated tokens.
- the source image is resized to the generated image's ``height`` × ``width`` (Lanczos) for both encoders: one
  source size per run, so prompts batch together. (The pipeline resizes it to about 1024² pixels at its own
  aspect ratio; at the default 1024×1024 the two agree for square sources.)

Everything is cached per prompt string — the instruction with its image path — so each source is encoded once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.estimate_spec import EstimateSpec
from flowrl.models.image_prompts import FORM, image_prompt, source_pil, split_image_prompt
from flowrl.models.qwen_image import QwenImageFlowModel

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions


class QwenImageEditFlowModel(QwenImageFlowModel):
    """Adapter over a ``QwenImageEditPipeline``; arguments as :class:`QwenImageFlowModel`'s, except
    ``max_sequence_length``: conditioning tokens besides the source image's vision tokens (the instruction and
    the template's end), default 512."""

    family = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    takes_source_image = True

    def __init__(
        self, pipe, *, guidance: float = 4.0, max_sequence_length: int = 512, **options: Unpack[AdapterOptions]
    ):
        super().__init__(pipe, guidance=guidance, max_sequence_length=max_sequence_length, **options)

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The negative prompt on each prompt's own source image (the pipeline encodes both with the image)."""
        return [image_prompt(self.negative_prompt, self._split(p)[1]) for p in prompts]

    @staticmethod
    def _split(prompt: str) -> tuple[str, str]:
        """(instruction, source image path) of ``prompt``; a prompt without an image is refused."""
        text, path = split_image_prompt(prompt)
        if path is None:
            raise ValueError(
                f"model family 'qwen_image_edit' edits an image, and the prompt {prompt!r} carries "
                f"none; accepted: {FORM}"
            )
        return text, path

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] zero-padded to L = ``max_sequence_length`` + the source's vision tokens,
        ``prompt_embeds_mask`` [1, L], and the packed source latent ``image_latents`` [1, (h/2)(w/2), 4C]."""
        (text, path), pipe = self._split(prompt), self.pipe
        source = source_pil(path, self.height, self.width)
        embeds, _ = pipe.encode_prompt([text], image=source, device=self.device)
        grid = pipe.processor.image_processor(images=[source], return_tensors="pt")["image_grid_thw"]
        length = self.max_sequence_length + int(grid.prod()) // pipe.processor.image_processor.merge_size**2
        if embeds.shape[1] > length:
            text_tokens = embeds.shape[1] - length + self.max_sequence_length
            raise ValueError(
                f"model.max_sequence_length={self.max_sequence_length}: the prompt {prompt!r} takes "
                f"{text_tokens} tokens besides its image's; raise it"
            )
        pixels = pipe.image_processor.preprocess(source, self.height, self.width).unsqueeze(2)
        latents = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None)  # [1, C, 1, h, w]
        return {**self._padded(embeds, length), "image_latents": self.pack(latents[:, :, 0])}

    def _image_tokens(self, hidden: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
        """The latents' tokens then the source's (``image_latents`` of each row), ``img_shapes`` with both."""
        _, h, w = self.latent_shape
        source = text["image_latents"].to(device=self.device, dtype=hidden.dtype)
        return torch.cat([hidden, source], dim=1), [[(1, h // 2, w // 2)] * 2] * hidden.shape[0]


# the estimate's data (flowrl.models.estimate_spec): Qwen-Image's transformer, each source's latent tokens after the
# generated ones and its vision tokens in the text
QwenImageEditFlowModel.estimate_spec = EstimateSpec(base="qwen_image", edit=True, vision=True)
