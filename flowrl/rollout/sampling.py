"""Plain ODE sampling (evaluation, ``flowrl sample``, explore's preview) and plans outside the trainer.

:func:`ode_batches` (and :func:`ode_sample`, its batches concatenated) keeps no forest: its Euler steps are the
stepping engine's for states outside a forest
(:func:`flowrl.rollout.base.euler_ode`, the same update and chunked forward as every rollout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from flowrl.rollout.base import RolloutContext, euler_ode

if TYPE_CHECKING:
    from flowrl.models.base import FlowModel
    from flowrl.rollout.forest import Forest


@torch.no_grad()
def ode_batches(
    model: "FlowModel",
    prompts: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    guidance: float | None = None,
    max_batch: int = 64,
    decode: bool = True,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, images)`` per batch of at most ``max_batch`` prompts, in order: images [b, 3, H, W] in [0, 1] (or
    clean latents with ``decode=False``) of ``prompts[start:start + b]``, each from ``model.noise([seeds[i]])``
    with ``steps`` Euler steps of the ODE at CFG ``guidance``, encoded, solved and decoded on its own, on the CPU.
    The one place prompts are cut into batches: a caller writes or scores each batch as it comes."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    guidance = model.guidance_or_default(guidance)
    sigmas = model.schedule(steps).float().cpu()
    for start in range(0, len(prompts), max_batch):
        batch_prompts = list(prompts[start : start + max_batch])
        x = euler_ode(
            model,
            model.noise(list(seeds[start : start + max_batch])),
            sigmas,
            model.encode(batch_prompts, guidance),
            guidance,
            max_batch,
        )
        yield start, (model.decode(x).cpu() if decode else x.cpu())


def ode_sample(
    model: "FlowModel",
    prompts: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    guidance: float | None = None,
    max_batch: int = 64,
    decode: bool = True,
) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] (or clean latents with ``decode=False``) for ``prompts[i]`` from
    ``model.noise([seeds[i]])``: every batch of :func:`ode_batches`, concatenated."""
    return torch.cat([images for _, images in ode_batches(model, prompts, seeds, steps, guidance, max_batch, decode)])


@dataclass
class SampleOutput:
    """Result of :func:`sample_with_plan`: ``images`` [L, 3, H, W] in [0, 1], one per leaf of
    ``forest`` in ``forest.leaves()`` order, and the forest with per-edge log-probs and stds."""

    images: torch.Tensor
    forest: "Forest"


@torch.no_grad()
def sample_with_plan(
    model: "FlowModel",
    prompts: Sequence[str],
    plan,
    seed: int = 0,
    iteration: int = 0,
    guidance: float | None = None,
    max_batch: int = 64,
    reward=None,
    reduction: str = "mean",
) -> SampleOutput:
    """Run a rollout plan (chains, tree, explore) outside the trainer: SDE sampling with log-probs.

    The plan is set up with ``model`` and ``reward`` first (a plan that scores candidates, as an
    explore plan does, needs the reward). ``reduction``: how edge log-probs are reduced (``mean`` | ``sum``)."""
    from flowrl.rollout.decoding import decode

    plan.setup(model, reward)
    forest = plan.rollout(
        model,
        list(prompts),
        RolloutContext(seed=seed, iteration=iteration, guidance=guidance, max_batch=max_batch, reduction=reduction),
    )
    return SampleOutput(decode(model, forest.all_latents()[forest.leaves()], max_batch), forest)
