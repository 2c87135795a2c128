"""Prompts that carry a source image (issue 37, image editing): the one-string form, what rewards receive (the
instruction, and the source in ``meta["source_images"]``), the ``source_fidelity`` reward, and the refusals at load
(an edit prompt without its image, an image prompt on a text model, a reward needing sources on text prompts, a
missing image) naming the key, the line and what is accepted. CPU only, no model."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from flowrl.errors import ConfigError
from flowrl.models.image_prompts import (
    image_prompt,
    load_source_image,
    prompt_label,
    prompt_texts,
    reward_inputs,
    split_image_prompt,
)
from flowrl.prompts.checks import check_prompt_images
from flowrl.rollout.scoring import components_of
from flowrl_rewards import MultiReward, Reward, build_reward


def write_image(path, colour, size=(16, 16)):
    Image.new("RGB", size, colour).save(path)
    return str(path)


class Seen(Reward):
    """Records the prompts and meta keys it is given; scores 0."""

    name = "seen"

    def __init__(self):
        self.calls = []

    def score(self, images, prompts, meta):
        self.calls.append((list(prompts), meta.get("source_images")))
        return torch.zeros(images.shape[0])


def test_an_image_prompt_is_one_string_that_splits_back_exactly():
    prompt = image_prompt("make the dog blue", "photos/dog 1.png")
    assert prompt == "[image: photos/dog 1.png] make the dog blue"
    assert split_image_prompt(prompt) == ("make the dog blue", "photos/dog 1.png")
    assert split_image_prompt(image_prompt(" ", "a.png")) == (" ", "a.png")  # a negative prompt " " stays " "
    assert split_image_prompt("a red circle") == ("a red circle", None)
    assert split_image_prompt("[imagine] a red circle") == ("[imagine] a red circle", None)
    assert prompt_texts([prompt, "a red circle"]) == ["make the dog blue", "a red circle"]
    assert prompt_label(prompt) == "make the dog blue [dog 1.png]" and prompt_label("a cat") == "a cat"


def test_rewards_receive_the_instruction_and_the_source_resized_to_the_samples(tmp_path):
    red, blue = (
        write_image(tmp_path / "red.png", (255, 0, 0), (20, 12)),
        write_image(tmp_path / "blue.png", (0, 0, 255)),
    )
    prompts = [image_prompt("make it green", red), image_prompt("make it pink", blue)]
    images = torch.rand(2, 3, 8, 10)
    texts, meta = reward_inputs(prompts, {"specs": 1}, images)
    assert texts == ["make it green", "make it pink"] and meta["specs"] == 1
    sources = meta["source_images"]
    assert sources.shape == (2, 3, 8, 10) and sources.dtype == torch.float32
    torch.testing.assert_close(sources[0].mean(dim=(1, 2)), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(sources[1].mean(dim=(1, 2)), torch.tensor([0.0, 0.0, 1.0]))
    assert reward_inputs(["a red circle"], {}, images[:1]) == (["a red circle"], {})  # text prompts: unchanged
    with pytest.raises(ValueError, match="mixes prompts with and without a source image"):
        reward_inputs([prompts[0], "a red circle"], {}, images)
    # through the one place flowrl calls a reward: every term of a MultiReward sees the same
    seen = Seen()
    multi = MultiReward([seen, build_reward("brightness")])
    components_of(multi, images, prompts, {})
    components_of(seen, images, prompts, {})
    for got_prompts, got_sources in seen.calls:
        assert got_prompts == ["make it green", "make it pink"]
        torch.testing.assert_close(got_sources, sources)


def test_source_fidelity_ranks_an_edit_that_keeps_the_source_above_one_that_repaints_it(tmp_path):
    path = write_image(tmp_path / "half.png", (0, 0, 0), (16, 16))
    with Image.open(path) as im:
        im.paste((255, 255, 255), (0, 0, 16, 8))  # top half white
        im.save(path)
    source = load_source_image(path, 16, 16)
    kept = source.clone()
    kept[0] = kept[0] * 0.8  # a colour change: layout kept
    repainted = 1.0 - source  # everything swapped
    fidelity = build_reward("source_fidelity", size=8)
    scores = components_of(fidelity, torch.stack([source, kept, repainted]), [image_prompt("x", path)] * 3, {})
    s = scores["source_fidelity"]
    assert s[0] == pytest.approx(1.0) and s[0] > s[1] > s[2] and s[2] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="compares each sample with its prompt's source image, and none was given"):
        fidelity(source[None], ["a red circle"])
    with pytest.raises(ValueError, match="size=0 must be an integer >= 1"):
        build_reward("source_fidelity", size=0)


def test_prompts_that_do_not_fit_the_model_fail_at_load_naming_key_line_and_form(tmp_path):
    dog = write_image(tmp_path / "dog.png", (10, 20, 30))
    good = tmp_path / "edits.txt"
    good.write_text(f"# edits\n[image: {dog}] make the dog blue\n[image: {dog}] add a hat\n")
    check_prompt_images(str(good), "prompts.train", edits=True, family="qwen_image_edit")  # fits
    check_prompt_images("a red circle|a blue square", "prompts.train", edits=False, family="sd3")
    mixed = tmp_path / "mixed.txt"
    mixed.write_text(f"[image: {dog}] make the dog blue\nmake it red\n")
    with pytest.raises(
        ConfigError,
        match=r"^prompts.train=.*mixed.txt.*, line 2: 'make it red' has no source image, "
        r"but model.family='qwen_image_edit' edits an image; accepted: "
        r"'\[image: PATH\] INSTRUCTION'",
    ):
        check_prompt_images(str(mixed), "prompts.train", edits=True, family="qwen_image_edit")
    with pytest.raises(
        ConfigError,
        match=r"^prompts.eval=.*, line 2: .* carries a source image, but "
        r"model.family='sd3' generates from text; .*model.family=qwen_image_edit",
    ):
        check_prompt_images(str(good), "prompts.eval", edits=False, family="sd3")
    with pytest.raises(
        ConfigError,
        match=r"prompt 1: 'a red circle': reward 'source_fidelity' compares the sample "
        r"with the prompt's source image, and this prompt has none",
    ):
        check_prompt_images(
            "a red circle|two dogs",
            "prompts.train",
            edits=False,
            family="sd3",
            rewards=[build_reward("source_fidelity")],
        )
    missing = tmp_path / "missing.txt"
    missing.write_text(f"[image: {dog}] ok\n[image: {tmp_path}/nope.png] make it blue\n")
    with pytest.raises(ConfigError, match=r"line 2: .*no such image '.*nope.png' \(looked in the working directory"):
        check_prompt_images(str(missing), "prompts.train", edits=True, family="qwen_image_edit")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match=r"prompt 1: .*cannot open the image '.*broken.png'"):
        check_prompt_images(
            f"[image: {tmp_path}/broken.png] make it blue", "prompts.train", edits=True, family="qwen_image_edit"
        )
    with pytest.raises(ConfigError, match=r"prompt 1: .*the instruction is empty"):
        check_prompt_images(f"[image: {dog}]  |[image: {dog}] x", "prompts.train", edits=True, family="qwen_image_edit")


def test_several_images_per_prompt_are_each_checked_and_allowed_only_where_the_family_takes_them(tmp_path):
    from flowrl.models import model_family
    from flowrl.models.image_prompts import split_image_prompts

    a, b = write_image(tmp_path / "a.png", (10, 20, 30)), write_image(tmp_path / "b.png", (30, 20, 10))
    two = f"[image: {a}] [image: {b}] put the cat on the sofa"
    assert split_image_prompts(two) == ("put the cat on the sofa", [a, b])
    assert prompt_texts([two]) == ["put the cat on the sofa"] and prompt_label(two).endswith("[a.png, b.png]")
    plus, single = (model_family(f).adapter_class().source_images for f in ("qwen_image_edit_plus", "qwen_image_edit"))
    assert (plus, single) == (None, 1)
    check_prompt_images(two, "prompts.train", edits=True, family="qwen_image_edit_plus", most=plus)  # fits
    with pytest.raises(ConfigError, match=r"prompt 1: .* carries 2 images, but model.family='qwen_image_edit' edits 1"):
        check_prompt_images(two, "prompts.train", edits=True, family="qwen_image_edit", most=single)
    missing_second = f"[image: {a}] [image: {tmp_path}/nope.png] put the cat on the sofa"
    with pytest.raises(ConfigError, match=r"prompt 1: .*no such image '.*nope.png'"):  # every image opens at load
        check_prompt_images(missing_second, "prompts.train", edits=True, family="qwen_image_edit_plus", most=None)
    texts, meta = reward_inputs([two], {}, torch.zeros(1, 3, 8, 8))
    assert texts == ["put the cat on the sofa"] and meta["source_images"].shape == (1, 3, 8, 8)  # the first image
