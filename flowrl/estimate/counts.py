"""The plan's work per iteration: forwards, explorer previews, decodes, leaves and training rows per
process, averaged over iterations spread over the run (the plan's ``expected_counts``)."""
from __future__ import annotations

from flowrl.rollout.base import RolloutContext
from flowrl.rollout.tree import Tree


def _replay_rows(plan, num_prompts: int, ctx) -> int:
    """States a policy objective replays (one velocity row per distinct parent of a trained edge)."""
    inner = getattr(plan, "inner_plan", None)
    if inner is not None and type(plan).__name__ == "Explore":
        return _replay_rows(inner, num_prompts, ctx)
    if isinstance(plan, Tree):
        layout = plan.layout(ctx.iteration, ctx.seed)
        n = layout.nodes_per_step(plan.steps, plan.branch)
        return num_prompts * sum(n[i] for i in range(plan.steps)
                                 if plan._trainable_step(i, layout) and (i + 1) not in layout.pruned)
    if inner is not None:
        return _replay_rows(inner, num_prompts, ctx)
    return int(plan.expected_counts(num_prompts, ctx)["trained_edges"])


def iteration_counts(plan, objective, num_prompts: int, max_steps: int, seed: int = 0) -> dict[str, float]:
    """Per process and iteration, averaged over 16 iterations spread over the run (random and progressive
    windows, depth pruning): ``forwards`` (full-precision states), ``explore_forwards``, ``decodes`` (leaves,
    probed states, explore previews), ``leaves``, ``trained_units`` (edges or leaves) and ``train_rows``
    (velocity rows the objective's forward with gradients runs, before CFG doubling); of the decodes, ``scored``
    (leaves and probed states, decoded together after the rollout) and ``pool`` (explore previews)."""
    iterations = sorted({round(i * (max(max_steps, 1) - 1) / 15) for i in range(16)})
    sums: dict[str, float] = {}
    for it in iterations:
        ctx = RolloutContext(seed=seed, iteration=it)
        counts = plan.expected_counts(num_prompts, ctx)
        units = counts["leaves"] if objective.trains_on == "leaves" else counts["trained_edges"]
        rows = counts["leaves"] * getattr(objective, "draws", 1) if objective.trains_on == "leaves" else \
            _replay_rows(plan, num_prompts, ctx)
        pool = num_prompts * plan.pool_size if "explore_forwards" in counts else 0
        row = {"forwards": counts["forwards"], "explore_forwards": counts.get("explore_forwards", 0),
               "decodes": counts["leaves"] + counts.get("probes", 0) + pool, "leaves": counts["leaves"],
               "trained_units": units, "train_rows": rows, "scored": counts["leaves"] + counts.get("probes", 0),
               "pool": pool}
        for k, v in row.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return {k: v / len(iterations) for k, v in sums.items()}
