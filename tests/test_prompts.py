"""Prompt sources: seeded epochs, difficulty-adaptive sampling, its config keys and its resume state."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.prompts.source import AdaptivePromptSource, PromptSource, build_prompt_source, shapes_task
from flowrl.rollout.forest import Forest
from flowrl.training.trainer import Trainer
from tests.conftest import make_model
from tests.test_trainer import tiny_config

EASY = [f"easy {i}" for i in range(20)]
HARD = [f"hard {i}" for i in range(20)]
BY_WORD = lambda p: p.split()[0]  # noqa: E731


def test_epoch_source_is_a_seeded_permutation_per_epoch():
    src = PromptSource(list("abcdef"), per_step=3, seed=1)
    first_epoch = src.batch(0) + src.batch(1)
    assert sorted(first_epoch) == list("abcdef")
    assert PromptSource(list("abcdef"), per_step=3, seed=1).batch(1) == src.batch(1)


def test_adaptive_draws_keys_with_spread_more_often():
    """A key whose groups never spread ("easy") falls to the floor weight; the other is drawn ~1/floor× more."""
    src = AdaptivePromptSource(EASY + HARD, per_step=8, seed=0, key=BY_WORD, floor=0.1, decay=0.5)
    first = Counter(BY_WORD(p) for p in src.batch(0))
    assert first["easy"] > 0 and first["hard"] > 0  # unseen keys start equal
    counts = Counter()
    for it in range(50):
        prompts = src.batch(it)
        counts.update(BY_WORD(p) for p in prompts)
        src.observe(torch.tensor([0.0 if p.startswith("easy") else 0.3 for p in prompts]))
    w = src.weights()
    assert w[src.keys.index("easy")] == pytest.approx(0.1) and w[src.keys.index("hard")] > 1.0
    assert counts["hard"] > 4 * counts["easy"], counts


def test_adaptive_walks_each_key_through_its_prompts_and_repeats_an_iteration():
    src = AdaptivePromptSource(EASY + HARD, per_step=4, seed=3, key=BY_WORD)
    drawn = []
    for it in range(10):
        batch = src.batch(it)
        assert src.batch(it) == batch  # asking again does not advance
        drawn += batch
        src.observe(torch.full((4,), 0.2))
    easy = [p for p in drawn if p.startswith("easy")]
    assert len(set(easy[:20])) == min(20, len(easy))  # no prompt of a key repeats before its epoch ends


def test_adaptive_ignores_unscored_groups_and_checks_lengths():
    src = AdaptivePromptSource(EASY + HARD, per_step=2, seed=0, key=BY_WORD)
    src.batch(0)
    with pytest.raises(ValueError, match="3 group spreads for 2 prompts"):
        src.observe(torch.zeros(3))
    src.observe(torch.tensor([float("nan"), float("nan")]))
    assert not src.seen.any()
    with pytest.raises(RuntimeError, match="iteration 0 were already observed"):
        src.observe(torch.zeros(2))


@pytest.mark.parametrize("num_keys,per_step", [(5, 4), (5, 5), (3, 8)])
def test_adaptive_draw_shares_follow_the_weights(num_keys, per_step):
    """Keys are drawn ∝ weight whether there are fewer, as many or more keys than draws per step."""
    prompts = [f"k{k} p{i}" for k in range(num_keys) for i in range(4)]
    src = AdaptivePromptSource(prompts, per_step=per_step, seed=0, key=BY_WORD, floor=0.1)
    src.spread[:] = torch.tensor([0.0] + [0.2] * (num_keys - 1), dtype=torch.float64)  # key k0: no spread
    src.seen[:] = True
    w = src.weights()
    counts = Counter(BY_WORD(p) for it in range(400) for p in src.batch(it))
    share = counts["k0"] / (400 * per_step)
    expected = float(w[0] / w.sum())
    assert expected < 0.05 and abs(share - expected) < 0.02, (share, expected)


def test_adaptive_moving_average_updates_once_per_iteration_per_key():
    src = AdaptivePromptSource(EASY + HARD, per_step=4, seed=0, key=BY_WORD, decay=0.75)
    src.batch(0)
    src._last = [0, 1, 20, 21]  # two easy and two hard groups
    src.observe(torch.tensor([0.2, 0.4, 1.0, float("nan")]))
    assert src.spread.tolist() == pytest.approx([0.3, 1.0])  # first sight: the mean of its groups
    src.batch(1)
    src._last = [2, 3, 22, 23]
    src.observe(torch.tensor([0.7, 0.7, 0.0, 0.0]))
    assert src.spread.tolist() == pytest.approx([0.75 * 0.3 + 0.25 * 0.7, 0.75 * 1.0])


def test_adaptive_state_round_trip_draws_the_same_prompts():
    def feed(src, its):
        out = []
        for it in its:
            prompts = src.batch(it)
            out.append(prompts)
            src.observe(torch.tensor([0.05 * it if p.startswith("easy") else 0.5 for p in prompts]))
        return out

    a = AdaptivePromptSource(EASY + HARD, per_step=4, seed=0, key=BY_WORD)
    feed(a, range(5))
    b = AdaptivePromptSource(EASY + HARD, per_step=4, seed=0, key=BY_WORD)
    b.batch(5)  # a stale draw is forgotten on load
    b.load_state_dict(a.state_dict())
    assert feed(b, range(5, 12)) == feed(a, range(5, 12))  # with feedback after the resume
    other = AdaptivePromptSource(
        EASY + [p.upper() for p in HARD], per_step=4, seed=0, key=lambda p: p.split()[0].lower()
    )
    with pytest.raises(ValueError, match="other prompts or keys"):  # same keys, other prompts
        other.load_state_dict(a.state_dict())


def test_group_reward_std_per_group():
    forest = Forest(prompts=["a", "b", "c"])
    forest.add_roots(torch.zeros(5, 1), group=[0, 0, 1, 1, 2], seed=[0, 1, 2, 3, 4])
    forest.reward[:] = torch.tensor([1.0, 3.0, 2.0, 2.0, float("nan")])
    std = forest.group_reward_std()
    assert std[:2].tolist() == [1.0, 0.0] and torch.isnan(std[2])


def test_group_reward_std_counts_only_leaves_and_follows_merge():
    """A tree: the root and the internal node carry no reward; after a merge the groups are renumbered."""

    def tree(leaf_rewards):
        f = Forest(prompts=["p"])
        root = f.add_roots(torch.zeros(1, 1), group=[0], seed=[0])
        edge = lambda m: dict(logp=torch.zeros(m), std=torch.ones(m), kernel="flow_grpo", eta=1.0, batch=0)  # noqa: E731
        mid = f.add_children(root.repeat(2), torch.zeros(2, 1), sigma=0.5, step=1, **edge(2))
        leaves = f.add_children(mid.repeat_interleave(2), torch.zeros(4, 1), sigma=0.0, step=2, **edge(4))
        f.reward[leaves] = torch.tensor(leaf_rewards)
        return f

    merged = Forest.merge([tree([0.0, 0.0, 1.0, 1.0]), tree([2.0, 2.0, 2.0, 2.0])])
    std = merged.group_reward_std()
    assert std.tolist() == pytest.approx([0.5, 0.0])


def test_config_keys_and_errors(tmp_path):
    cfg = TrainConfig.from_yaml(None, ["prompts.sampling=adaptive", "prompts.difficulty_key=shapes_task"])
    src = build_prompt_source(cfg.prompts, seed=0)
    assert isinstance(src, AdaptivePromptSource) and src.keys == sorted(
        ["single", "two_objects", "counting", "color_attr", "position"]
    )
    assert shapes_task("three green triangles") == "counting"
    with pytest.raises(ConfigError, match=r"prompts.sampling='adaptiv'.*did you mean 'adaptive'"):
        TrainConfig.from_yaml(None, ["prompts.sampling=adaptiv"])
    with pytest.raises(ConfigError, match=r"prompts.adaptive_floor=0.0 must be in \(0, 1\]"):
        TrainConfig.from_yaml(None, ["prompts.sampling=adaptive", "prompts.adaptive_floor=0"])
    bad = TrainConfig.from_yaml(None, ["prompts.sampling=adaptive", "prompts.difficulty_key=task"])
    with pytest.raises(
        ConfigError, match=r"prompts.difficulty_key='task' is not supported; accepted: \['prompt', 'shapes_task'\]"
    ):
        build_prompt_source(bad.prompts, seed=0)
    odd = TrainConfig.from_yaml(
        None,
        ["prompts.sampling=adaptive", "prompts.difficulty_key=shapes_task", "prompts.train=a red circle|a purple dog"],
    )
    with pytest.raises(ConfigError, match="fails on prompt 'a purple dog'"):
        build_prompt_source(odd.prompts, seed=0)
    plugin = tmp_path / "keys.py"
    plugin.write_text("def first_word(prompt):\n    return prompt.split()[0]\n")
    own = TrainConfig.from_yaml(
        None,
        [
            "prompts.sampling=adaptive",
            f"prompts.difficulty_key={plugin}:first_word",
            "prompts.train=a red circle|two blue squares|a dog",
        ],
    )
    assert build_prompt_source(own.prompts, seed=0).keys == ["a", "two"]
    for target, message in [
        (f"{plugin}:last_word", r"has no function 'last_word' \(functions in it: \['first_word'\]\)"),
        (f"{tmp_path}/nope.py:f", "no such file"),
        ("json:nofn", "has no function 'nofn'"),
        ("shapes", r"did you mean 'shapes_task'"),
        (":f", "is not supported"),
    ]:
        cfg = TrainConfig.from_yaml(None, ["prompts.sampling=adaptive", f"prompts.difficulty_key={target}"])
        with pytest.raises(ConfigError, match=message):
            build_prompt_source(cfg.prompts, seed=0)


def test_trainer_feeds_spreads_back_and_resumes_the_same_prompts(tmp_path):
    """Adaptive sampling in the loop: the statistics move, are logged, and a resumed run draws what an
    uninterrupted one drew (they are in the checkpoint)."""
    key_file = tmp_path / "keys.py"
    key_file.write_text("def first_word(prompt):\n    return prompt.split()[0]\n")  # 'a' pools three prompts
    extra = ("prompts.sampling=adaptive", f"prompts.difficulty_key={key_file}:first_word", "train.checkpoint_every=2")
    straight = Trainer(tiny_config(tmp_path, "straight", "train.max_steps=4", *extra), model=make_model("sd3"))
    straight.train()
    assert straight.prompts.seen.any()
    Trainer(tiny_config(tmp_path, "resumed", "train.max_steps=2", *extra), model=make_model("sd3")).train()
    second = Trainer(
        tiny_config(tmp_path, "resumed", "train.max_steps=4", "train.resume=latest", *extra), model=make_model("sd3")
    )
    second.train()
    read = lambda name: [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a = [r for r in read("straight") if "reward_mean" in r]
    b = [r for r in read("resumed") if "reward_mean" in r]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"], (ra["step"], ra, rb)
        assert {k: v for k, v in ra.items() if k.startswith("prompts/p/")} == {
            k: v for k, v in rb.items() if k.startswith("prompts/p/")
        }
    assert "groups_without_spread" in a[0] and any(k.startswith("prompts/p/") for k in a[-1])
    assert torch.equal(straight.prompts.cursor, second.prompts.cursor)
    assert a[-1]["prompts/p/a"] != pytest.approx(0.5)  # the observed spreads moved the draw weights


def test_resume_across_sampling_modes_is_explained(tmp_path):
    Trainer(tiny_config(tmp_path, "epoch", "train.max_steps=1"), model=make_model("sd3")).train()
    with pytest.raises(ValueError, match="written with prompts.sampling=epoch.*resume it with prompts.sampling=epoch"):
        Trainer(
            tiny_config(tmp_path, "epoch", "train.max_steps=2", "train.resume=latest", "prompts.sampling=adaptive"),
            model=make_model("sd3"),
        ).train()
    Trainer(
        tiny_config(tmp_path, "adaptive", "train.max_steps=1", "prompts.sampling=adaptive"), model=make_model("sd3")
    ).train()
    with pytest.warns(UserWarning, match="holds adaptive prompt statistics but prompts.sampling=epoch"):
        Trainer(
            tiny_config(tmp_path, "adaptive", "train.max_steps=2", "train.resume=latest"), model=make_model("sd3")
        ).train()
