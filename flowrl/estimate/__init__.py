"""Predicted peak GPU memory and seconds per iteration of a config, before any GPU is rented
(``flowrl bench CONFIG --estimate [--gpu H100]``; docs/estimate.md).

How it works: the model's real diffusers transformer (and VAE, and text encoders) is built from its
published ``config.json`` (:mod:`flowrl.models.archs`, or a local pipeline folder) on the ``meta``
device — shapes and dtypes, no memory — with the preset's LoRA attached by peft exactly as training
attaches it. Then the three phases of an iteration run on meta tensors at the preset's shapes:

- a rollout forward (no gradients) of ``rollout.max_batch`` states (×2 rows with CFG),
- a VAE decode of ``rollout.max_batch`` latents,
- one training micro-batch as the objective runs it (old-policy / reference forwards without
  gradients, the forward with gradients, backward), with and without gradient checkpointing,
- one AdamW step over the trainable parameters.

A dispatch mode counts every tensor storage those ops create and frees it when the last tensor using it
(or autograd's saved copy of it) dies, so each phase's peak of live bytes is the activation memory the
same code allocates on a device; attention runs as a fused kernel (flash/memory-efficient on CUDA, the
kernel torch picks on CPU), and torch's ``FlopCounterMode`` counts the FLOPs of the same ops. The
static part (weights, LoRA, gradients, AdamW state, EMA, old-policy / reference / explorer copies, text
encoders, VAE, reward models) is counted from the built modules and the config. Forwards per iteration
come from the plan's ``expected_counts`` (the closed forms docs/extending.md lists).

Measured against real runs on CPU (the tiny pipelines of :mod:`flowrl.models.testing`; tests/test_estimate.py)
and stated with every estimate: the assumptions in :data:`ASSUMPTIONS` and docs/estimate.md.

This module holds the public entry points, :func:`estimate` and :func:`run_estimate`; the parts, one job each:

- :mod:`~flowrl.estimate.gpus`: the GPU classes, the utilisation range, loading a config as if on a GPU;
- :mod:`~flowrl.estimate.archs`: the published architectures built on the meta device with the preset's LoRA;
- :mod:`~flowrl.estimate.inputs`: a preset's shapes and the transformer's inputs and velocity call;
- :mod:`~flowrl.estimate.trace`: the live-bytes and FLOP tracer;
- :mod:`~flowrl.estimate.autocast`: torch's autocast on meta tensors (full fine-tuning's fp32 master weights);
- :mod:`~flowrl.estimate.phases`: the phases of one iteration, traced;
- :mod:`~flowrl.estimate.counts`: the plan's forwards, decodes and training rows per iteration;
- :mod:`~flowrl.estimate.static`: weights of reward models and explorer copies, tensor bytes, prompt counts;
- :mod:`~flowrl.estimate.sharding`: what one process holds under FSDP2 (``model.shard: fsdp``) and its gathers;
- :mod:`~flowrl.estimate.report`: the CLI arguments and the markdown summary.
"""
from __future__ import annotations

import json
import math

import torch

from flowrl.config import build
from flowrl.errors import ConfigError
from flowrl.estimate.archs import (
    ARCH_CACHE,
    ARCH_DIR,
    add_lora,
    arch_for_model,
    arch_from_folder,
    arch_from_pipeline,
    build_transformer,
    build_vae,
    default_lora_targets,
    list_archs,
    load_arch,
    model_with_lora,
    text_encoder_params,
)
from flowrl.estimate.autocast import MetaAutocast
from flowrl.estimate.counts import iteration_counts
from flowrl.estimate.gpus import GPUS, UTILISATION, GPUClass, assume_gpu, gpu_class, load_config
from flowrl.estimate.inputs import (
    EDIT_FAMILIES,
    Shapes,
    base_family,
    preset_shapes,
    transformer_inputs,
    velocity,
    vision_tokens,
)
from flowrl.estimate.phases import phase_traces
from flowrl.estimate.report import add_estimate_arguments, format_estimate
from flowrl.estimate.sharding import ASSUMPTION as SHARDING_ASSUMPTION
from flowrl.estimate.sharding import fsdp_transients, held_bytes, shard_mode, sharded_update_traces
from flowrl.estimate.static import (
    REWARD_MODELS,
    explorer_bytes,
    host_decode_bytes,
    prompt_count,
    reward_model_bytes,
    tensor_bytes,
)
from flowrl.estimate.trace import LiveBytes, Trace, fused_attention, trace
from flowrl.models.dtypes import DTYPES

