"""Non-finite values never reach the weights: ±inf rewards count as failed, a non-finite gradient skips its
optimizer step, several in a row stop the run (issue 24, item 1)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config.schema import TrainConfig
from flowrl_rewards.heuristics.image_stats import Redness
from tests.conftest import make_model


class InfiniteOnFirst(Redness):
    """Redness, except the first image of every batch scores +inf and the second −inf."""

    name = "redness"

    def score(self, images, prompts, meta):
        out = super().score(images, prompts, meta).clone()
        out[0], out[1] = float("inf"), float("-inf")
        return out


def config(tmp_path, name, *extra):
    window = [] if "rollout.plan=ode" in extra else ["rollout.window.mode=all"]  # the ODE plan has no window
    return TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=2",
            "model.lora.init=default",
            "rollout.group_size=4",
            "rollout.steps=3",
            *window,
            "prompts.train=a red circle|two blue squares",
            "prompts.per_step=2",
            "prompts.eval=null",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.async_reward=false",
            "rewards=[{name: redness}]",
            "optim.lr=1e-2",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    "objective", [["loss.objective=clipped", "loss.kl_ref=0"], ["rollout.plan=ode", "loss.objective=nft"]]
)
def test_infinite_rewards_are_failed_rewards_not_poison(tmp_path, objective):
    from flowrl.training.trainer import Trainer

    trainer = Trainer(
        config(tmp_path, "inf", "train.max_steps=2", *objective), model=make_model("sd3"), reward=InfiniteOnFirst()
    )
    records = [r for r in trainer.train() if "reward_mean" in r]
    assert [r["reward_failed"] for r in records] == [2.0, 2.0]  # one batch per iteration: its first two images
    assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params)
    assert any(r["grad_norm"] > 0 for r in records)  # the other images still trained


def test_a_nonfinite_gradient_skips_the_step_and_a_streak_stops_the_run(tmp_path, monkeypatch):
    from flowrl.training.trainer import Trainer

    trainer = Trainer(config(tmp_path, "nan", "train.max_steps=5", "loss.kl_ref=0"), model=make_model("sd3"))
    real = trainer.objective.loss
    calls = {"n": 0}

    def poisoned(model, forest, batch, cond):
        loss, diag = real(model, forest, batch, cond)
        calls["n"] += 1
        return loss * float("nan") if calls["n"] > 1 else loss, diag

    monkeypatch.setattr(trainer.objective, "loss", poisoned)
    with pytest.warns(RuntimeWarning, match="not finite"):
        first = trainer.train_step(0)  # the first micro-batch is finite, the rest of the step is NaN
    assert first["skipped_steps"] == 1.0
    weights = [p.detach().clone() for p in trainer.params]
    with pytest.warns(RuntimeWarning, match="not finite"):
        trainer.train_step(1)
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"), pytest.warns(RuntimeWarning):
        trainer.train_step(2)
    assert all(torch.equal(a, p) for a, p in zip(weights, trainer.params))  # nothing non-finite got in


@pytest.mark.parametrize("damage", ["garbage_state", "nan_weights"])
def test_resume_skips_a_damaged_checkpoint_for_the_one_before(tmp_path, damage):
    import json

    from flowrl.training.trainer import Trainer

    common = ["loss.kl_ref=0", "train.checkpoint_every=1", "train.keep_last=3"]
    Trainer(config(tmp_path, "run", *common, "train.max_steps=2"), model=make_model("sd3")).train()
    newest = tmp_path / "run" / "checkpoints" / "step-2"
    if damage == "garbage_state":
        (newest / "trainer_state.pt").write_bytes(b"\x00torn write")
    else:
        from safetensors.torch import load_file, save_file

        f = newest / "pytorch_lora_weights.safetensors"
        save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(f).items()}, f)
    trainer = Trainer(
        config(tmp_path, "run", *common, "train.max_steps=3", "train.resume=latest"), model=make_model("sd3")
    )
    with pytest.warns(RuntimeWarning, match="step-2 is damaged"):
        trainer.train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # continued from step 1: its step 2 again, then 3
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params)


def test_nonfinite_weights_are_never_written(tmp_path):
    from flowrl.training.trainer import Trainer

    trainer = Trainer(config(tmp_path, "w", "loss.kl_ref=0", "train.max_steps=1"), model=make_model("sd3"))
    trainer.train()
    with torch.no_grad():
        trainer.params[0].fill_(float("inf"))
    trainer.step = 5
    with pytest.raises(FloatingPointError, match="not finite"):
        trainer.save_checkpoint()
    assert not (tmp_path / "w" / "checkpoints" / "step-5").exists()
