"""The estimate of ``train.pipeline: async`` (docs/pipeline.md, docs/estimate.md): what overlapping the rollout with
the update buys and costs, priced from the serial estimate's parts (:func:`flowrl.estimate.iteration.estimate`).

- **Time.** The rollout side (sampling, the explorer's previews, decoding) and the update side overlap on devices of
  their own (launched rollout processes, or a CPU's cores split between them): an iteration takes the longer of the
  two plus the weight sync (the trainable weights sent once per version at the link's bandwidth, :data:`LINK_GBPS`).
  At ``train.max_staleness`` 0 nothing overlaps, and beside the trainer on one GPU both share its compute (what they
  gain is the time one side leaves the card idle, not priced): the two sides and the sync add up.
  With launched rollout processes (``train.rollout_processes`` N of G processes) each rollout process samples for
  ⌈T/N⌉ of the T trainers, and each trainer updates on its share: :func:`best_split` is the N that balances them.
- **Memory, per process.** The trainer's is the serial estimate's peak (it still samples its evals). A rollout process
  sets up only what sampling needs (:meth:`~flowrl.objectives.base.Objective.setup_sampling`): the model, the
  objective's guided teacher on a copy of its own when ``rollout.teacher_share`` lets it draw (no KL reference is
  built there to share), the explorer, the
  rewards and the prompt cache; no old copy, no KL reference, no gradients, optimizer state or EMA. Its peak is the
  largest of the rollout's phases (sampling, decoding, encoding). Beside a trainer on one GPU both
  share the card (``fits`` adds the two peaks); a launched rollout process has a card of its own.
"""

from __future__ import annotations

import math

GiB = 2**30

LINK_GBPS = {
    "cpu": 5.0,  # shared memory: one copy of the flat weights in, one out
    "cuda": 500.0,  # CUDA IPC on the same card: a device-to-device copy
    "launched": 2.0,  # send_object_list: pickled through the host, then the process group (gloo or NCCL)
}
"""GB/s assumed for one weights version's trip to the rollout side, by link."""

ROLLOUT_PARTS = (
    "transformer_weights",
    "transformer_buffers",
    "lora",
    "text_encoders",
    "vae",
    "reward_models",
    "explorer",
    "teacher_own_copy",
    "prompt_cache",
)
"""The serial estimate's memory parts (GiB) a rollout process holds: its model, the sampling teacher's own copy when
the plan lets it draw (a full
copy of the transformer under full fine-tuning, the loaded transformer with its LoRA under LoRA with
``loss.teacher.path``, nothing under LoRA without one: the base with the adapter off), the explorer, the rewards and
the prompt cache. Not the objective's old copy or KL reference: the loss alone reads them, in the trainer."""

ROLLOUT_PHASES = ("rollout", "decode", "encode")


def best_split(rollout_seconds: float, update_seconds: float, processes: int) -> int:
    """The number N of ``processes`` (≥ 2) to roll out, the rest training, that minimises
    max(rollout · P/N, update · P/(P − N)), from one process's rollout and update seconds at ``processes`` trainers."""
    if processes < 2:
        return 0
    return min(
        range(1, processes),
        key=lambda n: max(rollout_seconds * processes / n, update_seconds * processes / (processes - n)),
    )


def price_pipeline(cfg, est: dict, target: str = "cuda") -> dict | None:
    """The ``pipeline`` part of an estimate of ``cfg`` (None for ``train.pipeline: sync``): seconds per iteration
    [low, high] with the overlap (the longer side plus the weight sync), each side's seconds, the sync's bytes and
    seconds, the rollout process's peak memory (GiB) and its parts, whether the layout fits its GPU(s), and the
    balanced number of launched rollout processes for this run's process count."""
    t = cfg.train
    if t.pipeline != "async":
        return None
    split, mem = est["time"]["split_seconds"], est["memory_gib"]
    rollout = [split["rollout"][i] + split["explore"][i] + split["decode"][i] for i in (0, 1)]
    update = list(split["update"])
    launched = int(t.rollout_processes)
    link = "launched" if launched else ("cuda" if target == "cuda" else "cpu")
    trainable_gib = mem["lora"] if mem["lora"] else mem["transformer_weights"]  # sent: LoRA alone, else the weights
    sync = trainable_gib * GiB / (LINK_GBPS[link] * 1e9)
    trainers = int(est["processes"])  # the estimate's processes are the trainers (launched rollout ones apart)
    total = trainers + launched
    served = math.ceil(trainers / launched) if launched else 1
    rollout_side = [r * served for r in rollout]
    shares_card = not launched and target == "cuda"
    if int(t.max_staleness) == 0 or shares_card:  # nothing overlaps, or both sides share one card's compute
        seconds = [rollout_side[i] + update[i] + sync for i in (0, 1)]
    else:
        seconds = [max(rollout_side[i], update[i]) + sync for i in (0, 1)]
    phases = mem["phases"]
    parts = {k: mem[k] for k in ROLLOUT_PARTS}
    rollout_peak = sum(parts.values()) + max(phases.get(k, 0.0) for k in ROLLOUT_PHASES)
    card = float(mem["gpu_memory"])
    fits = (mem["peak"] + rollout_peak <= card) if shares_card else (mem["peak"] <= card and rollout_peak <= card)
    return {
        "max_staleness": int(t.max_staleness),
        "layout": f"{launched} launched rollout process(es) for {trainers} trainer(s)" if launched else "beside",
        "seconds_per_iteration": seconds,
        "serial_seconds_per_iteration": list(est["time"]["seconds_per_iteration"]),
        "rollout_seconds": rollout_side,
        "update_seconds": update,
        "weight_sync_gib": trainable_gib,
        "weight_sync_seconds": sync,
        "link": link,
        "link_gbps": LINK_GBPS[link],
        "rollout_process_peak_gib": rollout_peak,
        "rollout_process_parts": parts,  # GiB each; the peak adds the largest rollout phase
        "trainer_peak_gib": mem["peak"],
        "shares_card": shares_card,
        "fits": bool(fits),
        "processes": total,
        # over all the processes: one trainer's share of the work at ``trainers`` spread to ``total``
        "best_rollout_processes": best_split(
            sum(rollout) / 2 * trainers / total, sum(update) / 2 * trainers / total, total
        ),
    }