__all__ = [
    "ARCH_DIR", "ASSUMPTIONS", "EDIT_FAMILIES", "GPUClass", "GPUS", "GUIDANCE_DEFAULT", "GiB", "SEQ_DEFAULT",
    "VIDEO_FAMILIES", "LiveBytes", "MetaAutocast", "REWARD_MODELS", "Shapes", "Trace",
    "UTILISATION", "add_estimate_arguments", "add_lora", "arch_for_model", "arch_from_folder", "arch_from_pipeline",
    "assume_gpu", "base_family", "build_transformer", "build_vae", "default_lora_targets", "estimate", "explorer_bytes",
    "format_estimate", "fsdp_transients", "fused_attention", "gpu_class", "held_bytes", "iteration_counts",
    "list_archs", "load_arch", "load_config", "preset_shapes", "run_estimate", "shard_mode",
    "sharded_update_traces", "text_encoder_params", "trace", "transformer_inputs", "velocity", "vision_tokens",
]

GiB = 2 ** 30

# per-family tables: the adapters' defaults (flowrl/models/<family>.py); an edit family reads its base family's
SEQ_DEFAULT = {"sd3": 16, "flux": 16, "sana": 300, "qwen_image": 512, "flux2": 512, "wan": 512}
"""``max_sequence_length`` when neither the config nor the architecture sets it."""
GUIDANCE_DEFAULT = {"sd3": 1.0, "flux": 3.5, "sana": 4.5, "qwen_image": 4.0, "flux2": 4.0, "wan": 5.0}
"""``guidance`` when the config sets none (Qwen-Image: true_cfg_scale; FLUX/FLUX.2: the distilled embedding)."""
GUIDANCE_DISTILLED = ("flux", "flux2")
"""Families whose ``guidance`` is an embedding, not a CFG branch."""
MASKED_TEXT = ("sana", "qwen_image")
"""Families caching an int64 text attention mask with each prompt."""
VIDEO_FAMILIES = ("wan",)
"""Families whose latent is a video [C, F, h, w] (``model.kwargs.num_frames``)."""

ASSUMPTIONS = [
    "activations: the live bytes of the diffusers transformer's own forward/backward traced on the meta device at "
    "the preset's shapes, attention as a fused kernel (memory-efficient/flash: no L×L matrix kept)",
    "dtypes as training holds them: the transformer in model.dtype with fp32 LoRA (and fp32 gradients, AdamW state, "
    "EMA, old-policy adapter); full fine-tuning: fp32 master weights (and fp32 frozen copies) computing under "
    "autocast in model.dtype, its casts and weight cache applied to the traced meta tensors; no autocast for LoRA "
    "(a launch with accelerate's mixed_precision would add it)",
    "memory is what torch.cuda.max_memory_allocated reports; the CUDA context (~0.5 GiB) and the caching "
    "allocator's fragmentation (typically 5–15 %) come on top (reserved > allocated)",
    f"time: FLOPs counted by torch's FlopCounterMode on the same ops (matmuls, convolutions, attention) at "
    f"{UTILISATION[0]:.0%}–{UTILISATION[1]:.0%} of the GPU's dense bf16 peak; elementwise ops, the host loop, "
    "reward models, text encoding (cached per prompt) and data movement are not timed",
    "an fp8 explorer runs its previews at the GPU's fp8/bf16 peak ratio (2 on Hopper/Ada); nvfp4 on Hopper/Ada is "
    "weight-only (bf16 activations): no speed-up; int8/nf4 explorers: none assumed",
    "reward model weights: approximate parameter counts (REWARD_MODELS), fp16 on the GPU",
    "one process per GPU; prompts.per_step is split evenly over the processes",
    SHARDING_ASSUMPTION,
    "model.offload_encoders: the text encoders in CPU memory, back on the device for an encode phase of their "
    "weights (the encoding's own activations are not counted)",
]


