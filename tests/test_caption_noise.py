"""Web-like caption noise for pretraining: each kind draws the image one fact wrong, the same way."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.shapes import prompt_sets, world
from flowrl.shapes.caption_noise import KINDS, CaptionNoise, corrupt
from flowrl_rewards.compositional.shapes import ShapesReward


def spec(prompt: str) -> world.Spec:
    return world.parse(prompt)


def test_each_kind_is_one_fact_wrong_in_its_fixed_direction():
    assert corrupt(spec("three red circles"), "count") == spec("two red circles")
    assert corrupt(spec("one red circle"), "count") is None  # one stays right
    assert corrupt(spec("a red circle left of a blue square"), "mirror") == spec("a red circle right of a blue square")
    assert corrupt(spec("a red circle above a blue square"), "mirror") == spec("a red circle below a blue square")
    assert corrupt(spec("a red circle and a blue square"), "swap") == spec("a blue circle and a red square")
    assert corrupt(spec("a red circle and a red square"), "drop") == spec("a red circle")
    with pytest.raises(ValueError, match="applies to task 'position'"):
        corrupt(spec("a red circle"), "mirror")


def test_swap_never_draws_a_held_out_pair():
    held = [("circle", "blue")]
    assert corrupt(spec("a red circle and a blue square"), "swap", held) is None
    assert corrupt(spec("a red circle and a green square"), "swap", held) == spec("a green circle and a red square")


def test_rates_follow_the_setting_and_wrong_images_fail_the_checker():
    train, _ = prompt_sets.prompt_sets(0)
    held = prompt_sets.held_out_pairs(0)
    noise = CaptionNoise(count=0.7, mirror=0.7, swap=1.0, drop=0.5)
    rng = np.random.default_rng(0)
    flipped = {k: 0 for k in KINDS}
    eligible = {k: 0 for k in KINDS}
    images, prompts = [], []
    for p in train:
        s = spec(p)
        drawn, kind = noise.apply(s, rng, held)
        for k, task in KINDS.items():
            eligible[k] += s.task == task and corrupt(s, k, held) is not None
        if kind is not None:
            flipped[kind] += 1
            assert drawn != s and not any((o.shape, o.color) in held for o in drawn.objects)
            if len(images) < 200:
                images.append(world.render(drawn, rng))
                prompts.append(p)
        else:
            assert drawn == s
    for kind, p in (("count", 0.7), ("mirror", 0.7), ("swap", 1.0), ("drop", 0.5)):
        rate = flipped[kind] / eligible[kind]
        assert abs(rate - p) < 0.06, (kind, rate)
    assert ShapesReward("strict").details(np.stack(images), prompts)["strict"].max() == 0.0
    assert CaptionNoise().apply(spec("two red circles"), rng) == (spec("two red circles"), None)


def test_parse_names_the_bad_item():
    assert CaptionNoise.parse("count=0.5, mirror=0.8") == CaptionNoise(count=0.5, mirror=0.8)
    assert not CaptionNoise.parse("").any()
    with pytest.raises(ValueError, match="'cnt=0.5' must be KIND=P"):
        CaptionNoise.parse("cnt=0.5")
    with pytest.raises(ValueError, match="swap=1.5 must be a probability"):
        CaptionNoise.parse("swap=1.5")
