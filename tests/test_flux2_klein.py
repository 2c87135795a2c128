"""FLUX.2 klein adapter on a tiny offline Flux2KleinPipeline (issue 56): the step-distilled model without guidance
(another value refused) and the Base model's true CFG, Qwen3 chat-template prompts padded to a fixed length with
hidden states 9, 18, 27, sampling and decoding equal to the pipeline's, the LoRA in a fresh pipeline, the stored
architecture (FLUX.2 [klein] 4B) and the estimate's shapes, and (slow) one NFT iteration of the preset at klein's own
4 steps with its export loaded by diffusers. CPU only."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, wrap
from flowrl.models.flux2 import Flux2FlowModel
from flowrl.models.flux2_klein import Flux2KleinFlowModel
from flowrl.models.testing.flux2 import tiny_flux2_pipeline
from flowrl.models.testing.flux2_klein import tiny_flux2_klein_pipeline
from tests.conftest import assert_lora_reloads, perturb_lora

SIZE = dict(height=16, width=16, max_sequence_length=20)
PRESET = "configs/flux2_klein/nft_pickscore.yaml"
PROMPTS = ["a red circle", "two blue square", "a green cat"]
TEMPLATE = 12  # tokens of every prompt besides its words: <|im_start|>user\n … <|im_end|>\n<|im_start|>assistant\n…


@pytest.fixture(scope="module")
def pipes() -> dict[bool, object]:
    """is_distilled → a tiny pipeline, for the tests that add no LoRA (each wraps it with its own settings)."""
    return {d: tiny_flux2_klein_pipeline(is_distilled=d) for d in (True, False)}


def make(**kw):
    pipe = tiny_flux2_klein_pipeline()
    return pipe, wrap(pipe, **SIZE, **kw)


# ---- family, guidance -------------------------------------------------------------------------------------------
def test_family_defaults_follow_is_distilled_and_a_distilled_model_refuses_guidance(pipes):
    distilled, base = wrap(pipes[True], **SIZE), wrap(pipes[False], **SIZE)
    assert MODEL_FAMILIES["flux2_klein"].pipeline == "Flux2KleinPipeline" and distilled.family == "flux2_klein"
    assert type(distilled) is type(base) is Flux2KleinFlowModel
    assert type(wrap(tiny_flux2_pipeline(), **SIZE)) is Flux2FlowModel  # FLUX.2-dev keeps its adapter
    assert (distilled.guidance, distilled.uses_cfg(), distilled.text_encoder_out_layers) == (1.0, False, (9, 18, 27))
    assert (base.guidance, base.uses_cfg(), base.uses_cfg(1.0), base.negative_prompt) == (4.0, True, False, "")
    assert wrap(pipes[False], **SIZE, negative_prompt="blurry").negative_prompt == "blurry"  # FLUX.2-dev refuses one
    assert (distilled.latent_shape, distilled.image_seq_len, distilled.vae_scale_factor) == ((16, 4, 4), 16, 4)
    with pytest.raises(
        ValueError, match=r"model.guidance=4.0: this FLUX.2 klein model is step-distilled .*accepted: 1.0"
    ):
        wrap(pipes[True], **SIZE, guidance=4.0)
    x, cond = distilled.noise([1]), distilled.encode(PROMPTS[:1])
    with pytest.raises(ValueError, match=r"guidance 2.0: .* step-distilled .*; accepted: 1.0"):
        distilled.velocity(x, 0.5, cond, guidance=2.0)
    with pytest.raises(ValueError, match="needs the unconditional branch"):
        base.velocity(x, 0.5, base.encode(PROMPTS[:1], 1.0))  # encoded without CFG, asked with it


def test_encode_is_the_pipelines_qwen3_template_padded_and_independent_of_the_batch(pipes):
    """Each prompt alone, padded to max_sequence_length, hidden states 9, 18, 27 concatenated: the pipeline's own
    rows; a Base model's CFG rows are the empty prompt's."""
    pipe = pipes[False]
    model = wrap(pipe, **SIZE)
    tokens = pipe.tokenizer(
        pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": "a red circle"}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
    ).input_ids
    assert len(tokens) == TEMPLATE + 3 and pipe.tokenizer.convert_ids_to_tokens(tokens)[-3:] == ["ĊĊ", "</think>", "ĊĊ"]
    a, b = model.encode(PROMPTS + PROMPTS[:1]), model.encode(PROMPTS[1:2])
    assert a.cond["prompt_embeds"].shape == (4, 20, 48) and set(a.cond) == {"prompt_embeds"}
    embeds, _ = pipe.encode_prompt(PROMPTS, max_sequence_length=20)
    torch.testing.assert_close(a.cond["prompt_embeds"][:3], embeds, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.cond["prompt_embeds"][1], b.cond["prompt_embeds"][0])
    assert torch.equal(a.uncond["prompt_embeds"][0], pipe.encode_prompt([""], max_sequence_length=20)[0][0])
    other = wrap(pipe, **SIZE, text_encoder_out_layers=(1, 2, 27)).encode(PROMPTS[:1]).cond["prompt_embeds"]
    assert torch.equal(other[..., 32:], a.cond["prompt_embeds"][:1, :, 32:]) and not torch.equal(other, embeds[:1])


def test_euler_ode_and_decode_reproduce_the_pipeline(pipes):
    """No guidance input, FLUX.2's empirical mu of the tokens and the steps, the batch-norm statistics and
    unpatchify: the distilled model at its 4 steps and the Base model's CFG equal Flux2KleinPipeline's (its own noise
    from the same seed; its latent output is the VAE's, unpatchified)."""
    from flowrl.rollout.sampling import ode_sample

    for distilled, g, steps in ((True, 1.0, 4), (False, 4.0, 3)):
        pipe = pipes[distilled]
        model = wrap(pipe, **SIZE, guidance=g)
        x = ode_sample(model, ["a green tree"], [11], steps, decode=False)
        common = dict(prompt="a green tree", guidance_scale=g, num_inference_steps=steps, **SIZE)
        with torch.no_grad():
            ref = pipe(output_type="latent", generator=torch.Generator().manual_seed(11), **common).images
            image = pipe(output_type="pt", latents=model.noise([11]), **common).images
            mean, std = model.latent_stats()
            assert torch.equal(model.schedule(steps), pipe.scheduler.sigmas)
            torch.testing.assert_close(pipe._unpatchify_latents(x * std + mean), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)  # measured: equal, CFG 4e-7
            assert 0.1 < image.mean() < 0.9
    with torch.no_grad():  # the Base model's CFG changes the sample
        plain = ode_sample(wrap(pipes[False], **SIZE, guidance=1.0), ["a green tree"], [11], 3, decode=False)
    assert (plain - x).abs().max() > 1e-3


# ---- LoRA -------------------------------------------------------------------------------------------------------
def test_lora_loads_into_a_fresh_pipeline(tmp_path):
    """FLUX.2's targets on klein's blocks; saved → ``pipe.load_lora_weights`` into a fresh Flux2KleinPipeline → the
    same velocities."""
    _, model = make()
    model.add_lora(LoraSpec(rank=2, alpha=4))
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    assert len(wrapped) == 12 + 2  # every projection of the double-stream block and the single-stream one
    perturb_lora(model.trainable)
    x, s = model.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v = model.velocity(x, s, model.encode(PROMPTS))
    model.save_lora(tmp_path)
    assert_lora_reloads(make, tmp_path, x, s, PROMPTS, v)


# ---- the stored architecture and the estimate -----------------------------------------------------------------
def test_stored_architecture_has_klein_4bs_published_size():
    """flux2_klein.json built on the meta device: FLUX.2 [klein] 4B (diffusers' module 3.88 B) and Qwen3-4B
    (4.02 B); FLUX.2-dev's VAE."""
    from flowrl import estimate as E

    arch = E.load_arch("flux2_klein")
    assert (arch["family"], arch["hub_ids"]) == ("flux2_klein", ["black-forest-labs/FLUX.2-klein-4B"])
    params = sum(p.numel() for p in E.build_transformer(arch).parameters())
    assert 3.8e9 <= params <= arch["published_transformer_params"]
    assert 4.0e9 <= E.text_encoder_params(arch)["text_encoder"] <= 4.05e9  # "Qwen3-4B": 4.0 B
    dev = E.load_arch("flux2_dev")["vae"]
    assert all(arch["vae"][k] == dev[k] for k in ("class", "config", "scale_factor", "latent_channels"))


def test_estimate_shapes_are_the_adapters(pipes):
    """The estimate of the tiny pipeline: FLUX.2's latent and tokens, the adapter's text length, no guidance input."""
    from flowrl import estimate as E

    arch = E.arch_from_pipeline(pipes[True])
    model = wrap(pipes[True], **SIZE)
    shapes = E.preset_shapes(arch, 16, 16, 20)
    assert arch["family"] == "flux2_klein" and shapes.latent == model.latent_shape and shapes.image_tokens == 16
    assert shapes.text_tokens == model.encode(PROMPTS[:1]).cond["prompt_embeds"].shape[1]
    assert "guidance" not in E.transformer_inputs(arch, shapes, 2, torch.bfloat16)


@pytest.mark.slow  # the cut transformer traced (a few s); the shapes: test_estimate_shapes_are_the_adapters
def test_bench_estimate_of_the_preset(capsys, monkeypatch):
    """``flowrl bench configs/flux2_klein/nft_pickscore.yaml --estimate`` (2 blocks of each kind): the model, FLUX.2's
    latent at 512 px, no CFG rows at guidance 1."""
    from flowrl import estimate as E
    from tests.test_estimate import with_blocks

    cut = lambda section: with_blocks(E.arch_for_model(section))  # noqa: E731
    monkeypatch.setitem(E.estimate.__globals__, "arch_for_model", cut)
    assert E.run_estimate(PRESET, [], gpu="H100", as_json=True) == 0
    result = json.loads(capsys.readouterr().out)["estimate"]
    sh = result["shapes"]
    assert result["family"] == "flux2_klein" and result["model"] == "FLUX.2 [klein] 4B"
    assert sh["latent"] == [128, 32, 32] and sh["image_tokens"] == 1024 and not sh["cfg"] and sh["guidance"] == 1.0


# ---- the preset -------------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~4 s; covered fast by test_euler_ode_and_decode_reproduce_the_pipeline (the 4-step sampler) and
# test_lora_loads_into_a_fresh_pipeline (the LoRA in diffusers); NFT on FLUX.2: tests/test_flux2.py
def test_the_preset_trains_one_nft_iteration_at_4_steps_and_its_export_loads_into_diffusers(tmp_path):
    """``flowrl train`` of the preset on the saved tiny pipeline: one DiffusionNFT iteration at klein's 4 steps and no
    guidance; ``flowrl export`` → a fresh Flux2KleinPipeline's ``load_lora_weights`` → the run's velocities."""
    from diffusers import Flux2KleinPipeline

    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny"
    tiny_flux2_klein_pipeline().save_pretrained(folder)
    (tmp_path / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    overrides = [
        f"model.path={folder}",
        "model.dtype=float32",
        "model.height=16",
        "model.width=16",
        "model.max_sequence_length=20",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.lora.init=default",
        "rollout.group_size=2",
        f"prompts.train={tmp_path / 'train.txt'}",
        "prompts.eval=null",
        "prompts.per_step=2",
        "rewards=[{name: brightness}]",
        "optim.lr=1e-2",
        "train.max_steps=1",
        "train.checkpoint_every=1",
        "train.progress=false",
        "train.num_threads=1",
        "train.async_reward=false",
        f"train.output_dir={tmp_path / 'runs'}",
    ]
    assert main(["train", PRESET, *overrides]) == 0
    run = tmp_path / "runs" / "flux2-klein-nft-pickscore"
    (record,) = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    assert record["trained_leaves"] == 4.0 and record["grad_norm"] > 0
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0

    cfg, ours, _ = model_from_run(str(run), None, [])
    assert (cfg.rollout.steps, ours.guidance, ours.uses_cfg()) == (4, 1.0, False)
    base = wrap(Flux2KleinPipeline.from_pretrained(folder), **SIZE)
    pipe = Flux2KleinPipeline.from_pretrained(folder)
    pipe.load_lora_weights(str(tmp_path / "export"))
    theirs = wrap(pipe, **SIZE)
    assert theirs.is_distilled  # the flag travels with the saved pipeline
    x, s = ours.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v_ours, v_theirs, v_base = (m.velocity(x, s, m.encode(PROMPTS)) for m in (ours, theirs, base))
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5
