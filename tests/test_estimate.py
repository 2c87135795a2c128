"""The estimate (flowrl/estimate/, docs/estimate.md): the GPU presets' real architectures built on the meta
device with their LoRA, their shapes, an estimate for every GPU preset, and the estimator against what one
training iteration of the tiny pipelines really allocates on this CPU (glibc's heap, sampled around every op);
the tracer (allocations only), the autocast emulation and the bf16 static parts against what torch allocates."""

from __future__ import annotations

import ctypes
import gc
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flowrl import estimate as E
from flowrl.config.schema import ConfigError, TrainConfig
from flowrl.estimate.report import _seconds
from flowrl.paths import CONFIG_DIR

CONFIG_ROOT = CONFIG_DIR.parent  # where `configs/...` paths start (the checkout, or the installed package)

ROOT = Path(__file__).resolve().parents[1]
GPU_DIRS = (
    "sd35",
    "flux",
    "flux_kontext",
    "sana",
    "qwen_image",
    "qwen_image21",
    "qwen_image_edit",
    "qwen_image_edit_plus",
    "flux2",
    "flux2_klein",
    "wan",
    "ltx2",
)
GPU_PRESETS = sorted(str(p.relative_to(CONFIG_ROOT)) for d in GPU_DIRS for p in (CONFIG_DIR / d).glob("*.yaml"))
PUBLISHED = {  # transformer parameters: the publishers' figures (rounded) and a range that admits the exact count
    "sd35_medium": (2.2e9, 2.5e9),  # "2.5 billion parameters" (Stability AI); diffusers' module: 2.24 B
    "sd35_large": (7.9e9, 8.2e9),  # "8.1 billion parameters"
    "flux1_dev": (11.8e9, 12.0e9),  # "12 billion parameter rectified flow transformer"; diffusers' module: 11.9 B
    "flux1_kontext_dev": (11.8e9, 12.0e9),  # FLUX.1 Kontext [dev]: "a 12 billion parameter rectified flow transformer"
    "sana_1600m": (1.55e9, 1.65e9),  # "Sana-1.6B"
    "qwen_image": (19.5e9, 20.5e9),  # "a 20B MMDiT"; diffusers' module: 20.43 B
    "qwen_image_edit": (19.5e9, 20.5e9),  # Qwen-Image fine-tuned for editing: the same transformer
    "qwen_image_edit_plus": (19.5e9, 20.5e9),  # Qwen-Image-Edit-2509/2511: Qwen-Image-Edit's transformer
    "qwen_image21": (7.0e9, 7.2e9),  # Qwen-Image 2.x: "a 7 B diffusion transformer"; diffusers' module: 7.12 B
    "flux2_dev": (31.5e9, 32.5e9),  # "a 32 billion parameter rectified flow transformer"; diffusers' module: 32.2 B
    "flux2_klein": (3.8e9, 4.0e9),  # FLUX.2 [klein] 4B; diffusers' module: 3.88 B
    "wan21_t2v_1_3b": (1.3e9, 1.45e9),  # "T2V-1.3B"; diffusers' module: 1.42 B
    "wan21_t2v_14b": (13.5e9, 14.5e9),  # "T2V-14B"
    "ltx2": (18.5e9, 19.5e9),  # "19B audio-video model"; diffusers' module: 18.88 B
}
TEXT_ENCODERS = {  # published sizes: T5 v1.1 XXL encoder 4.76 B, CLIP ViT-L/14 text 123 M, OpenCLIP bigG text 695 M,
    "T5EncoderModel": (4.7e9, 4.8e9),  # Gemma-2 2B 2.6 B
    "CLIPTextModel": (120e6, 126e6),
    "CLIPTextModelWithProjection": (120e6, 700e6),
    "Gemma2Model": (2.55e9, 2.65e9),
    "Qwen2_5_VLForConditionalGeneration": (8.2e9, 8.4e9),  # Qwen2.5-VL-7B: 8.29 B with its vision tower
    "Mistral3ForConditionalGeneration": (23.5e9, 24.5e9),  # Mistral-Small-3.1-24B
    "UMT5EncoderModel": (5.6e9, 5.8e9),  # UMT5-XXL encoder: T5-XXL's with a 256 k vocabulary
    "Qwen3ForCausalLM": (4.0e9, 4.05e9),  # Qwen3-4B (FLUX.2 klein): "Number of Parameters: 4.0B"
    "Qwen3VLForConditionalGeneration": (8.5e9, 9.0e9),  # Qwen3-VL-8B (Qwen-Image 2.1): 8.77 B with its vision tower
    # Gemma 3 12B (LTX-2), the Gemma 3 technical report: 417 M vision encoder + 1012 M embedding + 10759 M other
    "Gemma3ForConditionalGeneration": (12.0e9, 12.4e9),
    # LTX-2's text connectors (no published figure; from their config): the 49 stacked Gemma layers projected
    # 49·3840 → 3840 (0.72 B), then two connectors of 2 blocks 3840 wide (4d² attention + 8d² feed-forward: 0.35 B each)
    "LTX2TextConnectors": (1.4e9, 1.45e9),
}


def is_video(family: str) -> bool:
    """Whether a family samples videos, as its adapter declares (FlowModel.modality)."""
    from flowrl.models import model_family

    return model_family(family).adapter_class().modality == "video"


_PRESETS: dict[str, TrainConfig] = {}


def preset(path: str) -> TrainConfig:
    """The preset at ``path`` as `flowrl bench --estimate` loads it (a copy: loaded once per process, since the
    parametrisations read every preset at collection)."""
    import copy

    if path not in _PRESETS:
        _PRESETS[path] = E.load_config(str(CONFIG_ROOT / path), [], "H100")
    return copy.deepcopy(_PRESETS[path])


def gpus_of(path: str) -> int:
    """The GPUs a preset's estimate assumes: 8 for one that splits its samples (model.context_parallel), else 1."""
    from flowrl.distributed.context_parallel import context_degree

    return 8 if context_degree(preset(path).model.context_parallel) > 1 else 1


def arch_of(path: str) -> dict:
    return E.arch_for_model(preset(path).model)


def first_of_each(what) -> list:
    """GPU_PRESETS as parameters, each marked slow when an earlier one of its family gives the same
    ``what(cfg, arch)``: the same check of the same kind of transformer (another size of it, or the base family's
    transformer under an edit or variant family: the same module names and input layout) and sizes, run again
    (`pytest -m slow` runs them all)."""
    seen, params = set(), []
    for path in GPU_PRESETS:
        cfg = preset(path)
        arch = E.arch_for_model(cfg.model)
        kind = [E.base_family(arch["family"]), arch["transformer"]["class"]]
        key = json.dumps([*kind, what(cfg, arch)], sort_keys=True, default=str)
        params.append(pytest.param(path, marks=pytest.mark.slow) if key in seen else path)
        seen.add(key)
    return params


# ---- the presets' architectures on the meta device ----------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_stored_architecture_builds_on_meta_with_the_published_size(name):
    arch = E.load_arch(name)
    module = E.build_transformer(arch)
    params = list(module.parameters())
    assert params and all(p.device.type == "meta" for p in params)  # shapes only: nothing allocated
    assert all(b.device.type == "meta" for b in module.buffers())
    low, high = PUBLISHED[name]
    assert low <= sum(p.numel() for p in params) <= high
    for spec_name, count in E.text_encoder_params(arch).items():
        cls = next(s["class"] for s in arch["text_encoders"] if s["name"] == spec_name)
        lo, hi = TEXT_ENCODERS[cls]
        assert lo <= count <= hi, (spec_name, count)
    vae = E.build_vae(arch)
    assert (vae.config.get("latent_channels") or vae.config.get("z_dim")) == arch["vae"]["latent_channels"]
    spatial, temporal = vae_factors(vae.config)
    assert spatial == arch["vae"]["scale_factor"]
    if "temporal_factor" in arch["vae"]:
        assert temporal == arch["vae"]["temporal_factor"]


