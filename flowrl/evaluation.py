"""Held-out evaluation with ODE sampling, and PNG sample grids."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from flowrl.models.base import FlowModel
from flowrl.rollout.sampling import ode_sample
from flowrl.rollout.seeding import derive_seed


def eval_seeds(seed: int, n: int) -> list[int]:
    """Fixed per-image seeds of an evaluation (the same at every eval, so grids compare)."""
    return [derive_seed(seed, "eval", i) for i in range(n)]


@torch.no_grad()
def evaluate(model: FlowModel, prompts: Sequence[str], reward, *, steps: int, guidance: float | None, seed: int,
             max_batch: int = 64, keep_images: int = 0) -> tuple[dict[str, float], torch.Tensor]:
    """Mean of each reward term (``eval/<name>_mean``), per-task breakdowns of rewards that offer
    ``evaluate(images, prompts)``, and the first ``keep_images`` images [K, 3, H, W]."""
    images = ode_sample(model, prompts, eval_seeds(seed, len(prompts)), steps, guidance, max_batch)
    metrics: dict[str, float] = {}
    for name, scores in reward.components(images, list(prompts), {}).items():
        metrics[f"eval/{name}_mean"] = float(scores.mean())
    for term in reward.rewards:
        if hasattr(term, "evaluate"):
            for k, v in term.evaluate(images, list(prompts)).items():
                if isinstance(v, (int, float)):
                    metrics[f"eval/{term.name}/{k}"] = float(v)
    return metrics, images[:keep_images]


def save_grid(images: torch.Tensor, path: Path, nrow: int | None = None, scale: int = 1) -> None:
    """Write images [N, 3, H, W] in [0, 1] as one PNG grid (``scale``× nearest upsampling)."""
    from PIL import Image

    n, _, h, w = images.shape
    nrow = nrow or max(1, int(round(n ** 0.5)))
    ncol = (n + nrow - 1) // nrow
    pad = 2
    grid = torch.ones(3, ncol * (h + pad) + pad, nrow * (w + pad) + pad) * 0.5
    for i in range(n):
        r, c = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = images[i].clamp(0, 1)
    array = (grid.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    img = Image.fromarray(array)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
