"""Decoding the clean latents of a rollout into images on the host, a batch at a time, without the host waiting
for the device where the caller can hand the wait on (the scorer's worker thread does, :func:`not_waiting`).

    images = decode(model, x0, max_batch)                      # [S, 3, H, W] in [0, 1] on the CPU (waited for)
    images, ready = decode_to_host(model, x0, max_batch)       # valid once ``ready`` (a CUDA event or None) is done
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from flowrl.models.base import FlowModel


class _Waits(threading.local):
    events: list | None = None  # this thread's: a list while a caller takes over the waiting (:func:`not_waiting`)


_WAITS = _Waits()


def decode(model: FlowModel, latents: torch.Tensor, max_batch: int) -> torch.Tensor:
    """Images [S, 3, H, W] (a video family: videos [S, F, 3, H, W]) in [0, 1] on the CPU for clean latents
    [S, *latent_shape], ``max_batch`` at a time (:func:`decode_to_host`, waited for; under :func:`not_waiting` the
    caller takes the event instead and the host does not wait)."""
    images, ready = decode_to_host(model, latents, max_batch)
    if ready is not None:
        events = _WAITS.events
        if events is None:
            ready.synchronize()
        else:
            events.append(ready)
    return images


@contextlib.contextmanager
def not_waiting() -> Iterator[list]:
    """Inside, :func:`decode` hands its copies' events to the yielded list instead of waiting for them."""
    previous, _WAITS.events = _WAITS.events, []
    try:
        yield _WAITS.events
    finally:
        _WAITS.events = previous


def decode_to_host(
    model: FlowModel, latents: torch.Tensor, max_batch: int
) -> "tuple[torch.Tensor, torch.cuda.Event | None]":
    """:func:`decode` without waiting for the device: ``(images, ready)``, the images [S, 3, H, W] (or [S, F, 3, H, W])
    in one host buffer (pinned on CUDA) that is valid once ``ready`` (a CUDA event; None: valid now) has completed.
    The decodes are queued ``max_batch`` at a time, each copied into its rows of the buffer as it finishes."""
    if latents.shape[0] == 0:
        frames = (model.num_frames,) if model.modality == "video" else ()
        return torch.zeros(0, *frames, 3, model.height, model.width), None
    out = None
    on_cuda = torch.device(model.device).type == "cuda"
    for i in range(0, latents.shape[0], max_batch):
        images = model.decode(latents[i : i + max_batch].to(model.device))
        if out is None:
            out = torch.empty(
                (latents.shape[0], *images.shape[1:]),
                dtype=images.dtype,
                pin_memory=on_cuda and images.device.type == "cuda",
            )
        out[i : i + images.shape[0]].copy_(images, non_blocking=out.is_pinned())
    ready = None
    if out.is_pinned():
        ready = torch.cuda.Event()
        ready.record()
    return out, ready
