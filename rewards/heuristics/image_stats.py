"""Model-free rewards from image statistics: JPEG size (DDPO's compressibility tasks), brightness,
saturation, redness. Cheap, deterministic, CPU-only; handy for tests and sanity runs."""

from __future__ import annotations

import io

import torch

from flowrl_rewards.core._common import to_pil
from flowrl_rewards.core.base import Reward


class _JpegSize(Reward):
    """Size of the image saved as JPEG, in kB (1 kB = 1000 bytes), as DDPO computes it."""

    sign = 1.0

    def __init__(
        self,
        quality: int = 95,  # the JPEG encoder's quality, an integer in 1..100
    ):
        if not isinstance(quality, int) or isinstance(quality, bool) or not 1 <= quality <= 100:
            raise ValueError(f"{type(self).__name__}: quality={quality!r} must be an integer in 1..100")
        self.quality = quality

    def score(self, images, prompts, meta):
        sizes = []
        for img in to_pil(images):
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=self.quality)
            sizes.append(buf.tell() / 1000.0)
        return self.sign * torch.tensor(sizes, dtype=torch.float32)


class JpegIncompressibility(_JpegSize):
    """Score = JPEG size in kB (quality 95): larger files (more detail, more noise) score higher.

    kwargs: ``quality`` (int 1..100, default 95).
    """

    name = "jpeg_incompressibility"
    sign = 1.0


class JpegCompressibility(_JpegSize):
    """Score = −JPEG size in kB (quality 95): smaller files (flat, simple images) score higher.

    kwargs: ``quality`` (int 1..100, default 95).
    """

    name = "jpeg_compressibility"
    sign = -1.0


class Brightness(Reward):
    """Mean pixel value over all channels, in [0, 1]."""

    name = "brightness"

    def score(self, images, prompts, meta):
        return images.float().clamp(0, 1).mean(dim=(1, 2, 3))


class Saturation(Reward):
    """Mean HSV saturation ``(max − min) / max`` over pixels (0 for black pixels), in [0, 1]."""

    name = "saturation"

    def score(self, images, prompts, meta):
        x = images.float().clamp(0, 1)
        hi, lo = x.max(dim=1).values, x.min(dim=1).values
        sat = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi))
        return sat.mean(dim=(1, 2))


class Redness(Reward):
    """Mean of ``R − (G + B) / 2`` over pixels, in [−1, 1]."""

    name = "redness"

    def score(self, images, prompts, meta):
        x = images.float().clamp(0, 1)
        return (x[:, 0] - 0.5 * (x[:, 1] + x[:, 2])).mean(dim=(1, 2))
