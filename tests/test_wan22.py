"""Wan 2.2 on tiny offline pipelines: TI2V-5B's layout (48-channel-style residual VAE, per-token timesteps) and the
two-expert A14B pipelines (text- and image-to-video): flowrl's ODE samples equal the pipelines' own for the same seeds,
experts switch at the boundary with each expert's CFG scale, ``model.experts`` trains only the chosen expert,
the LoRA of each expert loads into a fresh diffusers pipeline, image prompts encode their image once; the stored
architectures against the published sizes. CPU only."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowrl.models import LoraSpec, wrap
from flowrl.models.image_prompts import image_prompt
from flowrl.models.testing.wan import tiny_wan_pipeline
from flowrl.models.wan import WanExperts, WanFlowModel
from flowrl.models.wan_i2v import WanI2VFlowModel
from flowrl.paths import CONFIG_DIR
from tests.conftest import perturb_lora

SIZE = dict(height=32, width=48, num_frames=5, max_sequence_length=12)  # latents [4, 2, 4, 6]: 12 video tokens
PROMPT = "a green tree"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A 32×48 PNG (random pixels) as an image prompt's path."""
    from PIL import Image

    path = tmp_path_factory.mktemp("wan22") / "first.png"
    pixels = (torch.rand(32, 48, 3, generator=torch.Generator().manual_seed(5)) * 255).to(torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def two_experts(i2v: bool = False, **kw):
    pipe = tiny_wan_pipeline(scheduler="euler", two_experts=True, image_to_video=i2v)
    return pipe, wrap(pipe, **{**SIZE, **kw})


def expert_calls(model) -> list[str]:
    """Records which expert runs, per transformer call (hooks on both experts)."""
    calls: list[str] = []
    for name in ("transformer", "transformer_2"):
        getattr(model.experts, name).register_forward_pre_hook(lambda m, a, n=name: calls.append(n))
    return calls


# ---- TI2V-5B's layout -----------------------------------------------------------------------------------------
def test_ti2v_5b_layout_ode_and_decode_reproduce_the_pipeline():
    """Wan 2.2's VAE (2×2 pixel patches: spatial factor 16, multiples of 32) with per-token timesteps: the adapter's
    Euler ODE gives the pipeline's latents and video for the same seed."""
    from flowrl.rollout.sampling import ode_sample

    pipe = tiny_wan_pipeline(scheduler="euler", expand_timesteps=True, vae="wan22")
    model = wrap(pipe, **{**SIZE, "height": 32, "width": 64})
    assert type(model) is WanFlowModel and model.experts is None
    assert (model.vae_scale_factor, model.latent_shape, model.image_seq_len) == (16, (8, 2, 2, 4), 4)
    with pytest.raises(ValueError, match="multiples of the VAE's spatial factor × the transformer's patch size = 32"):
        wrap(pipe, **{**SIZE, "height": 48, "width": 32})
    x = ode_sample(model, [PROMPT], [11], 3, decode=False)
    call = dict(prompt=PROMPT, guidance_scale=5.0, num_inference_steps=3, height=32, width=64, num_frames=5)
    with torch.no_grad():
        ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(11), max_sequence_length=12, **call)
        video = pipe(output_type="pt", latents=model.noise([11]), max_sequence_length=12, **call).frames
        torch.testing.assert_close(x, ref.frames, rtol=1e-5, atol=1e-5)
        decoded = model.decode(x)
    assert decoded.shape == video.shape == (1, 5, 3, 32, 64)
    torch.testing.assert_close(decoded, video, rtol=1e-5, atol=1e-5)


