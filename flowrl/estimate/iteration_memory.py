"""The memory of one iteration (:func:`~flowrl.estimate.iteration.estimate`'s parts): the model on the meta device,
the static memory, the prompt cache, the phases' peaks, and the architecture and memory reports."""

from __future__ import annotations

import math

import torch

from flowrl.estimate.archs import build_vae, default_lora_targets, model_with_lora, text_encoder_params
from flowrl.estimate.gpus import GPUClass
from flowrl.estimate.inputs import Shapes
from flowrl.estimate.sharding import fsdp_transients, held_bytes
from flowrl.estimate.static import explorer_bytes, host_decode_bytes, prompt_count, reward_model_bytes, tensor_bytes
from flowrl.models.blocks import block_lists, checkpointed_of
from flowrl.models.dtypes import DTYPES
from flowrl.models.estimate_spec import base_spec

GiB = 2**30


def model_on_meta(cfg, arch: dict, shards: int) -> dict:
    """The transformer on the meta device with its parameters in the dtypes training holds (the base in model.dtype
    and fp32 LoRA, or full fine-tuning's fp32 master weights) and the byte counts of its parts per process."""
    m = cfg.model
    dtype = DTYPES[m.dtype]
    lora = (
        None
        if m.full_finetune
        else (
            int(m.lora.rank),
            float(m.lora.alpha),
            tuple(m.lora.targets or default_lora_targets(arch["family"])),
            m.lora.init,
        )
    )
    module, lora_layers = model_with_lora(arch["key"], m.dtype, lora)
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    base = [p for n, p in module.named_parameters() if "lora_" not in n]
    adapters = [p for n, p in module.named_parameters() if "lora_" in n]
    # Wan 2.2 A14B: a second expert of the same architecture (``transformer_2``) held beside the first, trained too
    # unless model.experts names one; each row runs on one expert, so the traces and FLOPs are one expert's
    held = 2 if arch.get("transformer_2") else 1
    trained = 1 if held == 1 or m.experts in ("high", "low") else 2
    buffer_bytes = held * tensor_bytes(module.buffers())  # replicated under FSDP2 too
    base_bytes = held * held_bytes(base, shards)
    trainable_bytes = trained * held_bytes(trainable, shards)
    vae = build_vae(arch, dtype)
    return {
        "module": module,
        "held": held,
        "lora": lora,
        "lora_layers": trained * lora_layers,
        "trainable": trainable,
        "dtype": dtype,
        "dbytes": torch.empty(0, dtype=dtype).element_size(),
        "n_base": held * sum(p.numel() for p in base),
        "n_trainable": trained * sum(p.numel() for p in trainable),
        "trainable_bytes": trainable_bytes,
        "buffer_bytes": buffer_bytes,
        "base_bytes": base_bytes,
        "weight_bytes": base_bytes + trained * held_bytes(adapters, shards) + buffer_bytes,
        "full_copy": base_bytes + buffer_bytes,
        "encoders": text_encoder_params(arch),
        "vae_bytes": tensor_bytes(vae.parameters()),
        "vae_params": sum(p.numel() for p in vae.parameters()),
    }


def checkpointed_blocks(cfg, model: dict) -> int:
    """Blocks of the traced transformer the update checkpoints when ``model.gradient_checkpointing`` is on:
    ``model.checkpoint_blocks`` (None: every block), at most the blocks there are, as a run counts them (both experts'
    of a two-expert model) and says it (:func:`flowrl.models.blocks.checkpointed_of`)."""
    module = model["module"]
    blocks = len(block_lists(module))
    count = checkpointed_of(cfg.model.checkpoint_blocks, model["held"] * blocks, type(module).__name__)
    return min(count, blocks)


