"""Scoring a rollout's states: decode the states a forest asks to be scored and hand them, with what the rewards
receive for their prompts, to the background scorer (:class:`flowrl_rewards.background.BackgroundScorer`), so scoring
overlaps the next rollout::

    scorer = loop_scorer(multi_reward, enabled="auto")
    nodes, future = request_scores(scorer, model, forest, max_batch)   # leaves + probed states
    ...                                                                 # next rollout runs meanwhile
    forest.record_scores(nodes, future.result())                        # raw score per reward term
    forest.combine_scores(multi_reward.combine)                         # reward (leaves), value (probes)

:func:`components_of` is the one place flowrl calls a reward: a prompt that carries a source image reaches the
rewards as its instruction text with ``meta["source_images"]`` (:func:`flowrl.models.image_prompts.reward_inputs`).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Sequence

import torch

from flowrl.models.base import FlowModel
from flowrl.models.image_prompts import reward_inputs
from flowrl.rollout.decoding import decode, not_waiting
from flowrl_rewards.background import BackgroundScorer, reward_waits
from flowrl_rewards.core.port import Scorer


def components_of(
    reward: Scorer, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Each term's scores ``{name: float32 [B]}`` of images [B, 3, H, W] (videos [B, F, 3, H, W]):
    :meth:`~flowrl_rewards.core.port.Scorer.components` of what the rewards receive for ``prompts``, a wait on a reward
    that a stop of the training loop cuts short (:data:`~flowrl_rewards.background.reward_waits`)."""
    prompts, meta = reward_inputs(prompts, meta, images)
    with reward_waits.waiting():  # a stop of the training loop cuts a reward that does not answer short
        return reward.components(images, prompts, meta)


def loop_scorer(reward: Scorer, enabled: bool | str = True) -> BackgroundScorer:
    """The loop's background scorer of ``reward``: its worker scores as :func:`components_of` does."""
    return BackgroundScorer(reward, enabled, inputs=reward_inputs)


def request_scores(
    scorer: BackgroundScorer, model: FlowModel, forest, max_batch: int
) -> "tuple[torch.Tensor, cf.Future[dict[str, torch.Tensor]]]":
    """Decode every state ``forest`` asks to be scored (leaves, then probes) and submit them to ``scorer``.
    Returns the scored nodes [S] and the future of their raw scores ``{name: [S]}``; counts the decoded
    states in ``forest.counters["scored"]``. The host does not wait for the decodes: the scorer's thread does
    (:func:`~flowrl.rollout.decoding.decode_to_host`), so with a background scorer the next rollout is launched at
    once."""
    nodes, x0 = forest.score_requests()
    with not_waiting() as events:
        images = decode(model, x0, max_batch)
    ready = events[-1] if events else None
    forest.counters["scored"] = forest.counters.get("scored", 0) + int(nodes.numel())
    return nodes, scorer.submit(images, [forest.prompts[g] for g in forest.group[nodes].tolist()], {}, ready=ready)
