"""The reward port declares every member its callers use (issue 62 item 5): a :class:`flowrl_rewards.Scorer` that is
not a :class:`flowrl_rewards.Reward`, implementing ``__call__`` only, is combined by ``as_multi``, trains, is
evaluated and has its prompts checked; and what flowrl reads of a scorer or of its terms is declared on ``Scorer``
itself (listed below with where it is read, and recorded from a run whose reward records every read)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.config.schema import TrainConfig
from flowrl.errors import ConfigError
from flowrl.training.evaluation import score_images
from flowrl.training.scoring import as_multi, check_modality, run_rewards
from flowrl_rewards import MultiReward, Reward, Scorer
from tests.conftest import make_model

PROMPTS = ["a red circle", "two blue squares", "a green cat", "a small dog"]

CALLERS = {
    # what flowrl reads of a scorer (the run's training or eval reward) or of one of its terms, and where
    "terms": "flowrl/training/scoring.py (check_modality, FailedRewardStreak), evaluation.py (score_images), "
    "guard.py (EvalGuard.build), prompts/checks.py (check_run_prompts), scoring.py (as_multi)",
    "name": "the terms' metric keys: evaluation.py, guard.py, scoring.py, prompts/checks.py (check_prompt_images)",
    "components": "flowrl/rollout/scoring.py (components_of), rewards/background.py, training/grids.py",
    "combine": "flowrl/rollout/runner.py, rollout/explore.py, run/rollout_store.py",
    "failures": "flowrl/training/scoring.py (FailedRewardStreak.observe)",
    "evaluate": "flowrl/training/evaluation.py (score_images), rewards/core/multi.py",
    "normalize": "rewards/core/multi.py (the combiner's own), the port's combine",
    "last_error": "rewards/core/multi.py (MultiReward.components), the port's failures",
    "modality": "flowrl/training/scoring.py (check_modality), evaluation.py (score_images), rewards/core/multi.py",
    "needs_source_image": "flowrl/prompts/checks.py (check_prompt_images)",
    "check_prompt": "flowrl/prompts/checks.py (check_run_prompts), training/trainer.py, commands/sample.py, eval.py",
    "check_ready": "flowrl/training/scoring.py (run_rewards), commands/sample.py, eval.py, rollouts.py",
}

SEEN: set[str] = set()
"""Every public member read of a :class:`Recorded` scorer, by flowrl or by the port's own defaults."""


class Recorded:
    """Records in :data:`SEEN` each public member read of it (dunders and ``_private`` names left out)."""

    def __getattribute__(self, name):
        if not name.startswith("_"):
            SEEN.add(name)
        return object.__getattribute__(self, name)


class Dim(Recorded, Scorer):
    """A third-party scorer that implements only what the port requires: ``__call__``. Images or videos."""

    def __call__(self, images, prompts, meta=None):
        return 1.0 - images.flatten(1).mean(1)


class Channel(Recorded, Scorer):
    """One colour channel's mean: a term of :class:`Pair`."""

    def __init__(self, name: str, channel: int):
        self.name, self._channel = name, channel

    def __call__(self, images, prompts, meta=None):
        return images.select(-3, self._channel).flatten(1).mean(1)


class Pair(Recorded, Scorer):
    """A scorer of two terms that combines them itself (not a MultiReward): flowrl reads the port of it directly."""

    name = "pair"

    def __init__(self):
        self._terms = [Channel("red", 0), Channel("blue", 2)]

    @property
    def terms(self):
        return list(self._terms)

    def components(self, images, prompts, meta=None):
        return {t.name: t(images, prompts, meta) for t in self._terms}

    def combine(self, components, groups=None):
        return sum(components[t.name].float() for t in self._terms)

    def __call__(self, images, prompts, meta=None):
        return self.combine(self.components(images, prompts, meta))


def port_members() -> set[str]:
    """The public members declared on ``Scorer`` itself."""
    return {n for n in vars(Scorer) if not n.startswith("_")}


def tiny_config(tmp_path, name: str, *extra: str) -> TrainConfig:
    return TrainConfig.from_yaml(
        None,
        [
            "model.family=sd3",
            "model.lora.rank=2",
            "model.lora.init=default",
            "rollout.group_size=2",
            "rollout.steps=3",
            "rollout.max_batch=8",
            f"prompts.train={'|'.join(PROMPTS)}",
            "prompts.per_step=2",
            "prompts.eval=a red circle|a small dog",
            "eval.steps=2",
            "eval.grid_prompts=2",
            "optim.lr=3e-3",
            "train.max_steps=1",
            f"train.output_dir={tmp_path}",
            f"train.name={name}",
            "train.progress=false",
            "train.checkpoint_every=0",
            *extra,
        ],
    )


