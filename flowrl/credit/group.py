"""Group-relative advantages (docs/algorithms.md, "Group advantages"): Flow-GRPO, DanceGRPO, MixGRPO, MC-GRPO.

A_i = (r_i − b_g)/(scale + eps) for sample i of prompt group g, written on every edge of sample
i's chain. Baseline ``mean`` or ``median`` (MC-GRPO: the median sample itself is dropped from
training); scale ``group`` std, ``global`` std over the whole batch (all processes), ``mad`` or
``none``. Several rewards are combined into the leaves' ``reward`` by the MultiReward before credit
(weighted raw sum, or ``reward_normalize: group`` for the weighted sum of each reward's group
z-scores, DanceGRPO's advantage aggregation). Groups without reward spread get 0 and are marked
``flat`` (policy objectives skip their edges, counted in ``skipped_edges``; forward-process objectives
keep their leaves); MC-GRPO's median sample and failed rewards get weight 0 (never trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.core.choices import choice
from flowrl.credit.base import CreditRule, Gather
from flowrl.rollout.forest import Forest, flat_rows

BASELINES = ("mean", "median")
SCALES = ("group", "global", "mad", "none")


@dataclass
class GroupAdvantage(CreditRule):
    """Credit rule for chains: one advantage per sample, broadcast to its trainable edges and its leaf. Chains
    may hang from a shared deterministic trunk (``shared_noise``); trunk nodes get advantage 0, weight 0."""

    baseline: str = choice("mean", BASELINES)  # b_g of A = (r − b_g)/(scale + eps): mean | median (MC-GRPO: the
    # group's median sample gets advantage 0 and is not trained)
    scale: str = choice("global", SCALES)  # group (the group's std, ddof 0) | global (the std over the whole batch,
    # all processes: Flow-GRPO) | mad (median |r − median r| + 1e-3) | none (1: with reward_normalize group,
    # DanceGRPO/MixGRPO's aggregation)
    eps: float = 1e-4  # added to the scale: A = (r − b_g)/(scale + eps)
    zero_std_tol: float = 1e-6  # a group whose rewards span ≤ this (max − min) has no spread: advantage 0, marked
    # flat (policy objectives skip its edges)

    # ---- pure math on [P, G] reward tables ---------------------------------------------------
    def normalise(
        self, rewards: torch.Tensor, gather: Gather | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advantages for a reward table [P, G] (P groups of G samples).

        Returns ``(advantages [P, G], zero_var [P] bool, dropped [P, G] bool)``; ``dropped`` marks
        MC-GRPO's median sample and samples whose reward is NaN (a failed remote batch masked with
        ``on_error: nan``): those are replaced by their group's mean for the statistics, get
        advantage 0 and are not trained. ``gather`` concatenates a tensor across processes (for ``global``).
        """
        r = rewards.float()
        failed = torch.isnan(r)  # e.g. a remote reward's masked batch: excluded, never trained
        if failed.any():
            fill = torch.nan_to_num(r.nanmean(dim=1, keepdim=True), nan=0.0).expand_as(r)
            r = torch.where(failed, fill, r)
        if self.baseline == "mean":
            base = r.mean(dim=1, keepdim=True)
            dropped = torch.zeros_like(r, dtype=torch.bool)
        else:
            base = r.median(dim=1, keepdim=True).values
            # the (lower) median sample: its advantage is 0 by construction and it is not trained
            order = r.argsort(dim=1, stable=True)
            mid = order[:, (r.shape[1] - 1) // 2]
            dropped = torch.zeros_like(r, dtype=torch.bool)
            dropped[torch.arange(r.shape[0]), mid] = True
        zero_var = flat_rows(r, ~failed, self.zero_std_tol)
        if self.scale == "group":
            scale = r.std(dim=1, unbiased=False, keepdim=True)
        elif self.scale == "global":
            everything = r.flatten() if gather is None else gather(r.flatten())
            scale = everything.std(unbiased=False).reshape(1, 1).expand(r.shape[0], 1)
        elif self.scale == "mad":
            med = r.median(dim=1, keepdim=True).values  # MAD is about the median whatever the baseline
            scale = (r - med).abs().median(dim=1, keepdim=True).values + 1e-3
        else:
            scale = torch.ones_like(base)
        adv = (r - base) / (scale + self.eps)
        adv = torch.where(zero_var[:, None] | failed, torch.zeros_like(adv), adv)
        return adv, zero_var, dropped | failed

    # ---- on the forest ----------------------------------------------------------------------
    def assign(self, forest: Forest, gather: Gather | None = None) -> dict[str, float]:
        """Write ``advantage`` and ``weight`` on every edge of ``forest`` from its leaves' ``reward``.

        Prompt groups must have equal sizes; their leaves may come in any node order (a group's leaves are
        taken in node order, e.g. the ODE plan's teacher share puts the teacher's chains after the policy's).
        Returns statistics.
        """
        leaves = forest.leaves()
        leaves = leaves[torch.argsort(forest.group[leaves], stable=True)]
        groups = forest.group[leaves]
        num_groups = int(groups.max()) + 1 if leaves.numel() else 0
        if leaves.numel() % max(num_groups, 1) != 0 or not torch.equal(
            groups, torch.arange(num_groups).repeat_interleave(leaves.numel() // max(num_groups, 1))
        ):
            raise ValueError("group credit needs prompt groups of equal sizes")
        G = leaves.numel() // num_groups
        adv, zero_var, dropped = self.normalise(forest.reward[leaves].reshape(num_groups, G), gather)
        leaf_of = forest.leaf_of_each_node()
        edges = torch.nonzero((forest.parent >= 0) & forest.stochastic).flatten()
        if bool((leaf_of[edges] < 0).any()):
            raise ValueError(
                "group credit needs every stochastic edge to lead to one leaf (chains, or chains below a "
                "shared deterministic trunk); this forest branches below one: use a tree credit rule"
            )
        position = torch.full((forest.num_nodes,), -1, dtype=torch.long)
        position[leaves] = torch.arange(leaves.numel())
        on_chain = leaf_of >= 0  # trunk nodes above a group's branch point have several leaves below
        node_pos = position[leaf_of.clamp(min=0)]  # the leaf's sample index (meaningful on chains only)
        flat_adv = adv.flatten()
        flat = zero_var[:, None].expand(-1, G).flatten()
        forest.advantage = torch.where(on_chain, flat_adv[node_pos], torch.zeros(forest.num_nodes))
        forest.weight = (on_chain & ~dropped.flatten()[node_pos]).float()
        forest.flat = (on_chain & flat[node_pos]).float()
        return {
            "zero_std_ratio": float(zero_var.float().mean()) if num_groups else 0.0,
            "skipped_edges": int(((forest.weight[edges] == 0) | (forest.flat[edges] > 0)).sum()),
            "adv_abs_mean": float(flat_adv.abs().mean()) if flat_adv.numel() else 0.0,
        }
