"""The trainer's held-out evals: the eval it runs (:class:`~flowrl.training.evaluation.HeldOutEval` over
``prompts.eval``), when one is due, and recording one with the callbacks' verdicts.

:class:`TrainerEvals` is mixed into :class:`~flowrl.training.trainer.Trainer`, whose ``cfg``, ``model``, ``group``,
``accelerator``, ``reward``, ``eval_reward``, ``guidance``, ``callbacks``, ``control``, ``step`` and
``train_seconds`` it reads."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

from flowrl.config.schema import ConfigError
from flowrl.prompts.checks import check_prompts
from flowrl.prompts.source import read_prompts
from flowrl.training.evaluation import HeldOutEval
from flowrl.training.metrics import log_grid_image


class TrainerEvals:
    """The held-out evals of a :class:`~flowrl.training.trainer.Trainer` (mixed into it)."""

    def _held_out_eval(self) -> HeldOutEval:
        """The eval over ``prompts.eval`` (the first ``eval.num_prompts``), its grids in ``samples/``."""
        c = self.cfg
        eval_prompts = read_prompts(c.prompts.eval, "prompts.eval") if c.prompts.eval else []
        self.eval_prompts = eval_prompts[: c.eval.num_prompts] if c.eval.num_prompts else eval_prompts
        return HeldOutEval(
            c.eval,
            self.model,
            self.eval_prompts,
            self.eval_reward,
            self.group,
            Path(c.train.output_dir) / c.train.name / "samples",
            self.guidance,
            progress=c.train.progress,
            train_reward=self._held_out_training_reward(),
            on_grid=functools.partial(log_grid_image, self.accelerator, c.train.log_with),
            max_batch=c.rollout.max_batch,
        )

    def eval_due(self, seconds_before: float) -> bool:
        """Whether the step just taken ends an eval period: every ``eval.every`` iterations, or (with
        ``eval.every_minutes``) when the training time crossed a multiple of that many minutes during it."""
        every, minutes = self.cfg.eval.every, self.cfg.eval.every_minutes
        by_steps = bool(every) and self.step % every == 0
        by_time = bool(minutes) and int(self.train_seconds // (60 * minutes)) > int(seconds_before // (60 * minutes))
        return by_steps or by_time

    def _evaluate(self, tag: str | None = None) -> None:
        """One held-out eval (``tag``: before/after; None: periodic) with the eval guard's verdict, recorded."""
        with self.ema_weights(), self.sampling():
            record: dict[str, Any] = {"step": self.step, **self.evaluate(self.step, tag)}
        for callback in self.callbacks:
            record.update(callback.on_eval_end(self, record, self.control))  # e.g. the eval guard's verdict
        self._emit(record)

    def _held_out_training_reward(self):
        """The training reward, to score the evals' images with as well when the eval's rewards are others (the
        training reward held out beside the guard rewards); None when they are the same, or when it cannot score
        every held-out prompt (warned)."""
        c = self.cfg
        if self.eval_reward is self.reward or not c.prompts.eval:
            return None
        try:
            check_prompts(c.prompts.eval, "prompts.eval", self.reward.check_prompt)
        except ConfigError as e:
            warnings.warn(
                f"the evals report eval.rewards only: the training reward cannot score every held-out prompt ({e})",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return self.reward
