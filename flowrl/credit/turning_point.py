"""TP-GRPO: incremental step rewards and turning points (docs/step_credit.md, "TP-GRPO: turning points"; arXiv
2602.06422).

For a path with SDE steps k = 0..n−1 (then ODE): R_k = reward of the ODE completion of the state before
SDE step k (``forest.value`` of the decision states, from ``rollout.plan: probed`` with
``probe: ode_completion``; R_0 is the pure-ODE sample from the chain's own x_T) and R_n = the final reward
(the leaf's). With sign_ε(x) = 0 where |x| < ``tie_eps`` (else sign(x)):

    d_k = R_{k+1} − R_k (k = 0..n−1),  Δ = R_n − R_0,  s_k = sign_ε(d_k)·sign_ε(Δ)
    I_0 = [sign_ε(d_0)·sign_ε(R_n − R_1) > 0]
    I_k = [s_{k−1} < 0]·[s_k > 0]·[sign_ε(d_k)·sign_ε(R_n − R_{k+1}) > 0]   (k ≥ 1)
    r_k = R_n − R_k if I_k else d_k

The last step is never a turning point (R_n − R_n = 0). A turning point's aggregated reward R_n − R_k
always has the sign of Δ (for k = 0 it *is* Δ). Balancing (``balance``, ours: per prompt group, their
code per local batch): within each group the turning points with Δ > 0 and those with Δ < 0 are
counted, and min(#pos, #neg) of each are kept, those of the largest |Δ| first (ties: larger
|R_n − R_k|, then path and step order); a group with turning points of one sign only keeps none (their
code keeps all of them then). A dropped turning point falls back to its incremental reward d_k.
Advantage: per prompt group and schedule step, the z-score (r − mean)/(std + ``eps``) over the edges
(ddof 0); a (group, step) cell whose spread is ≤ ``zero_std_tol`` gives 0 and its edges are skipped
(weight 0, counted). The loss then trains every SDE edge on its own advantage.

Trees (and chains below a shared trunk): every root-to-leaf path is a chain as above, with R_n its leaf's
reward and R_k the values of the decision states on it; the step reward of an edge that several paths
share (above a branch point) is the **mean of its per-path step rewards over the leaves below it** (d_k is
the same on every path; only the turning-point status and R_n − R_k depend on the leaf). Balancing counts
(path, step) turning points. The z-score runs over the distinct edges at the same step of a group, so a
step with a single edge (a trunk) gives 0, as BranchGRPO's depth-wise rule does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.credit.base import CreditRule, Gather, set_stats, standardize, write_edge_credit
from flowrl.rollout.forest import Forest
from flowrl.rollout.probes import StepPaths, state_values


def sign_eps(x: torch.Tensor, tie_eps: float = 0.0) -> torch.Tensor:
    """sign(x) with |x| < ``tie_eps`` counted as 0."""
    return torch.where(x.abs() < tie_eps, torch.zeros_like(x), torch.sign(x))


def turning_points(R: torch.Tensor, tie_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turning points of reward sequences ``R`` [L, n+1] (R_0..R_n per path).

    Returns ``(indicator [L, n] bool, d [L, n], delta [L])`` per the module docstring."""
    d = R[:, 1:] - R[:, :-1]
    delta = R[:, -1] - R[:, 0]
    sd = sign_eps(d, tie_eps)
    s = sd * sign_eps(delta, tie_eps)[:, None]
    consistent = sd * sign_eps(R[:, -1:] - R[:, 1:], tie_eps) > 0  # sign(d_k)·sign(R_n − R_{k+1}) > 0
    indicator = torch.zeros_like(d, dtype=torch.bool)
    indicator[:, 0] = consistent[:, 0]
    indicator[:, 1:] = (s[:, :-1] < 0) & (s[:, 1:] > 0) & consistent[:, 1:]
    return indicator, d, delta


def step_rewards(R: torch.Tensor, indicator: torch.Tensor) -> torch.Tensor:
    """r_k [L, n]: R_n − R_k at turning points, d_k = R_{k+1} − R_k elsewhere."""
    return torch.where(indicator, R[:, -1:] - R[:, :-1], R[:, 1:] - R[:, :-1])


