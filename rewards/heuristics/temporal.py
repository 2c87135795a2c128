"""Temporal consistency of a video: how little consecutive frames differ (higher = less flicker)."""

from __future__ import annotations

import torch

from flowrl_rewards.core.base import Reward


class TemporalConsistency(Reward):
    """Score = 1 − the mean absolute pixel difference of consecutive frames, in [0, 1]: 1 for a still video,
    lower the more the frames flicker or jump. A video reward (``modality="video"``): it needs videos
    [B, F, 3, H, W]; with ``frame_stride`` k it compares frames k apart. A one-frame video scores 1.

    No model, CPU only, deterministic; pixel differences, so it also rewards slow motion (pair it with a
    per-frame quality reward, which it cannot replace).
    """

    name = "temporal_consistency"
    modality = "video"

    def score(self, images, prompts, meta):
        frames = images.float().clamp(0, 1)
        if frames.shape[1] < 2:
            return torch.ones(frames.shape[0])
        return 1.0 - (frames[:, 1:] - frames[:, :-1]).abs().mean(dim=(1, 2, 3, 4))
