"""One iteration's predicted memory and time (:func:`estimate`), in parts: the preset's shapes and guidance, the model
on the meta device, the work per iteration (from what the plan and the objective declare), the traced phases, the
static memory, the prompt cache, the phases' peaks, FLOPs and time, and the report (docs/estimate.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from flowrl.config import build
from flowrl.distributed.sharding import check_sharded_objective
from flowrl.estimate.archs import (
    ARCH_CACHE,
    arch_for_model,
    build_vae,
    default_lora_targets,
    model_with_lora,
    text_encoder_params,
)
from flowrl.estimate.context_parallel import ASSUMPTION as CONTEXT_ASSUMPTION
from flowrl.estimate.context_parallel import context_split, split_traces
from flowrl.estimate.counts import iteration_counts
from flowrl.estimate.gpus import UTILISATION, GPUClass, assume_gpu, gpu_class
from flowrl.estimate.inputs import Shapes, preset_shapes, with_sources
from flowrl.estimate.phases import phase_traces
from flowrl.estimate.pipeline import price_pipeline, trainers_of
from flowrl.estimate.run_checks import check_model_options, check_processes
from flowrl.estimate.sharding import ASSUMPTION as SHARDING_ASSUMPTION
from flowrl.estimate.sharding import fsdp_transients, held_bytes, shard_mode
from flowrl.estimate.static import explorer_bytes, host_decode_bytes, prompt_count, reward_model_bytes, tensor_bytes
from flowrl.models import MODEL_FAMILIES, model_family
from flowrl.models.blocks import block_lists, checkpointed_of
from flowrl.models.dtypes import DTYPES
from flowrl.models.estimate_spec import adapter_default, adapter_spec, base_spec, estimate_spec

GiB = 2**30


class _AdapterDefaults(Mapping):
    """Family → the default of one keyword of its adapter's constructor (read from its signature, or the spec's
    ``defaults`` where that says None: :func:`flowrl.models.estimate_spec.adapter_default`), for every registered
    family whose adapter declares an estimate spec."""

    def __init__(self, keyword: str):
        self.keyword = keyword

    def __getitem__(self, family: str):
        return adapter_default(family, self.keyword)

    def _families(self) -> list[str]:
        return [f for f in MODEL_FAMILIES if adapter_spec(model_family(f).adapter_class()) is not None]

    def __iter__(self):
        return iter(self._families())

    def __len__(self) -> int:
        return len(self._families())


SEQ_DEFAULT = _AdapterDefaults("max_sequence_length")
"""``max_sequence_length`` when neither the config nor the architecture sets it: the adapter's default."""
GUIDANCE_DEFAULT = _AdapterDefaults("guidance")
"""``guidance`` when the config sets none: the adapter's default (Qwen-Image: true_cfg_scale, 2.1: none; FLUX/FLUX.2:
the distilled embedding)."""

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
    f"{UTILISATION[0]:.0%}–{UTILISATION[1]:.0%} of the GPU's bf16 peak (the one perf/mfu divides by: measured where "
    "known, H100 798 and H200 788 TFLOP/s, else the datasheet's dense figure); elementwise ops, the host loop, "
    "reward models, text encoding (cached per prompt) and data movement are not timed",
    "an fp8 explorer runs its previews at the GPU's fp8/bf16 peak ratio (2 on Hopper/Ada); nvfp4 on Hopper/Ada is "
    "weight-only (bf16 activations): no speed-up; int8/nf4 explorers: none assumed",
    "reward model weights: approximate parameter counts (REWARD_MODELS), fp16 on the GPU",
    "one process per GPU; prompts.per_step is split evenly over the processes",
    SHARDING_ASSUMPTION,
    "model.offload_encoders: the text encoders in CPU memory, back on the device for an encode phase of their "
    "weights (the encoding's own activations are not counted)",
]


