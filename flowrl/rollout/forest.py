"""The trajectory forest: one flat, tensor-backed structure for every rollout shape (docs/extending.md).

Nodes are latent states; every non-root node n has one incoming edge parent[n] → n, and the edge's
data is stored on its child n. Independent chains are unbranched trees, BranchGRPO trees are K-ary,
Sol-RL's regenerated samples are chains whose roots were selected from a larger pool.

Per node (N nodes): ``latents`` fp32 [N, C, H, W], ``sigma`` [N] (noise level of the state; 1 = pure
noise), ``step`` [N] (schedule index; 0 = pure noise), ``parent`` [N] (-1 for roots), ``group`` [N]
(prompt group), ``seed`` [N] (seed of the node's root: ``model.noise([seed])`` rebuilds it).
Per edge into n: ``logp_old`` [N], ``std`` [N], ``stochastic`` [N] (SDE edge, trainable),
``kernel`` [N] (index into the forest's own ``kernels`` names; roots: 0, ``"ode"``), ``eta`` [N] (the noise
level used), ``batch`` [N] (id of the rollout forward that produced the velocity at the parent: replay uses
the same layout).
Outcomes (allocated with the nodes, kept by :meth:`merge`, never wiped): ``reward`` [N] (combined
reward of a leaf; NaN elsewhere), ``value`` [N] (combined reward of a probed intermediate state; NaN if
unset), ``reward_components[name]`` [N] (each reward term's raw score on every scored node),
``advantage`` [N] (0), ``weight`` [N] (1) and ``flat`` [N] (0), written by credit rules on the nodes they
credit: weight 0 = the unit (an edge into the node, or a leaf) is excluded from training (pruned, dropped,
failed); flat 1 = its comparison set (e.g. its prompt group) had no reward spread, so its advantage is 0 by
construction — policy objectives skip such units (nothing to learn), forward-process ones keep them (their
loss still pulls towards the old copy and the teacher); :meth:`units` reads all three.
``trainable`` [N] (1), written by the plan (0 = an edge its layout leaves untrained, e.g. a tree's depth
pruning): credit rules never overwrite it; it concerns edges only (a leaf is trained on its clean latents
whatever the edge into it);
``from_teacher`` [N] (0; 1 on nodes a guided teacher sampled, the ODE plan's ``teacher_share``).

Built in layers, frozen once: each :meth:`add_children` appends one layer of latents (fp32, on the forest's declared
``device``: the rollout's model's, set by :meth:`~flowrl.rollout.base.RolloutContext.new_forest`) and writes its
columns into buffers that grow by
doubling, so building costs time linear in the number of nodes. During a rollout :meth:`latents_of` reads
nodes from their layers; :meth:`all_latents` concatenates the layers once, when the rollout is read whole.
Probe latents live on the same device as the nodes' latents. ``meta``: plain method data a plan records
for the readers of its forest (e.g. ``probe_x0``: its probes are x̂0 projections of states reached by SDE
edges), never callbacks.

Scoring (:mod:`flowrl.rollout.forest_scores`): leaves are always scored (their latents are clean samples); a plan
may ask for intermediate states to be scored too with :meth:`add_probe` (node, clean-latent estimate: an ODE
completion, an x̂0 projection). :meth:`score_requests` lists both; the trainer decodes and scores them and records
the results with :meth:`record_scores` and :meth:`combine_scores`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from flowrl.rollout.forest_columns import DeviceColumns
from flowrl.rollout.forest_paths import ForestPaths
from flowrl.rollout.forest_scores import ForestScores
from flowrl.rollout.transfer import host_copy, to_device

_NODE_FIELDS = ("sigma", "step", "parent", "group", "seed", "logp_old", "std", "stochastic", "kernel", "eta", "batch")
_OUTCOME_DEFAULTS = {
    "reward": float("nan"),
    "value": float("nan"),
    "advantage": 0.0,
    "weight": 1.0,
    "flat": 0.0,
    "trainable": 1.0,
    "from_teacher": 0.0,
}
_DEVICE_COLUMNS = ("logp_old", "std", "stochastic")  # computed on the model's device (see Forest._settle)
UNITS = ("edges", "leaves")  # what an objective trains on (Objective.trains_on), what a credit rule writes


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: itself when it is there (no call that could synchronise), else a copy."""
    return t if t.device.type == "cpu" else t.cpu()


