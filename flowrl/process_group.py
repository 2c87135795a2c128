"""The processes of a run, as the loop, credit rules and prompt sources see them: one object for
gathering tensors, summing numbers and averaging gradients over an accelerate process group (with one
process every call is the identity, so the single-process path has no collective in it)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

WEIGHT = "__weight:"  # the prefix of the weight beside each mean in reduce_means' sums


class ProcessGroup:
    """``world`` processes, this one ``rank``; the main process (rank 0) writes the run's files."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.is_main = accelerator.is_main_process

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's ``t`` [n, ...] concatenated in rank order [world·n, ...], on the CPU."""
        if self.world == 1:
            return t
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def sum(self, value: float) -> float:
        """``value`` summed over processes."""
        if self.world == 1:
            return float(value)
        t = torch.tensor([float(value)], device=self.accelerator.device)
        return float(self.accelerator.reduce(t, reduction="sum").item())

    def mean(self, value: float) -> float:
        return self.sum(value) / self.world

    def reduce_sums(self, sums: dict[str, float], extremes: dict[str, Callable]) -> dict[str, float]:
        """``sums`` combined over processes key by key, over the union of every process's keys: a key in
        ``extremes`` by its function (e.g. ``min``; processes without the key take no part), the others
        added (a missing key counts 0). One gather of the small dicts; the result is the same on every rank."""
        if self.world == 1:
            return dict(sums)
        import torch.distributed as dist

        every: list[dict[str, float]] = [{} for _ in range(self.world)]
        dist.all_gather_object(every, dict(sums))
        out: dict[str, float] = {}
        for part in every:  # rank order, so every rank folds the same numbers in the same order
            for key, value in part.items():
                fold(out, key, value, extremes)
        return out

    def reduce_means(self, values: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """``values`` combined over processes by one :meth:`reduce_sums`, over the union of every process's
        keys: a key with a weight (the number of items behind its value, e.g. the prompts of a per-task
        accuracy) as the weighted mean sum(value·weight) / sum(weight) (processes without the key, or with
        weight 0, take no part); a key without one (a count) added. Equal on every rank to one process's
        statistics over all the items."""
        sums: dict[str, float] = {}
        for key, value in values.items():
            if key.startswith(WEIGHT):
                raise ValueError(f"reduce_means: key {key!r} starts with the reserved {WEIGHT!r}")
            weight = weights.get(key)
            if weight is None:
                sums[key] = float(value)
            elif weight:
                sums[key], sums[WEIGHT + key] = float(value) * weight, float(weight)
        total = self.reduce_sums(sums, {})
        return {k: v / total[WEIGHT + k] if WEIGHT + k in total else v
                for k, v in total.items() if not k.startswith(WEIGHT)}

    def average_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace every ``p.grad`` by its mean over processes (one flat all-reduce; a missing grad counts 0)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.accelerator.device)
        flat = self.accelerator.reduce(flat, reduction="mean")
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset: offset + g.numel()].view_as(g).to(p.device, p.dtype)
            offset += g.numel()

    def shard(self, items: list) -> tuple[list, int]:
        """This process's contiguous share of ``items`` (len divisible by ``world``) and its first index."""
        k = len(items) // self.world
        return items[self.rank * k:(self.rank + 1) * k], self.rank * k

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()


def fold(sums: dict[str, float], key: str, value: float, extremes: dict[str, Callable]) -> None:
    """Accumulate one diagnostic into ``sums``: keys in ``extremes`` combine by their function (min/max),
    the rest add (size-weighted sums, divided by the units at the end)."""
    if key in extremes and key in sums:
        sums[key] = extremes[key](sums[key], value)
    else:
        sums[key] = sums.get(key, 0.0) + value
