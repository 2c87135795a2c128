"""Side jobs of the loop as callbacks that control it (TRL's ``TrainerCallback`` and ``TrainerControl``): each is
called at the end of every iteration and every eval and after a resume; it may add metrics, and it asks the loop to
save, evaluate or stop through the :class:`TrainerControl` it is handed. The loop only calls them in order and does
what the control says: a callback's :class:`Stop` is the one way a run ends before ``train.max_steps`` (a signal and
``train.max_minutes`` end it too, as a stop of their own).

``Trainer(config, callbacks=[...])`` adds a user's after the built-in ones (:func:`default_callbacks`):
:class:`TeacherShareMetrics`, :class:`StopOnFailedRewards` (``train.max_failed_iterations``) and
:class:`GuardOnEval` (``eval.guard``). A callback's state (:meth:`Callback.state_dict`) is in every checkpoint, under
its :attr:`Callback.key`, and given back on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stop:
    """Why a run stops: ``reason`` (the callback's word for it), ``message`` (what the loop says), ``exit_status``
    (what ``flowrl train`` exits with), ``save`` (a checkpoint of the step reached is written), ``final_eval`` (the
    closing eval still runs), ``detail`` (the callback's own record of it) and ``error`` (raised once the loop has
    ended, e.g. a failure the run must not hide)."""

    reason: str
    message: str
    exit_status: int = 0
    save: bool = True
    final_eval: bool = False
    detail: dict[str, Any] | None = None
    error: BaseException | None = None


@dataclass
class TrainerControl:
    """What the callbacks ask of the loop: after this iteration ``should_save`` a checkpoint and ``should_evaluate``
    (both reset every iteration), and ``stop`` (the first :class:`Stop` asked for: the loop ends)."""

    should_save: bool = False
    should_evaluate: bool = False
    stop: Stop | None = field(default=None)

    def request_stop(self, stop: Stop) -> None:
        """End the run (the first request stands)."""
        if self.stop is None:
            self.stop = stop

    def next_iteration(self) -> None:
        self.should_save = self.should_evaluate = False


class Callback:
    """Base of the loop's side jobs; every hook's default does nothing.

    - :meth:`on_iteration`: the iteration's scored, credited, trained ``forest`` and its ``record`` so far
      (global metrics); returns metrics to add to the record (global: reduce over ``trainer.group`` inside);
    - :meth:`on_iteration_end`: the finished record, after it was logged; may ask the ``control`` to save, evaluate
      or stop;
    - :meth:`on_eval_end`: an eval's record (``step`` and its metrics); returns metrics to add to it, and may ask the
      ``control`` to stop;
    - :meth:`on_resume`: after a checkpoint's state was loaded (this callback's own included); returns a line to say,
      or None, and may ask the ``control`` to stop before any training;
    - :meth:`state_dict` / :meth:`load_state_dict`: what a checkpoint keeps of it (None: nothing), under :attr:`key`.
    """

    @property
    def key(self) -> str:
        """Its name in a checkpoint's ``callbacks`` (default: the class name)."""
        return type(self).__name__

    def on_iteration(self, trainer, forest, record: dict[str, Any]) -> dict[str, float]:
        return {}

    def on_iteration_end(self, trainer, record: dict[str, Any], control: TrainerControl) -> None:
        """Called after the iteration's record was written."""

    def on_eval_end(self, trainer, record: dict[str, Any], control: TrainerControl) -> dict[str, Any]:
        return {}

    def on_resume(self, trainer, checkpoint, control: TrainerControl) -> str | None:
        return None

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's state of this callback (None: it had none)."""


class TeacherShareMetrics(Callback):
    """The guided teacher's share of the iteration's samples and their rewards (none unless it drew samples)."""

    def on_iteration(self, trainer, forest, record: dict[str, Any]) -> dict[str, float]:
        from flowrl.objectives.teacher import teacher_share_metrics

        return teacher_share_metrics(forest, trainer.group)


class StopOnFailedRewards(Callback):
    """Every reward failed (all NaN) ``limit`` iterations in a row: the run stops (no checkpoint of it) and raises
    :class:`~flowrl.training.scoring.RewardsFailed` naming the rewards and why (``flowrl train`` exits 3). The count
    travels in the checkpoint."""

    def __init__(self, limit: int, reward):
        from flowrl.training.scoring import FailedRewardStreak

        self.streak = FailedRewardStreak(limit, reward)

    def on_iteration_end(self, trainer, record: dict[str, Any], control: TrainerControl) -> None:
        from flowrl.training.scoring import RewardsFailed

        try:
            self.streak.observe(record)
        except RewardsFailed as e:
            control.request_stop(Stop("failed_rewards", str(e), exit_status=3, save=False, error=e))

    def state_dict(self) -> dict[str, int]:
        return {"count": self.streak.count}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self.streak.count = int((state or {}).get("count", 0))


class GuardOnEval(Callback):
    """``eval.guard``: the :class:`~flowrl.training.guard.EvalGuard` of the run's eval rewards, asked at every eval;
    its trip stops the run (a checkpoint holding it is saved, no closing eval; ``flowrl train`` exits 4), and after a
    resume a trip that still stands stops it before any training. Its start values and trip travel in the
    checkpoint."""

    key = "guard"  # the key checkpoints have always kept it under
    exit_status = 4  # what `flowrl train` exits with after its stop

    def __init__(self, guard):
        self.guard = guard

    @classmethod
    def of(cls, cfg, reward) -> "GuardOnEval":
        """The guard of ``cfg.eval.guard`` over the eval ``reward`` (its terms as the config spells them)."""
        from flowrl.config.checks import guard_names
        from flowrl.training.guard import EvalGuard

        return cls(EvalGuard.build(cfg.eval.guard, guard_names(cfg), reward))

    def _stop(self, save: bool) -> Stop:
        return Stop("eval_guard", self.guard.message(), self.exit_status, save=save, detail=dict(self.guard.stop))

    def on_eval_end(self, trainer, record: dict[str, Any], control: TrainerControl) -> dict[str, Any]:
        out = self.guard.observe(int(record["step"]), record)
        if self.guard.stop is not None:
            control.request_stop(self._stop(save=True))
        return out

    def on_resume(self, trainer, checkpoint, control: TrainerControl) -> str | None:
        line, refuses = self.guard.after_resume(checkpoint)
        if refuses:
            control.request_stop(Stop("eval_guard", line, self.exit_status, save=False, detail=dict(self.guard.stop)))
        return line

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.guard.load_state_dict(state)


def default_callbacks(cfg, reward, eval_reward) -> list[Callback]:
    """The built-in side jobs of a run of ``cfg`` with training reward ``reward`` and eval reward ``eval_reward``."""
    return [
        TeacherShareMetrics(),
        StopOnFailedRewards(cfg.train.max_failed_iterations, reward),
        GuardOnEval.of(cfg, eval_reward),
    ]
