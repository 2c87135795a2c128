"""The statistics of the explore plan (:mod:`flowrl.rollout.explore`): which seeds of a preview pool are kept
(:func:`select_seeds`), the rank correlations between preview and regenerated rewards (:func:`spearman`,
:func:`kendall`) and the per-iteration metrics of the records its rollouts leave on their forests
(:func:`explore_metrics`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from flowrl.core.choices import choose
from flowrl.rollout.forest import Forest

SELECTIONS = ("extremes", "top_k", "spread")


def select_seeds(rewards: torch.Tensor, k: int, mode: str = "extremes") -> torch.Tensor:
    """Indices [k] into a pool of preview ``rewards`` [N] of the seeds to keep.

    ``extremes``: the ⌈k/2⌉ best (best first), then the ⌊k/2⌋ worst (worst first); ``top_k``: the k
    best, best first; ``spread``: k seeds at evenly spaced positions of the ranking (best first).
    Ties keep pool order; NaN rewards (failed scores) rank last and are taken only when the valid ones
    run out.
    """
    choose("rollout.select", mode, SELECTIONS)
    n = int(rewards.numel())
    if not 1 <= k <= n:
        raise ValueError(f"cannot keep {k} of a pool of {n}")
    values = rewards.detach().float().cpu().tolist()
    valid = sorted((i for i in range(n) if not math.isnan(values[i])), key=lambda i: (-values[i], i))
    failed = [i for i in range(n) if math.isnan(values[i])]
    if mode == "top_k" or len(valid) <= k:
        chosen = (valid + failed)[:k]
    elif mode == "extremes":
        best = valid[: (k + 1) // 2]
        chosen = best + valid[len(best) :][::-1][: k // 2]
    else:
        m = len(valid)
        chosen = [valid[round(j * (m - 1) / (k - 1))] for j in range(k)] if k > 1 else valid[:1]
    return torch.tensor(chosen, dtype=torch.long)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank), float64 [n]."""
    x = x.double()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(x.numel(), dtype=torch.float64)
    for value in torch.unique(x):
        tied = x == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's ρ of two [n] vectors (Pearson of average ranks); NaN if n < 2 or a side is constant."""
    if a.numel() < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denom if denom > 0 else float("nan")


def kendall(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's τ-b of two [n] vectors (ties corrected); NaN if n < 2 or a side is constant."""
    if a.numel() < 2:
        return float("nan")
    da = torch.sign(a.double()[:, None] - a.double()[None, :])
    db = torch.sign(b.double()[:, None] - b.double()[None, :])
    upper = torch.triu(torch.ones_like(da, dtype=torch.bool), diagonal=1)
    s = float((da * db)[upper].sum())
    na, nb = float((da[upper] != 0).sum()), float((db[upper] != 0).sum())
    return s / math.sqrt(na * nb) if na > 0 and nb > 0 else float("nan")


def _nanmean(values: list[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return sum(ok) / len(ok) if ok else float("nan")


RECORDS = "explore"
"""The key of ``forest.meta`` under which each explore rollout leaves its record (a list: one per rollout chunk)."""

STAGE_TIMES = (
    "time/explore_preview",
    "time/explore_score",
    "time/explore_select",
    "time/explore_regenerate",
    "time/explore_sync",
)


def explore_metrics(forest: Forest) -> dict[str, float]:
    """Rank fidelity and stage times (``explore/…``, ``time/explore_…``) of the rollouts whose records
    ``forest.meta["explore"]`` carries; ``forest`` must be scored (rewards on its leaves). {} without records."""
    pending: list[dict[str, Any]] = list(forest.meta.get(RECORDS, []))
    if not pending:
        return {}
    pooled_p, pooled_r, rho, tau, sep, hits = _fidelity(pending, forest)
    return _summary(pending, pooled_p, pooled_r, rho, tau, sep, hits)


def _fidelity(pending: list[dict[str, Any]], forest: Forest):
    """Per kept group: its (preview, regenerated) reward pairs, their ρ and τ, the upper half's separation and hit
    rate."""
    regen = _reward_per_root_seed(forest)
    pooled_p, pooled_r, rho, tau, sep, hits = [], [], [], [], [], []
    for record in pending:
        for group in record["kept"]:
            pairs = [(record["preview"][s], regen[s]) for s in group if s in regen and not math.isnan(regen[s])]
            if not pairs:
                continue
            p = torch.tensor([a for a, _ in pairs])
            r = torch.tensor([b for _, b in pairs])
            pooled_p.append(p)
            pooled_r.append(r)
            rho.append(spearman(p, r))
            tau.append(kendall(p, r))
            if len(pairs) >= 2:  # kept seeds in preview order: upper half vs lower half
                order = torch.argsort(p, descending=True, stable=True)
                upper, lower = order[: (len(pairs) + 1) // 2], order[(len(pairs) + 1) // 2 :]
                if lower.numel():
                    sep.append(float(r[upper].mean() - r[lower].mean()))
                top = set(torch.argsort(r, descending=True, stable=True)[: upper.numel()].tolist())
                hits.append(len(top & set(upper.tolist())) / upper.numel())
    return pooled_p, pooled_r, rho, tau, sep, hits


def _summary(pending, pooled_p, pooled_r, rho, tau, sep, hits) -> dict[str, float]:
    out: dict[str, float] = {}
    p_all = torch.cat(pooled_p) if pooled_p else torch.zeros(0)
    r_all = torch.cat(pooled_r) if pooled_r else torch.zeros(0)
    out["explore/spearman"] = spearman(p_all, r_all)
    out["explore/kendall"] = kendall(p_all, r_all)
    out["explore/spearman_in_group"] = _nanmean(rho)
    out["explore/kendall_in_group"] = _nanmean(tau)
    out["explore/separation"] = _nanmean(sep)
    out["explore/top_half_hit_rate"] = _nanmean(hits)
    pool = torch.cat([r["pool_rewards"] for r in pending])
    out["explore/pool_reward_mean"] = float(pool.nanmean())
    out["explore/kept_preview_mean"] = float(p_all.mean()) if p_all.numel() else float("nan")
    out["explore/kept_regenerated_mean"] = float(r_all.mean()) if r_all.numel() else float("nan")
    t_preview = sum(r["time/explore_preview"] for r in pending)
    t_full = sum(r["time/explore_regenerate"] for r in pending)
    explorer_rate = sum(r["explorer_forwards"] for r in pending) / t_preview if t_preview > 0 else float("nan")
    full_rate = sum(r["full_forwards"] for r in pending) / t_full if t_full > 0 else float("nan")
    out["explore/explorer_forwards_per_s"] = explorer_rate
    out["explore/full_forwards_per_s"] = full_rate
    out["explore/explorer_speedup"] = explorer_rate / full_rate if full_rate and full_rate > 0 else float("nan")
    for key in STAGE_TIMES:
        out[key] = sum(r[key] for r in pending)
    return out


def _reward_per_root_seed(forest: Forest) -> dict[int, float]:
    """Mean reward of the leaves below each root, by the root's seed (chains: the chain's reward)."""
    leaves = forest.leaves()
    seeds = forest.seed[leaves].tolist()  # every node carries its root's seed
    sums: dict[int, list[float]] = {}
    for seed, r in zip(seeds, forest.reward[leaves].tolist()):
        sums.setdefault(int(seed), []).append(float(r))
    return {s: sum(v) / len(v) for s, v in sums.items()}
