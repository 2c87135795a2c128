"""Forward-process objectives: DiffusionNFT and Advantage Weighted Matching (ALGORITHMS.md §11, §12).

Both train on the clean latents x0 of the forest's leaves, whatever sampler made them (an ODE plan,
chains, a tree, explore): no log-probs, no replay. Per leaf and iteration, D draws (t, ε) give the
forward-process point x_t = (1−t)·x0 + t·ε and the flow-matching target y = ε − x0 (the velocity the
model predicts at noise level σ = t). Each leaf carries its group advantage A (written by the credit
rule; 0 where the rule skipped it, e.g. a group without reward spread) and is trained unless its reward
failed (NaN).

Draws are addressed, never taken from a global RNG: ε by (run seed, iteration, root seed of the leaf,
its index within its prompt group, draw), t the same way or, with ``share_t``, by (run seed, iteration,
prompt, draw) so a group shares its timesteps. Any process layout and a resume draw the same numbers.

``cfg``: ``free`` (the published DiffusionNFT mode): rollouts at guidance 1 and the conditional velocity
is the policy, trained alone (no unconditional forward); ``guided``: rollouts at the model's guidance and
the guided velocity v_u + g·(v_c − v_u) is the policy.

Both keep an old policy (:class:`~flowrl.policy_copies.OldPolicy`): θ_old ← d_k·θ_old + (1−d_k)·θ after
optimizer step k, d_k = ``old_decay``·min(1, k/``old_decay_warmup``) (constant without warm-up; a
LoRA policy's old copy is a second adapter on the same base). ``kl_ref`` > 0 adds
``kl_ref``·mean‖v_θ − v_ref‖² towards the initial policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.objective import Batch, Objective
from flowrl.policy_copies import OldPolicy, Reference
from flowrl.rollout.seeding import derive_seed, seeded_normal

CFG_MODES = ("free", "guided")
TIMESTEPS = ("logit_normal", "uniform")


@dataclass
class ForwardProcessObjective(Objective):
    """What DiffusionNFT and AWM share: the leaves' micro-batches, (t, ε) draws, the old copy, CFG modes.

    ``draws``: (t, ε) pairs per leaf and iteration [2]. ``timesteps``: ``logit_normal`` (t = sigmoid(N(
    ``logit_mean``, ``logit_std``²))) or ``uniform``, mapped into ``t_range`` = [lo, hi]. ``batch_size``:
    rows (leaf × draw) per forward. ``adv_clip``: |A| bound.
    """

    draws: int = 2
    timesteps: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    t_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    share_t: bool = False
    cfg: str = "free"
    batch_size: int = 64
    adv_clip: float = 5.0
    old_decay: float = 0.9
    old_decay_warmup: int = 0
    kl_ref: float = 0.0

    trains_on = "leaves"

    def __post_init__(self) -> None:
        if self.cfg not in CFG_MODES:
            raise ValueError(f"loss.cfg={self.cfg!r} is not supported; accepted: {list(CFG_MODES)}")
        if self.timesteps not in TIMESTEPS:
            raise ValueError(f"loss.timesteps={self.timesteps!r} is not supported; accepted: {list(TIMESTEPS)}")
        if self.draws < 1:
            raise ValueError(f"loss.draws={self.draws} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"loss.batch_size={self.batch_size} must be >= 1")
        if len(self.t_range) != 2 or not 0.0 <= self.t_range[0] < self.t_range[1] <= 1.0:
            raise ValueError(f"loss.t_range={list(self.t_range)} must be [lo, hi] with 0 <= lo < hi <= 1")
        if self.logit_std <= 0:
            raise ValueError(f"loss.logit_std={self.logit_std} must be > 0")
        if not 0.0 <= self.old_decay < 1.0:
            raise ValueError(f"loss.old_decay={self.old_decay} must be in [0, 1) (the old policy's EMA decay per "
                             "optimizer step; 0 = the policy that sampled the iteration)")
        if self.old_decay_warmup < 0:
            raise ValueError(f"loss.old_decay_warmup={self.old_decay_warmup} must be >= 0")
        if self.adv_clip <= 0:
            raise ValueError(f"loss.adv_clip={self.adv_clip} must be > 0")
        if self.kl_ref < 0:
            raise ValueError(f"loss.kl_ref={self.kl_ref} must be >= 0")

    # ---- configuration and lifecycle ---------------------------------------------------------
    def rollout_guidance(self, guidance: float | None) -> float | None:
        if self.cfg == "guided":
            return guidance
        if guidance is not None and float(guidance) != 1.0:
            from flowrl.errors import ConfigError

            raise ConfigError(f"loss.cfg='free' samples and trains the conditional velocity (guidance 1), but "
                              f"model.guidance={guidance}; unset model.guidance (or set 1), or use loss.cfg='guided'")
        return 1.0

    def setup(self, model) -> None:
        self._old = OldPolicy(model)
        self._reference = Reference(model) if self.kl_ref > 0 else None
        self._updates = 0

    def decay(self, k: int) -> float:
        """The old policy's decay d_k after optimizer step k (1-based)."""
        if self.old_decay_warmup <= 0:
            return self.old_decay
        return self.old_decay * min(1.0, k / self.old_decay_warmup)

    def after_update(self, model) -> None:
        self._updates += 1
        self._old.update(self.decay(self._updates))

    def state_dict(self) -> dict:
        return {"old": self._old.state_dict(), "updates": self._updates}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self._old.load_state_dict(state["old"])
            self._updates = int(state["updates"])

    # ---- batches ----------------------------------------------------------------------------
    def draw_t(self, seeds: list[int]) -> torch.Tensor:
        """Timesteps [len(seeds)] in ``t_range``, one per seed."""
        u = torch.stack([torch.rand((), generator=torch.Generator().manual_seed(s)) if self.timesteps == "uniform"
                         else torch.sigmoid(self.logit_mean + self.logit_std *
                                            torch.randn((), generator=torch.Generator().manual_seed(s)))
                         for s in seeds])
        lo, hi = self.t_range
        return (lo + (hi - lo) * u).clamp(1e-4, 1.0 - 1e-4).float()

    def batches(self, forest, iteration: int = 0, seed: int = 0) -> list[Batch]:
        """Micro-batches of leaves (``batch_size`` // ``draws`` each) with their draws: ``t`` [B·D] and
        ``noise`` [B·D, C, H, W], leaf-major. Leaves must be clean (σ = 0); failed rewards are left out."""
        leaves = forest.leaves()
        if leaves.numel() and bool((forest.sigma[leaves] > 0).any()):
            raise ValueError("forward-process objectives train on clean latents, but some leaves of this forest "
                             "are not at sigma 0: the plan must sample to the end")
        leaves = leaves[torch.isfinite(forest.reward[leaves])]
        if leaves.numel() == 0:
            return []
        group = forest.group[leaves]
        within = torch.zeros_like(leaves)  # index of each leaf within its prompt group (layout-free address)
        for g in torch.unique(group):
            mine = group == g
            within[mine] = torch.arange(int(mine.sum()))
        shape = tuple(forest.all_latents().shape[1:])
        D = self.draws
        t_seeds, eps_seeds = [], []
        for n, k in zip(leaves.tolist(), within.tolist()):
            root, prompt = int(forest.seed[n]), forest.prompts[int(forest.group[n])]
            for d in range(D):
                t_seeds.append(derive_seed(seed, iteration, "fp_t", prompt, d) if self.share_t
                               else derive_seed(seed, iteration, "fp_t", root, k, d))
                eps_seeds.append(derive_seed(seed, iteration, "fp_eps", root, k, d))
        t = self.draw_t(t_seeds)
        per = max(1, self.batch_size // D)
        out = []
        for a in range(0, leaves.numel(), per):
            rows = slice(a * D, min(a + per, leaves.numel()) * D)
            noise = torch.stack([seeded_normal(s, shape) for s in eps_seeds[rows]])
            out.append(Batch(leaves[a:a + per], int(leaves[a:a + per].numel()), {"t": t[rows], "noise": noise}))
        return out

    # ---- the shared forward --------------------------------------------------------------------
    def forward_rows(self, model, forest, batch: Batch, cond, with_old: bool = True):
        """Per row (leaf × draw, leaf-major): v_θ (with grad), v_old (no grad; None unless ``with_old``),
        v_ref (None unless ``kl_ref`` > 0), the target y = ε − x0 and t; plus the leaves' advantages [B]."""
        device = model.device
        D = self.draws
        leaves = batch.index
        x0 = forest.all_latents()[leaves].to(device).repeat_interleave(D, dim=0)
        t = batch.extra["t"].to(device)
        eps = batch.extra["noise"].to(device)
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - tb) * x0 + tb * eps
        target = eps - x0
        rows_cond = cond.select(forest.group[leaves].repeat_interleave(D))
        g = forest.guidance
        v_old = v_ref = None
        if with_old:
            with torch.no_grad(), self._old.active():
                v_old = model.velocity(x_t, t, rows_cond, g).float()
        if self._reference is not None:
            with torch.no_grad(), self._reference.active():
                v_ref = model.velocity(x_t, t, rows_cond, g).float()
        v = model.velocity(x_t, t, rows_cond, g).float()
        adv = forest.advantage[leaves].float().to(device).clamp(-self.adv_clip, self.adv_clip)
        return v, v_old, v_ref, target, t, adv

    def per_leaf(self, rows: torch.Tensor) -> torch.Tensor:
        """Mean over each leaf's D draws: [B·D] → [B]."""
        return rows.view(-1, self.draws).mean(dim=1)

    def kl_ref_rows(self, v: torch.Tensor, v_ref: torch.Tensor | None) -> torch.Tensor | None:
        return None if v_ref is None else _row_mean((v - v_ref) ** 2)


