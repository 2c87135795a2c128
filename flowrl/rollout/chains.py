"""Independent chains: Flow-GRPO, Flow-GRPO-Fast, DanceGRPO, MixGRPO (docs/algorithms.md, "Chains"), and ODE rollouts.

G chains per prompt. Steps inside the SDE window use the plan's kernel (trainable edges); all other
steps are ODE (never trained). With ``post_solver="dpm2"`` the steps after the window are replaced
by fewer DPM-Solver++(2M) steps (MixGRPO-Flash). The ODE plan (``rollout.plan: ode``, :class:`ODEChains`)
makes every step deterministic (``solver``: Euler or DPM-Solver++(2M) over all T steps): no log-probs, the
leaves' clean latents for forward-process objectives (DiffusionNFT, AWM); its section has only the keys it
reads (no kernel, eta, window or post-solver).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flowrl.core.choices import Checked, choice
from flowrl.core.seeding import derive_seed, seeded_normals
from flowrl.models.base import FlowModel
from flowrl.rollout import sde
from flowrl.rollout.base import DPM2, RolloutContext, RolloutPlan, advance
from flowrl.rollout.forest import Forest

WINDOW_MODES = ("all", "fixed", "random", "progressive")
POST_SOLVERS = ("none", "dpm2")
SOLVERS = ("euler", "dpm2")


@dataclass
class SDEWindow(Checked):
    """Which schedule steps are stochastic (and trained).

    - ``all``: steps 0..T−2 (the last step, to σ=0, is never trained);
    - ``fixed``: [start, start+size);
    - ``random``: ``size`` consecutive steps, start drawn per iteration (from the run seed) so the
      window lies inside ``range`` = [lo, hi) (default [0, T//2): Flow-GRPO-Fast);
    - ``progressive`` (MixGRPO): start = ``start`` + stride·⌊iteration/tau⌋, clamped at T−1−size.
    """

    mode: str = choice("all", WINDOW_MODES)  # all (steps 0..T−2) | fixed ([start, start+size)) | random (size
    # consecutive steps drawn per iteration inside range: Flow-GRPO-Fast) | progressive (MixGRPO: start +
    # stride·⌊iteration/tau⌋, clamped at T−1−size); the last step (to σ 0) is never stochastic
    start: int = 0  # fixed: the window's first step; progressive: its first step at iteration 0
    size: int = 3  # consecutive stochastic (trained) steps, in [1, T−1]; unread by all; a window tree's depth d
    range: list[int] | None = None  # random: [lo, hi), the steps the window is drawn inside; null = [0, max(T//2,
    # size)) (Flow-GRPO-Fast's first half)
    stride: int = 1  # progressive: steps the window moves every tau iterations (≥ 0)
    tau: int = 25  # progressive: iterations between the window's moves (≥ 1)

    config_key = "rollout.window"

    def validate(self, steps: int) -> None:
        if self.mode != "all" and not (1 <= self.size <= steps - 1):
            raise ValueError(f"rollout.window.size={self.size} must be in [1, steps-1={steps - 1}]")
        if self.mode == "fixed" and not (0 <= self.start and self.start + self.size <= steps - 1):
            raise ValueError(
                f"rollout.window.start={self.start} with size {self.size} must end by step {steps - 1} "
                f"(the last step is never stochastic)"
            )
        if self.mode == "random":
            lo, hi = self._range(steps)
            if not (0 <= lo and hi <= steps - 1 and hi - lo >= self.size):
                raise ValueError(
                    f"rollout.window.range={[lo, hi]} must satisfy 0 <= lo, hi <= steps-1={steps - 1}, "
                    f"hi-lo >= size={self.size}"
                )
        if self.mode == "progressive" and (self.tau < 1 or self.stride < 0):
            raise ValueError(f"rollout.window.tau={self.tau} must be >= 1 and stride={self.stride} >= 0")

    def _range(self, steps: int) -> tuple[int, int]:
        if self.range is None:
            return 0, max(steps // 2, self.size)
        return int(self.range[0]), int(self.range[1])

    def steps(self, steps: int, iteration: int, seed: int) -> list[int]:
        """Stochastic step indices for this iteration (sorted)."""
        self.validate(steps)
        if self.mode == "all":
            return list(range(steps - 1))
        if self.mode == "fixed":
            start = self.start
        elif self.mode == "random":
            lo, hi = self._range(steps)
            gen = torch.Generator().manual_seed(derive_seed(seed, iteration, "window"))
            start = lo + int(torch.randint(0, hi - self.size - lo + 1, (1,), generator=gen))
        else:
            start = min(self.start + self.stride * (iteration // self.tau), steps - 1 - self.size)
        return list(range(start, start + self.size))


@dataclass(frozen=True)
class ChainRun:
    """One rollout of G chains per prompt, as the chain engine (:func:`roll_chains`, :func:`chain_counts`) runs it: the
    settings of the plan that asked, resolved for this iteration (no config keys of its own).

    ``window``: the stochastic steps (sorted; empty: every step ODE); ``post``: the schedule indices DPM-Solver++(2M)
    visits after the window (MixGRPO-Flash; None: Euler ODE after it); ``dpm2_all``: DPM-Solver++(2M) over all T steps
    (the ODE plan's ``solver: dpm2``)."""

    group_size: int
    steps: int
    kernel: str = "ode"
    eta: float = 0.0
    shared_noise: bool = False
    window: tuple[int, ...] = ()
    post: tuple[int, ...] | None = None
    dpm2_all: bool = False


@dataclass
class Chains(RolloutPlan):
    """G independent chains per prompt (Flow-GRPO / DanceGRPO / MixGRPO).

    ``shared_noise``: one x_T per prompt group (DanceGRPO) instead of one per chain (Flow-GRPO). The
    group's chains then share the deterministic trunk up to the first stochastic step and branch there:
    those steps cost one forward per group, in the rollout and (at the branch point) in training.
    ``eta``: the kernel's noise level inside the window.
    """

    group_size: int = 8  # G, chains per prompt (≥ 2): the group whose rewards the credit rule compares
    steps: int = 10  # T, the sampling schedule's steps (the model's own shift; ≥ 2)
    kernel: str = "flow_grpo"  # transition kernel of the window's steps: flow_grpo, dance, cps (docs/algorithms.md,
    # "Transition kernels") or a registered / package.module:function one; not ode (that is rollout.plan: ode)
    eta: float = 0.7  # η, the kernel's noise level inside the window (published: flow_grpo 0.7, dance 0.3, cps 0.8)
    shared_noise: bool = False
    window: SDEWindow = field(default_factory=SDEWindow)  # which steps are stochastic and trained (the rest ODE,
    # never trained): its mode and the keys below it; docs/algorithms.md, "Chains"
    post_solver: str = choice("none", POST_SOLVERS)  # none | dpm2: the ODE steps after the window replaced by fewer
    # DPM-Solver++(2M) steps (MixGRPO-Flash; untrained)
    post_steps_ratio: float = 0.4  # post_solver dpm2: round(ratio·steps left after the window) DPM-Solver++(2M)
    # steps, at least 1; in (0, 1]

    def __post_init__(self) -> None:
        if isinstance(self.window, dict):
            self.window = SDEWindow(**self.window)
        sde.check_kernel(self.kernel, "rollout.kernel")
        if self.kernel == "ode":
            raise ValueError(
                "rollout.kernel='ode' makes every chain deterministic: that is the ODE plan; use "
                "rollout.plan: ode (its keys: group_size, steps, solver, teacher_share)"
            )
        check_chain_shape(self.group_size, self.steps)
        if self.shared_noise and self.eta <= 0:
            raise ValueError(
                f"rollout.eta={self.eta} with rollout.shared_noise=true would make every chain of a group "
                "the same ODE sample; use eta > 0"
            )
        if not (0.0 < self.post_steps_ratio <= 1.0):
            raise ValueError(f"rollout.post_steps_ratio={self.post_steps_ratio} must be in (0, 1]")
        self.window.validate(self.steps)

    def unread_fields(self) -> dict[str, str]:
        """``post_steps_ratio`` without a post-solver."""
        if self.post_solver == "none":
            return {"post_steps_ratio": "it sizes the steps of rollout.post_solver: dpm2, which is off"}
        return {}

    @property
    def schedule_steps(self) -> int:
        return self.steps

    def run_of(self, ctx: RolloutContext) -> ChainRun:
        """This iteration's :class:`ChainRun`: the window ``ctx`` draws and the post-solver's steps after it."""
        window = tuple(self.window.steps(self.steps, ctx.iteration, ctx.seed))
        post = None
        if self.post_solver == "dpm2" and window:
            post = tuple(post_indices(self.steps, window[-1] + 1, self.post_steps_ratio))
        return ChainRun(self.group_size, self.steps, self.kernel, self.eta, self.shared_noise, window, post)

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        """Forwards and trained edges: T per chain (fewer after the window with dpm2); window size edges.
        With ``shared_noise`` the steps up to and including the first stochastic one cost one forward per group."""
        return chain_counts(self.run_of(ctx or RolloutContext()), num_prompts)

    def root_count(self) -> int:
        """Roots per prompt group a wrapping plan may seed through ``ctx.root_seeds``: 1 with shared
        noise, else G (chain j starts from the group's j-th seed)."""
        return 1 if self.shared_noise else self.group_size

    @torch.no_grad()
    def rollout(self, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
        """Forest of len(prompts)·G chains, grouped per prompt in order (chain j of prompt p is
        leaf p·G + j). Root x_T come from ``ctx.root_seeds`` when a wrapping plan set them."""
        return roll_chains(self.run_of(ctx), model, prompts, ctx)


@dataclass
class ODEChains(RolloutPlan):
    """``rollout.plan: ode``: G deterministic chains per prompt, one x_T seed each (``solver``: ``euler`` or
    ``dpm2`` over the T steps of the model's schedule). No stochastic edges: the forest's leaves are clean
    samples for forward-process objectives (``loss.objective: nft | awm``); explore can wrap it.

    ``teacher_share``: k of the G chains of every group are drawn by the objective's guided teacher
    (``loss.teacher``, at its own guidance, from the same seeds those chains would have had; the share follows
    ``loss.teacher.share_schedule``), the other G − k by the policy. All G are scored and credited in one
    group; the forest's ``from_teacher`` column marks the teacher's nodes. Leaves: the policy's chains of
    every group, then the teacher's."""

    group_size: int = 8  # G, deterministic chains per prompt (≥ 2), each from its own x_T seed
    steps: int = 10  # T, ODE steps over the model's schedule (≥ 2)
    solver: str = choice("euler", SOLVERS)
    teacher_share: int = 0

    def __post_init__(self) -> None:
        check_chain_shape(self.group_size, self.steps)
        if not 0 <= self.teacher_share <= self.group_size:
            raise ValueError(
                f"rollout.teacher_share={self.teacher_share} must be in [0, rollout.group_size="
                f"{self.group_size}] (the teacher's samples per prompt group)"
            )

    @property
    def has_trainable_edges(self) -> bool:
        return False

    @property
    def schedule_steps(self) -> int:
        return self.steps

    def root_count(self) -> int:
        """One root per chain: a wrapping plan may choose each chain's x_T."""
        return self.group_size

    def run_of(self, chains: int) -> ChainRun:
        """The engine's run of ``chains`` deterministic chains per prompt."""
        return ChainRun(chains, self.steps, dpm2_all=self.solver == "dpm2")

    def teacher_count(self, ctx: RolloutContext) -> int:
        """The teacher's chains per group in this rollout (0 without a teacher in ``ctx``)."""
        if not self.teacher_share:
            return 0
        if ctx.teacher is None:
            raise ValueError(f"rollout.teacher_share={self.teacher_share} needs a teacher (loss.teacher) to draw them")
        return int(round(self.teacher_share * ctx.teacher_fraction))

    @torch.no_grad()
    def rollout(self, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
        k = self.teacher_count(ctx)
        if k == 0:
            return roll_chains(self.run_of(self.group_size), model, prompts, ctx)
        G, P = self.group_size, len(prompts)
        seeds = ctx.given_root_seeds(P, G) or [
            derive_seed(ctx.seed, ctx.iteration, "root", ctx.group_offset + g, j) for g in range(P) for j in range(G)
        ]
        per_group = [seeds[g * G : (g + 1) * G] for g in range(P)]
        parts = []
        for chains, guidance, who in (
            (range(G - k), ctx.guidance, None),
            (range(G - k, G), ctx.teacher.guidance, ctx.teacher),
        ):
            if not len(chains):
                continue
            part_ctx = replace(ctx, guidance=guidance, root_seeds=[[s[j] for j in chains] for s in per_group])
            if who is None:
                parts.append(roll_chains(self.run_of(len(chains)), model, prompts, part_ctx))
            else:
                with who.active():
                    forest = roll_chains(self.run_of(len(chains)), model, prompts, part_ctx)
                forest.from_teacher[:] = 1.0
                forest.counters["teacher_forwards"] = forest.counters["forwards"]
                parts.append(forest)
        policy_guidance = model.guidance_or_default(ctx.guidance)
        for forest in parts:
            forest.guidance = policy_guidance  # the training forward's guidance; the teacher's marks its nodes
        return Forest.merge(parts, same_prompts=True)

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        counts = chain_counts(self.run_of(self.group_size), num_prompts)
        if ctx is not None and self.teacher_share and ctx.teacher is not None:
            counts["teacher_forwards"] = num_prompts * self.teacher_count(ctx) * self.steps
        return counts


# ---- the chain engine ------------------------------------------------------------------------------
def check_chain_shape(group_size: int, steps: int) -> None:
    """``rollout.group_size`` ≥ 2 and ``rollout.steps`` ≥ 2 (a ValueError naming the key otherwise)."""
    if group_size < 2:
        raise ValueError(f"rollout.group_size={group_size} must be >= 2 (group advantages need several samples)")
    if steps < 2:
        raise ValueError(f"rollout.steps={steps} must be >= 2")


def post_indices(steps: int, window_end: int, ratio: float) -> list[int]:
    """Schedule indices the DPM-Solver++(2M) steps visit after the window (ending at T): ``ratio`` of the
    remaining steps, at least one."""
    remaining = steps - window_end
    n_post = max(1, round(ratio * remaining))
    return sorted({round(window_end + k * remaining / n_post) for k in range(n_post + 1)})


def chain_counts(run: ChainRun, num_prompts: int) -> dict[str, int]:
    """The closed forms of a :class:`ChainRun` of ``num_prompts`` prompts: ``forwards`` (T per chain; fewer after the
    window with a post-solver; with ``shared_noise`` the steps up to and including the first stochastic one cost one
    forward per group), ``trained_edges`` and ``replay_rows`` (one per edge: shared noise's first window step is
    counted per edge too), ``leaves``."""
    chains = num_prompts * run.group_size
    if not run.window:
        return {"forwards": chains * run.steps, "trained_edges": 0, "leaves": chains, "replay_rows": 0}
    per_chain = run.steps if run.post is None else run.window[-1] + 1 + len(run.post) - 1
    trunk = run.window[0] + 1 if run.shared_noise else 0  # forwards one per group: the trunk and the branch point
    forwards = num_prompts * trunk + chains * (per_chain - trunk)
    edges = chains * len(run.window)
    return {"forwards": forwards, "trained_edges": edges, "leaves": chains, "replay_rows": edges}


@torch.no_grad()
def roll_chains(run: ChainRun, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
    """Forest of len(prompts)·G chains of ``run``, grouped per prompt in order (chain j of prompt p is leaf p·G + j).
    Root x_T come from ``ctx.root_seeds`` when a wrapping plan set them. SDE noise is addressed by (global group,
    chain, step), never by node index, so the same chain draws the same noise whatever the process layout, batch
    chunking or trunk sharing."""
    G, T = run.group_size, run.steps
    guidance = model.guidance_or_default(ctx.guidance)
    sigmas = model.schedule(T).float().cpu()
    sigma_at = sigmas.tolist()  # the schedule as python floats, read once (no per-step tensor reads)
    window_set = set(run.window)
    P = len(prompts)
    forest = ctx.new_forest(prompts, guidance, model.device)
    nodes, keys = _roots(run, model, forest, ctx, P, sigma_at[0])
    cond = model.encode(prompts, guidance)
    shape = model.latent_shape
    step_now = 0
    where: dict[int, int] = {}  # node → its position in ``nodes`` (the frontier), rebuilt per step

    def noise_for(parents: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """Noise [K, *shape] of the children of ``parents`` [K] (``branch`` [K]): one draw per (group, chain, step)."""
        seeds = []
        for p, b in zip(parents.tolist(), branch.tolist()):
            group, chain = keys[where[p]]
            seeds.append(derive_seed(ctx.seed, ctx.iteration, "sde", group, b if chain is None else chain, step_now))
        return seeded_normals(seeds, shape, model.device)

    if run.dpm2_all:
        _post_solve(forest, model, nodes, cond, sigma_at, list(range(T + 1)), guidance, ctx.max_batch)
        return forest
    last = T if run.post is None else run.window[-1] + 1
    for i in range(last):
        step_now = i
        where = {n: k for k, n in enumerate(nodes.tolist())}
        fanout = G if (run.shared_noise and run.window and i == run.window[0]) else 1
        kernel = run.kernel if i in window_set else "ode"
        nodes = advance(
            forest,
            model,
            nodes,
            cond,
            sigma_at[i + 1],
            i + 1,
            kernel,
            run.eta if i in window_set else 0.0,
            noise_for,
            guidance,
            ctx.max_batch,
            fanout,
            observers=ctx.observers,
            sigma=sigma_at[i],
        )
        if fanout > 1:  # children come parent by parent: branch b of a trunk becomes chain b of its group
            keys = [(group, b) for group, _ in keys for b in range(fanout)]
    if run.post is not None:
        _post_solve(forest, model, nodes, cond, sigma_at, list(run.post), guidance, ctx.max_batch)
    return forest


def _roots(run: ChainRun, model: FlowModel, forest: Forest, ctx: RolloutContext, P: int, sigma0: float):
    """The roots (x_T) [R] of a run and each root's (global group, chain; None for a shared trunk) [R], in root order:
    one per group with ``shared_noise`` (the group's chains share the ODE trunk up to the first stochastic step and
    branch there), else one per chain."""
    G = run.group_size
    given = ctx.given_root_seeds(P, 1 if run.shared_noise else G)  # x_T chosen by a wrapping plan (explore), else None
    if run.shared_noise:
        seeds = given or [derive_seed(ctx.seed, ctx.iteration, "root", ctx.group_offset + g, 0) for g in range(P)]
        nodes = forest.add_roots(model.noise(seeds), torch.arange(P), seeds, sigma=sigma0, step=0)
        return nodes, [(ctx.group_offset + g, None) for g in range(P)]
    seeds = given or [
        derive_seed(ctx.seed, ctx.iteration, "root", ctx.group_offset + g, j) for g in range(P) for j in range(G)
    ]
    nodes = forest.add_roots(model.noise(seeds), torch.arange(P).repeat_interleave(G), seeds, sigma=sigma0, step=0)
    return nodes, [(ctx.group_offset + k // G, k % G) for k in range(P * G)]


def _post_solve(
    forest: Forest,
    model: FlowModel,
    nodes: torch.Tensor,
    cond,
    sigmas: list[float],
    idx: list[int],
    guidance: float,
    max_batch: int,
) -> None:
    """DPM-Solver++(2M) over the schedule indices ``idx`` (ending at T, σ=0) of ``sigmas`` [T+1]: untrained ODE edges
    of kernel ``dpm2`` (after a window: :func:`post_indices`; the ODE plan's ``solver: dpm2``: all steps), one
    :func:`advance` per step with one :class:`DPM2` solver carrying x̂0 between them. No observers: the post-solver's
    states are not shown to a wrapping plan (probed's x̂0 probes refuse it)."""
    solver = DPM2()
    for a, b in zip(idx[:-1], idx[1:]):
        nodes = advance(
            forest, model, nodes, cond, sigmas[b], b, solver, 0.0, None, guidance, max_batch, sigma=sigmas[a]
        )
