"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): implicit positive and negative policies around a lagging old
copy, trained on the forward-process points of :mod:`flowrl.objectives.forward` (docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flowrl.core.choices import choice
from flowrl.objectives.base import Batch, ObjectiveFacts
from flowrl.objectives.forward import ForwardProcessObjective, row_mean

OPTIMALITY_FORMS = ("clip", "linear")  # NFT's optimality probability
CENTERS = ("old", "teacher")  # NFT's implicit policies' centre


@dataclass
class NFTLoss(ForwardProcessObjective):
    """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; docs/algorithms.md, "Forward-process objectives").

    Optimality probability per leaf r ∈ [0, 1] (``optimality``): ``clip`` r = ½ + ½·clip(A/``adv_scale``, −1, 1)
    **(ours)**; ``linear`` r = ½ + A/(2·``adv_clip``) (the public code's r = 0.5 + A/10 with A clipped to ±5).
    Implicit policies around a centre c and ``beta`` β: v⁺ = (1−β)·c + β·v_θ, v⁻ = (1+β)·c − β·v_θ; c is the
    old copy's velocity (``center: old``, the paper) or the guided teacher's (``center: teacher``: the policy
    is the teacher plus what the reward teaches, **ours**). Per row:
    L = r·‖v⁺ − y‖² + (1−r)·‖v⁻ − y‖² (means over latent elements), averaged over a leaf's draws, then
    over leaves. The per-row optimum is v_θ* = c + (2r − 1)/β·(y − c): towards the sample when
    r > ½, away when r < ½, the centre at r = ½ (flat groups pull the policy towards it).
    ``adaptive_weight``: the errors in x0 space (x̂0 = x_t − t·v, so ‖x̂0 − x0‖² = t²·‖v − y‖²), each row
    divided by sg(mean|x̂0_θ − x0|) and multiplied by ``adaptive_scale`` **(ours where the paper is terse)**.
    """

    beta: float = 1.0  # β, the implicit policies' step: v⁺ = (1−β)·c + β·v_θ, v⁻ = (1+β)·c − β·v_θ around the centre
    # c (> 0); the per-row optimum is c + (2r − 1)/β·(y − c)
    adv_scale: float = 2.0  # optimality_form clip: r = ½ + ½·clip(A/adv_scale, −1, 1), the |A| at which r saturates
    # (> 0)
    optimality_form: str = choice("clip", OPTIMALITY_FORMS)  # the optimality probability r ∈ [0, 1] of a leaf: clip
    # (r = ½ + ½·clip(A/adv_scale, −1, 1); ours) | linear (the public code's r = ½ + clip(A, ±adv_clip)/(2·adv_clip))
    adaptive_weight: bool = False
    adaptive_scale: float = 1.0  # adaptive_weight: the factor the normalised x0-space errors are multiplied by (> 0)
    center: str = choice("old", CENTERS)  # the implicit policies' centre c: old (the lagging old copy's velocity,
    # the paper) | teacher (the guided teacher's velocity: the policy is the teacher plus what the reward teaches;
    # ours; needs loss.teacher)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"loss.beta={self.beta} must be > 0 (DiffusionNFT's implicit-policy step)")
        if self.adv_scale <= 0:
            raise ValueError(f"loss.adv_scale={self.adv_scale} must be > 0")
        if self.adaptive_scale <= 0:
            raise ValueError(f"loss.adaptive_scale={self.adaptive_scale} must be > 0")
        if self.center == "teacher" and self.teacher is None:
            raise ValueError("loss.center='teacher' centres NFT on the teacher's velocity, but loss.teacher is not set")

    def needs_teacher_velocity(self, anchored: bool) -> bool:
        return self.center == "teacher" or super().needs_teacher_velocity(anchored)

    def unread_fields(self) -> dict[str, str]:
        """The shared ones, ``adv_scale`` under the linear optimality and ``adaptive_scale`` without the adaptive
        weight."""
        out = super().unread_fields()
        if self.optimality_form == "linear":
            out["adv_scale"] = "loss.optimality_form='linear' scales advantages by loss.adv_clip"
        if not self.adaptive_weight:
            out["adaptive_scale"] = "loss.adaptive_weight is false"
        return out

    def describe(self) -> ObjectiveFacts:
        """Centred on the teacher (``center: teacher``) the objective has no reward-free point to measure from."""
        facts = super().describe()
        if self.center != "old":
            return replace(
                facts,
                reward_free_overrides=None,
                no_reward_free_point=(
                    f"loss.center={self.center!r}: centred on the teacher, the objective has no reward-free point "
                    "(use loss.center='old')"
                ),
            )
        return facts

    def optimality(self, adv: torch.Tensor) -> torch.Tensor:
        """r [B] from advantages [B] (see the class docstring)."""
        if self.optimality_form == "linear":
            return 0.5 + 0.5 * adv.clamp(-self.adv_clip, self.adv_clip) / self.adv_clip
        return 0.5 + 0.5 * (adv / self.adv_scale).clamp(-1.0, 1.0)

    def row_loss(
        self, v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, t: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss [R], positive error [R], negative error [R]) for rows of v, centre ``v_old``, target [R, ...],
        t [R], r [R]."""
        b = self.beta
        v_pos = (1.0 - b) * v_old + b * v
        v_neg = (1.0 + b) * v_old - b * v
        err_pos, err_neg = row_mean((v_pos - target) ** 2), row_mean((v_neg - target) ** 2)
        if self.adaptive_weight:
            scale = (t * row_mean((v - target).abs())).detach().clamp(min=1e-5) / self.adaptive_scale
            err_pos, err_neg = err_pos * t * t / scale, err_neg * t * t / scale
        return r * err_pos + (1.0 - r) * err_neg, err_pos, err_neg

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.forward_rows(model, forest, batch, cond)
        v, v_old, target = rows.v, rows.v_old, rows.target
        r = self.optimality(rows.adv).repeat_interleave(self.draws)
        centre = rows.v_teacher if self.center == "teacher" else v_old
        own, err_pos, err_neg = self.row_loss(v, centre, target, rows.t, r)
        loss, diag = self.total(self.per_leaf(own), rows, batch)
        with torch.no_grad():
            diag.update(
                {
                    "nft_loss": loss.detach(),
                    "optimality_mean": r.mean(),
                    "nft_err_pos": err_pos.mean(),
                    "nft_err_neg": err_neg.mean(),
                    "fm_error": row_mean((v - target) ** 2).mean(),
                    "old_drift": row_mean((v - v_old) ** 2).mean(),
                }
            )
        return loss, diag