def _row_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over all non-batch elements: [R, ...] → [R]."""
    return x.mean(dim=tuple(range(1, x.ndim)))


@dataclass
class NFTLoss(ForwardProcessObjective):
    """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; ALGORITHMS.md §11).

    Optimality probability per leaf r = ½ + ½·clip(A/``adv_scale``, −1, 1) ∈ [0, 1]. Implicit policies
    from the old copy and ``beta`` β: v⁺ = (1−β)·v_old + β·v_θ, v⁻ = (1+β)·v_old − β·v_θ. Per row:
    L = r·‖v⁺ − y‖² + (1−r)·‖v⁻ − y‖² (means over latent elements), averaged over a leaf's draws, then
    over leaves. The per-row optimum is v_θ* = v_old + (2r − 1)/β·(y − v_old): towards the sample when
    r > ½, away when r < ½, the old policy at r = ½ (flat groups pull the policy towards the old copy).
    ``adaptive_weight``: the errors in x0 space (x̂0 = x_t − t·v, so ‖x̂0 − x0‖² = t²·‖v − y‖²), each row
    divided by sg(mean|x̂0_θ − x0|) **(ours where the paper is terse)**.
    """

    beta: float = 1.0
    adv_scale: float = 2.0
    adaptive_weight: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"loss.beta={self.beta} must be > 0 (DiffusionNFT's implicit-policy step)")
        if self.adv_scale <= 0:
            raise ValueError(f"loss.adv_scale={self.adv_scale} must be > 0")

    def optimality(self, adv: torch.Tensor) -> torch.Tensor:
        """r = ½ + ½·clip(A/adv_scale, −1, 1) [B]."""
        return 0.5 + 0.5 * (adv / self.adv_scale).clamp(-1.0, 1.0)

    def row_loss(self, v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, t: torch.Tensor,
                 r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss [R], positive error [R], negative error [R]) for rows of v, v_old, target [R, ...], t [R], r [R]."""
        b = self.beta
        v_pos = (1.0 - b) * v_old + b * v
        v_neg = (1.0 + b) * v_old - b * v
        err_pos, err_neg = _row_mean((v_pos - target) ** 2), _row_mean((v_neg - target) ** 2)
        if self.adaptive_weight:
            scale = (t * _row_mean((v - target).abs())).detach().clamp(min=1e-5)
            err_pos, err_neg = err_pos * t * t / scale, err_neg * t * t / scale
        return r * err_pos + (1.0 - r) * err_neg, err_pos, err_neg

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v, v_old, v_ref, target, t, adv = self.forward_rows(model, forest, batch, cond)
        r = self.optimality(adv).repeat_interleave(self.draws)
        rows, err_pos, err_neg = self.row_loss(v, v_old, target, t, r)
        kl = self.kl_ref_rows(v, v_ref)
        if kl is not None:
            rows = rows + self.kl_ref * kl
        loss = self.per_leaf(rows).mean()
        with torch.no_grad():
            diag = {"nft_loss": loss.detach(), "optimality_mean": r.mean(), "nft_err_pos": err_pos.mean(),
                    "nft_err_neg": err_neg.mean(), "fm_error": _row_mean((v - target) ** 2).mean(),
                    "old_drift": _row_mean((v - v_old) ** 2).mean()}
            if kl is not None:
                diag["kl_ref"] = kl.mean()
        return loss, diag


