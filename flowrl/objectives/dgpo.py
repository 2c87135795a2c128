"""Direct Group Preference Optimization (Luo, Hu & Tang 2025, arXiv 2510.08425; ICLR 2026), and the group-aligned
forward process it shares with CRD (:mod:`flowrl.objectives.crd`): per-leaf terms that read a statistic of the leaf's
whole prompt group at the same (t, ε) draw (docs/algorithms.md, "Group objectives")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from flowrl.core.choices import choice
from flowrl.core.seeding import derive_seed, seeded_normal
from flowrl.models.base import CFG_GRADIENTS
from flowrl.objectives.base import Batch, ObjectiveFacts
from flowrl.objectives.copies import OldPolicy, Reference
from flowrl.objectives.forward import TIMESTEPS, ForwardProcessObjective, Rows, row_mean
from flowrl.objectives.teacher import Teacher

GROUP_CFG_MODES = ("free", "guided", "guided_rollouts")
REFERENCES = ("initial", "teacher", "old")


@dataclass
class GroupTable:
    """The iteration's trained leaves sorted by prompt group, with their draws, shared by its micro-batches:
    ``leaves`` [L], ``t`` [L·D] and ``noise`` [L·D, C, H, W] (leaf-major), the anchor's per-leaf weights ``anchor``
    [L] (None without one), ``spans`` (group → its positions [first, end) in ``leaves``), ``extra`` (the teacher's
    conditioning and λ_k, as :meth:`ForwardProcessObjective.batches` hands them) and ``cache`` ((optimizer step,
    group) → per-draw means [D] of a statistic, for a group cut over several micro-batches)."""

    leaves: torch.Tensor
    t: torch.Tensor
    noise: torch.Tensor
    anchor: torch.Tensor | None
    spans: dict[int, tuple[int, int]]
    extra: dict[str, Any]
    cache: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def batch(self, a: int, b: int, draws: int) -> Batch:
        """The micro-batch of positions [a, b) (its ``extra`` names the table and its ``span``)."""
        extra = {
            **self.extra,
            "t": self.t[a * draws : b * draws],
            "noise": self.noise[a * draws : b * draws],
            "anchor": None if self.anchor is None else self.anchor[a:b],
            "table": self,
            "span": (a, b),
        }
        return Batch(self.leaves[a:b], b - a, extra)


@dataclass
class GroupedForward(ForwardProcessObjective):
    """A forward-process objective whose per-leaf term reads a statistic of the leaf's prompt group at the same
    draw (DGPO's group preference weight, CRD's centring).

    Micro-batches hold whole groups (as many as fit in ``micro_batch`` rows = ``rollout.max_batch``); a group with
    more rows is cut into chunks of leaves, and its statistic then comes from one forward without gradient over the
    whole group at the current weights (once per optimizer step), so the loss equals one forward over the group.
    ``timesteps: sampler`` trains at the highest ``level_fraction`` of the sampler's noise levels; more draws than
    levels cycle through them (each level ⌊D/L⌋ or ⌈D/L⌉ times, as a stratified draw). ``cfg: guided_rollouts``:
    rollouts at the model's guidance (CFG), the conditional velocity trained, the old copy and the reference read at
    guidance 1 (DGPO's default mode; ``free`` and ``guided`` as for NFT). ``cfg_gradient`` (read with ``cfg: guided``,
    whose policy is the guided velocity v_u + g·(v_c − v_u)): the gradient through the conditional branch only
    (``cond``: g·∇v_c) or through both (``both``: plus (1 − g)·∇v_u); docs/algorithms.md, "Training through CFG".
    """

    cfg: str = choice("free", GROUP_CFG_MODES)  # free (rollouts at guidance 1, the conditional velocity is the policy,
    # trained alone) | guided (rollouts at model.guidance, the guided velocity v_u + g·(v_c − v_u) is the policy) |
    # guided_rollouts (rollouts at model.guidance with CFG, the conditional velocity trained, the old copy and the
    # reference read at guidance 1; DGPO's default mode; evals at the rollout guidance)
    level_fraction: float = 1.0  # timesteps sampler: the share of the sampler's noise levels trained, highest first,
    # in (0, 1] (0.5 = the first half of the schedule); more draws than levels cycle through them
    cfg_gradient: str = choice("cond", CFG_GRADIENTS)  # cfg guided: the gradient through the conditional branch only
    # (cond: g·∇v_c) or through both (both: plus (1 − g)·∇v_u); docs/algorithms.md, "Training through CFG"

    group_use: ClassVar[str | None] = "compares the samples of each prompt group"
    statistic_reads_old: ClassVar[bool] = True  # the no-grad statistic pass runs the old copy
    statistic_reads_teacher: ClassVar[bool] = False  # ... and the teacher

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.level_fraction <= 1.0:
            raise ValueError(
                f"loss.level_fraction={self.level_fraction} must be in (0, 1] (the share of the sampler's "
                "noise levels trained, highest first)"
            )

    def unread_fields(self) -> dict[str, str]:
        out = super().unread_fields()
        if self.timesteps != "sampler":
            out["level_fraction"] = f"loss.timesteps={self.timesteps!r} does not train at the sampler's levels"
        if self.cfg != "guided":
            out["cfg_gradient"] = (
                f"loss.cfg={self.cfg!r} trains the conditional velocity alone (no unconditional branch); "
                "loss.cfg='guided' trains through CFG"
            )
        return out

    def forward_rows(self, model, forest, batch: Batch, cond, with_old: bool = True) -> Rows:
        """:meth:`ForwardProcessObjective.forward_rows` with the guided policy's gradient routed by
        ``cfg_gradient`` (values unchanged; the no-grad forwards of the copies and the teacher are unaffected)."""
        with model.cfg_gradient(self.cfg_gradient):
            return super().forward_rows(model, forest, batch, cond, with_old)

    def describe(self) -> ObjectiveFacts:
        """The forward process's facts; ``cfg: guided_rollouts`` rollouts must run CFG (guidance not 1)."""
        facts = super().describe()
        return replace(facts, rollout_cfg="on") if self.cfg == "guided_rollouts" else facts

    def training_guidance(self, forest) -> float:
        return 1.0 if self.cfg == "guided_rollouts" else forest.guidance

    def encode(self, model, forest):
        """The conditioning at the training guidance (no unconditional rows for ``guided_rollouts``)."""
        return model.encode(forest.prompts, self.training_guidance(forest))

    # ---- batches ----------------------------------------------------------------------------
    def batches(self, forest, iteration: int = 0, seed: int = 0, units: torch.Tensor | None = None) -> list[Batch]:
        """The forward process's draws (:meth:`ForwardProcessObjective.batches`), re-cut into group-aligned
        micro-batches over one :class:`GroupTable`."""
        parts = super().batches(forest, iteration, seed, units)
        if not parts:
            return parts
        D = self.draws
        leaves = torch.cat([b.index for b in parts])
        order = torch.argsort(forest.group[leaves], stable=True)
        rows = (order[:, None] * D + torch.arange(D)).flatten()
        leaves = leaves[order]
        anchor = None if parts[0].extra["anchor"] is None else torch.cat([b.extra["anchor"] for b in parts])[order]
        extra = {k: parts[0].extra[k] for k in ("teacher_cond", "anchor_weight")}
        noise = self.shared_noise(forest, leaves, torch.cat([b.extra["noise"] for b in parts])[rows], iteration, seed)
        anchor = self.leaf_anchor(forest, leaves, anchor, extra["anchor_weight"])
        group = forest.group[leaves].tolist()
        spans: dict[int, tuple[int, int]] = {}
        for p, g in enumerate(group):
            spans[g] = (spans[g][0] if g in spans else p, p + 1)
        table = GroupTable(leaves, torch.cat([b.extra["t"] for b in parts])[rows], noise, anchor, spans, extra)
        return [table.batch(a, b, D) for a, b in self.cuts(spans)]

    def cuts(self, spans: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
        """Micro-batches [a, b) of positions: whole groups while they fit in ``micro_batch`` rows, a bigger group in
        chunks of ``micro_batch // draws`` leaves."""
        per = max(1, self.micro_batch // self.draws)
        out: list[tuple[int, int]] = []
        for a, b in sorted(spans.values()):
            if out and out[-1][1] == a and b - out[-1][0] <= per:  # the next whole group fits beside the last
                out[-1] = (out[-1][0], b)
            else:
                out += [(c, min(c + per, b)) for c in range(a, b, per)]
        return out

    def shared_noise(
        self, forest, leaves: torch.Tensor, noise: torch.Tensor, iteration: int, seed: int
    ) -> torch.Tensor:
        """The draws' ε [L·D, C, H, W] of ``leaves`` [L] (default: the forward process's, one per leaf and draw)."""
        return noise

    def leaf_anchor(
        self, forest, leaves: torch.Tensor, anchor: torch.Tensor | None, strength: float | None
    ) -> torch.Tensor | None:
        """The anchor's per-leaf weights [L] (default: the forward process's, λ_k·w_i)."""
        return anchor

    def sampler_t(self, forest, seeds: list[int]) -> torch.Tensor:
        """``timesteps: sampler``: per leaf (``draws`` consecutive seeds) ``draws`` noise levels of the highest
        ``level_fraction`` of the sampler's (σ > 0 of the forest's nodes), from the leaf's first seed [len(seeds)]."""
        levels = torch.unique(forest.sigma[forest.sigma > 0]).float()  # ascending
        levels = levels[-max(1, math.ceil(self.level_fraction * levels.numel() - 1e-9)) :]
        D, L = self.draws, levels.numel()
        picks = []
        for i in range(0, len(seeds), D):
            gen = torch.Generator().manual_seed(seeds[i])
            picks.append(levels[torch.cat([torch.randperm(L, generator=gen) for _ in range(-(-D // L))])[:D]])
        return torch.cat(picks).clamp(1e-4, 1.0 - 1e-4)

    # ---- group statistics ----------------------------------------------------------------------
    def row_statistic(self, rows: Rows) -> torch.Tensor:
        """The per-row quantity [R] whose group mean the loss reads (detached)."""
        raise NotImplementedError

    def group_means(self, model, forest, batch: Batch, cond, stat: torch.Tensor) -> torch.Tensor:
        """Per row of ``batch`` [R], the mean of :meth:`row_statistic` over its prompt group's leaves at its draw
        (``stat`` [R]: this batch's rows; a group cut over several micro-batches is completed by :meth:`split_mean`)."""
        table, (a, b) = batch.extra["table"], batch.extra["span"]
        mine = stat.detach().view(-1, self.draws)  # [B, D]
        out = torch.empty_like(mine)
        for g, (ga, gb) in table.spans.items():
            lo, hi = max(a, ga), min(b, gb)
            if lo < hi:
                whole = a <= ga and gb <= b
                out[lo - a : hi - a] = (
                    mine[lo - a : hi - a].mean(0) if whole else self.split_mean(model, forest, cond, table, g)
                )
        return out.flatten()

    def split_mean(self, model, forest, cond, table: GroupTable, g: int) -> torch.Tensor:
        """Per-draw means [D] of :meth:`row_statistic` over group ``g``'s rows, from forwards without gradient in
        chunks of ``micro_batch`` rows at the current weights; cached per optimizer step."""
        key = (self._updates, g)
        if key not in table.cache:
            ga, gb = table.spans[g]
            per, stats = max(1, self.micro_batch // self.draws), []
            with torch.no_grad():
                for c in range(ga, gb, per):
                    chunk = table.batch(c, min(c + per, gb), self.draws)
                    if not self.statistic_reads_teacher:
                        chunk.extra["teacher_cond"] = None
                    rows = self.forward_rows(model, forest, chunk, cond, with_old=self.statistic_reads_old)
                    stats.append(self.row_statistic(rows).view(-1, self.draws))
            table.cache[key] = torch.cat(stats).mean(0)
        return table.cache[key]


@dataclass
class DGPOLoss(GroupedForward):
    """DGPO (Luo et al. 2025, arXiv 2510.08425; docs/algorithms.md, "DGPO"): maximum likelihood of group-level
    preferences, log σ(R_θ(G⁺) − R_θ(G⁻)), as its public code trains it (a gradient-equivalent surrogate).

    Per row (leaf i of group g at draw d; x_t, t and — ``share_noise`` — ε shared by the group at that draw):
    e_i = mean‖v_θ − y‖², e_ref,i the same under the ``reference`` (``initial``: the frozen initial weights at
    guidance 1; ``teacher``: the guided teacher, CFG-free mode (a); ``old``: the EMA old copy, TDM-R1's dynamic
    reference), δ_i = sg(e_i − e_ref,i), S_g = ``beta``·mean_{i∈g} A_i·δ_i over the group's trained leaves (their
    code: β·Σ/G), w_g = sg(σ(S_g)), and the row's term w_g·A_i·ẽ_i. Its gradient is that of softplus(S_g) =
    −log σ(−S_g), the group's preference NLL, times n_g/β (then averaged over rows). ẽ_i = e_i, detached where
    PPO's clip on ρ_i = exp(e_old,i − e_i) binds (A_i > 0 and ρ_i > 1 + ``clip``, or A_i ≤ 0 and ρ_i < 1 − ``clip``;
    ``clip`` 0: off). The old copy follows d_k = min(``old_decay_rate``·(k − ``old_decay_flat``), ``old_decay``) =
    min(0.001·(k − 1), 0.3) after step k, their ``ema_ref``. KL: ``kl_ref``·mean‖v_θ − v_ref‖² (their ``beta`` with
    ``kl_cfg`` 1) or the teacher's anchor (``kl_cfg`` > 1). Defaults: their GenEval recipe (``config/dgpo.py``
    ``geneval_sd3_4gpu``); diagnostics ``group_weight`` (mean w), ``dgpo_nll`` (mean softplus(S)), ``ref_error``.
    """

    cfg: str = choice("guided_rollouts", GROUP_CFG_MODES)
    beta: float = 100.0  # β, the group preference's scale: S_g = β·mean_{i∈g} A_i·δ_i, weight w_g = sg(σ(S_g)) (> 0;
    # published 10–100, 2000–5000 with reference old)
    reference: str = choice("initial", REFERENCES)  # what δ_i = sg(e_i − e_ref,i) measures the policy's errors
    # against: initial (the frozen initial weights at guidance 1: their kl_cfg 1) | teacher (the guided teacher,
    # loss.teacher: their CFG-free mode (a)) | old (the EMA old copy: TDM-R1's dynamic reference)
    clip: float = 1e-2  # PPO's clip on ρ_i = exp(e_old,i − e_i): a leaf's error is detached where A_i > 0 and ρ_i >
    # 1 + clip, or A_i ≤ 0 and ρ_i < 1 − clip (≥ 0; 0 = off: no old copy unless it is the reference)
    share_noise: bool = True  # one ε per prompt group and draw (the group's rows at the same noise) instead of one
    # per leaf
    share_t: bool = True  # one t per prompt group and draw (with share_noise: the group's rows at the same x_t
    # noise and level) instead of one per leaf
    timesteps: str = choice("sampler", TIMESTEPS)
    draws: int = 4
    level_fraction: float = 0.5
    kl_ref: float = 0.02  # weight of kl_ref·mean‖v_θ − v_ref‖² towards the unguided initial weights (their
    # train.beta with kl_cfg 1); 0 = no reference forward unless reference initial
    old_decay: float = 0.3  # the cap of the old copy's decay ramp d_k = min(old_decay_rate·(k − old_decay_flat),
    # old_decay) (their ema_ref: min(0.001·(k − 1), 0.3)), in [0, 1)
    old_decay_rate: float = 0.001  # the old copy's decay ramp per optimizer step (0 = a constant old_decay)
    old_decay_flat: int = 1  # optimizer steps before the old copy's decay ramp starts

    has_reward_free_point: ClassVar[bool] = True  # the preference term is all reward: the KL terms off leave it alone
    progress_keys = {**ForwardProcessObjective.progress_keys, "w": (("group_weight",), ".2f")}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(
                f"loss.beta={self.beta} must be > 0 (DGPO's preference scale; published 10–100, "
                "2000–5000 with reference: old)"
            )
        if not self.clip >= 0:
            raise ValueError(f"loss.clip={self.clip} must be >= 0 (PPO's clip of exp(e_old − e); 0 = off)")
        if self.reference == "teacher" and self.teacher is None:
            raise ValueError(
                "loss.reference='teacher' compares the policy's errors with the guided teacher's, but "
                "loss.teacher is not set; add loss.teacher: {guidance: 4.5, anchor: 0.02}"
            )

    @property
    def uses_old(self) -> bool:  # type: ignore[override]
        """An old copy for the clip or as the reference."""
        return self.clip > 0 or self.reference == "old"

    @property
    def statistic_reads_old(self) -> bool:  # type: ignore[override]
        return self.reference == "old"

    @property
    def statistic_reads_teacher(self) -> bool:  # type: ignore[override]
        return self.reference == "teacher"

    def setup(self, model, teacher_weights=None) -> None:
        """The old copy (clip or reference), the frozen initial weights (reference or KL), the teacher."""
        self._old = OldPolicy(model) if self.uses_old else None
        self._reference = Reference(model) if self.reads_reference else None
        self.teacher_model = (
            None if self.teacher is None else Teacher(model, self.teacher, self._reference, teacher_weights)
        )
        self._updates = 0

    @property
    def reads_reference(self) -> bool:
        return self.reference == "initial" or self.kl_ref > 0

    def frozen_copies(self) -> tuple[str, ...]:
        return (("old",) if self.uses_old else ()) + (("reference",) if self.reads_reference else ())

    def reward_free_overrides(self) -> dict[str, Any]:
        """No KL terms (the teacher stays, without its anchor, when it is the reference)."""
        if self.reference == "teacher":
            return {"kl_ref": 0.0, "teacher": replace(self.teacher, anchor=0.0)}
        return super().reward_free_overrides()

    def move_to_reward_free_point(self) -> None:
        if self._old is not None:
            self._old.copy_from_policy()

    def shared_noise(
        self, forest, leaves: torch.Tensor, noise: torch.Tensor, iteration: int, seed: int
    ) -> torch.Tensor:
        """``share_noise``: one ε per prompt group and draw, addressed by (run seed, iteration, prompt, draw)."""
        if not self.share_noise:
            return noise
        D, shape = self.draws, tuple(noise.shape[1:])
        drawn: dict[tuple[str, int], torch.Tensor] = {}
        out = []
        for n in leaves.tolist():
            prompt = forest.prompts[int(forest.group[n])]
            for d in range(D):
                if (prompt, d) not in drawn:
                    drawn[(prompt, d)] = seeded_normal(derive_seed(seed, iteration, "dgpo_eps", prompt, d), shape)
                out.append(drawn[(prompt, d)])
        return torch.stack(out)

    def reference_velocity(self, rows: Rows) -> torch.Tensor:
        return {"initial": rows.v_ref, "teacher": rows.v_teacher, "old": rows.v_old}[self.reference]

    def row_statistic(self, rows: Rows) -> torch.Tensor:
        """A_i·δ_i per row [R]."""
        err = row_mean((rows.v.detach() - rows.target) ** 2)
        err_ref = row_mean((self.reference_velocity(rows) - rows.target) ** 2)
        return rows.adv.repeat_interleave(self.draws) * (err - err_ref)

    def needs_teacher_velocity(self, anchored: bool) -> bool:
        return self.reference == "teacher" or super().needs_teacher_velocity(anchored)

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.forward_rows(model, forest, batch, cond, with_old=self.uses_old)
        adv = rows.adv.repeat_interleave(self.draws)  # [R]
        err = row_mean((rows.v - rows.target) ** 2)  # [R], with grad
        s = self.beta * self.group_means(model, forest, batch, cond, self.row_statistic(rows))
        w = torch.sigmoid(s)
        used, clipped = err, torch.zeros_like(err, dtype=torch.bool)
        if self.clip > 0:
            ratio = torch.exp(row_mean((rows.v_old - rows.target) ** 2) - err.detach())
            clipped = torch.where(adv > 0, ratio > 1.0 + self.clip, ratio < 1.0 - self.clip)
            used = torch.where(clipped, err.detach(), err)
        own = self.per_leaf(w * adv * used)
        loss, diag = self.total(own, rows, batch)
        with torch.no_grad():
            diag.update(
                {
                    "dgpo_loss": own.mean(),
                    "group_weight": w.mean(),
                    "dgpo_nll": F.softplus(s).mean(),
                    "fm_error": err.mean(),
                    "ref_error": row_mean((self.reference_velocity(rows) - rows.target) ** 2).mean(),
                    "clipfrac": clipped.float().mean(),
                }
            )
            if rows.v_old is not None:
                diag["old_drift"] = row_mean((rows.v - rows.v_old) ** 2).mean()
        return loss, diag
