"""The loop's rewards: built and checked before the model loads (:func:`run_rewards`); a video reward asked of an
image model is refused at load (:func:`check_modality`), and a run whose every reward keeps failing stops, naming them
(:class:`FailedRewardStreak`).

Scoring itself sits below the loop: the port and the background scorer in :mod:`flowrl_rewards.core.port` and
:mod:`flowrl_rewards.background`, decoding and requesting a forest's scores in :mod:`flowrl.rollout.decoding` and
:mod:`flowrl.rollout.scoring`.
"""

from __future__ import annotations

from typing import Any, Sequence

from flowrl.config import build
from flowrl.config.schema import TrainConfig
from flowrl.errors import ConfigError
from flowrl.models.base import FlowModel
from flowrl.prompts.checks import check_run_prompts
from flowrl_rewards.core.port import Scorer


def check_modality(model: FlowModel, rewards: Sequence[tuple[str, Scorer]]) -> None:
    """At load, before the first rollout: a ConfigError naming the config key and the reward when a video reward
    (``modality="video"``) is asked of a model that samples images. ``rewards``: (config key, reward or
    MultiReward) pairs, e.g. ``[("rewards", train_reward), ("eval.rewards", eval_reward)]``."""
    if model.modality == "video":
        return  # image rewards score its frames (Reward.__call__), video rewards its videos
    for key, reward in rewards:
        for term in reward.terms:
            if term.modality == "video":
                raise ConfigError(
                    f"{key}: reward {term.name!r} ({type(term).__name__}) scores videos [B, F, 3, H, W] "
                    f"only (modality 'video'), but model family {model.family or type(model).__name__!r} "
                    "samples images [B, 3, H, W]; accepted with an image model: image rewards "
                    "(modality 'image'). Remove it, or train a video family (e.g. model.family=wan)"
                )


class RewardsFailed(FloatingPointError):
    """Every reward failed (all NaN) several iterations in a row: the run stops with exit status 3."""


class FailedRewardStreak:
    """Counts iterations in a row whose every leaf's reward failed (``reward_failed`` == ``leaves``); the
    ``limit``-th (``train.max_failed_iterations``) raises :class:`RewardsFailed` naming the rewards that failed
    and why (:attr:`flowrl_rewards.core.port.Scorer.failures` of the last call), instead of training on nothing."""

    def __init__(self, limit: int, reward: Scorer):
        self.limit, self.reward, self.count = int(limit), reward, 0

    def observe(self, record: dict[str, float]) -> None:
        """Fold in one iteration's metrics (global over processes, so every process decides alike)."""
        leaves, failed = record.get("leaves", 0.0), record.get("reward_failed", 0.0)
        self.count = self.count + 1 if leaves > 0 and failed >= leaves else 0
        if self.count >= self.limit:
            why = "; ".join(f"reward {name!r}: {text}" for name, text in self.reward.failures.items()) or (
                f"rewards {[r.name for r in self.reward.terms]} gave no error, but every combined reward was NaN"
            )
            raise RewardsFailed(
                f"every reward failed in {self.count} iterations in a row (train.max_failed_iterations="
                f"{self.limit}; the last: {failed:.0f} of {leaves:.0f} images); last error: {why}. Fix "
                "the reward (or its server) and continue with train.resume=latest"
            )


def run_rewards(c: TrainConfig, reward: Any = None, model: FlowModel | None = None) -> tuple[Scorer, Scorer]:
    """The run's training and eval rewards (``reward``: a name or a Scorer given in code (:func:`as_multi`), else
    ``c.rewards``; ``c.eval.rewards`` or the training one), after checking that each prompt line is scorable (source
    images where needed, with ``model`` when given) and that every reward is ready (e.g. a remote server answers):
    a bad prompt line or a server that is down fails before the model loads."""
    train = (
        as_multi(reward, c.reward_normalize)
        if reward is not None
        else build.build_rewards(c.rewards, c.reward_normalize)
    )
    held_out = build.build_rewards(c.eval.rewards, key="eval.rewards") if c.eval.rewards else train
    check_run_prompts(c, train, held_out, model)
    for r in {id(train): train, id(held_out): held_out}.values():
        r.check_ready()
    return train, held_out


def as_multi(reward: Any, normalize: str = "none") -> Scorer:
    """The training reward of a reward given in code: a reward name, a Reward or any other
    :class:`~flowrl_rewards.core.port.Scorer` of one term (its :attr:`~flowrl_rewards.core.port.Scorer.terms` is
    ``[itself]``) as the one term of a :class:`flowrl_rewards.MultiReward` combined by ``normalize``; a MultiReward, or
    a Scorer of several terms that combines them itself, as it is (its own ``normalize``)."""
    from flowrl_rewards import MultiReward, Reward

    if isinstance(reward, MultiReward):
        return reward
    if isinstance(reward, (str, Reward)):
        return MultiReward([{"name": reward} if isinstance(reward, str) else reward], normalize=normalize)
    if isinstance(reward, Scorer):
        terms = reward.terms
        alone = len(terms) == 1 and terms[0] is reward
        return MultiReward([reward], normalize=normalize) if alone else reward
    raise TypeError(
        "reward must be a name or a flowrl_rewards.Scorer (a Reward, a MultiReward or a Scorer of your own), "
        f"got {type(reward).__name__}"
    )
