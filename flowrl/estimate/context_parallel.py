"""Context parallelism in the estimate (``model.context_parallel``; docs/estimate.md): what one process of a context
group of ``d = ulysses · ring`` processes holds and computes (:mod:`flowrl.distributed.context_parallel`)."""

from __future__ import annotations

from dataclasses import replace

from flowrl.distributed.context_parallel import check_context_parallel, check_transformer, context_degree

SPLIT_PHASES = ("rollout", "explore", "update", "update_checkpointed", "teacher_rollout")
"""The traced phases whose transformer forwards (and backwards) run split by sequence."""

ASSUMPTION = (
    "model.context_parallel (degree d = ulysses·ring): each process of a context group holds 1/d of a transformer "
    "forward's activations and does 1/d of its FLOPs (the whole sequence's trace divided by d, the text tokens, which "
    "the plans do not split, included); weights, the VAE decode, the rewards and the optimizer are whole on every "
    "process of the group (FSDP2 shards the weights over all processes); the data replicas are processes/d, each with "
    "prompts.per_step/replicas prompts; all-to-all and ring transfer time is not counted"
)


def context_split(cfg, processes: int, transformer, image_tokens: int) -> int:
    """The context degree of ``cfg`` over ``processes`` (1: off), after the run's own checks, naming the key: the
    degree divides the processes and ``prompts.per_step`` the replicas, and the ``transformer`` (on the meta device)
    runs split with a sequence of ``image_tokens``."""
    section = cfg.model.context_parallel
    degree = context_degree(section)
    if degree > 1:
        check_context_parallel(cfg, processes)
        check_transformer(transformer, section, image_tokens)
    return degree


def split_traces(traces: dict, degree: int) -> dict:
    """``traces`` with each transformer phase's (:data:`SPLIT_PHASES`) bytes and FLOPs divided by ``degree`` (and the
    ``updates`` view of the two update traces made of the divided ones)."""
    if degree == 1:
        return traces
    out = dict(traces)
    for phase in (p for p in SPLIT_PHASES if p in traces):  # teacher_rollout: only where the teacher samples
        t = traces[phase]
        out[phase] = replace(t, peak=t.peak // degree, end=t.end // degree, flops=t.flops // degree)
    out["updates"] = {False: out["update"], True: out["update_checkpointed"]}
    return out