def no_spread(count: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tol: float) -> torch.Tensor:
    """The loop's one spread test, per set [S] bool: fewer than two entries (``count``), or max − min (``hi`` − ``lo``)
    ≤ ``tol``. Group credit (:func:`flat_rows`), step credit and tree credit (:func:`flowrl.credit.base.standardize`)
    and the trainer's ``groups_without_spread`` (:meth:`Forest.flat_groups`) all ask it."""
    return (count < 2) | ((hi - lo) <= tol)


def flat_rows(values: torch.Tensor, ok: torch.Tensor, tol: float) -> torch.Tensor:
    """Which rows of ``values`` [P, G] have no spread [P] bool (:func:`no_spread` over the entries where ``ok``)."""
    if values.shape[1] == 0:
        return torch.ones(values.shape[0], dtype=torch.bool)
    lo = torch.where(ok, values, torch.full_like(values, float("inf"))).min(dim=1).values
    hi = torch.where(ok, values, torch.full_like(values, float("-inf"))).max(dim=1).values
    return no_spread(ok.sum(dim=1), lo, hi, tol)


@dataclass
class Forest(ForestPaths, DeviceColumns, ForestScores):
    """Trajectory forest of one rollout (see module docstring). Build with :meth:`add_roots` /
    :meth:`add_children`, then read through the helpers."""

    prompts: list[str]
    guidance: float = 1.0
    reduction: str = "mean"  # how edge log-probs were reduced over latent elements (replay uses the same)
    meta: dict = field(default_factory=dict)  # plain method data (see the module docstring)
    kernels: list[str] = field(default_factory=lambda: ["ode"])  # the names behind the ``kernel`` column
    device: torch.device | str = "cpu"  # where latents and probes live: declared (a rollout's: its model's device)
    sigma: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    step: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    parent: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    group: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    seed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # logp_old [N], std [N] and stochastic [N] are properties over these: an edge's values are computed on the model's
    # device and copied to the host without waiting (:meth:`add_children`); the first read settles the copies
    _logp_old: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    _std: torch.Tensor = field(default_factory=lambda: torch.zeros(0), repr=False)
    _stochastic: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool), repr=False)
    _pending: list = field(
        default_factory=list, repr=False
    )  # (first node, host copy [2, M], ready event, trainable kernel)
    kernel: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    eta: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    batch: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    counters: dict[str, int] = field(default_factory=lambda: {"forwards": 0, "nfe": 0, "model_calls": 0})
    reward: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    value: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    advantage: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    weight: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    flat: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    trainable: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    from_teacher: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    probe_node: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    _latent_blocks: list[torch.Tensor] = field(default_factory=list, repr=False)
    _block_starts: list[int] = field(default_factory=list, repr=False)
    _probe_blocks: list[torch.Tensor] = field(default_factory=list, repr=False)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _next_batch_id: int = 0
    copied_latent_rows: int = field(default=0, repr=False)  # latent rows copied while building and freezing

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)

    # ---- building -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return int(self.step.shape[0])

    def _grown(self, key: str, current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``current`` [n0] followed by ``new`` [n], as a view of a buffer that doubles when full (amortised
        linear). A column replaced wholesale (e.g. by a credit rule) seeds a fresh buffer."""
        n0, n = current.shape[0], current.shape[0] + new.shape[0]
        buf = self._buffers.get(key)
        if (
            buf is None
            or buf.shape[0] < n
            or buf.dtype != current.dtype
            or (n0 and current.data_ptr() != buf.data_ptr())
        ):
            buf = torch.empty(max(2 * n, 16), dtype=current.dtype)
            buf[:n0] = current
            self._buffers[key] = buf
        buf[n0:n] = new.to(current.dtype)
        return buf[:n]

    def _append(self, latents: torch.Tensor, **cols: torch.Tensor) -> torch.Tensor:
        n0, n = self.num_nodes, latents.shape[0]
        self._block_starts.append(n0)
        self._latent_blocks.append(latents.detach().to(self.device, torch.float32))
        for name in _NODE_FIELDS:
            attr = "_" + name if name in _DEVICE_COLUMNS else name  # no settling while a rollout appends
            setattr(
                self, attr, self._grown(name, getattr(self, attr), _on_host(torch.as_tensor(cols[name]).reshape(n)))
            )
        for name, default in _OUTCOME_DEFAULTS.items():
            new = _on_host(cols[name].float().reshape(n)) if name in cols else torch.full((n,), default)
            setattr(self, name, self._grown(name, getattr(self, name), new))
        for name, column in self.reward_components.items():
            self.reward_components[name] = self._grown(f"reward/{name}", column, torch.full((n,), float("nan")))
        return torch.arange(n0, n0 + n)

    def kernel_index(self, name: str) -> int:
        """The index of edge kernel ``name`` in this forest's ``kernels`` (the ``kernel`` column)."""
        if name not in self.kernels:
            self.kernels.append(name)
        return self.kernels.index(name)

    def add_roots(
        self,
        latents: torch.Tensor,
        group: Sequence[int] | torch.Tensor,
        seed: Sequence[int] | torch.Tensor,
        sigma: float = 1.0,
        step: int = 0,
    ) -> torch.Tensor:
        """Add roots (latents [R, C, H, W]); returns their node indices [R]."""
        r = latents.shape[0]
        return self._append(
            latents,
            sigma=torch.full((r,), float(sigma)),
            step=torch.full((r,), step),
            parent=torch.full((r,), -1),
            group=torch.as_tensor(group),
            seed=torch.as_tensor(seed),
            logp_old=torch.zeros(r),
            std=torch.zeros(r),
            stochastic=torch.zeros(r, dtype=torch.bool),
            kernel=torch.zeros(r),
            eta=torch.zeros(r),
            batch=torch.full((r,), -1),
        )

    def new_batch_id(self) -> int:
        """A fresh id for one rollout forward (all edges whose parent velocity it computed share it)."""
        self._next_batch_id += 1
        return self._next_batch_id - 1

    def add_children(
        self,
        parents: torch.Tensor,
        latents: torch.Tensor,
        sigma: float | torch.Tensor,
        step: int | torch.Tensor,
        logp: torch.Tensor,
        std: torch.Tensor,
        kernel: str,
        eta: float | torch.Tensor,
        batch: int | torch.Tensor,
    ) -> torch.Tensor:
        """Add one child per entry of ``parents`` [M] with states ``latents`` [M, C, H, W] reached by
        a ``kernel`` edge (log-prob ``logp`` [M], std ``std`` [M]). Returns the new node indices [M]."""
        parents = _on_host(torch.as_tensor(parents, dtype=torch.long))
        m = parents.shape[0]

        def column(value, dtype=torch.float32) -> torch.Tensor:  # a scalar broadcast to [M], or [M] as is
            t = _on_host(torch.as_tensor(value, dtype=dtype))
            return t.expand(m) if t.ndim == 0 else t

        # logp and std stay where they were computed: copied to the host without waiting, settled on first read
        values = torch.stack([logp.detach().float().reshape(m), std.detach().float().reshape(m).to(logp.device)])
        host, ready = host_copy(values)
        start = self.num_nodes
        nodes = self._append(
            latents,
            sigma=column(sigma),
            step=column(step, torch.long),
            parent=parents,
            group=self.group[parents],
            seed=self.seed[parents],
            logp_old=torch.zeros(m),
            std=torch.zeros(m),
            stochastic=torch.zeros(m, dtype=torch.bool),
            kernel=column(self.kernel_index(kernel), torch.long),
            eta=column(eta),
            batch=column(batch, torch.long),
        )
        self._pending.append((start, host, ready, kernel != "ode"))
        return nodes

    def count_forward(self, rows: int, cfg: bool) -> None:
        """Record one model call over ``rows`` states (each a forward; ×2 NFE with CFG)."""
        self.counters["forwards"] += rows
        self.counters["nfe"] += rows * (2 if cfg else 1)
        self.counters["model_calls"] += 1

    def latents_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """Latents [M, C, H, W] of ``nodes`` [M], read from their layers without freezing the forest."""
        nodes = torch.as_tensor(nodes, dtype=torch.long).reshape(-1).cpu()
        starts = torch.tensor(self._block_starts)
        layer = torch.searchsorted(starts, nodes, right=True) - 1
        if nodes.numel() and bool((layer == layer[0]).all()):  # indices moved without waiting (to_device)
            return self._latent_blocks[int(layer[0])][to_device(nodes - starts[layer[0]], self.device)]
        out = torch.empty((nodes.numel(),) + tuple(self._latent_blocks[0].shape[1:]), device=self.device)
        for k in torch.unique(layer).tolist():
            mine = layer == k
            rows = to_device(
                torch.cat([torch.nonzero(mine).flatten(), nodes[mine] - self._block_starts[k]]), self.device
            )
            out[rows[: rows.numel() // 2]] = self._latent_blocks[k][rows[rows.numel() // 2 :]]
        return out

    def all_latents(self) -> torch.Tensor:
        """Latents [N, C, H, W]: the layers concatenated once (frozen), then cached."""
        if len(self._latent_blocks) > 1:
            frozen = torch.cat(self._latent_blocks)
            self.copied_latent_rows += frozen.shape[0]
            self._latent_blocks, self._block_starts = [frozen], [0]
        return self._latent_blocks[0]

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
        if len({f.device for f in forests}) != 1:
            raise ValueError("cannot merge forests whose latents live on different devices")
        out = Forest(
            prompts=prompts,
            guidance=forests[0].guidance,
            reduction=forests[0].reduction,
            meta=_merged_meta([f.meta for f in forests]),
            device=forests[0].device,
        )
        names = list(dict.fromkeys(k for f in forests for k in f.reward_components))
        out.reward_components = {k: torch.zeros(0) for k in names}
        node_offset = group_offset = batch_offset = 0
        for f in forests:
            cols = {name: getattr(f, name).clone() for name in _NODE_FIELDS + tuple(_OUTCOME_DEFAULTS)}
            cols["parent"] = torch.where(cols["parent"] >= 0, cols["parent"] + node_offset, cols["parent"])
            cols["batch"] = torch.where(cols["batch"] >= 0, cols["batch"] + batch_offset, cols["batch"])
            cols["group"] = cols["group"] + group_offset
            cols["kernel"] = torch.tensor([out.kernel_index(k) for k in f.kernels])[cols["kernel"]]
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

    # ---- structure helpers (the path walks are in :class:`ForestPaths`) --------------------------
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

    def edges(self, trainable: bool = True) -> torch.Tensor:
        """Indices of child nodes of edges [E]: all edges, or (default) the units a policy objective trains,
        ``units("edges")``."""
        return self.units("edges") if trainable else torch.nonzero(self.parent >= 0).flatten()

    def units(self, trains_on: str, flat: bool = False, weighted: bool = True) -> torch.Tensor:
        """The nodes an objective trains [U], in node order: for ``"edges"`` the children of the stochastic
        edges the plan left ``trainable``; for ``"leaves"`` the leaves whose reward is finite (a failed reward
        is never trained). Only units the credit rule gave a non-zero ``weight`` (unless ``weighted`` is False), and
        ``flat`` ones (no reward spread in their comparison set) only when ``flat`` is True."""
        if trains_on == "edges":
            mask = (self.parent >= 0) & self.stochastic & (self.trainable > 0)
        elif trains_on == "leaves":
            mask = torch.zeros(self.num_nodes, dtype=torch.bool)
            mask[self.leaves()] = True
            mask &= torch.isfinite(self.reward)
        else:
            raise ValueError(f"units({trains_on!r}): accepted: {list(UNITS)}")
        if weighted:
            mask &= self.weight > 0
        if not flat:
            mask &= self.flat <= 0
        return torch.nonzero(mask).flatten()

    def flat_groups(self, tol: float = 1e-6) -> torch.Tensor:
        """Which prompt groups had no reward spread [len(prompts)] bool (:func:`flat_rows` over each group's
        leaf rewards, failed ones left out): the group credit rule's flat groups and the trainer's
        ``groups_without_spread`` are this one test."""
        leaves = self.leaves()
        leaves = leaves[torch.argsort(self.group[leaves], stable=True)]
        group = self.group[leaves]
        P = len(self.prompts)
        count = torch.bincount(group, minlength=P)
        within = torch.arange(leaves.numel()) - (torch.cumsum(count, 0) - count)[group]
        table = torch.full((P, int(count.max()) if leaves.numel() else 0), float("nan"), dtype=torch.float64)
        table[group, within] = self.reward[leaves].double()
        return flat_rows(table, torch.isfinite(table), tol)


def _merged_meta(metas: list[dict]) -> dict:
    """The first forest's meta; a list under a key (a plan's per-chunk records, e.g. explore's): every forest's lists
    concatenated in order."""
    out = dict(metas[0])
    for key, value in out.items():
        if isinstance(value, list):
            out[key] = [x for m in metas for x in m.get(key, [])]
    return out
