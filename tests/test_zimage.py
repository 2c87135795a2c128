"""Z-Image / Z-Image-Turbo adapter on a tiny offline ZImagePipeline: the chat-template prompts (real tokens only,
cached), Z-Image's CFG convention (flowrl's guidance = the pipeline's guidance_scale + 1, normalization and
truncation), exactness of sampling and decoding against the pipeline, replay == rollout, LoRA in diffusers, the
stored architectures, and the presets: the base model's Flow-GRPO and Turbo's DiffusionNFT at its own 8 steps without
CFG, in training, the eval and ``flowrl sample``. CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, load_model, wrap
from flowrl.models.testing import TINY_VOCAB
from flowrl.models.testing.zimage import tiny_zimage_pipeline
from flowrl.models.zimage import ZImageFlowModel
from tests.test_models import PROMPTS, inputs  # 3 prompts of 3, 6 and 7 words

SIZE = dict(height=16, width=16, max_sequence_length=16)
TEMPLATE = 8  # tokens of every prompt besides its words: <|im_start|> user \n … <|im_end|> \n <|im_start|> assistant \n
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "zimage"


def make(shift: float = 3.0, **kw):
    pipe = tiny_zimage_pipeline(shift=shift)
    pipe.set_progress_bar_config(disable=True)
    return pipe, wrap(pipe, **SIZE, **kw)


# ---- family, sizes, loading ---------------------------------------------------------------------
def test_family_is_registered_and_wrap_picks_the_adapter(tmp_path):
    pipe, model = make(guidance=2.0)
    assert (MODEL_FAMILIES["zimage"].pipeline, type(model), model.family) == (
        "ZImagePipeline",
        ZImageFlowModel,
        "zimage",
    )
    assert (model.latent_shape, model.image_seq_len, model.vae_scale_factor) == ((4, 8, 8), 16, 2)
    default = wrap(tiny_zimage_pipeline())  # the pipeline's defaults: guidance_scale 5 (+1), 1024 px, 512 tokens
    assert (default.guidance, default.height, default.width, default.max_sequence_length) == (6.0, 1024, 1024, 512)
    for bad, message in (
        ({"height": 18}, "multiples of 2 × vae_scale_factor = 4"),
        ({"cfg_normalization": -1.0}, r"model.kwargs.cfg_normalization=-1.0: must be ≥ 0"),
        ({"cfg_truncation": 1.5}, r"model.kwargs.cfg_truncation=1.5: must be in \[0, 1\]"),
        ({"max_sequence_length": 0}, "model.max_sequence_length must be ≥ 1"),
    ):
        with pytest.raises(ValueError, match=message):
            wrap(pipe, **{**SIZE, **bad})
    pipe.save_pretrained(tmp_path)
    loaded = load_model("zimage", tmp_path, guidance=2.0, **SIZE)
    x, s, prompts = inputs(model)
    with torch.no_grad():
        velocities = [m.velocity(x, s, m.encode(prompts, 2.0)) for m in (model, loaded)]
    assert type(loaded) is ZImageFlowModel and torch.equal(*velocities)


# ---- text: chat template, real tokens, cache -----------------------------------------------------
def test_encode_keeps_each_prompts_real_tokens_caches_them_and_adds_the_negative_prompt_under_cfg():
    pipe, model = make(guidance=3.0)
    rendered = pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a red circle"}], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert rendered == "<|im_start|>user\na red circle<|im_end|>\n<|im_start|>assistant\n"
    calls = []
    pipe.text_encoder.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    a, b = model.encode(PROMPTS + PROMPTS[:1]), model.encode(PROMPTS[1:2], 1.0)
    assert calls == [(1, 16)] * 4  # each of 3 prompts and the negative prompt "" once, alone, padded to 16 tokens
    assert set(a.cond) == {"prompt_embeds", "prompt_embeds_mask"} and a.uncond is not None and b.uncond is None
    lengths = [TEMPLATE + len(p.split()) for p in PROMPTS]
    assert a.cond["prompt_embeds_mask"].sum(1).tolist() == [*lengths, lengths[0]]
    assert a.uncond["prompt_embeds_mask"].sum(1).tolist() == [TEMPLATE] * 4
    embeds = a.cond["prompt_embeds"]
    assert embeds.shape == (4, 16, 16) and torch.equal(embeds[1], b.cond["prompt_embeds"][0])
    refs, _ = pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=16)  # (a copy:
    # the pipeline writes the templated prompts into the list it is given)
    for row, (n, ref) in enumerate(zip(lengths, refs)):  # the pipeline's batched encoding: each row's real tokens
        assert ref.shape[0] == n and embeds[row, n:].abs().sum() == 0
        torch.testing.assert_close(embeds[row, :n], ref, rtol=1e-5, atol=1e-6)
    seq = [model.encode([f"a {w}"], 1.0).cond["prompt_embeds"][0] for w in TINY_VOCAB]
    assert len({tuple(r.flatten().tolist()) for r in seq}) == len(TINY_VOCAB)  # every word changes the embedding


# ---- velocity and sampling: the pipeline's conventions ----------------------------------------------
def test_guidance_is_the_pipelines_scale_plus_one_in_one_forward():
    """g = 1 (Turbo's guidance_scale 0): one conditional row each; g ≠ 1: [uncond; cond] in one call, combined as
    ZImagePipeline does: pos + (g − 1)(pos − neg) on the transformer's output (−v); the timestep is 1 − σ."""
    pipe, model = make()
    x, s, prompts = inputs(model)
    rows, times = [], []
    model.trainable.register_forward_pre_hook(lambda m, a: rows.append(len(a[0])) or times.append(a[1]))
    with torch.no_grad():
        v1 = model.velocity(x, s, model.encode(prompts, 1.0), 1.0)
        v3 = model.velocity(x, s, model.encode(prompts, 3.0), 3.0)
        assert rows == [3, 6] and torch.allclose(times[0], 1 - s) and not torch.allclose(v1, v3, atol=1e-4)
        caps = lambda p: pipe.encode_prompt(list(p), do_classifier_free_guidance=False, max_sequence_length=16)[0]  # noqa: E731
        run = lambda caps: torch.stack(pipe.transformer(list(x.unsqueeze(2)), 1 - s, caps, return_dict=False)[0])  # noqa: E731
        pos, neg = run(caps(prompts)), run(caps([""] * 3))
        torch.testing.assert_close(v1, -pos.squeeze(2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v3, -(pos + 2.0 * (pos - neg)).squeeze(2), rtol=1e-5, atol=1e-5)
    assert v3.dtype == torch.float32 and v3.shape == x.shape


@pytest.mark.parametrize(
    "shift, g, steps, kw",
    [
        (3.0, 1.0, 3, {}),  # Turbo: no CFG
        (6.0, 3.0, 4, {}),  # Z-Image: CFG at guidance_scale 2
        (6.0, 5.0, 4, dict(cfg_normalization=1.0, cfg_truncation=0.2)),  # the norm cap and a late-step cut-off
    ],
)
def test_euler_ode_and_decode_reproduce_the_pipeline(shift, g, steps, kw):
    """Timestep 1 − σ, −output, CFG as pos + s(pos − neg) with s = g − 1, its normalization and truncation, the
    float32 linspace shifted statically (3 or 6), decode with scaling and shift: ODE sampling from the pipeline's own
    noise and decoding equal ZImagePipeline's at guidance_scale g − 1."""
    from flowrl.rollout.sampling import ode_sample

    pipe, model = make(shift, guidance=g, **kw)
    x = ode_sample(model, ["a green tree"], [11], steps, decode=False)
    common = dict(prompt="a green tree", guidance_scale=g - 1, num_inference_steps=steps, **SIZE, **kw)
    with torch.no_grad():
        ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(11), **common).images
        image = pipe(output_type="pt", latents=model.noise([11]), **common).images
        assert torch.equal(model.schedule(steps), pipe.scheduler.sigmas)
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)
        assert 0.1 < image.mean() < 0.9
    if kw:  # both options change the sample: they were exercised, not skipped
        plain = ode_sample(make(shift, guidance=g)[1], ["a green tree"], [11], steps, decode=False)
        only_norm = ode_sample(
            make(shift, guidance=g, cfg_normalization=1.0)[1], ["a green tree"], [11], steps, decode=False
        )
        assert not torch.allclose(plain, only_norm, atol=1e-4) and not torch.allclose(only_norm, x, atol=1e-4)


