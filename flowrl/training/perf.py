"""Model FLOP/s of every iteration (``perf/tflops``) and, on a device whose peak is known, the share of that peak
(``perf/mfu``): the estimate's FLOPs of one iteration (per process; :func:`flowrl.estimate.iteration.estimate`) over
the iteration's measured wall time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PerfMeter:
    """``flops_per_iteration``: model FLOPs of one iteration on one process; ``peak_tflops``: the device's bf16 peak
    (``train.peak_tflops``, else the table's; None on a CPU: no ``perf/mfu``)."""

    flops_per_iteration: float
    peak_tflops: float | None = None

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
