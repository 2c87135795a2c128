"""2×2 latent packing shared by the adapters of pipelines that feed their transformer patch tokens
(``QwenImagePipeline``; ``FluxPipeline`` packs the same way).

Such a pipeline packs every 2×2 patch of a ``[B, C, H, W]`` latent into one token of ``4C`` channels
(``_pack_latents``), samples with ``sigmas = linspace(1, 1/steps, steps)`` shifted by ``mu`` from the
number of image tokens, and unpacks the transformer's output (``_unpack_latents``). :class:`Packed2x2`
gives an adapter exactly that, ahead of :class:`~flowrl.models.base.FlowModel` in its bases::

    class FluxFlowModel(Packed2x2, FlowModel): ...
"""

from __future__ import annotations

import numpy as np
import torch


def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] → tokens [B, (H/2)(W/2), 4C], row-major over patches, channels then (dy, dx) in a token
    (the pipelines' ``_pack_latents``)."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Tokens [B, (h/2)(w/2), 4C] → [B, C, h, w], the inverse of :func:`pack_2x2` (the pipelines'
    ``_unpack_latents`` without their frame axis)."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


class Packed2x2:
    """FlowModel hooks of a 2×2-packing family: latent channels, image tokens, the pipeline's unshifted
    sigmas, ``pack`` / ``unpack`` of the adapter's latent shape."""

    @property
    def latent_channels(self) -> int:
        """Channels C of an unpacked latent: ``in_channels`` / 4 (a token holds a 2×2 patch)."""
        return self.pipe.transformer.config.in_channels // 4

    @property
    def image_seq_len(self) -> int:
        """Number of image tokens, (h/2)·(w/2) of the latent; ``mu`` of dynamic shifting depends on it."""
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    def _schedule_sigmas(self, steps: int) -> np.ndarray | None:
        """The pipelines' ``linspace(1, 1/steps, steps)``, shifted by the scheduler with ``mu`` from
        :attr:`image_seq_len` (:meth:`FlowModel.schedule`); None when the scheduler uses flow sigmas."""
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            return None
        return np.linspace(1.0, 1 / steps, steps)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] → tokens [B, (H/2)(W/2), 4C] (:func:`pack_2x2`)."""
        return pack_2x2(x)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, (H/2)(W/2), 4C] → [B, C, H, W] at the adapter's latent size (:func:`unpack_2x2`)."""
        _, h, w = self.latent_shape
        return unpack_2x2(tokens, h, w)
