"""Model adapters (SD3, FLUX) on tiny offline pipelines: contract, exactness and LoRA I/O. CPU only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, load_model, wrap
from flowrl.models.base import calculate_shift
from flowrl.models.flux import FluxFlowModel
from flowrl.models.sd3 import SD3FlowModel
from flowrl.models.testing import TINY_VOCAB, tiny_flux_pipeline, tiny_sd3_pipeline
from tests.conftest import perturb_lora

PROMPTS = ["a red circle", "two blue dog on the left", "a photo of a big yellow house"]
FLUX_SIZE = dict(height=16, width=16)  # FLUX pipelines default to 1024 px


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models: thread hand-offs cost more than the maths, badly so on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(kind: str, **kw):
    """A fresh (pipeline, adapter) pair; kinds: sd3, sd3_t5, flux."""
    if kind == "sd3":
        pipe = tiny_sd3_pipeline()
        return pipe, wrap(pipe, **kw)
    if kind == "sd3_t5":
        pipe = tiny_sd3_pipeline(with_t5=True)
        return pipe, wrap(pipe, **kw)
    if kind == "flux":
        pipe = tiny_flux_pipeline()
        return pipe, wrap(pipe, **FLUX_SIZE, **kw)
    raise ValueError(kind)


def cfg_kw(kind: str, scale: float) -> dict:
    """Adapter keywords turning classifier-free guidance on at ``scale``."""
    return {"true_cfg": scale} if kind == "flux" else {"guidance": scale}


def inputs(model, n=3, sigma=0.7):
    prompts = (PROMPTS * n)[:n]
    return model.noise(range(100, 100 + n)), torch.full((n,), sigma), prompts


# ---- picking and loading ----------------------------------------------------------------------
def test_wrap_picks_adapter_by_class_and_names_supported_ones():
    assert isinstance(make("sd3")[1], SD3FlowModel)
    assert isinstance(make("flux")[1], FluxFlowModel)
    with pytest.raises(TypeError, match="StableDiffusion3Pipeline.*FluxPipeline.*SanaPipeline"):
        wrap(object())
    with pytest.raises(ValueError, match="'pixart'.*flux.*sana.*sd3"):
        load_model("pixart", "nowhere")
    assert set(MODEL_FAMILIES) == {
        *("shapes", "sd3", "flux", "sana", "qwen_image", "qwen_image_edit", "flux2", "wan", "wan_i2v", "zimage"),
        *("flux_kontext", "flux2_klein", "qwen_image21", "qwen_image_edit_plus", "hunyuan_image", "ltx2"),
    }


@pytest.mark.parametrize("kind", ["sd3", "sd3_t5", "flux"])
def test_save_load_round_trip_gives_identical_velocities(kind, tmp_path):
    pipe, model = make(kind, **cfg_kw(kind, 2.0))
    pipe.save_pretrained(tmp_path)
    family = "flux" if kind == "flux" else "sd3"
    extra = FLUX_SIZE if kind == "flux" else {}
    loaded = load_model(family, tmp_path, **extra, **cfg_kw(kind, 2.0))
    assert type(loaded) is type(model)
    if family == "sd3":
        assert (loaded.pipe.text_encoder_3 is None) == (kind == "sd3")
    x, s, prompts = inputs(model)
    v0 = model.velocity(x, s, model.encode(prompts))
    v1 = loaded.velocity(x, s, loaded.encode(prompts))
    assert torch.equal(v0, v1)


# ---- noise, schedule, decode ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_noise_is_per_seed_and_independent_of_the_batch(kind):
    _, model = make(kind)
    a = model.noise([5, 6, 7])
    b = model.noise([7, 1, 5])
    assert a.shape == (3, *model.latent_shape) and a.dtype == torch.float32
    assert torch.equal(a[0], b[2]) and torch.equal(a[2], b[0])
    expect = torch.randn(model.latent_shape, generator=torch.Generator("cpu").manual_seed(6))
    assert torch.equal(a[1], expect)
    assert not torch.equal(a[0], a[1])


def test_schedule_equals_the_pipelines_scheduler():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for steps in (1, 4, 10):
        pipe, model = make("sd3")
        sigmas = model.schedule(steps)
        pipe.scheduler.set_timesteps(steps)  # what StableDiffusion3Pipeline does (static shift)
        assert torch.equal(sigmas, pipe.scheduler.sigmas)

        fpipe, fmodel = make("flux")
        fsigmas = fmodel.schedule(steps)
        mu = calculate_shift(16, 256, 4096, 0.5, 1.15)  # 8×8 latent → 16 tokens
        fpipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert torch.equal(fsigmas, fpipe.scheduler.sigmas)

        for s in (sigmas, fsigmas):
            assert s.shape == (steps + 1,) and s.dtype == torch.float32
            assert s[0].item() == 1.0 and s[-1].item() == 0.0
            assert bool((s[1:] < s[:-1]).all())
    assert not torch.equal(make("sd3")[1].schedule(4), torch.linspace(1, 0, 5))  # shift 3 applied


def test_sd3_schedule_with_dynamic_shifting_is_the_pipelines():
    """A StableDiffusion3Pipeline whose scheduler shifts by resolution: mu from (h/p)·(w/p) image tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = tiny_sd3_pipeline()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=True)
    model = wrap(pipe)
    assert model.image_seq_len == 16  # 8×8 latent, patch 2
    steps, prompt = 3, "a green tree"
    sigmas = model.schedule(steps)
    assert not torch.equal(sigmas, make("sd3")[1].schedule(steps))  # mu, not the static shift 3
    cond = model.encode([prompt])
    x = x_T = model.noise([11])
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * model.velocity(x, sigmas[i], cond)
        ref = pipe(
            prompt,
            guidance_scale=1.0,
            num_inference_steps=steps,
            max_sequence_length=16,
            latents=x_T,
            output_type="latent",
        ).images
    assert torch.equal(sigmas, pipe.scheduler.sigmas)  # what the pipeline's call set
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_calculate_shift_is_diffusers():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_shift
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift as sd3_shift

    for args in [(16,), (4096, 256, 4096, 0.5, 1.16), (1024, 256, 8192, 0.3, 1.2), (777, 100, 900, 0.25, 3.0)]:
        assert calculate_shift(*args) == flux_shift(*args) == sd3_shift(*args)


