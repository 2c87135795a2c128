"""The GPU classes an estimate is made for (peak bf16 TFLOP/s, usable memory, compute capability, fp8
speed-up), the assumed utilisation that turns FLOPs into the s/iteration range, and loading a config as if
on one of them (an explorer backend is checked against the named GPU, not this machine)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import flowrl.rollout.precision as precision
from flowrl.config.schema import TrainConfig
from flowrl.core.choices import choose
from flowrl.errors import ConfigError
from flowrl.paths import DEFAULT_CONFIG


@dataclass(frozen=True)
class GPUClass:
    """A GPU class: dense bf16 tensor-core peak (TFLOP/s, no sparsity), memory torch can use (GiB), compute
    capability, the dense fp8 peak relative to bf16 (1 where the GPU has no fp8 tensor cores), and the bf16 matmul
    rate measured on one (None where none was lent yet): the denominator of ``perf/mfu``."""

    name: str
    bf16_tflops: float
    memory_gib: float
    capability: tuple[int, int]
    fp8_speedup: float
    measured_bf16_tflops: float | None = None

    @property
    def peak_tflops(self) -> float:
        """The bf16 peak of this class, the one table both the estimate's time and ``perf/mfu`` use: measured where
        known, else the datasheet's dense figure (:attr:`peak_source` says which)."""
        return self.measured_bf16_tflops or self.bf16_tflops

    @property
    def peak_source(self) -> str:
        """Where :attr:`peak_tflops` comes from, in words."""
        if self.measured_bf16_tflops:
            return f"measured (8192³ bf16 matmuls; datasheet dense {self.bf16_tflops:g})"
        return "datasheet dense"


GPUS: dict[str, GPUClass] = {
    # NVIDIA datasheets: H100 SXM5 BF16 1,979 TFLOPS with sparsity → 989.4 dense; 80 GB HBM3 (79.6 GiB usable)
    # measured: 8192³ bf16 products on the lent H100 and H200 (2026-11, docs/gpu.md): 798 and 788 TFLOP/s
    "H100": GPUClass("H100 SXM5 80GB", 989.4, 79.6, (9, 0), 2.0, 798.0),
    # H200 SXM: same compute as H100 SXM, 141 GB HBM3e (139.8 GiB usable)
    "H200": GPUClass("H200 SXM 141GB", 989.4, 139.8, (9, 0), 2.0, 788.0),
    # A100 SXM4 80GB: BF16 312 TFLOPS dense; no fp8
    "A100": GPUClass("A100 SXM4 80GB", 312.0, 79.2, (8, 0), 1.0),
    # L40S: BF16 362.05 TFLOPS dense (733 with sparsity); 48 GB GDDR6 (44.4 GiB usable)
    "L40S": GPUClass("L40S 48GB", 362.05, 44.4, (8, 9), 2.0),
    # RTX 4090: BF16 with FP32 accumulate 165.2 TFLOPS dense (Ada whitepaper); 24 GB (23.6 GiB usable)
    "4090": GPUClass("GeForce RTX 4090 24GB", 165.2, 23.6, (8, 9), 2.0),
}
"""GPU classes ``--gpu`` accepts (keys are case-insensitive)."""

UTILISATION = (0.30, 0.60)
"""Assumed fraction of the bf16 peak (:attr:`GPUClass.peak_tflops`: measured where known, as ``perf/mfu``'s) the
transformer's matmuls reach (model FLOPs utilisation): the s/iteration range is FLOPs / (peak × 0.60) … FLOPs /
(peak × 0.30)."""


def gpu_class(name: str) -> GPUClass:
    """The :class:`GPUClass` named ``name`` (case-insensitive, e.g. ``h100``); a clear error names the choices."""
    for key, gpu in GPUS.items():
        if key.lower() == str(name).lower():
            return gpu
    raise ConfigError(f"unknown GPU class {name!r}; accepted: {sorted(GPUS)}")


def gpu_class_of_device(device_name: str) -> str | None:
    """The :data:`GPUS` key whose name a CUDA device's name contains (``NVIDIA H200`` → ``H200``), else None."""
    name = device_name.upper().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):
        if key.upper() in name:
            return key
    return None


@contextlib.contextmanager
def assume_gpu(gpu: str) -> Iterator[None]:
    """Within the context, explorer backends are checked against the GPU class ``gpu`` (its compute
    capability; torchao/bitsandbytes assumed installed) instead of this machine, so a GPU preset
    (``rollout.backend: fp8``) loads on a laptop for an estimate; a backend that GPU cannot run still fails,
    naming it."""
    spec = gpu_class(gpu)
    original = precision.check_backend

    def check(backend: str, device=None, key: str = "rollout.backend") -> None:
        choose(key, backend, precision.BACKENDS)
        need = {"fp8": (8, 9), "nvfp4": (8, 9)}.get(backend)
        if need is not None and spec.capability < need:
            raise ConfigError(
                f"{key}={backend!r} needs compute capability >= {need[0]}.{need[1]}; "
                f"{spec.name} has {spec.capability[0]}.{spec.capability[1]}"
            )

    precision.check_backend = check
    try:
        yield
    finally:
        precision.check_backend = original


def load_config(path: str | None, overrides: list[str] | None = None, gpu: str = "H100"):
    """``TrainConfig.from_yaml(path, overrides)`` with explorer backends checked against ``gpu``
    (:func:`assume_gpu`)."""
    with assume_gpu(gpu):
        return TrainConfig.from_yaml(path or DEFAULT_CONFIG, overrides or [])
