"""State rewards on forest nodes (docs/step_credit.md): the ``probed`` plan, the ODE completion of
states, and the forest readers that step-level credit rules (TP-GRPO, VGPO) share.

A *probe* asks the trainer to score an intermediate state through a clean-latent estimate
(``forest.add_probe``); its combined reward lands in ``forest.value[node]``. Two probes:

- ``ode_completion`` (TP-GRPO): complete the state to σ = 0 with Euler ODE steps of the rollout's own
  schedule (:func:`ode_complete`), decode and score. The probed states are the *decision states*: the
  parents of the stochastic edges (:func:`decision_states`), i.e. the state before every SDE step. On a
  chain whose window starts at step 0 that includes the root, so the root's completion is the pure-ODE
  reference R_0 from the chain's own x_T (the root latent is ``model.noise([seed])``, bit-exact, and its
  completion equals :func:`flowrl.rollout.sampling.ode_sample` from that seed). With a window starting
  at w > 0 the first decision state is the state at step w, reached from x_T by ODE steps only: its
  completion is the same pure-ODE sample (up to float rounding of the batch layout), so it serves as R_0
  without re-running the prefix. The state after the last SDE step is not probed: its completion *is*
  the rest of the chain (ODE steps), so its value is the leaf's reward (:func:`state_values`).
- ``x0_projection`` (VGPO): x̂0 = x − σ·v of every state reached by an SDE edge, from the velocity the
  next step computes anyway (the observer :func:`probe_x0`; the forest records ``meta["probe_x0"]``): zero
  extra forwards, one decode and one reward evaluation per probed state.

Probes never add nodes: the forest's structure, log-probs and replay layout are those of the inner
plan, so replay still equals rollout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from flowrl.core.choices import choice
from flowrl.errors import ConfigError
from flowrl.models.base import FlowModel
from flowrl.rollout.base import RolloutContext, RolloutPlan, euler_ode, inner_unread
from flowrl.rollout.chains import Chains
from flowrl.rollout.forest import Forest

PROBES = ("ode_completion", "x0_projection")


@dataclass
class Probed(RolloutPlan):
    """A rollout plan that wraps an inner plan and probes its states (``rollout.plan: probed``).

    ``inner``: the plan that rolls out, in the one nested form every wrapping plan takes: a name (a registered one
    such as ``chains`` (the default, with its defaults) or ``tree``, ``package.module:Class`` or ``file.py:Class``) or
    ``{plan: name, its own keys...}`` (:func:`flowrl.core.components.build_nested`, as in an explore plan); its keys
    are its own, not this section's. In Python, ``inner_plan=`` takes a ready plan object. ``setup``,
    ``after_update``, ``metrics`` and ``root_count`` are passed on to the inner plan.

    ``probe``: ``ode_completion`` or ``x0_projection`` (module docstring).

    Cost of ``ode_completion`` on chains of T steps with SDE window W (sorted steps): a completion from
    the state at step i costs T − i forwards (its first velocity is recomputed: the rollout does not keep
    velocities), so per chain the extra forwards are Σ_{i∈W} (T − i). For TP-GRPO's window W = 0..n−1
    that is T + Σ_{k=1}^{n−1} (T − k), and with the chain's own T the total is TP-GRPO's closed form
    T + T + Σ_{k=1}^{n−1}(T − k) exactly (64 for T 10, n 9; docs/step_credit.md, "The probed plan").
    Differences from that closed form: with
    ``shared_noise`` the first decision state (the group's trunk node) is completed once per *group*
    (T − W[0] forwards per group, not per chain), and the chains themselves share their trunk
    (:func:`~flowrl.rollout.chains.chain_counts`); a window starting at w > 0 uses the state at step w as R_0, so the
    reference costs T − w, not T. Decodes and reward evaluations: one per probed state (n per chain) on top
    of the leaf's (n + 1 per chain, as TP-GRPO counts). Counted in ``forest.counters["probe_forwards"]`` (and in
    ``forwards``/``nfe``); logged by :meth:`metrics`.

    All completions of an iteration run together, aligned on the schedule: at step i every probed state
    with start step ≤ i moves one Euler step in forwards of at most ``max_batch`` states, all at σ_i.

    Rewards: probe values and leaf rewards are combined separately by the MultiReward, so
    ``reward_normalize`` must be ``none`` (:meth:`check_reward_normalize`, when the config loads): step credit
    compares them.
    """

    probe: str = choice("ode_completion", PROBES)  # how a state is scored: ode_completion (TP-GRPO: the state before
    # every SDE step completed to σ 0 by Euler ODE steps, decoded and scored) | x0_projection (VGPO: x̂0 = x − σ·v of
    # every state an SDE step reaches, from the velocity the next step computes anyway: no extra forwards)
    inner: str | dict = "chains"
    inner_plan: RolloutPlan | None = field(default=None, metadata={"config": False})

    def __post_init__(self) -> None:
        if self.inner_plan is None:
            from flowrl.core import components

            self.inner_plan = components.build_nested(components.PLAN, self.inner, key="rollout.inner", refuse=Probed)
        inner = self.inner_plan
        if self.probe == "x0_projection" and isinstance(inner, Chains) and inner.post_solver != "none":
            raise ValueError(
                f"rollout.probe=x0_projection with rollout.inner.post_solver={inner.post_solver!r}: the "
                "post-solver does not probe the state after the last SDE step; use post_solver: none"
            )

    def unread_keys(self) -> dict[str, str]:
        """Its own unread keys (the base's check of its fields) and the inner plan's, named under ``rollout.inner``."""
        return {**super().unread_keys(), **inner_unread(self.inner_plan)}

    def check_reward_normalize(self, normalize: str) -> None:
        """``none`` only (class docstring), then the inner plan's check."""
        if normalize != "none":
            raise ConfigError(
                f"reward_normalize={normalize!r} with a probed plan (rollout.plan: probed): probe values and leaf "
                "rewards "
                "are normalised separately and could not be compared; accepted: reward_normalize: none"
            )
        self.inner_plan.check_reward_normalize(normalize)

    # ---- lifecycle: passed on to the inner plan ----------------------------------------------
    def setup(self, model: FlowModel, reward=None) -> None:
        self.inner_plan.setup(model, reward)

    def after_update(self, model: FlowModel) -> None:
        self.inner_plan.after_update(model)

    def root_count(self) -> int | None:
        """The inner plan's: a wrapping plan (explore) chooses the inner roots' x_T through ``ctx.root_seeds``,
        which reaches the inner plan unchanged (the probes start from those roots too)."""
        return self.inner_plan.root_count()

    @property
    def has_trainable_edges(self) -> bool:
        return self.inner_plan.has_trainable_edges

    @property
    def schedule_steps(self) -> int | None:
        return self.inner_plan.schedule_steps

    def metrics(self, forest: Forest) -> dict[str, float]:
        """The inner plan's metrics, plus the probes' cost: ``probe/extra_forwards`` (model forwards of
        the completions; 0 for x0 projection), ``probe/decodes`` (probed states decoded, one reward
        evaluation each), ``probe/reward_calls`` (images scored: leaves + probes) and both per leaf, and
        ``probe/value_mean`` (mean value of the probed states)."""
        out = dict(self.inner_plan.metrics(forest))
        leaves = max(int(forest.leaves().numel()), 1)
        probes = int(forest.probe_node.numel())
        extra = float(forest.counters.get("probe_forwards", 0))
        values = forest.value[forest.probe_node]
        out.update(
            {
                "probe/extra_forwards": extra,
                "probe/extra_forwards_per_leaf": extra / leaves,
                "probe/decodes": float(probes),
                "probe/reward_calls": float(probes + leaves),
                "probe/reward_calls_per_leaf": (probes + leaves) / leaves,
                "probe/value_mean": float(values.nanmean()) if probes and not bool(values.isnan().all()) else 0.0,
            }
        )
        return out

    # ---- rollout ------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
        """The inner plan's forest, with every decision state (``ode_completion``) or every state reached by
        an SDE edge (``x0_projection``) added as a probe."""
        if self.probe == "x0_projection":
            forest = self.inner_plan.rollout(
                model, prompts, dataclasses.replace(ctx, observers=ctx.observers + (probe_x0,))
            )
            forest.meta["probe_x0"] = True
            forest.counters.setdefault("probe_forwards", 0)
            return forest
        steps = self.schedule_steps
        if steps is None:
            raise ValueError(
                f"rollout.inner ({type(self.inner_plan).__name__}) declares no schedule_steps: the ODE "
                "completion needs the length of the schedule the inner plan samples with"
            )
        forest = self.inner_plan.rollout(model, prompts, ctx)
        nodes = decision_states(forest)
        before = forest.counters["forwards"]
        x0 = ode_complete(model, forest, nodes, steps, ctx.max_batch)
        forest.counters["probe_forwards"] = (
            forest.counters.get("probe_forwards", 0) + forest.counters["forwards"] - before
        )
        if nodes.numel():
            forest.add_probe(nodes, x0)
        return forest

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        """The inner plan's closed forms plus ``probe_forwards`` and ``probes`` (class docstring);
        ``forwards`` includes the probe forwards. Closed forms for an inner chains plan only."""
        ctx = ctx or RolloutContext()
        inner = self.inner_plan
        counts = inner.expected_counts(num_prompts, ctx)
        if not isinstance(inner, Chains):
            raise NotImplementedError(f"expected_counts of {self.probe} probes over an inner plan other than chains")
        T, G = inner.steps, inner.group_size
        window = inner.window.steps(T, ctx.iteration, ctx.seed)
        if self.probe == "x0_projection":
            return {**counts, "probe_forwards": 0, "probes": num_prompts * G * len(window)}
        first = 1 if inner.shared_noise else G  # the first decision state is the group's trunk node with shared noise
        extra = num_prompts * (first * (T - window[0]) + G * sum(T - i for i in window[1:]))
        probes = num_prompts * (first + G * (len(window) - 1))
        return {**counts, "forwards": counts["forwards"] + extra, "probe_forwards": extra, "probes": probes}


# ---- probes --------------------------------------------------------------------------------------
def decision_states(forest: Forest) -> torch.Tensor:
    """The states an SDE step leaves from: the distinct parents of the stochastic edges [Q], sorted."""
    edges = torch.nonzero((forest.parent >= 0) & forest.stochastic).flatten()
    return torch.unique(forest.parent[edges])


@torch.no_grad()
def ode_complete(model: FlowModel, forest: Forest, nodes: torch.Tensor, steps: int, max_batch: int) -> torch.Tensor:
    """Clean latents [Q, C, H, W] (fp32, on the forest's device) of the states ``nodes`` [Q] completed to σ = 0 with
    Euler
    ODE steps of ``model.schedule(steps)`` at the forest's guidance — the same update as
    :func:`flowrl.rollout.sampling.ode_sample`, so a root's completion is that function's sample from the
    root's seed (bit-exact when the batch layouts agree, e.g. ``max_batch`` 1 in both).

    Schedule-aligned batching (:func:`flowrl.rollout.base.euler_ode`): at step i every state whose own step
    is ≤ i moves one step, in forwards of at most ``max_batch`` states (all at σ_i), each counted with
    ``forest.count_forward``."""
    nodes = torch.as_tensor(nodes, dtype=torch.long).reshape(-1)
    x = forest.latents_of(nodes)
    if nodes.numel() == 0:
        return x.clone()
    sigmas = model.schedule(steps).float().cpu()
    start = forest.step[nodes]
    if int(start.max()) >= steps or not torch.allclose(sigmas[start], forest.sigma[nodes]):
        raise ValueError(
            f"ode_complete: the probed states' sigmas are not those of a {steps}-step schedule of this model"
        )
    cond = model.encode(forest.prompts, forest.guidance)
    return euler_ode(
        model, x, sigmas, cond, forest.guidance, max_batch, start=start, cond_rows=forest.group[nodes], count_on=forest
    )


def probe_x0(forest: Forest, nodes: torch.Tensor, x: torch.Tensor, sigma: float, v: torch.Tensor) -> None:
    """A rollout observer: every state in ``nodes`` [K] an SDE step reached is probed through its one-step clean
    estimate x̂0 = x − σ·v [K, ...], from the velocity the next step computes anyway (no extra forwards)."""
    reached = forest.stochastic[nodes]
    if bool(reached.any()):
        forest.add_probe(nodes[reached], (x - sigma * v.float())[reached.to(x.device)])


# ---- readers for step-level credit -------------------------------------------------------------
def state_values(forest: Forest) -> torch.Tensor:
    """The reward of every state [N]: ``value`` where probed, ``reward`` at leaves, NaN elsewhere — except
    that with ODE-completion probes (no ``forest.meta["probe_x0"]``) an unprobed state whose only way down is
    one deterministic edge takes its child's value (completing it by ODE passes through that child; e.g.
    the state after a chain's last SDE step takes its leaf's reward). With x0 probes no such fill-in
    holds (x̂0 of a state is not its child's)."""
    values = forest.value.clone()
    leaves = forest.leaves()
    values[leaves] = forest.reward[leaves]
    if forest.meta.get("probe_x0"):
        return values
    nodes = torch.arange(forest.num_nodes)
    has_parent = forest.parent >= 0
    only_child = torch.full((forest.num_nodes,), -1, dtype=torch.long)
    only_child[forest.parent[has_parent]] = nodes[has_parent]  # meaningful where a node has one child
    passes_on = (
        (forest.num_children() == 1)
        & ~torch.isin(nodes, forest.probe_node)
        & ~forest.stochastic[only_child.clamp(min=0)]
    )
    source = torch.where(passes_on, only_child, nodes)  # follow deterministic only-child edges down ...
    while True:  # ... to the first state that does not pass on (pointer jumping: O(log depth) passes)
        further = source[source]
        if torch.equal(further, source):
            return values[source]
        source = further


@dataclass
class StepPaths:
    """The SDE steps of every root-to-leaf path of a forest (chains: one path per chain; trees: one per
    leaf, sharing the edges above their branch points).

    ``leaf`` [L] and ``group`` [L] per path; ``edges[l]`` [n_l]: the child nodes of the stochastic edges
    along path l, root side first (the k-th entry is the path's SDE step k). :meth:`entries` flattens
    them to (path, k, edge) triples; :meth:`edge_mean` averages a per-entry quantity over the paths
    through each edge (an edge above a branch point lies on every path below it)."""

    leaf: torch.Tensor
    group: torch.Tensor
    edges: list[torch.Tensor]

    @classmethod
    def from_forest(cls, forest: Forest) -> "StepPaths":
        leaves = forest.leaves()
        table = forest.ancestor_table(leaves).flip(1)  # [L, D+1]: root side first, −1 before a shorter path's root
        node = table.clamp(min=0)
        sde_edge = (table >= 0) & (forest.parent[node] >= 0) & forest.stochastic[node]
        return cls(leaves, forest.group[leaves], [row[keep] for row, keep in zip(table, sde_edge)])

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat (path [M], k [M], edge [M]) over every SDE step of every path."""
        path = (
            torch.cat([torch.full((e.numel(),), i, dtype=torch.long) for i, e in enumerate(self.edges)])
            if self.edges
            else torch.zeros(0, dtype=torch.long)
        )
        k = torch.cat([torch.arange(e.numel()) for e in self.edges]) if self.edges else torch.zeros(0, dtype=torch.long)
        edge = torch.cat(self.edges) if self.edges else torch.zeros(0, dtype=torch.long)
        return path, k, edge

    def by_length(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Paths grouped by their number of SDE steps n ≥ 1, for vectorised math: {n: (path indices [L_n],
        their entries' positions in :meth:`entries` [L_n, n], step k along the rows)}."""
        lengths = torch.tensor([e.numel() for e in self.edges], dtype=torch.long)
        start = torch.cumsum(lengths, 0) - lengths  # offset of each path's first entry
        out = {}
        for n in torch.unique(lengths).tolist():
            if n > 0:
                rows = torch.nonzero(lengths == n).flatten()
                out[int(n)] = (rows, start[rows][:, None] + torch.arange(n))
        return out

    @staticmethod
    def edge_mean(edge: torch.Tensor, values: torch.Tensor, num_nodes: int) -> torch.Tensor:
        """Mean [N] of the finite ``values`` [M] of the entries on each edge (NaN where an edge has none)."""
        ok = torch.isfinite(values)
        total = torch.zeros(num_nodes).index_add_(0, edge[ok], values[ok].float())
        count = torch.zeros(num_nodes).index_add_(0, edge[ok], torch.ones(int(ok.sum())))
        return torch.where(count > 0, total / count.clamp(min=1), torch.full((num_nodes,), float("nan")))