def test_every_member_callers_read_is_declared_on_the_port_itself():
    assert set(CALLERS) <= port_members(), sorted(set(CALLERS) - port_members())
    scorer = Dim()  # the defaults a caller may rely on
    assert scorer.terms == [scorer] and scorer.name == "reward" and scorer.normalize == "none"
    assert scorer.modality == "any" and scorer.needs_source_image is False and scorer.last_error is None
    assert scorer.check_prompt("any prompt") is None and scorer.check_ready() is None
    assert scorer.failures == {} and scorer.evaluate(torch.rand(2, 3, 8, 8), PROMPTS[:2]) == {}
    assert Reward.modality == "image" and MultiReward.modality == "any"  # the rewards' own, unchanged


def test_as_multi_takes_any_scorer():
    dim, pair = Dim(), Pair()
    multi = as_multi(dim, "batch")
    assert isinstance(multi, MultiReward) and multi.terms == [dim] and multi.normalize == "batch"
    assert as_multi(pair) is pair  # several terms of its own: it combines them itself, as a MultiReward does
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    parts = multi.components(images, PROMPTS, {})
    assert list(parts) == ["reward"] and parts["reward"].dtype == torch.float32
    assert torch.allclose(parts["reward"], 1.0 - images.flatten(1).mean(1))
    # a Reward and a name are combined as before
    assert [t.name for t in as_multi("brightness").terms] == ["brightness"]
    with pytest.raises(TypeError, match=r"a name or a flowrl_rewards\.Scorer.*got object"):
        as_multi(object())


def test_a_scorer_of_its_own_is_checked_at_load(tmp_path):
    class Picky(Scorer):
        def __call__(self, images, prompts, meta=None):
            return images.flatten(1).mean(1)

        def check_prompt(self, prompt):
            if "dog" in prompt:
                raise ValueError("no dogs")

    class Editing(Dim):
        needs_source_image = True

    class Down(Dim):
        def check_ready(self):
            raise ConnectionError("the judge does not answer")

    class Clip(Dim):
        modality = "video"

    cfg = tiny_config(tmp_path, "checks")
    with pytest.raises(ConfigError, match=r"prompts\.train=.*'a small dog' cannot be scored: no dogs"):
        run_rewards(cfg, Picky())
    with pytest.raises(ConfigError, match=r"reward 'reward' compares the sample with the prompt's source image"):
        run_rewards(cfg, Editing())
    with pytest.raises(ConnectionError, match="the judge does not answer"):
        run_rewards(cfg, Down())
    train, held_out = run_rewards(cfg, Dim())
    assert held_out is train and isinstance(train, MultiReward)
    with pytest.raises(ConfigError, match=r"rewards: reward 'reward' \(Clip\) scores videos"):
        check_modality(SimpleNamespace(modality="image", family="sd3"), [("rewards", as_multi(Clip()))])


def test_the_eval_scores_a_scorer_of_its_own_alone_or_combined():
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    alone = score_images(images, PROMPTS, Dim(), "eval")
    combined = score_images(images, PROMPTS, as_multi(Dim()), "eval")
    assert alone == combined and set(alone[0]) == {"eval/reward_mean"}
    videos = torch.rand(4, 2, 3, 8, 8)  # "any": the eval asks its (empty) summary of videos too
    assert set(score_images(videos, PROMPTS, Pair(), "eval")[0]) == {"eval/red_mean", "eval/blue_mean"}


@pytest.mark.parametrize("make", [Dim, Pair], ids=["one-term", "two-terms"])
def test_a_scorer_that_is_not_a_reward_trains_and_is_evaluated(tmp_path, make):
    """One iteration with the scorer as the run's reward (given in code), evaluated at the start and the end; every
    member read of it (and of its terms) along the way is declared on ``Scorer``."""
    from flowrl.training.trainer import Trainer

    SEEN.clear()
    scorer = make()
    trainer = Trainer(tiny_config(tmp_path, make.__name__.lower()), model=make_model("sd3"), reward=scorer)
    assert (trainer.reward is scorer) == (make is Pair) and trainer.eval_reward is trainer.reward
    records = trainer.train()
    trained = [r for r in records if "reward_mean" in r]
    assert len(trained) == 1 and torch.isfinite(torch.tensor(trained[0]["reward_mean"]))
    names = ["reward"] if make is Dim else ["red", "blue"]
    evals = [r for r in records if f"eval/{names[0]}_mean" in r]
    assert [r["step"] for r in evals] == [0, 1]  # at the start and at the end
    assert all(f"eval/{n}_mean" in r for r in evals for n in names)
    unknown = SEEN - port_members()
    assert not unknown, f"flowrl read {sorted(unknown)} of a scorer, which Scorer does not declare"
    assert {"modality", "needs_source_image", "check_prompt", "check_ready", "terms", "name"} <= SEEN
    if make is Pair:  # the run's reward itself: its combine and components are what the loop called
        assert {"components", "combine", "evaluate"} <= SEEN