def test_decode_undoes_the_vae_scaling_and_shift_and_skips_a_missing_shift():
    pipe, model = make("sd3")
    x = model.noise([0, 1])
    vae = pipe.vae
    with torch.no_grad():
        ref = vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        assert torch.equal(model.decode(x), (ref / 2 + 0.5).clamp(0, 1))
        vae.register_to_config(shift_factor=None)  # a VAE without a shift, as SANA's DC-AE
        assert model._vae_scale_shift() == (vae.config.scaling_factor, None)
        ref = vae.decode(x / vae.config.scaling_factor, return_dict=False)[0]
        assert torch.equal(model.decode(x), (ref / 2 + 0.5).clamp(0, 1))


def test_base_module_imports_nothing_from_rollout():
    """flowrl.rollout imports FlowModel; base.py may import flowrl.rollout only inside functions."""
    import ast
    import inspect

    import flowrl.models.base as base

    tree = ast.parse(inspect.getsource(base))
    modules = [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m.startswith("flowrl.rollout")]


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_decode_gives_images_in_unit_range(kind):
    _, model = make(kind)
    with torch.no_grad():
        images = model.decode(model.noise([0, 1]) * 3)
    assert images.shape == (2, 3, model.height, model.width) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1


@pytest.mark.parametrize("kind", ["sd3", "sd3_t5", "flux"])
def test_euler_ode_with_the_adapter_reproduces_the_pipeline(kind):
    """Timestep conventions, packing, shift, CFG layout: an Euler ODE built from schedule/velocity
    equals the diffusers pipeline's own sampling loop (output_type="latent")."""
    pipe, model = make(kind, **cfg_kw(kind, 2.5))
    steps, prompt = 3, "a green tree"
    cond = model.encode([prompt])
    x = x_T = model.noise([11])
    sigmas = model.schedule(steps)
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * model.velocity(x, sigmas[i], cond)
        if kind == "flux":
            ref = pipe(
                prompt,
                negative_prompt="",
                true_cfg_scale=2.5,
                num_inference_steps=steps,
                max_sequence_length=16,
                latents=model.pack(x_T),
                output_type="latent",
                **FLUX_SIZE,
            ).images
            ref = model.unpack(ref)
        else:
            ref = pipe(
                prompt,
                guidance_scale=2.5,
                num_inference_steps=steps,
                max_sequence_length=16,
                latents=x_T,
                output_type="latent",
            ).images
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


