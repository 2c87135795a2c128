"""Tree credit: rewards fused from the leaves up, depth-wise advantages, width pruning (docs/trees.md).

Reads any forest (BranchGRPO / Dynamic-TreeRPO trees from :class:`flowrl.rollout.tree.Tree`, or chains
below a shared trunk) through the vectorised structure helpers; no Python loop walks the nodes.

1. **Fusion** to every node n from its descendant leaves ℓ (rewards r_ℓ, NaN rewards left out):
   ``mean`` r̄(n) = mean_ℓ r_ℓ, or ``path_softmax`` r̄(n) = Σ_ℓ softmax_ℓ(β·logp_path(n→ℓ))·r_ℓ with
   logp_path the sum of the edge log-probs from n down to ℓ (paper Eq. 3, β = ``fusion_beta``).
   Computed as softmax_ℓ(β·c_ℓ), c_ℓ = log-prob of the whole root→ℓ path: the terms above n are the
   same for every ℓ below n and cancel in the softmax. A leaf's r̄ is its reward.
2. **Depth-wise advantage**: A(n) = (r̄(n) − mean_d)/(std_d + ``eps``) over the nodes at n's depth d of
   n's tree (``depth_norm_scope: tree``, default; a tree = the nodes below one root) or of every tree
   of the iteration on every process (``batch``, through ``gather``). std with ddof 0 (as the group
   rule). A set of nodes at one depth with one node, or with a spread ≤ ``zero_std_tol``, gives 0 and
   its nodes are marked ``flat`` (policy objectives skip those edges, counted in ``skipped_edges``). The
   edge n→child gets A(child).
3. **Width pruning** (backward only) of the post-split chains — a leaf's chain is the edges on its path
   below its last branch point (the split edge included): ``parent_top1`` keeps, among the sibling
   chains hanging from one branch point, only the one with the highest fused reward (ties: the first);
   ``extremes_b`` keeps, per tree, the chains of the ``width_b`` best and ``width_b`` worst leaves.

Width-pruned chains (their edges and their leaf) and nodes without a valid fused value get weight 0, so
no objective trains them (a forward-process objective reading the leaves included). Edges the tree plan's
depth pruning left untrainable (``forest.trainable`` 0, set at rollout, see :mod:`flowrl.rollout.tree`) are
counted as ``pruned_depth_edges``; the leaves below them are still trained by leaf objectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowrl.core.choices import choice
from flowrl.credit.base import CreditRule, Gather, set_stats, standardize
from flowrl.rollout.forest import Forest

FUSIONS = ("mean", "path_softmax")
SCOPES = ("tree", "batch")
WIDTH_PRUNES = ("none", "parent_top1", "extremes_b")


@dataclass
class Fusion:
    """Fused rewards of all nodes and the entropy of the fusion weights (see :func:`fuse`)."""

    value: torch.Tensor  # [N] fp64, NaN where no valid leaf lies below
    entropy: torch.Tensor  # [N] fp64 nats of the weights over the node's descendant leaves (0 for one leaf)
    count: torch.Tensor  # [N] descendant leaves with a finite reward


def fuse(forest: Forest, beta: float) -> Fusion:
    """r̄(n) = Σ_ℓ w_ℓ(n)·r_ℓ with w(n) = softmax over n's descendant leaves of β·(path log-prob);
    β = 0 is the plain mean. Vectorised over (leaf, ancestor) pairs."""
    N = forest.num_nodes
    leaves = forest.leaves()
    reward = forest.reward[leaves].double()
    ok = torch.isfinite(reward)
    leaves, reward = leaves[ok], reward[ok]
    value = torch.full((N,), float("nan"), dtype=torch.float64)
    entropy = torch.zeros(N, dtype=torch.float64)
    count = torch.zeros(N, dtype=torch.long)
    if leaves.numel() == 0:
        return Fusion(value, entropy, count)
    table = forest.ancestor_table(leaves)  # [L, D+1]
    on = table >= 0
    path = torch.where(on, forest.logp_old.double()[table.clamp(min=0)], torch.zeros(table.shape, dtype=torch.float64))
    score = beta * path.sum(dim=1)  # β·c_ℓ [L]
    node = table[on]  # (ancestor, leaf) pairs, flattened
    pair_score = score[:, None].expand_as(table)[on]
    pair_reward = reward[:, None].expand_as(table)[on]
    top = torch.full((N,), -math.inf, dtype=torch.float64).scatter_reduce(0, node, pair_score, "amax")
    u = pair_score - top[node]  # ≤ 0
    e = torch.exp(u)
    z = torch.zeros(N, dtype=torch.float64).index_add_(0, node, e)
    num = torch.zeros(N, dtype=torch.float64).index_add_(0, node, e * pair_reward)
    eu = torch.zeros(N, dtype=torch.float64).index_add_(0, node, e * u)
    count = torch.bincount(node, minlength=N)
    has = count > 0
    value[has] = num[has] / z[has]
    entropy[has] = torch.log(z[has]) - eu[has] / z[has]  # −Σ w log w with w = e^u / z
    return Fusion(value, entropy.clamp(min=0.0), count)


@dataclass
class TreeAdvantage(CreditRule):
    """Credit rule for trees (docs/trees.md, "The credit rule's keys"): fusion, depth-wise advantages, width pruning;
    see the
    module docstring for every key."""

    fusion: str = choice("mean", FUSIONS)  # a node's reward r̄(n) from the leaves below it: mean | path_softmax
    # (BranchGRPO's Eq. 3: the leaves weighted by softmax(β·path log-prob from n), β = fusion_beta)
    fusion_beta: float = 1.0  # β of path_softmax, the weight of the path log-probs (paper: 1; 0 = the plain mean)
    depth_norm_scope: str = choice("tree", SCOPES)  # the nodes a depth-wise advantage A(n) = (r̄(n) − mean_d)/(std_d
    # + eps) is standardised over: tree (n's depth in n's tree) | batch (that depth in every tree of the
    # iteration, all processes)
    width_prune: str = choice("none", WIDTH_PRUNES)  # width pruning (backward only) of the post-split chains:
    # none | parent_top1 (of the sibling chains under one branch point, only the best by fused reward trained) |
    # extremes_b (per tree, only the chains of the width_b best and width_b worst leaves trained)
    width_b: int = 4  # extremes_b: chains of the b best and b worst leaves per tree are kept
    eps: float = 1e-4  # added to the depth's std: A = (r̄ − mean_d)/(std_d + eps)
    zero_std_tol: float = 1e-6  # a depth set with one node, or whose fused rewards span ≤ this, is flat: A = 0,
    # its edges skipped

    def unread_fields(self) -> dict[str, str]:
        """``fusion_beta`` without path-softmax fusion, ``width_b`` without extremes_b width pruning."""
        out = {}
        if self.fusion != "path_softmax":
            out["fusion_beta"] = f"credit.fusion={self.fusion!r}: only path_softmax weighs paths by β"
        if self.width_prune != "extremes_b":
            out["width_b"] = f"credit.width_prune={self.width_prune!r}: only extremes_b keeps b best and worst leaves"
        return out

    def __post_init__(self) -> None:
        if self.width_b < 1:
            raise ValueError(f"credit.width_b={self.width_b} must be >= 1")

    # ---- pieces ---------------------------------------------------------------------------------
    def depth_advantages(
        self, value: torch.Tensor, depth: torch.Tensor, tree: torch.Tensor, gather: Gather | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """A [N] (fp64) and ``zero`` [N] bool (the node's depth set has one node or no spread) from fused
        values [N] (NaN = no valid leaf: A 0), depths [N] and tree ids [N]."""
        ok = torch.isfinite(value)
        D = int(depth.max()) + 1 if depth.numel() else 1
        if self.depth_norm_scope == "tree":
            key = tree * D + depth
            _, key = torch.unique(key, return_inverse=True)
            K = int(key.max()) + 1 if key.numel() else 0
            stats = set_stats(value, key, ok, K)
        else:  # every tree of the iteration on every process: gather per-depth sufficient statistics
            if gather is not None:
                D = int(gather(torch.tensor([D], dtype=torch.long)).max())
            key = depth
            local = set_stats(value, key, ok, D)
            packed = torch.stack([local["count"], local["sum"], local["sumsq"], local["min"], local["max"]], dim=1)
            if gather is not None:
                packed = gather(packed).reshape(-1, D, 5)
                packed = torch.stack(
                    [
                        packed[..., 0].sum(0),
                        packed[..., 1].sum(0),
                        packed[..., 2].sum(0),
                        packed[..., 3].min(0).values,
                        packed[..., 4].max(0).values,
                    ],
                    dim=1,
                )
            stats = {
                "count": packed[:, 0],
                "sum": packed[:, 1],
                "sumsq": packed[:, 2],
                "min": packed[:, 3],
                "max": packed[:, 4],
            }
            n = stats["count"].clamp(min=1)
            stats["mean"] = stats["sum"] / n
            stats["std"] = (stats["sumsq"] / n - stats["mean"] ** 2).clamp(min=0).sqrt()
        adv, flat = standardize(value, key, stats, self.eps, self.zero_std_tol)
        sets = stats["count"] >= 2
        return adv, flat[key] | ~ok, {"zero_std_ratio": float((flat & sets).sum()) / max(int(sets.sum()), 1)}

    def width_keep(self, forest: Forest, value: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
        """Which edges width pruning keeps [N] bool (True off the post-split chains)."""
        keep = torch.ones(forest.num_nodes, dtype=torch.bool)
        if self.width_prune == "none":
            return keep
        leaf_of = forest.leaf_of_each_node()
        leaves = forest.leaves()
        r = value[leaves]
        valid = torch.isfinite(r)
        kept_leaf = torch.zeros(forest.num_nodes, dtype=torch.bool)
        if self.width_prune == "parent_top1":
            table = forest.ancestor_table(leaves)  # [L, D+1]
            chain = (table >= 0) & (leaf_of[table.clamp(min=0)] == leaves[:, None])
            length = chain.sum(dim=1)  # nodes on the leaf's chain: the leaf and up to below its branch point
            padded = torch.cat([table, torch.full((table.shape[0], 1), -1, dtype=table.dtype)], dim=1)
            branch = padded.gather(1, length[:, None])[:, 0]  # the branch point (−1: the chain reaches the root)
            rival = valid & (branch >= 0)  # lone chains (no branch point) take no part in any sibling set
            rr = torch.where(rival, r, torch.full_like(r, -math.inf))
            slot = branch.clamp(min=0)
            best = torch.full((forest.num_nodes,), -math.inf, dtype=rr.dtype).scatter_reduce(0, slot, rr, "amax")
            pos = torch.arange(leaves.numel())
            is_best = rival & (rr == best[slot])
            first = torch.full((forest.num_nodes,), leaves.numel()).scatter_reduce(
                0, slot[is_best], pos[is_best], "amin"
            )
            winner = (is_best & (pos == first[slot])) | (valid & (branch < 0))  # a lone chain has no rival
            kept_leaf[leaves[winner]] = True
        else:  # extremes_b: per tree, the b best and b worst leaves
            lv, rv, tv = leaves[valid], r[valid], tree[leaves[valid]]
            order = torch.argsort(rv, stable=True)
            order = order[torch.argsort(tv[order], stable=True)]  # by tree, then reward
            sorted_tree = tv[order]
            counts = torch.bincount(sorted_tree)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel()) - starts[sorted_tree]
            total = counts[sorted_tree]
            extreme = (rank < self.width_b) | (rank >= total - self.width_b)
            kept_leaf[lv[order[extreme]]] = True
        on_chain = leaf_of >= 0
        keep = ~on_chain | kept_leaf[leaf_of.clamp(min=0)]
        return keep

    # ---- on the forest ----------------------------------------------------------------------
    def assign(self, forest: Forest, gather: Gather | None = None) -> dict[str, float]:
        """Write ``advantage`` (A of each edge's child) and ``weight`` (1 unless depth-pruned by the plan,
        width-pruned or skipped) on every node; return statistics for the metrics log."""
        depth, tree = forest.depth(), forest.root_of()
        fusion = fuse(forest, self.fusion_beta if self.fusion == "path_softmax" else 0.0)
        adv, zero, stats = self.depth_advantages(fusion.value, depth, tree, gather)
        keep = self.width_keep(forest, fusion.value, tree)
        edge = (forest.parent >= 0) & forest.stochastic
        depth_pruned = edge & (forest.trainable <= 0)
        width_pruned = edge & ~depth_pruned & ~keep
        skipped = edge & ~depth_pruned & ~width_pruned & zero
        forest.advantage = torch.where(forest.parent >= 0, adv, torch.zeros_like(adv)).float()
        # weight 0: width-pruned or without a valid value (a leaf too); flat: no spread in its depth set. Depth
        # pruning stays in the plan's ``trainable`` column (it concerns the edge only, never the leaf below it).
        forest.weight = (keep & torch.isfinite(fusion.value)).float()
        forest.flat = (zero & torch.isfinite(fusion.value)).float()
        trained = edge & ~depth_pruned & (forest.weight > 0) & (forest.flat <= 0)
        branching = fusion.count >= 2
        out = {
            "pruned_edges": int((depth_pruned | width_pruned).sum()),
            "pruned_depth_edges": int(depth_pruned.sum()),
            "pruned_width_edges": int(width_pruned.sum()),
            "skipped_edges": int(skipped.sum()),
            "zero_std_ratio": stats["zero_std_ratio"],
            "adv_abs_mean": float(adv[trained].abs().mean()) if bool(trained.any()) else 0.0,
            "fusion_entropy": float(fusion.entropy[branching].mean()) if bool(branching.any()) else 0.0,
            "fusion_entropy_norm": float((fusion.entropy[branching] / fusion.count[branching].double().log()).mean())
            if bool(branching.any())
            else 0.0,
        }
        edge_depth = depth[edge]
        for d in torch.unique(edge_depth).tolist():
            out[f"adv_std/depth_{d:02d}"] = float(adv[edge & (depth == d)].std(unbiased=False))
        return out
