"""The embedded shapes pipeline: builds offline, the shipped weights load with plain diffusers and
generate the requested colours far more often than an untrained pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.shapes import prompt_sets, world
from flowrl.shapes.pipeline import (
    CLIP_MAX_LENGTH,
    CONFIG_FILE,
    MAX_SEQUENCE_LENGTH,
    SHIPPED_DIR,
    build_shapes_pipeline,
    generation_defaults,
    load_shapes_pipeline,
)
from flowrl_rewards.compositional.shapes import ShapesReward

# Single-object prompts: every colour, on two shapes (includes held-out colour-shape pairs).
SINGLE_PROMPTS = [f"a {c} {s}" for c in world.COLORS for s in ("circle", "square")]


@pytest.fixture(scope="module")
def shipped():
    """The shipped pipeline, loaded exactly as a diffusers user would."""
    from diffusers import StableDiffusion3Pipeline

    assert (SHIPPED_DIR / "model_index.json").is_file(), f"shipped weights missing in {SHIPPED_DIR}"
    pipe = StableDiffusion3Pipeline.from_pretrained(SHIPPED_DIR, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def untrained():
    """A freshly built (untrained) shapes pipeline, seed 0."""
    return build_shapes_pipeline(seed=0)


def _generate(pipe, prompts, guidance, seed=0, steps=20, output_type="pt"):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    return pipe(
        prompts,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=32,
        width=32,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=gens,
        output_type=output_type,
    ).images


def test_tokenizer_one_token_per_word(untrained, shipped):
    pipe = untrained
    for tok in (pipe.tokenizer, pipe.tokenizer_2, shipped.tokenizer, shipped.tokenizer_2):
        assert tok.model_max_length == CLIP_MAX_LENGTH
        ids = {}
        for word in world.vocabulary():
            enc = tok(word).input_ids
            assert len(enc) == 3, f"{word!r} → {enc}"  # BOS, word, EOS
            assert enc[1] != tok.unk_token_id
            ids[word] = enc[1]
        assert len(set(ids.values())) == len(ids)  # distinct words, distinct tokens
    # Longest prompt form still fits (BOS + 8 words + EOS ≤ CLIP_MAX_LENGTH).
    longest = max(prompt_sets.prompt_sets(0)[0], key=lambda p: len(p.split()))
    assert len(pipe.tokenizer(longest).input_ids) <= CLIP_MAX_LENGTH


def test_build_encodes_with_short_sequence(untrained):
    pipe = untrained
    embeds, _, pooled, _ = pipe.encode_prompt(
        ["a red circle", "two blue squares"],
        None,
        None,
        do_classifier_free_guidance=False,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )
    assert embeds.shape == (2, CLIP_MAX_LENGTH + MAX_SEQUENCE_LENGTH, pipe.transformer.config.joint_attention_dim)
    assert pooled.shape == (2, pipe.transformer.config.pooled_projection_dim)
    assert not torch.allclose(embeds[0], embeds[1])  # prompts are told apart
    # Same seed, same weights.
    again = build_shapes_pipeline(seed=0)
    for module in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        for (n, p), q in zip(getattr(pipe, module).named_parameters(), getattr(again, module).parameters()):
            assert torch.equal(p, q), f"{module}.{n}"


def test_shipped_folder_and_defaults():
    cfg = json.loads((SHIPPED_DIR / CONFIG_FILE).read_text())
    assert cfg["max_sequence_length"] == MAX_SEQUENCE_LENGTH and cfg["height"] == cfg["width"] == 32
    assert generation_defaults()["max_sequence_length"] == MAX_SEQUENCE_LENGTH
    size_mb = sum(f.stat().st_size for f in SHIPPED_DIR.rglob("*") if f.is_file()) / 2**20
    assert size_mb <= 25, f"shipped folder is {size_mb:.1f} MB"
    assert (SHIPPED_DIR / "pretrain_report.json").is_file()


def test_shipped_generates_images(shipped):
    images = _generate(shipped, ["a red circle"], guidance=1.0)
    assert images.shape == (1, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    pil = _generate(shipped, ["a blue square above a green triangle"], guidance=3.0, steps=10, output_type="pil")
    assert pil[0].size == (32, 32)
    # load_shapes_pipeline is the same plain loader
    again = load_shapes_pipeline()
    assert torch.equal(_generate(again, ["a red circle"], guidance=1.0), images)


def test_generation_is_deterministic(shipped):
    prompts = ["three cyan triangles", "a yellow square left of a red circle"]
    a = _generate(shipped, prompts, guidance=3.0, seed=7, steps=10)
    b = _generate(shipped, prompts, guidance=3.0, seed=7, steps=10)
    c = _generate(shipped, prompts, guidance=3.0, seed=8, steps=10)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_shipped_finds_requested_colours_far_more_than_untrained(shipped, untrained):
    reward = ShapesReward()
    trained = reward.evaluate(_generate(shipped, SINGLE_PROMPTS, guidance=3.0), SINGLE_PROMPTS)
    baseline = reward.evaluate(_generate(untrained, SINGLE_PROMPTS, guidance=3.0), SINGLE_PROMPTS)
    assert trained["colors_found"] >= 0.75, trained
    assert baseline["colors_found"] <= 0.25, baseline
    assert trained["accuracy"] > baseline["accuracy"]
