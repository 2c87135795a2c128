"""LTX-2 (text-to-video, video only) adapter on a tiny offline LTX2Pipeline: video latents [B, C, F, h, w] and the
pipeline's noise, the frames / text-length / size checks, audio refused by name, Gemma + connector prompts encoded
one at a time and cached, the video stream isolated from the audio stream (its velocity independent of any audio
input; the joint pipeline differs from it by the audio→video attention alone), CFG in one forward as the pipeline
combines it, exactness of Euler sampling and decoding against the pipeline (audio→video gate zeroed), the LTX shift,
replay == rollout, LoRA on the video stream only loading into a fresh pipeline; slow: one `flowrl train` iteration of
the preset and its LoRA in plain diffusers, and the architecture at real size. CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, wrap
from flowrl.models.ltx2 import LTX2FlowModel
from flowrl.models.testing.ltx2 import tiny_ltx2_pipeline
from tests.test_models import PROMPTS, inputs  # 3 prompts of 3, 6 and 7 words

SIZE = dict(height=32, width=32, num_frames=5, max_sequence_length=8)  # latents [4, 2, 4, 4]: 32 video tokens
GUIDANCE_OFF = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0)  # the pipeline's extra guidance terms
PRESET = Path(__file__).resolve().parents[1] / "configs" / "ltx2" / "flow_grpo_video.yaml"


def make(audio_to_video: bool = True, **kw):
    pipe = tiny_ltx2_pipeline(audio_to_video=audio_to_video)
    return pipe, wrap(pipe, **{**SIZE, **kw})


def joint_call(pipe, x, s, embeds, mask, audio, isolate):
    """The pipeline's own transformer call on latents [B, C, F, h, w] with real audio latents ``audio`` [B, L, C_a]
    (``isolate``: its modality-isolation pass); returns the video output unpacked, [B, C, F, h, w]."""
    video, audio_text, _ = pipe.connectors(embeds, mask, padding_side="left")
    t = s * 1000
    out = pipe.transformer(
        hidden_states=pipe._pack_latents(x),
        audio_hidden_states=audio,
        encoder_hidden_states=video,
        audio_encoder_hidden_states=audio_text,
        timestep=t,
        sigma=t,
        encoder_attention_mask=mask.new_ones(mask.shape),  # the connector's registers replace the padding
        audio_encoder_attention_mask=mask.new_ones(mask.shape),
        num_frames=2,
        height=4,
        width=4,
        fps=24.0,
        audio_num_frames=audio.shape[1],
        isolate_modalities=isolate,
        use_cross_timestep=True,
        return_dict=False,
    )[0]
    return pipe._unpack_latents(out, 2, 4, 4)


# ---- family, sizes, checks, audio refused -------------------------------------------------------------------
def test_family_sizes_checks_and_audio_refused_by_name():
    from flowrl.config.checks import check_model_kwargs
    from flowrl.config.schema import ModelSection
    from flowrl.errors import ConfigError

    pipe, model = make(guidance=2.0)
    assert (MODEL_FAMILIES["ltx2"].pipeline, type(model), model.family, model.modality) == (
        "LTX2Pipeline",
        LTX2FlowModel,
        "ltx2",
        "video",
    )
    assert (model.latent_shape, model.image_seq_len, model.vae_scale_factor, model.num_frames) == (
        (4, 2, 4, 4),
        32,
        8,
        5,
    )
    default = wrap(tiny_ltx2_pipeline())  # the pipeline's call defaults
    assert (default.guidance, default.height, default.width, default.num_frames, default.max_sequence_length) == (
        3.0,
        512,
        768,
        121,
        1024,
    )
    assert default.latent_shape == (4, 31, 64, 96) and default.frame_rate == 24.0
    with pytest.raises(ValueError, match=r"multiples of 32 and the VAE's spatial factor × the patch size = 32"):
        wrap(pipe, **{**SIZE, "height": 48})
    for bad in (0, 6, 4.5, True):
        with pytest.raises(ValueError, match=r"num_frames \(model.kwargs.num_frames\) must be 4·k \+ 1 — 1, 5, 9"):
            wrap(pipe, **{**SIZE, "num_frames": bad})
    with pytest.raises(
        ValueError,
        match=r"max_sequence_length \(model.max_sequence_length\) must be a positive "
        r"multiple of 4 .*got 6",
    ):
        wrap(pipe, **{**SIZE, "max_sequence_length": 6})
    # audio: refused by name, at the adapter and before any weight loads in a config
    with pytest.raises(ValueError, match=r"audio \(model.kwargs.audio\)=True: flowrl trains LTX-2 video only"):
        wrap(pipe, **SIZE, audio=True)
    with pytest.raises(
        ValueError, match=r"audio_guidance_scale \(model.kwargs.audio_guidance_scale\)=7.0: .*video only"
    ):
        wrap(pipe, **SIZE, audio_guidance_scale=7.0)
    section = lambda **kw: ModelSection(family="ltx2", path="unused", kwargs=kw)
    check_model_kwargs(section(num_frames=9, frame_rate=25.0, audio=False))
    with pytest.raises(ConfigError, match=r"model.kwargs.audio_latents=.*not a key of the model.family='ltx2'"):
        check_model_kwargs(section(audio_latents=1))
    one = wrap(pipe, **{**SIZE, "num_frames": 1})  # a single frame is a valid video (one latent frame)
    with torch.no_grad():
        assert one.latent_shape == (4, 1, 4, 4) and one.decode(one.noise([0])).shape == (1, 1, 3, 32, 32)


def test_latents_are_the_pipelines_noise():
    pipe, model = make()
    x = model.noise([7, 8])
    assert x.shape == (2, 4, 2, 4, 4) and x.dtype == torch.float32
    ref = pipe.prepare_latents(1, 4, 32, 32, 5, 0.0, torch.float32, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(pipe._pack_latents(x[:1]), ref)  # the pipeline draws [B, C, F, h, w], then packs it


# ---- text: Gemma + connectors, fixed length, cache ----------------------------------------------------------
def test_encode_caches_each_prompt_alone_as_the_pipeline_encodes_a_batch():
    pipe, model = make(guidance=3.0)
    calls = []  # token ids of every Gemma call
    pipe.text_encoder.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"]), with_kwargs=True)
    a, b = model.encode(PROMPTS + PROMPTS[:1]), model.encode(PROMPTS[1:2])
    assert [tuple(ids.shape) for ids in calls] == [(1, 8)] * 4  # each string once, alone; then "" once
    assert set(a.cond) == {"prompt_embeds", "prompt_attention_mask"}
    assert a.cond["prompt_embeds"].shape == (4, 8, 16) and not a.cond["prompt_embeds"].requires_grad
    assert torch.equal(a.cond["prompt_attention_mask"], torch.ones(4, 8, dtype=torch.int64))  # registers fill the pad
    assert torch.equal(a.cond["prompt_embeds"][1], b.cond["prompt_embeds"][0])
    assert torch.equal(a.cond["prompt_embeds"][0], a.cond["prompt_embeds"][3])
    # the pipeline's own batch: Gemma on the 3 prompts together, then the connectors
    embeds, mask, negative, negative_mask = pipe.encode_prompt(PROMPTS, negative_prompt="", max_sequence_length=8)
    video, _, _ = pipe.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(a.cond["prompt_embeds"][:3], video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        a.uncond["prompt_embeds"],
        pipe.connectors(negative, negative_mask)[0][:1].expand(4, -1, -1),
        rtol=1e-5,
        atol=1e-5,
    )
    assert wrap(pipe, guidance=1.0, **SIZE).encode(PROMPTS).uncond is None
    with pytest.raises(ValueError, match="8 tokens|max_sequence_length"):  # the connectors' register blocks
        wrap(pipe, **{**SIZE, "max_sequence_length": 10})


# ---- velocity: the video stream alone, CFG --------------------------------------------------------------------
def test_video_is_isolated_from_audio_and_cfg_is_the_pipelines_combination():
    """The adapter's velocity is the transformer's modality-isolated video output whatever the audio latents (the
    audio stand-in changes nothing); the joint pass (what LTX2Pipeline runs) differs from it only through the
    audio→video attention: equal when that gate is zero. CFG in one forward = the pipeline's x0-space combination."""
    for audio_to_video in (True, False):
        pipe, model = make(audio_to_video, guidance=3.0)
        x, s, prompts = inputs(model)
        with torch.no_grad():
            cond = model.encode(prompts)
            embeds, mask, negative, negative_mask = pipe.encode_prompt(prompts, max_sequence_length=8)
            v, v_cond = model.velocity(x, s, cond), model.velocity(x, s, cond, guidance=1.0)
            audio = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
            isolated = joint_call(pipe, x, s, embeds, mask, audio, isolate=True)
            joint = joint_call(pipe, x, s, embeds, mask, audio, isolate=False)
            torch.testing.assert_close(v_cond, isolated, rtol=1e-5, atol=1e-5)
            if audio_to_video:
                assert (joint - isolated).abs().max() > 1e-2  # LTX2Pipeline's video reads its audio
            else:
                torch.testing.assert_close(joint, isolated, rtol=0, atol=0)
            # CFG as the pipeline: x0 = x − σv per branch, x0_c + (g − 1)(x0_c − x0_u), back to v
            uncond = joint_call(pipe, x, s, negative, negative_mask, audio, isolate=True)
            sig = s.view(-1, 1, 1, 1, 1)
            x0_c, x0_u = x - sig * isolated, x - sig * uncond
            torch.testing.assert_close(v, (x - (x0_c + 2.0 * (x0_c - x0_u))) / sig, rtol=1e-5, atol=1e-5)
    batches = []
    hook = model.trainable.register_forward_pre_hook(
        lambda m, a, kw: batches.append(len(kw["hidden_states"])), with_kwargs=True
    )
    with torch.no_grad():
        alone = model.velocity(x[1:2], s[1:2], cond.select([1]))
    hook.remove()
    assert batches == [2] and v.dtype == torch.float32 and v.shape == x.shape == (3, 4, 2, 4, 4)
    torch.testing.assert_close(alone, v[1:2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unconditional"):
        model.velocity(x, s, wrap(pipe, guidance=1.0, **SIZE).encode(prompts))
    with pytest.raises(ValueError, match=r"x must be \[B, 4, 2, 4, 4\]"):
        model.velocity(x[:, :, :1], s, cond)


# ---- sampling, decoding and the schedule against the pipeline ------------------------------------------------
def test_euler_ode_and_decode_reproduce_the_pipelines_video():
    """flowrl's Euler ODE (rollout.sampling.ode_sample) on 5-D latents with CFG 3 gives the pipeline's final latents
    and decoded video for the same seed, where the pipeline's video cannot read its audio (audio→video gate zeroed)
    and its extra guidance terms are off; the stretched dynamic shift is the pipeline's schedule."""
    from flowrl.rollout.sampling import ode_sample

    pipe, model = make(audio_to_video=False, guidance=3.0)
    x = ode_sample(model, ["a green tree"], [11], 3, decode=False)
    final = {}

    def keep(pipeline, i, t, kwargs):
        final["latents"] = kwargs["latents"]
        return {}

    with torch.no_grad():
        video = pipe(
            prompt="a green tree",
            guidance_scale=3.0,
            num_inference_steps=3,
            generator=torch.Generator().manual_seed(11),
            output_type="pt",
            callback_on_step_end=keep,
            **SIZE,
            **GUIDANCE_OFF,
        ).frames
        assert torch.equal(model.schedule(3), pipe.scheduler.sigmas)
        torch.testing.assert_close(pipe._pack_latents(x), final["latents"], rtol=1e-5, atol=1e-5)
        decoded = model.decode_video(x)
        assert decoded.shape == video.shape == (1, 5, 3, 32, 32) and torch.equal(model.decode(x), decoded)
        torch.testing.assert_close(decoded, video, rtol=1e-5, atol=1e-5)
        assert 0.1 < video.mean() < 0.9 and not torch.allclose(video[:, 0], video[:, -1])
    assert not torch.equal(pipe.vae.latents_std, torch.ones(4))  # decode must undo the statistics


def test_schedule_is_ltx_dynamic_shift_stretched_to_its_terminal_sigma():
    """σ = linspace(1, 1/n, n) shifted by exp(mu) with mu linear in the video tokens (0.95 at 1024, 2.05 at 4096),
    stretched so the last non-zero σ is the scheduler's shift_terminal 0.1, then 0: the pipeline's own call."""
    import numpy as np
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

    pipe, model = make()
    for frames, (h, w), steps in ((5, (32, 32), 3), (9, (256, 384), 10)):  # 32 and 3·32·48 = 4608 video tokens
        with model.sized(h, w):
            model.num_frames = frames
            tokens = model.image_seq_len
            scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            mu = calculate_shift(tokens, 1024, 4096, 0.95, 2.05)
            retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
            sigmas = model.schedule(steps)
            assert torch.equal(sigmas, scheduler.sigmas) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
            assert sigmas[-2] == pytest.approx(0.1, abs=1e-6) and (sigmas[:-1].diff() < 0).all()
    assert tokens == 3 * 32 * 48 and model.image_seq_len == 3 * 4 * 4  # the size restored after sized()


# ---- rollout / replay ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, eta, reduction", [("flow_grpo", 0.7, "mean")])
def test_replay_equals_rollout(kernel, eta, reduction, monkeypatch):
    """Invariant 1 on LTX-2: tests/test_chains.py's replay test (SDE rollout with log-probs over [C, F, h, w], ratio
    exactly 1 at the rollout's weights, CFG, LoRA on, independent and shared noise)."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("ltx2", kernel, eta, reduction)


# ---- LoRA ---------------------------------------------------------------------------------------------------
def test_lora_targets_the_video_stream_only_and_loads_into_a_fresh_pipeline(tmp_path, monkeypatch):
    """The default targets reach the video stream's self- and text attention and feed-forward of every block and
    nothing of the audio stream or the cross-modal attentions; then tests/test_models.py's LoRA checks: saved →
    ``pipe.load_lora_weights`` into a fresh pipeline → the same velocity, ``load_lora`` in place and from the file,
    and ``reference()`` gives the base model exactly."""
    import tests.test_models as models_tests

    _, model = make()
    model.add_lora(LoraSpec(rank=2))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    per_block = [f"{attn}.{t}" for attn in ("attn1", "attn2") for t in ("to_q", "to_k", "to_v", "to_out.0")]
    expected = {f"transformer_blocks.{i}.{t}" for i in range(2) for t in [*per_block, "ff.net.0.proj", "ff.net.2"]}
    assert wrapped == expected
    monkeypatch.setattr(models_tests, "make", lambda kind, **kw: make(**kw))
    models_tests.test_lora_saved_by_the_adapter_loads_into_a_fresh_pipeline("ltx2", tmp_path)
    models_tests.test_reference_context_gives_the_base_model_exactly("ltx2")


# ---- slow: the preset through `flowrl train`, the architecture at real size --------------------------------
@pytest.mark.slow  # ~10 s; the default set covers its parts: replay == rollout, LoRA loading, sampling equality
def test_one_preset_iteration_and_its_lora_in_plain_diffusers(tmp_path):
    """One `flowrl train` iteration of configs/ltx2/flow_grpo_video.yaml on the tiny pipeline saved to a folder (the
    preset's objective, plan, kernel and frame rewards' layout; a cheap reward instead of PickScore, tiny sizes):
    exit 0, ratio exactly 1 at the first replay; the checkpoint's LoRA in a fresh ``LTX2Pipeline`` through
    ``load_lora_weights`` gives the run's velocities (flowrl sample's loader) and differs from the base."""
    import json

    import diffusers
    import yaml

    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny-ltx2"
    tiny_ltx2_pipeline().save_pretrained(folder)
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue square\n")
    cfg = yaml.safe_load(PRESET.read_text())  # the preset at tiny sizes in fp32, a reward that needs no download
    cfg["model"].update(path=str(folder), dtype="float32", height=32, width=32, max_sequence_length=8)
    cfg["model"]["kwargs"]["num_frames"] = 5
    cfg["model"]["lora"].update(rank=4, alpha=8)
    cfg["rollout"].update(group_size=2, steps=3, max_batch=4)
    cfg["rewards"] = [{"name": "brightness", "kwargs": {"frame_stride": 2}}, cfg["rewards"][1]]
    cfg["prompts"] = {"train": str(tmp_path / "train.txt"), "eval": None, "per_step": 2}
    cfg["train"].update(
        name="ltx2",
        output_dir=str(tmp_path / "runs"),
        max_steps=1,
        checkpoint_every=1,
        updates_per_epoch=1,
        log_with="none",
        progress=False,
        num_threads=1,
        async_reward=False,
    )
    config = tmp_path / "ltx2.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["train", str(config)]) == 0
    run = tmp_path / "runs" / "ltx2"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    (step,) = [r for r in records if "reward_mean" in r]
    assert step["first_step_abs_delta_logp"] == 0.0 and step["ratio_mean"] == 1.0 and step["grad_norm"] > 0
    assert "reward/temporal_consistency" in step
    cfg, ours, _ = model_from_run(str(run), None, [])
    keys = {k: getattr(cfg.model, k) for k in ("guidance", "height", "width", "max_sequence_length")}
    pipe = diffusers.LTX2Pipeline.from_pretrained(folder)
    base = wrap(diffusers.LTX2Pipeline.from_pretrained(folder), **keys, **cfg.model.kwargs)
    pipe.load_lora_weights(str(run / "checkpoints" / "step-1"))
    theirs = wrap(pipe, **keys, **cfg.model.kwargs)
    x, s = ours.noise([5, 6]), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_ours, v_theirs, v_base = (
            m.velocity(x, s, m.encode(["a red circle", "a big house"])) for m in (ours, theirs, base)
        )
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5


@pytest.mark.slow  # builds the 19 B transformer and Gemma 3 12B on the meta device (~5 s); nothing else covers it
def test_stored_architecture_matches_the_published_size():
    """flowrl/models/archs/ltx2.json: the transformer built from it has LTX-2's published 19 B parameters (18.88 B,
    of which the video stream's attention and feed-forward 12.9 B), Gemma 3 12B's 12.2 B; the preset's sizes fit
    the VAE (8k + 1 frames, multiples of 32 px)."""
    import yaml

    from flowrl.estimate.archs import _count_text_encoder, build_transformer
    from flowrl.models.architectures import load_arch

    arch = load_arch("ltx2")
    module = build_transformer(arch)
    total = sum(p.numel() for p in module.parameters())
    assert 18.5e9 < total < 19.5e9 and abs(total - arch["published_transformer_params"]) / 1.9e10 < 0.01
    video = sum(
        p.numel()
        for n, p in module.named_parameters()
        if "audio" not in n and any(f".{part}." in n for part in ("attn1", "attn2", "ff"))
    )
    assert 12.5e9 < video < 13.5e9
    assert 11.9e9 < _count_text_encoder(arch["text_encoders"][0]) < 12.5e9
    model = yaml.safe_load(PRESET.read_text())["model"]
    assert model["path"] in arch["hub_ids"] and model["family"] == arch["family"] == "ltx2"
    assert (model["kwargs"]["num_frames"] - 1) % arch["vae"]["temporal_factor"] == 0
    assert model["height"] % 32 == model["width"] % 32 == 0


def test_the_estimate_reads_a_local_folders_vae_factors_as_the_vae_derives_them(tmp_path):
    """A saved LTX-2 pipeline whose VAE config leaves its compression ratios null (the tiny one): the estimate's
    architecture of the folder takes the factors the VAE module itself derives, and a preset estimate on it runs
    (``flowrl train``'s perf/tflops warned "cannot be estimated" here)."""
    import diffusers
    import yaml

    from flowrl.config.schema import TrainConfig
    from flowrl.estimate.archs import arch_from_folder
    from flowrl.estimate.iteration import estimate

    folder = tmp_path / "tiny-ltx2"
    tiny_ltx2_pipeline().save_pretrained(folder)
    vae_config = yaml.safe_load((folder / "vae" / "config.json").read_text())
    assert vae_config["spatial_compression_ratio"] is None  # left to the VAE
    vae = diffusers.AutoencoderKLLTX2Video.from_pretrained(folder / "vae")
    arch = arch_from_folder(folder, "ltx2")
    assert (arch["vae"]["scale_factor"], arch["vae"]["temporal_factor"]) == (
        vae.spatial_compression_ratio,
        vae.temporal_compression_ratio,
    )
    from flowrl.models.ltx2 import vae_factors

    one_flag = {**vae_config, "spatio_temporal_scaling": False}  # one flag for every block, as diffusers takes it
    flagged = diffusers.AutoencoderKLLTX2Video.from_config(one_flag)
    assert vae_factors(one_flag) == {
        "scale_factor": flagged.spatial_compression_ratio,
        "temporal_factor": flagged.temporal_compression_ratio,
    }
    cfg = TrainConfig.from_yaml(
        str(PRESET),
        [f"model.path={folder}", "model.height=32", "model.width=32", "model.kwargs.num_frames=5"],
    )
    assert estimate(cfg, gpu="H100", processes=1)["flops"]["total"] > 0