def vae_factors(config) -> tuple[int, int | None]:
    """(spatial, temporal) downsampling of a VAE from its stages (not from the ratios a config may state): image VAEs
    ×2 per block after the first; the Wan-style video VAEs ×2 per ``dim_mult`` step and in time per
    ``temperal_downsample``; LTX-2's ``patch_size`` × 2 per stage that downsamples space (``downsample_type`` spatial
    or spatiotemporal), ``patch_size_t`` × 2 per stage that downsamples time (temporal or spatiotemporal)."""
    if "downsample_type" in config:
        kinds = config["downsample_type"]
        return (
            config["patch_size"] * 2 ** sum(k in ("spatial", "spatiotemporal") for k in kinds),
            config["patch_size_t"] * 2 ** sum(k in ("temporal", "spatiotemporal") for k in kinds),
        )
    blocks = config.get("block_out_channels") or config.get("decoder_block_out_channels") or config.get("dim_mult")
    downsample = config.get("temperal_downsample")
    return 2 ** (len(blocks) - 1), None if downsample is None else 2 ** sum(downsample)


def _lora_expected(module: nn.Module, targets: list[str], rank: int) -> tuple[int, int]:
    """(layers, parameters) a LoRA of ``rank`` on the Linear layers whose name ends with a target should
    have: rank·(in + out) per layer, from the base layers' own shapes."""
    layers = params = 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            layers += 1
            params += rank * (m.in_features + m.out_features)
    return layers, params


@pytest.mark.parametrize(
    "path",
    first_of_each(
        lambda cfg, arch: [cfg.model.lora.targets or E.default_lora_targets(cfg.model.family), cfg.model.lora.rank]
    ),
)
def test_every_gpu_preset_finds_its_lora_targets(path):
    cfg = preset(path)
    arch = E.arch_for_model(cfg.model)
    targets = cfg.model.lora.targets or E.default_lora_targets(cfg.model.family)
    base = E.build_transformer(arch)
    layers, params = _lora_expected(base, targets, cfg.model.lora.rank)
    names = [n for n, _ in base.named_modules()]

    def named(target: str) -> bool:
        return any(n == target or n.endswith("." + target) for n in names)

    for t in targets:  # every target names at least one layer of the real architecture, or one block by its index
        # (FLUX.2's single blocks' attn.to_out, up to FLUX.2-dev's 48): a smaller transformer's first block has it
        numbered = re.fullmatch(r"(.+\.)\d+(\..+)", t)
        assert named(t) or (numbered is not None and named(f"{numbered[1]}0{numbered[2]}")), t
    wrapped = E.add_lora(base, cfg.model.lora.rank, cfg.model.lora.alpha, targets)
    trainable = [p for p in base.parameters() if p.requires_grad]
    assert wrapped == layers > 0
    assert sum(p.numel() for p in trainable) == params
    assert all(p.device.type == "meta" for p in base.parameters())


def test_lora_targets_that_match_nothing_fail_naming_them():
    module = E.build_transformer(E.load_arch("sana_1600m"))
    with pytest.raises(ConfigError, match="model.lora.targets"):
        E.add_lora(module, 4, 8, ["no_such_layer"])


