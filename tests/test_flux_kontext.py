"""FLUX.1 Kontext adapter on a tiny offline FluxKontextPipeline (issue 56): prompts that carry their source image,
the source's VAE latent cached per (instruction, image) and appended as tokens with their own position ids, sampling
and decoding equal to the pipeline's (the distilled guidance embedding, and true CFG on the same source), the LoRA in a
fresh pipeline, the stored architecture and the estimate's tokens, the preset's refusals at load, and (slow) one
iteration of the preset with its export loaded by diffusers. CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowrl.errors import ConfigError
from flowrl.models import MODEL_FAMILIES, LoraSpec, wrap
from flowrl.models.flux import FluxFlowModel
from flowrl.models.flux_kontext import FluxKontextFlowModel
from flowrl.models.image_prompts import image_prompt
from flowrl.models.testing import tiny_flux_pipeline
from flowrl.models.testing.flux_kontext import tiny_flux_kontext_pipeline
from tests.conftest import assert_lora_reloads, perturb_lora, random_source_images

SIZE = dict(height=16, width=16, max_sequence_length=16)
PRESET = "configs/flux_kontext/flow_grpo_edit.yaml"
TEXTS = ["make it red", "add a blue dog", "make it red"]  # the same instruction on two different images


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    """Three 16×16 source images with different content (paths)."""
    return random_source_images(tmp_path_factory.mktemp("sources"), 3, 16)


@pytest.fixture(scope="module")
def pipe():
    """One tiny pipeline for the tests that add no LoRA (each wraps it with its own settings)."""
    return tiny_flux_kontext_pipeline()


def prompts_of(sources, n=3):
    return [image_prompt(TEXTS[i], sources[i]) for i in range(n)]


def make(**kw):
    pipe = tiny_flux_kontext_pipeline()
    return pipe, wrap(pipe, **SIZE, **kw)


# ---- family, conditioning ------------------------------------------------------------------------------------
def test_family_is_registered_wrap_picks_it_and_a_prompt_without_its_image_is_refused(pipe):
    model = wrap(pipe, **SIZE, guidance=2.5)
    assert MODEL_FAMILIES["flux_kontext"].pipeline == "FluxKontextPipeline" and model.family == "flux_kontext"
    assert type(model) is FluxKontextFlowModel and model.takes_source_image and model.guidance == 2.5
    assert (model.latent_shape, model.image_seq_len) == ((4, 8, 8), 16)  # mu counts the generated tokens only
    assert type(wrap(tiny_flux_pipeline(), **SIZE)) is FluxFlowModel  # text-to-image FLUX.1 keeps its adapter
    with pytest.raises(
        ValueError,
        match=r"model family 'flux_kontext' edits an image, and the prompt 'make it red' carries none; "
        r"accepted: '\[image: PATH\] INSTRUCTION'",
    ):
        model.encode(["make it red"])


def test_conditioning_is_cached_per_instruction_and_image_and_carries_the_source(pipe, sources, monkeypatch):
    """The instruction alone through the text encoders, the source through the VAE, each (instruction, image) once;
    the source latent is the pipeline's own; true CFG's negative prompt edits the same source."""
    model = wrap(pipe, **SIZE, true_cfg=2.0, negative_prompt=" ")
    texts, images = [], []
    encode_prompt, encode_image = pipe.encode_prompt, pipe._encode_vae_image

    def text_call(prompt, **kw):
        texts.append(prompt[0])
        return encode_prompt(prompt=prompt, **kw)

    def image_call(image, **kw):
        images.append(tuple(image.shape))
        return encode_image(image, **kw)

    monkeypatch.setattr(pipe, "encode_prompt", text_call)
    monkeypatch.setattr(pipe, "_encode_vae_image", image_call)
    prompts = prompts_of(sources)
    a = model.encode(prompts + prompts[:1])
    assert texts == [*TEXTS, " ", " ", " "] and images == [(1, 3, 16, 16)] * 6  # the negative once per source
    b = model.encode(prompts[2:])
    assert len(texts) == len(images) == 6  # cached: the same (instruction, image) is not encoded again
    cond, uncond = a.cond, a.uncond
    assert cond["prompt_embeds"].shape == (4, 16, 32) and cond["image_latents"].shape == (4, 16, 16)
    assert torch.equal(cond["image_latents"], uncond["image_latents"])  # CFG rows edit the same source
    assert torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][2])  # the image does not enter the text
    assert not torch.equal(cond["image_latents"][0], cond["image_latents"][2])
    assert torch.equal(cond["image_latents"][2], b.cond["image_latents"][0])  # independent of batch companions
    pixels = pipe.image_processor.preprocess(Image.open(sources[1]).convert("RGB"), 16, 16)
    _, source, _, ids = pipe.prepare_latents(pixels, 1, 4, 16, 16, torch.float32, "cpu", None, latents=model.noise([0]))
    assert torch.equal(cond["image_latents"][1:2], source) and ids[:, 0].eq(1).all()  # source ids: first axis 1


def test_euler_ode_and_decode_reproduce_the_pipeline(pipe, sources):
    """The source tokens after the latent's with their position ids, the output cut to the latent's tokens, the
    guidance embedding, true CFG with the negative prompt on the same source, FLUX.1's schedule: ODE sampling and
    decoding equal FluxKontextPipeline's (``max_area`` and ``_auto_resize`` keep its sizes at 16×16)."""
    from flowrl.rollout.sampling import ode_sample

    source = Image.open(sources[0]).convert("RGB")
    for embed, true_cfg in ((2.5, 1.0), (3.5, 2.0)):
        model = wrap(pipe, **SIZE, guidance=embed, true_cfg=true_cfg, negative_prompt=" ")
        x = ode_sample(model, [image_prompt("make it red", sources[0])], [11], 3, decode=False)
        common = dict(
            image=source,
            prompt="make it red",
            negative_prompt=" " if true_cfg != 1.0 else None,
            true_cfg_scale=true_cfg,
            guidance_scale=embed,
            num_inference_steps=3,
            height=16,
            width=16,
            max_area=16 * 16,
            _auto_resize=False,
            max_sequence_length=16,
            latents=model.pack(model.noise([11])),
        )
        with torch.no_grad():
            ref = pipe(output_type="latent", **common).images
            image = pipe(output_type="pt", **common).images
        torch.testing.assert_close(x, model.unpack(ref), rtol=1e-5, atol=1e-5)  # measured: equal, CFG 5e-7
        torch.testing.assert_close(model.decode(x), image, rtol=1e-5, atol=1e-5)
        assert 0.1 < image.mean() < 0.9
    with torch.no_grad():  # the source matters: another image, another sample
        other = ode_sample(model, [image_prompt("make it red", sources[1])], [11], 3, decode=False)
    assert (other - x).abs().max() > 1e-3


