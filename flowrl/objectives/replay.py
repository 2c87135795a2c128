"""Recompute trainable edges' log-probs with the current weights (the training forward).

Replay equals rollout: the same ``model.velocity`` call on the same parent states, in the same
batch layout (edges are replayed per rollout forward, ``forest.batch``), then the same kernel
formula. With unchanged weights the ratio is exactly 1 on CPU fp32 (invariant 1, tested).
Several edges may share a parent (trees): its velocity is computed once. With CFG, ``cfg_gradient`` decides which
branches the gradient of the replayed velocity flows through (:meth:`FlowModel.cfg_gradient`); the values, hence
the log-probs and ratios, are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.models.base import Conditioning, FlowModel
from flowrl.rollout import sde
from flowrl.rollout.forest import Forest
from flowrl.rollout.transfer import to_device


def replay_batches(forest: Forest, edges: torch.Tensor) -> list[torch.Tensor]:
    """Split trainable edge indices [E] into micro-batches, one per rollout forward, in rollout order."""
    if edges.numel() == 0:
        return []
    batch_ids = forest.batch[edges]
    order = torch.argsort(batch_ids, stable=True)  # by forward, node order kept within one
    _, counts = torch.unique_consecutive(batch_ids[order], return_counts=True)
    return list(torch.split(edges[order], counts.tolist()))


@dataclass
class ReplayOut:
    """Per edge [E]: new log-prob (with grad), its transition mean [E, ...] and std [E]."""

    logp: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    kl: torch.Tensor | None = None


def replay(
    model: FlowModel,
    forest: Forest,
    cond: Conditioning,
    edges: torch.Tensor,
    reduction: str | None = None,
    kl_form: str | None = None,
    reference=None,
    cfg_gradient: str = "both",
) -> ReplayOut:
    """Log-probs of ``edges`` [E] (child node indices, one kernel) under the model's current weights,
    reduced as the rollout reduced them (``forest.reduction``; ``reduction`` must agree if given).

    ``cond``: one row per prompt group of the forest. With ``kl_form`` set, also the KL [E] to the
    reference policy (``reference()`` context, default ``model.reference``), computed without gradient
    for the reference branch. ``cfg_gradient`` (``loss.cfg_gradient``): with CFG, ``cond`` sends the gradient through
    the conditional branch only (Flow-GRPO's ``train_sd3.py``), ``both`` through both (the model's own composition).
    """
    if reduction is not None and reduction != forest.reduction:
        raise ValueError(
            f"replay with reduction={reduction!r} of a forest whose log-probs were reduced by "
            f"{forest.reduction!r}: the ratio would not be 1 at unchanged weights"
        )
    reduction = forest.reduction
    kernels = forest.kernel[edges].unique()
    if kernels.numel() != 1:
        raise ValueError("a replay batch must hold edges of one kernel")
    kernel = forest.kernels[int(kernels[0])]
    latents = forest.all_latents()
    parents = forest.parent[edges]
    unique_parents, position = torch.unique_consecutive(parents, return_inverse=True)
    if unique_parents.numel() != torch.unique(parents).numel():
        raise ValueError("edges sharing a parent must be adjacent in a replay batch")
    device = model.device
    rows = to_device(torch.cat([unique_parents, edges]), latents.device)  # one index copy; host columns below
    x_parent = latents[rows[: unique_parents.numel()]].to(device)
    x_edges = latents[rows[unique_parents.numel() :]].to(device)
    sigma_parent = to_device(forest.sigma[unique_parents], device)
    group_cond = cond.select(to_device(forest.group[unique_parents], device))
    # the rollout's transition std, as recorded: it does not depend on the weights, and a plan may have
    # widened it (BranchGRPO's independent_scaled split noise evaluates its log-prob at s·std)
    recorded_std = to_device(forest.std[edges], device)
    position = to_device(position, device)
    sigma_from, sigma_to = to_device(forest.sigma[parents], device), to_device(forest.sigma[edges], device)
    eta = to_device(forest.eta[edges], device)

    def transition(v_parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = v_parent[position]
        x = x_parent[position]
        _, mean, _ = sde.step(kernel, x, v, sigma_from, sigma_to, eta)
        return mean, recorded_std

    with model.cfg_gradient(cfg_gradient):
        v = model.velocity(x_parent, sigma_parent, group_cond, forest.guidance)
    mean, std = transition(v)
    logp = sde.log_prob(x_edges, mean, std, reduction)
    kl = None
    if kl_form is not None:
        with torch.no_grad(), (reference or model.reference)():
            mean_ref, _ = transition(model.velocity(x_parent, sigma_parent, group_cond, forest.guidance))
        dt = sigma_to - sigma_from
        kl = sde.kl(mean, mean_ref, std, kl_form, dt)
    return ReplayOut(logp, mean, std, kl)
