"""Qwen-Image 2.1 adapter on a tiny offline QwenImage21Pipeline: sizes and refusals, the 2.1 text (Qwen3-VL,
the system turn dropped, cached per prompt), one transformer call per text length (padding would move the image's
positions), sampling and decoding equal to the pipeline's (with and without CFG, and its configured sample_sigmas),
replay == rollout, the LoRA in a fresh pipeline; slow: one `flowrl train` iteration of the preset with its LoRA in
plain diffusers, the stored architecture's size. CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, wrap
from flowrl.models.qwen_image21 import QwenImage21FlowModel
from flowrl.models.testing.qwen_image21 import tiny_qwen_image21_pipeline
from tests.conftest import assert_lora_reloads, perturb_lora

PRESET = Path(__file__).resolve().parents[1] / "configs" / "qwen_image21" / "flow_grpo_pickscore.yaml"
SIZE = dict(height=32, width=64, max_sequence_length=16)
PROMPTS = ["a red circle", "two blue dog on the left", "a photo of a big yellow house"]


def make(**kw):
    pipe = tiny_qwen_image21_pipeline(**kw.pop("pipeline", {}))
    return pipe, wrap(pipe, **{**SIZE, **kw})


def test_family_sizes_packing_and_refusals():
    from flowrl.models.testing.qwen_image import tiny_qwen_image_pipeline

    assert MODEL_FAMILIES["qwen_image21"].pipeline == "QwenImage21Pipeline"
    pipe, model = make()
    assert type(model) is QwenImage21FlowModel and model.family == "qwen_image21"
    assert model.guidance == 1.0 and not model.uses_cfg()  # the pipeline's true_cfg_scale default: no CFG
    assert model.vae_scale_factor == 16 and model.latent_shape == (4, 2, 4) and model.image_seq_len == 8
    assert wrap(tiny_qwen_image21_pipeline()).height == 1024  # the pipeline's output_resolution
    x = model.noise([1, 2])
    assert torch.equal(model.pack(x), pipe._pack_latents(x, 2, 4, 2, 4))
    assert torch.equal(model.unpack(model.pack(x)), x)
    assert torch.equal(pipe._unpack_latents(model.pack(x), 32, 64, 16)[:, :, 0], x)
    with pytest.raises(ValueError, match="multiples of 2 × vae_scale_factor = 32"):
        wrap(pipe, height=48, width=64)
    with pytest.raises(ValueError, match=r"got QwenImageTransformer2DModel \(.*Qwen-Image-2512 are model.family="):
        QwenImage21FlowModel(tiny_qwen_image_pipeline())
    short = wrap(tiny_qwen_image21_pipeline(), **{**SIZE, "max_sequence_length": 8})
    with pytest.raises(ValueError, match=r"max_sequence_length=8: the prompt 'a red circle' takes 11 tokens; raise it"):
        short.encode(["a red circle"])


def test_encode_drops_the_system_turn_caches_each_prompt_alone_and_pads_with_a_mask(monkeypatch):
    pipe, model = make(guidance=3.0)
    tok = pipe.processor.tokenizer
    full = tok(pipe.prompt_template_t2i.format("a red circle")).input_ids
    kept = tok.convert_ids_to_tokens(full[pipe._drop_idx :])
    assert kept[:4] == ["<|im_start|>", "user", "Ċ", "a"]  # the system turn is what the pipeline drops
    calls = []
    original = pipe.encode_prompt
    monkeypatch.setattr(pipe, "encode_prompt", lambda prompt, **k: calls.append(prompt) or original(prompt, **k))
    cond = model.encode(PROMPTS + PROMPTS[:1])
    assert calls == [[p] for p in PROMPTS] + [[" "]]  # each string once, alone; the negative prompt once
    assert cond.cond["prompt_embeds"].shape == (4, 16, 32)
    assert cond.cond["prompt_embeds_mask"].sum(1).tolist() == [11, 14, 15, 11] == [len(kept), 14, 15, len(kept)]
    for i, p in enumerate(PROMPTS):
        embeds, mask, image_pad = original([p])
        assert mask is None and not image_pad.any()
        n = embeds.shape[1]
        assert torch.equal(cond.cond["prompt_embeds"][i, :n], embeds[0])
        assert torch.equal(cond.cond["prompt_embeds"][i, n:], torch.zeros(16 - n, 32))


def test_one_call_per_text_length_each_row_as_the_pipeline_calls_it_alone():
    """A CFG batch of three prompt lengths (and the negative prompt's): one transformer call per length, each row
    equal to the pipeline's own unpadded call; padding the text (a masked call) would change the row."""
    pipe, model = make(guidance=3.0)
    calls = []
    model.trainable.register_forward_hook(
        lambda m, a, kw, out: calls.append(kw["encoder_hidden_states"].shape[:2]), with_kwargs=True
    )
    x, s = model.noise([1, 2, 3]), torch.tensor([0.9, 0.5, 0.2])
    cond = model.encode(PROMPTS)
    with torch.no_grad():
        v = model.velocity(x, s, cond)
        assert sorted(calls) == [(1, 11), (1, 14), (1, 15), (3, 9)]  # 3 negative-prompt rows of 9 tokens, one call

        def transformer(i, embeds, mask=None):
            n = embeds.shape[1]
            img_mask = torch.cat([torch.zeros(1, n, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool)], 1)
            out = pipe.transformer(
                hidden_states=model.pack(x[i : i + 1]),
                timestep=s[i : i + 1],
                encoder_hidden_states=embeds,
                encoder_hidden_states_mask=mask,
                img_shapes=[[(1, 2, 4)]],
                img_mask=img_mask,
                return_dict=False,
            )[0]
            return out[:, -8:]

        for i, p in enumerate(PROMPTS):
            v_c, v_u = transformer(i, pipe.encode_prompt([p])[0]), transformer(i, pipe.encode_prompt([" "])[0])
            torch.testing.assert_close(v[i : i + 1], model.unpack(v_u + 3.0 * (v_c - v_u)), rtol=1e-5, atol=1e-5)
        padded, mask = cond.cond["prompt_embeds"][:1], cond.cond["prompt_embeds_mask"][:1].bool()
        v_padded = transformer(0, padded, mask)
        assert not torch.allclose(v_padded, transformer(0, pipe.encode_prompt([PROMPTS[0]])[0]), atol=1e-4)


@pytest.mark.parametrize("guidance", [2.5, 1.0])
def test_euler_ode_and_decode_reproduce_the_pipeline(guidance):
    """Timestep, token layout, dynamic shift, plain true CFG (no rescale) and the RGBA decode: ODE sampling and
    decoding equal QwenImage21Pipeline's (its prefix KV cache on, as by default)."""
    from flowrl.rollout.sampling import ode_sample

    pipe, model = make(guidance=guidance)
    x = ode_sample(model, ["a green tree"], [11], 3, decode=False)
    common = dict(
        negative_prompt=" " if guidance > 1 else None,
        true_cfg_scale=guidance,
        num_inference_steps=3,
        height=32,
        width=64,
        latents=model.pack(model.noise([11])),
    )
    with torch.no_grad():
        ref = pipe("a green tree", output_type="latent", **common).images
        torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)
        image = pipe("a green tree", output_type="pt", **common).images
        assert image.shape == (1, 4, 32, 64)  # RGBA
        torch.testing.assert_close(model.decode(x), image[:, :3], rtol=1e-5, atol=1e-5)
    assert torch.equal(model.schedule(3), pipe.scheduler.sigmas)


