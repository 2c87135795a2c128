"""Plain ODE sampling (evaluation, ``flowrl sample``, probes): Euler steps of the flow, no forest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from flowrl.models.base import FlowModel
    from flowrl.rollout.forest import Forest


@torch.no_grad()
def ode_sample(model: "FlowModel", prompts: Sequence[str], seeds: Sequence[int], steps: int,
               guidance: float | None = None, max_batch: int = 64, decode: bool = True) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] (or clean latents with ``decode=False``) for ``prompts[i]`` from
    ``model.noise([seeds[i]])`` with ``steps`` Euler steps of the ODE at CFG ``guidance``."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    guidance = model.guidance if guidance is None else float(guidance)
    sigmas = model.schedule(steps).float().cpu()
    outs = []
    for start in range(0, len(prompts), max_batch):
        batch_prompts = list(prompts[start:start + max_batch])
        x = model.noise(list(seeds[start:start + max_batch]))
        cond = model.encode(batch_prompts, guidance)
        for i in range(steps):
            sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
            v = model.velocity(x, torch.full((x.shape[0],), sigma, device=x.device), cond, guidance)
            x = x + v.float() * (sigma_next - sigma)
        outs.append(model.decode(x).cpu() if decode else x.cpu())
    return torch.cat(outs)


@dataclass
class SampleOutput:
    """Result of :func:`sample_with_plan`: ``images`` [L, 3, H, W] in [0, 1], one per leaf of
    ``forest`` in ``forest.leaves()`` order, and the forest with per-edge log-probs and stds."""

    images: torch.Tensor
    forest: "Forest"


@torch.no_grad()
def sample_with_plan(model: "FlowModel", prompts: Sequence[str], plan, seed: int = 0, iteration: int = 0,
                     guidance: float | None = None, max_batch: int = 64, reward=None,
                     reduction: str = "mean") -> SampleOutput:
    """Run a rollout plan (chains, tree, explore) outside the trainer: SDE sampling with log-probs.

    The plan is set up with ``model`` and ``reward`` first (a plan that scores candidates, as an
    explore plan does, needs the reward). ``reduction``: how edge log-probs are reduced (``mean`` | ``sum``)."""
    from flowrl.rollout.base import RolloutContext
    from flowrl.scoring import decode

    plan.setup(model, reward)
    forest = plan.rollout(model, list(prompts), RolloutContext(seed=seed, iteration=iteration, guidance=guidance,
                                                                max_batch=max_batch, reduction=reduction))
    return SampleOutput(decode(model, forest.all_latents()[forest.leaves()], max_batch), forest)
