"""Qwen-Image adapter on a tiny offline QwenImagePipeline: text template and cache, true CFG as the pipeline
combines it, exactness of sampling and decoding against the pipeline, replay == rollout, LoRA I/O, bf16 on CPU
and one trainer iteration per objective kind. CPU only."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import MODEL_FAMILIES, LoraSpec, load_model, wrap
from flowrl.models.packing import pack_2x2, unpack_2x2
from flowrl.models.qwen_image import QwenImageFlowModel
from flowrl.models.testing import TINY_VOCAB
from flowrl.models.testing.qwen_image import TEMPLATE, tiny_qwen_image_pipeline
from tests.conftest import assert_lora_reloads, perturb_lora

PROMPTS = ["a red circle", "two blue dog on the left", "a photo of a big yellow house"]  # 8, 11, 12 text tokens
SIZE = dict(height=32, width=32, max_sequence_length=12)
SUFFIX = 5  # template tokens kept after the prompt: <|im_end|> \n <|im_start|> assistant \n


def make(**kw):
    pipe = tiny_qwen_image_pipeline()
    return pipe, wrap(pipe, **SIZE, **kw)


def inputs(model, n=3, sigma=0.7):
    return model.noise(range(100, 100 + n)), torch.full((n,), sigma), (PROMPTS * n)[:n]


# ---- family, sizes, loading ---------------------------------------------------------------------
def test_family_is_registered_and_wrap_picks_the_adapter(tmp_path):
    assert MODEL_FAMILIES["qwen_image"].pipeline == "QwenImagePipeline"
    pipe, model = make(guidance=2.0)
    assert type(model) is QwenImageFlowModel and model.family == "qwen_image"
    assert model.latent_shape == (4, 8, 8) and model.vae_scale_factor == 4 and model.image_seq_len == 16
    assert wrap(tiny_qwen_image_pipeline(), height=32, width=32).guidance == 4.0  # true_cfg_scale's default
    with pytest.raises(ValueError, match="multiples of 2 × vae_scale_factor"):
        wrap(pipe, height=36, width=32)
    pipe.save_pretrained(tmp_path)
    loaded = load_model("qwen_image", tmp_path, guidance=2.0, **SIZE)
    assert type(loaded) is QwenImageFlowModel
    x, s, prompts = inputs(model)
    with torch.no_grad():
        assert torch.equal(model.velocity(x, s, model.encode(prompts)), loaded.velocity(x, s, loaded.encode(prompts)))


def test_packing_is_the_pipelines_and_inverts():
    pipe, model = make()
    x = model.noise([1, 2])
    tokens = model.pack(x)
    assert tokens.shape == (2, 16, 16)
    assert torch.equal(tokens, pipe._pack_latents(x.unsqueeze(2), 2, 4, 8, 8))
    assert torch.equal(model.unpack(tokens), x) and torch.equal(unpack_2x2(pack_2x2(x), 8, 8), x)
    assert torch.equal(pipe._unpack_latents(tokens, 32, 32, 4)[:, :, 0], x)


# ---- text: template, dropped tokens, cache --------------------------------------------------------
def test_template_prefix_is_the_dropped_tokens_and_words_are_single_tokens():
    pipe = tiny_qwen_image_pipeline()
    tok = pipe.tokenizer
    assert pipe.prompt_template_encode == TEMPLATE
    for word in TINY_VOCAB:
        ids = tok(f"a {word}", add_special_tokens=False).input_ids
        assert len(ids) == 2, word
    drop = pipe.prompt_template_encode_start_idx
    full = tok(TEMPLATE.format("a red circle")).input_ids
    assert tok.convert_ids_to_tokens(full[drop - 3 : drop + 1]) == ["<|im_start|>", "user", "Ċ", "a"]
    embeds, mask = pipe.encode_prompt(["a red circle"], max_sequence_length=64)
    assert embeds.shape[1] == len(full) - drop == 3 + SUFFIX and mask is None


def test_encode_caches_pads_to_a_fixed_length_and_ignores_batch_companions(monkeypatch):
    pipe, model = make(guidance=3.0)
    calls = []
    original = pipe.encode_prompt
    monkeypatch.setattr(pipe, "encode_prompt", lambda prompt, **k: calls.append(prompt) or original(prompt, **k))
    a = model.encode(PROMPTS + PROMPTS[:1])
    b = model.encode(PROMPTS[1:2])
    assert calls == [[p] for p in PROMPTS] + [[" "]]  # each string once, alone; the negative prompt " " once
    assert a.cond["prompt_embeds"].shape == (4, 12, 32) and not a.cond["prompt_embeds"].requires_grad
    assert a.cond["prompt_embeds_mask"].sum(1).tolist() == [8, 11, 12, 8]
    assert torch.equal(a.cond["prompt_embeds"][1], b.cond["prompt_embeds"][0])
    assert torch.equal(a.cond["prompt_embeds"][0], a.cond["prompt_embeds"][3])
    # the pipeline's own batched encoding (padded within the batch by the tokenizer): the same rows
    embeds, mask = original(PROMPTS, max_sequence_length=12)
    torch.testing.assert_close(a.cond["prompt_embeds"][:3], embeds, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.cond["prompt_embeds_mask"][:3], mask)
    assert torch.equal(a.cond["prompt_embeds"][0, 8:], torch.zeros(4, 32))  # zero padding beyond the prompt
    neg, _ = original([" "], max_sequence_length=12)
    assert torch.equal(a.uncond["prompt_embeds"][2, : neg.shape[1]], neg[0])
    assert a.uncond["prompt_embeds_mask"][0].sum() == neg.shape[1] == 1 + SUFFIX  # " " is one token
    seq = torch.stack([model.encode([f"a {w}"]).cond["prompt_embeds"][0] for w in TINY_VOCAB])
    assert len({tuple(r.flatten().tolist()) for r in seq}) == len(TINY_VOCAB)  # every word changes the embedding
    assert wrap(pipe, guidance=1.0, **SIZE).encode(PROMPTS).uncond is None


# ---- velocity -------------------------------------------------------------------------------------
def test_true_cfg_in_one_forward_equals_the_pipelines_combination():
    pipe, model = make(guidance=3.0)
    x, s, prompts = inputs(model)
    rows = []
    hook = model.trainable.register_forward_hook(
        lambda m, a, kw, out: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    cond = model.encode(prompts)
    with torch.no_grad():
        v = model.velocity(x, s, cond)
        assert rows == [6]  # [uncond; cond] in one call
        # the pipeline's two calls, each on the unpadded embeddings of one prompt (mask None), then its combination
        pipe_v = []
        for i, p in enumerate(prompts):
            run = lambda e: pipe.transformer(
                hidden_states=model.pack(x[i : i + 1]),
                timestep=s[i : i + 1],
                encoder_hidden_states=e,
                encoder_hidden_states_mask=None,
                img_shapes=[[(1, 4, 4)]],
                return_dict=False,
            )[0]
            noise_pred = run(pipe.encode_prompt([p], max_sequence_length=12)[0])
            neg_noise_pred = run(pipe.encode_prompt([" "], max_sequence_length=12)[0])
            comb = neg_noise_pred + 3.0 * (noise_pred - neg_noise_pred)
            comb = comb * (torch.norm(noise_pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            pipe_v.append(model.unpack(comb))
        torch.testing.assert_close(v, torch.cat(pipe_v), rtol=1e-5, atol=1e-5)
        v_c = model.velocity(x, s, cond, guidance=1.0)
        v_u = model.velocity(x, s, type(cond)(cond.uncond), guidance=1.0)
        assert not torch.allclose(v, v_u + 3.0 * (v_c - v_u), atol=1e-3)  # the norm rescale is applied
        alone = model.velocity(x[1:2], s[1:2], cond.select([1]))  # same rows in another batch: GEMM rounding only
        torch.testing.assert_close(alone, v[1:2], rtol=1e-5, atol=1e-5)
    assert rows[-3:-1] == [3, 3] and v.dtype == torch.float32 and v.shape == x.shape
    hook.remove()
    with pytest.raises(ValueError, match="unconditional"):
        model.velocity(x, s, wrap(pipe, guidance=1.0, **SIZE).encode(prompts))


def test_euler_ode_and_decode_reproduce_the_pipeline():
    """Timestep convention, packing, dynamic shift with Qwen-Image's exponential time shift and terminal σ, true
    CFG with the negative prompt, latent normalisation: ODE sampling and decoding equal QwenImagePipeline's."""
    from flowrl.rollout.sampling import ode_sample

    for g in (2.5, 1.0):
        pipe, model = make(guidance=g)
        x = ode_sample(model, ["a green tree"], [11], 3, decode=False)
        common = dict(
            negative_prompt=model.negative_prompt,
            true_cfg_scale=g,
            num_inference_steps=3,
            height=32,
            width=32,
            max_sequence_length=12,
            latents=model.pack(model.noise([11])),
        )
        with torch.no_grad():
            ref = pipe("a green tree", output_type="latent", **common).images
            image = pipe("a green tree", output_type="pt", **common).images
        assert torch.equal(model.schedule(3), pipe.scheduler.sigmas)
        torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)
    sigmas = model.schedule(3)
    assert sigmas[0] == 1.0 and sigmas[-2:].tolist() == pytest.approx([0.02, 0.0])  # shift_terminal, then 0
    assert not torch.allclose(sigmas, torch.tensor([1.0, 2 / 3, 1 / 3, 0.0]))


