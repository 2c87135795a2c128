"""The trainer's part of ``train.pipeline: async`` (:mod:`flowrl.training.pipeline`): its link to the rollout side and
the jobs it hands over.

:class:`TrainerPipeline` is mixed into :class:`~flowrl.training.trainer.Trainer`, whose ``cfg``, ``accelerator``,
``layout``, ``params``, ``runner``, ``objective``, ``guidance`` and ``rollouts`` it reads."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from flowrl.distributed.process_group import ProcessGroup
from flowrl.rollout.forest import Forest
from flowrl.rollout.runner import RolloutRunner
from flowrl.training.pipeline import AsyncRollouts, RolloutJob, split_threads
from flowrl.training.rollout_process import DistLink, LocalRolloutProcess, layout_of
from flowrl.training.trainable import rollout_runner


class TrainerPipeline:
    """Linking a :class:`~flowrl.training.trainer.Trainer` to its rollout side (mixed into it)."""

    def _join_layout(self) -> tuple[object, list[int]] | None:
        """Make the groups of ``train.rollout_processes`` (on every launched process; ``layout``), and return the
        trainers' group and ranks (None: every process trains). A launched rollout process gets a plain
        :class:`ProcessGroup` here, only to close the process group with every process at the end."""
        self.layout = layout_of(self.cfg, self.accelerator)
        if self.rolls_out:
            self.group = ProcessGroup(self.accelerator)
        return (self.layout.trainer_group, self.layout.trainers) if self.layout is not None else None

    def _rollout_runner(self) -> RolloutRunner:
        """This process's rollouts in its own process: the plan over the policy, scored by the training reward (a
        ``sync`` run's every iteration; ``async``: the prompt groups of each job, and ``flowrl snr``'s rollouts)."""
        return rollout_runner(
            self.cfg, self.plan, self.model, self.reward, self.objective, self.prompts, self.group, self.guidance
        )

    def _pipeline(self, rollout_threads: int | None) -> AsyncRollouts:
        """The trainer's side of the pipeline, linked to its rollout process: one it starts beside itself, or the
        launched rollout process of ``train.rollout_processes`` that serves it."""
        c, rank, layout = self.cfg, self.accelerator.process_index, self.layout
        if layout is None:
            connect = functools.partial(LocalRolloutProcess, c, rollout_threads, self.accelerator.device)
            return AsyncRollouts(c, self.params, self._job, connect)
        connect = functools.partial(DistLink, layout.rollout_of(rank), layout.pairs[rank], "stop")
        return AsyncRollouts(c, self.params, self._job, connect, sends_weights=layout.sends_weights(rank))

    @contextlib.contextmanager
    def idle_rollout_threads(self) -> Iterator[None]:
        """While a rollout process beside this trainer has no job in flight (the closing eval after the last
        iteration), the trainer computes on both sides' CPU threads (``train.num_threads``), then on its own share
        again. Elsewhere (``sync``, a launched rollout process, jobs still in flight): nothing changes."""
        mine, theirs = split_threads(self.cfg.train)
        lend = self.rollouts is not None and self.layout is None and not self.rollouts.pending and mine and theirs
        if lend:
            torch.set_num_threads(mine + theirs)
        try:
            yield
        finally:
            if lend:
                torch.set_num_threads(mine)

    @property
    def rolls_out(self) -> bool:
        """Whether this process is one of the launched rollout processes (``train.rollout_processes``)."""
        return self.layout is not None and self.layout.rolls_out

    def _job(self, iteration: int) -> RolloutJob:
        """The rollout of ``iteration`` as this process hands it to its rollout process: its prompt groups now, the
        teacher's share and the guidance as they stand (with staleness s, after iteration − s − 1 updates)."""
        prompts, offset = self.runner.local_prompts(iteration)
        return RolloutJob(iteration, prompts, offset, self.objective.teacher_fraction(), self.guidance)

    def next_forest(self, iteration: int) -> tuple[Forest, dict[str, float], dict[str, float]]:
        """The scored forest of ``iteration``, its timings and its plan's metrics: rolled out here (``sync``), or taken
        from the rollout process (``async``; started here when the loop did not start it)."""
        if self.rollouts is None:
            forest, times = self.rollout(iteration)
            return forest, times, self.plan.metrics(forest)
        if not self.rollouts.started:
            self.rollouts.start(iteration)
        return self.rollouts.receive(iteration)