@pytest.mark.parametrize(
    "path",
    first_of_each(
        lambda cfg, arch: [
            arch["family"],
            cfg.model.height,
            cfg.model.width,
            cfg.model.max_sequence_length,
            cfg.model.kwargs,
            cfg.rollout.max_batch,
        ]
    ),
)
def test_preset_shapes_run_through_the_real_transformer_on_meta(path):
    cfg = preset(path)
    arch = E.arch_for_model(cfg.model)
    m = cfg.model
    edit = arch["family"] in E.EDIT_FAMILIES  # the base family's shapes, the sources' tokens added
    family = E.base_family(arch["family"])
    if "max_images" in m.kwargs:  # Qwen-Image-Edit-Plus: every prompt's conditioning padded to max_images sources
        text = {**arch["text"], "sources": m.kwargs["max_images"], "condition_area": m.kwargs["condition_area"]}
        arch = {**arch, "text": text}
    sources = arch["text"].get("sources", 1) if edit else 0
    frames = m.kwargs.get("num_frames") if is_video(family) else None
    shapes = E.preset_shapes(arch, m.height, m.width, m.max_sequence_length, frames)
    f = arch["vae"]["scale_factor"] * (2 if family == "flux2" else 1)  # FLUX.2: the 2×2-patchified VAE latent
    assert shapes.latent[-2:] == (m.height // f, m.width // f)
    patch = token_patch(arch)
    if is_video(family):  # [C, F, h, w]: F = (frames − 1)/t + 1, tokens F·(h/p)·(w/p)
        latent_frames = (frames - 1) // arch["vae"]["temporal_factor"] + 1
        assert shapes.latent[1] == latent_frames
        assert shapes.image_tokens == latent_frames * (m.height // f // patch) * (m.width // f // patch)
    else:
        assert len(shapes.latent) == 3
        assert shapes.image_tokens == (m.height // f // patch) * (m.width // f // patch)
    vision = 0
    if arch["family"] in ("qwen_image_edit", "qwen_image_edit_plus"):  # the text encoder sees each source
        area = arch["text"].get("condition_area")
        seen = (m.height, m.width) if area is None else E.condition_size(area, m.height, m.width)
        vision = E.vision_tokens(arch["text"]["vision"], *seen)
    clip = arch["text"]["clip_tokens"] if family == "sd3" else 0
    assert shapes.text_tokens == m.max_sequence_length + clip + sources * vision
    assert shapes.source_tokens == sources * shapes.image_tokens
    # the transformer takes rollout.max_batch rows (×2 with CFG) at these shapes and returns the velocity's shape; cut
    # to 2 blocks of each kind (the inputs and shapes do not depend on depth; the full depth: the slow estimates)
    module = E.build_transformer(with_blocks(arch))
    rows = cfg.rollout.max_batch * 2
    # (under the tracer: Qwen-Image 2.1 reads its token layout from a host mask, which the tracer moves to meta)
    with torch.no_grad(), E.fused_attention("cuda"), E.LiveBytes():
        out = module(**E.transformer_inputs(arch, shapes, rows, torch.bfloat16), return_dict=False)[0]
    if family in ("flux", "qwen_image"):  # 2×2-packed tokens (an edit model's output: the sources' tokens too)
        assert tuple(out.shape) == (rows, shapes.image_tokens + shapes.source_tokens, 4 * shapes.latent[0])
    elif family in ("flux2", "ltx2"):  # a token per latent cell
        assert tuple(out.shape) == (rows, shapes.image_tokens, shapes.latent[0])
    elif family == "qwen_image21":  # a token per latent cell, after the text's in one sequence
        assert tuple(out.shape) == (rows, shapes.text_tokens + shapes.image_tokens, shapes.latent[0])
    else:
        assert tuple(out.shape) == (rows, *shapes.latent)
    assert out.device.type == "meta"


def token_patch(arch: dict) -> int:
    """The latent cells per side one transformer token covers: FLUX and Qwen-Image pack 2×2; FLUX.2 (a token per
    cell of its 2×2-patchified latent), Qwen-Image 2.1 and LTX-2 one; the others their ``patch_size`` (Wan's
    spatial one)."""
    family = E.base_family(arch["family"])
    if family in ("flux", "qwen_image"):
        return 2
    if family == "flux2":
        return 1
    patch = arch["transformer"]["config"].get("patch_size", 1)
    return patch[-1] if isinstance(patch, (list, tuple)) else patch


def test_sizes_the_model_cannot_take_fail_naming_the_keys():
    arch = E.load_arch("flux1_dev")
    with pytest.raises(ConfigError, match="height/width"):
        E.preset_shapes(arch, 712, 720, 512)  # FLUX needs multiples of 16
    with pytest.raises(ConfigError, match="max_sequence_length"):
        E.preset_shapes(arch, 720, 720, 1024)


# ---- an estimate for every GPU preset -------------------------------------------------------------
_ESTIMATES: dict[tuple, dict] = {}


def estimate_of(path: str, gpu: str = "H100", overrides: tuple = (), blocks: int | None = None) -> dict:
    """The estimate of a GPU preset (``blocks``: its transformer cut to that many blocks, :func:`with_blocks`)."""
    key = (path, gpu, overrides, blocks)
    if key not in _ESTIMATES:
        cfg = E.load_config(str(CONFIG_ROOT / path), list(overrides), gpu)
        arch = with_blocks(E.arch_for_model(cfg.model), blocks) if blocks else None
        with E.assume_gpu(gpu):
            _ESTIMATES[key] = E.estimate(cfg, gpu=gpu, arch=arch, processes=gpus_of(path))
    return _ESTIMATES[key]


def with_blocks(arch: dict, blocks: int = 2) -> dict:
    """``arch`` with at most ``blocks`` transformer blocks of each kind (its own key: the caches tell it apart):
    the same model name, shapes, inputs, text encoders and VAE, a fraction of the full-size trace."""
    import copy

    cut = copy.deepcopy(arch)
    config = cut["transformer"]["config"]
    for key in ("num_layers", "num_single_layers"):
        if key in config:
            config[key] = min(config[key], blocks)
    cut["key"] = f"{arch['key']}-{blocks}-blocks"
    return cut


# Each preset whose model, shapes and batch layout no earlier preset shares traces the full-size transformer on the
# meta device (10–40 s each, Qwen-Image's 60 blocks the most: most of this file's time). The default set keeps one
# estimate per plan: SD3.5-M chains (flow_grpo_pickscore), probed (tp_grpo, vgpo) and tree (branchgrpo), FLUX.2 NFT
# (ode) and SANA explore, those of CUT_IN_DEFAULT with 4 blocks of each kind (full size in the slow set). The rest
# repeat a plan an unmarked preset covers; each of their families is estimated end to end in the default set at the
# preset's own shapes, from the tiny pipeline against a
# measured iteration (test_estimate_within_20_percent_of_a_measured_cpu_iteration) and for the Qwen-Image, FLUX.2,
# Wan, LTX-2, FLUX.1 Kontext, FLUX.2 klein, Qwen-Image 2.1 and Qwen-Image-Edit-Plus presets by `flowrl bench
# --estimate` with the transformer cut to 2 blocks (test_bench_estimate_prints_every_new_family_preset). Run them
# with -m slow.
SLOW_ESTIMATES = {
    "configs/flux/branchgrpo_hps.yaml",
    "configs/flux/dance_grpo_hps.yaml",
    "configs/flux/mix_grpo.yaml",  # 720 px FLUX
    "configs/flux/solrl_pickscore.yaml",
    "configs/sd35/nft_geneval.yaml",
    "configs/sd35/solrl_hps.yaml",
    "configs/qwen_image/nft_geneval.yaml",  # Qwen-Image: flow_grpo_pickscore covers the model
    "configs/sd35/flow_grpo_fast.yaml",  # 8 s: SD3.5-M's chains at other settings (flow_grpo_pickscore covers them)
    # the task presets: SD3.5-M Flow-GRPO (flow_grpo_pickscore) and NFT (nft_geneval) with another reward
    "configs/sd35/flow_grpo_geneval.yaml",
    "configs/sd35/flow_grpo_ocr.yaml",
    "configs/sd35/nft_ocr.yaml",
    "configs/sd35/flow_grpo_vlm_judge.yaml",
    # chains as SD3.5-M's, ode as FLUX.2's (15–40 s each; FLUX.1's trace takes about 1.5× FLUX.2's)
    "configs/qwen_image/flow_grpo_pickscore.yaml",
    "configs/qwen_image_edit/flow_grpo_edit.yaml",
    "configs/flux/nft_pickscore.yaml",
    "configs/wan/flow_grpo_1_3b.yaml",
    "configs/wan/flow_grpo_14b_cp.yaml",  # Wan 14B at 32 760 tokens; the split: tests/test_context_parallel.py
    "configs/wan/flow_grpo_a14b.yaml",  # Wan 2.2's experts and TI2V-5B: 30–40 s each; cut to 2 blocks in the default
    "configs/wan/flow_grpo_ti2v_5b.yaml",  # set (test_bench_estimate_prints_every_new_family_preset)
    "configs/ltx2/flow_grpo_video.yaml",  # 80 s at full size; cut to 2 blocks by the bench test
    # the families of issue 56 (10–40 s each at full size); cut to 2 blocks by the bench test in the default set
    "configs/flux_kontext/flow_grpo_edit.yaml",
    "configs/flux2_klein/nft_pickscore.yaml",
    "configs/qwen_image21/flow_grpo_pickscore.yaml",
    "configs/qwen_image_edit_plus/flow_grpo_edit.yaml",
    # the peers' objectives on SD3.5-M: chains (grpo_guard) and ode (dpo, dgpo, crd, gdro) as the presets above
    "configs/sd35/grpo_guard_pickscore.yaml",
    "configs/sd35/dpo_pickscore.yaml",
    "configs/sd35/dgpo_geneval.yaml",
    "configs/sd35/crd_ocr.yaml",
    "configs/sd35/gdro_ocr.yaml",
}


# In the default set these plans are estimated with their transformer cut to 4 blocks of each kind (the same shapes,
# plan counts and memory parts; a quarter of the trace or less), at full size in the slow set.
CUT_IN_DEFAULT = {
    "configs/sd35/flow_grpo_pickscore.yaml",
    "configs/sd35/tp_grpo_pickscore.yaml",
    "configs/sd35/vgpo_geneval.yaml",
    "configs/sd35/branchgrpo_pickscore.yaml",
    "configs/flux2/nft_pickscore.yaml",
    "configs/sana/solrl.yaml",
}


def estimate_params() -> list:
    params = []
    for p in GPU_PRESETS:
        if p in CUT_IN_DEFAULT:
            params.append(pytest.param(p, 4, id=f"{p}-4-blocks"))
        slow = p in SLOW_ESTIMATES or p in CUT_IN_DEFAULT
        params.append(pytest.param(p, None, id=p, marks=[pytest.mark.slow] if slow else []))
    return params


@pytest.mark.parametrize("path, blocks", estimate_params())
def test_estimate_gives_memory_and_time_for_every_gpu_preset(path, blocks):
    r = estimate_of(path, blocks=blocks)
    mem, t, fl = r["memory_gib"], r["time"], r["flops"]
    cfg = preset(path)
    # the parts add up: weights in the preset's dtype (bf16), the trainable LoRA, its gradients, AdamW state and EMA
    # in fp32 (as training keeps them), peak = static + prompt cache + largest phase
    arch = r["architecture"]
    assert cfg.model.dtype == "bfloat16" and not cfg.model.full_finetune
    # bf16, but for the few small modules diffusers keeps in fp32 (Wan: time embedder, scale-shift tables, norms)
    bf16 = arch["transformer_params"] * 2 / 2**30 / mem["sharded_over"]  # FSDP2 (the 8-GPU preset): a shard of each
    assert bf16 * (1 - 1e-6) <= mem["transformer_weights"] <= bf16 * 1.01
    lora = arch["trainable_params"] * 4 / 2**30 / mem["sharded_over"]  # fp32
    assert mem["lora"] == mem["gradients"] == pytest.approx(lora, rel=1e-6 if mem["sharded_over"] == 1 else 0.01)
    assert mem["optimizer_state"] == pytest.approx(2 * mem["gradients"], rel=1e-6)
    assert mem["peak"] == pytest.approx(mem["static"] + mem["prompt_cache"] + mem["dynamic"], rel=1e-6)
    assert mem["static"] > mem["transformer_weights"] + mem["text_encoders"]
    # activations: the presets check-point; without it the update holds every block's activations
    assert cfg.model.gradient_checkpointing
    assert mem["activations_update_with_checkpointing"] < 0.5 * mem["activations_update_without_checkpointing"]
    assert mem["peak"] == pytest.approx(mem["peak_with_gradient_checkpointing"])
    assert mem["peak_without_gradient_checkpointing"] > mem["peak"]
    assert mem["activations_rollout"] > 0 and mem["activations_decode"] > 0
    assert mem["explorer"] > 0 if cfg.rollout.plan == "explore" else mem["explorer"] == 0
    # FLOPs: the plan's forwards at the traced cost per row (×2 rows with CFG), a training row costs more than
    # a rollout row (backward, recompute, reference/old forwards)
    rows = 2 if r["shapes"]["cfg"] else 1
    assert fl["rollout"] == pytest.approx(r["counts"]["forwards"] * rows * fl["per_rollout_row"])
    assert fl["per_update_row"] > 1.5 * fl["per_rollout_row"]
    lo, hi = t["seconds_per_iteration"]
    assert 0 < lo < hi
    assert hi / lo == pytest.approx(E.UTILISATION[1] / E.UTILISATION[0])
    text = E.format_estimate(r)
    assert f"{_seconds(lo)}–{_seconds(hi)} s/iteration" in text and "**peak**" in text


def test_more_processes_share_the_work_and_not_the_weights():
    cfg = preset("configs/sd35/flow_grpo_pickscore.yaml")  # at 4 blocks: what is shared does not depend on depth
    one = estimate_of("configs/sd35/flow_grpo_pickscore.yaml", blocks=4)
    two = E.estimate(cfg, processes=2, arch=with_blocks(E.arch_for_model(cfg.model), 4))
    assert two["flops"]["total"] == pytest.approx(one["flops"]["total"] / 2, rel=1e-6)
    assert two["memory_gib"]["static"] == pytest.approx(one["memory_gib"]["static"])
    with pytest.raises(ConfigError, match="divisible"):
        E.estimate(cfg, processes=5)


def test_time_scales_with_the_gpu_and_fp8_needs_ada_or_hopper():
    h100 = estimate_of("configs/sd35/flow_grpo_pickscore.yaml", blocks=4)
    a100 = estimate_of("configs/sd35/flow_grpo_pickscore.yaml", "A100", blocks=4)
    ratio = a100["time"]["seconds_per_iteration"][0] / h100["time"]["seconds_per_iteration"][0]
    assert ratio == pytest.approx(E.GPUS["H100"].peak_tflops / E.GPUS["A100"].peak_tflops)  # perf/mfu's peaks
    assert a100["memory_gib"]["peak"] == pytest.approx(h100["memory_gib"]["peak"])
    with pytest.raises(ConfigError, match="capability"):
        E.load_config(str(CONFIG_ROOT / "configs/sana/solrl.yaml"), [], "A100")  # fp8 explorer on an A100
    with pytest.raises(ConfigError, match="unknown GPU class"):
        E.gpu_class("V100")


def test_the_prompt_cache_grows_with_the_run_unless_bounded():
    # the prompt cache does not depend on the transformer's depth: FLUX.1's cut to 2 blocks
    unbounded = ("model.prompt_cache_mb=null",)
    short = estimate_of("configs/flux/nft_pickscore.yaml", overrides=("train.max_steps=10", *unbounded), blocks=2)
    long = estimate_of("configs/flux/nft_pickscore.yaml", overrides=unbounded, blocks=2)
    assert short["memory_gib"]["peak"] == pytest.approx(long["memory_gib"]["peak"])
    assert long["memory_gib"]["prompt_cache_end_of_run"] > 10 * short["memory_gib"]["prompt_cache_end_of_run"]
    bounded = estimate_of("configs/flux/nft_pickscore.yaml", overrides=("model.prompt_cache_mb=512",), blocks=2)[
        "memory_gib"
    ]
    assert 0.5 < bounded["prompt_cache_end_of_run"] <= 0.5 + bounded["prompt_cache"] + 1e-9
    assert bounded["peak_end_of_run"] < long["memory_gib"]["peak_end_of_run"] - 50


NEW_FAMILY_DIRS = (
    "qwen_image",
    "qwen_image21",
    "qwen_image_edit",
    "qwen_image_edit_plus",
    "flux_kontext",
    "flux2",
    "flux2_klein",
    "wan",
    "ltx2",
)
"""The preset folders `flowrl bench --estimate` is run on with the transformer cut (their full size: slow)."""


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.slow) if p == "configs/qwen_image/nft_geneval.yaml" else p
        for p in GPU_PRESETS
        if Path(p).parts[1] in NEW_FAMILY_DIRS
    ],
)
def test_bench_estimate_prints_every_new_family_preset(path, capsys, monkeypatch):
    """``flowrl bench CONFIG --estimate`` on the presets of :data:`NEW_FAMILY_DIRS`: the table names the model and
    the shapes (a video: latent [C, F, h, w] and F·(h/p)·(w/p) tokens, p the family's patch; an edit model: its
    sources' tokens), the JSON the same estimate. The transformer is cut to 2 blocks (what is checked here does not
    depend on depth; the full-size estimates of these presets are
    test_estimate_gives_memory_and_time_for_every_gpu_preset's, in the slow set), and a video to 9 frames (the
    frame arithmetic is the same at any count; the VAE's decode is traced frame by frame)."""
    video = is_video(arch_of(path)["family"])
    overrides = ["model.kwargs.num_frames=9"] if video else []
    cut = []  # the architectures estimate() looked up, cut (patched where estimate() finds arch_for_model)
    monkeypatch.setitem(
        E.estimate.__globals__,
        "arch_for_model",
        lambda section: cut.append(with_blocks(E.arch_for_model(section))) or cut[-1],
    )
    assert E.run_estimate(str(CONFIG_ROOT / path), overrides, gpu="H100", processes=gpus_of(path), as_json=True) == 0
    result = json.loads(capsys.readouterr().out)["estimate"]  # the machine view: the JSON alone
    out = E.format_estimate(result)  # the human view: the table of the same estimate
    m = E.load_config(str(CONFIG_ROOT / path), overrides, "H100").model
    arch, sh = E.arch_for_model(m), result["shapes"]
    assert [a["transformer"]["config"]["num_layers"] for a in cut] == [2]  # the cut transformer was estimated
    assert result["model"] == arch["name"] and result["family"] == arch["family"] and arch["name"] in out
    assert f"latent {sh['latent']}" in out and "s/iteration" in out
    if arch["family"] in E.EDIT_FAMILIES:  # each source's latent tokens beside the generated ones
        sources = m.kwargs.get("max_images", 1)  # Qwen-Image-Edit-Plus: every prompt padded to max_images
        assert sh["source_tokens"] == sources * sh["image_tokens"] > 0
        assert f"+ {sh['source_tokens']} source image" in out
    assert result["memory_gib"]["peak"] > result["memory_gib"]["transformer_weights"] > 0
    assert len(sh["latent"]) == (4 if is_video(arch["family"]) else 3)
    patch = token_patch(arch)
    if is_video(arch["family"]):
        c, frames, h, w = sh["latent"]
        assert sh["image_tokens"] == frames * (h // patch) * (w // patch)
        assert frames == (m.kwargs["num_frames"] - 1) // arch["vae"]["temporal_factor"] + 1 <= 3
    else:
        c, h, w = sh["latent"]
        assert sh["image_tokens"] == (h // patch) * (w // patch)


def test_bench_estimate_prints_a_table_or_json(capsys):
    assert E.run_estimate(None, ["train.max_steps=5"], gpu="h200") == 0
    out = capsys.readouterr().out
    assert "H200" in out and "s/iteration" in out and "\n{" not in out  # the human view: the table alone
    assert E.run_estimate(None, ["train.max_steps=5"], gpu="h200", as_json=True) == 0
    result = json.loads(capsys.readouterr().out)["estimate"]
    assert result["memory_gib"]["peak"] > 0 and result["model"].startswith("shapes model")  # the shipped weights


# ---- against one real training iteration on this CPU -----------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_reader():
    """glibc's bytes in use (small chunks + mmapped large ones), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


class HeapPeak(TorchDispatchMode):
    """Largest rise of the process's heap in use, read before and after every aten op while active: the real
    allocations of an iteration (tensors, with the allocator's own overhead), independent of the estimator."""

    def __init__(self, in_use):
        super().__init__()
        self.in_use, self.base, self.peak = in_use, in_use(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, self.in_use() - self.base)
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use() - self.base)
        return out


def _tiny_wan_pipeline():
    """The tiny Wan pipeline (Euler sampler) with a wider transformer (2 blocks × 4 heads × 64, ffn 1024): the tiny
    one is 3× its VAE's width (24 vs 8 channels) where Wan2.1-1.3B's is 16× (1536 vs 96), so at any size its VAE
    decode, not the update, would be the iteration's peak, unlike the real preset's."""
    from diffusers import WanTransformer3DModel

    from flowrl.models.testing.wan import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(scheduler="euler")
    torch.manual_seed(0)
    pipe.register_modules(
        transformer=WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=64,
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=32,
            ffn_dim=1024,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).eval()
    )
    return pipe


TINY = {  # pipeline builder, adapter keywords, config overrides: sizes where the transformer dominates
    "sd3": (
        lambda: __import__("flowrl.models.testing", fromlist=["x"]).tiny_sd3_pipeline(sample_size=32),
        dict(guidance=4.5, height=64, width=64, max_sequence_length=16),
        ["model.guidance=4.5", "model.height=64", "model.width=64", "model.max_sequence_length=16"],
    ),
    "flux": (
        lambda: __import__("flowrl.models.testing", fromlist=["x"]).tiny_flux_pipeline(),
        dict(height=64, width=64, max_sequence_length=16),
        ["model.height=64", "model.width=64", "model.max_sequence_length=16"],
    ),
    "sana": (
        lambda: __import__("flowrl.models.testing", fromlist=["x"]).tiny_sana_pipeline(scheduler="euler"),
        dict(guidance=4.5, height=128, width=128, max_sequence_length=8),
        ["model.guidance=4.5", "model.height=128", "model.width=128", "model.max_sequence_length=8"],
    ),
    "qwen_image": (
        lambda: __import__("flowrl.models.testing", fromlist=["x"]).tiny_qwen_image_pipeline(num_layers=4),
        dict(guidance=4.5, height=64, width=64, max_sequence_length=32),
        ["model.guidance=4.5", "model.height=64", "model.width=64", "model.max_sequence_length=32"],
    ),
    "flux2": (
        lambda: __import__("flowrl.models.testing", fromlist=["x"]).tiny_flux2_pipeline(),
        dict(height=64, width=64, max_sequence_length=40),
        ["model.height=64", "model.width=64", "model.max_sequence_length=40"],
    ),
    "qwen_image_edit": (
        lambda: __import__("flowrl.models.testing", fromlist=["x"]).tiny_qwen_image_edit_pipeline(num_layers=4),
        dict(guidance=4.5, height=64, width=64, max_sequence_length=32),
        ["model.guidance=4.5", "model.height=64", "model.width=64", "model.max_sequence_length=32"],
    ),
    "wan": (
        _tiny_wan_pipeline,
        dict(guidance=4.5, height=32, width=48, num_frames=9, max_sequence_length=12),
        [
            "model.guidance=4.5",
            "model.height=32",
            "model.width=48",
            "model.max_sequence_length=12",
            "model.kwargs={num_frames: 9}",
        ],
    ),
}
NFT_DECODE_PEAK = [
    "loss.objective=nft",
    "rollout.max_batch=2",
    "loss.draws=1",
    "rollout.plan=ode",
    "rollout.group_size=4",
    "rollout.steps=4",
    "model.guidance=1",
]
"""DiffusionNFT, CFG-free, 2 states a micro-batch: the VAE decode of 2 latents is the iteration's peak."""
NFT_FULL = [
    "loss.objective=nft",
    "rollout.max_batch=8",
    "rollout.plan=ode",
    "rollout.group_size=4",
    "rollout.steps=4",
    "model.guidance=1",
    "model.full_finetune=true",
]
"""DiffusionNFT, CFG-free, full fine-tuning: 4 chains of 4 ODE steps per prompt."""
CASES = {  # id → (pipeline, extra overrides)
    "sd3-lora-cfg-kl": ("sd3", []),
    "sd3-checkpointing": ("sd3", ["model.gradient_checkpointing=true"]),
    "sd3-nft-full": ("sd3", NFT_FULL),
    "sd3-nft-decode-peak": ("sd3", NFT_DECODE_PEAK),
    # the main job's objective (configs/shapes/nft.yaml): a guided teacher, its own frozen copy, its anchor's forwards
    # at guidance 3 (2 rows per training row), and 2 of each group's 4 chains sampled by it
    "sd3-nft-teacher": ("sd3", [*NFT_FULL, "rollout.teacher_share=2", "loss.teacher={guidance: 3.0, anchor: 1.0}"]),
    "flux-lora": ("flux", []),
    "flux-checkpointing": ("flux", ["model.gradient_checkpointing=true", "loss.kl_ref=0"]),
    "sana-lora-cfg": ("sana", []),
    "qwen_image-lora-cfg": ("qwen_image", []),
    "qwen_image-nft-decode-peak": ("qwen_image", NFT_DECODE_PEAK),
    "qwen_image_edit-lora-cfg": (
        "qwen_image_edit",
        [],
    ),  # twice the image tokens, the source's vision tokens in the text
    "flux2-lora": ("flux2", []),
    "flux2-checkpointing": ("flux2", ["model.gradient_checkpointing=true"]),
    "wan-lora-cfg": ("wan", []),
    "wan-checkpointing": ("wan", ["model.gradient_checkpointing=true", "loss.kl_ref=0"]),
    "wan-nft-decode-peak": ("wan", NFT_DECODE_PEAK),
}
MEASURED_ERRORS: dict[str, float] = {}
# Variants of a family an unmarked case measures (gradient checkpointing, NFT's decode peak; 4–6 s each): -m slow.
# qwen_image-lora-cfg (15–20 s): qwen_image_edit-lora-cfg measures the same transformer, with the source's tokens too.
SLOW_CASES = {
    "sd3-checkpointing",
    "flux-checkpointing",
    "sd3-nft-decode-peak",
    "qwen_image-nft-decode-peak",
    "flux2-checkpointing",
    "wan-checkpointing",
    "wan-nft-decode-peak",
    "qwen_image-lora-cfg",
}


def _static_tensor_bytes(trainer) -> int:
    """Bytes of what the GPU would hold before an iteration: the pipeline's weights (LoRA included), optimizer
    state, EMA and the objective's copies, a guided teacher's among them (counted once per storage: one shared with
    the reference counts once)."""
    seen, total = set(), 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    pipe = trainer.model.pipe
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            for t in list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]:
                add(t)
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.numel() > 1:
                add(v)
    for t in trainer.updater.ema or []:
        add(t)
    teacher = getattr(trainer.objective, "teacher_model", None)
    for copy_ in [getattr(trainer.objective, name, None) for name in ("_old", "_reference")] + [
        getattr(teacher, "_copy", None)
    ]:
        if copy_ is not None and copy_.frozen is not None:
            for t in list(copy_.frozen.parameters()) + [b for b in copy_.frozen.buffers() if b.is_floating_point()]:
                add(t)
    return total


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in sorted(CASES)]
)
def test_estimate_within_20_percent_of_a_measured_cpu_iteration(case, tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from flowrl.models import wrap
    from flowrl.training.trainer import Trainer

    in_use = _heap_reader()
    if in_use is None:
        pytest.skip("needs glibc's mallinfo2 to read the heap")
    family, extra = CASES[case]
    build, adapter_kw, overrides = TINY[family]
    if "rollout.plan=ode" not in extra:
        overrides = overrides + ["rollout.group_size=4", "rollout.steps=2"]
    if family in E.EDIT_FAMILIES:  # each prompt on its own source image
        from tests.test_families_e2e import family_prompts

        edits = family_prompts(tmp_path, family, ["a red circle", "a blue square"])
        (tmp_path / "edits.txt").write_text("\n".join(edits))
        overrides = overrides + [f"prompts.train={tmp_path / 'edits.txt'}"]
    cfg = TrainConfig.from_yaml(
        None,
        [
            "prompts.train=a red circle|a blue square",
            "prompts.eval=null",
            "prompts.per_step=2",
            "rollout.max_batch=8",
            "rewards=[{name: brightness}]",
            f"train.output_dir={tmp_path}",
            "train.progress=false",
            "train.async_reward=false",
            "train.ema=0.9",
            f"model.family={family}",
            "model.path=in-memory",
        ]
        + overrides
        + extra,
    )
    pipe = build()
    model = wrap(
        pipe, device="cpu", dtype=torch.float32, gradient_checkpointing=cfg.model.gradient_checkpointing, **adapter_kw
    )
    trainer = Trainer(cfg, model=model)
    trainer.train_step(0)  # warm-up: prompt cache, optimizer state, one-time allocations
    gc.collect()
    heap = HeapPeak(in_use)
    with heap:
        trainer.train_step(1)
    flops = FlopCounterMode(display=False)
    with flops:
        trainer.train_step(2)

    result = E.estimate(cfg, arch=E.arch_from_pipeline(pipe), target="cpu")
    mem = result["memory_gib"]
    predicted = mem["dynamic"] * 2**30
    error = predicted / heap.peak - 1
    MEASURED_ERRORS[case] = error
    print(
        f"{case}: measured {heap.peak / 2**20:.2f} MiB, estimated {predicted / 2**20:.2f} MiB ({error:+.1%}; "
        f"peak phase {mem['peak_phase']}); FLOPs measured {flops.get_total_flops():.4g}, "
        f"estimated {result['flops']['total']:.4g}"
    )
    assert heap.peak > 2**20  # the iteration allocates megabytes: the comparison is not lost in noise
    assert abs(error) <= 0.20
    assert result["flops"]["total"] == pytest.approx(flops.get_total_flops(), rel=0.02)
    # the static part: what the model, optimizer, EMA and copies hold before the iteration
    static = (mem["static"] - mem["reward_models"]) * 2**30
    assert static == pytest.approx(_static_tensor_bytes(trainer), rel=0.05)


def test_live_bytes_counts_saved_activations_and_frees_them():
    w = torch.randn(256, 256, requires_grad=True)

    def step() -> None:
        h = torch.randn(32, 256)
        for _ in range(3):
            h = torch.tanh(h @ w)  # each tanh output is saved for backward: 3 × 32 KiB kept
        loss = h.sum()
        del h
        loss.backward()

    out = E.trace(step, "cpu")
    assert out.peak >= 4 * 32 * 256 * 4  # input + three saved activations, alive together before backward
    assert out.end == 256 * 256 * 4  # only w.grad survives
    # 3 forward matmuls, 3 weight-gradient matmuls, 2 input-gradient ones (the first input needs none)
    assert out.flops == (3 + 3 + 2) * 2 * 32 * 256 * 256


# ---- the tracer counts allocations only: no storage that existed before the trace ---------------------------------
def test_live_bytes_runs_an_op_meeting_host_tensors_on_meta():
    """A model computing its token layout on the host (Qwen-Image 2.1's modulation rows picked by a CPU mask) runs
    traced on the meta device: the op that mixes a host tensor with meta ones runs on meta (its output counted);
    any other failure is still raised."""
    mask = torch.tensor([True, False, True]).view(1, -1, 1)  # a real host tensor
    a, b = torch.empty(2, 3, 4, device="meta"), torch.empty(1, 3, 4, device="meta")
    with pytest.raises(RuntimeError):
        torch.where(mask, a, b)
    with E.LiveBytes() as live:
        out = torch.where(mask, a, b)
        with pytest.raises(RuntimeError):
            torch.mm(a[0], b[0])  # [3, 4] @ [3, 4]: not a device mix
    assert out.device.type == "meta" and out.shape == (2, 3, 4) and live.peak == 2 * 3 * 4 * 4


def test_live_bytes_counts_no_view_or_in_place_result_of_a_storage_from_before():
    weight, grad = torch.randn(256, 256), torch.zeros(256, 256)
    kept: list[torch.Tensor] = []

    def before() -> None:  # views of a weight (as a frozen Linear's backward saves weight.t()), in-place results
        kept.extend([weight.t(), weight[:16], weight.view(-1), weight.add_(0), grad.add_(weight)])

    assert E.trace(before, "cpu").peak == 0
    kept.clear()

    def during() -> None:  # a storage made in the trace counts once, whatever views and in-place ops use it
        a = torch.ones(1000)
        kept.extend([a.view(10, 100), a[5:], a.mul_(2), a.t()])

    out = E.trace(during, "cpu")
    assert out.peak == out.end == 1000 * 4
    kept.clear()


class MLP(nn.Sequential):
    """Weights much larger than its activations: what it allocates in an update is mostly gradients."""

    def __init__(self, layers: int = 8, width: int = 1024):
        super().__init__(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def test_traced_update_of_a_real_cpu_model_is_what_its_heap_allocates():
    """Backward accumulating into gradients that exist (every micro-batch after an optimizer step's first) allocates
    only the activations and one layer's new gradient at a time: the trace of the real model and of its meta copy
    (what the estimate traces) within 10 % of the heap's rise; a trace counting ``.grad`` += as an allocation would
    add every gradient (here 5× the activations)."""
    in_use = _heap_reader()
    if in_use is None:
        pytest.skip("needs glibc's mallinfo2 to read the heap")
    torch.manual_seed(0)
    real = MLP()
    meta = MLP().to("meta")
    gradients = 0
    for p in [*real.parameters(), *meta.parameters()]:
        p.grad = torch.zeros_like(p)
        gradients += p.numel() * p.element_size() if p.device.type == "cpu" else 0

    def step(model: nn.Module):
        def run() -> None:
            x = torch.randn(64, 1024, device=next(model.parameters()).device)
            model(x).square().mean().backward()

        return run

    step(real)()  # warm-up
    gc.collect()
    heap = HeapPeak(in_use)
    with heap:
        step(real)()
    traced, traced_meta = E.trace(step(real), "cpu"), E.trace(step(meta), "cpu")
    print(
        f"heap {heap.peak / 2**20:.2f} MiB, traced {traced.peak / 2**20:.2f} MiB "
        f"(meta {traced_meta.peak / 2**20:.2f}), gradients {gradients / 2**20:.0f} MiB"
    )
    assert heap.peak < gradients / 4  # the gradients are not allocated again: the comparison can tell
    assert traced.peak == pytest.approx(heap.peak, rel=0.10)
    assert traced_meta.peak == traced.peak and traced.end == traced_meta.end == 0


# ---- torch's autocast, emulated on meta tensors (full fine-tuning's fp32 master weights) -------------------------
def test_meta_autocast_allocates_what_torch_autocast_allocates_on_a_cpu():
    """The same fp32 model on the CPU under ``torch.autocast("cpu", bf16)`` and on meta under :class:`MetaAutocast`
    (CPU op lists), both traced: the no-grad forward holds the cached bf16 copy of every trainable weight until its
    region ends, the update also what backward saves; the tiny SD3 transformer's update with and without
    gradient checkpointing (recomputed blocks re-enter autocast)."""
    from flowrl.models.testing import tiny_sd3_pipeline

    torch.manual_seed(0)
    autocast = E.MetaAutocast(torch.bfloat16, "cpu")
    real, meta = MLP(width=512), MLP(width=512).to("meta")
    weights = sum(p.numel() for p in real.parameters())

    def mlp(model, region, grad: bool):
        def run() -> None:
            x = torch.randn(16, 512, device=next(model.parameters()).device)
            with torch.set_grad_enabled(grad):
                with region():
                    y = model(x)
                if grad:
                    y.float().square().mean().backward()

        return run

    cpu = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    for grad in (False, True):
        a, b = E.trace(mlp(real, cpu, grad), "cpu"), E.trace(mlp(meta, autocast, grad), "cpu")
        assert b.peak == pytest.approx(a.peak, rel=0.01) and b.end == a.end
        assert a.peak > weights * 2  # the bf16 copies of the weights are there: the comparison can tell
        for p in [*real.parameters(), *meta.parameters()]:
            p.grad = None

    pipe = tiny_sd3_pipeline(sample_size=32)
    arch = E.arch_from_pipeline(pipe)
    shapes = E.preset_shapes(arch, 64, 64, 16)
    real = pipe.transformer.float().train().requires_grad_(True)
    meta = E.build_transformer(arch, torch.float32).train().requires_grad_(True)

    def update(model, region):
        def run() -> None:
            device = next(model.parameters()).device
            x = {
                k: torch.ones(v.shape, dtype=v.dtype, device=device)
                for k, v in E.transformer_inputs(arch, shapes, 4, torch.float32).items()
            }
            with region():
                out = model(**x, return_dict=False)[0]
            out.float().square().mean().backward()

        return run

    for checkpointing in (False, True):
        if checkpointing:
            real.enable_gradient_checkpointing()
            meta.enable_gradient_checkpointing(autocast.checkpoint)
        a, b = E.trace(update(real, cpu), "cpu"), E.trace(update(meta, autocast), "cpu")
        print(
            f"tiny SD3 update, checkpointing {checkpointing}: torch.autocast {a.peak / 2**20:.3f} MiB, "
            f"MetaAutocast {b.peak / 2**20:.3f} MiB"
        )
        assert b.peak == pytest.approx(a.peak, rel=0.03) and b.flops == a.flops


# ---- static parts in the dtypes training holds (model.dtype bf16) --------------------------------------------------
BF16_CASES = {  # id → overrides: fp32 master weights, their frozen KL-reference copy, EMA; fp32 LoRA and its old copy
    "full-clipped-reference": ["model.full_finetune=true", "loss.kl_ref=0.04"],
    "lora-nft-old-adapter": ["loss.objective=nft", "rollout.plan=ode"],
}


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bf16_static_parts_are_what_training_holds(case, tmp_path):
    """A bf16 tiny SD3 trained one iteration by the Trainer (``master_weights_fp32`` / ``keep_adapter_fp32``, AdamW):
    every static part of the estimate equals the bytes of the tensors it stands for."""
    from flowrl.models import wrap
    from flowrl.models.testing import tiny_sd3_pipeline
    from flowrl.training.trainer import Trainer

    cfg = TrainConfig.from_yaml(
        None,
        [
            "prompts.train=a red circle|a blue square",
            "prompts.eval=null",
            "prompts.per_step=2",
            "rollout.max_batch=8",
            "rollout.group_size=4",
            "rollout.steps=2",
            "rewards=[{name: brightness}]",
            f"train.output_dir={tmp_path}",
            "train.progress=false",
            "train.async_reward=false",
            "train.ema=0.9",
            "model.family=sd3",
            "model.path=in-memory",
            "model.dtype=bfloat16",
            "model.height=32",
            "model.width=32",
            "model.guidance=1",
            "model.max_sequence_length=16",
        ]
        + BF16_CASES[case],
    )
    pipe = tiny_sd3_pipeline()
    model = wrap(pipe, device="cpu", dtype=torch.bfloat16, height=32, width=32, max_sequence_length=16, guidance=1.0)
    trainer = Trainer(cfg, model=model)
    transformer = trainer.model.trainable
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    gradients: dict[int, int] = {}
    for p in trainable:
        p.register_post_accumulate_grad_hook(lambda p: gradients.__setitem__(id(p), _bytes([p.grad])))
    trainer.train_step(0)
    named = dict(transformer.named_parameters())
    copies = {name: getattr(trainer.objective, name, None) for name in ("_old", "_reference")}
    frozen = {
        name: [*c.frozen.parameters(), *c.frozen.buffers()] if c is not None and c.frozen is not None else []
        for name, c in copies.items()
    }
    held = {
        "transformer_weights": _bytes(p for n, p in named.items() if "lora_" not in n),
        "transformer_buffers": _bytes(transformer.buffers()),
        "lora": _bytes(p for n, p in named.items() if "lora_" in n and ".default." in n),
        "gradients": sum(gradients.values()),
        "optimizer_state": _bytes(
            v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1
        ),
        "ema": _bytes(trainer.updater.ema),
        "old_policy": (
            _bytes(p for n, p in named.items() if "lora_" in n and ".default." not in n) + _bytes(frozen["_old"])
        ),
        "reference": _bytes(frozen["_reference"]),
    }
    assert len(gradients) == len(trainable) and all(p.dtype == torch.float32 for p in trainable)
    mem = E.estimate(cfg, arch=E.arch_from_pipeline(pipe), target="cpu")["memory_gib"]
    for part, size in held.items():
        print(f"{case} {part}: estimated {mem[part] * 2**30:.0f} B, held {size} B")
        assert mem[part] * 2**30 == pytest.approx(size, rel=1e-9), part
    full = cfg.model.full_finetune
    assert (held["reference"] > 0, held["lora"] > 0, held["old_policy"] > 0) == (full, not full, not full)
    # fp32 trainable weights: 4 bytes per element, twice that for AdamW, whatever model.dtype
    assert held["optimizer_state"] == 2 * held["gradients"] == 2 * held["ema"] > 0


def test_the_edit_architecture_extends_qwen_image_and_counts_the_tokens_the_adapter_makes(tmp_path):
    """qwen_image_edit.json states only what differs from qwen_image.json; at sizes below, at and above the tiny
    processor's pixel bound the estimate's text tokens (instruction + the source's vision tokens) and source tokens
    are the adapter's own encoded lengths."""
    from flowrl.models import wrap
    from flowrl.models.testing.qwen_image import tiny_qwen_image_edit_pipeline
    from tests.test_families_e2e import family_prompts

    base, edit = E.load_arch("qwen_image"), E.load_arch("qwen_image_edit")
    assert all(edit[k] == base[k] for k in ("transformer", "vae", "text_encoders"))
    assert edit["family"] == "qwen_image_edit" and edit["hub_ids"] == ["Qwen/Qwen-Image-Edit"]
    assert edit["text"]["max_sequence_length_limit"] == 1024 and edit["text"]["vision"]["patch_size"] == 14
    pipe = tiny_qwen_image_edit_pipeline()
    arch = E.arch_from_pipeline(pipe)
    assert arch["family"] == "qwen_image_edit" and arch["text"]["vision"]["max_pixels"] == 32 * 32
    pipe.save_pretrained(tmp_path / "pipe")  # a local folder reads the same (its video VAE's factor, the processor)
    folder = E.arch_from_folder(tmp_path / "pipe", "qwen_image_edit")
    assert folder["text"]["vision"] == arch["text"]["vision"]
    assert folder["vae"]["scale_factor"] == arch["vae"]["scale_factor"] == pipe.vae_scale_factor
    prompt = family_prompts(tmp_path, "qwen_image_edit", ["make it red"])[0]
    counts = set()
    for size in (16, 32, 48):
        text = wrap(pipe, height=size, width=size, max_sequence_length=16).encode([prompt]).cond
        shapes = E.preset_shapes(arch, size, size, 16)
        assert text["prompt_embeds"].shape[1] == shapes.text_tokens
        assert text["image_latents"].shape[1] == shapes.source_tokens == shapes.image_tokens
        counts.add(shapes.text_tokens)
    assert len(counts) == 2  # 48² px sources are resized to the processor's bound: as many tokens as 32²


def test_the_edit_plus_estimate_holds_every_prompt_padded_as_the_adapter_pads_it(tmp_path):
    """Qwen-Image-Edit-Plus: the estimate's shapes of a run with ``model.kwargs`` max_images and condition_area
    (:func:`with_sources`, as :func:`estimate` takes them) count the text and source tokens the adapter caches for a
    prompt with one source, padded to max_images (the text to max_sequence_length + max_images × a condition image's
    vision tokens, the sources to max_images latents): its transformer rows are those of a prompt with max_images
    sources. (The presets' estimates: test_bench_estimate_prints_every_new_family_preset.)"""
    from PIL import Image

    from flowrl.models import wrap
    from flowrl.models.image_prompts import image_prompt
    from flowrl.models.testing.qwen_image_edit_plus import tiny_qwen_image_edit_plus_pipeline

    pipe = tiny_qwen_image_edit_plus_pipeline()
    arch = E.arch_from_pipeline(pipe)
    assert arch["family"] == "qwen_image_edit_plus" and arch["text"]["vision"]["max_pixels"] == 32 * 32
    Image.new("RGB", (32, 32), (200, 40, 40)).save(tmp_path / "source.png")
    prompt = image_prompt("make it blue", tmp_path / "source.png")
    text = {}
    for sources in (2, 3):
        kwargs = {"max_images": sources, "condition_area": 32 * 32}
        sh = E.preset_shapes(E.with_sources(arch, kwargs), 32, 32, 40)
        cond = wrap(pipe, height=32, width=32, max_sequence_length=40, **kwargs).encode([prompt]).cond
        assert sh.text_tokens == cond["prompt_embeds"].shape[1]
        assert sh.source_tokens == cond["image_latents"].shape[1] == sources * sh.image_tokens
        text[sources] = sh.text_tokens
    assert 40 < text[2] < text[3]  # each source's vision tokens
    assert E.with_sources(arch, {})["text"]["sources"] == 3  # the adapter's default max_images


def test_reward_weights_counted_for_in_process_task_rewards_only():
    """The estimate holds the GenEval reward's detector and colour model, an in-process judge, and no weights for a
    served judge or the CPU OCR engine."""
    from flowrl.estimate.static import REWARD_MODELS, reward_model_bytes

    def counted(rewards: str) -> int:
        return reward_model_bytes(TrainConfig.from_yaml(None, [f"rewards={rewards}", "eval.rewards=null"]))[0]

    assert counted("[{name: geneval}]") == int(REWARD_MODELS["geneval"][0] * 2)
    assert counted("[{name: geneval, kwargs: {dtype: fp32}}]") == int(REWARD_MODELS["geneval"][0] * 4)
    assert counted("[{name: vlm_judge}]") == 0 == counted("[{name: vlm_judge, kwargs: {backend: openai}}]")
    assert counted("[{name: vlm_judge, kwargs: {backend: transformers}}]") == int(REWARD_MODELS["vlm_judge"][0] * 2)
    assert counted("[{name: ocr}]") == 0


def test_an_out_of_tree_plan_is_estimated_from_what_it_declares():
    """The estimate reads a plan's expected_counts and an objective's train_rows only: an out-of-tree plan whose
    trained edges share parents (replay_rows < trained_edges) and that previews a pool (explore_decodes) is counted
    as it declares, with no test of its type or private methods."""
    from flowrl.estimate.counts import iteration_counts
    from flowrl.objectives.policy import PolicyLoss
    from flowrl.rollout.base import RolloutPlan

    class Forked(RolloutPlan):  # 3 forwards and 4 trained edges per prompt, from 2 parents, after a pool of 5
        def expected_counts(self, num_prompts, ctx=None):
            it = 0 if ctx is None else ctx.iteration
            return {
                "forwards": 3 * num_prompts,
                "trained_edges": 4 * num_prompts,
                "leaves": 4 * num_prompts,
                "replay_rows": 2 * num_prompts,
                "explore_forwards": 7 * num_prompts,
                "explore_decodes": 5 * num_prompts,
                "probes": (it % 2) * num_prompts,
            }

    counts = iteration_counts(Forked(), PolicyLoss(), num_prompts=3, max_steps=16)
    assert counts["train_rows"] == 6 and counts["trained_units"] == 12 and counts["forwards"] == 9
    assert counts["pool"] == 15 and counts["explore_forwards"] == 21
    assert counts["scored"] == 12 + 1.5 and counts["decodes"] == 12 + 1.5 + 15  # probes on every other iteration