@pytest.mark.slow  # ~1.2 s; the velocity's determinism across batches: test_euler_ode_and_decode_reproduce_the_pipeline
# and test_guidance_is_the_pipelines_scale_plus_one_in_one_forward; the replay invariant itself: tests/test_chains.py
@pytest.mark.parametrize("kernel, eta, reduction", [("flow_grpo", 0.7, "mean")])
def test_replay_equals_rollout(kernel, eta, reduction, monkeypatch):
    """Invariant 1 on Z-Image: tests/test_chains.py's replay test (SDE rollout with log-probs, ratio exactly 1 at the
    rollout's weights, CFG on, LoRA on, independent and shared noise)."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("zimage", kernel, eta, reduction)


# ---- LoRA -----------------------------------------------------------------------------------------
def test_lora_targets_every_block_and_loads_into_a_fresh_pipeline(tmp_path, monkeypatch):
    """The default targets reach the attention and SwiGLU of the main layers and both refiners (not the embedders
    or the modulation); then tests/test_models.py's LoRA checks: saved → ``pipe.load_lora_weights`` into a fresh
    ZImagePipeline → the same velocity, ``load_lora`` in place and from the file, ``reference()`` exactly the base."""
    import tests.test_models as models_tests

    _, model = make()
    model.add_lora(LoraSpec(rank=2))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    block = [*(f"attention.{t}" for t in ("to_q", "to_k", "to_v", "to_out.0")), "feed_forward.w1"]
    block += ["feed_forward.w2", "feed_forward.w3"]
    assert wrapped == {f"{stack}.0.{t}" for stack in ("layers", "noise_refiner", "context_refiner") for t in block}
    monkeypatch.setattr(models_tests, "make", lambda kind, **kw: make(**kw))
    models_tests.test_lora_saved_by_the_adapter_loads_into_a_fresh_pipeline("zimage", tmp_path)
    models_tests.test_reference_context_gives_the_base_model_exactly("zimage")


# ---- the stored architectures -------------------------------------------------------------------
def test_stored_architectures_match_the_published_size_and_turbo_shares_the_transformer():
    """Z-Image's transformer built from the stored config on the meta device: the published 6B (6.15 B in diffusers);
    Z-Image-Turbo extends it: the same transformer, VAE and Qwen3-4B, its own hub id and shift 3 (Z-Image: 6)."""
    from flowrl.estimate.archs import build_transformer, text_encoder_params
    from flowrl.models.architectures import load_arch

    base, turbo = load_arch("zimage"), load_arch("zimage_turbo")
    total = sum(p.numel() for p in build_transformer(base).parameters())
    assert 6.1e9 < total < 6.2e9 and abs(total - base["published_transformer_params"]) / total < 0.03
    assert turbo["transformer"] == base["transformer"] and turbo["vae"] == base["vae"]
    assert turbo["hub_ids"] == ["Tongyi-MAI/Z-Image-Turbo"] and base["hub_ids"] == ["Tongyi-MAI/Z-Image"]
    assert (base["scheduler"]["config"]["shift"], turbo["scheduler"]["config"]["shift"]) == (6.0, 3.0)
    assert 4.0e9 < text_encoder_params(base)["text_encoder"] < 4.05e9  # Qwen3-4B without its LM head


# ---- the presets ----------------------------------------------------------------------------------
def preset_overrides(tmp_path: Path, folder: Path, steps: int | None = None) -> list[str]:
    """A preset on the tiny pipeline in ``folder``: its sizes, 2 prompts × 2 samples, brightness."""
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue square\na green cat\na small dog\n")
    (tmp_path / "eval.txt").write_text("a red circle\na big house\n")
    return [
        f"model.path={folder}",
        "model.dtype=float32",
        "model.height=16",
        "model.width=16",
        "model.max_sequence_length=16",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.lora.init=default",
        "rollout.group_size=2",
        *([f"rollout.steps={steps}"] if steps else []),
        f"prompts.train={tmp_path / 'train.txt'}",
        f"prompts.eval={tmp_path / 'eval.txt'}",
        "prompts.per_step=2",
        "rewards=[{name: brightness}]",
        "optim.lr=1e-2",
        "eval.every=3",
        "eval.num_prompts=2",
        "eval.grid_prompts=2",
        "train.checkpoint_every=3",
        "train.log_with=none",
        "train.progress=false",
        "train.num_threads=1",
        "train.async_reward=false",
        f"train.output_dir={tmp_path / 'runs'}",
    ]


def test_the_turbo_preset_keeps_the_models_own_steps_and_guidance():
    """Turbo's preset: 8 steps in rollouts and eval (ZImagePipeline's Turbo count), no CFG anywhere (guidance 1 =
    guidance_scale 0), DiffusionNFT CFG-free; the base preset: Flow-GRPO with CFG at guidance_scale 4."""
    from flowrl.config.schema import TrainConfig

    turbo = TrainConfig.from_yaml(str(CONFIGS / "nft_turbo_pickscore.yaml"))
    assert (turbo.model.path, turbo.model.guidance, turbo.rollout.steps, turbo.eval.steps) == (
        "Tongyi-MAI/Z-Image-Turbo",
        1.0,
        8,
        8,
    )
    assert (turbo.loss.objective, turbo.loss.cfg, turbo.rollout.plan, turbo.eval.guidance) == (
        "nft",
        "free",
        "ode",
        None,
    )
    base = TrainConfig.from_yaml(str(CONFIGS / "flow_grpo_pickscore.yaml"))
    assert (base.model.path, base.model.guidance, base.rollout.plan, base.eval.guidance) == (
        "Tongyi-MAI/Z-Image",
        5.0,
        "chains",
        5.0,
    )


@pytest.mark.slow  # ~10 s; covered fast by test_euler_ode_and_decode_reproduce_the_pipeline (Turbo's sampler at
# guidance 1), test_the_turbo_preset_keeps_the_models_own_steps_and_guidance (the preset's steps and guidance) and
# test_lora_targets_every_block_and_loads_into_a_fresh_pipeline (the LoRA in diffusers)
def test_turbo_preset_trains_3_iterations_and_sample_and_export_use_its_steps_and_guidance(tmp_path, monkeypatch):
    """``flowrl train`` of the Turbo preset on the saved tiny pipeline, 3 NFT iterations at 8 steps without CFG
    (one conditional row per transformer call); ``flowrl sample`` from its checkpoint draws with 8 steps and
    guidance 1 (what it ran: its ODE calls and the transformer's rows); ``flowrl export`` → a fresh ZImagePipeline's
    ``load_lora_weights`` → the run's velocities."""
    from diffusers import ZImagePipeline

    import flowrl.rollout.sampling as sampling
    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny"
    tiny_zimage_pipeline().save_pretrained(folder)
    preset = str(CONFIGS / "nft_turbo_pickscore.yaml")
    calls = []  # (batch rows of the transformer call) of every call in this process
    original = ZImageFlowModel.velocity

    def velocity(self, x, sigma, cond, guidance=None):
        calls.append((len(x), self.uses_cfg(guidance), cond.uncond is None))
        return original(self, x, sigma, cond, guidance)

    monkeypatch.setattr(ZImageFlowModel, "velocity", velocity)
    schedules = []  # the step count of every schedule asked for: rollouts, eval, sample
    schedule = ZImageFlowModel.schedule
    monkeypatch.setattr(ZImageFlowModel, "schedule", lambda self, n: schedules.append(n) or schedule(self, n))
    assert main(["train", preset, *preset_overrides(tmp_path, folder), "train.max_steps=3"]) == 0
    run = tmp_path / "runs" / "zimage-turbo-nft-pickscore"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in steps)
    assert all(r["trained_leaves"] == 4 for r in steps)  # 2 prompts × 2 samples, each an 8-step ODE rollout
    assert [r["step"] for r in records if "eval/brightness_mean" in r] == [0, 3]
    assert calls and all(not cfg and no_uncond for _, cfg, no_uncond in calls)  # never a CFG row: Turbo's guidance
    assert schedules and set(schedules) == {8}  # rollouts and both evals at Turbo's 8 steps

    used = []
    ode = sampling.ode_batches
    monkeypatch.setattr(
        sampling, "ode_batches", lambda m, p, s, steps, g, b: used.append((steps, g)) or ode(m, p, s, steps, g, b)
    )
    calls.clear()
    schedules.clear()
    out = tmp_path / "samples"
    assert main(["sample", "--checkpoint", str(run), "--prompt", "a red circle", "--num", "2", "--out", str(out)]) == 0
    assert (
        used == [(8, 1.0)]
        and schedules == [8]
        and len(calls) == 8
        and all(rows == 2 and not cfg for rows, cfg, _ in calls)
    )
    assert (out / "grid.png").is_file()

    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    _, ours, trained_at = model_from_run(str(run), None, [])
    assert trained_at == 1.0
    pipe = ZImagePipeline.from_pretrained(folder)
    pipe.load_lora_weights(str(tmp_path / "export"))
    theirs = wrap(pipe, **SIZE, guidance=1.0)
    x, s = ours.noise([5, 6]), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_ours, v_theirs = (m.velocity(x, s, m.encode(PROMPTS[:2])) for m in (ours, theirs))
        v_base = wrap(ZImagePipeline.from_pretrained(folder), **SIZE, guidance=1.0)
        v_base = v_base.velocity(x, s, v_base.encode(PROMPTS[:2]))
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5


