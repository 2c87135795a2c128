"""The reward port (:class:`flowrl_rewards.core.port.Scorer`, issue 53 item 1): a plain reward and a MultiReward of it
answer
``terms``, ``components``, ``combine``, ``failures``, ``evaluate`` and ``normalize`` alike, so the code that once asked
a reward what it has (the eval's summaries, the guard's names, the failed-reward streak, the video check, the rollout
store's combined reward, the background scorer) gives the same result for either."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.config.schema import GuardSection
from flowrl.errors import ConfigError
from flowrl.training.evaluation import score_images
from flowrl.training.guard import EvalGuard
from flowrl.training.scoring import FailedRewardStreak, RewardsFailed, check_modality
from flowrl_rewards import BackgroundScorer, MultiReward, Reward, Scorer

PROMPTS = ["a red circle", "a blue square", "a red square", "a blue circle"]


class Tally(Reward):
    """A GenEval-like term: scores each image's mean, and an eval summary per task (the prompt's shape)."""

    name = "tally"

    def score(self, images, prompts, meta):
        return images.mean(dim=(1, 2, 3))

    def evaluate(self, images, prompts):
        tasks = [p.split()[-1] for p in prompts]
        out = {"accuracy": float((images.mean(dim=(1, 2, 3)) > 0.5).float().mean()), "n": len(prompts)}
        for task in sorted(set(tasks)):
            out[f"accuracy/{task}"], out[f"n/{task}"] = 1.0, tasks.count(task)
        return out


class Plain(Reward):
    """A term without an eval summary."""

    name = "plain"

    def score(self, images, prompts, meta):
        return images[:, 0].mean(dim=(1, 2))


class Broken(Reward):
    """A term that fails every image and says why."""

    name = "broken"

    def score(self, images, prompts, meta):
        self.last_error = "the server answered 503"
        return torch.full((images.shape[0],), float("nan"))


def _images(n: int = 4) -> torch.Tensor:
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_a_plain_reward_is_a_scorer_of_one_term_itself():
    reward, images = Tally(), _images()
    assert isinstance(reward, Scorer) and reward.terms == [reward] and reward.normalize == "none"
    parts = reward.components(images, PROMPTS, {})
    assert list(parts) == ["tally"] and torch.equal(parts["tally"], reward(images, PROMPTS))
    assert torch.equal(reward.combine(parts, torch.tensor([0, 0, 1, 1])), parts["tally"])
    assert reward.failures == {} and Plain().evaluate(images, PROMPTS) == {}
    with pytest.raises(ValueError, match=r"reward 'tally' \(Tally\) scores one term.*\['a', 'b'\]"):
        reward.combine({"a": parts["tally"], "b": parts["tally"]})


def test_a_multi_reward_answers_the_port_for_its_terms():
    tally, plain = Tally(), Plain()
    multi, images = MultiReward([tally, plain]), _images()
    assert multi.terms == [tally, plain] and multi.normalize == "none"
    parts = multi.components(images, PROMPTS, {})
    assert torch.allclose(multi.combine(parts), parts["tally"] + parts["plain"])
    summary = multi.evaluate(images, PROMPTS)
    assert summary == {f"tally/{k}": v for k, v in tally.evaluate(images, PROMPTS).items()}  # plain has none
    multi.failures["tally"] = "not kept"  # a copy: the port's failures are the last call's, read only
    assert multi.failures == {}


def test_the_eval_summarises_a_term_alike_alone_or_combined():
    """score_images asked ``hasattr(term, "evaluate")`` of ``reward.rewards``: now every term's evaluate, through
    ``terms``, for a plain reward as for a MultiReward; a term without a summary adds its mean only."""
    images = _images()
    alone = score_images(images, PROMPTS, Tally(), "eval")
    combined = score_images(images, PROMPTS, MultiReward([Tally()]), "eval")
    assert alone == combined
    metrics, weights = alone
    assert metrics["eval/tally/accuracy/circle"] == 1.0 and weights["eval/tally/accuracy/circle"] == 2.0
    assert set(score_images(images, PROMPTS, Plain(), "eval")[0]) == {"eval/plain_mean"}
    videos = torch.rand(4, 3, 3, 8, 8)  # an image term is not asked for a summary of videos
    assert set(score_images(videos, PROMPTS, Tally(), "eval")[0]) == {"eval/tally_mean"}


def test_the_guard_names_the_terms_alike():
    section = GuardSection(reward="tally", max_drop=0.1)
    for reward in (Tally(), MultiReward([Tally(), Plain()])):
        assert EvalGuard.build(section, ["tally", "plain"], reward).metric == "eval/tally_mean"
    with pytest.raises(ConfigError, match=r"eval.guard.reward='nope'.*accepted: \['tally'\]"):
        EvalGuard.build(GuardSection(reward="nope"), ["tally"], Tally())


def test_the_streak_names_what_failed_alike():
    record = {"leaves": 4.0, "reward_failed": 4.0}
    for reward in (Broken(), MultiReward([Broken()])):
        reward.components(_images(), PROMPTS, {})
        with pytest.raises(RewardsFailed, match=r"reward 'broken': .*the server answered 503"):
            FailedRewardStreak(1, reward).observe(record)
    messages = []
    for reward in (Plain(), MultiReward([Plain()])):  # finite scores, no error: the same words for either
        reward.components(_images(), PROMPTS, {})
        with pytest.raises(RewardsFailed) as e:
            FailedRewardStreak(1, reward).observe(record)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "rewards ['plain'] gave no error" in messages[0]


def test_a_video_reward_on_an_image_model_is_refused_alike():
    class Clip(Plain):
        name, modality = "clip", "video"

    image_model = SimpleNamespace(modality="image", family="sd3")
    for reward in (Clip(), MultiReward([Plain(), Clip()])):
        with pytest.raises(ConfigError, match=r"rewards: reward 'clip' \(Clip\) scores videos.*family 'sd3'"):
            check_modality(image_model, [("rewards", reward)])
    check_modality(SimpleNamespace(modality="video", family="wan"), [("rewards", Clip())])  # a video family: fine


def test_the_background_scorer_gives_the_components_of_either():
    images = _images()
    with BackgroundScorer(Tally(), enabled=False) as alone, BackgroundScorer(MultiReward([Tally()])) as multi:
        assert alone.submit(images, PROMPTS).result().keys() == {"tally"}
        assert torch.equal(
            alone.submit(images, PROMPTS).result()["tally"], multi.submit(images, PROMPTS).result()["tally"]
        )
    seen = []

    def inputs(prompts, meta, images):
        seen.append(list(prompts))
        return [p.upper() for p in prompts], {**meta, "adapted": True}

    with BackgroundScorer(Tally(), enabled=False, inputs=inputs) as scorer:
        scorer.submit(images, PROMPTS).result()
    assert seen == [PROMPTS]
    with pytest.raises(TypeError, match="needs a flowrl_rewards.Reward"):
        BackgroundScorer(lambda images, prompts, meta: images)


def test_the_rollout_store_combines_a_plain_reward_as_a_multi_reward():
    """The store's writer asked ``hasattr(reward, "combine")``: a plain reward's combined score is its own."""
    from flowrl.run.rollout_store import sample_groups
    from tests.conftest import make_model

    model = make_model("sd3")
    kw = dict(images_per_prompt=2, steps=2, guidance=1.0, seed=3, max_batch=8)
    _, _, alone, parts = sample_groups(model, PROMPTS[:2], Tally(), **kw)
    _, _, combined, _ = sample_groups(model, PROMPTS[:2], MultiReward([Tally()]), **kw)
    assert torch.equal(alone, parts["tally"]) and torch.allclose(alone, combined)
