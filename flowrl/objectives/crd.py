"""Centered Reward Distillation (Zhu, Wang, Lathuilière & Kalogeiton 2026, arXiv 2603.14128), as its authors ship it in
Flow-Factory (``trainers/crd.py``): a forward-process objective beside DiffusionNFT that regresses the policy's
implicit reward against its old copy onto the centred rewards (docs/algorithms.md, "CRD")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from flowrl.core.choices import choice
from flowrl.objectives.base import Batch
from flowrl.objectives.dgpo import GroupedForward
from flowrl.objectives.forward import TIMESTEPS, ForwardProcessObjective, Rows, row_mean

LOSS_FORMS = ("mse", "bce")
KL_FLOOR = 1e-4  # the adaptive KL's weight for the group's worst sample (Flow-Factory's ``base_beta``)


@dataclass
class CRDLoss(GroupedForward):
    """CRD (arXiv 2603.14128; docs/algorithms.md, "CRD").

    Per row (leaf i at draw d, x_t = (1−t)·x0 + t·ε, y = ε − x0): the implicit reward
    r_i = −(e_θ,i/u_θ,i − e_old,i/u_old,i), e = mean‖v − y‖² of the policy (with gradient) and of the old copy, u =
    sg(max(mean|v − y|, 1e-5)) with ``adaptive_weight`` (their ``adaptive_logp``), else 1. The reward target
    a_i = ½ + clip(A_i, ±c)/(2c) ∈ [0, 1] (c = ``adv_clip``). Both are centred over the prompt group at the same draw:
    r̃_i = r_i − sg(mean_g r), ã_i = a_i − mean_g a (the paper's within-prompt centring, under which the unknown
    normaliser cancels; Flow-Factory centres over each gathered micro-batch, **ours** follows the paper). Loss per row:
    ``mse`` (β·r̃_i − ã_i)², or ``bce`` BCE(logit β·r̃_i, target σ(ã_i)); times c/β, averaged over draws and leaves.
    KL: the guided teacher's anchor (``loss.teacher``: their ``kl_cfg`` 4.5, ``kl_beta`` 0.1), with
    ``adaptive_kl`` per leaf λ_k·a_i + 1e-4·(1 − a_i) (their reward-adaptive KL). The old copy follows
    d_k = min(``old_decay_start`` + ``old_decay_rate``·max(0, k − ``old_decay_flat``), ``old_decay``) after optimizer
    step k: their "0-0.25-0.005-0.999" (they blend once per iteration; here after every optimizer step).
    Not here: their separate EMA sampling copy (rollouts use the policy: their schedule's first 75 steps) and the
    softmax / hard centring modes (``weight_temp`` ≥ 0; their default −1, uniform, is this one).
    """

    beta: float = 1.0  # β, the implicit reward's scale: the loss fits β·r̃ to the centred reward target ã (> 0;
    # published 1.0)
    loss_form: str = choice("mse", LOSS_FORMS)  # mse ((β·r̃ − ã)²) | bce (BCE of the logit β·r̃ against the target
    # σ(ã)); either times adv_clip/β
    adaptive_weight: bool = True  # divide each flow-matching error by sg(max(mean|v − y|, 1e-5)) in the implicit
    # reward (their adaptive_logp); false: the plain errors
    adaptive_kl: bool = True  # reward-adaptive KL: the teacher's anchor per leaf λ_k·a_i + 1e-4·(1 − a_i), the best
    # samples anchored at λ, the worst almost free (read with loss.teacher.anchor > 0 and weighting none)
    share_t: bool = True
    timesteps: str = choice("sampler", TIMESTEPS)
    draws: int = 20
    old_decay: float = 0.999  # the cap of the old copy's decay ramp d_k = min(old_decay_start + old_decay_rate·max(0,
    # k − old_decay_flat), old_decay) (their "0-0.25-0.005-0.999"), in [0, 1)
    old_decay_rate: float = 0.005  # the old copy's decay ramp per optimizer step (0 = the constant old_decay)
    old_decay_start: float = 0.25  # old_decay_rate > 0: the old copy's decay at the ramp's start, in [0, 1)

    statistic_reads_old: ClassVar[bool] = True
    progress_keys = {**ForwardProcessObjective.progress_keys, "r": (("implicit_reward",), ".3f")}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"loss.beta={self.beta} must be > 0 (CRD's implicit-reward scale; published 1.0)")
        if not 0.0 <= self.old_decay_start < 1.0:
            raise ValueError(
                f"loss.old_decay_start={self.old_decay_start} must be in [0, 1) (the old copy's decay at "
                "the first optimizer step)"
            )
        if self.adaptive_kl and self.teacher is not None and self.teacher.weighting != "none":
            raise ValueError(
                f"loss.teacher.weighting={self.teacher.weighting!r} with loss.adaptive_kl=true: CRD's "
                "adaptive KL is the anchor's per-leaf weight; set loss.teacher.weighting: none or "
                "loss.adaptive_kl: false"
            )

    def unread_fields(self) -> dict[str, str]:
        out = super().unread_fields()
        if self.old_decay_rate <= 0:
            out["old_decay_start"] = "loss.old_decay_rate=0 keeps the old copy's decay constant (loss.old_decay)"
        if self.teacher is None or self.teacher.anchor == 0:
            out["adaptive_kl"] = "no teacher anchor (loss.teacher.anchor) to weight"
        return out

    def decay(self, k: int) -> float:
        """d_k after optimizer step k (1-based): CRD's linear ramp from ``old_decay_start``, capped at ``old_decay``."""
        if self.old_decay_rate > 0:
            return min(self.old_decay_start + self.old_decay_rate * max(0, k - self.old_decay_flat), self.old_decay)
        return super().decay(k)

    def target(self, adv: torch.Tensor) -> torch.Tensor:
        """a [B] ∈ [0, 1] from advantages [B]: ½ + clip(A, ±c)/(2c)."""
        c = self.adv_clip
        return 0.5 + adv.clamp(-c, c) / (2.0 * c)

    def leaf_anchor(
        self, forest, leaves: torch.Tensor, anchor: torch.Tensor | None, strength: float | None
    ) -> torch.Tensor | None:
        """``adaptive_kl``: λ_k·a_i + 1e-4·(1 − a_i) per leaf [L]."""
        if anchor is None or not self.adaptive_kl:
            return anchor
        a = self.target(forest.advantage[leaves].float())
        return float(strength) * a + KL_FLOOR * (1.0 - a)

    def implicit_reward(self, rows: Rows) -> torch.Tensor:
        """r [R] (with gradient through v_θ)."""
        diff, diff_old = rows.v - rows.target, rows.v_old - rows.target
        err, err_old = row_mean(diff**2), row_mean(diff_old**2)
        if self.adaptive_weight:
            err = err / row_mean(diff.detach().abs()).clamp(min=1e-5)
            err_old = err_old / row_mean(diff_old.abs()).clamp(min=1e-5)
        return -(err - err_old)

    def row_statistic(self, rows: Rows) -> torch.Tensor:
        return self.implicit_reward(rows).detach()

    def centred_targets(self, forest, batch: Batch) -> torch.Tensor:
        """ã per row [R]: a_i minus the mean of a over the trained leaves of its group (all of them, in any batch)."""
        table, (a, b) = batch.extra["table"], batch.extra["span"]
        every = self.target(forest.advantage[table.leaves].float())
        out = torch.empty(b - a)
        for ga, gb in table.spans.values():
            lo, hi = max(a, ga), min(b, gb)
            if lo < hi:
                out[lo - a : hi - a] = every[lo:hi] - every[ga:gb].mean()
        return out.repeat_interleave(self.draws)

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.forward_rows(model, forest, batch, cond)
        r = self.implicit_reward(rows)  # [R]
        r_c = r - self.group_means(model, forest, batch, cond, r)
        a_c = self.centred_targets(forest, batch).to(r.device)
        if self.loss_form == "bce":
            per_row = F.binary_cross_entropy_with_logits(self.beta * r_c, torch.sigmoid(a_c), reduction="none")
        else:
            per_row = (self.beta * r_c - a_c) ** 2
        own = self.per_leaf(per_row) * (self.adv_clip / self.beta)
        loss, diag = self.total(own, rows, batch)
        with torch.no_grad():
            diag.update(
                {
                    "crd_loss": own.mean(),
                    "implicit_reward": r.mean(),
                    "implicit_reward_centred_abs": r_c.abs().mean(),
                    "fm_error": row_mean((rows.v - rows.target) ** 2).mean(),
                    "old_drift": row_mean((rows.v - rows.v_old) ** 2).mean(),
                }
            )
        return loss, diag