def static_memory(cfg, plan, objective, model: dict, arch: dict, shards: int, teacher=None) -> dict:
    """Bytes held through the iteration: weights, encoders, VAE, gradients, AdamW state, EMA, the objective's frozen
    copies, its guided teacher's (``teacher``: a :class:`~flowrl.estimate.teacher.TeacherPrice`, None without one; 0
    when it shares the reference's copy; ``teacher_own``: its own copy, what a rollout process holds when
    ``rollout.teacher_share`` lets it draw), an explorer copy, the reward models."""
    reward_bytes, reward_notes = reward_model_bytes(cfg)
    trainable_bytes, lora = model["trainable_bytes"], model["lora"]
    optim_bytes = 2 * held_bytes(model["trainable"], shards, itemsize=1) if cfg.optim.use_8bit else 2 * trainable_bytes
    ema = trainable_bytes if cfg.train.ema > 0 else 0
    copies = objective.describe().frozen_copies
    old = (trainable_bytes if lora is not None else model["full_copy"]) if "old" in copies else 0
    reference = model["full_copy"] if "reference" in copies and lora is None else 0
    teacher_bytes = teacher.held_bytes(model) if teacher is not None else 0
    explorer_spec = plan.explorer_spec()
    explorer = explorer_bytes(model["module"], *explorer_spec) if explorer_spec is not None else 0
    encoder_bytes = sum(model["encoders"].values()) * model["dbytes"]
    offloaded = encoder_bytes if cfg.model.offload_encoders else 0  # text encoders in CPU memory between uses
    total = (
        model["weight_bytes"]
        + encoder_bytes
        - offloaded
        + model["vae_bytes"]
        + optim_bytes
        + ema
        + old
        + reference
        + teacher_bytes
        + explorer
        + reward_bytes
    )
    return {
        "reward_bytes": reward_bytes,
        "reward_notes": reward_notes,
        "grads": trainable_bytes,
        "optim_bytes": optim_bytes,
        "ema": ema,
        "old": old,
        "reference": reference,
        "teacher": teacher_bytes,
        # a rollout process's: its own copy (no reference there to share), when the plan lets the teacher draw
        "teacher_own": teacher.own_bytes(model) if teacher is not None and plan.teacher_share else 0,
        "explorer": explorer,
        "encoder_bytes": encoder_bytes,
        "offloaded": offloaded,
        "total": total,
    }


def prompt_cache_bytes(cfg, arch: dict, shapes: Shapes, dbytes: int, P: int) -> dict:
    """The cached conditioning per prompt on the device (prompt_embeds [L, D] and pooled / mask; an edit model's packed
    source latent [source_tokens, in_channels]), now and at the end of the run (every distinct prompt drawn)."""
    t_config, family = arch["transformer"]["config"], arch["family"]
    text_dim = (
        t_config.get("joint_attention_dim")
        or t_config.get("caption_channels")
        or t_config.get("text_dim")
        or t_config.get("context_in_dim")
        or 0
    )
    pooled = t_config.get("pooled_projection_dim") or 0
    mask = shapes.text_tokens * 8 if base_spec(family).masked_text else 0  # int64 attention mask
    source = shapes.source_tokens * int(t_config.get("in_channels", 0))
    per_prompt = (shapes.text_tokens * text_dim + pooled + source) * dbytes + mask
    cache_now = (P + 1) * per_prompt
    distinct = min(cfg.train.max_steps * P, prompt_count(cfg.prompts.train) or cfg.train.max_steps * P)
    eval_prompts = prompt_count(cfg.prompts.eval) if cfg.prompts.eval else 0
    if cfg.eval.num_prompts:
        eval_prompts = min(eval_prompts or cfg.eval.num_prompts, cfg.eval.num_prompts)
    cache_end = (distinct + eval_prompts + 1) * per_prompt
    if cfg.model.prompt_cache_mb is not None:  # LRU-bounded between batches; one batch's prompts on top
        cache_end = min(cache_end, cfg.model.prompt_cache_mb * 2**20 + cache_now)
    return {"per_prompt": per_prompt, "now": cache_now, "end": cache_end}


def phase_peaks(
    cfg,
    model: dict,
    traces: dict,
    static: dict,
    cache: dict,
    work: dict,
    shapes: Shapes,
    frames: int | None,
    target: str,
    shards: int,
    P: int,
) -> dict:
    """Each phase's transient bytes on top of the static ones, the peak phase and the peak (with and without gradient
    checkpointing); a CPU run also holds the forest's latents and a decode's pixels in host memory."""
    m, counts = cfg.model, work["counts"]
    fsdp = (
        fsdp_transients(model["module"], model["dbytes"], m.shard_rollouts == "whole")
        if shards > 1
        else dict.fromkeys(("gather", "rollout", "reduce_scatter", "update"), 0)
    )
    optim_transient = traces["optimizer"].peak // shards  # foreach AdamW's temporaries scale with the (sharded) state
    decode_peak = traces["decode"].peak
    if target == "cpu":  # the decoded pixels of a whole decode call stay in host memory: a CPU's device memory
        states = math.ceil(max(counts["scored"], counts["pool"]) / max(1, min(int(cfg.rollout.chunks), P)))
        pixels = 3 * shapes.height * shapes.width * (frames or 1) * 4  # fp32 images (videos: every frame)
        decode_peak = host_decode_bytes(
            traces["decode"].peak, states, work["rollout_states"], pixels, math.prod(shapes.latent) * 4
        )
    grads, updates = static["grads"], traces["updates"]
    rollout_peak = max(traces["rollout"].peak, traces["teacher_rollout"].peak if "teacher_rollout" in traces else 0)
    phases = {
        "rollout": rollout_peak + fsdp["rollout"],  # the policy's forward or a sampling teacher's at its CFG
        "decode": decode_peak,
        "encode": static["offloaded"],  # offloaded text encoders back on the device for the new prompts
        "update": grads + updates[bool(m.gradient_checkpointing)].peak + fsdp["update"],
        "optimizer_step": grads + optim_transient,
    }
    forest_bytes = int(counts["forwards"] + counts["leaves"]) * math.prod(shapes.latent) * 4  # fp32 node latents
    host = forest_bytes if target == "cpu" else 0
    peak_phase = max(phases, key=phases.get)

    def peak_with(checkpointing: bool) -> float:
        other = dict(phases, update=grads + updates[checkpointing].peak + fsdp["update"])
        return (static["total"] + cache["now"] + host + max(other.values())) / GiB

    return {
        "phases": phases,
        "peak_phase": peak_phase,
        "host": host,
        "forest_bytes": forest_bytes,
        "fsdp": fsdp,
        "decode_peak": decode_peak,
        "rollout_peak": rollout_peak,
        "optim_transient": optim_transient,
        "peak": static["total"] + cache["now"] + host + phases[peak_phase],
        "peak_without": peak_with(False),
        "peak_with": peak_with(True),
    }


