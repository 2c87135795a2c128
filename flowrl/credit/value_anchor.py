"""VGPO: value anchoring in time and in the group (docs/step_credit.md, "VGPO: value anchoring"; arXiv 2512.12387).

For a path with SDE steps t = 0..n−1: the instant reward R_t is the value of the state reached by SDE
step t (``forest.value``: with ``rollout.plan: probed`` and ``probe: x0_projection`` the reward of
decode(x̂0), x̂0 = x − σ·v from the velocity the next step computes anyway; with ``ode_completion`` the
reward of its ODE completion — the state after the last SDE step then takes its leaf's reward). Then

    Q_t = Σ_{k ≥ t} γ^{k−t}·R_k                       (discounted value over the path's remaining SDE steps)
    ω_t = Q'_t / mean_t Q'_t,  Q' = Q − min_t Q + ``omega_shift``   (temporal weight; min and mean over the path)
    A_t = ω_t·[(Q_t − mean_g Q_t)/(std_g Q_t + ``eps``) + α_t·Q_t],  α_t = ``k_abs`` for t < ``abs_steps``, else 0

mean_g and std_g (ddof 0) run over the prompt group's edges at the same schedule step. The absolute
term keeps a signal where the group's values stop varying: a zero-variance (group, step) cell has z = 0
but keeps ω_t·α_t·Q_t; its edges are skipped (weight 0, counted) only where that is 0 too (t ≥ abs_steps).

Trees (and chains below a shared trunk): Q and ω are computed per root-to-leaf path, and an edge shared
by several paths (above a branch point) takes the **mean of its per-path Q and ω over the leaves below
it** — the leaf-weighted average of the futures that followed it (for a uniform K-ary tree exactly the
Bellman backup Q(s) = R(s) + γ·mean_children Q). The group z-score runs over the distinct edges at the
same step of a group (a step with one edge, a trunk, gets z = 0); t is the edge's SDE step index on its
root path, the same for every path through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.credit.base import CreditRule, Gather, write_edge_credit
from flowrl.credit.turning_point import per_step_stats, per_step_std, zscore_by_step
from flowrl.rollout.forest import Forest
from flowrl.rollout.probes import StepPaths, state_values


def discounted_values(R: torch.Tensor, gamma: float) -> torch.Tensor:
    """Q [L, n] with Q_t = Σ_{k≥t} γ^{k−t}·R_k for instant rewards ``R`` [L, n]."""
    Q = R.clone().float()
    for t in range(R.shape[1] - 2, -1, -1):
        Q[:, t] = R[:, t] + gamma * Q[:, t + 1]
    return Q


def temporal_weights(Q: torch.Tensor, shift: float = 1e-3) -> torch.Tensor:
    """ω [L, n] = Q'/mean_t Q' with Q' = Q − min_t Q + ``shift`` (per row)."""
    shifted = Q - Q.min(dim=1, keepdim=True).values + shift
    return shifted / shifted.mean(dim=1, keepdim=True)


