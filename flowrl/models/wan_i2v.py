"""`FlowModel` adapter for ``WanImageToVideoPipeline`` in Wan 2.2 I2V-A14B's layout: a prompt's image is the first frame
of the video generated.

A prompt carries its image: ``"[image: PATH] PROMPT"`` (:mod:`flowrl.models.image_prompts`, as Qwen-Image-Edit's
instructions). Everything else is :class:`~flowrl.models.wan.WanFlowModel`'s (video latents [B, 16, F, h, w] and their
noise, UMT5 text, timestep σ·1000, CFG, the two experts and their boundary, schedule, decode); what the image-to-video
pipeline adds, as ``WanImageToVideoPipeline.__call__`` applies it:

- the image, resized to the video's ``height`` × ``width`` (Lanczos, :func:`~flowrl.models.image_prompts.source_pil`)
  and preprocessed by the pipeline's video processor, becomes the pipeline's own ``prepare_latents`` condition
  ``image_condition`` [1, 4 + C, F, h, w]: a first-frame mask (4 channels: the first frame's 4 video frames marked 1)
  and the VAE latent (``argmax``, normalised per channel) of the image followed by ``num_frames`` − 1 black frames.
  Encoded once per prompt string and cached with its text embedding.
- every transformer call takes ``[latents, image_condition]`` along the channels (4 + 2C = 36 for A14B); the
  unconditional rows of CFG carry the same condition (:meth:`_negative_prompts`: the negative prompt on the same image).

Refused: the Wan 2.1 I2V transformers (``image_dim``: a CLIP image embedding in the cross-attention, not built here)
and TI2V-5B's image mode (``expand_timesteps``: the first frame's latent replaced, timestep 0 on its tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.models.estimate_spec import EstimateSpec
from flowrl.models.image_prompts import FORM, image_prompt, source_pil, split_image_prompt
from flowrl.models.wan import WanFlowModel

if TYPE_CHECKING:
    from typing import Unpack

    from flowrl.models.setup import AdapterOptions


class WanI2VFlowModel(WanFlowModel):
    """Adapter over a ``WanImageToVideoPipeline`` (Wan 2.2 I2V-A14B); arguments as :class:`WanFlowModel`'s (the
    pipeline's ``guidance_scale`` 5.0, 480 × 832, 81 frames, 512 UMT5 tokens; ``guidance_2`` and ``experts`` for two
    experts)."""

    family = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    takes_source_image = True

    def __init__(
        self,
        pipe,
        *,
        guidance: float = 5.0,
        num_frames: int = 81,
        max_sequence_length: int = 512,
        guidance_2: float | None = None,
        experts: str | None = None,
        **options: Unpack[AdapterOptions],
    ):
        """Wan's keywords (:class:`~flowrl.models.wan.WanFlowModel`), named here so the config check reads them."""
        transformer = pipe.transformer
        if transformer.config.get("image_dim") is not None:
            raise ValueError(
                "WanI2VFlowModel drives Wan 2.2 I2V-A14B's layout (the image's latent in the input channels); "
                f"this transformer takes a CLIP image embedding too (image_dim={transformer.config.image_dim}, "
                "Wan 2.1 I2V), which is not supported"
            )
        if pipe.config.get("expand_timesteps", False):
            raise ValueError(
                "WanI2VFlowModel does not run TI2V-5B's image mode (expand_timesteps); use model.family: wan for "
                "its text-to-video use"
            )
        super().__init__(
            pipe,
            guidance=guidance,
            num_frames=num_frames,
            max_sequence_length=max_sequence_length,
            guidance_2=guidance_2,
            experts=experts,
            **options,
        )

    @property
    def latent_channels(self) -> int:
        """C of the generated latent: the VAE's ``z_dim`` (the transformer's input adds the image condition)."""
        return self.pipe.vae.config.z_dim

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The negative prompt on each prompt's own image (the pipeline conditions both CFG branches on it)."""
        return [image_prompt(self.negative_prompt, self._split(p)[1]) for p in prompts]

    @staticmethod
    def _split(prompt: str) -> tuple[str, str]:
        """(prompt text, image path) of ``prompt``; a prompt without an image is refused."""
        text, path = split_image_prompt(prompt)
        if path is None:
            raise ValueError(
                f"model family 'wan_i2v' animates an image, and the prompt {prompt!r} carries none; accepted: {FORM}"
            )
        return text, path

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [1, L, D] (:meth:`WanFlowModel._encode_one` of the text) and ``image_condition``
        [1, 4 + C, F, h, w] fp32: the pipeline's ``prepare_latents`` condition of the prompt's image."""
        text, path = self._split(prompt)
        pipe = self.pipe
        pixels = pipe.video_processor.preprocess(source_pil(path, self.height, self.width), self.height, self.width)
        placeholder = torch.zeros(1, *self.latent_shape)  # the noise is the adapter's: no draw from the global RNG
        _, condition = pipe.prepare_latents(
            pixels.to(self.device, torch.float32),
            1,
            self.latent_channels,
            self.height,
            self.width,
            self.num_frames,
            torch.float32,
            self.device,
            None,
            placeholder,
        )
        return {**super()._encode_one(text), "image_condition": condition}

    def _model_input(self, hidden: torch.Tensor, text: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[latents, image_condition]`` along the channels: [R, 4 + 2C, F, h, w]."""
        return torch.cat([hidden, text["image_condition"].to(hidden.dtype)], dim=1)


# the estimate's data (flowrl.models.estimate_spec): Wan's transformer inputs and decode (its input channels the
# noise's and the first frame's condition, which the latent shape counts)
WanI2VFlowModel.estimate_spec = EstimateSpec(base="wan", video=True)
