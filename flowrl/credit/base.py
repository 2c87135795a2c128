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
