"""Qwen-Image-Edit 2509 / 2511 adapter on a tiny offline QwenImageEditPlusPipeline: prompts that carry one or several
source images (and their refusals), sampling and decoding equal to the pipeline's with two sources (2509, and 2511's
zero_cond_t transformer), a batch mixing image counts equal to its rows alone, the LoRA in a fresh pipeline; slow: one
`flowrl train` iteration of the preset with its LoRA in plain diffusers, the stored architecture's size. CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from flowrl.models import MODEL_FAMILIES, LoraSpec, wrap
from flowrl.models.qwen_image_edit_plus import (
    CONDITION_AREA,
    QwenImageEditPlusFlowModel,
    condition_size,
    image_prompts,
    split_image_prompts,
)
from flowrl.models.testing.qwen_image_edit_plus import tiny_qwen_image_edit_plus_pipeline
from tests.conftest import assert_lora_reloads, perturb_lora, random_source_images

PRESET = Path(__file__).resolve().parents[1] / "configs" / "qwen_image_edit_plus" / "flow_grpo_edit.yaml"
SIZE = dict(height=32, width=32, max_sequence_length=40, condition_area=32 * 32, max_images=2)
VISION = 256  # a 32×32 condition image: 16×16 vision patches (the tiny processor: patch 2, merge 1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    """Three 32×32 source images with different content (paths)."""
    return random_source_images(tmp_path_factory.mktemp("sources"), 3, 32)


def make(zero_cond_t=False, **kw):
    pipe = tiny_qwen_image_edit_plus_pipeline(zero_cond_t=zero_cond_t)
    return pipe, wrap(pipe, **{**SIZE, **kw})


def test_prompts_carry_one_or_several_images_and_bad_ones_are_refused(sources):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    assert MODEL_FAMILIES["qwen_image_edit_plus"].pipeline == "QwenImageEditPlusPipeline"
    prompt = image_prompts("put the cat on the sofa", sources[:2])
    assert prompt == f"[image: {sources[0]}] [image: {sources[1]}] put the cat on the sofa"
    assert split_image_prompts(prompt) == ("put the cat on the sofa", sources[:2])
    assert split_image_prompts("a plain prompt") == ("a plain prompt", [])
    for h, w in [(512, 512), (512, 1024), (768, 512)]:  # (height, width) as the pipeline's (width, height)
        assert condition_size(384 * 384, h, w) == plus_module.calculate_dimensions(384 * 384, w / h)[::-1]
    assert plus_module.CONDITION_IMAGE_SIZE == 384 * 384 == CONDITION_AREA
    _, model = make(guidance=2.0)
    assert type(model) is QwenImageEditPlusFlowModel and model.takes_source_image and model.latent_shape == (4, 8, 8)
    with pytest.raises(ValueError, match=r"edits images, and the prompt 'make it red' carries none; accepted: "):
        model.encode(["make it red"])
    with pytest.raises(ValueError, match=r"carries 3 images, more than model.kwargs.max_images=2; raise it"):
        model.encode([image_prompts("make it red", sources)])
    for key, value, accepted in [("max_images", 0, "≥ 1"), ("condition_area", 100, "≥ 1024 pixels")]:
        with pytest.raises(ValueError, match=rf"model.kwargs.{key}={value}: must be {accepted}"):
            wrap(tiny_qwen_image_edit_plus_pipeline(), **{**SIZE, key: value})


def test_a_batch_mixing_image_counts_equals_its_rows_alone(sources, monkeypatch):
    """Conditioning padded to max_images sources and their vision tokens; one transformer call per image count
    (1 and 2 here, CFG rows included), each row as it is alone; the negative prompt on the same sources."""
    pipe, model = make(guidance=3.0)
    calls, rows = [], []
    original = pipe.encode_prompt
    monkeypatch.setattr(
        pipe, "encode_prompt", lambda p, image=None, **k: calls.append((p[0], len(image))) or original(p, image, **k)
    )
    model.trainable.register_forward_hook(
        lambda m, a, kw, out: rows.append(kw["hidden_states"].shape), with_kwargs=True
    )
    prompts = [
        image_prompts("make it red", sources[:1]),
        image_prompts("make it red", sources[:2]),
        image_prompts("add a dog", sources[1:2]),
    ]
    cond = model.encode(prompts)
    assert calls == [("make it red", 1), ("make it red", 2), ("add a dog", 1), (" ", 1), (" ", 2), (" ", 1)]
    assert cond.cond["prompt_embeds"].shape == (3, 40 + 2 * VISION, 32)
    assert cond.cond["image_latents"].shape == (3, 2 * 16, 16) and cond.cond["image_count"].tolist() == [1, 2, 1]
    assert torch.equal(cond.cond["image_latents"][0, 16:], torch.zeros(16, 16))  # no second source: zeros
    assert torch.equal(cond.cond["image_latents"][0, :16], cond.cond["image_latents"][1, :16])  # the same first source
    masks = cond.cond["prompt_embeds_mask"].sum(1).tolist()
    assert masks[1] - masks[0] > VISION  # the second image's label and vision tokens
    x, s = model.noise([1, 2, 3]), torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        v = model.velocity(x, s, cond)
        assert sorted(r[:2] for r in rows) == [(2, 48), (4, 32)]  # [uncond; cond] per image count
        for i in range(3):
            torch.testing.assert_close(model.velocity(x[i : i + 1], s[i : i + 1], cond.select([i])), v[i : i + 1])


@pytest.mark.parametrize("zero_cond_t", [False, True])  # 2509, 2511
def test_euler_ode_and_decode_reproduce_the_pipeline_with_two_sources(sources, monkeypatch, zero_cond_t):
    """Picture labels, condition images, both sources' tokens after the latent's with their img_shapes, true CFG with
    the norm rescale and the negative prompt on the same sources: ODE sampling and decoding equal
    QwenImageEditPlusPipeline's (its condition and VAE sizes patched to 32×32); 2511's zero_cond_t transformer too."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    from flowrl.rollout.sampling import ode_sample

    monkeypatch.setattr(plus_module, "calculate_dimensions", lambda area, ratio: (32, 32))
    pipe, model = make(zero_cond_t, guidance=2.5)
    assert pipe.transformer.config.zero_cond_t == zero_cond_t
    x = ode_sample(model, [image_prompts("make it red", sources[:2])], [11], 2, decode=False)
    with torch.no_grad():
        ref = pipe(
            image=[Image.open(p).convert("RGB") for p in sources[:2]],
            prompt="make it red",
            negative_prompt=" ",
            true_cfg_scale=2.5,
            num_inference_steps=2,
            height=32,
            width=32,
            latents=model.pack(model.noise([11])),
            output_type="latent",
        ).images
        torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)
        config = pipe.vae.config  # the pipeline's decode: latent · std + mean, one frame of the video VAE
        std, mean = (torch.tensor(v).view(1, 4, 1, 1, 1) for v in (config.latents_std, config.latents_mean))
        image = pipe.vae.decode(pipe._unpack_latents(ref, 32, 32, 4) * std + mean, return_dict=False)[0][:, :, 0]
        image = pipe.image_processor.postprocess(image, output_type="pt")
        torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)