# ---- two experts: sampling against the pipeline ---------------------------------------------------------------
@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_two_expert_ode_switches_at_the_boundary_as_the_pipeline(i2v, image):
    """T2V-A14B / I2V-A14B layouts: steps with t ≥ 0.875·1000 run ``transformer`` at guidance 4, the rest
    ``transformer_2`` at guidance_2 3 (the pipeline's guidance_scale_2); the ODE sample and the video equal the
    pipeline's for the same seed; I2V: the image's condition joins the latents' channels."""
    from PIL import Image

    from flowrl.rollout.sampling import ode_sample

    pipe, model = two_experts(i2v, guidance=4.0, guidance_2=3.0)
    assert type(model) is (WanI2VFlowModel if i2v else WanFlowModel) and isinstance(model.trainable, WanExperts)
    assert model.experts.boundary == 875.0 and model.experts.trained == ("transformer", "transformer_2")
    prompt = image_prompt(PROMPT, image) if i2v else PROMPT
    calls = expert_calls(model)
    x = ode_sample(model, [prompt], [3], 4, decode=False)
    timesteps = model.schedule(4)[:-1] * 1000
    assert timesteps[0] >= 875 > timesteps[1]  # the boundary falls inside the run: 1000, 858, 602, 9
    assert calls == ["transformer"] + ["transformer_2"] * 3  # [uncond; cond] in one call per step
    call = dict(prompt=PROMPT, guidance_scale=4.0, guidance_scale_2=3.0, num_inference_steps=4, max_sequence_length=12)
    call.update(height=32, width=48, num_frames=5)
    if i2v:
        call["image"] = Image.open(image)
    with torch.no_grad():
        ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(3), **call).frames
        video = pipe(output_type="pt", latents=model.noise([3]), **call).frames
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.decode(x), video, rtol=1e-5, atol=1e-5)
        one = ode_sample(wrap(pipe, **SIZE, guidance=4.0), [prompt], [3], 4, decode=False)  # guidance_2 = guidance
    assert (one - x).abs().max() > 1e-4  # the low-noise expert's own scale mattered


def test_mixed_rows_run_each_on_its_expert_with_its_scale():
    """A batch with rows on both sides of the boundary: each row equals that row alone (its expert, its CFG scale);
    ``run_both`` (FSDP2: every process the same collectives) changes no value; an explicit guidance applies to both
    experts; bad ``experts`` is refused naming the key."""
    pipe, model = two_experts(guidance=4.0, guidance_2=2.0)
    x = model.noise([1, 2, 3])
    s = torch.tensor([0.95, 0.5, 0.875])  # high, low, exactly the boundary (high)
    with torch.no_grad():
        cond = model.encode([PROMPT] * 3)
        calls = expert_calls(model)
        v = model.velocity(x, s, cond)
        assert sorted(calls) == ["transformer", "transformer_2"]
        alone = torch.cat([model.velocity(x[i : i + 1], s[i : i + 1], cond.select([i])) for i in range(3)])
        torch.testing.assert_close(v, alone, rtol=1e-5, atol=1e-5)
        high, low = (pipe.transformer, 4.0), (pipe.transformer_2, 2.0)
        for row, (expert, g) in enumerate([high, low, high]):
            embeds, negative = pipe.encode_prompt([PROMPT], negative_prompt="", max_sequence_length=12)
            run = lambda e: expert(hidden_states=x[row : row + 1], timestep=s[row : row + 1] * 1000,
                                   encoder_hidden_states=e, return_dict=False)[0]  # fmt: skip
            c, u = run(embeds), run(negative)
            torch.testing.assert_close(v[row : row + 1], u + g * (c - u), rtol=1e-5, atol=1e-5)
        single = model.velocity(x[:1], s[:1], cond.select([0]))
        model.experts.run_both = True
        calls.clear()
        torch.testing.assert_close(model.velocity(x[:1], s[:1], cond.select([0])), single, rtol=0, atol=0)
        assert calls == ["transformer", "transformer_2"]  # the unused expert ran too
        model.experts.run_both = False
        explicit = model.velocity(x, s, cond, guidance=3.0)
        both3 = wrap(pipe, **SIZE, guidance=3.0, guidance_2=3.0)
        torch.testing.assert_close(explicit, both3.velocity(x, s, both3.encode([PROMPT] * 3)), rtol=0, atol=0)
    assert not model.uses_cfg(1.0) and wrap(pipe, **SIZE, guidance=1.0, guidance_2=2.0).uses_cfg()
    with pytest.raises(ValueError, match="model.experts must be one of high, low, both; got 'mid'"):
        wrap(pipe, **SIZE, experts="mid")


