"""The objective contract (flowrl/objectives/base.py): state is passed, not kept. Through one real iteration of the
trainer (begin_iteration, batches, losses, optimizer steps, after_update), an objective changes only the attributes it
declares in ``state_attributes``; its micro-batches and losses change nothing at all; its guided teacher changes only
its declared counters. And ``describe()`` is one value the tools read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowrl.objectives.base import Objective, ObjectiveFacts
from tests.conftest import make_model
from tests.test_forward_process import tiny
from tests.test_trainer import tiny_config

CASES = {  # objective → (its tiny run's config, settings); every case trains two optimizer steps per iteration
    "grpo_guard": (tiny_config, ["loss.objective=grpo_guard", "loss.kl_ref=0.0"]),
    "dpo": (tiny, ["loss.objective=dpo", "loss.teacher={guidance: 3.0, anchor: 1.0}"]),
    "nft_teacher": (
        tiny,
        ["loss.objective=nft", "loss.teacher={guidance: 3.0, anchor: 1.0}", "rollout.teacher_share=1"],
    ),
    "clipped": (tiny_config, ["loss.objective=clipped"]),
}


def snapshot(obj) -> dict:
    """``vars(obj)``: each value itself (compared by identity) and, for plain values, a copy (compared by value)."""
    return {k: (v, v if isinstance(v, (int, float, str, bool, type(None))) else None) for k, v in vars(obj).items()}


def changed(before: dict, after: dict) -> set[str]:
    """The attributes added, removed, rebound or (plain values) changed between two :func:`snapshot`s."""
    keys = set(before) | set(after)
    return {
        k
        for k in keys
        if k not in before or k not in after or before[k][0] is not after[k][0] and before[k][1] != after[k][1]
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_update_changes_only_the_declared_state(tmp_path, case):
    from flowrl.training.trainer import Trainer

    config, settings = CASES[case]
    trainer = Trainer(
        config(tmp_path, case, "train.updates_per_epoch=2", "prompts.eval=null", *settings), model=make_model("sd3")
    )
    objective = trainer.objective
    forest, _ = trainer.rollout(0)
    trainer.credit.assign(forest, gather=trainer.group.gather)
    teacher = objective.sampling_teacher()
    before, teacher_before = snapshot(objective), snapshot(teacher) if teacher is not None else {}

    objective.begin_iteration(trainer.model, forest)  # what the updater calls first
    inside = []  # the objective's attributes as its helpers see them, during the calls
    for name in ("select_leaves", "replay_edges"):
        if name in dir(objective):
            method = getattr(objective, name)
            setattr(objective, name, lambda *a, _m=method, **k: inside.append(snapshot(objective)) or _m(*a, **k))
    middle = snapshot(objective)
    cond = objective.encode(trainer.model, forest)
    batches = objective.batches(forest, 0, 0)
    assert batches and all(b.size > 0 for b in batches)
    every = forest.units(objective.describe().trains_on, flat=True, weighted=False)
    assert objective.batches(forest, 0, 0, units=every)  # the sharded loop's padding asks for explicit units
    with torch.no_grad():
        for batch in batches:
            objective.loss(trainer.model, forest, batch, cond)
    assert changed(middle, snapshot(objective)) == set(), "batches() and loss() keep nothing"
    assert all(changed(middle, seen) == set() for seen in inside), "nothing is flipped around a call either"

    for name in ("select_leaves", "replay_edges"):
        vars(objective).pop(name, None)
    record = trainer.update(forest, 0)
    assert record["skipped_steps"] == 0
    assert changed(before, snapshot(objective)) <= set(type(objective).state_attributes)
    if teacher is not None:
        assert changed(teacher_before, snapshot(teacher)) <= set(type(teacher).state_attributes)


def test_describe_is_one_value_the_tools_read():
    """Frozen, computed from the settings alone; the estimate's rows follow from it."""
    from flowrl.objectives.dpo import DPOLoss
    from flowrl.objectives.nft import NFTLoss
    from flowrl.objectives.policy import PolicyLoss

    facts = NFTLoss(draws=3, kl_ref=0.1, micro_batch=12).describe()
    assert isinstance(facts, ObjectiveFacts) and facts == NFTLoss(draws=3, kl_ref=0.1, micro_batch=12).describe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.trains_on = "edges"  # type: ignore[misc]
    assert (facts.trains_on, facts.rows_per_unit, facts.micro_batch) == ("leaves", 3, 12)
    assert facts.frozen_copies == ("old", "reference") and facts.reward_free_overrides == {
        "teacher": None,
        "kl_ref": 0.0,
    }
    counts = {"leaves": 16, "groups": 4, "replay_rows": 40}
    assert facts.train_rows(counts) == 48 and not facts.training_cfg(True)
    assert DPOLoss(draws=2).describe().train_rows(counts) == 2 * 4 * 2  # a pair per group
    policy = PolicyLoss(kl_ref=0.0).describe()
    assert policy.train_rows(counts) == 40 and policy.training_cfg(True) and policy.frozen_copies == ()
    assert policy.reward_free_overrides is None and "PolicyLoss declares none" in policy.no_reward_free_point


