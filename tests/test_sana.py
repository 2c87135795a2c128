"""SANA adapter on a tiny offline SanaPipeline: contract, exactness against the pipeline, replay == rollout,
save/load, LoRA I/O and a short learning run through the trainer. CPU only."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import LoraSpec, load_model, wrap
from flowrl.models.sana import SanaFlowModel
from flowrl.models.testing import TINY_VOCAB, tiny_sana_pipeline
from tests.conftest import perturb_lora

PROMPTS = ["a red circle", "two blue dog on the left", "a photo of a big yellow house"]
SEQ = dict(max_sequence_length=8)


def make(scheduler: str = "dpm", **kw):
    pipe = tiny_sana_pipeline(scheduler=scheduler)
    return pipe, wrap(pipe, **SEQ, **kw)


def test_wrap_picks_the_sana_adapter_and_sizes_follow_the_pipeline():
    pipe, model = make()
    assert isinstance(model, SanaFlowModel) and model.family == "sana"
    assert model.latent_shape == (4, 8, 8) and (model.height, model.width) == (32, 32)  # factor-4 DC-AE
    assert model.guidance == 4.5
    with pytest.raises(ValueError, match="multiples of lcm"):
        wrap(tiny_sana_pipeline(), height=48, width=32)


def test_every_vocabulary_word_is_one_gemma_token():
    pipe = tiny_sana_pipeline()
    for word in TINY_VOCAB:
        ids = pipe.tokenizer(f"a {word}", add_special_tokens=False).input_ids
        assert len(ids) == 2 and pipe.tokenizer.unk_token_id not in ids, word


def test_euler_ode_with_the_adapter_reproduces_the_pipeline():
    """Timestep convention (σ·1000·timestep_scale), text mask, CFG layout and schedule: an Euler ODE from
    schedule/velocity equals SanaPipeline's own loop with a flow-matching Euler scheduler."""
    from flowrl.rollout.sampling import ode_sample

    pipe, model = make("euler", guidance=2.5)
    x = ode_sample(model, ["a green tree"], [11], 3, decode=False)
    ref = pipe(
        "a green tree",
        guidance_scale=2.5,
        num_inference_steps=3,
        latents=model.noise([11]),
        output_type="latent",
        use_resolution_binning=False,
        complex_human_instruction=None,
        height=32,
        width=32,
        **SEQ,
    ).images
    assert torch.equal(model.schedule(3), pipe.scheduler.sigmas)
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_schedule_from_sanas_dpm_solver_starts_at_one():
    _, model = make("dpm")
    for steps in (1, 4, 10):
        s = model.schedule(steps)
        t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
        assert s.dtype == torch.float32 and s.shape == (steps + 1,)
        assert s[0].item() == 1.0 and s[-1].item() == 0.0 and bool((s[1:] < s[:-1]).all())
        torch.testing.assert_close(s, (3 * t / (1 + 2 * t)).float())  # flow_shift 3


def test_negative_prompt_is_encoded_without_the_instruction():
    instruction = ["the", "photo", "of"]
    pipe, plain = make(guidance=2.0)
    chi = wrap(pipe, guidance=2.0, complex_human_instruction=instruction, **SEQ)
    a, b = plain.encode(PROMPTS[:2]), chi.encode(PROMPTS[:2])
    assert not torch.equal(a.cond["prompt_embeds"], b.cond["prompt_embeds"])
    assert torch.equal(a.uncond["prompt_embeds"], b.uncond["prompt_embeds"])
    emb, mask, neg, neg_mask = pipe.encode_prompt(
        PROMPTS[:2], do_classifier_free_guidance=True, negative_prompt="", complex_human_instruction=instruction, **SEQ
    )
    assert torch.equal(b.cond["prompt_embeds"], emb) and torch.equal(b.cond["prompt_attention_mask"], mask)
    assert torch.equal(b.uncond["prompt_embeds"], neg) and torch.equal(b.uncond["prompt_attention_mask"], neg_mask)
    assert not torch.equal(a.cond["prompt_embeds"][0], a.cond["prompt_embeds"][1])
    assert plain.encode(PROMPTS[:2], 1.0).uncond is None


def test_learned_sigma_output_keeps_the_velocity_half():
    from diffusers import SanaTransformer2DModel

    pipe = tiny_sana_pipeline()
    config = dict(pipe.transformer.config)
    config["out_channels"] = 8
    pipe.transformer = SanaTransformer2DModel.from_config(config).eval()
    model = wrap(pipe, guidance=1.0, **SEQ)
    x = model.noise([1, 2])
    with torch.no_grad():
        v = model.velocity(x, 0.5, model.encode(PROMPTS[:2]))
        full = pipe.transformer(
            hidden_states=x,
            encoder_hidden_states=model.encode(PROMPTS[:2]).cond["prompt_embeds"],
            encoder_attention_mask=model.encode(PROMPTS[:2]).cond["prompt_attention_mask"],
            timestep=torch.full((2,), 500.0),
            return_dict=False,
        )[0]
    assert v.shape == x.shape and torch.equal(v, full[:, :4])


def test_save_load_round_trip_gives_identical_velocities(tmp_path):
    pipe, model = make(guidance=2.0)
    pipe.save_pretrained(tmp_path)
    loaded = load_model("sana", tmp_path, guidance=2.0, **SEQ)
    assert type(loaded) is SanaFlowModel
    x, s = model.noise([100, 101, 102]), torch.full((3,), 0.7)
    with torch.no_grad():
        assert torch.equal(model.velocity(x, s, model.encode(PROMPTS)), loaded.velocity(x, s, loaded.encode(PROMPTS)))
    assert torch.equal(model.schedule(6), loaded.schedule(6))


def test_lora_saved_by_the_adapter_loads_into_a_fresh_pipeline(tmp_path):
    _, model = make(guidance=1.0)
    model.add_lora(LoraSpec(rank=2, init="default"))
    perturb_lora(model.trainable, scale=0.2, part="lora_B")
    model.save_lora(tmp_path)
    fresh_pipe = tiny_sana_pipeline()
    fresh_pipe.load_lora_weights(str(tmp_path))
    fresh = wrap(fresh_pipe, guidance=1.0, **SEQ)
    x, s = model.noise([3, 4]), torch.full((2,), 0.4)
    with torch.no_grad():
        v0 = model.velocity(x, s, model.encode(PROMPTS[:2]))
        v1 = fresh.velocity(x, s, fresh.encode(PROMPTS[:2]))
        with model.reference():
            base = model.velocity(x, s, model.encode(PROMPTS[:2]))
    torch.testing.assert_close(v0, v1, rtol=0, atol=1e-6)
    assert not torch.allclose(v0, base)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kernel, eta", [("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_replay_equals_rollout(kernel, eta, reduction, monkeypatch):
    """Invariant 1 for SANA: tests/test_chains.py's replay test (ratio exactly 1 at the rollout's weights,
    CFG on, LoRA on, independent and shared noise) run on the SANA adapter."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("sana", kernel, eta, reduction)


def test_training_changes_lora_and_improves_the_objective(tmp_path, monkeypatch):
    """As for SD3 and FLUX: tests/test_trainer.py's learning test (LoRA moves, the first inner step replays
    with ratio exactly 1 — here without CFG —, every update raises the surrogate objective) on SANA."""
    import tests.test_trainer as trainer_tests

    monkeypatch.setattr(trainer_tests, "make_model", lambda family: make(guidance=1.0)[1])
    trainer_tests.test_training_changes_lora_and_improves_the_objective(tmp_path, "sana")