@pytest.mark.slow  # ~5 s; the trainer's policy objective with CFG on Z-Image: test_replay_equals_rollout (chains
# replayed, ratio 1) and test_euler_ode_and_decode_reproduce_the_pipeline (the guided sampler)
def test_base_preset_trains_one_flow_grpo_iteration(tmp_path):
    """``flowrl train`` of the Z-Image Flow-GRPO preset on the saved tiny pipeline (shift 6): one iteration with CFG
    (guidance 5), the first replay reproducing the rollout (its 2 updates: the second at moved weights)."""
    from flowrl.commands.main import main

    folder = tmp_path / "tiny"
    tiny_zimage_pipeline(shift=6.0).save_pretrained(folder)
    preset = str(CONFIGS / "flow_grpo_pickscore.yaml")
    extra = ["train.max_steps=1", "prompts.eval=null", "rollout.steps=3"]
    assert main(["train", preset, *preset_overrides(tmp_path, folder), *extra]) == 0
    lines = (tmp_path / "runs" / "zimage-flow-grpo-pickscore" / "metrics.jsonl").read_text().splitlines()
    (record,) = [r for r in map(json.loads, lines) if "reward_mean" in r]
    assert record["first_step_abs_delta_logp"] == 0.0 and record["grad_norm"] > 0  # the first replay is the rollout
    assert record["trained_edges"] == 2 * 2 * 2  # window all: the 3 steps' SDE edges but the last, to σ = 0
