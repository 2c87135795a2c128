"""``flowrl bench``: where an iteration's time goes, and its peak memory.

Reports seconds per iteration split into rollout, reward and update, the time spent inside model
forwards (``velocity``) and backwards, and the loop's own overhead = iteration − (forwards +
backwards + decode/reward). Peak memory: CUDA max allocated, or the process's peak RSS on CPU.
"""
from __future__ import annotations

import resource
import time

import torch

from flowrl.config import TrainConfig


class _Timed:
    """Wraps a callable and accumulates its wall time."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def bench_iteration(cfg: TrainConfig, iterations: int = 3, warmup: int = 1) -> dict[str, float]:
    """Mean timings over ``iterations`` train steps after ``warmup`` untimed ones (no eval, no saving)."""
    from flowrl.trainer import Trainer

    cfg.train.progress = False
    cfg.prompts.eval = None
    trainer = Trainer(cfg)
    for i in range(warmup):
        trainer.train_step(i)
    velocity = _Timed(trainer.model.velocity)
    trainer.model.velocity = velocity
    backward = _Timed(torch.Tensor.backward)
    torch.Tensor.backward = lambda self, *a, **k: backward(self, *a, **k)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sums: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        for i in range(warmup, warmup + iterations):
            rec = trainer.train_step(i)
            for k in ("time/rollout", "time/reward", "time/update", "rollout_forwards", "rollout_nfe", "trained_edges"):
                sums[k] = sums.get(k, 0.0) + rec[k]
    finally:
        torch.Tensor.backward = backward.fn
    total = (time.perf_counter() - t0) / iterations
    out = {k: v / iterations for k, v in sums.items()}
    out["seconds_per_iteration"] = total
    out["forward_seconds"] = velocity.seconds / iterations
    out["backward_seconds"] = backward.seconds / iterations
    out["overhead_seconds"] = total - out["forward_seconds"] - out["backward_seconds"] - out["time/reward"]
    out["overhead_fraction"] = out["overhead_seconds"] / total
    if torch.cuda.is_available():
        out["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out
