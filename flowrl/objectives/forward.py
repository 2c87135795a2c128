"""What the forward-process objectives share (DiffusionNFT: :mod:`flowrl.objectives.nft`; AWM:
:mod:`flowrl.objectives.awm`;
best-of-N: :mod:`flowrl.objectives.best_of_n`).

Both train on the clean latents x0 of the forest's leaves, whatever sampler made them (an ODE plan,
chains, a tree, explore): no log-probs, no replay. Per leaf and iteration, D draws (t, ε) give the
forward-process point x_t = (1−t)·x0 + t·ε and the flow-matching target y = ε − x0 (the velocity the
model predicts at noise level σ = t). Each leaf carries its group advantage A (written by the credit
rule; 0 in a group without reward spread, which is still trained) and is trained unless its reward failed
(NaN) or the credit rule gave it weight 0 (MC-GRPO's median sample, a tree's width-pruned chain).

Draws are addressed, never taken from a global RNG: ε by (run seed, iteration, root seed of the leaf,
its index within its prompt group, draw), t the same way or, with ``share_t``, by (run seed, iteration,
prompt, draw) so a group shares its timesteps. Any process layout and a resume draw the same numbers.

``cfg``: ``free`` (the published DiffusionNFT mode): rollouts at guidance 1 and the conditional velocity
is the policy, trained alone (no unconditional forward); ``guided``: rollouts at the model's guidance and
the guided velocity v_u + g·(v_c − v_u) is the policy.

Both keep an old policy (:class:`~flowrl.objectives.copies.OldPolicy`): θ_old ← d_k·θ_old + (1−d_k)·θ after
optimizer step k, d_k = ``old_decay``·min(1, k/``old_decay_warmup``) (constant without warm-up; a
LoRA policy's old copy is a second adapter on the same base). ``kl_ref`` > 0 adds
``kl_ref``·mean‖v_θ − v_ref‖² towards the initial policy. With ``old_decay_rate`` > 0 the decay follows
DiffusionNFT's public schedule instead: d_k = min(``old_decay_rate``·max(0, k − ``old_decay_flat``), ``old_decay``)
(their values: rate 0.001, cap 0.5, flat 0).

``teacher`` (:mod:`flowrl.objectives.teacher`): a frozen guided teacher whose velocity anchors the policy at the same
forward-process points (λ_k·w·mean‖v_θ − v_T‖², added to every row) and whose samples may share the groups
(``rollout.teacher_share``). ``reward_term`` weights the objective's own reward-driven term: 0 leaves the
anchor alone (guidance distillation, the baseline the reward must beat).

``timesteps: sampler``: each leaf trains at ``draws`` distinct noise levels of the sampler's own schedule
(the σ > 0 of the forest's nodes), fresh ε each — DiffusionNFT's public setting (9 of 10 steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from flowrl.core.choices import choice
from flowrl.objectives.base import Batch, Objective, ObjectiveFacts
from flowrl.objectives.copies import OldPolicy, Reference
from flowrl.objectives.forward_draws import ForwardDraws
from flowrl.objectives.forward_draws import rank_within as rank_within  # re-exported: importable from here as before
from flowrl.objectives.teacher import Teacher, TeacherSpec
from flowrl.rollout.transfer import to_device

CFG_MODES = ("free", "guided")
TIMESTEPS = ("logit_normal", "uniform", "sampler")


@dataclass
class ForwardProcessObjective(ForwardDraws, Objective):
    """What DiffusionNFT and AWM share: the leaves' micro-batches, (t, ε) draws, the old copy, CFG modes.

    ``draws``: (t, ε) pairs per leaf and iteration [2]. ``timesteps``: ``logit_normal`` (t = sigmoid(N(
    ``logit_mean``, ``logit_std``²))) or ``uniform``, mapped into ``t_range`` = [lo, hi]. ``micro_batch``:
    rows (leaf × draw) per training forward — not a key of its own: the run's ``rollout.max_batch``, set by
    :func:`flowrl.config.build.build_loss`. ``adv_clip``: |A| bound.
    """

    draws: int = 2
    timesteps: str = choice("logit_normal", TIMESTEPS)  # how each draw's t (= σ) is drawn: logit_normal (t =
    # sigmoid(N(logit_mean, logit_std²))) or uniform, mapped into t_range; sampler: draws distinct noise levels
    # (σ > 0) of the rollout's own schedule (DiffusionNFT's public setting; group objectives: of its highest
    # level_fraction)
    logit_mean: float = 0.0  # timesteps logit_normal: the mean of the normal whose sigmoid is t (0 = centred at ½)
    logit_std: float = 1.0  # timesteps logit_normal: the std of that normal (> 0; larger spreads t to the ends)
    t_range: list[float] = field(default_factory=lambda: [0.0, 1.0])  # [lo, hi], 0 ≤ lo < hi ≤ 1: the drawn t is
    # lo + (hi − lo)·u (clamped to [1e-4, 1 − 1e-4]); unread with timesteps sampler
    share_t: bool = False  # one t per prompt group and draw (the group's samples compared at the same noise levels)
    # instead of one per leaf; ε stays per leaf
    cfg: str = choice("free", CFG_MODES)
    adv_clip: float = 5.0  # |A| bound: the leaves' advantages are clipped to ±adv_clip (> 0)
    old_decay: float = 0.9  # the old copy's EMA decay d ∈ [0, 1): θ_old ← d·θ_old + (1 − d)·θ after every optimizer
    # step (0 = the policy that sampled the iteration); with old_decay_rate > 0 the cap of the ramp
    old_decay_warmup: int = 0  # optimizer steps over which the decay ramps up: d_k = old_decay·min(1,
    # k/old_decay_warmup); 0 = constant
    old_decay_rate: float = 0.0  # > 0: the decay ramps linearly instead, d_k = min(old_decay_rate·max(0, k −
    # old_decay_flat), old_decay) (DiffusionNFT's public schedule: rate 0.001, cap 0.5); 0 = off
    old_decay_flat: int = 0  # old_decay_rate > 0: optimizer steps before the ramp starts
    kl_ref: float = 0.0  # weight of kl_ref·mean‖v_θ − v_ref‖² towards the initial policy (LoRA off, or a frozen copy
    # under full fine-tuning); 0 = no reference forward
    teacher: TeacherSpec | None = None  # a frozen guided teacher ({guidance: 3.0, ...}; docs/algorithms.md, "A
    # guided teacher"): its velocity anchors the policy at the same forward-process points (λ_k·w·mean‖v_θ −
    # v_T‖², added to every row) and its samples may share the groups (rollout.teacher_share); null = none
    reward_term: float = 1.0  # weight of the objective's own reward-driven term (≥ 0): 0 leaves the teacher's anchor
    # alone (guidance distillation, the baseline the reward must beat)

    trains_on = "leaves"
    trains_flat = True  # a group without spread still pulls towards the old copy (and the teacher)
    progress_keys = {"fm": (("fm_error",), ".3f"), "anchor": (("anchor_error",), ".3f")}
    group_use: ClassVar[str | None] = None  # what an objective reading whole prompt groups does with them (needs 2+)
    uses_old: ClassVar[bool] = True  # keeps a lagging old copy (a subclass that never reads it sets False)
    has_reward_free_point: ClassVar[bool] = True  # with an old copy: the reward-free terms vanish at old = policy
    state_attributes: ClassVar[tuple[str, ...]] = ("_updates",)  # optimizer steps taken (the old copy's weights and
    # the schedules follow them; the copies' tensors change in place)

    def __post_init__(self) -> None:
        if isinstance(self.teacher, dict):
            self.teacher = TeacherSpec(**self.teacher)
        if self.draws < 1:
            raise ValueError(f"loss.draws={self.draws} must be >= 1")
        if len(self.t_range) != 2 or not 0.0 <= self.t_range[0] < self.t_range[1] <= 1.0:
            raise ValueError(f"loss.t_range={list(self.t_range)} must be [lo, hi] with 0 <= lo < hi <= 1")
        if self.logit_std <= 0:
            raise ValueError(f"loss.logit_std={self.logit_std} must be > 0")
        if not 0.0 <= self.old_decay < 1.0:
            raise ValueError(
                f"loss.old_decay={self.old_decay} must be in [0, 1) (the old policy's EMA decay per "
                "optimizer step; 0 = the policy that sampled the iteration)"
            )
        if self.old_decay_warmup < 0:
            raise ValueError(f"loss.old_decay_warmup={self.old_decay_warmup} must be >= 0")
        if self.adv_clip <= 0:
            raise ValueError(f"loss.adv_clip={self.adv_clip} must be > 0")
        if self.kl_ref < 0:
            raise ValueError(f"loss.kl_ref={self.kl_ref} must be >= 0")
        if self.old_decay_rate < 0 or self.old_decay_flat < 0:
            raise ValueError(
                f"loss.old_decay_rate={self.old_decay_rate} and loss.old_decay_flat={self.old_decay_flat} must be >= 0"
            )
        if self.reward_term < 0:
            raise ValueError(f"loss.reward_term={self.reward_term} must be >= 0 (0 = the teacher's anchor alone)")
        if self.reward_term == 0 and (self.teacher is None or self.teacher.anchor == 0):
            raise ValueError(
                "loss.reward_term=0 leaves nothing to train without a teacher's anchor; set "
                "loss.teacher.anchor > 0 or loss.reward_term > 0"
            )

    # ---- configuration and lifecycle ---------------------------------------------------------
    def unread_fields(self) -> dict[str, str]:
        """The logit-normal's parameters under other timesteps, ``t_range`` under the sampler's levels, and the old
        copy's schedule when the objective keeps no old copy (:attr:`uses_old`)."""
        out: dict[str, str] = {}
        if self.timesteps != "logit_normal":
            why = f"loss.timesteps={self.timesteps!r} draws no logit-normal timesteps"
            out.update({"logit_mean": why, "logit_std": why})
        if self.timesteps == "sampler":
            out["t_range"] = "loss.timesteps='sampler' trains at the sampler's own noise levels"
        if not self.uses_old:
            why = f"{type(self).__name__} keeps no old copy"
            out.update({k: why for k in ("old_decay", "old_decay_warmup", "old_decay_rate", "old_decay_flat")})
        return out

    def setup(self, model, teacher_weights=None) -> None:
        self._old = OldPolicy(model) if self.uses_old else None
        self._reference = Reference(model) if self.kl_ref > 0 else None
        self.teacher_model = (
            None if self.teacher is None else Teacher(model, self.teacher, self._reference, teacher_weights)
        )
        self._updates = 0

    def setup_sampling(self, model, teacher_weights=None, draws_teacher: bool = False) -> None:
        """The teacher alone when the plan lets it draw, on its own copy (no KL reference to share on the rollout
        side); no old copy, no reference."""
        self._old = self._reference = None
        drawn = draws_teacher and self.teacher is not None
        self.teacher_model = Teacher(model, self.teacher, None, teacher_weights) if drawn else None
        self._updates = 0

    def decay(self, k: int) -> float:
        """The old policy's decay d_k after optimizer step k (1-based)."""
        if self.old_decay_rate > 0:
            return min(self.old_decay_rate * max(0, k - self.old_decay_flat), self.old_decay)
        if self.old_decay_warmup <= 0:
            return self.old_decay
        return self.old_decay * min(1.0, k / self.old_decay_warmup)

    def anchor_weight(self, forest=None) -> float:
        """λ_k: the anchor's weight at the current optimizer step (0 without a teacher's anchor)."""
        if self.teacher is None or self.teacher.anchor == 0:
            return 0.0
        mean_reward = None
        if forest is not None:
            r = forest.reward[forest.leaves()]
            mean_reward = float(r[torch.isfinite(r)].mean()) if bool(torch.isfinite(r).any()) else None
        return self.teacher.anchor * self.teacher.anchor_schedule(self._updates, mean_reward)

    def teacher_fraction(self) -> float:
        """The teacher's share of each group follows ``share_schedule`` at the optimizer steps taken."""
        return 1.0 if self.teacher is None else float(self.teacher.sample_schedule(self._updates))

    def after_update(self, model) -> None:
        self._updates += 1
        if self._old is not None:
            self._old.update(self.decay(self._updates))

    def state_dict(self) -> dict:
        return {"old": None if self._old is None else self._old.state_dict(), "updates": self._updates}

    def frozen_copies(self) -> tuple[str, ...]:
        """The old copy (unless the objective keeps none), then the reference for ``kl_ref`` > 0."""
        return (("old",) if self.uses_old else ()) + (("reference",) if self.kl_ref > 0 else ())

    def describe(self) -> ObjectiveFacts:
        """Leaves, ``draws`` rows each; the frozen copies; the guided velocity trained only with ``cfg: guided``
        (CFG-free trains the conditional one, from rollouts at guidance 1); its teacher and :attr:`group_use`; the
        reward-free point when :attr:`has_reward_free_point`."""
        facts = replace(
            super().describe(),
            rows_per_unit=self.draws,
            frozen_copies=self.frozen_copies(),
            guided_training=self.cfg == "guided",
            teacher_path=None if self.teacher is None else self.teacher.path,
            rollout_cfg="any" if self.cfg == "guided" else "off",
            has_teacher=self.teacher is not None,
            teacher_guidance=None if self.teacher is None else float(self.teacher.guidance),
            teacher_in_update=self.teacher is not None and self.needs_teacher_velocity(self.teacher.anchor > 0),
            group_use=self.group_use,
        )
        if not self.has_reward_free_point:
            return facts
        return replace(facts, reward_free_overrides=self.reward_free_overrides(), no_reward_free_point=None)

    def reward_free_overrides(self) -> dict[str, Any]:
        """No teacher anchor and no KL to the reference: their gradients do not depend on the reward."""
        return {"teacher": None, "kl_ref": 0.0}

    def sampling_teacher(self):
        """The guided teacher built from ``loss.teacher`` (None without one)."""
        return self.teacher_model

    def move_to_reward_free_point(self) -> None:
        """The old copy set to the weights: the objective's own reward-free terms vanish there."""
        self._old.copy_from_policy()

    def take_stats(self) -> dict[str, float]:
        """The teacher's cost since the last call (forwards, seconds); the anchor's weight is a diagnostic of the
        loss."""
        return {} if self.teacher_model is None else self.teacher_model.take_stats()

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            if self._old is not None and state.get("old") is not None:
                self._old.load_state_dict(state["old"])
            self._updates = int(state["updates"])

    # ---- the shared forward --------------------------------------------------------------------
    def forward_rows(self, model, forest, batch: Batch, cond, with_old: bool = True) -> "Rows":
        """The micro-batch's :class:`Rows`: v_θ (with grad), v_old (no grad; None unless ``with_old``), v_ref (None
        unless ``kl_ref`` > 0), the teacher's guided velocity when the batch carries ``teacher_cond``
        (:meth:`needs_teacher_velocity`; no grad), the target y = ε − x0, t and the leaves' advantages."""
        device = model.device
        D = self.draws
        leaves = batch.index
        latents = forest.all_latents()
        x0 = latents[to_device(leaves, latents.device)].to(device).repeat_interleave(D, dim=0)
        t = to_device(batch.extra["t"], device)
        eps = to_device(batch.extra["noise"], device)
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - tb) * x0 + tb * eps
        target = eps - x0
        row_groups = to_device(forest.group[leaves].repeat_interleave(D), device)
        rows_cond = cond.select(row_groups)
        g = self.training_guidance(forest)
        v_old = v_ref = None
        if with_old:
            with torch.no_grad(), self._old.active():
                v_old = model.velocity(x_t, t, rows_cond, g).float()
        if self._reference is not None:
            with torch.no_grad(), self._reference.active():
                v_ref = model.velocity(x_t, t, rows_cond, g).float()
        teacher_cond = batch.extra.get("teacher_cond")
        v_teacher = (
            None if teacher_cond is None else self.teacher_model.velocity(x_t, t, teacher_cond.select(row_groups))
        )
        v = model.velocity(x_t, t, rows_cond, g).float()
        adv = to_device(forest.advantage[leaves].float(), device).clamp(-self.adv_clip, self.adv_clip)
        return Rows(v, v_old, v_ref, v_teacher, target, t, adv)

    def training_guidance(self, forest) -> float:
        """The guidance of the training forwards (policy, old copy, reference): the rollouts' (``forest.guidance``);
        a subclass that trains the conditional velocity of guided rollouts returns 1."""
        return forest.guidance

    def per_leaf(self, rows: torch.Tensor) -> torch.Tensor:
        """Mean over each leaf's D draws: [B·D] → [B]."""
        return rows.view(-1, self.draws).mean(dim=1)

    def kl_ref_rows(self, v: torch.Tensor, v_ref: torch.Tensor | None) -> torch.Tensor | None:
        return None if v_ref is None else row_mean((v - v_ref) ** 2)

    def total(self, own: torch.Tensor, rows: "Rows", batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss from the objective's own per-leaf term ``own`` [B]: ``reward_term``·own, plus
        ``kl_ref``·(per-leaf mean‖v_θ − v_ref‖²) and the teacher's anchor λ_k·w·(per-leaf mean‖v_θ − v_T‖²)
        (``rows``: the batch's :class:`Rows`); returns (mean over leaves, diagnostics ``kl_ref`` / ``anchor_error`` /
        ``anchor_weight`` λ_k)."""
        diag: dict[str, torch.Tensor] = {}
        per_leaf = self.reward_term * own
        kl = self.kl_ref_rows(rows.v, rows.v_ref)
        if kl is not None:
            per_leaf = per_leaf + self.kl_ref * self.per_leaf(kl)
            diag["kl_ref"] = kl.detach().mean()
        extra = batch.extra or {}
        weight = extra.get("anchor")
        if weight is not None and rows.v_teacher is not None:
            err = self.per_leaf(row_mean((rows.v - rows.v_teacher) ** 2))
            per_leaf = per_leaf + to_device(weight, err.device) * err
            diag["anchor_error"] = err.detach().mean()
        if extra.get("anchor_weight") is not None:
            diag["anchor_weight"] = torch.tensor(float(extra["anchor_weight"]))
        return per_leaf.mean(), diag


@dataclass
class Rows:
    """One micro-batch at its forward-process points, per row (leaf × draw, leaf-major) [R, ...]: the policy's
    velocity ``v`` (with grad), the old copy's ``v_old``, the reference's ``v_ref`` and the teacher's guided
    ``v_teacher`` (no grad; None where not computed), the target ``target`` = ε − x0 and the noise level ``t`` [R];
    and the leaves' advantages ``adv`` [B] (clipped to ±``adv_clip``)."""

    v: torch.Tensor
    v_old: torch.Tensor | None
    v_ref: torch.Tensor | None
    v_teacher: torch.Tensor | None
    target: torch.Tensor
    t: torch.Tensor
    adv: torch.Tensor


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over all non-batch elements: [R, ...] → [R]."""
    return x.mean(dim=tuple(range(1, x.ndim)))
