"""Qwen-Image-Edit adapter on a tiny offline QwenImageEditPipeline (issue 37): prompts that carry their source
image, the conditioning cached per (instruction, image), the negative prompt on the same source, sampling and
decoding equal to the pipeline's, replay ratio exactly 1, the LoRA in a fresh pipeline, bf16 on CPU, one policy and
one NFT iteration, and an edit prompt without its image refused at load. CPU only."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from flowrl.errors import ConfigError
from flowrl.models import MODEL_FAMILIES, LoraSpec, load_model, wrap
from flowrl.models.image_prompts import image_prompt
from flowrl.models.qwen_image_edit import QwenImageEditFlowModel
from flowrl.models.testing.qwen_image import tiny_qwen_image_edit_pipeline
from tests.conftest import assert_lora_reloads, perturb_lora, random_source_images

SIZE = dict(height=32, width=32, max_sequence_length=16)
IMAGE_TOKENS = 256  # a 32×32 source: 16×16 vision patches (the tiny processor: patch 2, merge 1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    """Three 32×32 source images with different content (paths)."""
    return random_source_images(tmp_path_factory.mktemp("sources"), 3, 32)


def prompts_of(sources, n=3):
    texts = ["make it red", "add a blue dog", "make it red"]  # the same instruction on two different images
    return [image_prompt(texts[i], sources[i]) for i in range(n)]


def make(**kw):
    pipe = tiny_qwen_image_edit_pipeline()
    return pipe, wrap(pipe, **SIZE, **kw)


def test_family_is_registered_and_loads_from_a_folder(tmp_path, sources):
    assert MODEL_FAMILIES["qwen_image_edit"].pipeline == "QwenImageEditPipeline"
    pipe, model = make(guidance=2.0)
    assert type(model) is QwenImageEditFlowModel and model.takes_source_image and model.latent_shape == (4, 8, 8)
    pipe.save_pretrained(tmp_path)
    loaded = load_model("qwen_image_edit", tmp_path, guidance=2.0, **SIZE)
    x, s, prompts = model.noise([1, 2]), torch.tensor([0.8, 0.4]), prompts_of(sources, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            model.velocity(x, s, model.encode(prompts)),
            loaded.velocity(x, s, loaded.encode(prompts)),
            rtol=1e-5,
            atol=1e-5,
        )
    with pytest.raises(
        ValueError,
        match=r"edits an image, and the prompt 'make it red' carries none; "
        r"accepted: '\[image: PATH\] INSTRUCTION'",
    ):
        model.encode(["make it red"])


def test_conditioning_is_cached_per_instruction_and_image_and_carries_the_source(sources, monkeypatch):
    pipe, model = make(guidance=3.0)
    calls = []
    original = pipe.encode_prompt
    monkeypatch.setattr(
        pipe,
        "encode_prompt",
        lambda prompt, image=None, **k: calls.append((prompt[0], image.size)) or original(prompt, image=image, **k),
    )
    prompts = prompts_of(sources)
    a = model.encode(prompts + prompts[:1])
    assert [c[0] for c in calls] == [
        "make it red",
        "add a blue dog",
        "make it red",
        " ",
        " ",
        " ",
    ]  # negative per image
    assert all(size == (32, 32) for _, size in calls)  # the source at the generated size
    b = model.encode(prompts[2:])
    assert len(calls) == 6  # cached: the same (instruction, image) is not encoded again
    cond, uncond = a.cond, a.uncond
    assert cond["prompt_embeds"].shape == (4, 16 + IMAGE_TOKENS, 32) and cond["image_latents"].shape == (4, 16, 16)
    assert torch.equal(cond["image_latents"], uncond["image_latents"])  # CFG rows edit the same source
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][2])  # same words, other image
    assert not torch.equal(cond["image_latents"][0], cond["image_latents"][2])
    assert torch.equal(cond["prompt_embeds"][2], b.cond["prompt_embeds"][0])  # independent of batch companions
    # the source latent is the pipeline's own: argmax of the VAE posterior, normalised, packed
    pixels = pipe.image_processor.preprocess(Image.open(sources[1]).convert("RGB"), 32, 32).unsqueeze(2)
    torch.testing.assert_close(
        cond["image_latents"][1:2], pipe._pack_latents(pipe._encode_vae_image(pixels, None), 1, 4, 8, 8)
    )


def test_a_prompt_longer_than_max_sequence_length_is_refused_naming_its_text_tokens(sources):
    """The padded length is max_sequence_length plus the source's vision tokens; an instruction whose text takes
    more is refused, naming the setting and its text tokens (the padding shared with Qwen-Image's adapter)."""
    _, model = make()
    prompt = prompts_of(sources)[1]
    text_tokens = int(model.encode([prompt]).cond["prompt_embeds_mask"].sum()) - IMAGE_TOKENS
    assert 2 < text_tokens <= SIZE["max_sequence_length"]
    short = wrap(tiny_qwen_image_edit_pipeline(), **{**SIZE, "max_sequence_length": text_tokens - 1})
    with pytest.raises(
        ValueError,
        match=rf"model.max_sequence_length={text_tokens - 1}: the prompt .* takes "
        rf"{text_tokens} tokens besides its image's; raise it",
    ):
        short.encode([prompt])
    exact = wrap(tiny_qwen_image_edit_pipeline(), **{**SIZE, "max_sequence_length": text_tokens}).encode([prompt])
    assert exact.cond["prompt_embeds_mask"].shape == (1, text_tokens + IMAGE_TOKENS)
    assert bool(exact.cond["prompt_embeds_mask"].all())  # no padding left at the exact length


def test_euler_ode_and_decode_reproduce_the_pipeline(sources, monkeypatch):
    """The source tokens after the latent's, both shapes in img_shapes, the output cut to the latent's tokens, true
    CFG with the negative prompt on the same image: ODE sampling and decoding equal QwenImageEditPipeline's (its
    source resized to 32×32 instead of ~1024²: ``calculate_dimensions`` patched)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module

    from flowrl.rollout.sampling import ode_sample

    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (32, 32, None))
    source = Image.open(sources[0]).convert("RGB")
    for g in (2.5, 1.0):
        pipe, model = make(guidance=g)
        prompt = image_prompt("make it red", sources[0])
        x = ode_sample(model, [prompt], [11], 3, decode=False)
        common = dict(
            image=source,
            prompt="make it red",
            negative_prompt=" ",
            true_cfg_scale=g,
            num_inference_steps=3,
            height=32,
            width=32,
            latents=model.pack(model.noise([11])),
        )
        with torch.no_grad():
            ref = pipe(output_type="latent", **common).images
            image = pipe(output_type="pt", **common).images
            torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)


def test_lora_loads_into_a_fresh_pipeline(tmp_path, sources):
    _, model = make(guidance=2.0)
    model.add_lora(LoraSpec(rank=4, alpha=8))
    perturb_lora(model.trainable)
    prompts = prompts_of(sources)
    x, s = model.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v = model.velocity(x, s, model.encode(prompts))
    model.save_lora(tmp_path)
    assert_lora_reloads(lambda: make(guidance=2.0), tmp_path, x, s, prompts, v)


def test_bf16_runs_on_cpu_close_to_fp32(sources):
    _, fp32 = make(guidance=2.0)
    _, bf16 = make(guidance=2.0, dtype=torch.bfloat16)
    x, s, prompts = fp32.noise([1, 2]), torch.tensor([0.8, 0.3]), prompts_of(sources, 2)
    with torch.no_grad():
        v32 = fp32.velocity(x, s, fp32.encode(prompts))
        v16 = bf16.velocity(x, s, bf16.encode(prompts))
    assert v16.dtype == torch.float32 and torch.isfinite(v16).all() and not torch.equal(v16, v32)
    assert (v16 - v32).norm() / v32.norm() < 0.05


def edit_config(tmp_path, sources, name, *overrides, nft=False):
    from tests.test_forward_process import tiny
    from tests.test_trainer import tiny_config

    (tmp_path / "edits.txt").write_text("\n".join(prompts_of(sources)) + "\n")
    return (tiny if nft else tiny_config)(
        tmp_path,
        name,
        "model.family=qwen_image_edit",
        f"prompts.train={tmp_path / 'edits.txt'}",
        "prompts.eval=null",
        "rewards=[{name: brightness}, {name: source_fidelity, kwargs: {size: 8}}]",
        *overrides,
    )


def test_policy_iteration_replays_with_ratio_one_and_scores_against_the_source(tmp_path, sources):
    from flowrl.training.trainer import Trainer

    cfg = edit_config(
        tmp_path,
        sources,
        "edit",
        "train.max_steps=1",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.window.size=2",
        "train.async_reward=false",
    )
    trainer = Trainer(cfg, model=make(guidance=2.0)[1])
    before = {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}
    (record,) = [r for r in trainer.train() if "reward_mean" in r]
    assert record["first_step_abs_delta_logp"] == 0.0 and record["ratio_mean"] == 1.0
    assert 0.0 < record["reward/source_fidelity"] < 1.0
    after = dict(trainer.model.trainable.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_nft_iteration_trains_the_lora(tmp_path, sources):
    from flowrl.training.trainer import Trainer

    cfg = edit_config(
        tmp_path, sources, "edit_nft", "loss.objective=nft", "train.max_steps=1", "optim.lr=1e-2", nft=True
    )
    trainer = Trainer(cfg, model=make(guidance=1.0)[1])
    before = [p.detach().clone() for p in trainer.params]
    (record,) = [r for r in trainer.train() if "reward_mean" in r]
    assert record["grad_norm"] > 0 and any(not torch.equal(b, p) for b, p in zip(before, trainer.params))


def test_an_edit_prompt_without_its_image_fails_at_load_before_the_model(tmp_path, sources):
    from flowrl.training.trainer import Trainer
    from tests.test_trainer import tiny_config

    (tmp_path / "bad.txt").write_text(f"{prompts_of(sources)[0]}\nmake it blue\n")
    cfg = tiny_config(
        tmp_path, "bad", "model.family=qwen_image_edit", f"prompts.train={tmp_path / 'bad.txt'}", "prompts.eval=null"
    )
    with pytest.raises(
        ConfigError,
        match=r"^prompts.train=.*bad.txt.*, line 2: 'make it blue' has no source image, "
        r"but model.family='qwen_image_edit' edits an image; accepted: ",
    ):
        Trainer(cfg)  # model.path is unset: the prompts fail first
    cfg = tiny_config(tmp_path, "text", "model.family=sd3", f"prompts.train={tmp_path / 'edits.txt'}")
    (tmp_path / "edits.txt").write_text("\n".join(prompts_of(sources)) + "\n")
    with pytest.raises(ConfigError, match=r"line 1: .* carries a source image, but model.family='sd3' generates"):
        Trainer(cfg)


def test_flowrl_sample_takes_edit_prompts_and_refuses_one_without_its_image(tmp_path, sources, monkeypatch):
    import argparse

    from flowrl.commands import sample as cli_sample
    from flowrl.config.schema import TrainConfig

    cfg = TrainConfig.from_yaml(None, ["model.family=qwen_image_edit", "eval.steps=2"])
    monkeypatch.setattr(cli_sample, "model_from_run", lambda *a: (cfg, make(guidance=2.0)[1], None))

    def sample(*prompts):
        args = argparse.Namespace(
            command="sample",
            checkpoint=None,
            config=None,
            overrides=[],
            prompt=list(prompts),
            num=1,
            seed=0,
            guidance=None,
            steps=None,
            out=str(tmp_path / "out"),
            scale=1,
        )
        return cli_sample.run(args)

    assert sample(image_prompt("make it red", sources[0])) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["000-make_it_red_source0.png.png", "grid.png"]
    with pytest.raises(
        ConfigError,
        match=r"^--prompt 'make it blue' has no source image, but "
        r"model.family='qwen_image_edit' edits an image",
    ):
        sample("make it blue")
