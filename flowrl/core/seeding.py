"""Seeds derived from (run seed, iteration, role, indices): no global RNG anywhere in a rollout.

``derive_seed(0, 3, "root", 17)`` is the same number on every machine, process and run, so any
root state or noise draw can be rebuilt from its address (resume, Sol-RL regeneration, replays).
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of ints/strings (stable blake2b hash of their repr)."""
    digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_normal(seed: int, shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 standard normal draw of ``shape`` from a CPU generator seeded with ``seed``, moved to ``device``."""
    gen = torch.Generator("cpu").manual_seed(int(seed))
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device)


def seeded_normals(seeds: list[int], shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [len(seeds), *shape]: row i is ``seeded_normal(seeds[i], shape)`` (bit-identical), drawn straight into one
    host buffer (pinned when ``device`` is CUDA) and moved to ``device`` in one copy that does not block the host."""
    device = torch.device(device)
    out = torch.empty((len(seeds), *shape), dtype=torch.float32, pin_memory=device.type == "cuda")
    gen = torch.Generator("cpu")
    for row, seed in zip(out, seeds):
        torch.randn(shape, generator=gen.manual_seed(int(seed)), dtype=torch.float32, out=row)
    return out.to(device, non_blocking=True) if device.type == "cuda" else out.to(device)
