"""Several rewards combined with weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rewards.base import Reward
from rewards.registry import build_reward


@dataclass
class RewardSpec:
    """One term of a :class:`MultiReward`: registry name (or ``module:Class``), weight, kwargs."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


class MultiReward(Reward):
    """Weighted sum of rewards. :meth:`components` returns each term's raw scores so a credit rule
    can normalise per reward (``per_reward_norm``) instead of summing raw values."""

    name = "multi"

    def __init__(self, terms: Sequence[RewardSpec | dict | Reward], weights: Sequence[float] | None = None):
        self.rewards: list[Reward] = []
        self.weights: list[float] = []
        for i, term in enumerate(terms):
            if isinstance(term, Reward):
                reward, weight = term, 1.0
            else:
                spec = term if isinstance(term, RewardSpec) else RewardSpec(**term)
                reward, weight = build_reward(spec.name, **dict(spec.kwargs)), float(spec.weight)
            if weights is not None:
                weight = float(weights[i])
            self.rewards.append(reward)
            self.weights.append(weight)
        if not self.rewards:
            raise ValueError("MultiReward needs at least one reward")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique inside one MultiReward, got {names}")

    def components(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None
                   ) -> dict[str, torch.Tensor]:
        """Raw scores of every term: name → float32 [B]."""
        meta = {} if meta is None else meta
        return {r.name: r(images, prompts, meta) for r in self.rewards}

    def combine(self, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """Weighted sum float32 [B] of the outputs of :meth:`components`."""
        total = None
        for reward, weight in zip(self.rewards, self.weights):
            term = weight * components[reward.name]
            total = term if total is None else total + term
        return total

    def score(self, images, prompts, meta):
        return self.combine(self.components(images, prompts, meta))
