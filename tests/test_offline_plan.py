"""The rollout store and ``rollout.plan: offline`` (issue 45, GDRO's offline mode): the store written once, replayed
exactly, never sampled from, the same draws in any layout, and a missing, damaged or foreign store refused."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.rollout.base import RolloutContext
from flowrl.rollout.offline import Offline
from flowrl.rollout.offline_store import META_FILE, RolloutStore
from flowrl.run.rollout_store import write_store
from tests.conftest import make_model

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def redness():
    from flowrl_rewards import MultiReward

    return MultiReward([{"name": "redness"}])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of 3 prompts × 4 samples of the tiny SD3 pipeline, in two part files."""
    out = tmp_path_factory.mktemp("stores") / "store"
    model = make_model("sd3")
    write_store(
        out,
        model,
        PROMPTS,
        redness(),
        images_per_prompt=4,
        steps=3,
        guidance=1.0,
        seed=7,
        max_batch=8,
        model_info={"family": "sd3"},
        part_bytes=2 * 4 * 4 * 8 * 8 * 4,
    )  # two prompts per part
    return out


def no_forward(model):
    def refuse(*a, **k):
        raise AssertionError("the offline plan must not run the model")

    model.velocity = refuse
    return model


def test_the_store_holds_the_ode_samples_of_every_prompt_with_their_seeds_and_rewards(store):
    from flowrl.rollout.sampling import ode_sample

    s = RolloutStore(store)
    assert s.prompts == PROMPTS and s.images_per_prompt == 4 and s.rows == 12 and len(s.parts) == 2
    assert (store / "prompts.txt").read_text().splitlines() == PROMPTS
    model = make_model("sd3")
    x0 = ode_sample(model, [p for p in PROMPTS for _ in range(4)], s.seed.tolist(), 3, 1.0, decode=False)
    assert torch.allclose(s.latents(torch.arange(12)), x0, atol=1e-5)  # the seeds rebuild the samples
    images = model.decode(x0)
    assert torch.allclose(s.reward, redness()(images, [p for p in PROMPTS for _ in range(4)]), atol=1e-5)


def test_the_plan_replays_exactly_the_stored_samples_and_never_samples(store):
    s = RolloutStore(store)
    model = no_forward(make_model("sd3"))
    plan = Offline(source=str(store), group_size=3)
    plan.setup(model)
    forest = plan.rollout(model, ["a green triangle", "a red circle"], RolloutContext(seed=1, iteration=4))
    leaves = forest.leaves()
    assert leaves.numel() == 6 and forest.counters["forwards"] == 0 and forest.edges(trainable=False).numel() == 0
    assert bool((forest.sigma[leaves] == 0).all()) and forest.group[leaves].tolist() == [0, 0, 0, 1, 1, 1]
    rows = [r for p in plan.picks(["a green triangle", "a red circle"], RolloutContext(seed=1, iteration=4)) for r in p]
    assert all(r in range(8, 12) for r in rows[:3]) and all(r in range(0, 4) for r in rows[3:])
    assert torch.equal(forest.all_latents()[leaves], s.latents(torch.tensor(rows)))
    assert forest.seed[leaves].tolist() == s.seed[rows].tolist()
    assert plan.expected_counts(2) == {"forwards": 0, "trained_edges": 0, "leaves": 6, "replay_rows": 0}


def test_scored_replays_give_back_the_stored_rewards(store):
    from flowrl.config.schema import PromptsSection
    from flowrl.prompts.source import build_prompt_source
    from flowrl.rollout.runner import RolloutRunner

    class One:  # one process
        world, rank, is_main = 1, 0, True

        def shard(self, items):
            return items, 0

    model = no_forward(make_model("sd3"))
    plan = Offline(source=str(store), group_size=0)
    plan.setup(model)
    prompts = build_prompt_source(PromptsSection(train="|".join(PROMPTS), eval=None, per_step=3), 0)
    runner = RolloutRunner(
        plan,
        model,
        redness(),
        prompts,
        One(),
        seed=0,
        guidance=1.0,
        max_batch=8,
        chunks=2,
        reduction="mean",
        async_reward=False,
    )
    forest, _ = runner.run(0)
    stats = plan.metrics(forest)
    assert forest.leaves().numel() == 12 and stats["offline/reward_drift"] < 1e-5
    assert stats["offline/stored_reward"] == pytest.approx(float(RolloutStore(store).reward.mean()), abs=1e-5)


