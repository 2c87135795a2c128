"""Side jobs are callbacks (flowrl/training/callbacks.py): a user's callback adds metrics to every iteration's and
eval's record (written to metrics.jsonl) and can stop a run after an iteration's record is written; the built-in
ones (teacher share, failed-reward streak, eval guard) are ordinary callbacks in the same list."""

from __future__ import annotations

import json

import pytest

from flowrl.training.callbacks import Callback, GuardOnEval, StopOnFailedRewards, TeacherShareMetrics
from tests.conftest import make_model
from tests.test_trainer import tiny_config


class Counting(Callback):
    def __init__(self, stop_after: int | None = None):
        self.iterations, self.evals, self.stop_after = 0, 0, stop_after

    def on_iteration(self, trainer, forest, record):
        self.iterations += 1
        return {"user/leaves_seen": float(forest.leaves().numel()), "user/reward_mean_seen": record["reward_mean"]}

    def on_iteration_end(self, trainer, record):
        if self.stop_after is not None and record["step"] >= self.stop_after:
            raise StopIteration(f"stopped by the user's callback at step {record['step']}")

    def on_eval_end(self, trainer, record):
        self.evals += 1
        return {"user/eval_seen": 1.0}


def test_a_users_callback_adds_metrics_and_runs_after_the_built_in_ones(tmp_path):
    from flowrl.training.trainer import Trainer

    mine = Counting()
    trainer = Trainer(
        tiny_config(
            tmp_path,
            "cb",
            "train.max_steps=2",
            "prompts.eval=a red circle",
            "eval.every=0",
            "eval.images_per_prompt=1",
            "eval.steps=2",
        ),
        model=make_model("sd3"),
        callbacks=[mine],
    )
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds == [TeacherShareMetrics, StopOnFailedRewards, GuardOnEval, Counting]
    trainer.train()
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward_mean" in r]
    assert mine.iterations == 2 and [r["user/leaves_seen"] for r in steps] == [r["leaves"] for r in steps]
    assert all(r["user/reward_mean_seen"] == r["reward_mean"] for r in steps)
    evals = [r for r in lines if "user/eval_seen" in r]
    assert mine.evals == len(evals) >= 1  # the closing eval (and the one at the start when eval.at_start)


def test_a_callback_stops_the_run_after_the_iteration_is_written(tmp_path):
    from flowrl.training.trainer import Trainer

    trainer = Trainer(
        tiny_config(tmp_path, "stop", "train.max_steps=3", "prompts.eval=null"),
        model=make_model("sd3"),
        callbacks=[Counting(stop_after=1)],
    )
    with pytest.raises(StopIteration, match="at step 1"):
        trainer.train()
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "reward_mean" in r] == [1]  # the stopping iteration's record is kept
