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
    condition_size,
    preset_shapes,
    transformer_inputs,
    velocity,
    vision_tokens,
    with_sources,
)
from flowrl.estimate.iteration import (
    ASSUMPTIONS,
    GUIDANCE_DEFAULT,
    SEQ_DEFAULT,
    GiB,
    estimate,
)
from flowrl.estimate.report import add_estimate_arguments, format_estimate
from flowrl.estimate.sharding import fsdp_transients, held_bytes, shard_mode, sharded_update_traces
from flowrl.estimate.static import REWARD_MODELS, explorer_bytes
from flowrl.estimate.trace import LiveBytes, Trace, fused_attention, trace

__all__ = [
    "ARCH_CACHE",
    "ARCH_DIR",
    "model_with_lora",
    "ASSUMPTIONS",
    "EDIT_FAMILIES",
    "GPUClass",
    "GPUS",
    "GUIDANCE_DEFAULT",
    "GiB",
    "SEQ_DEFAULT",
    "LiveBytes",
    "MetaAutocast",
    "REWARD_MODELS",
    "Shapes",
    "Trace",
    "UTILISATION",
    "add_estimate_arguments",
    "add_lora",
    "arch_for_model",
    "arch_from_folder",
    "arch_from_pipeline",
    "assume_gpu",
    "base_family",
    "build_transformer",
    "build_vae",
    "condition_size",
    "default_lora_targets",
    "estimate",
    "explorer_bytes",
    "format_estimate",
    "fsdp_transients",
    "fused_attention",
    "gpu_class",
    "held_bytes",
    "iteration_counts",
    "list_archs",
    "load_arch",
    "load_config",
    "preset_shapes",
    "run_estimate",
    "shard_mode",
    "sharded_update_traces",
    "text_encoder_params",
    "trace",
    "transformer_inputs",
    "velocity",
    "vision_tokens",
    "with_sources",
]


def run_estimate(
    config: str | None,
    overrides: list[str],
    gpu: str = "H100",
    processes: int = 1,
    shard: str | None = None,
    as_json: bool = False,
) -> int:
    """``flowrl bench CONFIG --estimate [--gpus N] [--shard fsdp] [--json]``: after the run's own load checks
    (:mod:`~flowrl.estimate.run_checks`: a config a run refuses is refused here, with its words), print the table of
    :func:`estimate` (``shard`` None: the config's ``model.shard``); with ``train.fit=auto`` first what
    :func:`~flowrl.estimate.fit.fit_config` chooses for ``gpu`` (the ``key=value`` overrides win), then the estimate
    of the fitted config. ``as_json``: the machine view, one JSON object (:func:`summary_json`) and nothing else on
    stdout. Every other message (what could not be checked here, a warning) goes to stderr."""
    import sys

    from flowrl.estimate.fit import fit_config, kept_keys, settings_of
    from flowrl.estimate.run_checks import check_prompts_and_rewards

    cfg = load_config(config, overrides, gpu)
    notes = check_prompts_and_rewards(cfg)  # said once the estimate stands: a refusal comes alone
    fit = None
    with assume_gpu(gpu):
        if cfg.train.fit == "auto":
            fit = fit_config(cfg, gpu, processes=processes, keep=kept_keys(overrides), shard=shard)
            cfg = fit.config
        result = fit.estimate if fit is not None else estimate(cfg, gpu=gpu, processes=processes, shard=shard)
    if as_json:
        print(json.dumps(summary_json(result, settings_of(cfg), fit), indent=2, default=float))
    else:
        if fit is not None:
            print("\n".join(fit.summary()) + "\n")
        print(format_estimate(result))
        print("\n(--json: every figure, the settings and the assumptions as one JSON object)")
    for note in notes:
        print(f"flowrl bench --estimate: note: {note}", file=sys.stderr)
    return 0


def summary_json(result: dict, settings: dict, fit=None) -> dict:
    """``flowrl bench --estimate --json``: ``peak_gib``, ``seconds_per_iteration`` [low, high],
    ``flops_per_iteration``, ``settings`` (the effective value of every key ``train.fit`` may choose), ``fit`` (what
    it chose, or null) and the whole ``estimate``."""
    return {
        "peak_gib": result["memory_gib"]["peak"],
        "seconds_per_iteration": result["time"]["seconds_per_iteration"],
        "flops_per_iteration": result["flops"]["total"],
        "settings": settings,
        "fit": fit.to_json() if fit is not None else None,
        "estimate": result,
    }
