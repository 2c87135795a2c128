"""GDRO's hacking-corrected evaluation score (Wang et al. 2026, arXiv 2601.02036, "corrected score"): the
evaluation reward r discounted by an independent judge of image quality, so a rise of r bought by degrading the
images (reward hacking) stops counting as progress::

    r_corrected = r · (û − 3) + 0.2

û: the mean of UnifiedReward's three 1–5 scores of the image (alignment, coherence, style). In the paper r and û
are a model's held-out means (their Table 3: FLUX.1 OCR 0.5843 with û ≈ 3.43 gives 0.4486); as a reward term the
same formula is applied per image (``gdro_corrected`` scores, whose mean carries the covariance of r and û), and
:meth:`CorrectedScore.evaluate` reports the paper's form from the means (``eval/gdro_corrected/corrected``, with
``reward`` r̄ and ``quality`` ū beside it: exact for one process; several processes average their own).

    eval:
      rewards:
        - name: gdro_corrected
          kwargs:
            reward: {name: ocr}
            quality:             # each term's score mapped from quality_range onto 1–5; û = their mean
              - {name: vlm_judge, kwargs: {score: pattern, pattern: 'Alignment Score:\\s*([0-9.]+)', ...}}
              - ...
            quality_range: [0, 1]   # vlm_judge's pattern scores are already mapped onto [0, 1]

A term is a registry name or ``{name, kwargs}``; ``center`` (3) and ``offset`` (0.2) are the paper's constants.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from flowrl_rewards.core.base import Reward
from flowrl_rewards.core.registry import build_reward, term_spec

UNIFIED_REWARD_SCALE = (1.0, 5.0)  # UnifiedReward's score range, on which center 3 is its midpoint


class CorrectedScore(Reward):
    """r·(û − ``center``) + ``offset`` per image (module docstring). ``reward``: the evaluation reward r (a term);
    ``quality``: one term or a list whose mean, each mapped from ``quality_range`` [lo, hi] onto UnifiedReward's
    1–5, is û (``quality_range: null``: the terms already score on 1–5). Adds to ``meta``:
    ``gdro_corrected/reward`` and ``gdro_corrected/quality`` (float32 [B])."""

    name = "gdro_corrected"
    nested_terms = {"reward": False, "quality": True}

    def __init__(
        self,
        reward: Any,
        quality: Any,
        quality_range: Sequence[float] | None = (0.0, 1.0),  # [lo, hi]: the range the quality terms score in, mapped
        # onto UnifiedReward's 1–5; null: they already score on 1–5
        center: float = 3.0,  # the c of r·(û − c) + offset: the paper's 3, the middle of 1–5
        offset: float = 0.2,  # added to r·(û − center): the paper's 0.2
    ):
        name, kwargs = term_spec(reward, "reward", "gdro_corrected")
        self.reward = build_reward(name, **kwargs)
        terms = quality if isinstance(quality, (list, tuple)) else [quality]
        if not terms:
            raise ValueError(
                "gdro_corrected: quality=[] must name at least one quality reward (the paper: "
                "UnifiedReward's alignment, coherence and style)"
            )
        self.quality = [
            build_reward(name, **kw)
            for name, kw in (term_spec(q, f"quality[{i}]", "gdro_corrected") for i, q in enumerate(terms))
        ]
        if quality_range is not None:
            lo, hi = (float(v) for v in quality_range) if len(quality_range) == 2 else (math.nan, math.nan)
            if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
                raise ValueError(
                    f"gdro_corrected: quality_range={list(quality_range)} must be [lo, hi] with lo < hi "
                    "(the range the quality terms score in; null: they score on 1–5)"
                )
            quality_range = (lo, hi)
        for key, value in (("center", center), ("offset", offset)):
            if not math.isfinite(float(value)):
                raise ValueError(f"gdro_corrected: {key}={value!r} must be a finite number")
        self.quality_range, self.center, self.offset = quality_range, float(center), float(offset)
        self.modality = "any" if any(t.modality != "image" for t in [self.reward, *self.quality]) else "image"
        self._last: tuple | None = None  # (images, prompts, r, û) of the last call: evaluate reuses it

    def check_prompt(self, prompt: str) -> None:
        for term in (self.reward, *self.quality):
            term.check_prompt(prompt)

    def check_ready(self) -> None:
        for term in (self.reward, *self.quality):
            term.check_ready()

    def to_unified_scale(self, q: torch.Tensor) -> torch.Tensor:
        """Quality scores [B] mapped from ``quality_range`` onto 1–5 (as they are without a range)."""
        if self.quality_range is None:
            return q
        lo, hi = self.quality_range
        a, b = UNIFIED_REWARD_SCALE
        return a + (b - a) * (q - lo) / (hi - lo)

    def parts(
        self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(r [B], û [B]) of ``images``: the reward and the mean of the mapped quality terms (cached for the same
        call)."""
        last = self._last
        if last is not None and last[0] is images and last[1] == list(prompts):
            return last[2], last[3]
        r = self.reward(images, prompts, meta).float()
        u = torch.stack([self.to_unified_scale(q(images, prompts, meta).float()) for q in self.quality]).mean(0)
        self._last = (images, list(prompts), r, u)
        return r, u

    def score(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """float32 [B]: r·(û − center) + offset (NaN where r or û is)."""
        r, u = self.parts(images, prompts, meta)
        meta["gdro_corrected/reward"] = r
        meta["gdro_corrected/quality"] = u
        return r * (u - self.center) + self.offset

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
        """The paper's model-level form: ``corrected`` = r̄·(ū − center) + offset from the batch means ``reward`` r̄
        and ``quality`` ū (finite scores only), and ``n``."""
        r, u = self.parts(images, prompts, {})
        ok = torch.isfinite(r) & torch.isfinite(u)
        if not bool(ok.any()):
            return {"corrected": float("nan"), "reward": float("nan"), "quality": float("nan"), "n": len(prompts)}
        rm, um = float(r[ok].mean()), float(u[ok].mean())
        return {"corrected": rm * (um - self.center) + self.offset, "reward": rm, "quality": um, "n": int(ok.sum())}
