"""The search behind ``train.fit: auto`` (:mod:`flowrl.estimate.fit`): the memory model the two probes span (a line
per phase in the batch, interpolated per checkpointed block) and the chooser that ranks every candidate (rollout
batch, update batch, checkpointed blocks, offload) by its predicted throughput within the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EFFICIENCY_TOKENS = 8192
"""Tokens per forward at which the update reaches half its best speed in the throughput score (ours: a 2–12 B
transformer's matmuls fill an H100 from roughly 10^4 tokens per forward on)."""
OFFLOAD_PENALTY = 0.02
"""Score lost by offloading the text encoders (a copy to the device per batch of new prompts): only when needed."""


@dataclass
class _Line:
    """A quantity linear in a batch size, through two probes (x0, y0) and (x1, y1); constant when x0 == x1."""

    x0: float
    y0: float
    x1: float
    y1: float

    def __call__(self, x: float) -> float:
        if self.x1 == self.x0:
            return self.y0
        return self.y0 + (self.y1 - self.y0) * (x - self.x0) / (self.x1 - self.x0)


def states_of(result: dict) -> tuple[int, int]:
    """(rollout states per forward, update states per micro-batch) an estimate traced: the batches as the run takes
    them (``rollout.max_batch`` at most the iteration's forwards, the micro-batch at most its training rows)."""
    sh = result["shapes"]
    return sh["rollout_rows"] // (2 if sh["cfg"] else 1), sh["update_rows"] // (2 if sh["train_cfg"] else 1)


@dataclass
class _MemoryModel:
    """Predicted peak (GiB) of settings (rollout batch ``b``, update batch ``u``, ``k`` of ``blocks`` checkpointed,
    ``offload``), from two probe estimates ``low`` and ``high``, every block checkpointed; a batch beyond what the
    high probe traced (the iteration's forwards or training rows) is that batch."""

    low: dict
    high: dict
    blocks: int

    def __post_init__(self) -> None:
        (b0, u0), (b1, u1) = states_of(self.low), states_of(self.high)
        self.b, self.u = (b0, b1), (u0, u1)

    def _line(self, key: str, over: str) -> _Line:
        x = self.b if over == "b" else self.u
        return _Line(x[0], self.low["memory_gib"][key], x[1], self.high["memory_gib"][key])

    def update(self, u: int, k: int) -> float:
        """The update phase's activations with ``k`` blocks checkpointed (one block's worth on top in between)."""
        u = min(u, self.u[1])
        none = self._line("activations_update_without_checkpointing", "u")(u)
        every = self._line("activations_update_with_checkpointing", "u")(u)
        saved_per_block = max(0.0, none - every) / self.blocks
        between = saved_per_block if 0 < k < self.blocks else 0.0
        return none - saved_per_block * k + between

    def phases(self, b: int, u: int, k: int, offload: bool) -> dict[str, float]:
        mem = self.low["memory_gib"]
        p = mem["phases"]
        encoders = mem["text_encoders"] + mem["offloaded_to_cpu"]
        b = min(b, self.b[1])
        return {
            "rollout": self._line("activations_rollout", "b")(b) + p["rollout"] - mem["activations_rollout"],
            "decode": self._line("activations_decode", "b")(b),
            "update": self.update(u, k) + p["update"] - mem["activations_update"],
            "optimizer_step": p["optimizer_step"],
            "encode": encoders if offload else 0.0,
        }

    def base(self, offload: bool) -> float:
        """Bytes held through the iteration (GiB), the text encoders' on the device unless offloaded; the host
        forest of a CPU run grows with nothing fit chooses."""
        mem = self.low["memory_gib"]
        encoders = mem["text_encoders"] + mem["offloaded_to_cpu"]
        return mem["base"] - mem["text_encoders"] + (0.0 if offload else encoders)

    def peak(self, b: int, u: int, k: int, offload: bool) -> float:
        return self.base(offload) + max(self.phases(b, u, k, offload).values())


# ---- choosing -----------------------------------------------------------------------------------------------------
def _ladder(low: int, high: int) -> list[int]:
    """``low`` doubled while below ``high``, and ``high`` itself (ascending, distinct)."""
    out, x = [], max(1, low)
    while x < high:
        out.append(x)
        x *= 2
    return sorted({*out, high})


@dataclass(frozen=True)
class _Candidate:
    b: int
    u: int
    k: int
    offload: bool
    score: float


class _Chooser:
    """The candidates of one config and device, best first."""

    def __init__(
        self,
        cfg,
        keep: set[str],
        model: _MemoryModel,
        budget: float,
        policy: bool,
        unit: int,
        caps: tuple[int, int],
        tokens_per_row: int,
    ):
        self.cfg, self.keep, self.model, self.budget, self.policy = cfg, keep, model, budget, policy
        self.unit, self.caps, self.tokens = unit, caps, tokens_per_row

    def options(self) -> tuple[list[int], list[int], list[int], list[bool]]:
        c, keep, n = self.cfg, self.keep, self.model.blocks
        bs = [int(c.rollout.max_batch)] if "rollout.max_batch" in keep else _ladder(self.unit, self.caps[0])
        if self.policy:
            us = bs
        elif "train.micro_batch" in keep:
            us = [int(c.train.micro_batch or c.rollout.max_batch)]
        else:
            us = [u for u in _ladder(self.unit, self.caps[1]) if u % self.unit == 0] or [self.unit]
        ks = list(range(n + 1))
        if "model.gradient_checkpointing" in keep:
            ks = [k for k in ks if (k > 0) == bool(c.model.gradient_checkpointing)]
        if "model.checkpoint_blocks" in keep and c.model.gradient_checkpointing:
            ks = [n if c.model.checkpoint_blocks is None else min(int(c.model.checkpoint_blocks), n)]
        offloads = [bool(c.model.offload_encoders)] if "model.offload_encoders" in keep else [False, True]
        return bs, us, ks, offloads

    def score(self, u: int, k: int, offload: bool) -> float:
        x = u * self.tokens
        return x / (x + EFFICIENCY_TOKENS) / (1 + k / (3 * self.model.blocks)) - (OFFLOAD_PENALTY if offload else 0.0)

    def ranked(self) -> list[_Candidate]:
        bs, us, ks, offloads = self.options()
        m, out = self.model, []
        for offload in offloads:
            for u in us:
                for k in ks:
                    if self.policy:
                        fits = m.peak(u, u, k, offload) <= self.budget
                        b = u
                    else:
                        fitting = [b for b in bs if m.peak(b, u, k, offload) <= self.budget]
                        fits, b = bool(fitting), max(fitting, default=0)
                    if fits:
                        out.append(_Candidate(b, u, k, offload, self.score(u, k, offload)))
        return sorted(out, key=lambda c: (-c.score, -c.b, c.k))

    def least(self) -> _Candidate:
        """The least-memory settings the kept keys allow."""
        bs, us, ks, offloads = self.options()
        return _Candidate(bs[0], us[0], ks[-1], offloads[-1], 0.0)

    def settings(self, c: _Candidate) -> dict[str, Any]:
        n = self.model.blocks
        return {
            "rollout.max_batch": c.b,
            "train.micro_batch": None if self.policy else c.u,
            "model.gradient_checkpointing": c.k > 0,
            "model.checkpoint_blocks": None if c.k in (0, n) else c.k,
            "model.offload_encoders": c.offload,
        }
