"""One iteration's predicted memory and time (:func:`estimate`), put together from its parts: the preset's shapes and
guidance, the work per iteration (from what the plan and the objective declare), the traced phases, FLOPs and time
(:mod:`flowrl.estimate.iteration_work`); the model on the meta device, the static memory, the prompt cache, the phases'
peaks and the memory report (:mod:`flowrl.estimate.iteration_memory`) (docs/estimate.md)."""

from __future__ import annotations

from flowrl.config import build
from flowrl.distributed.sharding import check_sharded_objective
from flowrl.estimate.archs import ARCH_CACHE, arch_for_model
from flowrl.estimate.context_parallel import ASSUMPTION as CONTEXT_ASSUMPTION
from flowrl.estimate.context_parallel import context_split, split_traces
from flowrl.estimate.gpus import UTILISATION, assume_gpu, gpu_class
from flowrl.estimate.iteration_memory import (  # noqa: F401 (GiB re-exported)
    GiB,
    architecture_report,
    checkpointed_blocks,
    memory_report,
    model_on_meta,
    phase_peaks,
    prompt_cache_bytes,
    static_memory,
)
from flowrl.estimate.iteration_work import (  # noqa: F401 (the defaults re-exported)
    GUIDANCE_DEFAULT,
    SEQ_DEFAULT,
    flops_and_time,
    iteration_work,
    shapes_and_guidance,
    traced_phases,
)
from flowrl.estimate.pipeline import price_pipeline
from flowrl.estimate.run_checks import check_model_options, check_processes
from flowrl.estimate.sharding import ASSUMPTION as SHARDING_ASSUMPTION
from flowrl.estimate.sharding import shard_mode
from flowrl.models.blocks import block_lists
from flowrl.training.pipeline import trainers_of

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
    "a guided teacher (loss.teacher): its anchor's forwards in every update and its full rollout.teacher_share of "
    "the chains, at its guidance (its schedule and share_schedule not priced); its frozen copy shared with a KL "
    "reference of the initial weights, its own in an async rollout process",
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
    processes, replicas, gpu_spec, shard, shards, arch, plan, objective = _setup(
        cfg, gpu, processes, arch, target, shard
    )
    shapes, frames, guidance, cfg_on = shapes_and_guidance(cfg, arch, objective)
    model = model_on_meta(cfg, arch, shards)
    degree = context_split(cfg, processes, model["module"], shapes.image_tokens)
    P = cfg.prompts.per_step // replicas
    work = iteration_work(cfg, plan, objective, P, cfg_on, arch["family"])
    traces = split_traces(traced_phases(cfg, arch, model, objective, shapes, work, cfg_on, target, shards), degree)
    static = static_memory(cfg, plan, objective, model, arch, shards, work["teacher"])
    cache = prompt_cache_bytes(cfg, arch, shapes, model["dbytes"], P)
    phases = phase_peaks(cfg, model, traces, static, cache, work, shapes, frames, target, shards, P)
    flops = flops_and_time(cfg, plan, gpu_spec, traces, work, cfg_on)
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
        "architecture": architecture_report(cfg, model),
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
            "micro_batch": int(objective.describe().micro_batch),
            "gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
            "checkpoint_blocks": checkpointed_blocks(cfg, model) if cfg.model.gradient_checkpointing else 0,
            "blocks": len(block_lists(model["module"])),
        },
        "counts": {**work["counts"], "prompts_per_process": P, "inner_epochs": int(cfg.train.inner_epochs)},
        "memory_gib": memory_report(cfg, gpu_spec, model, static, cache, traces, phases, shards),
        "flops": flops["flops"],
        "time": flops["time"],
        "assumptions": ASSUMPTIONS + static["reward_notes"] + ([CONTEXT_ASSUMPTION] if degree > 1 else []),
    }
    pipeline = price_pipeline(cfg, result, target)  # train.pipeline=async: the overlap, per-process memory
    if pipeline is not None:
        result["pipeline"] = pipeline
        result["time"] = {**result["time"], "seconds_per_iteration": pipeline["seconds_per_iteration"]}
    return result


def _setup(cfg, gpu: str, processes: int, arch: dict | None, target: str, shard: str | None) -> tuple:
    """:func:`estimate`'s arguments checked as a run checks them, and what it builds first: the trainer processes, the
    data replicas, the GPU, the sharding (and the shards a tensor is split into), the architecture, the plan and the
    objective."""
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
    return processes, replicas, gpu_spec, shard, shards, arch, plan, objective
