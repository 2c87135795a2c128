"""The values an adapter's calls exchange beside latents: :class:`Conditioning` (a batch's text conditioning),
:func:`sigma_vector` (σ as an fp32 vector) and :func:`calculate_shift` (``mu`` of dynamic shifting). Part of the
:class:`~flowrl.models.base.FlowModel` contract; :mod:`flowrl.models.base` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def sigma_vector(sigma: torch.Tensor | float, batch: int, device: torch.device) -> torch.Tensor:
    """σ as an fp32 vector [batch] on ``device`` (from a scalar, a 0-d tensor or a [batch] tensor)."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32).to(device)
    if sigma.ndim == 0:
        return sigma.expand(batch)
    if sigma.shape != (batch,):
        raise ValueError(f"sigma must be a scalar or [B={batch}]; got shape {list(sigma.shape)}")
    return sigma


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """``mu`` of dynamic shifting: linear in the number of image tokens, ``base_shift`` at
    ``base_seq_len`` and ``max_shift`` at ``max_seq_len``. The same arithmetic as diffusers'
    ``calculate_shift`` (SD3 and FLUX pipelines), without importing a pipeline module."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    mu = image_seq_len * m + b
    return mu


@dataclass
class Conditioning:
    """Text conditioning for a batch of B prompts.

    ``cond`` / ``uncond`` map names (e.g. ``"prompt_embeds"`` [B, L, D], ``"pooled"`` [B, D]) to
    tensors whose first dimension is the batch. ``uncond`` is None when guidance is off.
    """

    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return next(iter(self.cond.values())).shape[0]

    def select(self, index: torch.Tensor | Sequence[int]) -> "Conditioning":
        """Rows ``index`` (a LongTensor or list of ints) of every tensor."""
        index = torch.as_tensor(index, dtype=torch.long)
        pick = lambda d: None if d is None else {k: v[index.to(v.device)] for k, v in d.items()}
        return Conditioning(pick(self.cond), pick(self.uncond))

    @staticmethod
    def cat(parts: Sequence["Conditioning"]) -> "Conditioning":
        """Concatenate along the batch dimension."""
        keys = parts[0].cond.keys()
        cond = {k: torch.cat([p.cond[k] for p in parts]) for k in keys}
        if parts[0].uncond is None:
            return Conditioning(cond, None)
        uncond = {k: torch.cat([p.uncond[k] for p in parts]) for k in keys}
        return Conditioning(cond, uncond)