# ---- text conditioning --------------------------------------------------------------------------
def test_every_vocabulary_word_is_one_token():
    pipe = tiny_sd3_pipeline(with_t5=True)
    for tok in (pipe.tokenizer, pipe.tokenizer_2):
        for w in TINY_VOCAB:
            assert len(tok(w, add_special_tokens=False).input_ids) == 1, w
    for w in TINY_VOCAB:
        assert len(pipe.tokenizer_3(w, add_special_tokens=False).input_ids) == 1, w


@pytest.mark.parametrize("kind", ["sd3", "sd3_t5", "flux"])
def test_encode_caches_per_prompt_and_distinguishes_prompts(kind, monkeypatch):
    pipe, model = make(kind, **cfg_kw(kind, 3.0))
    calls = []
    original = pipe.encode_prompt
    monkeypatch.setattr(pipe, "encode_prompt", lambda *a, **k: calls.append(k["prompt"]) or original(*a, **k))
    a = model.encode(["a red circle", "a blue circle", "a red circle"])
    b = model.encode(["a red circle", "a blue circle"])
    assert calls == [["a red circle"], ["a blue circle"], [""]]  # each string once, alone; "" for CFG
    for key in a.cond:
        assert torch.equal(a.cond[key][:2], b.cond[key]) and torch.equal(a.cond[key][0], a.cond[key][2])
        assert not torch.equal(a.cond[key][0], a.cond[key][1])  # one word differs
        assert not a.cond[key].requires_grad and torch.equal(a.uncond[key][0], a.uncond[key][2])
    # Every word changes the embedding (each is its own token).
    seq = torch.stack([model.encode([f"a {w}"]).cond["prompt_embeds"][0] for w in TINY_VOCAB])
    assert len({tuple(r.flatten().tolist()) for r in seq}) == len(TINY_VOCAB)
    # No uncond without CFG.
    off = wrap(pipe, **FLUX_SIZE) if kind == "flux" else wrap(pipe, guidance=1.0)
    assert off.encode(["a red circle"]).uncond is None


