"""The training loop on tiny SD3 / FLUX pipelines: learning, checkpoints, resume, outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.config.schema import TrainConfig
from flowrl.objectives.replay import replay, replay_batches
from flowrl.training.trainer import Trainer
from tests.conftest import make_model

PROMPTS = "a red circle|two blue squares|a green cat|a small dog"


def tiny_config(tmp_path: Path, name: str = "run", *extra: str) -> TrainConfig:
    cfg = TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=4",
            "model.lora.init=default",
            "rollout.group_size=4",
            "rollout.steps=6",
            "rollout.window.mode=fixed",
            "rollout.window.start=0",
            "rollout.window.size=3",
            "rollout.max_batch=8",
            f"prompts.train={PROMPTS}",
            "prompts.per_step=2",
            "prompts.eval=a red circle|a small dog",
            "eval.steps=4",
            "eval.grid_prompts=2",
            "optim.lr=3e-3",
            "loss.clip_low=0.2",
            "loss.clip_high=0.2",
            "loss.kl_ref=0.01",
            "train.max_steps=3",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            "train.progress=false",
            *extra,
        ],
    )
    cfg.rewards[0].name = "brightness"
    return cfg


def lora_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_training_changes_lora_and_improves_the_objective(tmp_path, family):
    """Three iterations: LoRA moves, the first inner step replays with ratio exactly 1, and each update
    raises the surrogate objective sum_e A_e * logp_e on the iteration's own edges."""
    extra = ["train.inner_epochs=2"]
    if family == "flux":
        extra += ["model.family=flux"]
    cfg = tiny_config(tmp_path, family, *extra)
    trainer = Trainer(cfg, model=make_model(family))
    before = lora_state(trainer)
    for it in range(3):
        forest, _ = trainer.rollout(it)
        trainer.credit.assign(forest)
        edges = forest.edges()
        stats = trainer.update(forest, it)
        assert stats["first_step_abs_delta_logp"] == 0.0
        cond = trainer.model.encode(forest.prompts, forest.guidance)
        with torch.no_grad():
            gain = sum(
                float((forest.advantage[b] * (replay(trainer.model, forest, cond, b).logp - forest.logp_old[b])).sum())
                for b in replay_batches(forest, edges)
            )
        assert gain > 0, f"iteration {it}: the update lowered the objective ({gain})"
    after = lora_state(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_run_outputs_and_lora_loads_into_a_fresh_pipeline(tmp_path):
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.rollout.sampling import ode_sample

    cfg = tiny_config(tmp_path, "outputs", "train.checkpoint_every=2", "train.keep_last=1")
    trainer = Trainer(cfg, model=make_model("sd3"))
    records = trainer.train()
    run = tmp_path / "outputs"
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "reward_mean" in r] == [1, 2, 3]
    assert lines[0]["step"] == 0 and "eval/brightness_mean" in lines[0]
    assert "eval/brightness_mean" in lines[-1]
    assert records[-1] == lines[-1]
    for key in (
        "approx_kl",
        "clipfrac_high",
        "clipfrac_low",
        "ratio_mean",
        "grad_norm",
        "rollout_forwards",
        "trained_edges",
    ):
        assert key in lines[1]
    assert lines[1]["rollout_forwards"] == 2 * 4 * 6 and lines[1]["trained_edges"] == 2 * 4 * 3
    assert (run / "reward_curve.png").stat().st_size > 0
    assert (run / "samples" / "before.png").is_file() and (run / "samples" / "after.png").is_file()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-3"]  # keep_last=1 removed step-2
    # the LoRA in diffusers format loads with plain diffusers and gives the trained model's outputs
    pipe = tiny_sd3_pipeline()
    pipe.load_lora_weights(str(run / "checkpoints" / "step-3"))
    from flowrl.models import wrap

    fresh = wrap(pipe)
    a = ode_sample(trainer.model, ["a red circle"], [7], 4)
    b = ode_sample(fresh, ["a red circle"], [7], 4)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_resume_continues_the_same_run(tmp_path):
    """Invariant 6: 2 iterations + checkpoint + resume to 4 == 4 uninterrupted iterations."""
    straight = Trainer(tiny_config(tmp_path, "straight", "train.max_steps=4", "train.ema=0.5"), model=make_model("sd3"))
    straight.train()
    first = Trainer(tiny_config(tmp_path, "resumed", "train.max_steps=2", "train.ema=0.5"), model=make_model("sd3"))
    first.train()
    second = Trainer(
        tiny_config(tmp_path, "resumed", "train.max_steps=4", "train.ema=0.5", "train.resume=latest"),
        model=make_model("sd3"),
    )
    assert second.step == 0
    second.train()
    read = lambda name: [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    a = [r for r in read("straight") if "reward_mean" in r]
    b = [r for r in read("resumed") if "reward_mean" in r]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["policy_loss"] == rb["policy_loss"], (ra["step"], ra, rb)
    sa, sb = lora_state(straight), lora_state(second)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for ea, eb in zip(straight.ema, second.ema):
        assert torch.equal(ea, eb)


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from flowrl.run import checkpoint

    cfg = tiny_config(tmp_path, "crash", "train.max_steps=1")
    trainer = Trainer(cfg, model=make_model("sd3"))
    trainer.train()
    good = tmp_path / "crash" / "checkpoints" / "step-1"
    files_before = sorted(p.name for p in good.iterdir())
    trainer.step = 2

    def exploding_save(state, path):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", exploding_save)
    with pytest.raises(OSError):
        trainer.save_checkpoint()
    monkeypatch.undo()
    assert sorted(p.name for p in good.iterdir()) == files_before
    assert checkpoint.list_checkpoints(tmp_path / "crash" / "checkpoints")[-1][0] == 1
    assert checkpoint.resolve_resume("latest", tmp_path / "crash" / "checkpoints") == good


def test_zero_variance_groups_are_skipped_and_counted(tmp_path):
    cfg = tiny_config(tmp_path, "zero")
    trainer = Trainer(cfg, model=make_model("sd3"))
    forest, _ = trainer.rollout(0)
    forest.reward[forest.leaves()] = torch.tensor([0.5] * 4 + [0.1, 0.2, 0.3, 0.4])
    stats = trainer.credit.assign(forest)
    assert stats["zero_std_ratio"] == 0.5
    assert stats["skipped_edges"] == 4 * 3
    assert forest.edges().numel() == 4 * 3
    out = trainer.update(forest, 0)
    assert out["trained_edges"] == 12


def test_chunked_rollout_with_background_scoring_matches_one_piece(tmp_path):
    """rollout.chunks splits the iteration's prompt groups; scoring runs on a thread meanwhile. The
    merged forest has the same draws (seeds are addressed by global group) and the same rewards."""
    one = Trainer(tiny_config(tmp_path, "one", "prompts.per_step=4"), model=make_model("sd3"))
    two = Trainer(
        tiny_config(tmp_path, "two", "prompts.per_step=4", "rollout.chunks=2", "train.async_reward=true"),
        model=make_model("sd3"),
    )
    assert two.runner.scorer.enabled
    fa, _ = one.rollout(0)
    fb, _ = two.rollout(0)
    assert fa.prompts == fb.prompts and fa.num_nodes == fb.num_nodes
    la, lb = fa.leaves(), fb.leaves()  # node order differs (part by part); leaves come in group order in both
    assert torch.equal(fa.group[la], fb.group[lb]) and torch.equal(fa.seed[la], fb.seed[lb])
    torch.testing.assert_close(fa.all_latents()[la], fb.all_latents()[lb], rtol=1e-4, atol=1e-5)
    assert [fb.depth(int(l)) for l in lb] == [fa.depth(int(l)) for l in la]
    torch.testing.assert_close(
        fa.reward_components["brightness"][la], fb.reward_components["brightness"][lb], rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(fa.reward[la], fb.reward[lb], rtol=1e-4, atol=1e-5)  # combined after the last part
    assert not torch.isnan(fb.reward[lb]).any() and fb.counters["scored"] == lb.numel()
    assert fb.counters["forwards"] == fa.counters["forwards"] == 4 * 4 * 6
    # replay of the merged forest is still exact: batch ids were offset, not mixed
    two.credit.assign(fb)
    assert two.update(fb, 0)["first_step_abs_delta_logp"] == 0.0


def test_shared_noise_trains_from_the_branch_point_with_every_update(tmp_path):
    """Shared x_T per group: chains branch at the first SDE step, the first inner step still replays
    with ratio exactly 1, and each of the configured optimizer steps happens."""
    cfg = tiny_config(tmp_path, "shared", "rollout.shared_noise=true", "train.updates_per_epoch=3", "loss.kl_ref=0")
    trainer = Trainer(cfg, model=make_model("sd3"))
    steps = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: steps.append(1))
    forest, _ = trainer.rollout(0)
    assert forest.roots().numel() == 2  # one x_T per prompt group
    trainer.credit.assign(forest)
    stats = trainer.update(forest, 0)
    assert stats["first_step_abs_delta_logp"] == 0.0
    assert len(steps) == 3
    assert stats["trained_edges"] == 2 * 4 * 3


def test_eval_every_minutes_evaluates_when_training_time_crosses_each_period():
    """``eval.every_minutes``: an eval after the step whose training time crossed a multiple of the period
    (however many steps that took), combined with ``eval.every`` by 'or'."""
    from types import SimpleNamespace

    def due(extra, walk):
        fake = SimpleNamespace(cfg=TrainConfig.from_yaml(None, extra), step=0, train_seconds=0.0)
        steps = []
        for seconds in walk:
            before, fake.train_seconds = fake.train_seconds, seconds
            fake.step += 1
            if Trainer.eval_due(fake, before):
                steps.append(fake.step)
        return steps

    walk = [25, 50, 75, 100, 125, 130, 250]  # cumulative seconds after steps 1..7
    assert due(["eval.every_minutes=1"], walk) == [3, 5, 7]  # crosses 60, 120, 180 (+240 in one step)
    assert due(["eval.every=2"], walk) == [2, 4, 6]
    assert due(["eval.every=2", "eval.every_minutes=1"], walk) == [2, 3, 4, 5, 6, 7]
    assert due([], walk) == []


def test_eval_every_minutes_in_a_run_and_training_time_in_the_metrics(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, "timed", "eval.every_minutes=1e-9"), model=make_model("sd3"))
    trainer.train()
    records = [json.loads(l) for l in (tmp_path / "timed" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in records if "reward_mean" not in r]
    assert evals == [0, 1, 2, 3]  # every step crosses a period this short; the last step's eval is the final one
    totals = [r["time/train_total"] for r in records if "reward_mean" in r]
    assert all(b > a > 0 for a, b in zip(totals, totals[1:])) and totals[-1] == pytest.approx(trainer.train_seconds)