@dataclass
class AWMLoss(ForwardProcessObjective):
    """Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; ALGORITHMS.md §12).

    Per leaf: the flow-matching error L_θ = mean over its draws of ‖v_θ − y‖² (and L_old under the old copy),
    the ratio ρ = exp(L_old − L_θ) and the clipped objective max(−A·ρ, −A·clip(ρ, 1−``clip``, 1+``clip``)),
    plus ``kl_old``·mean‖v_θ − v_old‖² (velocity space) and ``kl_ref``·mean‖v_θ − v_ref‖². Timesteps are shared
    by the group (``share_t``) so its samples' errors compare at the same noise levels. With ``old_decay`` 0
    the old copy is the policy that sampled the iteration (PPO's old policy; ρ = 1 at its first step); then
    with one step per iteration neither the clip nor the KL binds, and measured on the shapes model
    (lr 3e-4, full fine-tuning) the flow-matching error of the policy grew from 0.16 to 24 within 50
    iterations (pushing errors up on poor samples is unbounded). The defaults keep a lagging copy (EMA 0.9)
    and ``kl_old`` 1.0: the error stayed at 0.13–0.17 over 40 iterations.
    """

    share_t: bool = True
    clip: float = 0.2
    kl_old: float = 1.0
    old_decay: float = 0.9

    extremes = {"ratio_min": min, "ratio_max": max}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip <= 0:
            raise ValueError(f"loss.clip={self.clip} must be > 0")
        if self.kl_old < 0:
            raise ValueError(f"loss.kl_old={self.kl_old} must be >= 0")

    def clipped(self, err: torch.Tensor, err_old: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-leaf clipped objective [B] and ratio ρ = exp(L_old − L_θ) [B] from errors L_θ [B] (with grad),
        L_old [B] and advantages A [B]."""
        ratio = torch.exp(err_old - err)
        clipped = ratio.clamp(1.0 - self.clip, 1.0 + self.clip)
        return torch.maximum(-adv * ratio, -adv * clipped), ratio

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v, v_old, v_ref, target, t, adv = self.forward_rows(model, forest, batch, cond)
        err = self.per_leaf(_row_mean((v - target) ** 2))
        err_old = self.per_leaf(_row_mean((v_old - target) ** 2))
        policy, ratio = self.clipped(err, err_old, adv)
        drift = self.per_leaf(_row_mean((v - v_old) ** 2))
        per_leaf = policy + self.kl_old * drift
        kl = self.kl_ref_rows(v, v_ref)
        if kl is not None:
            per_leaf = per_leaf + self.kl_ref * self.per_leaf(kl)
        loss = per_leaf.mean()
        with torch.no_grad():
            r = ratio.detach()
            diag = {"awm_policy_loss": policy.mean(), "fm_error": err.mean(), "old_drift": drift.mean(),
                    "ratio_mean": r.mean(), "ratio_min": r.min(), "ratio_max": r.max(),
                    "clipfrac": ((r < 1.0 - self.clip) | (r > 1.0 + self.clip)).float().mean()}
            if kl is not None:
                diag["kl_ref"] = kl.mean()
        return loss, diag