# ---- which expert trains -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["low", "high", "both"])
def test_experts_choose_which_expert_trains(experts):
    """LoRA on the chosen expert(s) only; an optimizer step on a loss over rows of both noise ranges changes only
    those LoRA weights (``low``: the high-noise expert stays exactly as it was); the reference context is the base
    of both; ``run_both`` gives the unused expert's LoRA a zero gradient, not none."""
    pipe, model = two_experts(guidance=1.0, experts=experts)
    before = [(p, p.detach().clone()) for p in model.trainable.parameters()]  # peft keeps them as base layers
    x, s = model.noise([1, 2]), torch.tensor([0.95, 0.3])
    with torch.no_grad():
        base = model.velocity(x, s, model.encode([PROMPT] * 2))
    model.add_lora(LoraSpec(rank=2, init="default"))
    trained = {"low": {"transformer_2"}, "high": {"transformer"}, "both": {"transformer", "transformer_2"}}[experts]
    params = {n: p for n, p in model.trainable.named_parameters() if p.requires_grad}
    assert params and {n.split(".")[0] for n in params} == trained and all("lora_" in n for n in params)
    assert {n.split(".")[0] for n, _ in model.trainable.named_parameters() if "lora_" in n} == trained
    optimizer = torch.optim.SGD(params.values(), lr=0.5)
    model.velocity(x, s, model.encode([PROMPT] * 2)).square().mean().backward()
    optimizer.step()
    assert all(torch.equal(p, w) for p, w in before)  # no base weight of either expert moved
    moved = {n.split(".")[0] for n, p in params.items() if "lora_B" in n and p.abs().sum() > 0}
    assert moved == trained  # the trained expert's LoRA (zero-initialised B) moved, from rows of its own range
    with torch.no_grad(), model.reference():
        torch.testing.assert_close(model.velocity(x, s, model.encode([PROMPT] * 2)), base, rtol=0, atol=0)
    if experts == "both":
        model.experts.run_both = True
        optimizer.zero_grad()
        model.velocity(x[:1], s[:1], model.encode([PROMPT])).square().mean().backward()
        low = [p.grad for n, p in params.items() if n.startswith("transformer_2.")]
        assert all(g is not None and g.abs().sum() == 0 for g in low)