def architecture_report(cfg, model: dict) -> dict:
    m, lora, trainable = cfg.model, model["lora"], model["trainable"]
    return {
        "transformer_params": model["n_base"],
        "trainable_params": model["n_trainable"],
        "lora_layers": model["lora_layers"],
        "lora_targets": list(lora[2]) if lora else None,
        "full_finetune": lora is None,
        "text_encoder_params": model["encoders"],
        "vae_params": model["vae_params"],
        "dtype": m.dtype,
        "trainable_dtype": str(trainable[0].dtype).replace("torch.", "") if trainable else None,
        "autocast": m.dtype if lora is None and model["dtype"] != torch.float32 else None,
    }


def memory_report(
    cfg, gpu_spec: GPUClass, model: dict, static: dict, cache: dict, traces: dict, phases: dict, shards: int
) -> dict:
    """Every part of the memory in GiB, the peak and its phase, and whether it fits the GPU."""
    updates, peak = traces["updates"], phases["peak"]
    parts = {
        "sharded_over": shards,
        "transformer_weights": model["base_bytes"] / GiB,
        "transformer_buffers": model["buffer_bytes"] / GiB,
        "lora": (model["trainable_bytes"] if model["lora"] is not None else 0) / GiB,
        "text_encoders": (0 if static["offloaded"] else static["encoder_bytes"]) / GiB,
        "vae": model["vae_bytes"] / GiB,
        "offloaded_to_cpu": static["offloaded"] / GiB,
        "reward_models": static["reward_bytes"] / GiB,
        "gradients": static["grads"] / GiB,
        "optimizer_state": static["optim_bytes"] / GiB,
        "ema": static["ema"] / GiB,
        "old_policy": static["old"] / GiB,
        "reference": static["reference"] / GiB,
        "teacher": static["teacher"] / GiB,  # 0: shares the reference's copy, or the base under LoRA
        "teacher_own_copy": static["teacher_own"] / GiB,  # a rollout process's (rollout.teacher_share > 0)
        "explorer": static["explorer"] / GiB,
        "prompt_cache": cache["now"] / GiB,
        "activations_rollout": phases["rollout_peak"] / GiB,
        "activations_decode": phases["decode_peak"] / GiB,
        "activations_update": updates[bool(cfg.model.gradient_checkpointing)].peak / GiB,
        "activations_update_without_checkpointing": updates[False].peak / GiB,
        "activations_update_with_checkpointing": updates[True].peak / GiB,
        "optimizer_step_transient": phases["optim_transient"] / GiB,
        "fsdp_gather": phases["fsdp"]["gather"] / GiB,
        "fsdp_gather_rollout": phases["fsdp"]["rollout"] / GiB,
        "fsdp_reduce_scatter": phases["fsdp"]["reduce_scatter"] / GiB,
        "static": static["total"] / GiB,
        "dynamic": (phases["host"] + phases["phases"][phases["peak_phase"]]) / GiB,
        "peak": peak / GiB,
        "peak_phase": phases["peak_phase"],
        "peak_without_gradient_checkpointing": phases["peak_without"],
        "peak_with_gradient_checkpointing": phases["peak_with"],
        "gpu_memory": gpu_spec.memory_gib,
        "fits": bool(peak / GiB <= gpu_spec.memory_gib),
        "prompt_cache_per_prompt_mib": cache["per_prompt"] / 2**20,
        "prompt_cache_end_of_run": cache["end"] / GiB,
        "peak_end_of_run": (peak - cache["now"] + cache["end"]) / GiB,
        "host_forest": phases["forest_bytes"] / GiB,
        "base": (static["total"] + cache["now"] + phases["host"]) / GiB,  # held through the iteration: peak − phase
        "phases": {k: v / GiB for k, v in phases["phases"].items()},  # each phase's transient bytes on top of base
    }
    return parts
