"""GDRO: Group-level Direct Reward Optimization (Wang, Chen, Xu, Liu, Zhao 2026, arXiv 2601.02036; docs/algorithms.md,
"GDRO"): a forward-process objective (:mod:`flowrl.objectives.forward`) that ranks each prompt group's samples by
their rewards through DPO-style implicit rewards, so it trains on any stored or freshly sampled clean latents,
whatever sampler made them (``rollout.plan: offline`` replays a fixed store: :mod:`flowrl.rollout.offline`).

Per leaf i of a prompt group (k leaves with rewards r, ranked r_(1) ≥ … ≥ r_(k)), at D forward-process points
x_t = (1−t)·x0 + t·ε (target y = ε − x0; t and ε shared by the group, as Diffusion-DPO shares them by a pair):

- implicit reward  s_i = −β · mean_d [ ‖v_θ(x_t) − y‖² − ‖v_ref(x_t) − y‖² ]   (paper Eq. 5), v_ref the frozen
  initial policy (:class:`~flowrl.objectives.copies.Reference`: LoRA disabled, or a frozen copy); ‖·‖² a mean over
  latent elements (``norm: mean``, **ours**: the paper writes ‖·‖²₂ and states no more; Diffusion-DPO writes the
  same and its code takes the mean, as Flow-GRPO's code, which GDRO's tasks come from, and this package's other
  objectives do) or their sum (``norm: sum``, the squared L2 norm read literally: β acts ×elements stronger);
- soft targets  q_i(j) = softmax over the remaining set {j ≥ i} of r_(j)/τ   (τ = 0: one-hot on position i,
  the pure ranking loss of the paper's Eq. 12);
- Plackett–Luce cross-entropy  L_GDRO = Σ_{i=1}^{k−1} [ log Σ_{m≥i} exp s_(m) − Σ_{j≥i} q_i(j)·s_(j) ]  (Eq. 7);
- top-1 stabiliser  L_reg = mean_d ‖v_θ(x_t) − y‖² of the group's best leaf (Eq. 8, the one-hot mask M; the same
  norm);
- per group  ℓ = L_GDRO + γ·L_reg  (Eq. 9).

A micro-batch holds whole groups; its loss is the mean over its leaves of their group's ℓ (each group weighs by
its trained leaves, so equal groups weigh equally). Groups without reward spread (``forest.flat``, set by the
credit rule) and groups left with fewer than two trained leaves are skipped: they have no ranking to learn.
The credit rule's advantages are not read (its weights are: a failed reward or a dropped leaf is not ranked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from flowrl.core.choices import choice
from flowrl.core.seeding import derive_seed, seeded_normal
from flowrl.objectives.base import Batch, ObjectiveFacts
from flowrl.objectives.copies import Reference
from flowrl.objectives.forward import TIMESTEPS, ForwardProcessObjective, row_mean

NORMS = ("mean", "sum")  # ‖·‖² over latent elements: their mean (the code convention), or the squared L2 norm


def plackett_luce_loss(s: torch.Tensor, r: torch.Tensor, tau: float) -> torch.Tensor:
    """GDRO's group loss (paper Eq. 7) for implicit rewards ``s`` [k] and rewards ``r`` [k], both in ranked order
    (r descending): Σ_{i<k} [ logsumexp(s[i:]) − Σ_{j≥i} q_i(j)·s[j] ], q_i = softmax(r[i:]/τ) (τ = 0: one-hot
    on position i). A scalar; 0 for k < 2."""
    k = s.shape[0]
    if k < 2:
        return s.sum() * 0.0
    pos = torch.arange(k, device=s.device)
    rest = pos.view(1, -1) >= pos[: k - 1].view(-1, 1)  # [k−1, k]: row i holds the remaining set {j ≥ i}
    neg_inf = torch.full((k - 1, k), float("-inf"), device=s.device, dtype=s.dtype)
    log_norm = torch.logsumexp(torch.where(rest, s.view(1, -1).expand(k - 1, k), neg_inf), dim=1)  # [k−1]
    if tau > 0:
        logits = torch.where(rest, (r.to(s.dtype) / tau).view(1, -1).expand(k - 1, k), neg_inf)
        q = torch.softmax(logits, dim=1)
    else:
        q = (pos.view(1, -1) == pos[: k - 1].view(-1, 1)).to(s.dtype)
    return (log_norm - (q * s.view(1, -1)).sum(dim=1)).sum()


def ranked_groups(forest, leaves: torch.Tensor) -> list[torch.Tensor]:
    """The prompt groups of ``leaves`` [L] as lists of leaf nodes ranked by reward (descending; ties: node order),
    in the order of their groups; groups of fewer than two leaves are left out."""
    out = []
    group = forest.group[leaves]
    for g in torch.unique(group).tolist():
        mine = leaves[group == g]
        if mine.numel() < 2:
            continue
        order = torch.argsort(-forest.reward[mine].double(), stable=True)
        out.append(mine[order])
    return out


@dataclass
class GDROLoss(ForwardProcessObjective):
    """GDRO (arXiv 2601.02036; the module docstring has the loss). ``beta``: the implicit reward's scale β [6:
    the paper's GenEval setting; 12 for OCR]; ``tau``: the soft targets' temperature τ [0.05]; ``gamma``: the
    top-1 stabiliser's weight γ [1.0: GenEval; 0.5: OCR]; ``norm``: ‖·‖² as a ``mean`` over latent elements
    (default) or their ``sum`` (the squared L2 norm); ``share_t`` / ``share_noise``: one (t, ε) per draw for
    the whole group (default, as Diffusion-DPO's pairs) or per leaf. Inherited: ``draws`` D [1], ``timesteps``
    [uniform: t ∈ [0, T] uniformly, the paper], ``t_range``, ``cfg``, ``kl_ref`` (an extra ‖v_θ − v_ref‖² term,
    0: the implicit reward is GDRO's only tie to the reference), ``reward_term`` (weight of ℓ). No old copy,
    no advantages, no teacher."""

    beta: float = 6.0
    tau: float = 0.05
    gamma: float = 1.0
    norm: str = choice("mean", NORMS)
    draws: int = 1
    timesteps: str = choice("uniform", TIMESTEPS)
    share_t: bool = True
    share_noise: bool = True

    uses_old: ClassVar[bool] = False
    has_reward_free_point: ClassVar[bool] = False  # its gradient at θ = ref is the ranking's: no reward-free point
    trains_flat = False  # a group without reward spread has no ranking to learn
    progress_keys = {"fm": (("fm_error",), ".3f"), "acc": (("implicit_acc",), ".2f")}
    extremes = {"implicit_reward_min": min, "implicit_reward_max": max}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(
                f"loss.beta={self.beta} must be > 0 (GDRO's implicit-reward scale β; the paper: 6 GenEval, 12 OCR)"
            )
        if not self.tau >= 0:
            raise ValueError(f"loss.tau={self.tau} must be >= 0 (the soft targets' temperature; 0 = ranking only)")
        if not self.gamma >= 0:
            raise ValueError(f"loss.gamma={self.gamma} must be >= 0 (the top-1 stabiliser's weight)")
        if self.teacher is not None:
            raise ValueError(
                "loss.teacher is not read by loss.objective='gdro' (its tie to the initial model is the "
                "implicit reward's reference); remove loss.teacher, or use loss.objective: nft"
            )

    def unread_fields(self) -> dict[str, str]:
        """The shared ones, and ``adv_clip``: GDRO ranks raw rewards and reads no advantage."""
        out = super().unread_fields()
        out["adv_clip"] = "loss.objective='gdro' ranks the rewards themselves and reads no advantage"
        return out

    def describe(self) -> ObjectiveFacts:
        """The forward process's facts; ``timesteps: sampler`` needs a plan that samples along a schedule."""
        return replace(super().describe(), sampler_timesteps=self.timesteps == "sampler")

    # ---- lifecycle: the frozen reference, always ---------------------------------------------------
    def setup(self, model, teacher_weights=None) -> None:
        super().setup(model, teacher_weights)
        if self._reference is None:
            self._reference = Reference(model)

    def frozen_copies(self) -> tuple[str, ...]:
        return ("reference",)

    # ---- batches: whole ranked groups -----------------------------------------------------------------
    def batches(self, forest, iteration: int = 0, seed: int = 0, units: torch.Tensor | None = None) -> list[Batch]:
        """Micro-batches of whole prompt groups (as many as fit ``micro_batch`` rows of leaf × draw, at least one),
        each group's leaves ranked by reward (:func:`ranked_groups`) over ``units`` (default :meth:`units`).
        ``extra``: ``t`` [R] and ``noise`` [R, C, H, W] (leaf-major, D rows per leaf) and ``sizes`` (leaves per
        group, in order)."""
        leaves = forest.leaves()
        if leaves.numel() and bool((forest.sigma[leaves] > 0).any()):
            raise ValueError(
                "loss.objective='gdro' trains on clean latents, but some leaves of this forest are not "
                "at sigma 0: the plan must sample to the end"
            )
        groups = ranked_groups(forest, self.units(forest) if units is None else units)
        shape = tuple(forest.all_latents().shape[1:])
        out, pending = [], []
        for grp in groups + [None]:
            rows = sum(int(g.numel()) for g in pending) * self.draws
            if pending and (grp is None or rows + int(grp.numel()) * self.draws > self.micro_batch):
                out.append(self._batch(forest, pending, iteration, seed, shape))
                pending = []
            if grp is not None:
                pending.append(grp)
        return out

    def _batch(self, forest, groups: list[torch.Tensor], iteration: int, seed: int, shape: tuple[int, ...]) -> Batch:
        t_seeds, eps_seeds = [], []
        for grp in groups:
            t, eps = self.draw_seeds(forest, grp, iteration, seed)
            t_seeds += t
            eps_seeds += eps
        t = self.sampler_t(forest, t_seeds) if self.timesteps == "sampler" else self.draw_t(t_seeds)
        drawn: dict[int, torch.Tensor] = {}  # a draw shared by the group is drawn once
        for s in eps_seeds:
            if s not in drawn:
                drawn[s] = seeded_normal(s, shape)
        noise = torch.stack([drawn[s] for s in eps_seeds])
        index = torch.cat(groups)
        return Batch(index, int(index.numel()), {"t": t, "noise": noise, "sizes": [int(g.numel()) for g in groups]})

    def draw_seeds(self, forest, ranked: torch.Tensor, iteration: int, seed: int) -> tuple[list[int], list[int]]:
        """The seeds of a group's t and ε draws, D per leaf in ranked order [k·D each]: addressed by (run seed,
        iteration, prompt, the group's smallest root seed, draw) when shared by the group, else by the leaf's
        root seed and its index among the group's leaves in node order — never by node index or process."""
        prompt = forest.prompts[int(forest.group[ranked[0]])]
        roots = forest.seed[ranked]
        key = int(roots.min())
        within = torch.argsort(torch.argsort(ranked)).tolist()  # each leaf's index in node order
        t_seeds, eps_seeds = [], []
        for root, k in zip(roots.tolist(), within):
            for d in range(self.draws):
                group_addr, leaf_addr = (prompt, key, d), (int(root), k, d)
                t_seeds.append(derive_seed(seed, iteration, "gdro_t", *(group_addr if self.share_t else leaf_addr)))
                eps_seeds.append(
                    derive_seed(seed, iteration, "gdro_eps", *(group_addr if self.share_noise else leaf_addr))
                )
        return t_seeds, eps_seeds

    # ---- the loss ----------------------------------------------------------------------------------
    def group_terms(
        self, s: torch.Tensor, err: torch.Tensor, reward: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each leaf's group loss ℓ = L_GDRO + γ·L_reg [B] from implicit rewards ``s`` [B], flow-matching errors
        ``err`` [B] (mean over draws) and rewards ``reward`` [B], groups of ``sizes`` consecutive leaves in ranked
        order; and diagnostics (means over groups)."""
        own, ranks, regs, accs, tops = [], [], [], [], []
        start = 0
        for k in sizes:
            sl = slice(start, start + k)
            rank = plackett_luce_loss(s[sl], reward[sl], self.tau)
            reg = err[start]  # the group's best-rewarded leaf (ranked first)
            own.append((rank + self.gamma * reg).expand(k))
            with torch.no_grad():
                ranks.append(rank.detach())
                regs.append(reg.detach())
                r, sg = reward[sl], s[sl].detach()
                better = r.view(-1, 1) > r.view(1, -1)
                accs.append(((sg.view(-1, 1) > sg.view(1, -1)) & better).sum() / better.sum().clamp(min=1))
                tops.append(torch.softmax(sg, 0)[0])
            start += k
        diag = {
            "gdro_rank_loss": torch.stack(ranks).mean(),
            "gdro_top1_error": torch.stack(regs).mean(),
            "implicit_acc": torch.stack(accs).float().mean(),
            "implicit_top1_prob": torch.stack(tops).mean(),
        }
        return torch.cat(own), diag

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = self.forward_rows(model, forest, batch, cond, with_old=False)
        fm, fm_ref = row_mean((rows.v - rows.target) ** 2), row_mean((rows.v_ref - rows.target) ** 2)  # [R]
        elements = rows.v[0].numel() if self.norm == "sum" else 1
        err, err_ref = self.per_leaf(fm) * elements, self.per_leaf(fm_ref) * elements  # ‖·‖² per leaf [B]
        s = -self.beta * (err - err_ref)  # implicit rewards [B]
        reward = forest.reward[batch.index].float().to(s.device)
        own, group_diag = self.group_terms(s, err, reward, batch.extra["sizes"])
        loss, diag = self.total(own, rows, batch)
        diag.update(group_diag)
        with torch.no_grad():
            sd = s.detach()
            diag.update(
                {
                    "gdro_loss": loss.detach(),
                    "fm_error": fm.detach().mean(),
                    "ref_error": fm_ref.mean(),
                    "implicit_reward_mean": sd.mean(),
                    "implicit_reward_min": sd.min(),
                    "implicit_reward_max": sd.max(),
                }
            )
        return loss, diag