def test_lora_loads_into_a_fresh_pipeline(tmp_path, sources):
    """The adapter's LoRA file (two prompts, two and one sources) read by a fresh pipeline's ``load_lora_weights``
    gives the same velocities; without it, the base's."""
    _, model = make(guidance=2.0)
    model.add_lora(LoraSpec(rank=4, alpha=8))
    perturb_lora(model.trainable)
    prompts = [image_prompts("make it red", sources[:2]), image_prompts("add a dog", sources[2:])]
    x, s = model.noise([5, 6]), torch.tensor([0.9, 0.3])
    with torch.no_grad():
        v = model.velocity(x, s, model.encode(prompts))
    model.save_lora(tmp_path)
    assert_lora_reloads(lambda: make(guidance=2.0), tmp_path, x, s, prompts, v)


# ---- slow ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~7 s; the default set covers its parts: the adapter's velocities, equality with the pipeline
def test_one_preset_iteration_and_its_lora_in_plain_diffusers(tmp_path, sources):
    """One `flowrl train` iteration of configs/qwen_image_edit_plus/flow_grpo_edit.yaml on the tiny pipeline saved
    to a folder (its objective, plan, kernel and source_fidelity guard; brightness instead of PickScore, tiny sizes),
    prompts with one and two sources: exit 0, ratio exactly 1 at the first replay; the checkpoint's LoRA in a fresh
    ``QwenImageEditPlusPipeline`` through ``load_lora_weights`` gives the run's velocities and differs from the base."""
    import json

    import diffusers

    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny"
    tiny_qwen_image_edit_plus_pipeline().save_pretrained(folder)
    prompts = [image_prompts("make it red", sources[:2]), image_prompts("add a dog", sources[2:])]
    (tmp_path / "train.txt").write_text("\n".join(prompts) + "\n")
    overrides = [
        f"model.path={folder}",
        "model.dtype=float32",
        *(f"model.{k}={SIZE[k]}" for k in ("height", "width", "max_sequence_length")),
        "model.kwargs.condition_area=1024",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.gradient_checkpointing=false",
        "rollout.group_size=2",
        "rollout.steps=2",
        "rollout.max_batch=4",
        f"prompts.train={tmp_path / 'train.txt'}",
        "prompts.eval=null",
        "prompts.per_step=2",
        "train.max_steps=1",
        "train.checkpoint_every=1",
        "train.log_with=none",
        "train.progress=false",
        "train.num_threads=1",
        "train.async_reward=false",
        f"train.output_dir={tmp_path / 'runs'}",
        "train.name=plus",
        "train.updates_per_epoch=1",
        'rewards=[{"name": "brightness"}, {"name": "source_fidelity", "weight": 0.5, "kwargs": {"size": 8}}]',
    ]
    assert main(["train", str(PRESET), *overrides]) == 0
    run = tmp_path / "runs" / "plus"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    (step,) = [r for r in records if "reward_mean" in r]
    assert step["first_step_abs_delta_logp"] == 0.0 and step["ratio_mean"] == 1.0 and step["grad_norm"] > 0
    assert 0.0 < step["reward/source_fidelity"] < 1.0
    cfg, ours, _ = model_from_run(str(run), None, [])
    keys = {k: getattr(cfg.model, k) for k in ("guidance", "height", "width", "max_sequence_length")}
    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(folder)
    base = wrap(diffusers.QwenImageEditPlusPipeline.from_pretrained(folder), **keys, **cfg.model.kwargs)
    pipe.load_lora_weights(str(run / "checkpoints" / "step-1"))
    theirs = wrap(pipe, **keys, **cfg.model.kwargs)
    x, s = ours.noise([5, 6]), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_ours, v_theirs, v_base = (m.velocity(x, s, m.encode(prompts)) for m in (ours, theirs, base))
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5


@pytest.mark.slow  # builds the 20 B transformer on the meta device; nothing else covers the stored file
def test_stored_architecture_is_qwen_image_edits_with_the_published_size():
    """flowrl/models/archs/qwen_image_edit_plus.json extends Qwen-Image-Edit's (the same 20 B transformer, VAE and
    encoder, checked against the published 20 B) with the condition images' area; the preset names a hub id of it."""
    import yaml

    from flowrl.estimate.archs import build_transformer
    from flowrl.models.architectures import load_arch

    arch, edit = load_arch("qwen_image_edit_plus"), load_arch("qwen_image_edit")
    assert arch["transformer"] == edit["transformer"] and arch["vae"] == edit["vae"]
    assert arch["text"]["vision"] == edit["text"]["vision"] and arch["text"]["condition_area"] == 384 * 384
    total = sum(p.numel() for p in build_transformer(arch).parameters())
    assert abs(total - arch["published_transformer_params"]) / arch["published_transformer_params"] < 0.03
    model = yaml.safe_load(PRESET.read_text())["model"]
    assert model["path"] in arch["hub_ids"] and model["family"] == arch["family"]
    assert model["kwargs"]["condition_area"] == arch["text"]["condition_area"]
