"""Helpers shared by the model rewards: device/dtype resolution, image conversion, weight files.

Kept free of heavy imports (PIL, huggingface_hub and safetensors are imported inside functions).
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch


def resolve_device(device: str | torch.device, owner: str = "reward") -> torch.device:
    """``"auto"`` → ``cuda`` if available else ``cpu``; anything else goes through ``torch.device``."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{owner}: device={device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{owner}: device={device!r} but CUDA is not available here; use 'auto' or 'cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, owner: str = "reward") -> torch.dtype:
    """``"auto"`` → fp16 on CUDA, fp32 elsewhere; else one of fp32/fp16/bf16 (or a ``torch.dtype``)."""
    from flowrl.models.dtypes import DTYPE_ALIASES, DTYPES, dtype_named

    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"{owner}: dtype={dtype} is not supported; use one of fp32, fp16, bf16 or 'auto'")
        return dtype
    if dtype in (None, "auto"):
        return torch.float16 if device.type == "cuda" else torch.float32
    found = dtype_named(dtype)
    if found is None:
        raise ValueError(
            f"{owner}: dtype={dtype!r} is not supported; use one of 'auto', {sorted([*DTYPES, *DTYPE_ALIASES])}"
        )
    return found


def to_uint8(images: torch.Tensor):
    """[B, 3, H, W] float in [0, 1] → numpy uint8 [B, H, W, 3], rounded as a saved PNG would be."""
    x = images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: torch.Tensor) -> list:
    """[B, 3, H, W] float in [0, 1] → list of RGB ``PIL.Image`` (8 bits per channel).

    Reward models were trained on 8-bit images decoded to PIL, so their own processors are applied
    to these (the exact published resize, crop and normalisation).
    """
    from PIL import Image

    return [Image.fromarray(a) for a in to_uint8(images)]


def batches(n: int, batch_size: int | None) -> Iterator[slice]:
    """Slices covering ``range(n)`` in chunks of ``batch_size`` (all at once if None or <= 0)."""
    step = n if not batch_size or batch_size <= 0 else int(batch_size)
    for start in range(0, n, max(step, 1)):
        yield slice(start, min(start + step, n))


def unique(prompts: Sequence[str]) -> tuple[list[str], torch.Tensor]:
    """Unique prompts (first-seen order) and the index of each prompt into them."""
    order: dict[str, int] = {}
    index = [order.setdefault(p, len(order)) for p in prompts]
    return list(order), torch.tensor(index, dtype=torch.long)


def check_batch_size(batch_size: Any, owner: str) -> int:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"{owner}: batch_size={batch_size!r} must be a positive integer")
    return batch_size


def hub_or_local_file(spec: str, kwarg: str, owner: str) -> str:
    """A local file path, or ``"org/repo:filename"`` fetched with ``huggingface_hub.hf_hub_download``."""
    path = os.path.expanduser(str(spec))
    if os.path.isfile(path):
        return path
    repo, sep, filename = str(spec).partition(":")
    if not sep or not filename or repo.count("/") != 1 or repo.startswith(("/", ".", "~")):
        raise FileNotFoundError(
            f"{owner}: {kwarg}={spec!r} is neither an existing file nor a hub file 'org/repo:filename'"
        )
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id=repo, filename=filename)
    except Exception as e:  # offline, missing repo, ...: say which kwarg takes a local file instead
        raise RuntimeError(
            f"{owner}: could not fetch {filename!r} from the hub repo {repo!r} ({type(e).__name__}: {e}); "
            f"download it elsewhere and pass its local path as {kwarg}=..."
        ) from e


def load_state_dict(path: str, owner: str) -> dict[str, torch.Tensor]:
    """A tensor state dict from ``.safetensors`` or a torch file (``weights_only=True``, never arbitrary pickle).

    A ``{"state_dict": ...}`` wrapper and a ``module.`` prefix (DataParallel) are removed.
    """
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise RuntimeError(f"{owner}: cannot read weights file {path!r} as a tensor state dict ({e})") from e
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise RuntimeError(f"{owner}: weights file {path!r} does not hold a state dict of tensors")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return sd