def test_micro_batch_is_a_declared_field_not_a_loss_key():
    """Every objective declares ``micro_batch`` (set from train.micro_batch / rollout.max_batch at build), and no
    ``loss`` section accepts it as a key."""
    from flowrl.config.chosen import build_loss
    from flowrl.config.schema import ConfigError, TrainConfig
    from flowrl.core import components

    assert "micro_batch" in {f.name for f in dataclasses.fields(Objective)}
    assert "micro_batch" not in {
        f.name for f in components.component_fields(components.resolve(components.LOSS, "nft"))
    }
    cfg = TrainConfig.from_yaml(
        None, ["loss.objective=nft", "rollout.plan=ode", "rollout.max_batch=6", "train.micro_batch=4"]
    )
    assert build_loss(cfg).micro_batch == 4
    with pytest.raises(ConfigError, match="micro_batch"):
        TrainConfig.from_yaml(None, ["loss.objective=nft", "rollout.plan=ode", "loss.micro_batch=4"])


def test_the_tools_read_an_objective_only_through_describe():
    """The load-time checks are the facts' own (:class:`ObjectiveFacts`): neither ``Objective`` nor any registered
    objective carries them, and the facts refuse what the objectives refused, with the same words."""
    from flowrl.core import components
    from flowrl.credit.group import GroupAdvantage
    from flowrl.credit.turning_point import TurningPoint
    from flowrl.errors import ConfigError
    from flowrl.objectives.dgpo import DGPOLoss
    from flowrl.objectives.dpo import DPOLoss
    from flowrl.objectives.gdro import GDROLoss
    from flowrl.objectives.nft import NFTLoss
    from flowrl.objectives.policy import PolicyLoss
    from flowrl.rollout.chains import ODEChains

    class OneLeafPerGroup(ODEChains):
        def expected_counts(self, num_prompts, ctx=None):
            return {**super().expected_counts(num_prompts, ctx), "leaves": num_prompts}

    checks = ("check_plan", "check_credit", "rollout_guidance")
    classes = [Objective] + [components.resolve(components.LOSS, name) for name, _ in components.LOSS.registry.items()]
    assert len(classes) > 5
    for cls in classes:
        assert not [m for m in checks if hasattr(cls, m)], f"{cls.__name__} still carries a tool's check"
    assert all(callable(getattr(ObjectiveFacts, m)) for m in checks)

    free = NFTLoss().describe()
    assert (free.name, free.rollout_cfg, free.has_teacher, free.group_use) == ("nft", "off", False, None)
    assert free.rollout_guidance(None) == 1.0 and free.rollout_guidance(1) == 1.0
    with pytest.raises(ConfigError, match=r"loss.cfg='free' .* model.guidance=3"):
        free.rollout_guidance(3)
    assert NFTLoss(cfg="guided").describe().rollout_guidance(3.0) == 3.0  # as given
    assert PolicyLoss().describe().rollout_guidance(4.5) == 4.5 and PolicyLoss().describe().name == "clipped"
    guided = DGPOLoss().describe()  # cfg: guided_rollouts
    assert guided.rollout_guidance(None) is None and guided.rollout_guidance(4.0) == 4.0
    with pytest.raises(ConfigError, match=r"loss.cfg='guided_rollouts' .* model.guidance=1.0"):
        guided.rollout_guidance(1.0)

    shared = ODEChains(group_size=4, steps=3, teacher_share=2)
    with pytest.raises(ConfigError, match=r"rollout.teacher_share=2 draws samples from a teacher, but loss.teacher"):
        free.check_plan(shared)
    NFTLoss(teacher={"guidance": 3.0}).describe().check_plan(shared)
    with pytest.raises(ConfigError, match=r"loss.objective='clipped' trains stochastic edges .* rollout.plan='ode'"):
        PolicyLoss().describe().check_plan(shared)
    with pytest.raises(ConfigError, match=r"loss.objective='dpo' pairs .* gives 1 leaf per group"):
        DPOLoss().describe().check_plan(OneLeafPerGroup(group_size=2, steps=3))
    assert GDROLoss(timesteps="sampler").describe().sampler_timesteps and not GDROLoss().describe().sampler_timesteps
    for objective in (free, PolicyLoss().describe()):  # the group rule writes on leaves and edges: both accepted
        objective.check_credit(GroupAdvantage())
    with pytest.raises(ConfigError, match=r"credit.rule='turning_point' writes advantages on edges only, but "):
        free.check_credit(TurningPoint())

    def short_plans(plan):  # an objective's own check of the plan, beyond the declared ones
        if plan.steps < 5:
            raise ConfigError(f"rollout.steps={plan.steps}: this objective needs at least 5")

    with pytest.raises(ConfigError, match=r"rollout.steps=3: this objective needs at least 5"):
        dataclasses.replace(free, plan_checks=(short_plans,)).check_plan(ODEChains(group_size=4, steps=3))
    with pytest.raises(TypeError, match=r"defines check_plan, which the config checks no longer call"):

        class Stale(PolicyLoss):  # an objective written for the methods that moved: refused, not silently ignored
            def check_plan(self, plan):
                pass


