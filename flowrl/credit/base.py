"""What every credit rule shares: it reads a scored forest and writes advantages on its edges."""

from __future__ import annotations

import math
from typing import Callable, ClassVar

import torch

from flowrl.core.choices import Checked
from flowrl.rollout.forest import Forest, no_spread

Gather = Callable[[torch.Tensor], torch.Tensor]


class CreditRule(Checked):
    """Forest → ``advantage`` [N], ``weight`` [N] and ``flat`` [N] on the units it credits (weight 0 = not
    trained; flat 1 = no reward spread to compare against; see :class:`~flowrl.rollout.forest.Forest`).

    :attr:`writes`: the units it writes advantages on, ``"edges"`` (the stochastic edges) and/or ``"leaves"``;
    an objective whose :attr:`~flowrl.objectives.base.Objective.trains_on` is not among them is refused at load.
    :attr:`zero_std_tol`: the spread at or below which a prompt group counts as flat (the loop logs the share of
    such groups and feeds it to an adaptive prompt source).

    A credit rule reads the forest only: ``reward`` on leaves and ``value`` on probed states (both
    combined over reward terms by the MultiReward), ``reward_components[name]`` per term, ``group``,
    the structure and the log-probs. Subclasses are dataclasses whose fields are the keys of the
    ``credit`` section (:mod:`flowrl.core.components`); a field declares its accepted values with
    :func:`flowrl.config.choices.choice`, checked on construction.
    """

    writes: ClassVar[tuple[str, ...]] = ("edges", "leaves")
    config_key = "credit"
    zero_std_tol = 1e-6  # a prompt group whose rewards spread by no more than this is flat (a rule's key may set it)

    def assign(self, forest: Forest, gather: Gather | None = None) -> dict[str, float]:
        """Write ``forest.advantage`` and ``forest.weight``; return statistics for the metrics log.
        ``gather`` concatenates a tensor across processes (for batch-wide statistics)."""
        raise NotImplementedError


def write_edge_credit(
    forest: Forest, edges: torch.Tensor, advantage: torch.Tensor, train: torch.Tensor, flat: torch.Tensor | None = None
) -> torch.Tensor:
    """Write ``advantage`` [E] and weight 1 on the ``edges`` [E] marked ``train`` [E] bool, and ``flat`` 1 on those of
    them whose comparison set had no spread (``flat`` [E] bool: their advantage is 0; an objective trains them only if
    it trains flat units); every other node gets advantage 0, weight 0 and flat 0. Edges the plan left untrainable
    (``forest.trainable`` 0: a tree's depth pruning) stay untrained. Returns which of ``edges`` were so pruned [E]
    bool."""
    pruned = forest.trainable[edges] <= 0
    train = train & ~pruned
    forest.advantage = torch.zeros(forest.num_nodes)
    forest.weight = torch.zeros(forest.num_nodes)
    forest.flat = torch.zeros(forest.num_nodes)
    forest.advantage[edges] = torch.where(train, advantage, torch.zeros_like(advantage)).float()
    forest.weight[edges] = train.float()
    if flat is not None:
        forest.flat[edges] = (flat & train).float()
    return pruned


def set_stats(value: torch.Tensor, key: torch.Tensor, ok: torch.Tensor, num_sets: int) -> dict[str, torch.Tensor]:
    """count, sum, sumsq, min, max, mean and std (ddof 0, two-pass) [num_sets] (fp64) of ``value`` [N] over
    the sets ``key`` [N] (ids < num_sets), counting only the entries where ``ok`` [N] (e.g. finite)."""
    v = torch.where(ok, value, torch.zeros_like(value)).double()
    k = key[ok]
    count = torch.zeros(num_sets, dtype=torch.float64).index_add_(0, k, torch.ones(k.numel(), dtype=torch.float64))
    total = torch.zeros(num_sets, dtype=torch.float64).index_add_(0, k, v[ok])
    mean = total / count.clamp(min=1)
    dev = torch.zeros(num_sets, dtype=torch.float64).index_add_(0, k, (v[ok] - mean[k]) ** 2)
    sumsq = torch.zeros(num_sets, dtype=torch.float64).index_add_(0, k, v[ok] ** 2)
    lo = torch.full((num_sets,), math.inf, dtype=torch.float64).scatter_reduce(0, k, v[ok], "amin")
    hi = torch.full((num_sets,), -math.inf, dtype=torch.float64).scatter_reduce(0, k, v[ok], "amax")
    return {
        "count": count,
        "sum": total,
        "sumsq": sumsq,
        "min": lo,
        "max": hi,
        "mean": mean,
        "std": (dev / count.clamp(min=1)).sqrt(),
    }


def standardize(
    value: torch.Tensor, key: torch.Tensor, stats: dict[str, torch.Tensor], eps: float, zero_std_tol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """z-scores [N] (fp64) of ``value`` [N] within the sets ``key`` [N], from their ``stats`` (:func:`set_stats`),
    and which sets are flat [num_sets] bool: fewer than two entries, or a spread ≤ ``zero_std_tol``. Entries
    of flat sets and non-finite entries get 0."""
    flat = no_spread(stats["count"], stats["min"], stats["max"], zero_std_tol)
    z = (value.double() - stats["mean"][key]) / (stats["std"][key] + eps)
    return torch.where(torch.isfinite(value) & ~flat[key], z, torch.zeros_like(z)), flat
