"""Sol-RL: explore cheap, regenerate faithful, train on the regenerated (docs/explore.md).

Per prompt group, every iteration:

1. **pool**: N seeds (``pool``, default 4·K), seed n of global group g = ``derive_seed(run seed,
   iteration, "explore", g, n)``; x_T = ``model.noise([seed])`` (bit-exact on any device);
2. **preview**: an ODE of ``preview_steps`` Euler steps with the explorer (:mod:`flowrl.rollout.explorer`:
   ``same`` precision with fewer steps, or a low-precision copy that follows the live weights);
3. **score** the N previews with the run's reward (the MultiReward the trainer passes to ``setup``);
4. **select** K seeds (K = the inner plan's :meth:`~flowrl.rollout.base.RolloutPlan.root_count`, e.g.
   ``group_size`` of chains): ``extremes`` (default) the ⌈K/2⌉ best and ⌊K/2⌋ worst previews,
   ``top_k`` the K best, ``spread`` K seeds evenly spaced over the preview ranking;
5. **regenerate**: the inner plan runs at full precision from exactly those x_T (rebuilt from the
   seeds through ``ctx.root_seeds``), with its own fresh SDE noise.

The returned forest is the inner plan's: it holds only the regenerated samples, so only they are
scored again by the trainer and reach credit and loss. Preview forwards are counted apart
(``forest.counters["explore_forwards"]``, ``"explore_nfe"``, ``"explore_scored"``).

The inner plan is any registered plan that takes given roots (``root_count()`` not None; chains
does, one root per chain), given by ``inner`` in the one nested form: a name, or the plan's section as a
mapping (``plan`` names it, its own keys beside, nested fields nested)::

    rollout:
      plan: explore
      inner:                              # plan: chains | tree | my_pkg.plans:MyPlan | path/to/file.py:MyPlan
        {plan: chains, group_size: 8, steps: 10, eta: 1.0, window: {mode: random, size: 2, range: [0, 5]}}
      pool: 32
      preview_steps: 6
      backend: int8

The keys are checked against the inner plan's own fields (a misspelled one names the nearest). From
Python, ``inner`` takes the same name or dict, or pass a ready plan: ``Explore(inner_plan=Chains(...))``.

The explorer follows the live weights (LoRA merged) lazily: ``after_update`` marks it stale and the
next rollout syncs it once, so several optimizer steps per iteration re-quantize once, and weights
loaded after ``setup`` (resume) are picked up too. :meth:`Explore.metrics` reports, per iteration:
Spearman and Kendall τ-b between preview and regenerated rewards of the kept seeds (pooled over the
iteration, and the mean within prompt groups), the separation of the kept upper vs lower half (by
preview rank) after regeneration, the top-half hit rate, explorer vs full-precision forwards per
second, and the time of every stage.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.core.choices import choice
from flowrl.core.seeding import derive_seed
from flowrl.errors import ConfigError
from flowrl.rollout.base import RolloutContext, RolloutPlan, inner_unread
from flowrl.rollout.explore_stats import (  # noqa: F401 (SELECTIONS, kendall, spearman: this module's API)
    RECORDS,
    SELECTIONS,
    explore_metrics,
    kendall,
    select_seeds,
    spearman,
)
from flowrl.rollout.forest import Forest
from flowrl.rollout.precision import BACKENDS


def build_inner(spec: str | dict[str, Any], key: str = "rollout.inner") -> RolloutPlan:
    """The inner plan ``spec`` (a name, or ``{plan: name, key: value, ...}``) built by
    :func:`flowrl.core.components.build_nested`; it must take given root seeds (the explorer chooses them) and not be
    an explore plan itself."""
    from flowrl.core import components

    plan = components.build_nested(components.PLAN, spec, key=key, refuse=Explore)
    if plan.root_count() is None:
        raise ConfigError(
            f"{key}={spec!r} does not take given root seeds (its root_count() is None), so "
            "it cannot regenerate the selected seeds"
        )
    return plan


@dataclass
class Explore(RolloutPlan):
    """Sol-RL's explore → select → regenerate around an inner plan (module docstring).

    ``inner``: the inner plan, a name or ``{plan: name, its keys...}``; ``pool``: N candidates per prompt (None →
    4·K); ``select``: ``extremes`` | ``top_k`` | ``spread``; ``preview_steps``: Euler steps of the
    explorer's ODE preview; ``backend``: the explorer (:data:`flowrl.rollout.precision.BACKENDS`), checked
    against this machine when the config loads and against the model's device at ``setup``;
    ``min_params`` / ``skip``: which Linear layers a quantizing backend converts (None → the
    backend's default skip list, :data:`flowrl.rollout.precision.DEFAULT_SKIP`).
    """

    inner: str | dict = "chains"
    pool: int | None = None
    select: str = choice("extremes", SELECTIONS)  # which K of the pool's seeds are regenerated, by preview reward:
    # extremes (the ⌈K/2⌉ best and ⌊K/2⌋ worst) | top_k (the K best) | spread (K evenly spaced over the ranking)
    preview_steps: int = 6
    backend: str = choice("same", BACKENDS)  # the explorer that previews: same (the live model, cheap by its fewer
    # steps) | bf16 | fp16 | int8 | nf4 | fp8 | nvfp4 (a low-precision copy that follows the live weights;
    # flowrl/rollout/precision.py), checked against this machine when the config loads and against the model's device
    # at setup
    min_params: int = 16384  # a quantizing backend converts only the Linear layers with at least this many weights
    # (16,384 = 128×128; ≥ 0)
    skip: list[str] | None = None  # module-name patterns (fnmatch) of Linear layers a quantizing backend leaves in
    # the rest's precision; null = the backend's default skip list (flowrl.rollout.precision.DEFAULT_SKIP)
    inner_plan: RolloutPlan | None = field(default=None, metadata={"config": False})

    def __post_init__(self) -> None:
        from flowrl.rollout.precision import check_backend

        if self.inner_plan is None:
            self.inner_plan = build_inner(self.inner)
        elif self.inner_plan.root_count() is None:
            raise ConfigError(f"inner_plan {type(self.inner_plan).__name__} does not take given root seeds")
        if self.preview_steps < 1:
            raise ConfigError(f"rollout.preview_steps={self.preview_steps} must be >= 1")
        if self.pool is not None and self.pool < self.keep:
            raise ConfigError(
                f"rollout.pool={self.pool} must be >= the kept seeds per prompt "
                f"(K = {self.keep}, the inner plan's roots per group)"
            )
        if self.min_params < 0:
            raise ConfigError(f"rollout.min_params={self.min_params} must be >= 0")
        check_backend(self.backend)  # this machine; the model's device is checked again in setup
        # declared state, set by setup and after_update alone (per-iteration records travel on the forest's meta)
        self._explorer = None
        self._model = None
        self._reward = None
        self._stale = False

    @property
    def keep(self) -> int:
        """K: seeds kept per prompt (the inner plan's roots per group)."""
        return int(self.inner_plan.root_count())

    @property
    def pool_size(self) -> int:
        """N: candidates per prompt."""
        return self.pool if self.pool is not None else 4 * self.keep

    # ---- lifecycle --------------------------------------------------------------------------
    def unread_fields(self) -> dict[str, str]:
        """``min_params`` and ``skip`` with the ``same`` backend (it converts no layer)."""
        if self.backend == "same":
            why = "it chooses the layers a low-precision backend converts, and rollout.backend: same converts none"
            return {"min_params": why, "skip": why}
        return {}

    def unread_keys(self) -> dict[str, str]:
        """Its own unread keys (the base's check of :meth:`unread_fields`) and the inner plan's, named under
        ``rollout.inner``."""
        return {**super().unread_keys(), **inner_unread(self.inner_plan)}

    def check_reward_normalize(self, normalize: str) -> None:
        """The inner plan's (the explorer scores its previews with whatever combination the run uses)."""
        self.inner_plan.check_reward_normalize(normalize)

    def setup(self, model, reward=None) -> None:
        """Set up the inner plan, keep the reward (it scores the preview pool) and build the explorer."""
        from flowrl.rollout.explorer import make_explorer
        from flowrl.rollout.precision import check_backend

        self.inner_plan.setup(model, reward)
        if isinstance(reward, str):
            from flowrl_rewards import MultiReward

            reward = MultiReward([reward])
        self._reward = reward
        check_backend(self.backend, model.device)
        self._model = model
        self._explorer = make_explorer(model, self.backend, min_params=self.min_params, skip=self.skip)
        self._stale = True  # weights loaded after setup (resume) are picked up by the first rollout

    def after_update(self, model) -> None:
        """Mark the explorer stale (the next rollout re-merges the LoRA into it once)."""
        self.inner_plan.after_update(model)
        self._model = model
        self._stale = True

    @property
    def explorer(self):
        """The :class:`~flowrl.rollout.explorer.Explorer`, synced with the live weights."""
        return self._synced()[0]

    def _synced(self):
        """(the explorer synced with the live weights, seconds the sync took: 0 when it was not stale)."""
        if self._explorer is None:
            raise RuntimeError("Explore.setup(model, reward) must run before the explorer is used")
        seconds = 0.0
        if self._stale:
            t0 = time.perf_counter()
            self._explorer.sync(self._model)
            seconds = time.perf_counter() - t0
            self._stale = False
        return self._explorer, seconds

    def explorer_spec(self) -> tuple[str, int, list[str] | None] | None:
        """``(backend, min_params, skip)`` of its explorer copy (``same`` keeps no copy of its own: it samples with
        the policy, fewer steps)."""
        return (self.backend, self.min_params, self.skip)

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        """The inner plan's counts (full-precision forwards, trained edges, leaves of K seeds per prompt)
        plus ``explore_forwards`` = prompts · N · preview_steps (explorer forwards, ×2 NFE with CFG) and
        ``explore_decodes`` = prompts · N (the previews decoded and scored)."""
        counts = dict(self.inner_plan.expected_counts(num_prompts, ctx))
        counts["explore_forwards"] = num_prompts * self.pool_size * self.preview_steps
        counts["explore_decodes"] = num_prompts * self.pool_size
        return counts

    # ---- rollout ----------------------------------------------------------------------------
    def _score_pool(self, images: torch.Tensor, prompts: list[str], groups: torch.Tensor) -> torch.Tensor:
        """Combined reward [M] of the preview images [M, 3, H, W] (the run's MultiReward)."""
        from flowrl.rollout.scoring import components_of

        parts = components_of(self._reward, images, prompts, {})
        return self._reward.combine(parts, groups).float().cpu()

    @torch.no_grad()
    def rollout(self, model, prompts: list[str], ctx: RolloutContext) -> Forest:
        """Preview N seeds per prompt with the explorer, keep K by reward, regenerate them with the inner
        plan; returns the inner plan's forest (regenerated samples only)."""
        from flowrl.rollout.decoding import decode
        from flowrl.rollout.sampling import ode_sample

        if self._reward is None:
            raise RuntimeError(
                "Explore needs the run's reward to score its preview pool: call setup(model, reward) "
                "(flowrl.sample(..., reward=...) or the trainer do)"
            )
        P, N, K = len(prompts), self.pool_size, self.keep
        explorer, sync_seconds = self._synced()
        guidance = model.guidance_or_default(ctx.guidance)
        seeds = [
            derive_seed(ctx.seed, ctx.iteration, "explore", ctx.group_offset + g, n) for g in range(P) for n in range(N)
        ]
        pool_prompts = [p for p in prompts for _ in range(N)]

        t0 = time.perf_counter()
        x0 = ode_sample(
            explorer.model,
            pool_prompts,
            seeds,
            self.preview_steps,
            guidance=guidance,
            max_batch=ctx.max_batch,
            decode=False,
        )
        t1 = time.perf_counter()
        groups = torch.arange(P).repeat_interleave(N)
        rewards = self._score_pool(decode(model, x0, ctx.max_batch), pool_prompts, groups + ctx.group_offset)
        t2 = time.perf_counter()
        kept = [select_seeds(rewards[g * N : (g + 1) * N], K, self.select) for g in range(P)]
        root_seeds = [[seeds[g * N + int(i)] for i in kept[g]] for g in range(P)]
        t3 = time.perf_counter()
        forest = self.inner_plan.rollout(model, prompts, dataclasses.replace(ctx, root_seeds=root_seeds))
        t4 = time.perf_counter()

        used = set(forest.seed[forest.roots()].tolist())
        if used != {s for group in root_seeds for s in group}:
            raise RuntimeError(
                f"inner plan {type(self.inner_plan).__name__} ignored ctx.root_seeds: its roots are not "
                "the selected seeds"
            )
        cfg = 2 if model.uses_cfg(guidance) else 1
        forest.counters["explore_forwards"] = forest.counters.get("explore_forwards", 0) + P * N * self.preview_steps
        forest.counters["explore_nfe"] = forest.counters.get("explore_nfe", 0) + P * N * self.preview_steps * cfg
        forest.counters["explore_scored"] = forest.counters.get("explore_scored", 0) + P * N
        forest.meta.setdefault(RECORDS, []).append(  # read by metrics(forest): nothing kept on the plan
            {
                "iteration": ctx.iteration,
                "preview": {s: float(rewards[k]) for k, s in enumerate(seeds)},
                "kept": root_seeds,  # per local group, in selection order
                "pool_rewards": rewards,
                "explorer_forwards": P * N * self.preview_steps,
                "full_forwards": forest.counters["forwards"],
                "time/explore_preview": t1 - t0,
                "time/explore_score": t2 - t1,
                "time/explore_select": t3 - t2,
                "time/explore_regenerate": t4 - t3,
                "time/explore_sync": sync_seconds,
            }
        )
        return forest

    # ---- diagnostics ------------------------------------------------------------------------
    def metrics(self, forest: Forest) -> dict[str, float]:
        """Rank fidelity and stage times of the rollouts that made ``forest`` (``explore/…`` and ``time/explore_…``),
        from the records they left on its ``meta``; ``forest`` must be scored (rewards on its leaves)."""
        return explore_metrics(forest)
