"""Model FLOP/s of every iteration (``perf/tflops``) and, on a device whose peak is known, the share of that peak
(``perf/mfu``): the estimate's FLOPs of one iteration (per process; :func:`flowrl.estimate.iteration.estimate`) over
the iteration's measured wall time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flowrl.config.bounds import PEAK_TFLOPS as PEAK_RANGE


@dataclass(frozen=True)
class PerfMeter:
    """``flops_per_iteration``: model FLOPs of one iteration on one process; ``peak_tflops``: the device's bf16 peak
    (``train.peak_tflops``, else the GPU table's, :attr:`flowrl.estimate.gpus.GPUClass.peak_tflops`: the one the
    estimate's time uses too; None on a CPU: no ``perf/mfu``), within ``train.peak_tflops``'s range
    (:data:`flowrl.config.bounds.PEAK_TFLOPS`); ``peak_source``: where
    that peak comes from, in words."""

    flops_per_iteration: float
    peak_tflops: float | None = None
    peak_source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        peak = self.peak_tflops
        if peak is not None and not (math.isfinite(peak) and PEAK_RANGE[0] <= peak <= PEAK_RANGE[1]):
            raise ValueError(
                f"peak_tflops={peak!r} must be in [{PEAK_RANGE[0]:g}, {PEAK_RANGE[1]:,g}] bf16 TFLOP/s (a device's "
                "peak; perf/mfu divides by it)"
            )

    def metrics(self, seconds: float) -> dict[str, float]:
        """``perf/tflops`` (and ``perf/mfu``) of an iteration that took ``seconds``."""
        tflops = self.flops_per_iteration / max(seconds, 1e-12) / 1e12
        out = {"perf/tflops": tflops}
        if self.peak_tflops:
            out["perf/mfu"] = tflops / self.peak_tflops
        return out

    def progress(self, record: dict) -> dict[str, str]:
        """The progress bar's field: MFU where known, else TFLOP/s."""
        if "perf/mfu" in record:
            return {"mfu": f"{record['perf/mfu']:.0%}"}
        return {"tflops": f"{record['perf/tflops']:.3g}"} if "perf/tflops" in record else {}