def estimate(cfg, gpu: str = "H100", processes: int = 1, arch: dict | None = None, target: str = "cuda",
             shard: str | None = None) -> dict:
    """Predicted peak memory and s/iteration of one iteration of ``cfg`` (a :class:`~flowrl.config.schema.TrainConfig`)
    on one ``gpu`` of ``processes`` (prompt groups split evenly), without allocating model memory.

    ``shard``: ``ddp`` (every process a whole copy) or ``fsdp`` (FSDP2: the transformer's weights, LoRA,
    gradients, AdamW state, EMA and copies split over the processes, plus its gathers; at least 2 processes);
    default ``cfg.model.shard`` (``auto`` resolved as a run here would). Memory is per process (per GPU).

    ``arch``: the model's architecture (default: :func:`arch_for_model` of ``cfg.model``; e.g.
    :func:`arch_from_pipeline` for an in-memory pipeline). ``target``: ``cuda`` (fused GPU attention, foreach
    AdamW) or ``cpu`` (the kernels torch picks on a CPU, for comparing with a CPU run).

    Returns a dict: ``architecture`` (parameters, trainable, LoRA layers), ``shapes``, ``counts`` (per
    iteration and process), ``memory_gib`` (every part, ``peak`` = static + the largest phase, and the peak
    with and without gradient checkpointing), ``flops`` and ``time`` (``seconds_per_iteration`` [low, high]
    at the assumed utilisation range), ``assumptions``.
    """
    if processes < 1 or cfg.prompts.per_step % processes:
        raise ConfigError(f"prompts.per_step={cfg.prompts.per_step} must be divisible by the processes ({processes})")
    if target not in ("cuda", "cpu"):
        raise ValueError(f"target must be 'cuda' or 'cpu'; got {target!r}")
    gpu_spec = gpu_class(gpu)
    m = cfg.model
    shard = shard_mode(cfg, shard, processes)
    shards = processes if shard == "fsdp" else 1  # each sharded tensor held 1/shards per process
    arch = arch or arch_for_model(m)
    ARCH_CACHE[arch["key"]] = arch
    family = arch["family"]
    dtype = DTYPES[m.dtype]
    dbytes = torch.empty(0, dtype=dtype).element_size()
    defaults = arch.get("defaults", {})

    # ---- shapes and guidance ----
    t_config = arch["transformer"]["config"]
    default_px = arch["text"].get("default_image_size") or int(t_config.get("sample_size", 64)) * int(arch["vae"]["scale_factor"])
    height = int(m.height or defaults.get("height") or default_px)
    width = int(m.width or defaults.get("width") or default_px)
    max_seq = int(m.max_sequence_length or defaults.get("max_sequence_length") or SEQ_DEFAULT[base_family(family)])
    frames = int(m.kwargs.get("num_frames") or defaults.get("num_frames", 81)) if family in VIDEO_FAMILIES else None
    shapes = preset_shapes(arch, height, width, max_seq, frames)
    with assume_gpu(gpu):  # an explorer backend is checked against the named GPU, not this machine
        plan = build.build_plan(cfg.rollout)
    objective = build.build_loss(cfg)
    guidance_default = defaults.get("guidance_scale", GUIDANCE_DEFAULT[base_family(family)])
    rollout_guidance = objective.rollout_guidance(m.guidance)
    guidance = float(guidance_default if rollout_guidance is None else rollout_guidance)
    if family in GUIDANCE_DISTILLED:  # the guidance value is an embedding: FLUX's CFG is true_cfg, FLUX.2's none
        cfg_on = family == "flux" and float(m.true_cfg or 1.0) != 1.0
    else:
        cfg_on = guidance != 1.0
    cfg_rows = 2 if cfg_on else 1

    # ---- the model on the meta device, its parameters in the dtypes training holds: the base in model.dtype and
    # fp32 LoRA, or full fine-tuning's fp32 master weights (so gradients, AdamW state, EMA and copies are fp32) ----
    lora = None if m.full_finetune else (int(m.lora.rank), float(m.lora.alpha),
                                         tuple(m.lora.targets or default_lora_targets(family)), m.lora.init)
    module, lora_layers = model_with_lora(arch["key"], m.dtype, lora)
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    n_base = sum(p.numel() for n, p in module.named_parameters() if "lora_" not in n)
    n_trainable = sum(p.numel() for p in trainable)
    trainable_bytes = held_bytes(trainable, shards)
    buffer_bytes = tensor_bytes(module.buffers())  # replicated under FSDP2 too
    base_bytes = held_bytes((p for n, p in module.named_parameters() if "lora_" not in n), shards)
    weight_bytes = held_bytes(params, shards) + buffer_bytes
    full_copy = base_bytes + buffer_bytes
    encoders = text_encoder_params(arch)
    vae = build_vae(arch, dtype)
    vae_params = sum(p.numel() for p in vae.parameters())

    # ---- work per iteration ----
    P = cfg.prompts.per_step // processes
    counts = iteration_counts(plan, objective, P, cfg.train.max_steps, cfg.train.seed)
    max_batch = int(cfg.rollout.max_batch)
    policy = objective.trains_on == "edges"
    if policy:
        train_cfg = cfg_on
        update_states = max_batch
    else:
        train_cfg = cfg_on and getattr(objective, "cfg", "free") == "guided"
        draws = int(getattr(objective, "draws", 1))
        update_states = max(1, max_batch // draws) * draws
    update_states = max(1, min(update_states, int(max(counts["train_rows"], 1))))
    rollout_states = max(1, min(max_batch, int(max(counts["forwards"], 1))))

    # ---- traced phases (cached: presets sharing a model, shapes and batch layout share them) ----
    before = () if policy else ("old",) + (("reference",) if getattr(objective, "kl_ref", 0) > 0 else ())
    after = ("reference",) if policy and getattr(objective, "kl_ref", 0) > 0 else ()
    trace_args = (arch["key"], m.dtype, lora, shapes, rollout_states, cfg_on, update_states, train_cfg, before, after,
                  bool(counts["explore_forwards"]), bool(cfg.optim.use_8bit), target)
    # FSDP2: the weights gathered in model.dtype, a block's gradients reduce-scattered and freed as backward leaves
    # it (fsdp["update"] below)
    traces = phase_traces(*trace_args, shards > 1)
    t_rollout, t_explore, t_decode, t_optim = (traces[k] for k in ("rollout", "explore", "decode", "optimizer"))
    updates = {False: traces["update"], True: traces["update_checkpointed"]}

    # ---- static memory ----
    reward_bytes, reward_notes = reward_model_bytes(cfg)
    grads = trainable_bytes
    optim_bytes = 2 * held_bytes(trainable, shards, itemsize=1) if cfg.optim.use_8bit else 2 * trainable_bytes
    ema = trainable_bytes if cfg.train.ema > 0 else 0
    old = (trainable_bytes if lora is not None else full_copy) if not policy else 0
    wants_reference = getattr(objective, "kl_ref", 0) > 0
    reference = full_copy if wants_reference and lora is None else 0
    explorer = explorer_bytes(module, plan.backend, plan.min_params, plan.skip) if hasattr(plan, "backend") else 0
    encoder_bytes = sum(encoders.values()) * dbytes
    vae_bytes = tensor_bytes(vae.parameters())
    offloaded = encoder_bytes if m.offload_encoders else 0  # text encoders in CPU memory between uses
    static = (weight_bytes + encoder_bytes - offloaded + vae_bytes + optim_bytes + ema + old + reference + explorer
              + reward_bytes)

    # per prompt: the cached conditioning on the device (prompt_embeds [L, D] and pooled / mask; an edit model's
    # packed source latent [source_tokens, in_channels])
    text_dim = t_config.get("joint_attention_dim") or t_config.get("caption_channels") or t_config.get("text_dim") or 0
    pooled = t_config.get("pooled_projection_dim") or 0
    mask = shapes.text_tokens * 8 if base_family(family) in MASKED_TEXT else 0  # int64 attention mask
    source = shapes.source_tokens * int(t_config.get("in_channels", 0))
    per_prompt = (shapes.text_tokens * text_dim + pooled + source) * dbytes + mask
    cache_now = (P + 1) * per_prompt
    distinct = min(cfg.train.max_steps * P, prompt_count(cfg.prompts.train) or cfg.train.max_steps * P)
    eval_prompts = prompt_count(cfg.prompts.eval) if cfg.prompts.eval else 0
    if cfg.eval.num_prompts:
        eval_prompts = min(eval_prompts or cfg.eval.num_prompts, cfg.eval.num_prompts)
    cache_end = (distinct + eval_prompts + 1) * per_prompt
    if cfg.model.prompt_cache_mb is not None:  # LRU-bounded between batches; one batch's prompts on top
        cache_end = min(cache_end, cfg.model.prompt_cache_mb * 2 ** 20 + cache_now)
    forest_bytes = int(counts["forwards"] + counts["leaves"]) * math.prod(shapes.latent) * 4  # fp32 node latents

    fsdp = fsdp_transients(module, dbytes, m.shard_rollouts == "whole") if shards > 1 else \
        dict.fromkeys(("gather", "rollout", "reduce_scatter", "update"), 0)
    optim_transient = t_optim.peak // shards  # foreach AdamW's temporaries scale with the (sharded) state
    decode_peak = t_decode.peak
    if target == "cpu":  # the decoded pixels of a whole decode call stay in host memory: a CPU's device memory
        states = math.ceil(max(counts["scored"], counts["pool"]) / max(1, min(int(cfg.rollout.chunks), P)))
        pixels = 3 * height * width * (frames or 1) * 4  # fp32 images (videos: every frame)
        decode_peak = host_decode_bytes(t_decode.peak, states, rollout_states, pixels, math.prod(shapes.latent) * 4)
    phases = {
        "rollout": t_rollout.peak + fsdp["rollout"],
        "decode": decode_peak,
        "encode": offloaded,  # offloaded text encoders back on the device for the new prompts (activations small)
        "update": grads + updates[bool(m.gradient_checkpointing)].peak + fsdp["update"],
        "optimizer_step": grads + optim_transient,
    }
    host = forest_bytes if target == "cpu" else 0
    peak_phase = max(phases, key=phases.get)
    peak = static + cache_now + host + phases[peak_phase]

    def peak_with(checkpointing: bool) -> float:
        other = dict(phases, update=grads + updates[checkpointing].peak + fsdp["update"])
        return (static + cache_now + host + max(other.values())) / GiB

    # ---- FLOPs and time ----
    f_row = t_rollout.flops / (rollout_states * cfg_rows)
    f_explore_row = t_explore.flops / (rollout_states * cfg_rows)
    f_decode = t_decode.flops / rollout_states
    upd = updates[bool(m.gradient_checkpointing)]
    train_rows_per_trace = update_states * (2 if train_cfg else 1)
    f_train_row = upd.flops / train_rows_per_trace
    epochs = int(cfg.train.inner_epochs)
    flops = {
        "rollout": counts["forwards"] * cfg_rows * f_row,
        "explore": counts["explore_forwards"] * cfg_rows * f_explore_row,
        "decode": counts["decodes"] * f_decode,
        "update": counts["train_rows"] * (2 if train_cfg else 1) * f_train_row * epochs,
    }
    speed = {k: 1.0 for k in flops}
    if getattr(plan, "backend", "same") == "fp8":
        speed["explore"] = gpu_spec.fp8_speedup
    effective = sum(flops[k] / speed[k] for k in flops)
    peak_flops = gpu_spec.bf16_tflops * 1e12
    seconds = [effective / (peak_flops * UTILISATION[1]), effective / (peak_flops * UTILISATION[0])]
    split = {k: [flops[k] / speed[k] / (peak_flops * u) for u in (UTILISATION[1], UTILISATION[0])] for k in flops}

    memory = {
        "sharded_over": shards,
        "transformer_weights": base_bytes / GiB,
        "transformer_buffers": buffer_bytes / GiB,
        "lora": (trainable_bytes if lora is not None else 0) / GiB,
        "text_encoders": (0 if offloaded else encoder_bytes) / GiB,
        "vae": vae_bytes / GiB,
        "offloaded_to_cpu": offloaded / GiB,
        "reward_models": reward_bytes / GiB,
        "gradients": grads / GiB,
        "optimizer_state": optim_bytes / GiB,
        "ema": ema / GiB,
        "old_policy": old / GiB,
        "reference": reference / GiB,
        "explorer": explorer / GiB,
        "prompt_cache": cache_now / GiB,
        "activations_rollout": t_rollout.peak / GiB,
        "activations_decode": decode_peak / GiB,
        "activations_update": updates[bool(m.gradient_checkpointing)].peak / GiB,
        "activations_update_without_checkpointing": updates[False].peak / GiB,
        "activations_update_with_checkpointing": updates[True].peak / GiB,
        "optimizer_step_transient": optim_transient / GiB,
        "fsdp_gather": fsdp["gather"] / GiB,
        "fsdp_gather_rollout": fsdp["rollout"] / GiB,
        "fsdp_reduce_scatter": fsdp["reduce_scatter"] / GiB,
        "static": static / GiB,
        "dynamic": (host + phases[peak_phase]) / GiB,
        "peak": peak / GiB,
        "peak_phase": peak_phase,
        "peak_without_gradient_checkpointing": peak_with(False),
        "peak_with_gradient_checkpointing": peak_with(True),
        "gpu_memory": gpu_spec.memory_gib,
        "fits": bool(peak / GiB <= gpu_spec.memory_gib),
        "prompt_cache_per_prompt_mib": per_prompt / 2 ** 20,
        "prompt_cache_end_of_run": cache_end / GiB,
        "peak_end_of_run": (peak - cache_now + cache_end) / GiB,
        "host_forest": forest_bytes / GiB,
    }
    return {
        "model": arch["name"], "family": family, "gpu": gpu_spec.name, "processes": processes, "target": target,
        "shard": shard, "shard_rollouts": m.shard_rollouts if shards > 1 else None,
        "offload_encoders": bool(m.offload_encoders),
        "architecture": {"transformer_params": n_base, "trainable_params": n_trainable, "lora_layers": lora_layers,
                         "lora_targets": list(lora[2]) if lora else None, "full_finetune": lora is None,
                         "text_encoder_params": encoders, "vae_params": vae_params, "dtype": m.dtype,
                         "trainable_dtype": str(trainable[0].dtype).replace("torch.", "") if trainable else None,
                         "autocast": m.dtype if lora is None and dtype != torch.float32 else None},
        "shapes": {"height": shapes.height, "width": shapes.width, "latent": list(shapes.latent),
                   "image_tokens": shapes.image_tokens, "source_tokens": shapes.source_tokens,
                   "text_tokens": shapes.text_tokens, "cfg": cfg_on,
                   "guidance": guidance, "rollout_rows": rollout_states * cfg_rows,
                   "update_rows": train_rows_per_trace, "max_batch": max_batch,
                   "gradient_checkpointing": bool(m.gradient_checkpointing)},
        "counts": {**counts, "prompts_per_process": P, "inner_epochs": epochs},
        "memory_gib": memory,
        "flops": {**flops, "total": sum(flops.values()), "per_rollout_row": f_row, "per_update_row": f_train_row,
                  "per_decode": f_decode},
        "time": {"seconds_per_iteration": seconds, "split_seconds": split, "gpu_bf16_tflops": gpu_spec.bf16_tflops,
                 "utilisation": list(UTILISATION), "explorer_speedup": speed["explore"]},
        "assumptions": ASSUMPTIONS + reward_notes,
    }


def run_estimate(config: str | None, overrides: list[str], gpu: str = "H100", processes: int = 1,
                 shard: str | None = None) -> int:
    """``flowrl bench CONFIG --estimate [--gpus N] [--shard fsdp]``: print the table and the JSON of
    :func:`estimate` (``shard`` None: the config's ``model.shard``)."""
    cfg = load_config(config, overrides, gpu)
    with assume_gpu(gpu):
        result = estimate(cfg, gpu=gpu, processes=processes, shard=shard)
    print(format_estimate(result))
    print(json.dumps(result, indent=2, default=float))
    return 0
