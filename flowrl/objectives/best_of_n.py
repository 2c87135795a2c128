"""Best-of-N guided distillation (``loss.objective: raft``): the baseline a reward-driven objective is compared with.

Each iteration draws G samples per prompt (with ``rollout.teacher_share: G`` all of them from the guided
teacher, as Flow-GRPO's SFT baseline samples best-of-N from the guided model), keeps the ``top_k`` best of
every group by reward, and regresses the policy's velocity on them with plain flow matching: per row
‖v_θ(x_t, c) − (ε − x0)‖² at the forward-process points of :class:`~flowrl.objectives.forward.ForwardProcessObjective`
(RAFT, Dong et al. 2023; "reward-ranked fine-tuning"). With ``cfg: free`` the conditional velocity learns
the guided teacher's best samples. A ``loss.teacher.anchor`` > 0 adds the teacher's velocity pull as for NFT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.objectives.base import Batch
from flowrl.objectives.forward import ForwardProcessObjective, row_mean


@dataclass
class RAFTLoss(ForwardProcessObjective):
    """Flow matching on the ``top_k`` best leaves of every prompt group (``min_reward``: and only those whose
    reward reaches it). No old policy is read."""

    top_k: int = 2  # the highest-reward leaves of every prompt group trained by plain flow matching (≥ 1; ties: the
    # earlier node)
    min_reward: float = float("-inf")  # of those, only the leaves whose reward is at least this (-inf = no floor)

    uses_old: ClassVar[bool] = False
    has_reward_free_point: ClassVar[bool] = False  # no old copy: nothing to put at the weights measured

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k < 1:
            raise ValueError(f"loss.top_k={self.top_k} must be >= 1 (the best samples of each group trained)")

    def select_leaves(self, forest, leaves: torch.Tensor, padding: bool = False) -> torch.Tensor:
        """The ``top_k`` highest-reward leaves of each group among ``leaves`` [L] (ties: the earlier node)."""
        reward, group = forest.reward[leaves], forest.group[leaves]
        keep = torch.zeros(leaves.numel(), dtype=torch.bool)
        for g in torch.unique(group):
            mine = torch.nonzero(group == g).flatten()
            order = torch.argsort(-reward[mine], stable=True)[: self.top_k]
            keep[mine[order]] = True
        keep &= reward >= self.min_reward
        return leaves[keep]

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.forward_rows(model, forest, batch, cond, with_old=False)
        v, target = rows.v, rows.target
        loss, diag = self.total(self.per_leaf(row_mean((v - target) ** 2)), rows, batch)
        with torch.no_grad():
            diag.update(
                {
                    "raft_loss": loss.detach(),
                    "fm_error": row_mean((v - target) ** 2).mean(),
                    "raft_reward": forest.reward[batch.index].float().mean(),
                }
            )
        return loss, diag
