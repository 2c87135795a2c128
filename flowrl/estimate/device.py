"""The estimate for the device a run is on: ``train.fit: auto`` before the model loads (:func:`fit_for_run`) and the
FLOPs and peak behind ``perf/tflops`` and ``perf/mfu`` (:func:`perf_meter`). A CUDA device is matched to its GPU class
by name (its memory read from the device); a CPU run is fitted to the host's memory with the CPU's kernels."""

from __future__ import annotations

import os
import warnings
from typing import Iterable

import torch

from flowrl.config import build
from flowrl.estimate.fit import Fit, fit_config, kept_keys
from flowrl.estimate.gpus import GPUS, gpu_class_of_device
from flowrl.estimate.iteration import GiB, estimate
from flowrl.estimate.run_checks import check_launch
from flowrl.training.perf import PerfMeter

FALLBACK_GPU = "H100"
"""The GPU class of a CUDA device none of :data:`GPUS` names (its own memory is used; its peak is the H100's)."""


def device_at_hand(cfg) -> tuple[str, float, str, str]:
    """(GPU class key, memory in GiB, estimate target, description) of the device ``cfg.model.device`` resolves to."""
    device = build.resolve_device(cfg.model.device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        memory = torch.cuda.get_device_properties(index).total_memory / GiB
        return gpu_class_of_device(name) or FALLBACK_GPU, memory, "cuda", f"{name} ({memory:.1f} GiB)"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return FALLBACK_GPU, memory, "cpu", f"this CPU ({memory:.1f} GiB of host memory)"


def world_size() -> int:
    """Processes of a run launched by accelerate or torchrun (``WORLD_SIZE``), else 1."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def fit_for_run(cfg, overrides: Iterable[str] = ()) -> Fit:
    """:func:`fit_config` of ``cfg`` for the device at hand; the keys of ``overrides`` (``key=value``) are kept."""
    check_launch(cfg, world_size())  # the run's refusal of its launch first, not the estimate's of it
    gpu, memory, target, description = device_at_hand(cfg)
    return fit_config(
        cfg,
        gpu,
        processes=world_size(),
        capacity_gib=memory,
        keep=kept_keys(overrides),
        target=target,
        device=description,
    )


def perf_meter(cfg, flops_per_iteration: float | None = None, arch: dict | None = None) -> PerfMeter | None:
    """The :class:`PerfMeter` of a run of ``cfg`` on the device at hand: the estimate's FLOPs of one iteration (or
    ``flops_per_iteration``, e.g. a fit's) and the peak (``train.peak_tflops``, else the GPU class's; none on a CPU).
    None, with a warning, when the run cannot be estimated (an out-of-tree family, a plan that declares no counts); a
    launch the run refuses is refused first, alone, with the run's words
    (:func:`~flowrl.estimate.run_checks.check_launch`: context parallelism on one process used to warn "no
    perf/tflops" before the run's refusal)."""
    check_launch(cfg, world_size())
    gpu, _, target, _ = device_at_hand(cfg)
    if flops_per_iteration is None:
        try:
            flops_per_iteration = float(
                estimate(cfg, gpu=gpu, processes=world_size(), arch=arch, target=target)["flops"]["total"]
            )
        except Exception as e:  # noqa: BLE001 - a side metric never stops a run (an out-of-tree plan or family)
            warnings.warn(
                f"no perf/tflops for this run: its model cannot be estimated ({e})", RuntimeWarning, stacklevel=2
            )
            return None
    if cfg.train.peak_tflops:
        return PerfMeter(flops_per_iteration, cfg.train.peak_tflops, "train.peak_tflops")
    if target != "cuda":
        return PerfMeter(flops_per_iteration)
    spec = GPUS[gpu]
    return PerfMeter(flops_per_iteration, spec.peak_tflops, f"{spec.name}, {spec.peak_source}")