def estimate(
    cfg, gpu: str = "H100", processes: int = 1, arch: dict | None = None, target: str = "cuda", shard: str | None = None
) -> dict:
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
    at the assumed utilisation range), ``assumptions``. The plan and the objective are asked what they declare
    (:meth:`~flowrl.rollout.base.RolloutPlan.expected_counts`, ``explorer_spec``; the objective's
    :meth:`~flowrl.objectives.base.Objective.describe`), never tested for their type.
    """
    launched = int(cfg.train.rollout_processes) if cfg.train.pipeline == "async" else 0
    processes = trainers_of(processes, launched)  # train.rollout_processes: the trainers share the work
    replicas = check_processes(cfg, processes)  # data replicas (context groups), as the run checks them
    if target not in ("cuda", "cpu"):
        raise ValueError(f"target must be 'cuda' or 'cpu'; got {target!r}")
    gpu_spec = gpu_class(gpu)
    shard = shard_mode(cfg, shard, processes)
    shards = processes if shard == "fsdp" else 1  # each sharded tensor held 1/shards per process
    arch = arch or arch_for_model(cfg.model)
    ARCH_CACHE[arch["key"]] = arch
    check_model_options(cfg, arch)  # what the adapter would refuse when built (model.experts of one transformer, …)
    with assume_gpu(gpu):  # an explorer backend is checked against the named GPU, not this machine
        plan = build.build_plan(cfg.rollout)
    objective = build.build_loss(cfg)
    if shard == "fsdp":
        check_sharded_objective(objective)  # as the run refuses it, before its model loads
    shapes, frames, guidance, cfg_on = _shapes_and_guidance(cfg, arch, objective)
    model = _model_on_meta(cfg, arch, shards)
    degree = context_split(cfg, processes, model["module"], shapes.image_tokens)
    P = cfg.prompts.per_step // replicas
    work = _work(cfg, plan, objective, P, cfg_on)
    traces = split_traces(_traces(cfg, arch, model, objective, shapes, work, cfg_on, target, shards), degree)
    static = _static_memory(cfg, plan, objective, model, arch, shards)
    cache = _prompt_cache(cfg, arch, shapes, model["dbytes"], P)
    phases = _phases(cfg, model, traces, static, cache, work, shapes, frames, target, shards, P)
    flops = _flops_and_time(cfg, plan, gpu_spec, traces, work, cfg_on)
    result = {
        "model": arch["name"],
        "family": arch["family"],
        "gpu": gpu_spec.name,
        "processes": processes,
        "target": target,
        "shard": shard,
        "shard_rollouts": cfg.model.shard_rollouts if shards > 1 else None,
        "context_parallel": degree,
        "offload_encoders": bool(cfg.model.offload_encoders),
        "architecture": _architecture_report(cfg, model),
        "shapes": {
            "height": shapes.height,
            "width": shapes.width,
            "latent": list(shapes.latent),
            "image_tokens": shapes.image_tokens,
            "source_tokens": shapes.source_tokens,
            "text_tokens": shapes.text_tokens,
            "cfg": cfg_on,
            "guidance": guidance,
            "rollout_rows": work["rollout_states"] * (2 if cfg_on else 1),
            "update_rows": work["update_states"] * (2 if work["train_cfg"] else 1),
            "train_cfg": bool(work["train_cfg"]),
            "max_batch": int(cfg.rollout.max_batch),
            "micro_batch": int(objective.micro_batch),
            "gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
            "checkpoint_blocks": _checkpointed(cfg, model) if cfg.model.gradient_checkpointing else 0,
            "blocks": len(block_lists(model["module"])),
        },
        "counts": {**work["counts"], "prompts_per_process": P, "inner_epochs": int(cfg.train.inner_epochs)},
        "memory_gib": _memory_report(cfg, gpu_spec, model, static, cache, traces, phases, shards),
        "flops": flops["flops"],
        "time": flops["time"],
        "assumptions": ASSUMPTIONS + static["reward_notes"] + ([CONTEXT_ASSUMPTION] if degree > 1 else []),
    }
    pipeline = price_pipeline(cfg, result, target)  # train.pipeline=async: the overlap, per-process memory
    if pipeline is not None:
        result["pipeline"] = pipeline
        result["time"] = {**result["time"], "seconds_per_iteration": pipeline["seconds_per_iteration"]}
    return result


def _shapes_and_guidance(cfg, arch: dict, objective) -> tuple[Shapes, int | None, float, bool]:
    """The preset's sizes (image, latent, tokens), a video family's frames (None for images), the rollouts' guidance
    and whether they run CFG (a guidance-distilled family: FLUX's true CFG only)."""
    m, family = cfg.model, arch["family"]
    defaults = arch.get("defaults", {})
    t_config = arch["transformer"]["config"]
    default_px = arch["text"].get("default_image_size") or int(t_config.get("sample_size", 64)) * int(
        arch["vae"]["scale_factor"]
    )
    height = int(m.height or defaults.get("height") or default_px)
    width = int(m.width or defaults.get("width") or default_px)
    max_seq = int(m.max_sequence_length or defaults.get("max_sequence_length") or SEQ_DEFAULT[family])
    video = model_family(family).adapter_class().modality == "video"  # as the family declares it
    frames = int(m.kwargs.get("num_frames") or defaults.get("num_frames", 81)) if video else None
    shapes = preset_shapes(with_sources(arch, m.kwargs), height, width, max_seq, frames)
    guidance_default = defaults.get("guidance_scale", GUIDANCE_DEFAULT[family])
    rollout_guidance = objective.rollout_guidance(m.guidance)
    guidance = float(guidance_default if rollout_guidance is None else rollout_guidance)
    kind = estimate_spec(family).guidance
    if kind != "cfg":  # the guidance value is an embedding: FLUX's CFG is true_cfg, FLUX.2's none
        cfg_on = kind == "true_cfg" and float(m.true_cfg or 1.0) != 1.0
    else:
        cfg_on = guidance != 1.0
    return shapes, frames, guidance, cfg_on


def _model_on_meta(cfg, arch: dict, shards: int) -> dict:
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


def _work(cfg, plan, objective, P: int, cfg_on: bool) -> dict:
    """One iteration's work per process (:func:`iteration_counts`) and the states one rollout forward and one traced
    update hold (a policy objective replays ``max_batch`` states; a forward-process one whole leaves' points)."""
    counts = iteration_counts(plan, objective, P, cfg.train.max_steps, cfg.train.seed)
    max_batch = int(cfg.rollout.max_batch)
    facts = objective.describe()
    per_unit = facts.rows_per_unit
    update_states = max(1, int(facts.micro_batch) // per_unit) * per_unit  # train.micro_batch or max_batch
    return {
        "counts": counts,
        "train_cfg": facts.training_cfg(cfg_on),
        "update_states": max(1, min(update_states, int(max(counts["train_rows"], 1)))),
        "rollout_states": max(1, min(max_batch, int(max(counts["forwards"], 1)))),
    }


def _traces(
    cfg, arch: dict, model: dict, objective, shapes: Shapes, work: dict, cfg_on: bool, target: str, shards: int
) -> dict:
    """The traced phases (cached: presets sharing a model, shapes and batch layout share them). The objective's frozen
    copies run before the policy's forward in a forward-process update, the reference after it in a replay."""
    facts = objective.describe()
    copies, policy = facts.frozen_copies, facts.trains_on == "edges"
    before = () if policy else copies
    after = copies if policy else ()
    trace_args = (
        arch["key"],
        cfg.model.dtype,
        model["lora"],
        shapes,
        work["rollout_states"],
        cfg_on,
        work["update_states"],
        work["train_cfg"],
        before,
        after,
        bool(work["counts"]["explore_forwards"]),
        bool(cfg.optim.use_8bit),
        target,
    )
    # FSDP2: the weights gathered in model.dtype, a block's gradients reduce-scattered and freed as backward leaves
    # it (fsdp["update"] below)
    traces = phase_traces(*trace_args, shards > 1, _checkpointed(cfg, model))
    traces["updates"] = {False: traces["update"], True: traces["update_checkpointed"]}
    return traces


def _checkpointed(cfg, model: dict) -> int:
    """Blocks of the traced transformer the update checkpoints when ``model.gradient_checkpointing`` is on:
    ``model.checkpoint_blocks`` (None: every block), at most the blocks there are, as a run counts them (both experts'
    of a two-expert model) and says it (:func:`flowrl.models.blocks.checkpointed_of`)."""
    module = model["module"]
    blocks = len(block_lists(module))
    count = checkpointed_of(cfg.model.checkpoint_blocks, model["held"] * blocks, type(module).__name__)
    return min(count, blocks)


def _static_memory(cfg, plan, objective, model: dict, arch: dict, shards: int) -> dict:
    """Bytes held through the iteration: weights, encoders, VAE, gradients, AdamW state, EMA, the objective's frozen
    copies, an explorer copy, the reward models."""
    reward_bytes, reward_notes = reward_model_bytes(cfg)
    trainable_bytes, lora = model["trainable_bytes"], model["lora"]
    optim_bytes = 2 * held_bytes(model["trainable"], shards, itemsize=1) if cfg.optim.use_8bit else 2 * trainable_bytes
    ema = trainable_bytes if cfg.train.ema > 0 else 0
    copies = objective.describe().frozen_copies
    old = (trainable_bytes if lora is not None else model["full_copy"]) if "old" in copies else 0
    reference = model["full_copy"] if "reference" in copies and lora is None else 0
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
        "explorer": explorer,
        "encoder_bytes": encoder_bytes,
        "offloaded": offloaded,
        "total": total,
    }


def _prompt_cache(cfg, arch: dict, shapes: Shapes, dbytes: int, P: int) -> dict:
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


def _phases(
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
    phases = {
        "rollout": traces["rollout"].peak + fsdp["rollout"],
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
        "optim_transient": optim_transient,
        "peak": static["total"] + cache["now"] + host + phases[peak_phase],
        "peak_without": peak_with(False),
        "peak_with": peak_with(True),
    }


def _flops_and_time(cfg, plan, gpu_spec: GPUClass, traces: dict, work: dict, cfg_on: bool) -> dict:
    """FLOPs per phase from the traced forwards and the iteration's counts, and seconds per iteration at the assumed
    utilisation range of the GPU's bf16 peak (an fp8 explorer previews faster)."""
    counts, rollout_states = work["counts"], work["rollout_states"]
    cfg_rows = 2 if cfg_on else 1
    f_row = traces["rollout"].flops / (rollout_states * cfg_rows)
    f_explore_row = traces["explore"].flops / (rollout_states * cfg_rows)
    f_decode = traces["decode"].flops / rollout_states
    upd = traces["updates"][bool(cfg.model.gradient_checkpointing)]
    train_rows_per_trace = work["update_states"] * (2 if work["train_cfg"] else 1)
    f_train_row = upd.flops / train_rows_per_trace
    flops = {
        "rollout": counts["forwards"] * cfg_rows * f_row,
        "explore": counts["explore_forwards"] * cfg_rows * f_explore_row,
        "decode": counts["decodes"] * f_decode,
        "update": counts["train_rows"] * (2 if work["train_cfg"] else 1) * f_train_row * int(cfg.train.inner_epochs),
    }
    speed = {k: 1.0 for k in flops}
    if (plan.explorer_spec() or ("same",))[0] == "fp8":
        speed["explore"] = gpu_spec.fp8_speedup
    effective = sum(flops[k] / speed[k] for k in flops)
    peak_flops = gpu_spec.peak_tflops * 1e12  # the one table of peaks: perf/mfu divides by the same
    seconds = [effective / (peak_flops * UTILISATION[1]), effective / (peak_flops * UTILISATION[0])]
    split = {k: [flops[k] / speed[k] / (peak_flops * u) for u in (UTILISATION[1], UTILISATION[0])] for k in flops}
    return {
        "flops": {
            **flops,
            "total": sum(flops.values()),
            "per_rollout_row": f_row,
            "per_update_row": f_train_row,
            "per_decode": f_decode,
        },
        "time": {
            "seconds_per_iteration": seconds,
            "split_seconds": split,
            "gpu_bf16_tflops": gpu_spec.peak_tflops,
            "peak_source": gpu_spec.peak_source,
            "utilisation": list(UTILISATION),
            "explorer_speedup": speed["explore"],
        },
    }


def _architecture_report(cfg, model: dict) -> dict:
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


def _memory_report(
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
        "explorer": static["explorer"] / GiB,
        "prompt_cache": cache["now"] / GiB,
        "activations_rollout": traces["rollout"].peak / GiB,
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
