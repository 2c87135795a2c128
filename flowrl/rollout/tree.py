"""Branching rollouts: BranchGRPO and Dynamic-TreeRPO as one tree plan (docs/trees.md).

One root per prompt (x_T from the seed ``derive_seed(seed, iteration, "root", global group, 0)``, the
same x_T as shared-noise chains). Step i moves every node at step i one step in ONE batched forward
(chunked by ``max_batch``); at a split step each node gets ``branch`` = K children that share its
velocity and differ by their noise. Modes (``mode``):

- ``sde`` (BranchGRPO): every step 0..T−1 uses the kernel (dance, η 0.3) and is trainable; splits at
  ``split_steps``. Per prompt n(i) = K^{#splits < i} nodes at step i: Σ_{i<T} n(i) forwards and
  Σ_{i<T} n(i+1) trained edges (T 20, K 2, splits 0,3,6,9: 203 and 218; 16 leaves). The last step is
  stochastic too (dance and flow_grpo have std > 0 there; ``cps`` has std 0, so it is not trained).
- ``mix`` (BranchGRPO-Mix): SDE only at the split steps and in the first ``mix_window`` steps; ODE
  (untrained) elsewhere.
- ``window`` (Dynamic-TreeRPO): ODE from σ_0 to step l (one path per prompt), a K-ary tree (binary
  by default) over the d = ``window.size`` steps l..l+d−1 (every window step splits, SDE), then ODE to
  the end for all K^d leaves; l moves as ``window`` says (``progressive`` like MixGRPO: l = start +
  stride·⌊iteration/tau⌋, clamped at T−1−d). Layer k of the window uses the noise level
  η_k = η·(1 + ``beta_noise``·k/(d−1)). ``split_steps`` is not used. Forwards l + (K^d−1)/(K−1) +
  K^d·(T−l−d), trained edges Σ_{k=1..d} K^k (2^{d+1}−2 for K = 2).

Split noise (``split_noise``): ``correlated`` (default, the paper): child b draws
ξ_b = (ξ0 + s·η_b)/sqrt(1+s²), s = ``split_scale``, ξ0 shared by the siblings; each child is an ordinary
SDE sample of the kernel (same marginal) and siblings correlate 1/(1+s²). ``independent_scaled``
(their code): x_b = μ + s·std·η_b, the edge's std is s·std and its log-prob is evaluated at s·std
**(ours; their code evaluates it at the unscaled std)**.

Noise is addressed by the node's path, never by node index: a node's path is (global group, the
branch index taken at each split so far); an unsplit SDE step from a node with path π at step i draws
``derive_seed(seed, iteration, "sde", group, *π, i)``; a split draws η_b from ``(.., "split", group, *π,
b, i)`` and ξ0 from ``(.., "split_shared", group, *π, i)``. So chunking (``max_batch``), splitting the
groups over processes (``group_offset``) or over ``rollout.chunks`` draws the same numbers.

Depth pruning (backward only; rollout and rewards unchanged) lives here because its window moves with
the iteration, which the plan sees (``ctx.iteration``) and which survives resume and chunk merging:
with ``depth_prune_size`` w > 0, trainable edges whose child step lies in the window
[lo + ⌊iteration/``depth_prune_every``⌋, … + w) get weight 0, where lo = s_last + 2 is the first step
below the last split's children (s_last = the last split step; the split edges themselves are always
trained **(ours)**); the window slides by 1 every ``depth_prune_every`` iterations toward the end and
stops when it reaches step T. A credit rule keeps these zeros (:class:`flowrl.credit.tree.TreeAdvantage`
multiplies its weights into them) and counts them. Width pruning needs rewards: it is the credit rule's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flowrl.core.choices import choice
from flowrl.core.seeding import derive_seed, seeded_normal
from flowrl.models.base import FlowModel
from flowrl.rollout import sde
from flowrl.rollout.base import RolloutContext, RolloutPlan, advance
from flowrl.rollout.chains import SDEWindow
from flowrl.rollout.forest import Forest

MODES = ("sde", "mix", "window")
SPLIT_NOISE = ("correlated", "independent_scaled")


@dataclass
class TreeLayout:
    """Where one iteration's tree splits and which steps are stochastic (all schedule step indices)."""

    splits: list[int]
    sde: list[int]
    eta: dict[int, float]  # noise level per stochastic step
    pruned: list[int]  # child steps whose edges depth pruning skips

    def nodes_per_step(self, steps: int, branch: int) -> list[int]:
        """n(i) = K^{#splits < i} for i = 0..T: nodes per prompt at step i."""
        return [branch ** sum(1 for s in self.splits if s < i) for i in range(steps + 1)]