def test_the_rollout_side_sets_up_its_sampling_teacher_and_no_copy_the_loss_reads():
    """``setup_sampling`` (a rollout process of ``train.pipeline: async``): of the main job's objective with a KL
    reference (full fine-tuning: an old copy, the reference and a teacher sharing it), nothing is made when the plan
    lets no teacher draw, and only the teacher, on its own copy, when it does; it guides exactly as the trainer's
    teacher does."""
    from flowrl.config import build
    from flowrl.config.schema import TrainConfig

    cfg = TrainConfig.from_yaml("configs/shapes/nft.yaml", ["loss.kl_ref=0.1", "model.device=cpu"])
    trainer_model, rollout_model = (build.build_model(cfg.model, torch.device("cpu")) for _ in range(2))
    for model in (trainer_model, rollout_model):
        model.trainable.requires_grad_(True)
    trainer_side, rollout_side = build.build_loss(cfg), build.build_loss(cfg)
    trainer_side.setup(trainer_model)
    rollout_side.setup_sampling(rollout_model)  # the main job's plan lets no teacher draw: nothing to set up
    assert len(trainer_model.frozen_copies) == 2 and not rollout_model.frozen_copies  # old + reference; none
    assert rollout_side.sampling_teacher() is None
    rollout_side.setup_sampling(rollout_model, draws_teacher=True)  # rollout.teacher_share > 0: the teacher alone
    assert len(rollout_model.frozen_copies) == 1
    x = torch.randn(2, *trainer_model.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.full((2,), 0.7)
    with torch.no_grad():  # the policies move on; each teacher stays the initial model at guidance 3
        for model in (trainer_model, rollout_model):
            for p in model.trainable.parameters():
                p.add_(0.01)
        v = [
            side.sampling_teacher().velocity(x, t, model.encode(["a red circle"] * 2, 3.0))
            for side, model in ((trainer_side, trainer_model), (rollout_side, rollout_model))
        ]
    torch.testing.assert_close(v[0], v[1], rtol=0, atol=0)
