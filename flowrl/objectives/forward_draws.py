"""The forward-process objectives' micro-batches and draws (a mixin of
:class:`~flowrl.objectives.forward.ForwardProcessObjective`; the module docstring of :mod:`flowrl.objectives.forward`
says what they train on).

Each scored leaf's (t, ε) draws are addressed, never taken from a global RNG: ε by (run seed, iteration, root seed of
the leaf, its index within its prompt group (:func:`rank_within`), draw), t the same way or, with ``share_t``, by (run
seed, iteration, prompt, draw). t is logit-normal or uniform in ``t_range`` (:meth:`ForwardDraws.draw_t`), or one of
the sampler's own noise levels (:meth:`ForwardDraws.sampler_t`). It reads the objective's fields (``draws``,
``timesteps``, ``share_t``, ``micro_batch``, ``adv_clip``, ``teacher``...) and its teacher's anchor weight.
"""

from __future__ import annotations

import torch

from flowrl.core.seeding import derive_seed, seeded_normals
from flowrl.objectives.base import Batch
from flowrl.objectives.teacher import leaf_weights


class ForwardDraws:
    """:meth:`batches` of a forward-process objective: its leaves, their (t, ε) draws and the teacher's anchor."""

    def draw_t(self, seeds: list[int]) -> torch.Tensor:
        """Timesteps [len(seeds)] in ``t_range``, one per seed."""
        u = torch.stack(
            [
                torch.rand((), generator=torch.Generator().manual_seed(s))
                if self.timesteps == "uniform"
                else torch.sigmoid(
                    self.logit_mean + self.logit_std * torch.randn((), generator=torch.Generator().manual_seed(s))
                )
                for s in seeds
            ]
        )
        lo, hi = self.t_range
        return (lo + (hi - lo) * u).clamp(1e-4, 1.0 - 1e-4).float()

    def batches(self, forest, iteration: int = 0, seed: int = 0, units: torch.Tensor | None = None) -> list[Batch]:
        """Micro-batches of leaves (``micro_batch`` // ``draws`` each) with their draws: ``t`` [B·D] and
        ``noise`` [B·D, C, H, W], leaf-major, the anchor's per-leaf weight ``anchor`` [B] (with a teacher) and the
        teacher's conditioning of the forest's prompts ``teacher_cond`` (encoded once per iteration, when its
        velocity is needed). Leaves must be clean (σ = 0); only the credited units are trained (:meth:`units`:
        failed rewards and leaves the credit rule gave weight 0 are left out)."""
        leaves = forest.leaves()
        if leaves.numel() and bool((forest.sigma[leaves] > 0).any()):
            raise ValueError(
                "forward-process objectives train on clean latents, but some leaves of this forest "
                "are not at sigma 0: the plan must sample to the end"
            )
        leaves = self.select_leaves(forest, self.units(forest) if units is None else units, padding=units is not None)
        if leaves.numel() == 0:
            return []
        group = forest.group[leaves]
        within = rank_within(group)  # index of each leaf within its prompt group (layout-free address)
        shape = tuple(forest.all_latents().shape[1:])
        D = self.draws
        t_seeds, eps_seeds = [], []
        for root, g, k in zip(forest.seed[leaves].tolist(), group.tolist(), within.tolist()):
            prompt = forest.prompts[g]
            for d in range(D):
                t_seeds.append(
                    derive_seed(seed, iteration, "fp_t", prompt, d)
                    if self.share_t
                    else derive_seed(seed, iteration, "fp_t", root, k, d)
                )
                eps_seeds.append(derive_seed(seed, iteration, "fp_eps", root, k, d))
        t = self.sampler_t(forest, t_seeds) if self.timesteps == "sampler" else self.draw_t(t_seeds)
        anchor = None
        strength = self.anchor_weight(forest)
        if strength > 0:
            adv = forest.advantage[leaves].float().clamp(-self.adv_clip, self.adv_clip)
            anchor = strength * leaf_weights(self.teacher.weighting, forest.reward[leaves].float(), group, adv)
        reads_teacher = self.needs_teacher_velocity(anchor is not None)
        teacher_cond = self.teacher_model.encode(forest.prompts) if reads_teacher else None
        per = max(1, self.micro_batch // D)
        out = []
        for a in range(0, leaves.numel(), per):
            rows = slice(a * D, min(a + per, leaves.numel()) * D)
            noise = seeded_normals(eps_seeds[rows], shape)
            extra = {
                "t": t[rows],
                "noise": noise,
                "anchor": None if anchor is None else anchor[a : a + per],
                "teacher_cond": teacher_cond,
                "anchor_weight": None if self.teacher is None else strength,
            }
            out.append(Batch(leaves[a : a + per], int(leaves[a : a + per].numel()), extra))
        return out

    def needs_teacher_velocity(self, anchored: bool) -> bool:
        """Whether the loss reads the teacher's velocity in an update (``anchored``: the anchor weighs in it)."""
        return anchored

    def select_leaves(self, forest, leaves: torch.Tensor, padding: bool = False) -> torch.Tensor:
        """The leaves [L'] this objective trains on, of the scored ``leaves`` [L] (default: all of them); ``padding``:
        asked for explicit units (the sharded loop's weight-0 padding, which needs one micro-batch)."""
        return leaves

    def sampler_t(self, forest, seeds: list[int]) -> torch.Tensor:
        """``timesteps: sampler``: for each leaf (``draws`` consecutive seeds), ``draws`` distinct noise levels of
        the sampler's schedule (the σ > 0 its nodes visited), drawn from the leaf's first seed [len(seeds)]."""
        levels = torch.unique(forest.sigma[forest.sigma > 0]).float()
        D = self.draws
        if D > levels.numel():
            raise ValueError(
                f"loss.draws={D} with loss.timesteps='sampler' needs at least {D} sampler steps; the "
                f"rollouts visited {levels.numel()} noise levels above 0 (raise rollout.steps)"
            )
        picks = [
            levels[torch.randperm(levels.numel(), generator=torch.Generator().manual_seed(seeds[i]))[:D]]
            for i in range(0, len(seeds), D)
        ]
        return torch.cat(picks).clamp(1e-4, 1.0 - 1e-4)


def rank_within(group: torch.Tensor) -> torch.Tensor:
    """For entries labelled ``group`` [L] (ints ≥ 0), each entry's index among the entries of its group, in order
    [L]."""
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group)
    first = torch.cumsum(counts, 0) - counts  # where each group starts in ``order``
    within = torch.empty_like(group)
    within[order] = torch.arange(group.numel()) - first[group[order]]
    return within
