"""Side jobs of the loop as callbacks (TRL's ``TrainerCallback``): each is called at the end of every iteration and
every eval, and may add metrics or stop the run; the loop itself only calls them in order.

``Trainer(config, callbacks=[...])`` adds a user's after the built-in ones (:func:`default_callbacks`):
:class:`TeacherShareMetrics`, :class:`StopOnFailedRewards` (``train.max_failed_iterations``) and
:class:`GuardOnEval` (``eval.guard``). A callback keeps its own state; the trainer's checkpoints hold the guard's.
"""

from __future__ import annotations

from typing import Any


class Callback:
    """Base of the loop's side jobs; every hook's default does nothing.

    - :meth:`on_iteration`: the iteration's scored, credited, trained ``forest`` and its ``record`` so far
      (global metrics); returns metrics to add to the record (global: reduce over ``trainer.group`` inside);
    - :meth:`on_iteration_end`: the finished record, after it was logged; may raise to stop the run (the record is
      kept);
    - :meth:`on_eval_end`: an eval's record (``step`` and its metrics); returns metrics to add to it.
    """

    def on_iteration(self, trainer, forest, record: dict[str, Any]) -> dict[str, float]:
        return {}

    def on_iteration_end(self, trainer, record: dict[str, Any]) -> None:
        """Called after the iteration's record was written."""

    def on_eval_end(self, trainer, record: dict[str, Any]) -> dict[str, Any]:
        return {}


class TeacherShareMetrics(Callback):
    """The guided teacher's share of the iteration's samples and their rewards (none unless it drew samples)."""

    def on_iteration(self, trainer, forest, record: dict[str, Any]) -> dict[str, float]:
        from flowrl.objectives.teacher import teacher_share_metrics

        return teacher_share_metrics(forest, trainer.group)


class StopOnFailedRewards(Callback):
    """Every reward failed (all NaN) ``limit`` iterations in a row: the run stops with exit status 3, naming the
    rewards and why (:class:`~flowrl.training.scoring.FailedRewardStreak`)."""

    def __init__(self, limit: int, reward):
        from flowrl.training.scoring import FailedRewardStreak

        self.streak = FailedRewardStreak(limit, reward)

    def on_iteration_end(self, trainer, record: dict[str, Any]) -> None:
        self.streak.observe(record)


class GuardOnEval(Callback):
    """The eval guard's verdict on every eval (``eval.guard``: the stop when an eval reward falls from its start
    value); its trip is read by the loop through ``guard.stop``."""

    def __init__(self, guard):
        self.guard = guard

    def on_eval_end(self, trainer, record: dict[str, Any]) -> dict[str, Any]:
        return self.guard.observe(int(record["step"]), record)


def default_callbacks(cfg, reward, guard) -> list[Callback]:
    """The built-in side jobs of a run of ``cfg`` whose training reward is ``reward`` and whose guard is ``guard``."""
    return [TeacherShareMetrics(), StopOnFailedRewards(cfg.train.max_failed_iterations, reward), GuardOnEval(guard)]