@dataclass
class Tree(RolloutPlan):
    """K-ary trees per prompt: BranchGRPO (``mode: sde``), BranchGRPO-Mix (``mix``) and
    Dynamic-TreeRPO (``window``); see the module docstring for every key."""

    steps: int = 20  # T, the sampling schedule's steps (the model's own shift; ≥ 2)
    kernel: str = "dance"  # transition kernel of the stochastic steps: dance, flow_grpo, cps (not ode)
    eta: float = 0.3  # η, the kernel's noise level (> 0: siblings differ by their noise); beta_noise scales it by
    # layer in mode window
    mode: str = choice("sde", MODES)  # sde (BranchGRPO: every step stochastic and trained) | mix (BranchGRPO-Mix:
    # SDE only at the split steps and in the first mix_window steps) | window (Dynamic-TreeRPO: ODE to the window,
    # a tree over its d steps, every one splitting, then ODE to the end); docs/trees.md
    branch: int = 2  # K children per node at a split
    split_steps: list[int] = field(default_factory=lambda: [0, 3, 6, 9])  # modes sde, mix: the steps at which
    # every node splits into K; distinct, in [0, T−2]; unread by mode window
    split_noise: str = choice("correlated", SPLIT_NOISE)  # correlated (the paper: child b draws (ξ0 + s·η_b)/sqrt(1
    # + s²), ξ0 shared by the siblings: each child an ordinary kernel sample) | independent_scaled (their code:
    # μ + s·std·η_b, the split edge's std s·std)
    split_scale: float = 4.0  # s of the split noise (> 0): correlated siblings correlate 1/(1 + s²) (0.059 at 4);
    # independent_scaled widens the split edges' std to s·std
    mix_window: int = 4  # mode mix: SDE in steps [0, mix_window) besides the splits
    window: SDEWindow = field(  # mode window: where the tree sits, the chains' window (fixed | random | progressive;
        # all is refused), d = size; the tree's default is {mode: progressive, start: 0, size: 4, range: null,
        # stride: 1, tau: 25}
        default_factory=lambda: SDEWindow(mode="progressive", start=0, size=4, stride=1, tau=25)
    )
    beta_noise: float = 0.0  # mode window: η_k = η·(1 + beta_noise·k/(d−1))
    depth_prune_size: int = 0  # w, depth pruning (backward only): trainable edges whose child step lies in a w-step
    # window from two steps below the last split get weight 0, the window sliding every depth_prune_every
    # iterations; 0 = off
    depth_prune_every: int = 30  # depth pruning: iterations between the window's one-step slides toward the end
    # (≥ 1); it stops at step T

    def __post_init__(self) -> None:
        if isinstance(self.window, dict):
            self.window = SDEWindow(**self.window)
        self.split_steps = [int(s) for s in self.split_steps]
        sde.check_kernel(self.kernel, "rollout.kernel")
        if self.kernel == "ode":
            raise ValueError("rollout.kernel='ode' has no stochastic edges to train; accepted: flow_grpo, dance, cps")
        if self.eta <= 0:
            raise ValueError(f"rollout.eta={self.eta} must be > 0 (a tree's siblings differ by their noise)")
        if self.steps < 2:
            raise ValueError(f"rollout.steps={self.steps} must be >= 2")
        if self.branch < 2:
            raise ValueError(f"rollout.branch={self.branch} must be >= 2")
        if self.split_scale <= 0:
            raise ValueError(f"rollout.split_scale={self.split_scale} must be > 0")
        if self.mode != "window":
            bad = [s for s in self.split_steps if not 0 <= s <= self.steps - 2]
            if not self.split_steps or bad or len(set(self.split_steps)) != len(self.split_steps):
                raise ValueError(
                    f"rollout.split_steps={self.split_steps} must be distinct steps in [0, steps-2="
                    f"{self.steps - 2}], at least one"
                )
        if self.mix_window < 0:
            raise ValueError(f"rollout.mix_window={self.mix_window} must be >= 0")
        if self.mode == "window":
            if self.window.mode == "all":
                raise ValueError(
                    "rollout.window.mode='all' would split at every step; accepted: fixed, random, progressive"
                )
            self.window.validate(self.steps)
            d = self.window.size
            if min(self._layer_eta(k, d) for k in range(d)) <= 0:
                raise ValueError(f"rollout.beta_noise={self.beta_noise} makes a layer's noise level <= 0")
        if self.depth_prune_size < 0 or self.depth_prune_every < 1:
            raise ValueError(
                f"rollout.depth_prune_size={self.depth_prune_size} must be >= 0 and "
                f"rollout.depth_prune_every={self.depth_prune_every} >= 1"
            )

    # ---- layout -----------------------------------------------------------------------------
    def _layer_eta(self, k: int, d: int) -> float:
        return self.eta * (1.0 + self.beta_noise * k / (d - 1)) if d > 1 else self.eta

    def layout(self, iteration: int = 0, seed: int = 0) -> TreeLayout:
        """Splits, stochastic steps, their η and the depth-pruned child steps of ``iteration``."""
        T = self.steps
        if self.mode == "window":
            window = self.window.steps(T, iteration, seed)
            splits, stochastic = window, window
            eta = {s: self._layer_eta(k, len(window)) for k, s in enumerate(window)}
        else:
            splits = sorted(self.split_steps)
            stochastic = (
                list(range(T)) if self.mode == "sde" else sorted(set(splits) | set(range(min(self.mix_window, T))))
            )
            eta = {s: self.eta for s in stochastic}
        pruned: list[int] = []
        if self.depth_prune_size > 0:
            lo = max(splits) + 2
            start = min(lo + iteration // self.depth_prune_every, max(lo, T + 1 - self.depth_prune_size))
            pruned = list(range(start, min(start + self.depth_prune_size, T + 1)))
        return TreeLayout(splits=list(splits), sde=list(stochastic), eta=eta, pruned=pruned)

    def _trainable_step(self, i: int, layout: TreeLayout) -> bool:
        """Whether the edges of step i (σ_i → σ_{i+1}) are stochastic (cps has std 0 on the last step)."""
        return i in layout.eta and not (self.kernel == "cps" and i == self.steps - 1)

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        """Closed forms (docs/trees.md, "Cost: closed forms"): ``forwards`` Σ_{i<T} n(i), ``trained_edges`` Σ n(i+1)
        over
        the stochastic steps minus the depth-pruned ones, ``depth_pruned_edges``, ``leaves`` n(T), ``replay_rows``
        Σ n(i) over the stochastic steps whose edges are not pruned (siblings share their parent's velocity); per
        prompt times ``num_prompts``."""
        ctx = ctx or RolloutContext()
        layout = self.layout(ctx.iteration, ctx.seed)
        n = layout.nodes_per_step(self.steps, self.branch)
        stochastic = [i for i in range(self.steps) if self._trainable_step(i, layout)]
        pruned = sum(n[i + 1] for i in stochastic if i + 1 in layout.pruned)
        return {
            "forwards": num_prompts * sum(n[: self.steps]),
            "trained_edges": num_prompts * (sum(n[i + 1] for i in stochastic) - pruned),
            "depth_pruned_edges": num_prompts * pruned,
            "leaves": num_prompts * n[self.steps],
            "replay_rows": num_prompts * sum(n[i] for i in stochastic if i + 1 not in layout.pruned),
        }

    @property
    def schedule_steps(self) -> int:
        return self.steps

    def root_count(self) -> int:
        """One root per prompt group: a wrapping plan (Sol-RL's explore) may choose its x_T seed."""
        return 1

    # ---- rollout --------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
        """Forest of one K-ary tree per prompt (prompt p is group p; its leaves come in path order)."""
        T, K = self.steps, self.branch
        guidance = model.guidance_or_default(ctx.guidance)
        sigmas = model.schedule(T).float().cpu()
        layout = self.layout(ctx.iteration, ctx.seed)
        splits = set(layout.splits)
        P = len(prompts)
        forest = ctx.new_forest(prompts, guidance, model.device)
        seeds = ctx.given_root_seeds(P, self.root_count()) or [
            derive_seed(ctx.seed, ctx.iteration, "root", ctx.group_offset + g, 0) for g in range(P)
        ]
        nodes = forest.add_roots(model.noise(seeds), torch.arange(P), seeds, sigma=float(sigmas[0]), step=0)
        path_of = {int(n): (ctx.group_offset + g,) for g, n in enumerate(nodes)}  # (global group, branches...)
        cond = model.encode(prompts, guidance)
        shape = model.latent_shape
        s = self.split_scale
        step_now = 0

        def draw(*address) -> torch.Tensor:
            return seeded_normal(derive_seed(ctx.seed, ctx.iteration, *address, step_now), shape)

        def noise_for(parents: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
            rows, shared = [], {}
            for p, b in zip(parents.tolist(), branch.tolist()):
                path = path_of[p]
                if step_now not in splits:
                    rows.append(draw("sde", *path))
                    continue
                eta_b = draw("split", *path, b)
                if self.split_noise == "correlated":
                    if p not in shared:
                        shared[p] = draw("split_shared", *path)
                    rows.append((shared[p] + s * eta_b) / math.sqrt(1.0 + s * s))
                else:  # independent_scaled: advance widens the std by s (std_scale)
                    rows.append(eta_b)
            return torch.stack(rows).to(model.device)

        for i in range(T):
            step_now = i
            split = i in splits
            fanout = K if split else 1
            stochastic = i in layout.eta
            scale = s if (split and self.split_noise == "independent_scaled") else 1.0
            children = advance(
                forest,
                model,
                nodes,
                cond,
                float(sigmas[i + 1]),
                i + 1,
                self.kernel if stochastic else "ode",
                layout.eta.get(i, 0.0),
                noise_for,
                guidance,
                ctx.max_batch,
                fanout,
                std_scale=scale,
                observers=ctx.observers,
            )
            parents = forest.parent[children].tolist()
            if split:
                branches = torch.arange(K).repeat(nodes.shape[0]).tolist()
                path_of = {int(c): path_of[p] + (b,) for c, p, b in zip(children.tolist(), parents, branches)}
            else:
                path_of = {int(c): path_of[p] for c, p in zip(children.tolist(), parents)}
            nodes = children
        if layout.pruned:
            edges = forest.edges(trainable=True)
            pruned = edges[torch.isin(forest.step[edges], torch.tensor(layout.pruned))]
            forest.trainable[pruned] = 0.0
        return forest

    def metrics(self, forest: Forest) -> dict[str, float]:
        """Stochastic edges, edges skipped by depth pruning (before credit) and leaves per tree."""
        edges = torch.nonzero((forest.parent >= 0) & forest.stochastic).flatten()
        roots = forest.roots().numel()
        return {
            "tree/stochastic_edges": float(edges.numel()),
            "tree/depth_pruned_edges": float((forest.trainable[edges] == 0).sum()),
            "tree/leaves_per_tree": forest.leaves().numel() / max(roots, 1),
        }
