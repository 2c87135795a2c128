"""The estimate for people: ``flowrl bench``'s ``--estimate`` arguments and the markdown summary of
:func:`flowrl.estimate.estimate`'s result."""

from __future__ import annotations

from flowrl.estimate.gpus import GPUS


def add_estimate_arguments(parser) -> None:
    """``--estimate``, ``--gpu``, ``--processes`` (alias ``--gpus``) and ``--shard`` of ``flowrl bench``."""
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="predict peak GPU memory and s/iteration without running (meta device; docs/estimate.md)",
    )
    parser.add_argument("--gpu", default="H100", help=f"GPU class of --estimate: {', '.join(GPUS)} (default H100)")
    parser.add_argument(
        "--processes",
        "--gpus",
        dest="processes",
        type=int,
        default=1,
        help="processes (GPUs) sharing prompts.per_step, for --estimate (default 1)",
    )
    parser.add_argument(
        "--shard",
        choices=("ddp", "fsdp"),
        default=None,
        help="--estimate: ddp (a whole copy per GPU) or fsdp (FSDP2, split over --gpus; "
        "default: the config's model.shard)",
    )


_LABELS = {
    "fsdp_gather_rollout": "FSDP gather in the rollout (the whole transformer)",
    "fsdp_gather": "FSDP gather (root + 2 consecutive blocks, in every forward and backward)",
    "fsdp_reduce_scatter": "FSDP reduce-scatter (a block's gradients + their fp32 copy, in backward)",
    "offloaded_to_cpu": "text encoders in CPU memory (on the GPU only to encode new prompts: the encode phase)",
    "teacher": "teacher (loss.teacher's frozen copy)",
}


def size_text(gib: float) -> str:
    """``1.23 GiB``, or ``12.34 MiB`` below 0.1 GiB."""
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.3g} FLOP"


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _precision(arch: dict) -> str:
    """The dtypes training holds: ``model.dtype``, fp32 LoRA on it, or fp32 master weights under autocast."""
    if arch.get("autocast"):
        return f"fp32 master weights, computed in {arch['autocast']} (autocast)"
    if arch.get("trainable_dtype") and arch["trainable_dtype"] != arch["dtype"]:
        return f"{arch['dtype']}, trainable {arch['trainable_dtype']}"
    return arch["dtype"]


_MEMORY_ROWS = (
    "transformer_weights",
    "transformer_buffers",
    "lora",
    "text_encoders",
    "vae",
    "reward_models",
    "gradients",
    "optimizer_state",
    "ema",
    "old_policy",
    "reference",
    "teacher",
    "explorer",
    "prompt_cache",
    "activations_rollout",
    "activations_decode",
    "activations_update",
    "optimizer_step_transient",
    "fsdp_gather_rollout",
    "fsdp_gather",
    "fsdp_reduce_scatter",
    "offloaded_to_cpu",
)
"""The parts of ``memory_gib`` the table lists, in its order (those that are 0 left out)."""


