"""The trajectory forest: one flat, tensor-backed structure for every rollout shape (DESIGN.md).

Nodes are latent states; every non-root node n has one incoming edge parent[n] → n, and the edge's
data is stored on its child n. Independent chains are unbranched trees, BranchGRPO trees are K-ary,
Sol-RL's regenerated samples are chains whose roots were selected from a larger pool.

Per node (N nodes): ``latents`` fp32 [N, C, H, W], ``sigma`` [N] (noise level of the state; 1 = pure
noise), ``step`` [N] (schedule index; 0 = pure noise), ``parent`` [N] (-1 for roots), ``group`` [N]
(prompt group), ``seed`` [N] (seed of the node's root: ``model.noise([seed])`` rebuilds it).
Per edge into n: ``logp_old`` [N], ``std`` [N], ``stochastic`` [N] (SDE edge, trainable),
``kernel`` [N] (index into :data:`EDGE_KERNELS`), ``eta`` [N] (the noise level used), ``batch`` [N]
(id of the rollout forward that produced the velocity at the parent: replay uses the same layout).
Outcomes (allocated with the nodes, kept by :meth:`merge`, never wiped): ``reward`` [N] (combined
reward of a leaf; NaN elsewhere), ``value`` [N] (combined reward of a probed intermediate state; NaN if
unset), ``reward_components[name]`` [N] (each reward term's raw score on every scored node),
``advantage`` [N] (0) and ``weight`` [N] (1), written by credit rules (weight 0 = edge skipped);
``trainable`` [N] (1), written by the plan (0 = an edge its layout leaves untrained, e.g. a tree's depth
pruning): credit rules never overwrite it, and :meth:`edges` skips an edge that either column zeroes;
``from_teacher`` [N] (0; 1 on nodes a guided teacher sampled, the ODE plan's ``teacher_share``).

Scoring: leaves are always scored (their latents are clean samples); a plan may ask for intermediate
states to be scored too with :meth:`add_probe` (node, clean-latent estimate: an ODE completion, an x̂0
projection). :meth:`score_requests` lists both; the trainer decodes and scores them and records the
results with :meth:`record_scores` and :meth:`combine_scores`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from flowrl import sde

EDGE_KERNELS: list[str] = list(sde.KERNELS) + ["dpm2"]  # a kernel registered later is appended on first use


def kernel_index(name: str) -> int:
    """The index of edge kernel ``name`` in :data:`EDGE_KERNELS` (the forest's ``kernel`` column)."""
    if name not in EDGE_KERNELS:
        EDGE_KERNELS.append(name)
    return EDGE_KERNELS.index(name)
_NODE_FIELDS = ("sigma", "step", "parent", "group", "seed", "logp_old", "std", "stochastic", "kernel", "eta", "batch")
_OUTCOME_DEFAULTS = {"reward": float("nan"), "value": float("nan"), "advantage": 0.0, "weight": 1.0, "trainable": 1.0,
                     "from_teacher": 0.0}


@dataclass
class Forest:
    """Trajectory forest of one rollout (see module docstring). Build with :meth:`add_roots` /
    :meth:`add_children`, then read through the helpers."""

    prompts: list[str]
    guidance: float = 1.0
    reduction: str = "mean"  # how edge log-probs were reduced over latent elements (replay uses the same)
    probe_x0: bool = False  # its probes are x̂0 projections of states reached by SDE edges (probed's x0_projection)
    observers: tuple = field(default=(), repr=False, compare=False)  # RolloutContext.observers, while rolling out
    latents: torch.Tensor | None = None
    sigma: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    step: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    parent: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    group: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    seed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    logp_old: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    std: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    stochastic: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    kernel: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    eta: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    batch: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    counters: dict[str, int] = field(default_factory=lambda: {"forwards": 0, "nfe": 0, "model_calls": 0})
    reward: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    value: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    advantage: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    weight: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    trainable: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    from_teacher: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    probe_node: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    _latent_blocks: list[torch.Tensor] = field(default_factory=list, repr=False)
    _probe_blocks: list[torch.Tensor] = field(default_factory=list, repr=False)
    _next_batch_id: int = 0

    # ---- building -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return int(self.step.shape[0])

    def _append(self, latents: torch.Tensor, **cols: torch.Tensor) -> torch.Tensor:
        n0, n = self.num_nodes, latents.shape[0]
        self._latent_blocks.append(latents.detach().float())
        self.latents = None  # concatenated lazily
        for name in _NODE_FIELDS:
            old = getattr(self, name)
            new = torch.as_tensor(cols[name]).to(dtype=old.dtype).reshape(n).cpu()
            setattr(self, name, torch.cat([old, new]))
        for name, default in _OUTCOME_DEFAULTS.items():
            new = cols[name].float().reshape(n).cpu() if name in cols else torch.full((n,), default)
            setattr(self, name, torch.cat([getattr(self, name), new]))
        for name, column in self.reward_components.items():
            self.reward_components[name] = torch.cat([column, torch.full((n,), float("nan"))])
        return torch.arange(n0, n0 + n)

    def add_roots(self, latents: torch.Tensor, group: Sequence[int] | torch.Tensor, seed: Sequence[int] | torch.Tensor,
                  sigma: float = 1.0, step: int = 0) -> torch.Tensor:
        """Add roots (latents [R, C, H, W]); returns their node indices [R]."""
        r = latents.shape[0]
        return self._append(
            latents, sigma=torch.full((r,), float(sigma)), step=torch.full((r,), step), parent=torch.full((r,), -1),
            group=torch.as_tensor(group), seed=torch.as_tensor(seed), logp_old=torch.zeros(r), std=torch.zeros(r),
            stochastic=torch.zeros(r, dtype=torch.bool), kernel=torch.zeros(r), eta=torch.zeros(r),
            batch=torch.full((r,), -1),
        )

    def new_batch_id(self) -> int:
        """A fresh id for one rollout forward (all edges whose parent velocity it computed share it)."""
        self._next_batch_id += 1
        return self._next_batch_id - 1

    def add_children(self, parents: torch.Tensor, latents: torch.Tensor, sigma: float | torch.Tensor, step: int | torch.Tensor,
                     logp: torch.Tensor, std: torch.Tensor, kernel: str, eta: float | torch.Tensor,
                     batch: int | torch.Tensor) -> torch.Tensor:
        """Add one child per entry of ``parents`` [M] with states ``latents`` [M, C, H, W] reached by
        a ``kernel`` edge (log-prob ``logp`` [M], std ``std`` [M]). Returns the new node indices [M]."""
        parents = torch.as_tensor(parents, dtype=torch.long).cpu()
        m = parents.shape[0]

        def column(value, dtype=torch.float32) -> torch.Tensor:  # a scalar broadcast to [M], or [M] as is
            t = torch.as_tensor(value, dtype=dtype).cpu()
            return t.expand(m) if t.ndim == 0 else t

        std = std.detach().float().cpu()
        return self._append(
            latents, sigma=column(sigma), step=column(step, torch.long), parent=parents, group=self.group[parents],
            seed=self.seed[parents], logp_old=logp.detach().float().cpu(), std=std,
            stochastic=(std > 0) & (kernel != "ode"), kernel=column(kernel_index(kernel), torch.long),
            eta=column(eta), batch=column(batch, torch.long),
        )

    def count_forward(self, rows: int, cfg: bool) -> None:
        """Record one model call over ``rows`` states (each a forward; ×2 NFE with CFG)."""
        self.counters["forwards"] += rows
        self.counters["nfe"] += rows * (2 if cfg else 1)
        self.counters["model_calls"] += 1

    def all_latents(self) -> torch.Tensor:
        """Latents [N, C, H, W] (concatenated once, then cached)."""
        if self.latents is None or self.latents.shape[0] != self.num_nodes:
            self.latents = torch.cat(self._latent_blocks) if len(self._latent_blocks) > 1 else self._latent_blocks[0]
            self._latent_blocks = [self.latents]
        return self.latents

    @staticmethod
    def merge(forests: Sequence["Forest"], same_prompts: bool = False) -> "Forest":
        """One forest from several rolled out separately (prompt groups renumbered in order, node,
        parent, probe and rollout-batch indices offset). Outcome columns, reward components and probes
        are carried. ``same_prompts``: the forests are parts of the same prompt groups (each holds some of
        every group's chains): groups keep their numbers and the prompts are listed once."""
        if len(forests) == 1:
            return forests[0]
        if same_prompts and any(f.prompts != forests[0].prompts for f in forests):
            raise ValueError("merge(same_prompts=True) needs forests over the same prompts, in the same order")
        for attr in ("guidance", "reduction"):
            if len({getattr(f, attr) for f in forests}) != 1:
                raise ValueError(f"cannot merge forests sampled with different {attr}")
        prompts = list(forests[0].prompts) if same_prompts else [p for f in forests for p in f.prompts]
        out = Forest(prompts=prompts, guidance=forests[0].guidance,
                     reduction=forests[0].reduction, probe_x0=forests[0].probe_x0)
        names = list(dict.fromkeys(k for f in forests for k in f.reward_components))
        out.reward_components = {k: torch.zeros(0) for k in names}
        node_offset = group_offset = batch_offset = 0
        for f in forests:
            cols = {name: getattr(f, name).clone() for name in _NODE_FIELDS + tuple(_OUTCOME_DEFAULTS)}
            cols["parent"] = torch.where(cols["parent"] >= 0, cols["parent"] + node_offset, cols["parent"])
            cols["batch"] = torch.where(cols["batch"] >= 0, cols["batch"] + batch_offset, cols["batch"])
            cols["group"] = cols["group"] + group_offset
            new = out._append(f.all_latents(), **cols)
            for k in names:
                if k in f.reward_components:
                    out.reward_components[k][new] = f.reward_components[k]
            if f.probe_node.numel():
                out.add_probe(f.probe_node + node_offset, f.probe_latents())
            node_offset += f.num_nodes
            group_offset += 0 if same_prompts else len(f.prompts)
            batch_offset += max(f._next_batch_id, int(f.batch.max()) + 1 if f.num_nodes else 0)
            for k, v in f.counters.items():
                out.counters[k] = out.counters.get(k, 0) + v
        out._next_batch_id = batch_offset
        return out

    # ---- scoring ---------------------------------------------------------------------------
    def add_probe(self, nodes: torch.Tensor, x0: torch.Tensor) -> None:
        """Ask for intermediate states ``nodes`` [Q] to be scored through the clean-latent estimates
        ``x0`` [Q, C, H, W] (e.g. ODE completions or x̂0 projections); their combined score lands in
        ``value``. Leaves are scored anyway and cannot be probed."""
        nodes = torch.as_tensor(nodes, dtype=torch.long).cpu().reshape(-1)
        if x0.shape[0] != nodes.shape[0]:
            raise ValueError(f"add_probe: {nodes.shape[0]} nodes but {x0.shape[0]} latents")
        self.probe_node = torch.cat([self.probe_node, nodes])
        self._probe_blocks.append(x0.detach().float().cpu())

    def probe_latents(self) -> torch.Tensor:
        """Clean-latent estimates of the probed states [Q, C, H, W], in ``probe_node`` order."""
        if not self._probe_blocks:
            return torch.zeros((0,) + tuple(self.all_latents().shape[1:]))
        if len(self._probe_blocks) > 1:
            self._probe_blocks = [torch.cat(self._probe_blocks)]
        return self._probe_blocks[0]

    def score_requests(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes to score [S] and their clean latents [S, C, H, W]: every leaf, then every probe."""
        leaves = self.leaves()
        if self.probe_node.numel() and bool(torch.isin(self.probe_node, leaves).any()):
            raise ValueError("a probe was added on a leaf: leaves are scored from their own latents")
        nodes = torch.cat([leaves, self.probe_node])
        return nodes, torch.cat([self.all_latents()[leaves], self.probe_latents()])

    def record_scores(self, nodes: torch.Tensor, components: dict[str, torch.Tensor]) -> None:
        """Write each reward term's raw scores [S] of ``nodes`` [S] into ``reward_components``. A non-finite
        score (±inf, NaN: a broken reward or server) is stored as NaN: it counts as a failed reward, is left
        out of every statistic and never trained (``reward_failed`` in the metrics)."""
        for name, values in components.items():
            column = self.reward_components.setdefault(name, torch.full((self.num_nodes,), float("nan")))
            values = values.detach().float().cpu()
            column[nodes] = torch.where(torch.isfinite(values), values, torch.full_like(values, float("nan")))

    def combine_scores(self, combine) -> None:
        """``reward`` on the leaves and ``value`` on the probed states from ``reward_components``:
        ``combine(components {name: [S]}, groups [S]) → [S]`` (a MultiReward's :meth:`combine`),
        applied to the leaves and to the probed states separately."""
        if not self.reward_components:
            return
        for nodes, column in ((self.leaves(), self.reward), (self.probe_node, self.value)):
            if nodes.numel():
                column[nodes] = combine({k: v[nodes] for k, v in self.reward_components.items()}, self.group[nodes]).float()

    # ---- structure helpers ----------------------------------------------------------------
    # Vectorised: each helper walks the forest level by level (a few tensor ops per level of depth),
    # never node by node, so trees of thousands of nodes cost O(depth) tensor operations.
    def leaves(self) -> torch.Tensor:
        """Indices of nodes with no children, in node order [L]."""
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool)
        has_child[self.parent[self.parent >= 0]] = True
        return torch.nonzero(~has_child).flatten()

    def roots(self) -> torch.Tensor:
        return torch.nonzero(self.parent < 0).flatten()

    def group_reward_std(self) -> torch.Tensor:
        """Std (population) of the scored leaf rewards of each prompt group [len(prompts)]; NaN for a
        group without a scored leaf. Zero means the group's advantages are all zero: nothing to learn."""
        leaves = self.leaves()
        r = self.reward[leaves].double()
        ok = ~torch.isnan(r)
        g, r = self.group[leaves][ok], r[ok]
        n = torch.zeros(len(self.prompts), dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
        mean = torch.zeros_like(n).index_add_(0, g, r) / n.clamp(min=1)
        var = torch.zeros_like(n).index_add_(0, g, (r - mean[g]) ** 2) / n.clamp(min=1)
        return torch.where(n > 0, var.sqrt(), torch.full_like(n, float("nan"))).float()

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

    def edges(self, trainable: bool = True) -> torch.Tensor:
        """Indices of child nodes of edges [E]: all edges, or (default) the stochastic ones that the plan
        left ``trainable`` and the credit rule gave a non-zero ``weight``."""
        mask = self.parent >= 0
        if trainable:
            mask = mask & self.stochastic & (self.trainable > 0) & (self.weight > 0)
        return torch.nonzero(mask).flatten()