@dataclass
class ValueAnchor(CreditRule):
    """VGPO credit (``credit.rule: value_anchor``; module docstring). Needs the values of the states reached by
    SDE steps: ``rollout.plan: probed`` (``probe: x0_projection`` as published, or ``ode_completion``).

    ``gamma`` [0.9], ``k_abs`` [0.1] and ``abs_steps`` [5] (ours; docs/step_credit.md, "VGPO: value anchoring"),
    ``omega_shift`` [1e-3] (the positivity shift of ω), ``eps`` and ``zero_std_tol`` as ``credit.rule: group``."""

    gamma: float = 0.9  # γ ∈ [0, 1], the discount of the path's later state values: Q_t = Σ_{k≥t} γ^{k−t}·R_k (ours)
    k_abs: float = 0.1  # α, the weight of the absolute term α·Q_t added to the group z-score in the first abs_steps
    # SDE steps, a signal where the group stops varying (ours)
    abs_steps: int = 5  # the first SDE steps of a path that get the absolute term k_abs·Q_t (≥ 0; 0 = none; ours)
    omega_shift: float = 1e-3  # the positivity shift of the temporal weight ω_t = Q'_t/mean_t Q', Q' = Q − min_t Q +
    # omega_shift (> 0)
    eps: float = 1e-4  # added to the std of the z-score over a (prompt group, step) cell: (Q − mean)/(std + eps)
    zero_std_tol: float = 1e-6  # a (group, step) cell whose Q spans ≤ this has z = 0; its edges are skipped where
    # the absolute term is 0 too (t ≥ abs_steps)

    writes = ("edges",)  # step-level credit lives on the SDE edges; a leaf objective would read 0 everywhere

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"credit.gamma={self.gamma} must be in [0, 1]")
        if self.abs_steps < 0:
            raise ValueError(f"credit.abs_steps={self.abs_steps} must be >= 0")
        if self.omega_shift <= 0 or self.eps <= 0:
            raise ValueError(f"credit.omega_shift={self.omega_shift} and credit.eps={self.eps} must be > 0")

    def assign(self, forest: Forest, gather: Gather | None = None) -> dict[str, float]:
        """Write ``advantage`` and ``weight`` on every SDE edge; non-SDE edges get weight 0. Returns statistics
        (value curves: mean R_t, Q_t and ω_t per step; per-step advantage std; the absolute term's share)."""
        values = state_values(forest)
        paths = StepPaths.from_forest(forest)
        path_id, k, edge = paths.entries()
        missing = torch.isnan(values[edge]) & ~torch.isin(edge, forest.probe_node)
        if bool(missing.any()):
            raise ValueError(
                "credit.rule=value_anchor needs the value of every state an SDE step reaches: use "
                "rollout.plan=probed (rollout.probe=x0_projection or ode_completion)"
            )
        M = edge.shape[0]
        instant = values[edge]
        Q = torch.full((M,), float("nan"))
        omega = torch.full((M,), float("nan"))
        for _, pos in paths.by_length().values():
            q = discounted_values(instant[pos], self.gamma)
            Q[pos], omega[pos] = q, temporal_weights(q, self.omega_shift)

        edges = torch.unique(edge)
        q_edge = StepPaths.edge_mean(edge, Q, forest.num_nodes)[edges]
        w_edge = StepPaths.edge_mean(edge, omega, forest.num_nodes)[edges]
        t_edge = torch.zeros(forest.num_nodes, dtype=torch.long).index_copy_(0, edge, k)[
            edges
        ]  # SDE index on the root path
        alpha = torch.where(t_edge < self.abs_steps, torch.full_like(q_edge, self.k_abs), torch.zeros_like(q_edge))
        z, zero_var, zero_ratio = zscore_by_step(forest, edges, q_edge, self.eps, self.zero_std_tol)
        adv = w_edge * (z + alpha * q_edge)
        flat = zero_var & (alpha == 0)  # no spread and no absolute term: advantage 0, flat (not weight 0)
        train = torch.isfinite(adv)
        pruned = write_edge_credit(forest, edges, adv, train, flat=flat)
        train = train & ~flat & ~pruned

        step = forest.step[forest.parent[edge]]
        edge_step = forest.step[forest.parent[edges]]
        trained = train & torch.isfinite(adv)
        stats = {
            "zero_std_ratio": zero_ratio,
            "skipped_edges": float((~train & ~pruned).sum()),
            "pruned_depth_edges": float(pruned.sum()),
            "adv_abs_mean": float(forest.advantage[edges].abs().mean()) if edges.numel() else 0.0,
            "vgpo/abs_term_mean": float((w_edge * alpha * q_edge)[trained].abs().mean())
            if bool(trained.any())
            else 0.0,
            "vgpo/rel_term_mean": float((w_edge * z)[trained].abs().mean()) if bool(trained.any()) else 0.0,
        }
        stats.update(per_step_stats("vgpo/r", step, instant))
        stats.update(per_step_stats("vgpo/q", step, Q))
        stats.update(per_step_stats("vgpo/omega", step, omega))
        stats.update(per_step_std("vgpo/adv_std", edge_step, forest.advantage[edges]))
        return stats