def format_estimate(result: dict) -> str:
    """A short human-readable summary of :func:`estimate`'s result (markdown)."""
    mem, arch, sh, t, fl = (result[k] for k in ("memory_gib", "architecture", "shapes", "time", "flops"))
    lo, hi = t["seconds_per_iteration"]
    shard = result.get("shard", "ddp")
    per_gpu = (
        []
        if result["processes"] == 1
        else [
            "memory per GPU; "
            + (
                f"FSDP2: weights, LoRA, gradients, optimizer state, EMA and copies split over {mem['sharded_over']} "
                "GPUs, "
                "rollouts gather "
                f"{'the whole transformer' if result['shard_rollouts'] == 'whole' else 'block by block'}"
                if shard == "fsdp"
                else "DDP: a whole copy of the model on every GPU"
            )
        ]
    )
    degree = result.get("context_parallel", 1)
    if degree > 1:
        per_gpu.append(
            f"context parallel: each sample's sequence split over {degree} GPUs ({result['processes'] // degree} data "
            f"replicas of {result['counts']['prompts_per_process']} prompts): 1/{degree} of a forward's activations "
            "and FLOPs per GPU"
        )
    lines = [
        f"## estimate: {result['model']} on {result['processes']} × {result['gpu']} ({shard})",
        *per_gpu,
        f"transformer {_count(arch['transformer_params'])} parameters, trainable {_count(arch['trainable_params'])}"
        + ("" if arch["full_finetune"] else f" (LoRA on {arch['lora_layers']} layers)")
        + f", {_precision(arch)}",
        f"{sh['height']}×{sh['width']} px → latent {sh['latent']}, {sh['image_tokens']} image "
        + (f"+ {sh['source_tokens']} source image " if sh.get("source_tokens") else "")
        + f"+ {sh['text_tokens']} text "
        f"tokens; rollout forward {sh['rollout_rows']} rows, update micro-batch {sh['update_rows']} rows"
        + (" (CFG doubles rows)" if sh["cfg"] else ""),
        "",
        "| memory | |",
        "|---|---|",
    ]
    for key in _MEMORY_ROWS:
        if mem.get(key) and not (key == "fsdp_gather_rollout" and mem[key] == mem["fsdp_gather"]):
            lines.append(f"| {_LABELS.get(key, key.replace('_', ' '))} | {size_text(mem[key])} |")
    lines += [
        f"| **peak** ({mem['peak_phase']}) | **{size_text(mem['peak'])}** of {mem['gpu_memory']:.0f} GiB "
        f"({'fits' if mem['fits'] else 'does NOT fit'}) |",
        f"| peak with / without gradient checkpointing | {size_text(mem['peak_with_gradient_checkpointing'])} / "
        f"{size_text(mem['peak_without_gradient_checkpointing'])} |",
        f"| peak at the end of the run (prompt cache grown to {size_text(mem['prompt_cache_end_of_run'])}) | "
        f"{size_text(mem['peak_end_of_run'])} |",
        "",
        f"FLOPs per iteration {_flops(fl['total'])} (rollout {_flops(fl['rollout'])}, explore {_flops(fl['explore'])}, "
        f"decode {_flops(fl['decode'])}, update {_flops(fl['update'])}" + _teacher_flops(fl) + ") → "
        f"**{_seconds(lo)}–{_seconds(hi)} s/iteration** at {t['utilisation'][0]:.0%}–{t['utilisation'][1]:.0%} of "
        f"{t['gpu_bf16_tflops']:.0f} bf16 TFLOP/s ({t.get('peak_source', 'datasheet dense')} peak, the one perf/mfu "
        "divides by)",
    ]
    if result.get("pipeline"):
        lines += ["", pipeline_text(result["pipeline"])]
    return "\n".join(lines)


def _teacher_flops(fl: dict) -> str:
    """``; the guided teacher: …`` (its sampled chains and its anchor's forwards, of the rollout's and the update's
    FLOPs), or nothing without one."""
    parts = [(fl.get(f"teacher_{k}") or 0, k) for k in ("rollout", "update")]
    if not any(n for n, _ in parts):
        return ""
    return "; of these the guided teacher's " + ", ".join(f"{_flops(n)} in the {k}" for n, k in parts if n)


def pipeline_text(p: dict) -> str:
    """The lines of ``train.pipeline=async`` (:func:`flowrl.estimate.pipeline.price_pipeline`)."""
    rollout, update, serial = p["rollout_seconds"], p["update_seconds"], p["serial_seconds_per_iteration"]
    return "\n".join(
        [
            f"pipeline async (staleness {p['max_staleness']}, {p['layout']}): rollout side "
            f"{_seconds(rollout[0])}–{_seconds(rollout[1])} s, update side {_seconds(update[0])}–{_seconds(update[1])} "
            f"s, weight sync {size_text(p['weight_sync_gib'])} in {p['weight_sync_seconds']:.3g} s ({p['link']}, "
            f"{p['link_gbps']:g} GB/s) → the s/iteration above (serial: {_seconds(serial[0])}–{_seconds(serial[1])})",
            f"rollout process peak {size_text(p['rollout_process_peak_gib'])} beside the trainer's "
            f"{size_text(p['trainer_peak_gib'])}"
            + (" on one card" if p["shares_card"] else ", each on its own GPU")
            + f": {'fits' if p['fits'] else 'does NOT fit'}; balanced over {p['processes']} processes: "
            f"{p['best_rollout_processes']} rolling out (train.rollout_processes)",
        ]
    )