# ---- LoRA export -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["both", "low"])
def test_lora_of_each_expert_loads_into_a_fresh_pipeline(experts, tmp_path):
    """``save_lora``: the high-noise expert's file in the folder, the low-noise expert's in transformer_2/; diffusers
    loads them (``load_into_transformer_2=True`` for the second) and its ODE sample equals the trained adapter's;
    ``load_lora`` into a fresh adapter gives the same velocities; a folder of other experts is refused."""
    from flowrl.rollout.sampling import ode_sample

    _, model = two_experts(guidance=4.0, guidance_2=3.0, experts=experts)
    model.add_lora(LoraSpec(rank=2, alpha=4))
    perturb_lora(model.trainable, scale=0.3)
    model.save_lora(tmp_path)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors"))
    low_file = "transformer_2/pytorch_lora_weights.safetensors"
    assert files == (["pytorch_lora_weights.safetensors", low_file] if experts == "both" else [low_file])
    fresh = tiny_wan_pipeline(scheduler="euler", two_experts=True)
    if experts == "both":
        fresh.load_lora_weights(str(tmp_path))
    fresh.load_lora_weights(str(tmp_path / "transformer_2"), load_into_transformer_2=True)
    with torch.no_grad():
        x = ode_sample(model, [PROMPT], [4], 4, decode=False)
        call = dict(prompt=PROMPT, guidance_scale=4.0, guidance_scale_2=3.0, num_inference_steps=4, **SIZE)
        ref = fresh(output_type="latent", generator=torch.Generator().manual_seed(4), **call).frames
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
        with model.reference():  # the base of both experts
            assert (ode_sample(model, [PROMPT], [4], 4, decode=False) - x).abs().max() > 1e-3  # the LoRA changed it
    loaded = two_experts(guidance=4.0, guidance_2=3.0, experts=experts)[1]
    loaded.load_lora(tmp_path)
    xs, s = model.noise([1, 2]), torch.tensor([0.95, 0.3])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.velocity(xs, s, loaded.encode([PROMPT] * 2)), model.velocity(xs, s, model.encode([PROMPT] * 2))
        )
    assert all(p.dtype == torch.float32 for n, p in loaded.trainable.named_parameters() if "lora_" in n)
    other = two_experts(experts="high")[1]
    with pytest.raises(ValueError, match=r"holds the experts .* but the model trains \['transformer'\]"):
        other.load_lora(tmp_path)


# ---- image to video: prompts -------------------------------------------------------------------------------------
def test_i2v_encodes_each_image_once_and_refuses_text_prompts(image):
    """The image's condition [1, 4 + 4, F, h, w] (first-frame mask, the image's latent) is cached with the prompt; the
    negative prompt carries the same image; a prompt without an image is refused naming the form."""
    pipe, model = two_experts(i2v=True, guidance=4.0)
    encoded = []
    original = pipe.vae.encode
    pipe.vae.encode = lambda *a, **k: (encoded.append(1), original(*a, **k))[1]
    prompt = image_prompt(PROMPT, image)
    cond = model.encode([prompt, prompt])
    model.encode([prompt])
    assert len(encoded) == 2  # the prompt and its negative (the same image), once each
    condition = cond.cond["image_condition"]
    assert condition.shape == (2, 8, 2, 4, 6) and torch.equal(condition[:, :4, 0], torch.ones(2, 4, 4, 6))
    assert torch.equal(condition[:, :4, 1], torch.zeros(2, 4, 4, 6))
    assert torch.equal(cond.uncond["image_condition"], condition)
    with pytest.raises(ValueError, match="animates an image, and the prompt 'a green tree' carries none"):
        model.encode([PROMPT])
    single = tiny_wan_pipeline(image_to_video=True, expand_timesteps=True)
    with pytest.raises(ValueError, match="TI2V-5B's image mode"):
        wrap(single, **SIZE)


