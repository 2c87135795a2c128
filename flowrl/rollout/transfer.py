"""Copies between the host and the model's device that do not stall the host (issue 52).

The forest's bookkeeping (node indices, groups, σ, advantages…) lives on the host; latents, prompt embeddings
and everything a model call returns live on the model's device. On CUDA a plain ``t.to("cuda")`` of a pageable
host tensor, and every read of a device value on the host (``.item()``, ``float(t)``, ``.cpu()``, ``.tolist()``,
``bool(t)``), waits until the GPU has finished all the work queued before it: the host then launches the next
kernels into an idle GPU. The loop moves small host columns with :func:`to_device` (pinned memory, asynchronous
on CUDA) and reads device values back once per iteration, where it needs them. ``torch.cuda.set_sync_debug_mode
("warn")`` names every synchronisation left on a GPU; tests/test_host_syncs.py holds the line on the CPU.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (any shape) on ``device``: from the host to CUDA through pinned memory without blocking the host (the
    copy is ordered on the current stream before any kernel launched after it); otherwise ``t.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``t`` (any shape) to the host: ``(copy, ready)``. From CUDA the copy lands in pinned memory
    asynchronously and is valid once ``ready`` (a CUDA event) has completed (``ready.synchronize()``); from the
    host it is ``t`` itself and ``ready`` is None."""
    if t.device.type != "cuda":
        return t, None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return out, ready
