"""One iteration's rollout and scoring: the prompt groups of this process, the plan's forest, the rewards
of every leaf (and every probed state), optionally in chunks whose scoring overlaps the next chunk's
rollout (``rollout.chunks``, ``train.async_reward``)."""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from flowrl.rollout.base import RolloutContext, RolloutPlan
from flowrl.rollout.forest import Forest
from flowrl.rollout.scoring import loop_scorer, request_scores
from flowrl_rewards.background import BackgroundScorer
from flowrl_rewards.core.port import Scorer


class PromptShards(Protocol):
    """This process's share of the prompts (:class:`flowrl.distributed.process_group.ProcessGroup` is one)."""

    def shard(self, items: Sequence[str]) -> tuple[list[str], int]:
        """This process's items and the global index of its first."""


class RolloutRunner:
    """``run(iteration)`` → (scored forest, timings) for this process's share of the iteration's prompts."""

    def __init__(
        self,
        plan: RolloutPlan,
        model,
        reward: Scorer,
        prompts,
        group: PromptShards,
        *,
        seed: int,
        guidance: float,
        max_batch: int,
        chunks: int,
        reduction: str,
        async_reward: bool | str = "auto",
        teacher=None,
    ):
        self.plan, self.model, self.reward, self.prompts, self.group = plan, model, reward, prompts, group
        self.seed, self.guidance, self.max_batch, self.chunks, self.reduction = (
            seed,
            guidance,
            max_batch,
            chunks,
            reduction,
        )
        self.async_reward = async_reward
        self.teacher = teacher  # the objective's guided teacher (plans may let it draw a share of each group)
        self._scorer: BackgroundScorer | None = None

    @property
    def scorer(self) -> BackgroundScorer:
        """The reward scorer (a background thread when enabled), started on first use and after :meth:`close`."""
        if self._scorer is None:
            self._scorer = loop_scorer(self.reward, enabled=self.async_reward)
        return self._scorer

    def local_prompts(self, iteration: int) -> tuple[list[str], int]:
        """This process's prompt groups for ``iteration`` and the global index of its first group."""
        return self.group.shard(self.prompts.batch(iteration))

    def run(self, iteration: int, teacher_fraction: float = 1.0) -> tuple[Forest, dict[str, float]]:
        """Sample the forest of ``iteration`` and score it (no gradients): every leaf and every state the
        plan probed gets its reward terms in ``reward_components`` and its combined score in ``reward``
        (leaves) or ``value`` (probed states).

        With ``chunks`` > 1 the prompt groups are rolled out in parts; each part's states are decoded and
        handed to the scorer (a background thread when enabled) while the next part rolls out. Seeds are
        addressed by global group, so chunking changes no draw. The terms are combined after the last part,
        over the whole iteration.
        """
        prompts, offset = self.local_prompts(iteration)
        return self.run_prompts(iteration, prompts, offset, teacher_fraction)

    def run_prompts(
        self, iteration: int, prompts: list[str], offset: int, teacher_fraction: float = 1.0
    ) -> tuple[Forest, dict[str, float]]:
        """:meth:`run` on given prompt groups (``offset``: the global index of the first): what a rollout process of
        ``train.pipeline=async`` runs for the jobs the trainer hands it (:mod:`flowrl.training.pipeline`)."""
        n_chunks = min(self.chunks, len(prompts))
        bounds = [len(prompts) * k // n_chunks for k in range(n_chunks + 1)]
        self.model.trainable.eval()
        parts = []
        t_sample = t_score = 0.0
        for a, b in zip(bounds[:-1], bounds[1:]):
            ctx = RolloutContext(
                seed=self.seed,
                iteration=iteration,
                group_offset=offset + a,
                guidance=self.guidance,
                max_batch=self.max_batch,
                reduction=self.reduction,
                teacher=self.teacher,
                teacher_fraction=teacher_fraction,
            )
            t0 = time.perf_counter()
            forest = self.plan.rollout(self.model, prompts[a:b], ctx)
            nodes, future = request_scores(self.scorer, self.model, forest, self.max_batch)
            t1 = time.perf_counter()
            parts.append((forest, nodes, future))
            t_sample += t1 - t0
            t_score += time.perf_counter() - t1
        t2 = time.perf_counter()
        for forest, nodes, future in parts:
            forest.record_scores(nodes, future.result())
        forest = Forest.merge([f for f, _, _ in parts])
        forest.combine_scores(self.reward.combine)
        t_score += time.perf_counter() - t2  # waiting for the scorer after the last part
        return forest, {"time/rollout": t_sample, "time/reward": t_score}

    def close(self) -> None:
        """Stop the background scorer's thread (a later :meth:`run` starts a new one)."""
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None
