"""FLUX.2 adapter on a tiny offline Flux2Pipeline: the pipeline's latent space (patchified, batch-normalised) and
noise, Mistral chat-template prompts padded to a fixed length and cached, the distilled guidance embedding,
exactness of sampling and decoding against the pipeline, replay == rollout, LoRA I/O, bf16 on CPU and one trainer
iteration per objective kind. CPU only."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, load_model, wrap
from flowrl.models.base import calculate_shift
from flowrl.models.flux2 import Flux2FlowModel
from flowrl.models.packing import pack_2x2
from flowrl.models.testing import TINY_VOCAB
from flowrl.models.testing.flux2 import tiny_flux2_pipeline
from tests.conftest import perturb_lora
from tests.test_models import PROMPTS, inputs  # 3 prompts of 3, 6 and 7 words: 35, 38, 39 text tokens

SIZE = dict(height=16, width=16, max_sequence_length=40)
FIXED = 32  # tokens of every prompt besides its words: <s>, the system message in its markers, [INST], [/INST]


def make(**kw):
    pipe = tiny_flux2_pipeline(guidance_embeds=kw.pop("guidance_embeds", True))
    return pipe, wrap(pipe, **SIZE, **kw)


# ---- family, sizes, loading ---------------------------------------------------------------------
def test_family_is_registered_and_wrap_picks_the_adapter(tmp_path):
    pipe, model = make(guidance=2.0)
    assert (MODEL_FAMILIES["flux2"].pipeline, type(model), model.family) == ("Flux2Pipeline", Flux2FlowModel, "flux2")
    assert (model.latent_shape, model.image_seq_len, model.vae_scale_factor) == ((16, 4, 4), 16, 2 * 2)
    default = wrap(tiny_flux2_pipeline())  # the pipeline's defaults: 128 latent cells of its VAE (factor 2)
    assert (
        default.guidance,
        default.height,
        default.width,
        default.max_sequence_length,
        default.text_encoder_out_layers,
    ) == (4.0, 256, 256, 512, (10, 20, 30))
    for bad, message in (
        ({"height": 18}, "multiples of 2 × the pipeline's vae_scale_factor = 4"),
        ({"text_encoder_out_layers": (10, 20, 31)}, "31 hidden states"),
    ):
        with pytest.raises(ValueError, match=message):
            wrap(pipe, **{**SIZE, **bad})
    pipe.save_pretrained(tmp_path)
    loaded = load_model("flux2", tmp_path, guidance=2.0, **SIZE)
    x, s, prompts = inputs(model)
    with torch.no_grad():
        velocities = [m.velocity(x, s, m.encode(prompts)) for m in (model, loaded)]
    assert type(loaded) is Flux2FlowModel and torch.equal(*velocities)


def test_latents_are_the_pipelines_noise_tokens_and_ids():
    """The adapter's latent is the pipeline's: its noise from a seed, its tokens (one per cell) and position ids;
    FLUX.1's 2×2 packing of the VAE latent equals the pipeline's patchify followed by its packing."""
    from diffusers.utils.torch_utils import randn_tensor

    pipe, model = make()
    x = model.noise([7, 8])
    assert torch.equal(x[:1], randn_tensor((1, 16, 4, 4), generator=torch.Generator().manual_seed(7)))
    tokens, ids = pipe.prepare_latents(2, 4, 16, 16, torch.float32, "cpu", None, latents=x)
    assert torch.equal(model.pack(x), tokens) and tokens.shape == (2, 16, 16)
    assert torch.equal(model.unpack(tokens), x) and torch.equal(pipe._unpack_latents_with_ids(tokens, ids), x)
    assert ids[0].tolist() == [[0, h, w, 0] for h in range(4) for w in range(4)]
    z = torch.randn(2, 4, 8, 8)  # a VAE latent
    assert torch.equal(pipe._pack_latents(pipe._patchify_latents(z)), pack_2x2(z))


# ---- text: chat template, fixed length, cache -----------------------------------------------------
def test_chat_template_and_words_are_single_tokens():
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    pipe = tiny_flux2_pipeline()
    tok = pipe.tokenizer.tokenizer
    for word in TINY_VOCAB:
        assert len(tok(f"a {word}", add_special_tokens=False).input_ids) == 2, word
    ids = pipe.tokenizer.apply_chat_template(
        format_input(["a red circle"]),
        tokenize=True,
        return_dict=True,
        add_generation_prompt=False,
        return_tensors="pt",
    )["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids[0].tolist())
    assert tokens[:3] == ["<s>", "[SYSTEM_PROMPT]", "You"]
    assert tokens[-5:] == ["[INST]", "a", "Ġred", "Ġcircle", "[/INST]"]
    assert len(tokens) == FIXED + 3 and tokens.count("<unk>") == 0


def test_encode_caches_pads_to_a_fixed_length_and_ignores_batch_companions(caplog, monkeypatch):
    pipe, model = make(guidance=3.0)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # its records reach caplog
    caplog.set_level(logging.WARNING, logger="transformers")  # as a fresh process has it (the CLI quiets it to ERROR)
    shapes = []  # of every text-encoder call
    pipe.text_encoder.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    a, b = model.encode(PROMPTS + PROMPTS[:1]), model.encode(PROMPTS[1:2], 3.0)
    assert shapes == [(1, 40)] * 3  # each string once, alone, padded to 40 tokens; no negative prompt (no CFG)
    assert not [r for r in caplog.records if "processor_kwargs" in r.getMessage()]  # transformers' notice dropped
    pipe.encode_prompt(PROMPTS[:1], max_sequence_length=40)
    assert [r for r in caplog.records if "processor_kwargs" in r.getMessage()]  # (which the pipeline's call gives)
    assert a.uncond is None and b.uncond is None and set(a.cond) == {"prompt_embeds"}
    assert a.cond["prompt_embeds"].shape == (4, 40, 48) and not a.cond["prompt_embeds"].requires_grad
    assert torch.equal(a.cond["prompt_embeds"][1], b.cond["prompt_embeds"][0])
    assert torch.equal(a.cond["prompt_embeds"][0], a.cond["prompt_embeds"][3])
    # the pipeline's own batched encoding (every prompt padded to max_sequence_length by the tokenizer): the same rows
    embeds, _ = pipe.encode_prompt(PROMPTS, max_sequence_length=40)
    torch.testing.assert_close(a.cond["prompt_embeds"][:3], embeds, rtol=1e-5, atol=1e-6)
    # the padding rows are the pad token's hidden states (the pipeline attends to them): not zero
    assert a.cond["prompt_embeds"][0, FIXED + 3 :].abs().sum(-1).min() > 0
    other = dict(max_sequence_length=40, text_encoder_out_layers=(1, 2, 30))  # hidden states 1 and 2 instead of 10, 20
    layers = wrap(pipe, **{**SIZE, **other}).encode(PROMPTS[:1]).cond["prompt_embeds"]
    assert torch.equal(layers, pipe.encode_prompt(PROMPTS[:1], **other)[0])
    assert torch.equal(layers[..., 32:], a.cond["prompt_embeds"][:1, :, 32:]) and not torch.equal(layers, embeds[:1])
    seq = torch.stack([model.encode([f"a {w}"]).cond["prompt_embeds"][0] for w in TINY_VOCAB])
    assert len({tuple(r.flatten().tolist()) for r in seq}) == len(TINY_VOCAB)  # every word changes the embedding


# ---- velocity: the guidance embedding ---------------------------------------------------------------
def test_guidance_is_the_embedding_in_one_forward_as_the_pipeline_calls_the_transformer():
    pipe, model = make()
    x, s, prompts = inputs(model)
    cond = model.encode(prompts)
    guidances = []  # of every transformer call
    hook = model.trainable.register_forward_pre_hook(
        lambda m, a, kw: guidances.append(kw["guidance"].tolist()), with_kwargs=True
    )
    with torch.no_grad():
        v4, v1 = model.velocity(x, s, cond), model.velocity(x, s, cond, guidance=1.0)
        assert guidances == [[4.0] * 3, [1.0] * 3] and not model.uses_cfg(4.0) and not torch.allclose(v4, v1, atol=1e-4)
        embeds, text_ids = pipe.encode_prompt(prompts, max_sequence_length=40)
        tokens, ids = pipe.prepare_latents(3, 4, 16, 16, torch.float32, "cpu", None, latents=x)
        out = pipe.transformer(
            hidden_states=tokens,
            timestep=s,
            guidance=torch.full([3], 4.0),
            txt_ids=text_ids,
            encoder_hidden_states=embeds,
            img_ids=ids,
            return_dict=False,
        )[0]
        torch.testing.assert_close(v4, pipe._unpack_latents_with_ids(out, ids), rtol=1e-5, atol=1e-5)
        alone = model.velocity(x[1:2], s[1:2], cond.select([1]))  # same row in another batch: GEMM rounding only
        torch.testing.assert_close(alone, v4[1:2], rtol=1e-5, atol=1e-5)
    hook.remove()
    assert v4.dtype == torch.float32 and v4.shape == x.shape
    _, plain = make(guidance_embeds=False)  # no guidance input: the value changes nothing
    cond = plain.encode(prompts)
    with torch.no_grad():
        assert torch.equal(plain.velocity(x, s, cond, 4.0), plain.velocity(x, s, cond, 1.0))


def test_euler_ode_and_decode_reproduce_the_pipeline():
    """Timestep convention, tokens and ids, the guidance embedding, dynamic shift with FLUX.2's empirical mu (of the
    steps too), batch-norm statistics and unpatchify: ODE sampling (the pipeline's own noise from the same seed) and
    decoding equal Flux2Pipeline's."""
    from flowrl.rollout.sampling import ode_sample

    for g, steps in ((4.0, 3), (1.5, 5)):
        pipe, model = make(guidance=g)
        x = ode_sample(model, ["a green tree"], [11], steps, decode=False)
        common = dict(
            prompt="a green tree",
            guidance_scale=g,
            num_inference_steps=steps,
            height=16,
            width=16,
            max_sequence_length=40,
        )
        with torch.no_grad():
            ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(11), **common).images
            image = pipe(output_type="pt", latents=model.noise([11]), **common).images
            assert torch.equal(model.schedule(steps), pipe.scheduler.sigmas)
            torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)
            assert 0.1 < image.mean() < 0.9
    bn = model.pipe.vae.bn  # the statistics are not the identity: decode must undo them
    assert bn.running_mean.abs().min() > 0 and not torch.allclose(bn.running_var, torch.ones(16))
    flux1 = type(pipe.scheduler).from_config(pipe.scheduler.config)  # FLUX.1's mu (of the image tokens alone)
    flux1.set_timesteps(sigmas=np.linspace(1.0, 1 / 5, 5), mu=calculate_shift(16))
    assert not torch.allclose(model.schedule(5), flux1.sigmas, atol=1e-3)