# ---- rollout / replay -----------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, eta, reduction", [("flow_grpo", 0.7, "mean"), ("cps", 0.8, "sum")])
def test_replay_equals_rollout(kernel, eta, reduction, monkeypatch):
    """Invariant 1 on Qwen-Image: tests/test_chains.py's replay test (SDE rollout with log-probs, ratio exactly 1
    at the rollout's weights, true CFG at 3.5, LoRA on, independent and shared noise)."""
    import tests.test_chains as chains_tests

    monkeypatch.setattr(chains_tests, "make_model", lambda family: make()[1])
    chains_tests.test_replay_equals_rollout("qwen_image", kernel, eta, reduction)


# ---- LoRA -----------------------------------------------------------------------------------------
def test_lora_targets_cover_attention_and_mlps_and_load_into_a_fresh_pipeline(tmp_path):
    _, model = make(guidance=2.0)
    model.add_lora(LoraSpec(rank=4, alpha=8))  # alpha ≠ rank: the scale must survive the file
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.trainable.named_parameters() if ".lora_A" in n}
    assert len(wrapped) == 2 * 12  # 2 blocks × (8 attention projections + 4 MLP linears)
    assert {n.split(".", 2)[2] for n in wrapped} == {f"attn.{t}" for t in model.default_lora_targets[:8]} | {
        t for t in model.default_lora_targets[8:]
    }
    x, s, prompts = inputs(model)
    cond = model.encode(prompts)
    model.velocity(x, s, cond).square().mean().backward()  # one SGD step on the LoRA
    with torch.no_grad():
        for p in model.trainable.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    perturb_lora(model.trainable)
    with torch.no_grad():
        v = model.velocity(x, s, cond)
    model.save_lora(tmp_path)
    v_base = assert_lora_reloads(lambda: make(guidance=2.0), tmp_path, x, s, prompts, v)
    _, created = make(guidance=2.0)
    created.load_lora(tmp_path)  # resume path: the adapter created from the file
    with torch.no_grad():
        assert torch.equal(created.velocity(x, s, created.encode(prompts)), v)
        with created.reference():
            assert torch.equal(created.velocity(x, s, created.encode(prompts)), v_base)


