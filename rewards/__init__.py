"""Reward plugins for flowrl: one interface (:class:`Reward`), a registry, and a weighted combiner."""
from rewards.base import Reward
from rewards.registry import REGISTRY, build_reward, register
from rewards.multi import MultiReward, RewardSpec

__all__ = ["Reward", "REGISTRY", "build_reward", "register", "MultiReward", "RewardSpec"]

register("temporal_consistency", "rewards.temporal:TemporalConsistency")
register("source_fidelity", "rewards.source_fidelity:SourceFidelity")
