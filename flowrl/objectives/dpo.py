"""Online Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908) in its flow-matching form, as Flow-GRPO's
``train_sd3_dpo.py`` and Flow-Factory's ``dpo`` trainer run it online: a forward-process objective
(:mod:`flowrl.objectives.forward`) on chosen/rejected pairs formed inside each prompt group (docs/algorithms.md,
"Online Diffusion-DPO")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from flowrl.objectives.base import Batch, ObjectiveFacts
from flowrl.objectives.copies import Reference
from flowrl.objectives.forward import ForwardProcessObjective, row_mean
from flowrl.objectives.teacher import Teacher


@dataclass
class DPOLoss(ForwardProcessObjective):
    """Online Diffusion-DPO (arXiv 2311.12908; docs/algorithms.md, "Online Diffusion-DPO").

    Pairs: in every prompt group, the leaf with the highest advantage is chosen (w) and the one with the lowest is
    rejected (l) — Flow-GRPO's and Flow-Factory's rule (best vs worst, one pair per group); ties go to the earlier node;
    a group without spread (``flat``), or with fewer than two trainable leaves, gives no pair. Pairs never cross groups.
    Each pair shares its ``draws`` (t, ε) points (Diffusion-DPO's shared noise and timestep): the chosen leaf's, drawn
    as
    :mod:`~flowrl.objectives.forward` draws them (the ``share_t`` key is not read). Per draw, with errors
    e = mean‖v(x_t) − (ε − x0)‖² of the policy (θ) and of the frozen reference (the initial weights):

        z = −(β/2)·[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))],   ℓ = −log σ(z),

    averaged over the pair's draws, then over pairs (each pair's ℓ is counted on both of its leaves, the units the loop
    averages over). β [100: Flow-GRPO ``config/dpo.py``, Flow-Factory's SD3.5 DPO example] absorbs Diffusion-DPO's
    T·ω(λ_t); both public codes use −β/2 on element-mean errors, as here. No old copy (Flow-GRPO's reference is never
    refreshed by default); ``kl_ref`` > 0 adds the shared velocity pull to the same reference, and a ``teacher`` its
    anchor, as for NFT. Diagnostics: ``dpo_loss``, ``implicit_acc`` (share of draws with z > 0), ``dpo_margin`` (mean
    z),
    ``err_chosen``/``err_rejected`` and their reference errors (pairs: ``trained_leaves``/2).
    """

    beta: float = 100.0  # β in z = −(β/2)·[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))], ℓ = −log σ(z) (> 0; absorbs
    # Diffusion-DPO's T·ω(λ_t)) [100: Flow-GRPO and Flow-Factory; Diffusion-DPO used 5000 for SD1.5]

    uses_old: ClassVar[bool] = False
    group_use: ClassVar[str | None] = "pairs the best and worst leaf of each prompt group"
    trains_flat = False  # a group without spread has no preferred sample
    # the preference term is all reward: without kl_ref and the teacher (reward_free_overrides) nothing else is left
    has_reward_free_point: ClassVar[bool] = True
    progress_keys = {**ForwardProcessObjective.progress_keys, "acc": (("implicit_acc",), ".2f")}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(
                f"loss.beta={self.beta} must be > 0 (Diffusion-DPO's KL strength; published 100 for flow matching)"
            )

    # ---- configuration and lifecycle ---------------------------------------------------------
    def unread_fields(self) -> dict[str, str]:
        """The shared ones (no old copy), ``share_t`` (a pair always shares its points) and ``adv_clip`` without a
        teacher (only the ranking of advantages is read)."""
        out = super().unread_fields()
        out["share_t"] = "DPOLoss always trains a pair at the same (t, ε) points"
        if self.teacher is None:
            out["adv_clip"] = (
                "DPOLoss reads only the order of the advantages (a teacher's anchor weighting reads the clip)"
            )
        return out

    def describe(self) -> ObjectiveFacts:
        """The forward-process facts, training a chosen and a rejected leaf per prompt group."""
        return replace(super().describe(), leaves_per_group=2)

    def setup(self, model, teacher_weights=None) -> None:
        """The frozen reference (always: the preference is measured against it); no old copy."""
        self._old = None
        self._reference = Reference(model)
        self.teacher_model = (
            None if self.teacher is None else Teacher(model, self.teacher, self._reference, teacher_weights)
        )
        self._updates = 0

    def frozen_copies(self) -> tuple[str, ...]:
        return ("reference",)

    def reward_free_overrides(self) -> dict[str, Any]:
        return {"teacher": None, "kl_ref": 0.0}

    def move_to_reward_free_point(self) -> None:
        """Nothing to move: with the reward-free terms off (:meth:`reward_free_overrides`) the whole gradient is the
        preference's, which exists only through the reward's ranking."""

    def kl_ref_rows(self, v: torch.Tensor, v_ref: torch.Tensor | None) -> torch.Tensor | None:
        """The reference runs for the preference anyway; its velocity pull only with ``kl_ref`` > 0."""
        return super().kl_ref_rows(v, v_ref) if self.kl_ref > 0 else None

    # ---- pairs and batches ---------------------------------------------------------------------
    def select_leaves(self, forest, leaves: torch.Tensor, padding: bool = False) -> torch.Tensor:
        """The pairs among ``leaves`` [L], interleaved [w_0, l_0, w_1, l_1, ...] [2P], groups in increasing order;
        with ``padding`` (explicit units asked, :meth:`batches`) and no pair, the first leaf paired with itself."""
        adv, group = forest.advantage[leaves].double(), forest.group[leaves]
        out: list[int] = []
        for g in torch.unique(group).tolist():
            mine = torch.nonzero(group == g).flatten()
            a = adv[mine]
            best, worst = int(torch.argmax(a)), int(torch.argmin(a))  # the first of equals
            if mine.numel() >= 2 and bool(a[best] > a[worst]):
                out += [int(leaves[mine[best]]), int(leaves[mine[worst]])]
        if not out and padding and leaves.numel():
            out = [int(leaves[0])] * 2
        return torch.tensor(out, dtype=torch.long)

    def batches(self, forest, iteration: int = 0, seed: int = 0, units: torch.Tensor | None = None) -> list[Batch]:
        """The forward-process micro-batches over the pairs (:meth:`select_leaves`), regrouped so that no pair is split
        (``micro_batch`` // (2·``draws``) pairs each, at least one), the rejected leaf's ``t`` and ``noise`` replaced by
        the chosen one's: a pair is compared at the same points. Asked for ``units`` explicitly (the sharded loop's
        weight-0 padding asks for a micro-batch over every unit) where no pair forms, the first unit paired with itself:
        a micro-batch whose loss is log 2 with no gradient (z ≡ 0)."""
        parts = super().batches(forest, iteration, seed, units)
        if not parts:
            return []
        D = self.draws
        index = torch.cat([b.index for b in parts])
        t = torch.cat([b.extra["t"] for b in parts]).view(-1, 2, D)
        noise = torch.cat([b.extra["noise"] for b in parts])
        noise = noise.view(-1, 2, D, *noise.shape[1:])
        t = t[:, :1].expand_as(t).reshape(-1)
        noise = noise[:, :1].expand_as(noise).reshape(-1, *noise.shape[3:])
        anchors = [b.extra["anchor"] for b in parts]
        anchor = None if anchors[0] is None else torch.cat(anchors)
        shared = {k: parts[0].extra[k] for k in ("teacher_cond", "anchor_weight")}
        per = 2 * max(1, self.micro_batch // (2 * D))  # leaves per micro-batch: whole pairs
        out = []
        for a in range(0, index.numel(), per):
            rows = slice(a * D, min(a + per, index.numel()) * D)
            extra = {
                "t": t[rows],
                "noise": noise[rows],
                "anchor": None if anchor is None else anchor[a : a + per],
                **shared,
            }
            out.append(Batch(index[a : a + per], int(index[a : a + per].numel()), extra))
        return out

    # ---- the loss -----------------------------------------------------------------------------
    def pair_loss(self, err: torch.Tensor, err_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ℓ per leaf [2P], z [P, D]) from the policy's and the reference's errors [2P·D], rows leaf-major and pairs
        interleaved (chosen, rejected)."""
        d = (err - err_ref).view(-1, 2, self.draws)
        z = -0.5 * self.beta * (d[:, 0] - d[:, 1])
        per_pair = F.softplus(-z).mean(dim=1)  # −log σ(z), stably
        return per_pair.repeat_interleave(2), z

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.forward_rows(model, forest, batch, cond, with_old=False)
        err = row_mean((rows.v - rows.target) ** 2)
        err_ref = row_mean((rows.v_ref - rows.target) ** 2)
        own, z = self.pair_loss(err, err_ref)
        loss, diag = self.total(own, rows, batch)
        with torch.no_grad():
            e, r = err.detach().view(-1, 2, self.draws), err_ref.view(-1, 2, self.draws)
            diag.update(
                {
                    "dpo_loss": own.detach().mean(),
                    "implicit_acc": (z > 0).float().mean(),
                    "dpo_margin": z.detach().mean(),
                    "err_chosen": e[:, 0].mean(),
                    "err_rejected": e[:, 1].mean(),
                    "ref_err_chosen": r[:, 0].mean(),
                    "ref_err_rejected": r[:, 1].mean(),
                    "fm_error": err.detach().mean(),
                }
            )
        return loss, diag
