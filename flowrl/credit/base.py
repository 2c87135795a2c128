"""What every credit rule shares: it reads a scored forest and writes advantages on its edges."""
from __future__ import annotations

from typing import Callable

import torch

from flowrl.rollout.forest import Forest

Gather = Callable[[torch.Tensor], torch.Tensor]


class CreditRule:
    """Forest → ``advantage`` [N] and ``weight`` [N] on its edges (weight 0 = the edge is not trained).

    A credit rule reads the forest only: ``reward`` on leaves and ``value`` on probed states (both
    combined over reward terms by the MultiReward), ``reward_components[name]`` per term, ``group``,
    the structure and the log-probs. Subclasses are dataclasses whose fields are the keys of the
    ``credit`` section (:mod:`flowrl.components`).
    """

    def assign(self, forest: Forest, gather: Gather | None = None) -> dict[str, float]:
        """Write ``forest.advantage`` and ``forest.weight``; return statistics for the metrics log.
        ``gather`` concatenates a tensor across processes (for batch-wide statistics)."""
        raise NotImplementedError


def write_edge_credit(forest: Forest, edges: torch.Tensor, advantage: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """Write ``advantage`` [E] and weight 1 on the ``edges`` [E] marked ``train`` [E] bool; every other node
    gets advantage 0 and weight 0. Edges the plan left at weight 0 (a tree's depth pruning) stay untrained.
    Returns which of ``edges`` were so pruned [E] bool."""
    incoming = forest.weight if forest.weight.numel() == forest.num_nodes else torch.ones(forest.num_nodes)
    pruned = incoming[edges] <= 0
    train = train & ~pruned
    forest.advantage = torch.zeros(forest.num_nodes)
    forest.weight = torch.zeros(forest.num_nodes)
    forest.advantage[edges] = torch.where(train, advantage, torch.zeros_like(advantage)).float()
    forest.weight[edges] = train.float()
    return pruned
