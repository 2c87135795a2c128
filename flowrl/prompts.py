"""Prompt sources: which prompt groups each iteration trains on, derived from (seed, iteration)."""
from __future__ import annotations

from pathlib import Path

import torch

from flowrl.config import REPO_ROOT
from flowrl.rollout.seeding import derive_seed


def read_prompts(spec: str, key: str = "prompts.train") -> list[str]:
    """Prompts from a text file (one per line; blank lines and ``#`` comments skipped), resolved
    against the working directory and then the repository root, or inline ``"a|b|c"``."""
    if "|" in spec or not (spec.endswith(".txt") or "/" in spec):
        prompts = [p.strip() for p in spec.split("|") if p.strip()]
    else:
        path = Path(spec)
        if not path.is_file() and (REPO_ROOT / spec).is_file():
            path = REPO_ROOT / spec
        if not path.is_file():
            raise FileNotFoundError(f"{key}={spec!r}: no such prompt file (relative paths are tried from the "
                                    f"working directory and from {REPO_ROOT})")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"{key}={spec!r} holds no prompts")
    return prompts


class PromptSource:
    """Epoch-wise shuffled prompts: iteration ``it`` takes prompts ``[it·n, (it+1)·n)`` of an endless
    sequence of seeded permutations, so a resumed run sees exactly the same prompts."""

    def __init__(self, prompts: list[str], per_step: int, seed: int = 0):
        self.prompts = list(prompts)
        self.per_step = per_step
        self.seed = seed

    def _epoch(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", epoch))
        return torch.randperm(len(self.prompts), generator=gen).tolist()

    def batch(self, iteration: int) -> list[str]:
        """The ``per_step`` prompts of ``iteration`` (all processes together)."""
        out: list[str] = []
        pos = iteration * self.per_step
        while len(out) < self.per_step:
            epoch, offset = divmod(pos, len(self.prompts))
            out.append(self.prompts[self._epoch(epoch)[offset]])
            pos += 1
        return out
