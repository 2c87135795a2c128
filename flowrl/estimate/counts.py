"""The plan's work per iteration: forwards, explorer previews, decodes, leaves and training rows per
process, averaged over iterations spread over the run. Read from what the plan declares
(:meth:`~flowrl.rollout.base.RolloutPlan.expected_counts`) and the objective declares
(:meth:`~flowrl.objectives.base.Objective.describe`: what it trains on, its rows per iteration), so an
out-of-tree plan or objective is estimated from its own declarations."""

from __future__ import annotations

from flowrl.rollout.base import RolloutContext


class _DeclaredTeacher:
    """The estimate's stand-in for an objective's guided teacher in a plan's context: a plan's ``expected_counts``
    reads only that there is one (and the context's ``teacher_fraction``)."""

    guidance = None


DECLARED_TEACHER = _DeclaredTeacher()


def iteration_counts(plan, objective, num_prompts: int, max_steps: int, seed: int = 0) -> dict[str, float]:
    """Per process and iteration, averaged over 16 iterations spread over the run (random and progressive
    windows, depth pruning): ``forwards`` (full-precision states), ``explore_forwards``, ``decodes`` (leaves,
    probed states, explore previews), ``leaves``, ``trained_units`` (edges or leaves) and ``train_rows``
    (velocity rows the objective's forward with gradients runs, before CFG doubling); of the decodes, ``scored``
    (leaves and probed states, decoded together after the rollout) and ``pool`` (explore previews); of the forwards,
    ``teacher_forwards`` (states the objective's guided teacher samples, ``rollout.teacher_share``: the plan is
    asked with a teacher in its context when the objective declares one, at its full share)."""
    iterations = sorted({round(i * (max(max_steps, 1) - 1) / 15) for i in range(16)})
    facts = objective.describe()
    sums: dict[str, float] = {}
    for it in iterations:
        ctx = RolloutContext(seed=seed, iteration=it, teacher=DECLARED_TEACHER if facts.has_teacher else None)
        counts = plan.expected_counts(num_prompts, ctx)
        units = counts["leaves"] if facts.trains_on == "leaves" else counts["trained_edges"]
        scored = counts["leaves"] + counts.get("probes", 0)
        pool = counts.get("explore_decodes", 0)
        row = {
            "forwards": counts["forwards"],
            "explore_forwards": counts.get("explore_forwards", 0),
            "decodes": scored + pool,
            "leaves": counts["leaves"],
            "trained_units": units,
            "train_rows": facts.train_rows({**counts, "groups": num_prompts}),
            "scored": scored,
            "pool": pool,
            "teacher_forwards": counts.get("teacher_forwards", 0),
        }
        for k, v in row.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return {k: v / len(iterations) for k, v in sums.items()}
