"""Wan (text-to-video) adapter on a tiny offline WanPipeline: video latents [B, C, F, h, w] and the pipeline's noise,
the frames check, UMT5 prompts zero-padded to a fixed length and cached, CFG in one forward as the pipeline combines
its two calls, exactness of Euler sampling and video decoding against the pipeline, Wan 2.1's UniPC schedule, replay
== rollout on 5-D latents, LoRA I/O and bf16 on CPU. CPU only."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, wrap
from flowrl.models.testing import TINY_VOCAB
from flowrl.models.testing.wan import tiny_wan_pipeline
from flowrl.models.wan import WanFlowModel
from tests.conftest import perturb_lora
from tests.test_models import PROMPTS, inputs  # 3 prompts of 3, 6 and 7 words: 4, 7 and 8 UMT5 tokens with </s>

SIZE = dict(height=32, width=48, num_frames=5, max_sequence_length=12)  # latents [4, 2, 4, 6]: 12 video tokens
CALL = dict(height=32, width=48, num_frames=5, max_sequence_length=12)  # the same, for the pipeline's own call


def make(scheduler: str = "unipc", expand_timesteps: bool = False, **kw):
    pipe = tiny_wan_pipeline(scheduler=scheduler, expand_timesteps=expand_timesteps)
    return pipe, wrap(pipe, **{**SIZE, **kw})


# ---- family, sizes, frames, loading ---------------------------------------------------------------
def test_family_is_registered_and_wrap_picks_the_adapter(tmp_path):
    from flowrl.config.build import build_model
    from flowrl.config.schema import ModelSection
    from flowrl.errors import ConfigError

    pipe, model = make(guidance=2.0)
    assert (MODEL_FAMILIES["wan"].pipeline, type(model), model.family) == ("WanPipeline", WanFlowModel, "wan")
    assert (model.latent_shape, model.image_seq_len, model.vae_scale_factor, model.latent_frames) == (
        (4, 2, 4, 6),
        12,
        8,
        2,
    )
    default = wrap(tiny_wan_pipeline())  # the pipeline's defaults
    assert (
        default.guidance,
        default.height,
        default.width,
        default.num_frames,
        default.max_sequence_length,
        default.negative_prompt,
    ) == (5.0, 480, 832, 81, 512, "")
    assert default.latent_shape == (4, 21, 60, 104)
    with pytest.raises(ValueError, match="multiples of the VAE's spatial factor × the transformer's patch size = 16"):
        wrap(pipe, **{**SIZE, "height": 40})
    pipe.save_pretrained(tmp_path)  # loaded back through the config (model.kwargs.num_frames), as a run loads it
    section = lambda frames: ModelSection(
        family="wan",
        path=str(tmp_path),
        guidance=2.0,
        height=32,
        width=48,
        max_sequence_length=12,
        kwargs={"num_frames": frames},
    )
    loaded, (x, s, prompts) = build_model(section(5), device=torch.device("cpu")), inputs(model)
    with torch.no_grad():
        assert type(loaded) is WanFlowModel and torch.equal(
            *(m.velocity(x, s, m.encode(prompts)) for m in (model, loaded))
        )
    # frames the VAE cannot compress (num_frames − 1 not a multiple of 4) fail at construction, naming the key
    with pytest.raises(
        ConfigError,
        match=r"num_frames \(model.kwargs.num_frames\) must be 4·k \+ 1 — 1, 5, 9, …, 81"
        r".*got 6",
    ):
        build_model(section(6), device=torch.device("cpu"))
    for bad in (0, 8, 4.5, True):
        with pytest.raises(ValueError, match="num_frames"):
            wrap(pipe, **{**SIZE, "num_frames": bad})
    # half a two-expert pipeline, and the two-expert keywords on a one-transformer one, are refused, naming them
    half = type(pipe)(**{**pipe.components, "transformer_2": pipe.transformer})
    with pytest.raises(ValueError, match="needs both transformer_2 and boundary_ratio.*boundary_ratio=None"):
        wrap(half, **SIZE)
    for kw in ({"experts": "low"}, {"guidance_2": 3.0}):
        with pytest.raises(ValueError, match="apply to two-expert Wan 2.2 pipelines.*leave them unset"):
            wrap(pipe, **SIZE, **kw)
    one = wrap(pipe, **{**SIZE, "num_frames": 1})  # a single frame is a valid video (one latent frame)
    assert one.latent_shape == (4, 1, 4, 6) and one.decode(one.noise([0])).shape == (1, 1, 3, 32, 48)


def test_latents_are_the_pipelines_noise():
    pipe, model = make()
    x = model.noise([7, 8])
    assert x.shape == (2, 4, 2, 4, 6) and x.dtype == torch.float32
    ref = pipe.prepare_latents(1, 4, 32, 48, 5, torch.float32, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(x[:1], ref)


# ---- text: UMT5, fixed length, cache ------------------------------------------------------------------
def test_encode_caches_pads_to_a_fixed_length_and_ignores_batch_companions():
    pipe, model = make(guidance=3.0)
    for word in TINY_VOCAB:
        assert len(pipe.tokenizer(word).input_ids) == 2, word  # the word and </s>
    encoder_inputs = []  # token ids of every UMT5 call
    pipe.text_encoder.register_forward_pre_hook(lambda m, args: encoder_inputs.append(args[0]))
    a, b = model.encode(PROMPTS + PROMPTS[:1]), model.encode(PROMPTS[1:2])
    # each string once, alone, padded to 12 tokens; then the negative prompt "" (</s> alone) once
    assert [tuple(ids.shape) for ids in encoder_inputs] == [(1, 12)] * 4 and encoder_inputs[3][0, :2].tolist() == [1, 0]
    assert set(a.cond) == {"prompt_embeds"} and a.cond["prompt_embeds"].shape == (4, 12, 32)
    assert not a.cond["prompt_embeds"].requires_grad
    assert torch.equal(a.cond["prompt_embeds"][1], b.cond["prompt_embeds"][0])
    assert torch.equal(a.cond["prompt_embeds"][0], a.cond["prompt_embeds"][3])
    # the pipeline's own batched encoding (every prompt padded to max_sequence_length, then its rows cut and
    # zero-padded): the same rows; the padding is zero, the tokens (words and </s>) are not
    embeds, negative = pipe.encode_prompt(PROMPTS, negative_prompt="", max_sequence_length=12)
    torch.testing.assert_close(a.cond["prompt_embeds"][:3], embeds, rtol=1e-5, atol=1e-6)
    for row, tokens in zip(a.cond["prompt_embeds"], (4, 7, 8, 4)):
        assert row[:tokens].abs().sum(-1).min() > 0 and torch.equal(row[tokens:], torch.zeros(12 - tokens, 32))
    torch.testing.assert_close(a.uncond["prompt_embeds"], negative[:1].expand(4, -1, -1), rtol=1e-5, atol=1e-6)
    assert wrap(pipe, guidance=1.0, **SIZE).encode(PROMPTS).uncond is None
    words = torch.cat([model.encode([f"a {w}"]).cond["prompt_embeds"].flatten(1) for w in TINY_VOCAB])
    assert torch.unique(words, dim=0).shape[0] == len(TINY_VOCAB)  # every word changes the embedding


# ---- velocity: CFG ------------------------------------------------------------------------------------
def test_cfg_in_one_forward_equals_the_pipelines_combination():
    pipe, model = make(guidance=3.0)
    x, s, prompts = inputs(model)
    with torch.no_grad():
        cond = model.encode(prompts)
        # the pipeline's two calls (cond, then uncond) at timestep σ·1000, and its combination
        embeds, negative = pipe.encode_prompt(prompts, negative_prompt="", max_sequence_length=12)
        run = lambda e: pipe.transformer(
            hidden_states=x, timestep=s * 1000, encoder_hidden_states=e, return_dict=False
        )[0]
        noise_pred, noise_uncond = run(embeds), run(negative)
        batches = []  # rows of each transformer call of the adapter
        hook = model.trainable.register_forward_pre_hook(
            lambda m, a, kw: batches.append(len(kw["hidden_states"])), with_kwargs=True
        )
        v, v_cond = model.velocity(x, s, cond), model.velocity(x, s, cond, guidance=1.0)
        alone = model.velocity(x[1:2], s[1:2], cond.select([1]))  # same rows in another batch: GEMM rounding only
        hook.remove()
    assert batches == [6, 3, 2]  # [uncond; cond] in one call; no uncond rows at guidance 1
    torch.testing.assert_close(v, noise_uncond + 3.0 * (noise_pred - noise_uncond), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cond, noise_pred, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, v[1:2], rtol=1e-5, atol=1e-5)
    assert v.dtype == torch.float32 and v.shape == x.shape == (3, 4, 2, 4, 6)
    with pytest.raises(ValueError, match="unconditional"):
        model.velocity(x, s, wrap(pipe, guidance=1.0, **SIZE).encode(prompts))
    with pytest.raises(ValueError, match=r"x must be \[B, 4, 2, 4, 6\]"):
        model.velocity(x[:, :, :1], s, cond)


# ---- sampling and decoding against the pipeline ----------------------------------------------------
@pytest.mark.parametrize("expand_timesteps", [False, True])
def test_euler_ode_and_decode_reproduce_the_pipeline(expand_timesteps):
    """flowrl's own Euler ODE sampler (rollout.sampling.ode_sample → base.euler_ode: shape-agnostic) on 5-D latents:
    timestep convention, CFG with the negative prompt, the shifted schedule and the latent statistics give the
    pipeline's latents and video (FlowMatchEulerDiscreteScheduler: the pipeline is then an Euler ODE too), the same
    seed's noise; also in Wan 2.2 TI2V's per-token timestep mode."""
    from flowrl.rollout.sampling import ode_sample

    for g in (5.0, 1.0):
        pipe, model = make("euler", expand_timesteps, guidance=g)
        x = ode_sample(model, ["a green tree"], [11], 3, decode=False)
        common = dict(prompt="a green tree", guidance_scale=g, num_inference_steps=3, **CALL)
        with torch.no_grad():
            ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(11), **common).frames
            video = pipe(output_type="pt", latents=model.noise([11]), **common).frames
            assert torch.equal(model.schedule(3), pipe.scheduler.sigmas)
            torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
            decoded = model.decode_video(x)
            assert decoded.shape == video.shape == (1, 5, 3, 32, 48) and torch.equal(model.decode(x), decoded)
            torch.testing.assert_close(decoded, video, rtol=1e-5, atol=1e-5)
            assert 0.1 < video.mean() < 0.9 and not torch.allclose(video[:, 0], video[:, -1])
    stats = model.pipe.vae.config  # the latent statistics are not the identity: decode must undo them
    assert stats.latents_mean != [0.0] * 4 and stats.latents_std != [1.0] * 4


def test_schedule_is_wans_unipc_schedule_from_sigma_one():
    """Wan 2.1 ships UniPC with flow sigmas (flow_shift 3): the adapter's schedule is the scheduler's own, except its
    first σ, nudged by UniPC to 1 − 1e-6, is 1; the pipeline feeds the transformer ⌊σ·1000⌋, the adapter σ·1000."""
    pipe, model = make()
    for steps in (3, 10):
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(steps)
        sigmas = model.schedule(steps)
        assert sigmas[0] == 1.0 and 0 < 1 - scheduler.sigmas[0] < 1e-5 and sigmas[-1] == 0.0
        assert torch.equal(sigmas[1:], scheduler.sigmas[1:]) and sigmas.dtype == torch.float32
        shifted = lambda t: 3 * t / (1 + 2 * t)
        ref = shifted(torch.linspace(1, 1 / 1000, steps + 1, dtype=torch.float64)[:-1])
        torch.testing.assert_close(sigmas[:-1].double(), ref, rtol=0, atol=1e-6)
        assert (
            (sigmas[:-1] * 1000 - scheduler.timesteps).abs() <= 1
        ).all() and scheduler.timesteps.dtype == torch.int64


# ---- rollout / replay (5-D latents through forest, kernels, log-probs) ------------------------------
@pytest.mark.parametrize("kernel, eta, reduction", [("flow_grpo", 0.7, "mean"), ("cps", 0.8, "sum")])
def test_replay_equals_rollout(kernel, eta, reduction, monkeypatch):
    """Invariant 1 on Wan: tests/test_chains.py's replay test (SDE rollout with log-probs over [C, F, h, w], ratio
    exactly 1 at the rollout's weights, CFG at 3.5, LoRA on, independent and shared noise)."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("wan", kernel, eta, reduction)


