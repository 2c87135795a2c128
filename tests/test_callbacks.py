"""Side jobs are callbacks that control the loop (flowrl/training/callbacks.py): a user's callback adds metrics to
every iteration's and eval's record (written to metrics.jsonl) and asks the loop, through its TrainerControl, to
evaluate, save or stop; its state is checkpointed and given back on resume; the built-in ones (teacher share,
failed-reward streak, eval guard) are ordinary callbacks in the same list, and the trainer has no guard of its own."""

from __future__ import annotations

import json

from flowrl.training.callbacks import Callback, GuardOnEval, Stop, StopOnFailedRewards, TeacherShareMetrics
from tests.conftest import make_model
from tests.test_trainer import tiny_config


class Counting(Callback):
    def __init__(self, stop_after: int | None = None, evaluate_at: int | None = None, save_at: int | None = None):
        self.iterations, self.evals, self.stop_after = 0, 0, stop_after
        self.evaluate_at, self.save_at = evaluate_at, save_at

    def on_iteration(self, trainer, forest, record):
        self.iterations += 1
        return {"user/leaves_seen": float(forest.leaves().numel()), "user/reward_mean_seen": record["reward_mean"]}

    def on_iteration_end(self, trainer, record, control):
        step = record["step"]
        control.should_evaluate = step == self.evaluate_at
        control.should_save = step == self.save_at
        if self.stop_after is not None and step >= self.stop_after:
            control.request_stop(Stop("user", f"stopped by the user's callback at step {step}"))

    def on_eval_end(self, trainer, record, control):
        self.evals += 1
        return {"user/eval_seen": 1.0}

    def state_dict(self):
        return {"iterations": self.iterations}

    def load_state_dict(self, state):
        self.iterations = (state or {}).get("iterations", 0)


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


def test_a_callback_evaluates_saves_and_stops_through_the_control_and_its_state_is_resumed(tmp_path):
    """The control's requests: an eval after step 1, a checkpoint after step 2, the stop after step 3 (its record kept,
    a checkpoint of it saved, no closing eval); the callback's own state comes back on resume."""
    from flowrl.training.trainer import Trainer

    cfg = tiny_config(
        tmp_path,
        "control",
        "train.max_steps=6",
        "prompts.eval=a red circle",
        "eval.every=0",
        "eval.at_start=false",
        "eval.images_per_prompt=1",
        "eval.steps=2",
    )
    mine = Counting(stop_after=3, evaluate_at=1, save_at=2)
    trainer = Trainer(cfg, model=make_model("sd3"), callbacks=[mine])
    trainer.train()
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "reward_mean" in r] == [1, 2, 3]  # the stopping iteration's record is kept
    assert [r["step"] for r in lines if "user/eval_seen" in r] == [1]  # asked for; no closing eval after the stop
    assert sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir()) == ["step-2", "step-3"]
    assert trainer.control.stop.reason == "user" and "at step 3" in trainer.control.stop.message
    again = Counting()
    resumed = Trainer(
        tiny_config(tmp_path, "control", "train.max_steps=4", "prompts.eval=null", "train.resume=latest"),
        model=make_model("sd3"),
        callbacks=[again],
    )
    resumed.train()
    assert again.iterations == 3 + 1  # the checkpoint's count, then one more iteration
