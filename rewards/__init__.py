"""Reward plugins for flowrl: one interface (:class:`Reward`), a registry, and a weighted combiner."""
from flowrl_rewards.base import Reward
from flowrl_rewards.registry import REGISTRY, build_reward, register
from flowrl_rewards.multi import MultiReward, RewardSpec

__all__ = ["Reward", "REGISTRY", "build_reward", "register", "MultiReward", "RewardSpec"]

register("temporal_consistency", "flowrl_rewards.temporal:TemporalConsistency")
register("source_fidelity", "flowrl_rewards.source_fidelity:SourceFidelity")
