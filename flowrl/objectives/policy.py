"""Policy objectives: the clipped ratio over replayed edges (docs/algorithms.md, "The clipped objective") and
LayerTuning (docs/trees.md, "Dynamic-TreeRPO's loss").

For each trained edge e: r_e = exp(logp_θ(e) − logp_old(e)), A_e clipped to ±adv_clip,
L = mean_e max(−A_e·r_e, −A_e·clip(r_e, 1−ε_low, 1+ε_high)) + β·mean_e KL_e.
Edge weights w_e (default 1) multiply each edge's term. The mean is over the edges handed in;
the trainer scales micro-batches so an update averages over all its trained edges.

A policy objective trains the forest's stochastic edges (:class:`~flowrl.objectives.base.Objective` with
``trains_on = "edges"``): its micro-batches are the rollout's forwards
(:func:`~flowrl.objectives.replay.replay_batches`),
and :meth:`PolicyLoss.loss` replays them (ratio exactly 1 at unchanged weights) and, with β > 0, runs the
reference forward for the KL term. :meth:`PolicyLoss.__call__` is the math on plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flowrl.core.choices import choice
from flowrl.models.base import CFG_GRADIENTS
from flowrl.objectives.base import Batch, Objective, ObjectiveFacts
from flowrl.objectives.copies import Reference
from flowrl.objectives.replay import replay, replay_batches
from flowrl.rollout import sde
from flowrl.rollout.transfer import to_device

__all__ = ["Objective", "PolicyLoss", "LayerTuningLoss"]


@dataclass
class PolicyLoss(Objective):
    """Clipped ratio objective with optional KL to the reference policy.

    ``clip_low``/``clip_high``: ε_low, ε_high (symmetric when equal). ``adv_clip``: |A| bound.
    ``kl_ref``: weight of the KL to the reference policy (0 = no reference forward; the same key as the
    forward-process objectives'). ``kl_form``: ``exact`` or ``flow_grpo``.
    ``reduction``: log-probs as the ``mean`` (Flow-GRPO) or ``sum`` over latent elements.
    ``adaptive_kappa``: None, or κ for reward-conditioned clip bounds (docs/trees.md, "Dynamic-TreeRPO's loss").
    ``offpolicy_cap``: C, the unclipped branch's importance weight truncated at min(r, C); ``offpolicy_reject``: None
    or [low, high], edges whose ratio leaves the band get weight 0 (the rollout correction of docs/pipeline.md: the
    ratio is against the log-probs the rollout recorded, which with ``train.pipeline=async`` came from older weights).
    ``cfg_gradient``: with CFG rollouts, the replay's gradient through the conditional branch only (``cond``,
    Flow-GRPO's ``train_sd3.py``) or through both (``both``); docs/algorithms.md, "Training through CFG".
    """

    clip_low: float = 1e-4
    clip_high: float = 1e-4
    adv_clip: float = 5.0
    kl_ref: float = 0.04
    kl_form: str = choice("exact", sde.KL_FORMS)
    reduction: str = choice("mean", sde.REDUCTIONS)
    adaptive_kappa: float | None = None
    offpolicy_cap: float = 2.0
    offpolicy_reject: list[float] | None = None
    cfg_gradient: str = choice("cond", CFG_GRADIENTS)

    trains_on = "edges"
    extremes = {
        "ratio_min": min,
        "ratio_max": max,
        "abs_delta_logp": max,
        "offpolicy/ratio_min": min,
        "offpolicy/ratio_max": max,
    }
    first_step_keys = ("abs_delta_logp",)  # weights not yet updated: every ratio must be exactly 1
    progress_keys = {"kl": (("approx_kl",), ".1e"), "clip": (("clipfrac_high", "clipfrac_low"), ".2f")}
    _reference = None  # the KL reference (a Reference), from setup() when kl_ref > 0

    @property
    def needs_reference(self) -> bool:
        return self.kl_ref > 0

    def setup(self, model) -> None:
        self._reference = Reference(model) if self.needs_reference else None

    def setup_sampling(self, model, teacher_weights=None, draws_teacher: bool = False) -> None:
        """Nothing: sampling reads nothing of a policy objective (no teacher; the reference is the loss's)."""

    def batches(self, forest, iteration: int = 0, seed: int = 0, units: torch.Tensor | None = None) -> list[Batch]:
        """One micro-batch per rollout forward over the trainable edges (replay's layout)."""
        return [
            Batch(b, int(b.numel())) for b in replay_batches(forest, self.units(forest) if units is None else units)
        ]

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Replay the batch's edges under the current weights (and the reference for β > 0), then
        :meth:`__call__` on the plain tensors."""
        b = batch.index
        reference = self._reference
        if self.needs_reference and reference is None:
            raise RuntimeError("PolicyLoss with kl_ref > 0 needs setup(model) first (the KL reference)")
        out = replay(
            model,
            forest,
            cond,
            b,
            kl_form=self.kl_form if self.needs_reference else None,
            reference=reference.active if reference is not None else None,
            cfg_gradient=self.cfg_gradient,
        )
        host = to_device(torch.stack([forest.logp_old[b], forest.advantage[b], forest.weight[b]]), out.logp.device)
        return self(out.logp, host[0], host[1], out.kl, host[2])

    def __post_init__(self) -> None:
        if self.clip_low <= 0 or self.clip_high <= 0:
            raise ValueError(f"loss.clip_low={self.clip_low} and loss.clip_high={self.clip_high} must be > 0")
        if self.kl_ref < 0:
            raise ValueError(f"loss.kl_ref={self.kl_ref} must be >= 0")
        if self.adaptive_kappa is not None and self.adaptive_kappa < 0:
            raise ValueError(f"loss.adaptive_kappa={self.adaptive_kappa} must be >= 0 (or null: constant clip bounds)")
        if not self.offpolicy_cap > 1.0:
            raise ValueError(
                f"loss.offpolicy_cap={self.offpolicy_cap} must be > 1 (the truncated importance weight's cap)"
            )
        band = self.offpolicy_reject
        if band is not None and not (len(band) == 2 and 0 <= band[0] < 1 < band[1]):
            raise ValueError(
                f"loss.offpolicy_reject={band} must be [low, high] with 0 <= low < 1 < high (or null: no rejection)"
            )

    def describe(self) -> ObjectiveFacts:
        """The reference as a frozen copy, for the KL (``kl_ref`` > 0)."""
        return replace(super().describe(), frozen_copies=("reference",) if self.needs_reference else ())

    def unread_fields(self) -> dict[str, str]:
        """``kl_form`` without a KL to the reference (``kl_ref`` 0)."""
        return {"kl_form": "loss.kl_ref is 0: no KL to the reference is computed"} if self.kl_ref == 0 else {}

    def clip_bounds(self, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ε_low, ε_high per edge [E] (constant unless ``adaptive_kappa`` is set)."""
        low = torch.full_like(adv, self.clip_low)
        high = torch.full_like(adv, self.clip_high)
        if self.adaptive_kappa is not None:
            k = self.adaptive_kappa
            high = high * (1.0 + k * adv.clamp(min=0) / self.adv_clip)
            low = low * (1.0 + k * (-adv).clamp(min=0) / self.adv_clip)
        return low, high

    def __call__(
        self,
        logp: torch.Tensor,
        logp_old: torch.Tensor,
        advantage: torch.Tensor,
        kl: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (scalar) and detached diagnostics for edges [E]: ``logp`` (with grad), ``logp_old``,
        ``advantage``, optional ``kl`` [E] and ``weight`` [E]."""
        adv = advantage.float().clamp(-self.adv_clip, self.adv_clip)
        delta = logp.float() - logp_old.float()
        ratio = torch.exp(delta)
        low, high = self.clip_bounds(adv)
        clipped = torch.minimum(torch.maximum(ratio, 1.0 - low), 1.0 + high)
        r = ratio.detach()
        # rollout correction (docs/pipeline.md): the unclipped branch's importance weight truncated at the cap (its
        # gradient min(r, C)·∇log π; exactly r below the cap), and edges outside the rejection band left out
        truncated = torch.where(r > self.offpolicy_cap, ratio * (self.offpolicy_cap / r), ratio)
        per_edge = torch.maximum(-adv * truncated, -adv * clipped)
        w = torch.ones_like(per_edge) if weight is None else weight.float()
        kept = torch.ones_like(r, dtype=torch.bool)
        if self.offpolicy_reject is not None:
            kept = (r >= self.offpolicy_reject[0]) & (r <= self.offpolicy_reject[1])
            w = w * kept
        policy = (w * per_edge).mean()
        loss = policy
        kl_mean = torch.zeros((), device=logp.device)
        if kl is not None:
            kl_mean = (w * kl.float()).mean()
            loss = loss + self.kl_ref * kl_mean
        with torch.no_grad():
            d = delta.detach()
            r = ratio.detach()
            diag = {
                "policy_loss": policy.detach(),
                "kl": kl_mean.detach(),
                "approx_kl": 0.5 * (d * d).mean(),
                "clipfrac_high": (r > 1.0 + high).float().mean(),
                "clipfrac_low": (r < 1.0 - low).float().mean(),
                "ratio_mean": r.mean(),
                "ratio_min": r.min(),
                "ratio_max": r.max(),
                "abs_delta_logp": d.abs().max(),
                "offpolicy/ratio_mean": r.mean(),
                "offpolicy/ratio_min": r.min(),
                "offpolicy/ratio_max": r.max(),
                "offpolicy/truncated": (r > self.offpolicy_cap).float().mean(),
                "offpolicy/rejected": (~kept).float().mean(),
            }
        return loss, diag


@dataclass
class LayerTuningLoss(PolicyLoss):
    """The clipped objective plus Dynamic-TreeRPO's LayerTuning-RL term (docs/trees.md,
    "Dynamic-TreeRPO's loss"), once per optimizer step (:meth:`Objective.auxiliary`):

    λ·(1/(P·S))·Σ_g Σ_σ w_g·mean‖v_θ(x_σ, σ) − (ε − x0*_g)‖², over the P prompt groups of the forest and
    the S distinct σ at which its stochastic edges start (the tree layers), where x0*_g is the clean
    latent of group g's best leaf, x_σ = (1−σ)·x0*_g + σ·ε with fresh ε, and
    w_g = clamp((r*_g − mean_g)/(std_g + 1e-4), 0, 3)/3 (leaf rewards of the group, std ddof 0)
    **(ours)**. Groups with w_g = 0 run no forward. v_θ is the conditional velocity (guidance 1, as
    flow-matching training and DiffusionNFT regress it), whatever the rollout's guidance: regressing the
    CFG-composed velocity v_u + g·(v_c − v_u) onto the data's flow target ε − x0 drags both branches
    toward an unguided field and collapsed the shapes model at guidance 3 (held-out strict 0.569 → 0.004
    in 21 iterations; docs/results.md). ε is drawn from ``derive_seed(seed of the group's root,
    "layer_tuning", σ)``: no global RNG, the same draw for every process layout and on resume.

    ``layer_lambda``: λ [0.1]. ``micro_batch``: rows per forward — not a key of its own: the run's
    ``rollout.max_batch`` (:func:`flowrl.config.build.build_loss`); each chunk runs under activation
    checkpointing, so the term's memory does not grow with P·S (its backward recomputes one chunk at a
    time). Set ``adaptive_kappa`` (κ [1]) for Dynamic-TreeRPO's adaptive clip.
    """

    layer_lambda: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_lambda < 0:
            raise ValueError(f"loss.layer_lambda={self.layer_lambda} must be >= 0")

    def auxiliary(self, model, forest, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        from flowrl.core.seeding import derive_seed, seeded_normal

        if self.layer_lambda == 0:
            return None
        leaves = forest.leaves()
        edges = torch.nonzero((forest.parent >= 0) & forest.stochastic).flatten()
        sigmas = torch.unique(forest.sigma[forest.parent[edges]]).tolist()
        reward, group = forest.reward[leaves].double(), forest.group[leaves]
        P = len(forest.prompts)
        rows = []  # (group, best leaf, weight)
        for g in range(P):
            mine = (group == g) & torch.isfinite(reward)
            if int(mine.sum()) < 2:
                continue
            r = reward[mine]
            best = leaves[mine][int(torch.argmax(r))]
            w = float(((r.max() - r.mean()) / (r.std(unbiased=False) + 1e-4)).clamp(0.0, 3.0)) / 3.0
            if w > 0:
                rows.append((g, int(best), w))
        if not rows or not sigmas:
            return None
        device = model.device
        groups = torch.tensor([g for g, _, _ in rows for _ in sigmas])
        best = torch.tensor([b for _, b, _ in rows for _ in sigmas])
        weight = torch.tensor([w for _, _, w in rows for _ in sigmas], device=device)
        sigma = torch.tensor([s for _ in rows for s in sigmas], dtype=torch.float32)
        x0 = forest.all_latents()[best].to(device)
        root_seed = forest.seed[best].tolist()
        eps = torch.stack(
            [
                seeded_normal(derive_seed(seed, "layer_tuning", s), model.latent_shape)
                for seed, s in zip(root_seed, sigma.tolist())
            ]
        ).to(device)
        sig = sigma.to(device).view(-1, *[1] * (x0.ndim - 1))  # image or video latents
        x = (1.0 - sig) * x0 + sig * eps

        def squared_error(a: int, b: int) -> torch.Tensor:  # [b − a] rows of mean ‖v − (ε − x0)‖²
            v = model.velocity(x[a:b], sigma[a:b].to(device), cond.select(groups[a:b]), 1.0)
            return ((v.float() - (eps[a:b] - x0[a:b])) ** 2).mean(dim=tuple(range(1, x.ndim)))

        from torch.utils.checkpoint import checkpoint

        per_row = torch.cat(
            [
                checkpoint(squared_error, a, min(a + self.micro_batch, len(rows) * len(sigmas)), use_reentrant=False)
                for a in range(0, len(rows) * len(sigmas), self.micro_batch)
            ]
        )
        loss = self.layer_lambda * (weight * per_row).sum() / (P * len(sigmas))
        return loss, {
            "layer_tuning_loss": loss.detach(),
            "layer_tuning_weight": weight.mean().detach(),
            "layer_tuning_mse": per_row.detach().mean(),
        }