def test_draws_are_seeded_by_iteration_and_global_group_whatever_the_layout(store):
    plan = Offline(source=str(store), group_size=2)
    whole = plan.picks(PROMPTS, RolloutContext(seed=3, iteration=5))
    parts = plan.picks(PROMPTS[:1], RolloutContext(seed=3, iteration=5)) + plan.picks(
        PROMPTS[1:], RolloutContext(seed=3, iteration=5, group_offset=1)
    )
    assert whole == parts  # chunks and processes see the same samples
    assert whole == plan.picks(PROMPTS, RolloutContext(seed=3, iteration=5))  # and a resume
    others = [plan.picks(PROMPTS, RolloutContext(seed=3, iteration=i)) for i in range(6)]
    assert len({json.dumps(o) for o in others}) > 1  # the iteration changes the picks
    assert all(len(set(p)) == 2 for o in others for p in o)  # without replacement within a group


def test_a_missing_or_damaged_store_is_refused_naming_it(store, tmp_path):
    import shutil

    with pytest.raises(ConfigError, match=r"rollout.source='.*nowhere'.*not a folder"):
        Offline(source=str(tmp_path / "nowhere"))
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    (bad / META_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="rollouts.json cannot be read"):
        Offline(source=str(bad))
    shutil.rmtree(bad)
    shutil.copytree(store, bad)
    part = bad / "part-00001.safetensors"
    part.write_bytes(part.read_bytes()[:-8])
    with pytest.raises(ConfigError, match="part-00001.safetensors holds .* bytes"):
        Offline(source=str(bad))
    shutil.rmtree(bad)
    shutil.copytree(store, bad)
    part = bad / "part-00000.safetensors"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF  # same size, another latent value
    part.write_bytes(bytes(data))
    plan = Offline(source=str(bad), group_size=2)
    with pytest.raises(ConfigError, match="does not match its sha256"):
        plan.store.latents(torch.tensor([0]))


def test_a_store_of_another_model_or_prompt_is_refused(store):
    plan = Offline(source=str(store), group_size=2)
    with pytest.raises(ConfigError, match=r"latents \[4, 8, 8\].*latents \[4, 16, 16\]"):
        plan.setup(make_model("sd3", height=32, width=32))
    with pytest.raises(ConfigError, match="holds no samples of the prompt 'a dog'.*prompts.txt"):
        plan.rollout(make_model("sd3"), ["a dog"], RolloutContext())
    with pytest.raises(ConfigError, match="rollout.source is not set"):
        Offline().setup(make_model("sd3"))
    with pytest.raises(ValueError, match="rollout.group_size=5 is more than the 4 samples"):
        Offline(source=str(store), group_size=5)
    with pytest.raises(ValueError, match="rollout.group_size=1"):
        Offline(source=str(store), group_size=1)


def test_a_resume_on_another_store_is_refused(store, tmp_path):
    other = tmp_path / "other"
    write_store(
        other,
        make_model("sd3"),
        PROMPTS,
        None,
        images_per_prompt=2,
        steps=2,
        guidance=1.0,
        seed=0,
        max_batch=8,
        model_info={"family": "sd3"},
    )
    state = Offline(source=str(store), group_size=2).state_dict()
    Offline(source=str(store), group_size=2).load_state_dict(state)  # the same store: accepted
    with pytest.raises(ConfigError, match="holds other samples"):
        Offline(source=str(other), group_size=2).load_state_dict(state)
    assert bool(torch.isnan(RolloutStore(other).reward).all())  # written without a reward: NaN


def test_the_writer_never_replaces_a_store(store):
    with pytest.raises(ConfigError, match="earlier flowrl rollouts"):
        write_store(
            store,
            make_model("sd3"),
            PROMPTS,
            None,
            images_per_prompt=2,
            steps=2,
            guidance=1.0,
            seed=0,
            max_batch=8,
            model_info={"family": "sd3"},
        )
