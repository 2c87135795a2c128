"""Fidelity of an edit to its source image: how much of the source survives (higher = closer to the source)."""

from __future__ import annotations

import torch.nn.functional as F

from flowrl_rewards.core.base import Reward


class SourceFidelity(Reward):
    """Score = 1 − the mean absolute pixel difference between the sample and its prompt's source image, both
    average-pooled to ``size`` × ``size`` (default 32), in [0, 1]: 1 for an unchanged layout and colours,
    lower the more the edit repaints. For image-editing runs (prompts ``[image: PATH] INSTRUCTION``): the
    source arrives as ``meta["source_images"]`` [B, 3, H, W] (:mod:`flowrl.models.image_prompts`); a run whose
    prompts carry no image is refused at load (``needs_source_image``).

    No model, CPU only, deterministic. It guards an instruction reward (e.g. CLIP or PickScore of the
    instruction) against edits that throw the source away; alone it rewards doing nothing.
    """

    name = "source_fidelity"
    needs_source_image = True

    def __init__(
        self,
        size: int = 32,  # the side in pixels both images are average-pooled to (>= 1)
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"reward 'source_fidelity': size={size!r} must be an integer >= 1 (pixels of the pooled comparison)"
            )
        self.size = size

    def score(self, images, prompts, meta):
        sources = meta.get("source_images")
        if sources is None:
            raise ValueError(
                "reward 'source_fidelity' compares each sample with its prompt's source image, and "
                "none was given (meta['source_images']); its prompts must read '[image: PATH] ...'"
            )
        pool = lambda x: F.adaptive_avg_pool2d(x.float().clamp(0, 1), self.size)
        return 1.0 - (pool(images) - pool(sources.to(images.device))).abs().mean(dim=(1, 2, 3))
