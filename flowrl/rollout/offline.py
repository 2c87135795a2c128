"""``rollout.plan: offline``: replay a fixed rollout store instead of sampling (GDRO's fully offline training, arXiv
2601.02036: pre-generated groups, no sampler in the loop; :mod:`flowrl.rollout.offline_store` has the format and
its writer, ``flowrl rollouts``).

Each iteration the prompt source draws its prompts from ``prompts.train`` as for any plan; for every drawn prompt
(global group index q = ``ctx.group_offset`` + its position) the plan takes ``group_size`` of the store's samples of
that prompt, chosen without replacement by a generator seeded with (run seed, iteration, "offline", q) — all of
them when ``group_size`` is 0 — and builds a forest of those clean latents as leaves (each a root at σ = 0, its
stored root seed kept: ``model.noise([seed])`` rebuilds its x_T), grouped per prompt. No model forward runs; the
runner decodes and scores the leaves as it scores any plan's, so the rewards are the run's own (``rewards``),
compared with the stored ones in the metrics (``offline/reward_drift``: 0 when the run scores as the store did).
The draws depend on nothing but the seed, the iteration and q: any process layout, chunking and a resume draw
the same samples.

The store is read when the plan is built (at config load, before the model loads: a missing or damaged store
fails then, naming ``rollout.source``) and checked against the model at :meth:`Offline.setup`, before training:
another family or latent shape is refused, and so is another model with the same ones (the identity the store
records: :func:`~flowrl.rollout.offline_store.model_identity`). ``source: null`` (the presets' default) is refused
at setup, so a preset loads without a store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.core.seeding import derive_seed
from flowrl.errors import ConfigError
from flowrl.models.base import FlowModel
from flowrl.rollout.base import RolloutContext, RolloutPlan
from flowrl.rollout.forest import Forest
from flowrl.rollout.offline_store import COMMAND, RolloutStore


@dataclass
class Offline(RolloutPlan):
    """Replay ``source`` (a rollout store, :mod:`flowrl.rollout.offline_store`): ``group_size`` stored samples of each
    drawn prompt per iteration [6: GDRO's best group size, of 16 pre-generated images per prompt], 0 = all of the
    prompt's. See the module docstring."""

    source: str | None = None  # the rollout store replayed: a folder written by `flowrl rollouts CONFIG --out FOLDER`
    # (point prompts.train at FOLDER/prompts.txt); null (the presets' default) is refused when the run starts
    group_size: int = 6  # stored samples of each drawn prompt per iteration, drawn without replacement (≥ 2; 0 = all
    # of the prompt's) [6: GDRO's best group size, of 16 pre-generated images per prompt]

    def __post_init__(self) -> None:
        if self.group_size == 1 or self.group_size < 0:
            raise ValueError(
                f"rollout.group_size={self.group_size} must be >= 2 (a group ranks several samples) or 0 "
                "(every stored sample of the prompt)"
            )
        self._store: RolloutStore | None = None
        if self.source is not None:
            if not str(self.source).strip():
                raise ValueError(
                    "rollout.source='' must name a rollout store (a folder written by "
                    f"`{COMMAND} CONFIG --out FOLDER`), e.g. rollout: {{plan: offline, source: runs/store}}"
                )
            self._store = RolloutStore(self.source, "rollout.source")
            if self.group_size > self._store.images_per_prompt:
                raise ValueError(
                    f"rollout.group_size={self.group_size} is more than the "
                    f"{self._store.images_per_prompt} samples per prompt of rollout.source="
                    f"{self.source!r}; accepted: 2…{self._store.images_per_prompt}, or 0 (all)"
                )

    @property
    def store(self) -> RolloutStore:
        if self._store is None:
            raise ConfigError(
                "rollout.plan='offline' replays a rollout store, and rollout.source is not set; "
                f"accepted: a folder written by `{COMMAND} CONFIG --out FOLDER` "
                "(rollout.source=FOLDER, and prompts.train=FOLDER/prompts.txt)"
            )
        return self._store

    # ---- what tools ask of a plan ------------------------------------------------------------------
    @property
    def has_trainable_edges(self) -> bool:
        return False

    def leaves_per_group(self) -> int:
        """Samples per prompt group: ``group_size``, or (0) the store's per prompt (its K; 16 without a store)."""
        if self.group_size:
            return self.group_size
        return self._store.images_per_prompt if self._store is not None else 16

    def expected_counts(self, num_prompts: int, ctx: RolloutContext | None = None) -> dict[str, int]:
        """No forwards, no edges: ``leaves`` stored samples per prompt group."""
        return {"forwards": 0, "trained_edges": 0, "leaves": num_prompts * self.leaves_per_group(), "replay_rows": 0}

    # ---- lifecycle ---------------------------------------------------------------------------------
    def setup(self, model: FlowModel, reward=None) -> None:
        """The store must hold this model's samples (:meth:`RolloutStore.check_model`: its latents and identity)."""
        self.store.check_model(model)

    def state_dict(self) -> dict:
        """The store's fingerprint: a resume replays the same samples or refuses."""
        return {"store": self.store.fingerprint}

    def load_state_dict(self, state: dict | None) -> None:
        if state and state.get("store") not in (None, self.store.fingerprint):
            raise ConfigError(
                f"rollout.source={self.source!r} holds other samples (fingerprint {self.store.fingerprint}) "
                f"than the run being resumed was trained on ({state['store']}); accepted: that run's store"
            )

    # ---- one iteration -----------------------------------------------------------------------------
    def picks(self, prompts: list[str], ctx: RolloutContext) -> list[list[int]]:
        """The store rows replayed for each of ``prompts`` in ``ctx`` (see the module docstring), sorted."""
        out = []
        for g, prompt in enumerate(prompts):
            rows = self.store.rows_of(prompt)
            k = self.group_size or len(rows)
            if k < len(rows):
                gen = torch.Generator().manual_seed(
                    derive_seed(ctx.seed, ctx.iteration, "offline", ctx.group_offset + g)
                )
                rows = sorted(rows[i] for i in torch.randperm(len(rows), generator=gen)[:k].tolist())
            out.append(list(rows))
        return out

    @torch.no_grad()
    def rollout(self, model: FlowModel, prompts: list[str], ctx: RolloutContext) -> Forest:
        """A forest of the picked stored samples: leaf-roots at σ = 0, grouped per prompt in order (no forward)."""
        picks = self.picks(prompts, ctx)
        rows = torch.tensor([r for p in picks for r in p], dtype=torch.long)
        forest = ctx.new_forest(prompts, model.guidance_or_default(ctx.guidance), model.device)
        groups = torch.cat([torch.full((len(p),), g, dtype=torch.long) for g, p in enumerate(picks)])
        step = int(self.store.meta["sampler"]["steps"])
        forest.add_roots(self.store.latents(rows), groups, self.store.seed[rows], sigma=0.0, step=step)
        return forest

    def metrics(self, forest: Forest) -> dict[str, float]:
        """``offline/stored_reward``: the mean stored reward of the replayed samples; ``offline/reward_drift``: the
        mean |reward now − stored reward| (both finite; 0 when the run's rewards score as the store's did)."""
        leaves = forest.leaves()
        index = {
            (p, int(s)): r for p in set(forest.prompts) for r in self.store.rows_of(p) for s in [self.store.seed[r]]
        }
        stored = torch.tensor(
            [
                float(self.store.reward[index[(forest.prompts[int(forest.group[n])], int(forest.seed[n]))]])
                for n in leaves.tolist()
            ]
        )
        now = forest.reward[leaves].float()
        both = torch.isfinite(stored) & torch.isfinite(now)
        out = {
            "offline/stored_reward": float(stored[torch.isfinite(stored)].mean())
            if bool(torch.isfinite(stored).any())
            else float("nan")
        }
        out["offline/reward_drift"] = (
            float((now[both] - stored[both]).abs().mean()) if bool(both.any()) else float("nan")
        )
        return out
