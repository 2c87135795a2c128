"""Which of PyTorch's scaled-dot-product-attention kernels a CUDA run lets torch choose.

torch (2.5 and later) tries its cuDNN attention kernel first on Hopper cards (H100, H200) when the inputs allow it,
then flash, memory-efficient and math. Measured on an H200 (torch 2.11.0+cu130, 2026-11-27; docs/gpu.md, "GPU
check results"): one DiffusionNFT iteration of FLUX.1-dev (LoRA r32, bf16, 512 px: 24 heads × 128 over 512 text +
1,024 image tokens) through the cuDNN kernel fails in the backward, as "an illegal memory access" under
``CUDA_LAUNCH_BLOCKING=1`` (``mha_graph.execute(...)`` not good) and as three non-finite gradients in a row
without it; the same iteration with the cuDNN kernel off gives finite gradients (max |g| 2.2e-4) with flash or
memory-efficient attention. SD3.5-Medium's shapes did not fail. So a run turns that kernel off unless
``model.cudnn_attention: true``.

It is a process-wide switch (``torch.backends.cuda.enable_cudnn_sdp``), not a context around the forwards: with
gradient checkpointing the blocks' forwards run again inside the backward, outside any context the loop could open,
and must pick the same kernel.
"""

from __future__ import annotations

import torch


def configure_attention(device: torch.device | str, cudnn: bool) -> None:
    """On a CUDA ``device``, allow torch's cuDNN attention kernel iff ``cudnn``; elsewhere nothing changes."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(bool(cudnn))


def cudnn_attention_on(device: torch.device | str) -> bool:
    """True when ``device`` is a CUDA device and torch may pick its cuDNN attention kernel there."""
    return torch.device(device).type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