# ---- stored architectures ----------------------------------------------------------------------------------------
ARCHS = {  # name: (published parameters per transformer, transformers, in_channels, boundary_ratio)
    "wan22_ti2v_5b": (5e9, 1, 48, None),
    "wan22_t2v_a14b": (14e9, 2, 16, 0.875),
    "wan22_i2v_a14b": (14e9, 2, 36, 0.9),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_stored_architectures_match_the_published_sizes(name):
    """Built on the meta device from the stored configs: each transformer within 10 % of the published size (5 B;
    A14B: 14 B per expert, 27 B in all), the experts' configs equal, the VAE's factors as stored."""
    from flowrl.estimate.archs import build_transformer, build_vae
    from flowrl.models.architectures import load_arch

    published, count, in_channels, boundary = ARCHS[name]
    arch = load_arch(name)
    assert arch["published_transformer_params"] == published and arch["family"] in ("wan", "wan_i2v")
    module = build_transformer(arch)
    n = sum(p.numel() for p in module.parameters())
    assert abs(n - published) / published < 0.1, n
    assert module.config.in_channels == in_channels
    if count == 2:
        assert arch["transformer_2"]["config"] == arch["transformer"]["config"]
        assert arch["boundary_ratio"] == boundary
        assert abs(2 * n - 27e9) / 27e9 < 0.1
    vae = build_vae(arch)
    assert vae.config.scale_factor_spatial == arch["vae"]["scale_factor"]
    assert 2 ** sum(vae.config.temperal_downsample) == arch["vae"]["temporal_factor"]


# ---- presets ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["flow_grpo_a14b", "flow_grpo_ti2v_5b"])
def test_presets_name_their_model_and_sources(name):
    """Each preset loads, names a stored architecture's hub id and states its sources and its estimated peak."""
    from flowrl.config.schema import TrainConfig
    from flowrl.models.architectures import list_archs, load_arch

    path = CONFIG_DIR / "wan" / f"{name}.yaml"
    cfg = TrainConfig.from_yaml(path)
    hub_ids = {i for a in list_archs() for i in load_arch(a)["hub_ids"]}
    assert cfg.model.path in hub_ids
    header = path.read_text().split("\nmodel:")[0]
    assert "Source" in header and "GiB" in header and "--estimate" in header
    frames = cfg.model.kwargs["num_frames"]
    assert (frames - 1) % 4 == 0 and math.isfinite(cfg.model.guidance)


# ---- one training iteration through the CLI (slow) -------------------------------------------------------------
@pytest.mark.slow  # the default set covers it: test_experts_choose_which_expert_trains (the update on one expert)
def test_a14b_preset_trains_one_iteration_with_experts_low(tmp_path):
    """``flowrl train configs/wan/flow_grpo_a14b.yaml`` on the tiny two-expert pipeline with ``experts: low``: one
    iteration; the checkpoint holds the low-noise expert's LoRA only, and it changed."""
    from safetensors.torch import load_file

    from flowrl.commands.main import main

    folder = tmp_path / "tiny"
    tiny_wan_pipeline(two_experts=True).save_pretrained(folder)
    overrides = [
        f"model.path={folder}",
        "model.dtype=float32",
        "model.height=32",
        "model.width=48",
        "model.max_sequence_length=12",
        "model.experts=low",
        "model.kwargs={num_frames: 5, guidance_2: 3.0}",
        "model.lora.rank=2",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.max_batch=4",
        "rewards=[{name: brightness, kwargs: {frame_stride: 2}}]",
        "eval.rewards=null",
        "prompts.train=a red circle|a green cat",
        "prompts.eval=null",
        "prompts.per_step=2",
        "train.max_steps=1",
        "train.checkpoint_every=1",
        "train.num_threads=1",
        "train.progress=false",
        "train.async_reward=false",
        f"train.output_dir={tmp_path / 'runs'}",
        "train.name=a14b",
    ]
    assert main(["train", str(CONFIG_DIR / "wan" / "flow_grpo_a14b.yaml"), *overrides]) == 0
    run = tmp_path / "runs" / "a14b"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("reward_mean" in r for r in records)
    files = sorted(p.relative_to(run).as_posix() for p in run.rglob("pytorch_lora_weights.safetensors"))
    assert files and all(f.endswith("transformer_2/pytorch_lora_weights.safetensors") for f in files), files
    lora_b = [v for k, v in load_file(run / files[-1]).items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)


def test_model_experts_is_a_model_key_checked_at_load():
    from flowrl.config.schema import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"model\.experts='low' chooses the trained expert .*model\.family='sd3'"):
        TrainConfig.from_yaml(None, ["model.family=sd3", "model.path=somewhere", "model.experts=low"])
    with pytest.raises(ConfigError, match=r"model\.experts='mid'.*high.*low.*both"):
        TrainConfig.from_yaml(None, ["model.family=wan", "model.path=somewhere", "model.experts=mid"])
    assert TrainConfig.from_yaml(None, ["model.family=wan", "model.path=x", "model.experts=low"]).model.experts == "low"