# ---- LoRA --------------------------------------------------------------------------------------------------------
def test_lora_loads_into_a_fresh_pipeline(tmp_path, sources):
    """The adapter's LoRA (FLUX.1's targets) saved → ``pipe.load_lora_weights`` into a fresh FluxKontextPipeline →
    the same velocities (source tokens included)."""
    _, model = make(guidance=2.5)
    model.add_lora(LoraSpec(rank=4, alpha=8))
    perturb_lora(model.trainable)
    prompts = prompts_of(sources)
    x, s = model.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v = model.velocity(x, s, model.encode(prompts))
    model.save_lora(tmp_path)
    assert_lora_reloads(lambda: make(guidance=2.5), tmp_path, x, s, prompts, v)


# ---- the stored architecture and the estimate's tokens ----------------------------------------------------------
def test_stored_architecture_extends_flux1_dev_with_the_published_size():
    """flux1_kontext_dev.json states only what differs from flux1_dev.json; its transformer built on the meta device
    has FLUX.1 Kontext [dev]'s published 12 B parameters (diffusers' module: 11.90 B)."""
    from flowrl import estimate as E

    base, kontext = E.load_arch("flux1_dev"), E.load_arch("flux1_kontext_dev")
    assert all(kontext[k] == base[k] for k in ("transformer", "vae", "text_encoders", "text"))
    assert (kontext["family"], kontext["hub_ids"]) == ("flux_kontext", ["black-forest-labs/FLUX.1-Kontext-dev"])
    params = sum(p.numel() for p in E.build_transformer(kontext).parameters())
    assert 11.8e9 <= params <= kontext["published_transformer_params"]


def test_estimate_counts_the_tokens_the_adapter_makes(pipe, sources):
    """The estimate of the tiny pipeline: as many source tokens as generated ones, no vision tokens in the text (T5
    alone), and the transformer inputs of one call take both (``img_ids`` included)."""
    from flowrl import estimate as E

    arch = E.arch_from_pipeline(pipe)
    assert arch["family"] == "flux_kontext" and "vision" not in arch["text"]
    text = wrap(pipe, **SIZE).encode(prompts_of(sources, 1)).cond
    shapes = E.preset_shapes(arch, 16, 16, 16)
    assert (shapes.text_tokens, shapes.image_tokens) == (text["prompt_embeds"].shape[1], 16)
    assert shapes.source_tokens == text["image_latents"].shape[1] == shapes.image_tokens
    inputs = E.transformer_inputs(arch, shapes, 2, torch.bfloat16)
    assert inputs["hidden_states"].shape == (2, 32, 16) and inputs["img_ids"].shape == (32, 3)