def test_the_pipelines_sample_sigmas_are_the_schedule_at_their_step_count():
    from flowrl.rollout.sampling import ode_sample

    grid = [1.0, 0.8, 0.5, 0.25]
    pipe, model = make(pipeline={"sample_sigmas": grid})
    x = ode_sample(model, ["a green tree"], [5], 4, decode=False)
    with torch.no_grad():  # the pipeline runs its grid whatever num_inference_steps says
        ref = pipe(
            "a green tree",
            num_inference_steps=2,
            height=32,
            width=64,
            output_type="latent",
            latents=model.pack(model.noise([5])),
        ).images
    assert torch.equal(model.schedule(4), pipe.scheduler.sigmas)
    torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)
    assert model.schedule(3).tolist() == make()[1].schedule(3).tolist()  # another step count: linspace, shifted


def test_replay_equals_rollout(monkeypatch):
    """Invariant 1 on Qwen-Image 2.1: tests/test_chains.py's replay test (SDE rollout with log-probs, ratio exactly 1
    at the rollout's weights, CFG 3.5 with one call per text length, LoRA on)."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("qwen_image21", "flow_grpo", 0.7, "mean")


def test_lora_targets_the_single_stream_and_loads_into_a_fresh_pipeline(tmp_path):
    _, model = make(guidance=2.0)
    model.add_lora(LoraSpec(rank=4, alpha=8))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    assert wrapped == {f"transformer_blocks.{i}.{t}" for i in range(2) for t in model.default_lora_targets}
    perturb_lora(model.trainable)
    x, s = model.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v = model.velocity(x, s, model.encode(PROMPTS))
    model.save_lora(tmp_path)
    assert_lora_reloads(lambda: make(guidance=2.0), tmp_path, x, s, PROMPTS, v)


# ---- slow ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~6 s; the default set covers its parts: replay == rollout, LoRA loading, sampling equality
def test_one_preset_iteration_and_its_lora_in_plain_diffusers(tmp_path):
    """One `flowrl train` iteration of configs/qwen_image21/flow_grpo_pickscore.yaml on the tiny pipeline saved to a
    folder (its objective, plan, kernel and guidance; brightness instead of PickScore, tiny sizes): exit 0, ratio
    exactly 1 at the first replay; the checkpoint's LoRA in a fresh ``QwenImage21Pipeline`` through
    ``load_lora_weights`` gives the run's velocities (flowrl sample's loader) and differs from the base."""
    import json

    import diffusers

    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny"
    tiny_qwen_image21_pipeline().save_pretrained(folder)
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue square\n")
    overrides = [
        f"model.path={folder}",
        "model.dtype=float32",
        *(f"model.{k}={v}" for k, v in SIZE.items()),
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.gradient_checkpointing=false",
        "rollout.group_size=2",
        "rollout.steps=3",
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
        "train.name=q21",
        "train.updates_per_epoch=1",
        'rewards=[{"name": "brightness"}]',
    ]
    assert main(["train", str(PRESET), *overrides]) == 0
    run = tmp_path / "runs" / "q21"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    (step,) = [r for r in records if "reward_mean" in r]
    assert step["first_step_abs_delta_logp"] == 0.0 and step["ratio_mean"] == 1.0 and step["grad_norm"] > 0
    cfg, ours, _ = model_from_run(str(run), None, [])
    assert cfg.model.guidance == 1.0 and ours.has_lora
    keys = {k: getattr(cfg.model, k) for k in ("guidance", "height", "width", "max_sequence_length")}
    pipe = diffusers.QwenImage21Pipeline.from_pretrained(folder)
    base = wrap(diffusers.QwenImage21Pipeline.from_pretrained(folder), **keys)
    pipe.load_lora_weights(str(run / "checkpoints" / "step-1"))
    theirs = wrap(pipe, **keys)
    x, s = ours.noise([5, 6]), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_ours, v_theirs, v_base = (
            m.velocity(x, s, m.encode(["a red circle", "a big house"])) for m in (ours, theirs, base)
        )
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5


@pytest.mark.slow  # builds the 7 B transformer and Qwen3-VL-8B on the meta device; nothing else covers the stored file
def test_stored_architecture_matches_the_published_size():
    """flowrl/models/archs/qwen_image21.json: the transformer built from it has Qwen-Image 2.x's published 7 B
    (7.12 B), the VAE is 16× with 64 channels, the text encoder Qwen3-VL-8B's 8.8 B; the preset names its hub id."""
    import yaml

    from flowrl.estimate.archs import _count_text_encoder, build_transformer
    from flowrl.models.architectures import load_arch

    arch = load_arch("qwen_image21")
    total = sum(p.numel() for p in build_transformer(arch).parameters())
    assert abs(total - arch["published_transformer_params"]) / arch["published_transformer_params"] < 0.03
    assert arch["vae"]["scale_factor"] == 16 and arch["vae"]["config"]["z_dim"] == 64 == arch["vae"]["latent_channels"]
    assert 8.5e9 < _count_text_encoder(arch["text_encoders"][0]) < 9.0e9
    model = yaml.safe_load(PRESET.read_text())["model"]
    assert model["path"] in arch["hub_ids"] and model["family"] == arch["family"] and model["guidance"] == 1.0
