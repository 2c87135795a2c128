"""The forest's path helpers (a mixin of :class:`~flowrl.rollout.forest.Forest`): walks up and down its edges.

Vectorised: each helper walks the forest level by level (a few tensor ops per level of depth), never node by
node, so trees of thousands of nodes cost O(depth) tensor operations. They read ``parent`` [N], ``logp_old``
[N], ``num_nodes`` and ``leaves()`` of the forest.
"""

from __future__ import annotations

import torch


class ForestPaths:
    """Structure queries over ``parent`` (see the module docstring)."""

    def children(self, n: int) -> torch.Tensor:
        return torch.nonzero(self.parent == n).flatten()

    def num_children(self) -> torch.Tensor:
        """Number of children of every node [N]."""
        return torch.bincount(self.parent[self.parent >= 0], minlength=self.num_nodes)

    def _walk_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth [N], root [N]) of every node: all nodes step up to their parents together, one tensor
        step per level."""
        depth = torch.zeros(self.num_nodes, dtype=torch.long)
        cur = torch.arange(self.num_nodes)
        up = self.parent.clone()
        while True:
            moving = up >= 0
            if not bool(moving.any()):
                return depth, cur
            depth += moving.long()
            cur = torch.where(moving, up, cur)
            up = torch.where(moving, self.parent[up.clamp(min=0)], up)

    def depth(self, n: int | None = None) -> torch.Tensor | int:
        """Number of edges from the root to node ``n`` (or for all nodes [N] when n is None)."""
        if n is not None:
            d = 0
            while int(self.parent[n]) >= 0:
                n = int(self.parent[n])
                d += 1
            return d
        return self._walk_up()[0]

    def root_of(self) -> torch.Tensor:
        """The root above every node [N] (a root is its own root)."""
        return self._walk_up()[1]

    def ancestor_table(self, nodes: torch.Tensor | None = None) -> torch.Tensor:
        """Paths up to the root [M, D+1] of ``nodes`` [M] (default: the leaves): column k holds the
        k-th ancestor (column 0 the node itself), −1 past the root; D = the largest depth among them."""
        nodes = self.leaves() if nodes is None else torch.as_tensor(nodes, dtype=torch.long).reshape(-1)
        columns = [nodes]
        while True:
            prev = columns[-1]
            nxt = torch.where(prev >= 0, self.parent[prev.clamp(min=0)], prev)
            if not bool((nxt >= 0).any()):
                return torch.stack(columns, dim=1)
            columns.append(nxt)

    def ancestors(self, n: int) -> list[int]:
        """Nodes from ``n`` up to its root, n first."""
        path = [int(n)]
        while int(self.parent[path[-1]]) >= 0:
            path.append(int(self.parent[path[-1]]))
        return path

    def descendant_leaves(self, n: int) -> torch.Tensor:
        """Leaves below node ``n`` (``n`` itself if it is a leaf), in node order [k]."""
        leaves = self.leaves()
        if leaves.numel() == 0:
            return leaves
        return leaves[(self.ancestor_table(leaves) == int(n)).any(dim=1)]

    def path_logp(self, n: int | torch.Tensor, leaf: int | torch.Tensor) -> float | torch.Tensor:
        """Sum of edge log-probs along the path n → leaf (excluding the edge into n).

        ``n`` and ``leaf`` are node indices (returns a float) or index tensors [M] (returns fp64 [M],
        pairs computed together). Raises ValueError when a ``leaf`` is not ``n`` or below it."""
        if not isinstance(n, torch.Tensor) and not isinstance(leaf, torch.Tensor):
            total, cur = 0.0, int(leaf)
            while cur != n:
                if cur < 0:
                    raise ValueError(f"node {leaf} is not a descendant of {n}")
                total += float(self.logp_old[cur])
                cur = int(self.parent[cur])
            return total
        n = torch.as_tensor(n, dtype=torch.long).reshape(-1)
        leaf = torch.as_tensor(leaf, dtype=torch.long).reshape(-1)
        n, leaf = torch.broadcast_tensors(n, leaf)
        table = self.ancestor_table(leaf)  # [M, D+1]
        hit = table == n[:, None]
        if not bool(hit.any(dim=1).all()):
            bad = int(torch.nonzero(~hit.any(dim=1)).flatten()[0])
            raise ValueError(f"node {int(leaf[bad])} is not a descendant of {int(n[bad])}")
        below = torch.cumsum(hit.long(), dim=1) == 0  # columns strictly below n on the path
        logp = self.logp_old.double()[table.clamp(min=0)]
        return torch.where(below & (table >= 0), logp, torch.zeros_like(logp)).sum(dim=1)

    def leaf_of_each_node(self) -> torch.Tensor:
        """The unique leaf below each node [N], or −1 where several leaves lie below (a node with a
        branch point at or under it, e.g. the shared trunk of a group). For chains every node has one."""
        leaf_of = torch.full((self.num_nodes,), -1, dtype=torch.long)
        leaves = self.leaves()
        if leaves.numel() == 0:
            return leaf_of
        table = self.ancestor_table(leaves)  # [L, D+1]
        owner = leaves[:, None].expand_as(table)
        on_path = table >= 0
        nodes, owners = table[on_path], owner[on_path]
        n_leaves = torch.bincount(nodes, minlength=self.num_nodes)
        leaf_of[nodes] = owners  # several writers only where n_leaves > 1, and those are reset below
        return torch.where(n_leaves == 1, leaf_of, torch.full_like(leaf_of, -1))
