"""Reward plugins for flowrl: one port (:class:`Scorer`: what flowrl calls), one interface (:class:`Reward`), a
registry, a weighted combiner, and the background scorer that overlaps scoring with sampling."""

from flowrl_rewards.background import BackgroundScorer
from flowrl_rewards.core.base import Reward
from flowrl_rewards.core.multi import MultiReward, RewardSpec
from flowrl_rewards.core.port import Scorer
from flowrl_rewards.core.registry import REGISTRY, build_reward, register

__all__ = ["Scorer", "Reward", "REGISTRY", "build_reward", "register", "MultiReward", "RewardSpec", "BackgroundScorer"]

register("temporal_consistency", "flowrl_rewards.heuristics.temporal:TemporalConsistency")
register("source_fidelity", "flowrl_rewards.heuristics.source_fidelity:SourceFidelity")