# ---- LoRA -----------------------------------------------------------------------------------------
def test_lora_targets_cover_attention_and_ffn_and_load_into_a_fresh_pipeline(tmp_path, monkeypatch):
    """The default targets reach both attentions and the feed-forward of every block; then tests/test_models.py's
    LoRA checks on Wan: saved → ``pipe.load_lora_weights`` into a fresh pipeline → the same velocity, ``load_lora`` in
    place and from the file, and the ``reference()`` context gives the base model exactly."""
    import tests.test_models as models_tests

    _, model = make()
    model.add_lora(LoraSpec(rank=2))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    per_block = [f"{attn}.{t}" for attn in ("attn1", "attn2") for t in ("to_q", "to_k", "to_v", "to_out.0")]
    assert wrapped == {f"blocks.{i}.{t}" for i in range(2) for t in [*per_block, "ffn.net.0.proj", "ffn.net.2"]}
    monkeypatch.setattr(models_tests, "make", lambda kind, **kw: make(**kw))
    models_tests.test_lora_saved_by_the_adapter_loads_into_a_fresh_pipeline("wan", tmp_path)
    models_tests.test_reference_context_gives_the_base_model_exactly("wan")


# ---- low precision --------------------------------------------------------------------------------
def test_bf16_runs_on_cpu_close_to_fp32():
    """bf16 transformer (its fp32 modules kept; VAE and UMT5 fp32): velocities and ODE samples within 5% of fp32's,
    LoRA gradients fp32 and non-zero on every target."""
    from flowrl.rollout.sampling import ode_sample

    fp32, bf16 = (make(guidance=2.0, dtype=dtype)[1] for dtype in (torch.float32, torch.bfloat16))
    assert (
        bf16.trainable.dtype == torch.bfloat16 and bf16.pipe.vae.dtype == bf16.pipe.text_encoder.dtype == torch.float32
    )
    assert bf16.trainable.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32  # _keep_in_fp32
    x, s, prompts = inputs(fp32)

    @torch.no_grad()
    def outputs(m):  # a velocity and a 4-step ODE sample
        return m.velocity(x, s, m.encode(prompts)), ode_sample(m, ["a green tree"], [3], 4, decode=False)

    for exact, rounded in zip(outputs(fp32), outputs(bf16)):
        assert rounded.dtype == torch.float32 and 0 < (rounded - exact).norm() / exact.norm() < 0.05
    with torch.no_grad():
        assert torch.isfinite(bf16.decode(outputs(bf16)[1])).all()
    bf16.add_lora(LoraSpec(rank=2, alpha=4))
    perturb_lora(bf16.trainable, scale=0.05)
    bf16.velocity(x, s, bf16.encode(prompts)).square().mean().backward()
    grads = {n: p.grad for n, p in bf16.trainable.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 10 * 2  # blocks × targets × (A, B)
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads.values())