# ---- rollout / replay -----------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, eta, reduction", [("flow_grpo", 0.7, "mean"), ("cps", 0.8, "sum")])
def test_replay_equals_rollout(kernel, eta, reduction, monkeypatch):
    """Invariant 1 on FLUX.2: tests/test_chains.py's replay test (SDE rollout with log-probs, ratio exactly 1 at the
    rollout's weights, guidance embedding 3.5, LoRA on, independent and shared noise)."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("flux2", kernel, eta, reduction)


# ---- LoRA -----------------------------------------------------------------------------------------
def test_lora_targets_cover_both_streams_and_load_into_a_fresh_pipeline(tmp_path, monkeypatch):
    """The default targets reach every projection of a double-stream block (attention of both streams, both SwiGLU
    feed-forwards) and of a single-stream block (fused input, output); then tests/test_models.py's LoRA checks on
    FLUX.2: saved → ``pipe.load_lora_weights`` into a fresh pipeline → the same velocity, ``load_lora`` in place and
    from the file, and the ``reference()`` context gives the base model exactly."""
    import tests.test_models as models_tests

    _, model = make()
    model.add_lora(LoraSpec(rank=2))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    double = [
        *(f"attn.{t}" for t in model.default_lora_targets[:8]),
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
    ]
    single = ["attn.to_qkv_mlp_proj", "attn.to_out"]
    assert wrapped == {f"transformer_blocks.0.{t}" for t in double} | {
        f"single_transformer_blocks.0.{t}" for t in single
    }
    monkeypatch.setattr(models_tests, "make", lambda kind, **kw: make(**kw))
    models_tests.test_lora_saved_by_the_adapter_loads_into_a_fresh_pipeline("flux2", tmp_path)
    models_tests.test_reference_context_gives_the_base_model_exactly("flux2")


# ---- low precision --------------------------------------------------------------------------------
def test_bf16_runs_on_cpu_close_to_fp32():
    """bf16 transformer (VAE and text encoder fp32): fp32 velocities within 5% of fp32's, ODE samples too, LoRA
    gradients fp32 and non-zero on every target."""
    from flowrl.rollout.sampling import ode_sample

    models = {dtype: make(dtype=dtype)[1] for dtype in (torch.float32, torch.bfloat16)}
    x, s, prompts = inputs(models[torch.float32])
    with torch.no_grad():
        v = {dtype: m.velocity(x, s, m.encode(prompts)) for dtype, m in models.items()}
        z = {dtype: ode_sample(m, ["a green tree"], [3], 4, decode=False) for dtype, m in models.items()}
    low = models[torch.bfloat16]
    assert low.trainable.dtype == torch.bfloat16 and low.pipe.vae.dtype == low.pipe.text_encoder.dtype == torch.float32
    for out in (v, z):
        exact, rounded = out[torch.float32], out[torch.bfloat16]
        assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
        assert (rounded - exact).norm() / exact.norm() < 0.05
    assert torch.isfinite(low.decode(z[torch.bfloat16])).all()
    low.add_lora(LoraSpec(rank=2, alpha=4))
    perturb_lora(low.trainable, scale=0.05)
    low.velocity(x, s, low.encode(prompts)).square().mean().backward()
    grads = [p.grad for n, p in low.trainable.named_parameters() if p.requires_grad]
    assert len(grads) == 2 * 14 and all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


def test_bf16_lora_trains_checkpoints_and_resumes(tmp_path, monkeypatch):
    """tests/test_low_precision.py's bf16 loop on FLUX.2: ratio exactly 1, the fp32 LoRA moves, and 2 iterations +
    resume to 3 equal 3 straight ones bit for bit."""
    import tests.test_low_precision as low_tests

    monkeypatch.setattr(low_tests, "low_model", lambda family, dtype: make(dtype=dtype)[1])
    low_tests.test_lora_trains_checkpoints_and_resumes_in_low_precision(tmp_path, "flux2", "bfloat16")


# ---- the trainer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["policy", "nft"])
def test_one_trainer_iteration_per_objective_kind(tmp_path, objective):
    """One iteration of the policy objective (2 prompts × 2 chains × 2 SDE steps replayed with ratio exactly 1, the
    guidance embedding at 2 in the rollouts) and of DiffusionNFT (CFG-free: guidance 1; 4 leaves): the LoRA moves."""
    from flowrl.training.trainer import Trainer
    from tests.test_forward_process import tiny
    from tests.test_trainer import tiny_config

    if objective == "policy":
        cfg = tiny_config(
            tmp_path,
            "flux2",
            "model.family=flux2",
            "train.max_steps=1",
            "prompts.eval=null",
            "rollout.group_size=2",
            "rollout.steps=3",
            "rollout.window.size=2",
        )
        expected = {"first_step_abs_delta_logp": 0.0, "ratio_mean": 1.0, "trained_edges": 2 * 2 * 2}
    else:
        cfg = tiny(
            tmp_path, "flux2_nft", "model.family=flux2", "loss.objective=nft", "train.max_steps=1", "optim.lr=1e-2"
        )
        expected = {"trained_leaves": 4.0}
    trainer = Trainer(cfg, model=make(guidance=2.0 if objective == "policy" else 1.0)[1])
    assert trainer.guidance == (2.0 if objective == "policy" else 1.0)
    before = [p.detach().clone() for p in trainer.params]
    (record,) = [r for r in trainer.train() if "reward_mean" in r]
    assert {k: record[k] for k in expected} == expected and record["grad_norm"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in record.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