def balance_signs(group: torch.Tensor, delta: torch.Tensor, gain: torch.Tensor, tie_eps: float = 0.0) -> torch.Tensor:
    """Which turning points to keep [M] bool, given for each of M turning points its prompt ``group``, its
    path's ``delta`` (Δ) and its ``gain`` (R_n − R_k): per group, min(#Δ>0, #Δ<0) of each sign, largest
    |Δ| first (ties: larger |gain|, then input order)."""
    keep = torch.zeros(group.shape[0], dtype=torch.bool)
    sign = sign_eps(delta, tie_eps)
    for g in torch.unique(group).tolist():
        sides = [torch.nonzero((group == g) & (sign == s)).flatten().tolist() for s in (1.0, -1.0)]
        n = min(len(side) for side in sides)
        for side in sides:
            ranked = sorted(side, key=lambda i: (-abs(float(delta[i])), -abs(float(gain[i])), i))
            keep[ranked[:n]] = True
    return keep


def zscore_by_step(
    forest: Forest, edges: torch.Tensor, values: torch.Tensor, eps: float, zero_std_tol: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per (prompt group, schedule step of the edge) z-scores of ``values`` [E] over the distinct ``edges`` [E]
    (ddof 0; non-finite values are left out and get 0).

    Returns ``(z [E], zero_var [E] bool: the edge's cell has spread ≤ zero_std_tol (or one finite value),
    the fraction of (group, step) cells with zero variance)``."""
    if edges.numel() == 0:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool), 0.0
    cells = torch.stack([forest.group[edges], forest.step[forest.parent[edges]]], dim=1)
    _, cell = torch.unique(cells, dim=0, return_inverse=True)
    num_cells = int(cell.max()) + 1
    stats = set_stats(values, cell, torch.isfinite(values), num_cells)
    z, flat = standardize(values, cell, stats, eps, zero_std_tol)
    return z.float(), flat[cell], float(flat.sum()) / num_cells


def per_step_stats(prefix: str, steps: torch.Tensor, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}_step{i}``: the mean of the finite ``values`` [M] whose schedule step ``steps`` [M] is i (0 if
    none is finite: every process logs the same keys, which the trainer all-reduces)."""
    out = {}
    for i in torch.unique(steps).tolist():
        v = values[(steps == i) & torch.isfinite(values)]
        out[f"{prefix}_step{int(i)}"] = float(v.float().mean()) if v.numel() else 0.0
    return out


def per_step_std(prefix: str, steps: torch.Tensor, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}_step{i}``: the std (ddof 0) of ``values`` [E] at schedule step i."""
    return {
        f"{prefix}_step{int(i)}": float(values[steps == i].float().std(unbiased=False))
        for i in torch.unique(steps).tolist()
    }


@dataclass
class TurningPoint(CreditRule):
    """TP-GRPO credit (``credit.rule: turning_point``; module docstring). Needs state values on the decision
    states: ``rollout.plan: probed`` with ``probe: ode_completion``.

    ``tie_eps``: |x| below it counts as sign 0 (d_k, Δ, R_n − R_{k+1}); 0 = exact ties only (their code).
    ``balance``: per-group sign balancing of turning points (on/off). ``use_turning_points``: off gives plain
    incremental rewards r_k = d_k (the paper's ablation). ``eps``, ``zero_std_tol``: as ``credit.rule: group``.
    """

    tie_eps: float = 0.0
    balance: bool = True
    use_turning_points: bool = True
    eps: float = 1e-4  # added to the std of the z-score over a (prompt group, step) cell: (r − mean)/(std + eps)
    zero_std_tol: float = 1e-6  # a (group, step) cell whose step rewards span ≤ this gives 0; its edges are skipped
    # (weight 0, counted)

    writes = ("edges",)  # step-level credit lives on the SDE edges; a leaf objective would read 0 everywhere

    def __post_init__(self) -> None:
        if self.tie_eps < 0:
            raise ValueError(f"credit.tie_eps={self.tie_eps} must be >= 0")
        if self.eps <= 0:
            raise ValueError(f"credit.eps={self.eps} must be > 0")

    def assign(self, forest: Forest, gather: Gather | None = None) -> dict[str, float]:
        """Write ``advantage`` and ``weight`` on every SDE edge from the decision states' values and the leaves'
        rewards; non-SDE edges get weight 0. Returns statistics (turning-point rate per step, sign balance,
        per-step advantage std, mean R_k per step: the value curve)."""
        values = state_values(forest)
        paths = StepPaths.from_forest(forest)
        path_id, k, edge = paths.entries()
        parent = forest.parent[edge]
        missing = torch.isnan(values[parent]) & ~torch.isin(parent, forest.probe_node)
        if bool(missing.any()):
            raise ValueError(
                "credit.rule=turning_point needs the value of the state before every SDE step (R_0 is the "
                "pure-ODE reference): use rollout.plan=probed with rollout.probe=ode_completion"
            )
        M = edge.shape[0]
        indicator = torch.zeros(M, dtype=torch.bool)
        d = torch.full((M,), float("nan"))
        gain = torch.full((M,), float("nan"))  # R_n − R_k
        delta = torch.full((M,), float("nan"))
        for rows, pos in paths.by_length().values():
            R = torch.cat([values[parent[pos]], forest.reward[paths.leaf[rows]][:, None]], dim=1)  # [L_n, n+1]
            ind, dd, dl = turning_points(R, self.tie_eps)
            indicator[pos] = ind if self.use_turning_points else torch.zeros_like(ind)
            d[pos], gain[pos], delta[pos] = dd, R[:, -1:] - R[:, :-1], dl[:, None].expand_as(dd)
        valid = torch.isfinite(d) & torch.isfinite(gain)
        indicator &= valid
        found = indicator.clone()
        if self.balance and bool(indicator.any()):
            tp = torch.nonzero(indicator).flatten()
            indicator[tp] = balance_signs(paths.group[path_id[tp]], delta[tp], gain[tp], self.tie_eps)
        reward = torch.where(indicator, gain, d)  # NaN where the path's rewards failed

        edges = torch.unique(edge)
        r_edge = StepPaths.edge_mean(edge, reward, forest.num_nodes)[edges]
        z, zero_var, zero_ratio = zscore_by_step(forest, edges, r_edge, self.eps, self.zero_std_tol)
        train = torch.isfinite(r_edge)  # cells without spread: flat (advantage 0), not weight 0
        pruned = write_edge_credit(forest, edges, z, train, flat=zero_var)
        train = train & ~zero_var & ~pruned

        step = forest.step[parent]
        edge_step = forest.step[forest.parent[edges]]
        sign = sign_eps(delta, self.tie_eps)
        pos, neg = int((found & (sign > 0)).sum()), int((found & (sign < 0)).sum())
        kept_pos, kept_neg = int((indicator & (sign > 0)).sum()), int((indicator & (sign < 0)).sum())
        stats = {
            "tp/rate": float(found[valid].float().mean()) if bool(valid.any()) else 0.0,
            "tp/kept_rate": float(indicator[valid].float().mean()) if bool(valid.any()) else 0.0,
            "tp/pos": float(pos),
            "tp/neg": float(neg),
            "tp/kept_pos": float(kept_pos),
            "tp/kept_neg": float(kept_neg),
            "tp/sign_balance": (pos - neg) / (pos + neg) if pos + neg else 0.0,
            "tp/delta_mean": float(delta[valid & (k == 0)].mean()) if bool((valid & (k == 0)).any()) else 0.0,
            "tp/step_reward_mean": float(reward[valid].mean()) if bool(valid.any()) else 0.0,
            "zero_std_ratio": zero_ratio,
            "skipped_edges": float((~train & ~pruned).sum()),
            "pruned_depth_edges": float(pruned.sum()),
            "adv_abs_mean": float(forest.advantage[edges].abs().mean()) if edges.numel() else 0.0,
        }
        # every step keeps its key when its rewards failed (NaN), so all processes log the same keys
        stats.update(
            per_step_stats("tp/rate", step, torch.where(valid, found.float(), torch.full(found.shape, float("nan"))))
        )
        stats.update(per_step_stats("tp/value", step, values[parent]))
        stats.update(per_step_std("tp/adv_std", edge_step, forest.advantage[edges]))
        return stats
