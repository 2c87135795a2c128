"""HunyuanImage 2.1 adapter on a tiny offline HunyuanImagePipeline: the two text encoders (Qwen2.5-VL with its mask,
ByT5 for quoted text), exactness of sampling and decoding against the pipeline (CFG through its guider, before the
guider's APG steps; the guidance-distilled embedding), the refiner refused by name, LoRA files a plain diffusers
transformer loads, the stored architecture and one ``flowrl train`` iteration of the preset. CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, load_model, wrap
from flowrl.models.hunyuan_image import HunyuanImageFlowModel
from flowrl.models.testing.hunyuan_image import tiny_hunyuan_image_pipeline
from tests.test_models import PROMPTS, inputs

SIZE = dict(height=16, width=16, max_sequence_length=16)
LORA_FILE = "pytorch_lora_weights.safetensors"
PRESET = str(Path(__file__).resolve().parents[1] / "configs" / "hunyuan_image" / "flow_grpo_pickscore.yaml")


def make(glyph: bool = False, guidance_embeds: bool = False, **kw):
    pipe = tiny_hunyuan_image_pipeline(glyph=glyph, guidance_embeds=guidance_embeds)
    pipe.set_progress_bar_config(disable=True)
    pipe.tokenizer_max_length = SIZE["max_sequence_length"]  # the pipeline's own calls encode as the adapter does
    return pipe, wrap(pipe, **SIZE, **kw)


def test_family_sizes_defaults_loading_and_the_refiner_refused(tmp_path):
    """The family, its latent (one token per cell of the 32× VAE), the guider's CFG scale as the default guidance;
    the refiner refused by name before loading (a folder or hub id), as a pipeline and as ``use_refiner``; the
    MeanFlow distilled transformer refused."""
    from diffusers import HunyuanImageRefinerPipeline

    pipe, model = make()
    assert MODEL_FAMILIES["hunyuan_image"].pipeline == "HunyuanImagePipeline" and type(model) is HunyuanImageFlowModel
    assert (model.latent_shape, model.image_seq_len, model.vae_scale_factor, model.guidance) == ((4, 4, 4), 16, 4, 3.5)
    default = wrap(tiny_hunyuan_image_pipeline())
    assert (default.height, default.max_sequence_length, default.uses_cfg()) == (256, 1000, True)  # 64 cells of f 4
    with pytest.raises(ValueError, match="multiples of 2 × vae_scale_factor = 8"):
        wrap(pipe, **{**SIZE, "height": 12})
    with pytest.raises(ValueError, match=r"model.max_sequence_length=1001: must be in \[1, 1000\]"):
        wrap(pipe, max_sequence_length=1001)
    pipe.save_pretrained(tmp_path / "base")
    loaded = load_model("hunyuan_image", tmp_path / "base", **SIZE)
    x, s, prompts = inputs(model)
    with torch.no_grad():
        assert torch.equal(*(m.velocity(x, s, m.encode(prompts)) for m in (model, loaded)))
    refiner = tmp_path / "refiner-folder"
    refiner.mkdir()
    (refiner / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanImageRefinerPipeline"}))
    for path in (refiner, "hunyuanvideo-community/HunyuanImage-2.1-Refiner-Diffusers"):
        with pytest.raises(ValueError, match=r"model.path=.*refiner stage \(HunyuanImageRefinerPipeline"):
            load_model("hunyuan_image", path)
    with pytest.raises(ValueError, match=r"model.kwargs.use_refiner=True: .*refiner stage"):
        wrap(pipe, use_refiner=True)
    fake = HunyuanImageRefinerPipeline.__new__(HunyuanImageRefinerPipeline)  # its class alone is refused
    fake.transformer = pipe.transformer
    with pytest.raises(ValueError, match="HunyuanImageRefinerPipeline .*refiner stage"):
        HunyuanImageFlowModel(fake)
    pipe.transformer.register_to_config(use_meanflow=True)
    with pytest.raises(ValueError, match=r"HunyuanImage-2.1-Distilled's transformer \(use_meanflow\)"):
        wrap(pipe)


def test_encode_gives_both_encoders_masked_and_fixed_length():
    """Qwen2.5-VL: the template's first 34 tokens dropped, padded to max_sequence_length with its mask; ByT5: the
    quoted text's bytes (mask on) or zeros (mask off); equal to the pipeline's encode_prompt, each prompt cached."""
    pipe, model = make(glyph=True)
    prompts = [PROMPTS[0], "a sign 'two cat' red"]
    cond = model.encode(prompts + prompts[:1], 1.0).cond
    assert cond["prompt_embeds"].shape == (3, 16, 16) and cond["prompt_embeds_2"].shape == (3, 128, 8)
    assert cond["prompt_embeds_mask"][0].sum() == 3 + 1  # its 3 words and the template's closing <|im_end|>
    ref = pipe.encode_prompt(prompts, batch_size=2)
    for got, want in zip((cond[k][:2] for k in cond), ref):
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6)
    assert cond["prompt_embeds_mask_2"][0].sum() == 0 and cond["prompt_embeds_2"][0].abs().sum() == 0
    assert cond["prompt_embeds_mask_2"][1].sum() == len('Text "two cat". ') + 1  # the glyph text's bytes and </s>
    assert torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][2])


@pytest.mark.parametrize(
    "glyph, distilled, steps, prompt, g",
    [
        (True, False, 2, "a sign 'hello' red", None),  # the guider's CFG 3.5, the ByT5 branch on
        (False, False, 6, "a green tree", 2.0),  # up to 6 steps: the guider's APG never starts
        (False, True, 3, "a green tree", 3.0),  # guidance-distilled: the embedding, no CFG rows
    ],
)
def test_euler_ode_and_decode_reproduce_the_pipeline(glyph, distilled, steps, prompt, g):
    """Timestep σ·1000, CFG [uncond; cond] combined as the guider's CFG (or the distilled embedding g·1000), both
    text encoders with their masks, linspace(1, 0) shifted by 5, decode by the scaling factor: ODE sampling from the
    pipeline's own noise and decoding equal HunyuanImagePipeline's."""
    from flowrl.rollout.sampling import ode_sample

    pipe, model = make(glyph, distilled, **({} if g is None else {"guidance": g}))
    if g is not None and not distilled:
        pipe.guider = type(pipe.guider)(guidance_scale=g)
    assert model.uses_cfg() is not distilled
    x = ode_sample(model, [prompt], [11], steps, decode=False)
    common = dict(prompt=prompt, num_inference_steps=steps, height=16, width=16)
    if distilled:
        common["distilled_guidance_scale"] = g
    with torch.no_grad():
        ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(11), **common).images
        image = pipe(output_type="pt", latents=model.noise([11]), **common).images
        assert torch.equal(model.schedule(steps), pipe.scheduler.sigmas)
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)
        if not distilled:  # beyond 6 steps the guider switches to APG (momentum over the steps): not reproduced
            apg = pipe(output_type="latent", latents=model.noise([11]), **{**common, "num_inference_steps": 8})
            assert not torch.allclose(ode_sample(model, [prompt], [11], 8, decode=False), apg.images, atol=1e-3)


def test_lora_targets_and_files_a_plain_transformer_loads(tmp_path):
    """The default targets reach both streams' attention and feed-forwards and the single-stream blocks, not the
    final ``proj_out``; save_lora writes diffusers' single-transformer LoRA file: a fresh pipeline's
    ``transformer.load_lora_adapter(folder, prefix="transformer")`` gives the same velocities; ``load_lora`` restores
    it in place and from the file."""
    _, model = make()
    model.add_lora(LoraSpec(rank=2, alpha=4, init="default"))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    assert "single_transformer_blocks.0.proj_out" in wrapped and "proj_out" not in wrapped
    assert {"transformer_blocks.0.ff_context.net.2", "single_transformer_blocks.0.proj_mlp"} <= wrapped
    assert (
        "transformer_blocks.0.attn.add_q_proj" in wrapped and len(wrapped) == 12 + 5 + 6
    )  # double, single, refiner block
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.trainable.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    x, s, prompts = inputs(model)
    v = model.velocity(x, s, model.encode(prompts))
    model.save_lora(tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file() and type(
        model.pipe
    ).__name__ == "HunyuanImagePipeline"
    pipe, fresh = make()
    v_base = fresh.velocity(x, s, fresh.encode(prompts))
    pipe.transformer.load_lora_adapter(str(tmp_path), weight_name=LORA_FILE, prefix="transformer")
    torch.testing.assert_close(fresh.velocity(x, s, fresh.encode(prompts)), v, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(v, v_base)
    _, created = make()
    created.load_lora(tmp_path)
    assert torch.equal(created.velocity(x, s, created.encode(prompts)), v)
    _, resumed = make()
    resumed.add_lora(LoraSpec(rank=2, alpha=4))
    resumed.load_lora(tmp_path)
    assert torch.equal(resumed.velocity(x, s, resumed.encode(prompts)), v)


def test_stored_architecture_matches_the_published_size():
    """HunyuanImage 2.1's transformer from the stored config on the meta device: the published 17B (17.4 B in
    diffusers); its encoders: Qwen2.5-VL-7B and ByT5-small's encoder."""
    from flowrl.estimate.archs import build_transformer, text_encoder_params
    from flowrl.models.architectures import load_arch

    arch = load_arch("hunyuan_image_2_1")
    total = sum(p.numel() for p in build_transformer(arch).parameters())
    assert 17.3e9 < total < 17.5e9 and abs(total - arch["published_transformer_params"]) / total < 0.03
    encoders = text_encoder_params(arch)
    assert 8.2e9 < encoders["text_encoder"] < 8.4e9 and 0.2e9 < encoders["text_encoder_2"] < 0.23e9