@pytest.mark.slow  # the cut transformer traced (a few s); the tokens: test_estimate_counts_the_tokens_the_adapter_makes
def test_bench_estimate_of_the_preset(capsys, monkeypatch):
    """``flowrl bench configs/flux_kontext/flow_grpo_edit.yaml --estimate`` (the transformer cut to 2 blocks): the
    model, the source tokens beside the generated ones, no CFG rows (the guidance is an embedding)."""
    from flowrl import estimate as E
    from tests.test_estimate import with_blocks

    cut = lambda section: with_blocks(E.arch_for_model(section))  # noqa: E731
    monkeypatch.setitem(E.estimate.__globals__, "arch_for_model", cut)
    assert E.run_estimate(PRESET, [], gpu="H100", as_json=True) == 0
    result = json.loads(capsys.readouterr().out)["estimate"]
    out = E.format_estimate(result)
    sh = result["shapes"]
    assert result["family"] == "flux_kontext" and result["model"] == "FLUX.1 Kontext [dev]"
    assert sh["source_tokens"] == sh["image_tokens"] == 1024 and "+ 1024 source image" in out
    assert not sh["cfg"] and sh["guidance"] == 2.5


# ---- the preset ---------------------------------------------------------------------------------------------------
def preset_overrides(tmp_path: Path, folder: Path | str, train: Path) -> list[str]:
    """The preset on the tiny pipeline in ``folder``: its sizes, 2 prompts × 2 chains, cheap rewards."""
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
        "rollout.steps=3",
        f"prompts.train={train}",
        "prompts.eval=null",
        "prompts.per_step=2",
        "rewards=[{name: brightness}, {name: source_fidelity, weight: 0.5, kwargs: {size: 8}}]",
        "optim.lr=3e-3",
        "train.max_steps=1",
        "train.checkpoint_every=1",
        "train.log_with=none",
        "train.progress=false",
        "train.num_threads=1",
        "train.async_reward=false",
        f"train.output_dir={tmp_path / 'runs'}",
    ]


def test_the_preset_refuses_a_line_whose_image_is_missing_naming_the_file_and_line(tmp_path, sources):
    """At load, before the model: a line whose image file does not exist, and a line without an image."""
    from flowrl.config.schema import TrainConfig
    from flowrl.training.trainer import Trainer

    for name, line, message in (
        ("gone.txt", image_prompt("make it blue", tmp_path / "gone.png"), r"'\[image: .*: no such image '.*gone\.png'"),
        ("plain.txt", "make it blue", r"'make it blue' has no source image, but model.family='flux_kontext' edits"),
    ):
        (tmp_path / name).write_text(f"{prompts_of(sources)[0]}\n{line}\n")
        cfg = TrainConfig.from_yaml(PRESET, preset_overrides(tmp_path, "unused/folder", tmp_path / name))
        with pytest.raises(ConfigError, match=rf"^prompts.train=.*{name}.*, line 2: {message}"):
            Trainer(cfg)  # model.path names no folder: the prompts fail first


@pytest.mark.slow  # ~4 s; covered fast by test_euler_ode_and_decode_reproduce_the_pipeline (the sampler) and
# test_lora_loads_into_a_fresh_pipeline (the LoRA in diffusers); the trainer on an edit family: test_qwen_image_edit.py
def test_the_preset_trains_one_iteration_and_its_export_loads_into_diffusers(tmp_path, sources):
    """``flowrl train`` of the preset on the saved tiny pipeline with an image-and-instruction prompt file: one
    Flow-GRPO iteration (the first replay reproduces the rollout, fidelity to the source scored); ``flowrl export``
    → a fresh FluxKontextPipeline's ``load_lora_weights`` → the run's velocities, not the base model's."""
    from diffusers import FluxKontextPipeline

    from flowrl.commands.main import main
    from flowrl.run.model import model_from_run

    folder = tmp_path / "tiny"
    tiny_flux_kontext_pipeline().save_pretrained(folder)
    (tmp_path / "edits.txt").write_text("\n".join(prompts_of(sources)) + "\n")
    assert main(["train", PRESET, *preset_overrides(tmp_path, folder, tmp_path / "edits.txt")]) == 0
    run = tmp_path / "runs" / "flux-kontext-flow-grpo"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (record,) = [r for r in map(json.loads, lines) if "reward_mean" in r]
    assert record["first_step_abs_delta_logp"] == 0.0 and record["grad_norm"] > 0  # the first replay is the rollout
    assert 0.0 < record["reward/source_fidelity"] < 1.0 and record["trained_edges"] == 2 * 2 * 2
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0

    _, ours, _ = model_from_run(str(run), None, [])
    keys = dict(SIZE, guidance=2.5)
    base = wrap(FluxKontextPipeline.from_pretrained(folder), **keys)
    pipe = FluxKontextPipeline.from_pretrained(folder)
    pipe.load_lora_weights(str(tmp_path / "export"))
    theirs = wrap(pipe, **keys)
    prompts, x, s = prompts_of(sources), ours.noise([5, 6, 7]), torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        v_ours, v_theirs = (m.velocity(x, s, m.encode(prompts)) for m in (ours, theirs))
        v_base = base.velocity(x, s, base.encode(prompts))
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-6, atol=1e-6)
    assert (v_ours - v_base).abs().max() > 1e-5
