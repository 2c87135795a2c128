"""GRPO-Guard (Wang et al. 2025, arXiv 2510.22319): the clipped objective with the SDE importance ratio normalised per
denoising step and each step's gradient re-weighted (docs/algorithms.md, "GRPO-Guard").

Why: an edge's log-ratio under a Gaussian kernel N(μ, s²) with the rollout's draw x' = μ_old + s·ξ is
log r = red(ξ ⊙ Δμ)/s − red(Δμ²)/(2s²), Δμ = μ_θ − μ_old (``red``: the forest's reduction over latent elements,
a mean by default). The second term biases it below 0 and both scale with 1/s, which differs by step: the clip band
[1 − ε, 1 + ε] is rarely reached by positive-advantage edges and means something else at every step. GRPO-Guard's
RatioNorm drops the bias and the scale, log r̃ = s·log r + red(Δμ²)/(2s) = red(ξ ⊙ Δμ) (the published code's form), and
its gradient re-weighting multiplies each edge's clipped term by δ = 1/|dt| (the paper's flow-matching δ_t; Δμ ∝ dt·Δv,
so the step's gradient no longer scales with its width).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from flowrl.core.choices import choice
from flowrl.objectives.base import Batch, ObjectiveFacts
from flowrl.objectives.copies import OldPolicy
from flowrl.objectives.policy import PolicyLoss
from flowrl.objectives.replay import replay

REWEIGHTS = ("dt", "none")  # GRPO-Guard's per-step gradient weight δ


@dataclass
class GRPOGuardLoss(PolicyLoss):
    """GRPO-Guard (arXiv 2510.22319; docs/algorithms.md, "GRPO-Guard"): :class:`PolicyLoss` with the normalised ratio.

    Per trained edge e (child x', recorded std s, rollout mean μ_old, current mean μ_θ, ξ = (x' − μ_old)/s):
    log r̃_e = red(ξ ⊙ (μ_θ − μ_old)) [E], and
    L = mean_e w_e·δ_e·max(−A_e·r̃_e, −A_e·clip(r̃_e, 1−ε_low, 1+ε_high)) + β·mean_e w_e·KL_e
    with δ_e = 1/|σ_child − σ_parent| (``reweight: dt``, the paper and verl-omni) or 1 (``reweight: none``,
    Flow-Factory's
    ``grpo-guard`` trainer). The KL term is the clipped objective's, not re-weighted. At the rollout's weights r̃ = 1
    exactly (Δμ = 0), so the first micro-batches' ``abs_delta_logp`` (here: |log r̃|) stays 0; ``raw_delta_logp`` logs
    the
    mean of the unnormalised log r (the bias the paper measures).

    μ_old: the forest records no transition mean, so the objective keeps the rollout's weights (an
    :class:`~flowrl.objectives.copies.OldPolicy`: a second LoRA adapter, or a frozen copy under full fine-tuning), set
    to
    the policy at :meth:`begin_iteration` (the weights are still the rollout's then). Until the iteration's first
    optimizer step the policy *is* that
    copy and μ_old is the replay's own mean, detached (no extra forward); after it (``train.updates_per_epoch`` or
    ``train.inner_epochs`` > 1) each micro-batch runs one more forward without gradients under the copy. The decision
    depends only on the optimizer steps taken, the same on every process, so sharded forwards stay in step.

    A subclass, not an option of the clipped objective: it adds a copy of the weights, a forward and its own ratio, and
    the rule of this package is that no existing objective file grows by more than its registration; as its own class
    (``loss.objective: grpo_guard``) it adds only ``reweight`` and keeps every key of ``clipped``.
    """

    reweight: str = choice("dt", REWEIGHTS)  # each edge's clipped term times δ: dt (δ = 1/|σ_child − σ_parent|, the
    # paper's and verl-omni's) | none (δ = 1: the ratio normalisation only, Flow-Factory's trainer)

    state_attributes: ClassVar[tuple[str, ...]] = ("_steps",)  # optimizer steps since the rollout's weights were kept
    _rollout_weights = None  # the rollout's weights (an OldPolicy), from setup()

    def setup(self, model) -> None:
        super().setup(model)
        self._rollout_weights = OldPolicy(model)
        self._steps = 0

    def begin_iteration(self, model, forest) -> None:
        """Keep the rollout's weights (still the policy's): μ_old of this iteration's edges."""
        self._rollout_weights.copy_from_policy()
        self._steps = 0

    def after_update(self, model) -> None:
        self._steps += 1

    def describe(self) -> ObjectiveFacts:
        """The reference for the KL (``kl_ref`` > 0), then the rollout's weights (``old``), in the order a replay runs
        them."""
        facts = super().describe()
        return replace(facts, frozen_copies=facts.frozen_copies + ("old",))

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Replay the batch's edges (with the reference for β > 0), get μ_old, then :meth:`guarded` on plain tensors."""
        b = batch.index
        reference = self._reference
        if self._rollout_weights is None or (self.needs_reference and reference is None):
            raise RuntimeError("GRPOGuardLoss needs setup(model) first (the rollout's weights and the KL reference)")
        out = replay(
            model,
            forest,
            cond,
            b,
            kl_form=self.kl_form if self.needs_reference else None,
            reference=reference.active if reference is not None else None,
            cfg_gradient=self.cfg_gradient,
        )
        if self._steps == 0:
            mean_old = out.mean.detach()
        else:
            with torch.no_grad(), self._rollout_weights.active():
                mean_old = replay(model, forest, cond, b).mean
        device = out.mean.device
        dt = (forest.sigma[b] - forest.sigma[forest.parent[b]]).to(device)
        return self.guarded(
            out.mean,
            mean_old,
            forest.all_latents()[b].to(device),
            out.std,
            dt,
            forest.advantage[b].to(device),
            out.kl,
            forest.weight[b].to(device),
            forest.logp_old[b].to(device),
            out.logp,
            forest.reduction,
        )

    def normalised_log_ratio(
        self,
        mean: torch.Tensor,
        mean_old: torch.Tensor,
        x_next: torch.Tensor,
        std: torch.Tensor,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """log r̃ [E] = red(ξ ⊙ (μ_θ − μ_old)), ξ = (x' − μ_old)/s, from the transition means and child states
        [E, ...] and the stds [E]."""
        s = std.float().clamp(min=torch.finfo(torch.float32).tiny).view(-1, *[1] * (mean.ndim - 1))
        xi = (x_next.float() - mean_old.float()) / s
        prod = xi * (mean.float() - mean_old.float())
        dims = tuple(range(1, mean.ndim))
        return prod.mean(dim=dims) if reduction == "mean" else prod.sum(dim=dims)

    def step_weight(self, dt: torch.Tensor) -> torch.Tensor:
        """δ [E] from each edge's dt = σ_child − σ_parent [E]: 1/|dt| (``reweight: dt``) or 1."""
        return 1.0 / dt.float().abs() if self.reweight == "dt" else torch.ones_like(dt, dtype=torch.float32)

    def guarded(
        self,
        mean: torch.Tensor,
        mean_old: torch.Tensor,
        x_next: torch.Tensor,
        std: torch.Tensor,
        dt: torch.Tensor,
        advantage: torch.Tensor,
        kl: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        logp_old: torch.Tensor | None = None,
        logp: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (scalar) and detached diagnostics for edges [E]: transition means ``mean`` (with grad) and ``mean_old``
        and child states ``x_next`` [E, ...]; ``std``, ``dt``, ``advantage``, optional ``kl``, ``weight`` [E]; the raw
        ``logp``/``logp_old`` [E] only for the ``raw_delta_logp`` diagnostic."""
        log_ratio = self.normalised_log_ratio(mean, mean_old, x_next, std, reduction)
        w = torch.ones_like(log_ratio) if weight is None else weight.float()
        # the clipped objective's math with r = r̃ (log-ratio against 0) and weights w·δ; its KL term is added below
        loss, diag = PolicyLoss.__call__(
            self, log_ratio, torch.zeros_like(log_ratio), advantage, None, w * self.step_weight(dt)
        )
        kl_mean = torch.zeros((), device=log_ratio.device)
        if kl is not None:
            kl_mean = (w * kl.float()).mean()
            loss = loss + self.kl_ref * kl_mean
        diag["kl"] = kl_mean.detach()
        if logp is not None and logp_old is not None:
            diag["raw_delta_logp"] = (logp.detach().float() - logp_old.float()).mean()
        return loss, diag