# ---- velocity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sd3", "sd3_t5", "flux"])
def test_cfg_composes_both_branches_in_one_forward(kind):
    _, model = make(kind, **cfg_kw(kind, 3.0))
    x, s, prompts = inputs(model)
    rows = []
    hook = model.trainable.register_forward_hook(
        lambda m, args, kw, out: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    cond = model.encode(prompts)
    v = model.velocity(x, s, cond)
    assert rows == [6]  # [uncond; cond] in one call

    g1 = cfg_kw(kind, 1.0)
    plain = type(model)(model.pipe, **g1, **(FLUX_SIZE if kind == "flux" else {}))
    rows.clear()
    v_c = plain.velocity(x, s, cond)
    v_u = plain.velocity(x, s, type(cond)(cond.uncond))
    assert rows == [3, 3]  # guidance 1: the uncond rows of `cond` are not run
    torch.testing.assert_close(v, v_u + 3.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    if kind != "flux":
        torch.testing.assert_close(model.velocity(x, s, cond, guidance=1.0), v_c, rtol=0, atol=0)
        with pytest.raises(ValueError, match="unconditional"):
            model.velocity(x, s, plain.encode(prompts), guidance=2.0)
    hook.remove()


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_velocity_is_a_deterministic_fp32_function_with_gradients(kind):
    _, model = make(kind, gradient_checkpointing=True)
    x, s, prompts = inputs(model)
    cond = model.encode(prompts)
    v1 = model.velocity(x, s, cond)
    v2 = model.velocity(x, s.view(-1), cond)
    assert v1.dtype == torch.float32 and v1.shape == x.shape and torch.equal(v1, v2)
    assert torch.equal(model.velocity(x[:1], 0.7, cond.select([0])), model.velocity(x[:1], s[:1], cond.select([0])))
    model.add_lora(LoraSpec(rank=2, alpha=4))
    perturb_lora(model.trainable)
    for _ in range(2):  # cached embeddings can be reused across backward passes
        model.velocity(x, s, cond).square().mean().backward()
    grads = [p.grad for n, p in model.trainable.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all("lora_" in n for n, p in model.trainable.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="sigma"):
        model.velocity(x, torch.ones(2), cond)


def test_forward_module_routes_the_transformer_call():
    _, model = make("sd3")
    x, s, prompts = inputs(model)
    cond = model.encode(prompts)
    v = model.velocity(x, s, cond)

    class Counting(torch.nn.Module):  # stands in for a DDP / compiled wrapper
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, **kw):
            self.calls += 1
            return self.inner(**kw)

    wrapper = Counting(model.trainable)
    model.set_forward_module(wrapper)
    assert torch.equal(model.velocity(x, s, cond), v) and wrapper.calls == 1
    model.set_forward_module(None)
    assert model.forward_module is model.trainable


def test_flux_guidance_embedding_is_an_input_not_a_branch():
    _, model = make("flux")
    x, s, prompts = inputs(model)
    cond = model.encode(prompts)
    assert cond.uncond is None and model.guidance == 3.5 and not model.uses_cfg(7.0)
    assert not torch.equal(model.velocity(x, s, cond), model.velocity(x, s, cond, guidance=1.0))
    schnell = wrap(tiny_flux_pipeline(guidance_embeds=False), **FLUX_SIZE)
    c = schnell.encode(prompts)
    assert torch.equal(schnell.velocity(x, s, c), schnell.velocity(x, s, c, guidance=1.0))


# ---- LoRA ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_default_lora_targets_exist(kind):
    _, model = make(kind)
    names = [n for n, _ in model.trainable.named_modules()]
    for target in model.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_saved_by_the_adapter_loads_into_a_fresh_pipeline(kind, tmp_path):
    _, model = make(kind)
    x, s, prompts = inputs(model)
    model.add_lora(LoraSpec(rank=4, alpha=8))  # alpha ≠ rank: the scale must survive the file
    perturb_lora(model.trainable)
    cond = model.encode(prompts)
    v = model.velocity(x, s, cond)
    model.save_lora(tmp_path)

    fresh_pipe, fresh = make(kind)
    v_base = fresh.velocity(x, s, fresh.encode(prompts))
    fresh_pipe.load_lora_weights(tmp_path)
    torch.testing.assert_close(fresh.velocity(x, s, fresh.encode(prompts)), v, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(v, v_base)

    # Resume: load_lora overwrites an attached adapter in place, or creates one.
    _, resumed = make(kind)
    resumed.add_lora(LoraSpec(rank=4, alpha=8))
    params = {n: p for n, p in resumed.trainable.named_parameters() if p.requires_grad}
    resumed.load_lora(tmp_path)
    assert torch.equal(resumed.velocity(x, s, resumed.encode(prompts)), v)
    assert all(p is dict(resumed.trainable.named_parameters())[n] for n, p in params.items())
    _, created = make(kind)
    created.load_lora(tmp_path)
    assert torch.equal(created.velocity(x, s, created.encode(prompts)), v)
    assert {n for n, p in created.trainable.named_parameters() if p.requires_grad} == set(params)
    _, wrong = make(kind)
    wrong.add_lora(LoraSpec(rank=4, alpha=8, target_modules=["to_q"]))
    with pytest.raises(ValueError, match="does not match"):
        wrong.load_lora(tmp_path)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_reference_context_gives_the_base_model_exactly(kind):
    _, model = make(kind, **cfg_kw(kind, 2.0))
    x, s, prompts = inputs(model)
    cond = model.encode(prompts)
    with pytest.raises(RuntimeError, match="LoRA"):
        with model.reference():
            pass
    v_base = model.velocity(x, s, cond)
    model.add_lora(LoraSpec(rank=4, alpha=8))
    perturb_lora(model.trainable)
    v_lora = model.velocity(x, s, cond)
    with model.reference():
        v_ref = model.velocity(x, s, cond)
    assert torch.equal(v_ref, v_base) and not torch.allclose(v_lora, v_base)
    assert torch.equal(model.velocity(x, s, cond), v_lora)  # adapter enabled again