# ---- low precision --------------------------------------------------------------------------------
def test_bf16_runs_on_cpu_close_to_fp32():
    from flowrl.rollout.sampling import ode_sample

    _, fp32 = make(guidance=2.0)
    _, bf16 = make(guidance=2.0, dtype=torch.bfloat16)
    assert bf16.trainable.dtype == torch.bfloat16 and bf16.pipe.vae.dtype == torch.float32
    x, s, prompts = inputs(fp32)
    with torch.no_grad():
        v32 = fp32.velocity(x, s, fp32.encode(prompts))
        v16 = bf16.velocity(x, s, bf16.encode(prompts))
        assert v16.dtype == torch.float32 and torch.isfinite(v16).all() and not torch.equal(v16, v32)
        assert (v16 - v32).norm() / v32.norm() < 0.05
        a = ode_sample(fp32, ["a green tree"], [3], 4, decode=False)
        b = ode_sample(bf16, ["a green tree"], [3], 4, decode=False)
        assert torch.isfinite(b).all() and (a - b).norm() / a.norm() < 0.05
    bf16.add_lora(LoraSpec(rank=2, alpha=4))
    perturb_lora(bf16.trainable, scale=0.05)
    bf16.velocity(x, s, bf16.encode(prompts)).square().mean().backward()
    grads = {n: p.grad for n, p in bf16.trainable.named_parameters() if p.requires_grad}
    # the last block's text queries and text-stream outputs never reach the image: no gradient (as in fp32)
    dead = {n.split(".lora_")[0] for n, g in grads.items() if g is None or not g.abs().sum() > 0}
    assert dead == {
        f"transformer_blocks.1.{m}"
        for m in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    }
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values() if g is not None)


# ---- the trainer ----------------------------------------------------------------------------------
def test_policy_objective_iteration_replays_with_ratio_one(tmp_path):
    from flowrl.training.trainer import Trainer
    from tests.test_trainer import tiny_config

    cfg = tiny_config(
        tmp_path,
        "qwen",
        "model.family=qwen_image",
        "train.max_steps=1",
        "prompts.eval=null",
        "rollout.group_size=2",
        "rollout.steps=3",
        "rollout.window.size=2",
    )
    trainer = Trainer(cfg, model=make(guidance=2.0)[1])
    assert trainer.guidance == 2.0  # rollouts with true CFG
    before = {n: p.detach().clone() for n, p in trainer.model.trainable.named_parameters() if p.requires_grad}
    records = [r for r in trainer.train() if "reward_mean" in r]
    assert len(records) == 1 and records[0]["first_step_abs_delta_logp"] == 0.0
    assert records[0]["ratio_mean"] == 1.0 and records[0]["trained_edges"] == 2 * 2 * 2
    after = dict(trainer.model.trainable.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_nft_objective_iteration_trains_the_lora(tmp_path):
    from flowrl.training.trainer import Trainer
    from tests.test_forward_process import tiny

    cfg = tiny(
        tmp_path, "qwen_nft", "model.family=qwen_image", "loss.objective=nft", "train.max_steps=1", "optim.lr=1e-2"
    )
    trainer = Trainer(cfg, model=make(guidance=1.0)[1])
    before = [p.detach().clone() for p in trainer.params]
    records = [r for r in trainer.train() if "reward_mean" in r]
    assert len(records) == 1 and records[0]["trained_leaves"] == 4.0 and records[0]["grad_norm"] > 0
    assert torch.isfinite(torch.tensor(records[0]["fm_error"]))
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