@pytest.mark.slow  # ~4 s; covered fast by test_euler_ode_and_decode_reproduce_the_pipeline (the sampler) and
# test_lora_targets_and_files_a_plain_transformer_loads (the LoRA in a plain transformer); the trainer's policy
# objective on a CFG family: tests/test_zimage.py, tests/test_qwen_image.py
def test_the_preset_trains_one_iteration_and_its_export_loads_into_diffusers(tmp_path):
    """``flowrl train`` of the preset on the saved tiny pipeline: one Flow-GRPO iteration with CFG 3.5 (the first
    replay reproduces the rollout); ``flowrl export`` → a fresh pipeline's transformer ``load_lora_adapter`` → the
    run's velocities, not the base model's."""
    from diffusers import HunyuanImagePipeline

    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny"
    tiny_hunyuan_image_pipeline().save_pretrained(folder)
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue square\na green cat\na small dog\n")
    overrides = [
        f"model.path={folder}",
        *("model.dtype=float32", "model.height=16", "model.width=16", "model.max_sequence_length=16"),
        *("model.lora.rank=4", "model.lora.alpha=8", "model.lora.init=default", "model.gradient_checkpointing=false"),
        *("rollout.group_size=2", "rollout.steps=3", f"prompts.train={tmp_path / 'train.txt'}", "prompts.eval=null"),
        *("prompts.per_step=2", "rewards=[{name: brightness}]", "optim.lr=3e-3", "train.max_steps=1"),
        *("train.checkpoint_every=1", "train.log_with=none", "train.progress=false", "train.num_threads=1"),
        *("train.async_reward=false", f"train.output_dir={tmp_path / 'runs'}"),
    ]
    assert main(["train", PRESET, *overrides]) == 0
    run = tmp_path / "runs" / "hunyuan-image-flow-grpo-pickscore"
    (record,) = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    assert record["first_step_abs_delta_logp"] == 0.0 and record["grad_norm"] > 0
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0

    _, ours, _ = model_from_run(str(run), None, [])
    base = wrap(HunyuanImagePipeline.from_pretrained(folder), **SIZE, guidance=3.5)
    pipe = HunyuanImagePipeline.from_pretrained(folder)
    pipe.transformer.load_lora_adapter(str(tmp_path / "export"), weight_name=LORA_FILE, prefix="transformer")
    theirs = wrap(pipe, **SIZE, guidance=3.5)
    x, s = ours.noise([5, 6]), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_ours, v_theirs, v_base = (m.velocity(x, s, m.encode(PROMPTS[:2])) for m in (ours, theirs, base))
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5
