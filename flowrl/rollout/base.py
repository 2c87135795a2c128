"""What every rollout plan shares: its context and the batched transition step over forest nodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.core.choices import Checked
from flowrl.models.base import Conditioning, FlowModel
from flowrl.rollout import sde
from flowrl.rollout.forest import Forest
from flowrl.rollout.transfer import to_device


@dataclass
class RolloutContext:
    """Where a rollout sits in a run: everything its random draws are derived from.

    ``group_offset``: global index of this process's first prompt group (unique seeds across ranks).
    ``guidance``: CFG scale (None → the model's default). ``max_batch``: states per model forward.
    ``reduction``: how edge log-probs are reduced over latent elements (``mean`` | ``sum``); the loss
    owns this setting (``loss.reduction``) and the forest records it so replay matches.
    ``observers``: functions ``observe(forest, nodes [K], x [K, ...], sigma, v [K, ...])`` that :func:`advance`
    calls after every velocity forward, so a wrapping plan sees each state with its velocity without extra
    forwards (e.g. probed's x̂0 probes, VGPO).
    ``root_seeds``: set by a wrapping plan (Sol-RL's explore) to choose the x_T of the inner plan's roots:
    one list of seeds per prompt group of this rollout, :meth:`RolloutPlan.root_count` seeds each
    (None: the plan derives its own root seeds).
    ``teacher``: the objective's guided teacher (:class:`flowrl.objectives.teacher.Teacher`; None without
    ``loss.teacher``),
    for plans that let it draw a share of each group (the ODE plan's ``teacher_share``).
    ``teacher_fraction``: the share of ``rollout.teacher_share`` it draws in this rollout (the objective's
    ``loss.teacher.share_schedule`` at its optimizer steps, :meth:`~flowrl.objectives.base.Objective.teacher_fraction`).
    """

    seed: int = 0
    iteration: int = 0
    group_offset: int = 0
    guidance: float | None = None
    max_batch: int = 64
    reduction: str = "mean"
    observers: tuple[Callable[..., None], ...] = ()
    root_seeds: list[list[int]] | None = None
    teacher: object | None = None
    teacher_fraction: float = 1.0

    def given_root_seeds(self, num_groups: int, per_group: int) -> list[int] | None:
        """``root_seeds`` flattened group by group [num_groups·per_group] after checking their count, or
        None when no wrapping plan chose them."""
        if self.root_seeds is None:
            return None
        counts = [len(s) for s in self.root_seeds]
        if len(counts) != num_groups or any(c != per_group for c in counts):
            raise ValueError(
                f"root_seeds must give {per_group} seed(s) for each of {num_groups} prompt groups; got {counts}"
            )
        return [int(s) for seeds in self.root_seeds for s in seeds]

    def new_forest(self, prompts: list[str], guidance: float, device: torch.device | str) -> Forest:
        """An empty forest for ``prompts`` that records this context's sampler settings, its latents kept on ``device``
        (the rollout's model's)."""
        return Forest(prompts=list(prompts), guidance=guidance, reduction=self.reduction, device=device)


def inner_unread(plan: "RolloutPlan") -> dict[str, str]:
    """A wrapped plan's unread keys (:meth:`RolloutPlan.unread_keys`), named under ``rollout.inner`` where its
    keys are given."""
    return {k.replace("rollout.", "rollout.inner.", 1): why for k, why in plan.unread_keys().items()}


class RolloutPlan(Checked):
    """A rollout plan turns prompts into a :class:`Forest` (``rollout.plan``; docs/extending.md).

    Subclasses are dataclasses whose fields are the keys of the ``rollout`` section
    (:mod:`flowrl.core.components`). The lifecycle, as the trainer (and :func:`flowrl.sample`) drive it:

    1. :meth:`setup` once with the model and the reward, before the first rollout (an explore plan
       builds its low-precision copy of the policy here and keeps the reward to score its preview pool);
    2. :meth:`rollout` every iteration; the forest's leaves, and any states the plan asked for with
       ``forest.add_probe``, are then decoded and scored by the trainer, which logs :meth:`metrics`;
    3. :meth:`after_update` after every optimizer step (so a copy of the policy follows the weights).

    A plan that wraps another (``inner``) passes each call on to it. :meth:`expected_counts` gives the
    closed forms (docs/extending.md, "The loop, and what each component sees", lists each plan's page) for
    tests and logs, with one signature for every plan.
    """

    config_key = "rollout"  # fields with declared choices are checked as rollout.<field> (flowrl.config.choices)
    teacher_share = 0  # chains per group the objective's guided teacher draws (a field of the plans that let it)

    def setup(self, model: FlowModel, reward=None) -> None:
        """Called once before the first rollout; ``reward`` is the run's MultiReward (or None). What a plan can check
        without the model it checks when the config loads (e.g. :meth:`check_reward_normalize`), not here."""

    def check_reward_normalize(self, normalize: str) -> None:
        """Raise a ConfigError when the plan cannot work with the run's ``reward_normalize`` (``none`` | ``batch`` |
        ``group``), checked when the config loads (:func:`flowrl.config.checks.check_components`). Default: any."""

    def after_update(self, model: FlowModel) -> None:
        """Called after every optimizer step, with the updated model."""

    def rollout(self, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        """The plan's own state for checkpoints (None: none). Copies of the policy need none: after a resume
        loads the weights the loop calls :meth:`after_update`, as after any change of the weights."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore what :meth:`state_dict` returned (called before :meth:`after_update` on resume)."""

    def metrics(self, forest: Forest) -> dict[str, float]:
        """Statistics of a rolled-out and scored ``forest`` for the metrics log (e.g. how well an
        explorer's preview ranked the regenerated samples); called before credit. Default: none."""
        return {}

    @property
    def has_trainable_edges(self) -> bool:
        """Whether rollouts leave stochastic edges a policy objective can replay (an ODE plan does not)."""
        return True

    @property
    def keeps_clean_latents(self) -> bool:
        """Whether the forest's leaves are clean samples (σ = 0) a forward-process objective can train on."""
        return True

    def explorer_spec(self) -> tuple[str, int, list[str] | None] | None:
        """The low-precision explorer copy the plan keeps (``(backend, min_params, skip)``: what it converts), or
        None (default): none. For the memory estimate."""
        return None

    @property
    def schedule_steps(self) -> int | None:
        """T: the steps of the model's schedule this plan samples with (a probe completes states along it); None for a
        plan without one schedule."""
        return None

    def root_count(self) -> int | None:
        """Roots per prompt group whose x_T seeds a wrapping plan may choose through ``ctx.root_seeds``
        (:meth:`RolloutContext.given_root_seeds`); None (default): the plan does not take given roots."""
        return None

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        """Closed-form counts (docs/extending.md) of a rollout of ``num_prompts`` prompts in context ``ctx`` (its
        iteration and seed fix random windows): ``forwards``, ``trained_edges``, ``leaves`` and ``replay_rows`` (the
        states a policy objective's replay evaluates: one per parent of a trained edge), and where the plan has them
        ``probes`` (probed states, decoded and scored), ``explore_forwards`` / ``explore_decodes`` (an explorer's
        preview forwards and decoded previews), ``teacher_forwards``. Tools (the estimate, the logs) read these and
        nothing else of a plan."""
        raise NotImplementedError


# ---- the stepping engine -------------------------------------------------------------------------
# Every model forward of a rollout, a probe's completion or a plain ODE sample goes through
# velocity_in_chunks: states x [M, C, H, W] all at one noise level σ (a python float), in forwards of at
# most ``max_batch`` consecutive rows, in order. Every step over forest nodes goes through advance; states
# outside a forest (ODE completions, samples) move with euler_ode. Updates are sde.step's kernels (Euler:
# kernel "ode") and sde.dpm2_step, applied chunk by chunk, so a forward's layout fixes every number.


def velocity_in_chunks(
    model: FlowModel,
    x: torch.Tensor,
    sigma: float,
    cond: Conditioning,
    guidance: float,
    max_batch: int,
    cond_rows: torch.Tensor | None = None,
    count_on: Forest | None = None,
):
    """Velocities of the states ``x`` [M, ...] at ``sigma``, one forward per ``max_batch`` consecutive rows.

    Yields ``(rows, x_chunk, v)``: ``rows`` a slice of 0..M−1, ``x_chunk`` = x[rows] on the model's device,
    ``v`` [k, ...] its velocity. ``cond_rows`` [M]: the row of ``cond`` each state reads (None: ``cond`` has
    one row per state; passed as is when one forward covers them all). ``count_on``: the forest whose
    counters record each forward (:meth:`Forest.count_forward`)."""
    for start in range(0, x.shape[0], max_batch):
        rows = slice(start, start + max_batch)
        xb = x[rows].to(model.device)
        n = xb.shape[0]
        if cond_rows is not None:
            cond_b = cond.select(cond_rows[rows])
        else:
            cond_b = cond if n == x.shape[0] else cond.select(torch.arange(start, start + n, device=model.device))
        v = model.velocity(xb, torch.full((n,), sigma, device=model.device), cond_b, guidance)
        if count_on is not None:
            count_on.count_forward(n, cfg=model.uses_cfg(guidance))
        yield rows, xb, v


@dataclass
class DPM2:
    """The DPM-Solver++(2M) multistep solver as a kernel of :func:`advance` (:func:`flowrl.rollout.sde.dpm2_step`).

    Carries the previous step's x̂0 [M, ...] (rows in the order of the nodes it advanced) and its σ from
    one call to the next: use one per solve, over the same nodes' descendants in order (fanout 1)."""

    prev_x0: torch.Tensor | None = None
    prev_sigma: float | None = None


def advance(
    forest: Forest,
    model: FlowModel,
    parents: torch.Tensor,
    cond: Conditioning,
    sigma_next: float,
    step_next: int,
    kernel: str | DPM2,
    eta: float,
    noise_for: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None,
    guidance: float,
    max_batch: int,
    fanout: int = 1,
    std_scale: float = 1.0,
    observers: tuple[Callable[..., None], ...] = (),
    sigma: float | None = None,
) -> torch.Tensor:
    """Move every node in ``parents`` [M] (all at the same sigma) one step with ``kernel``, giving
    each ``fanout`` children (siblings share the parent's velocity and differ by their noise).

    ``kernel``: a transition kernel's name (:data:`flowrl.rollout.sde.KERNEL_FUNCTIONS`; ``"ode"`` is the Euler ODE
    step) or a :class:`DPM2` solver (deterministic edges of kernel ``dpm2``, never replayed: batch id −1;
    ``eta``, ``noise_for`` unused).

    The velocity at the parents is computed in chunks of ``max_batch // fanout`` parents (at least one),
    one forward each (:func:`velocity_in_chunks`), so a forward carries at most ``max_batch`` new edges;
    its id is recorded on them so training replays exactly this layout. ``cond`` holds one
    row per prompt group; ``noise_for(parent_of_child, branch)`` (both [K] for the K children of a
    chunk; ``branch`` in 0..fanout−1) returns noise [K, C, H, W] (None for deterministic kernels).
    Returns the new child indices [M·fanout], the children of a parent adjacent, parents in order.

    ``std_scale`` (default 1) widens the transition: x_next = μ + std_scale·std·ξ, and the edge's
    std (stored on the forest) and log-prob are those of the widened Gaussian N(μ, (std_scale·std)²)
    (BranchGRPO's ``independent_scaled`` split noise; docs/trees.md, "What one iteration does").
    ``observers`` (the rollout context's, :attr:`RolloutContext.observers`) see every chunk's parents with
    their velocity. ``sigma``: the parents' noise level when the caller knows it (a python float; None reads it from
    the forest).

    Nothing here waits for the device: the conditioning rows move once per call, the noise through pinned memory,
    and the edges' log-probs and stds reach the forest's host columns asynchronously (:meth:`Forest.add_children`).
    """
    multistep = isinstance(kernel, DPM2)
    if fanout > 1 and (multistep or kernel == "ode" or eta <= 0):
        raise ValueError("fanout > 1 needs a stochastic kernel: deterministic siblings would be copies")
    x_parents = forest.latents_of(parents)
    sigma = float(forest.sigma[parents[0]]) if sigma is None else sigma
    edges, x0s = [], []  # per forward, added after the last (add_edges)
    stochastic = not multistep and kernel != "ode" and eta > 0
    for rows, x, v in velocity_in_chunks(
        model,
        x_parents,
        sigma,
        cond,
        guidance,
        max(1, max_batch // fanout),
        cond_rows=to_device(forest.group[parents], model.device),
        count_on=forest,
    ):
        chunk = parents[rows]
        for observe in observers:
            observe(forest, chunk, x, sigma, v)
        if multistep:
            prev_x0 = None if kernel.prev_x0 is None else kernel.prev_x0[rows]
            x_next, x0 = sde.dpm2_step(x, v, sigma, sigma_next, prev_x0, kernel.prev_sigma)
            x0s.append(x0)
            zeros = torch.zeros(chunk.shape[0])
            edges.append((chunk, x_next, zeros, zeros, "dpm2", 0.0, -1))
            continue
        noise = noise_for if stochastic else None
        edges.append(_kernel_edges(forest, chunk, x, v, (sigma, sigma_next), kernel, eta, noise, fanout, std_scale))
    if multistep:
        kernel.prev_x0, kernel.prev_sigma = torch.cat(x0s), sigma
    return add_edges(forest, edges, sigma_next, step_next)


def _kernel_edges(
    forest: Forest,
    chunk: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    sigmas: tuple[float, float],
    kernel: str,
    eta: float,
    noise_for: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None,
    fanout: int,
    std_scale: float,
) -> tuple:
    """One forward's edges by transition ``kernel`` (:func:`advance`): the ``fanout`` children of each parent of
    ``chunk`` [K] (states ``x``, velocities ``v``) from noise level ``sigmas[0]`` to ``sigmas[1]``, as the tuple
    :func:`add_edges` takes. ``noise_for``: None for a deterministic step."""
    if fanout > 1:
        x, v = x.repeat_interleave(fanout, dim=0), v.repeat_interleave(fanout, dim=0)
        chunk = chunk.repeat_interleave(fanout)
    branch = torch.arange(fanout).repeat(chunk.shape[0] // fanout)
    noise = noise_for(chunk, branch) if noise_for is not None else None
    x_next, mean, std = sde.step(kernel, x, v, *sigmas, eta, noise)
    if std_scale != 1.0 and noise is not None:
        std = std * std_scale
        x_next = mean + std.reshape(-1, *([1] * (mean.ndim - 1))) * noise.float()
    if noise is None:  # deterministic: nothing of the device to wait for
        logp = std = torch.zeros(chunk.shape[0])
    else:
        logp = sde.log_prob(x_next, mean, std, forest.reduction)
    return (
        chunk,
        x_next,
        logp,
        std,
        kernel if noise is not None else "ode",
        eta if noise is not None else 0.0,
        forest.new_batch_id(),
    )


def add_edges(forest: Forest, edges: list[tuple], sigma_next: float, step_next: int) -> torch.Tensor:
    """Add the children of one :func:`advance` call, forward by forward, as few forest layers as possible: one per run
    of consecutive forwards with the same kernel and η (the forest's bookkeeping costs per call, not per row).

    ``edges``: per forward ``(parents [K], x_next [K, ...], logp [K], std [K], kernel name, eta, batch id)``. Returns
    the new nodes [ΣK], in the order given (node numbers and batch ids as one add per forward would give them)."""
    children, start = [], 0
    while start < len(edges):
        end = start + 1
        while end < len(edges) and edges[end][4:6] == edges[start][4:6]:
            end += 1
        run = edges[start:end]
        cat = (lambda k: run[0][k]) if len(run) == 1 else (lambda k: torch.cat([e[k] for e in run]))
        batch = torch.cat([torch.full((e[0].shape[0],), e[6]) for e in run])
        children.append(
            forest.add_children(cat(0), cat(1), sigma_next, step_next, cat(2), cat(3), run[0][4], run[0][5], batch)
        )
        start = end
    return torch.cat(children)


def euler_ode(
    model: FlowModel,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Conditioning,
    guidance: float,
    max_batch: int,
    start: torch.Tensor | None = None,
    cond_rows: torch.Tensor | None = None,
    count_on: Forest | None = None,
) -> torch.Tensor:
    """States outside a forest, ``x`` [Q, C, H, W], moved to σ = 0 with Euler ODE steps (``sde.step("ode")``)
    of the schedule ``sigmas`` [T+1]. Returns fp32 [Q, C, H, W] on x's device (``x`` is not changed).

    Row r starts at schedule step ``start[r]`` ([Q]; None: all at step 0). Schedule-aligned: at step i every
    row with start ≤ i moves one step, in forwards of at most ``max_batch`` such rows
    (:func:`velocity_in_chunks`, with ``cond_rows`` [Q] and ``count_on`` as there)."""
    x = x.to(torch.float32, copy=True)
    if x.shape[0] == 0:
        return x
    start = torch.zeros(x.shape[0], dtype=torch.long) if start is None else start
    for i in range(int(start.min()), sigmas.shape[0] - 1):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        active = torch.nonzero(start <= i).flatten()
        every = active.numel() == x.shape[0]
        rows_cond = cond_rows if every else (active if cond_rows is None else cond_rows[active])
        for rows, xb, v in velocity_in_chunks(
            model, x if every else x[active], sigma, cond, guidance, max_batch, cond_rows=rows_cond, count_on=count_on
        ):
            x[active[rows]] = sde.step("ode", xb, v, sigma, sigma_next)[0].to(x.device)
    return x
