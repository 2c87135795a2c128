"""Declared state only (issue 62 item 4): nothing outside a model stashes attributes on it — after a run's set-up
(objectives' frozen copies and old adapters, the plan's explorer, the forward wrapper, encoder offload) every
attribute of the model is one its class declares; a two-expert Wan module declares what stands for it instead of
imitating a diffusers model; the explore plan and the teacher keep no per-iteration value on themselves between calls
(the plan's records travel on the forest's ``meta``, the teacher's cost in its declared counter)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_model
from tests.test_trainer import tiny_config

PROMPTS = ["a red circle", "two blue squares"]


def declared(cls: type) -> set[str]:
    """The names a class declares: annotated or given a value in its body, anywhere in its MRO."""
    return {name for klass in cls.__mro__ for name in (*vars(klass), *getattr(klass, "__annotations__", {}))}


@pytest.mark.parametrize(
    "settings",
    [
        ["loss.objective=clipped"],  # LoRA: the old policy as a second adapter
        ["model.full_finetune=true", "loss.objective=clipped", "model.dtype=float32"],  # frozen copies on the model
        ["explore"],  # the explore plan's explorer (tests/test_explore.py's tiny run)
    ],
    ids=["lora", "full_finetune", "explore"],
)
def test_a_models_attributes_after_setup_are_the_ones_its_class_declares(tmp_path, settings):
    from flowrl.training.trainer import Trainer

    model = make_model("sd3")
    model.offload_encoders()
    if settings == ["explore"]:
        from tests.test_explore import tiny_config as explore_config

        config = explore_config(tmp_path, "run", "prompts.eval=null")
    else:
        config = tiny_config(tmp_path, "run", "prompts.eval=null", *settings)
    trainer = Trainer(config, model=model)
    trainer.rollout(0)
    model.set_forward_module(model.trainable)  # what the loop does with its DDP / compiled wrapper
    undeclared = set(vars(model)) - declared(type(model))
    assert undeclared == set(), f"attributes set on the model that {type(model).__name__} does not declare"
    if "model.full_finetune=true" in settings:
        assert model.frozen_copies and model.forward_override is model.trainable and model.encoders_offloaded


def test_the_wan_experts_declare_their_config_and_adapters_instead_of_imitating_diffusers():
    from torch import nn

    from flowrl.models.module_group import ModuleGroup, diffusers_config, peft_configs
    from flowrl.models.wan_experts import WanExperts

    class Expert(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.config, self.peft_config = {"_name_or_path": name}, {"default": name}

    experts = WanExperts(Expert("high"), Expert("low"), 875.0, ("transformer_2",))
    assert isinstance(experts, ModuleGroup)
    assert "config" not in dir(type(experts)) and not hasattr(experts, "peft_config")
    assert diffusers_config(experts) == {"_name_or_path": "high"} and peft_configs(experts) == {"default": "low"}
    assert diffusers_config(nn.Linear(1, 1)) is None and peft_configs(nn.Linear(1, 1)) == {}


def test_explore_keeps_no_per_iteration_state_between_rollout_and_metrics(sd3_model):
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.explore import Explore

    plan = Explore(inner={"plan": "chains", "group_size": 2, "steps": 3}, pool=3, preview_steps=2)
    plan.setup(sd3_model, "brightness")
    plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=0, iteration=0))  # the first rollout syncs the explorer

    def snapshot():
        return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else id(v)) for k, v in vars(plan).items()}

    before = snapshot()
    forest = plan.rollout(sd3_model, PROMPTS, RolloutContext(seed=0, iteration=1))
    forest.reward[forest.leaves()] = 0.5
    stats = plan.metrics(forest)
    assert snapshot() == before, "rollout + metrics left nothing on the plan"
    assert stats["explore/pool_reward_mean"] == stats["explore/pool_reward_mean"]  # computed from forest.meta
    assert [r["iteration"] for r in forest.meta["explore"]] == [1]


def test_explore_records_of_merged_chunks_add_up(sd3_model):
    from flowrl.rollout.base import RolloutContext
    from flowrl.rollout.explore import Explore
    from flowrl.rollout.forest import Forest

    plan = Explore(inner={"plan": "chains", "group_size": 2, "steps": 3}, pool=3, preview_steps=2)
    plan.setup(sd3_model, "brightness")
    first = plan.rollout(sd3_model, PROMPTS[:1], RolloutContext(seed=0, iteration=1))
    second = plan.rollout(sd3_model, PROMPTS[1:], RolloutContext(seed=0, iteration=1, group_offset=1))
    assert len(Forest.merge([first, second]).meta["explore"]) == 2


def test_the_teacher_counts_its_cost_in_its_declared_counter(sd3_model):
    from flowrl.objectives.teacher import Teacher, TeacherSpec

    teacher = Teacher(sd3_model, TeacherSpec(guidance=3.0))
    before = {k: id(v) for k, v in vars(teacher).items()}
    x = sd3_model.noise([0, 1])
    teacher.velocity(x, torch.full((2,), 0.5), teacher.encode(PROMPTS))
    assert {k: id(v) for k, v in vars(teacher).items()} == before and type(teacher).state_attributes == ()
    stats = teacher.take_stats()
    assert stats["teacher_forwards"] == 2 and stats["time/teacher"] > 0
    assert teacher.take_stats()["teacher_forwards"] == 0
