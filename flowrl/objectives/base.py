"""The objective contract (``loss.objective``): what an objective trains on, its loss, its lifecycle.

The loop hands the objective a scored, credited forest and only zero-grads, back-propagates and steps:

1. :meth:`Objective.setup` once, after the trainable weights exist (LoRA attached or full fine-tuning),
   before the first rollout: an objective keeps the copies it needs here (a KL reference, an old policy);
2. every iteration: :meth:`encode` the forest's prompts (the conditioning its velocity uses),
   :meth:`batches` (the micro-batches of the iteration: edges for policy objectives, leaves for
   forward-process ones), then per micro-batch :meth:`loss` → ``(loss averaged over the batch, diagnostics)``;
   the loop weights each micro-batch's loss by ``batch.size`` so an optimizer step averages over all of
   its units on all processes; :meth:`auxiliary` once per optimizer step (an extra term, e.g. LayerTuning);
3. :meth:`after_update` after every optimizer step (an old-policy EMA follows the weights here);
4. :meth:`state_dict` / :meth:`load_state_dict`: whatever the objective keeps goes into checkpoints.

What the loop and the tools ask of it, declared here so no caller probes for attributes: :meth:`sampling_teacher`
(the guided teacher plans may let draw a share of each group, handed to them in the rollout context),
:meth:`take_stats` (diagnostics since the last call, logged with the iteration), :meth:`train_rows` (the estimate's
count of training forwards), and :attr:`has_reward_free_point` with :meth:`reward_free_overrides` /
:meth:`move_to_reward_free_point` (``flowrl snr --reward-only``: the reward's share of the gradient alone).

Subclasses are dataclasses whose fields are the keys of the ``loss`` section (:mod:`flowrl.config.components`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from flowrl.config.choices import Checked
from flowrl.errors import ConfigError


@dataclass
class Batch:
    """One micro-batch of an objective: ``index`` [B] (edge child nodes or leaf nodes of the forest) and
    ``size`` (the units the loss averages over: edges, or leaves; the loop weights micro-batches by it).
    ``extra`` carries whatever else the objective decided ahead (e.g. timesteps and noise draws)."""

    index: torch.Tensor
    size: int
    extra: dict[str, Any] | None = None


class Objective(Checked):
    """Base of ``loss.objective`` components (see the module docstring for the lifecycle).

    Class attributes a subclass sets: :attr:`trains_on` (``"edges"``: stochastic edges replayed with
    log-probs; ``"leaves"``: the clean latents of the leaves), :attr:`extremes` (diagnostics combined by
    min/max over micro-batches instead of averaged), :attr:`first_step_keys` (diagnostics also logged as
    ``first_step_<key>`` for the first micro-batches of an iteration, before any weight changed),
    :attr:`progress_keys` (the iteration record's keys the progress bar shows beside the reward: label →
    (keys summed, format); a key the record lacks is left out).
    ``reduction`` (how rollouts reduce edge log-probs over latent elements) belongs to the objective;
    objectives that do not use log-probs leave the default.
    """

    config_key = "loss"
    trains_on: ClassVar[str] = "edges"
    trains_flat: ClassVar[bool] = False
    extremes: ClassVar[dict[str, Any]] = {}
    first_step_keys: ClassVar[tuple[str, ...]] = ()
    progress_keys: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {}
    has_reward_free_point: ClassVar[bool] = False  # a subclass may make it a property of its settings
    reduction: str = "mean"

    def progress(self, record: dict[str, Any]) -> dict[str, str]:
        """The progress bar's fields for one iteration ``record``: ``progress_keys`` the record holds."""
        shown = {}
        for label, (keys, fmt) in self.progress_keys.items():
            if all(key in record for key in keys):
                shown[label] = format(sum(float(record[key]) for key in keys), fmt)
        return shown

    # ---- configuration checks ---------------------------------------------------------------
    def units(self, forest) -> torch.Tensor:
        """The nodes this objective trains [U] (``forest.units``: the credit rule's ``weight`` honoured alike by
        every objective; flat units kept when :attr:`trains_flat`)."""
        return forest.units(self.trains_on, flat=self.trains_flat)

    def check_credit(self, credit) -> None:
        """Refuse, at config load, a credit rule that writes no advantage where this objective reads one."""
        writes = tuple(getattr(credit, "writes", ("edges", "leaves")))
        if self.trains_on not in writes:
            raise ConfigError(f"credit.rule={_name(credit)!r} writes advantages on {' and '.join(writes)} only, but "
                              f"loss.objective={_name(self)!r} trains on {self.trains_on} (it would read advantage 0 on "
                              f"every one); use credit.rule: group (or tree), or an objective that trains on "
                              f"{writes[0]} (loss.objective: clipped)")

    def check_plan(self, plan) -> None:
        """Refuse, at config load, a rollout plan this objective cannot train on (names the keys)."""
        if self.trains_on == "edges" and not getattr(plan, "has_trainable_edges", True):
            raise ConfigError(f"loss.objective={_name(self)!r} trains stochastic edges by replaying their log-probs, "
                              f"but rollout.plan={_name(plan)!r} keeps none (deterministic ODE rollouts); use a "
                              "forward-process objective (loss.objective: nft | awm) or a stochastic kernel")
        if self.trains_on == "leaves" and not getattr(plan, "keeps_clean_latents", True):
            raise ConfigError(f"loss.objective={_name(self)!r} trains on the clean latents of the leaves, but "
                              f"rollout.plan={_name(plan)!r} keeps none; accepted plans: chains, ode, tree, explore, probed")

    def rollout_guidance(self, guidance: float | None) -> float | None:
        """The CFG scale the rollouts must use, given ``model.guidance`` (None = the model's default)."""
        return guidance

    # ---- lifecycle ----------------------------------------------------------------------------
    def setup(self, model) -> None:
        """Called once with the model whose trainable weights are set up (LoRA or full)."""

    def after_update(self, model) -> None:
        """Called after every optimizer step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint written before the objective kept state)."""

    # ---- what the loop and the tools ask -----------------------------------------------------------
    def sampling_teacher(self):
        """The guided teacher (:class:`~flowrl.objectives.teacher.Teacher`) that plans may let draw a share of each
        prompt group (the rollout context's ``teacher``), or None (default): no teacher."""
        return None

    def take_stats(self) -> dict[str, float]:
        """Diagnostics accumulated since the last call (logged with the iteration; a count key ``*_forwards`` is
        summed over processes, the others averaged), reset by the call. Default: none."""
        return {}

    def train_rows(self, counts: dict[str, int]) -> int:
        """Velocity rows the forward with gradients runs in one iteration, from a plan's
        :meth:`~flowrl.rollout.base.RolloutPlan.expected_counts`: its leaves (training on leaves) or the states a
        replay of its trained edges evaluates (``replay_rows``). ``counts`` also holds ``groups`` (the prompt groups
        of the rollout), for an objective that trains a fixed number of leaves per group. For the memory/time
        estimate."""
        return int(counts["leaves"] if self.trains_on == "leaves" else counts["replay_rows"])

    def no_reward_free_point(self) -> str | None:
        """Why this objective, as configured, has no reward-free point (None when it has one); the refusal of
        ``flowrl snr --reward-only`` says it."""
        if self.has_reward_free_point:
            return None
        return (f"{type(self).__name__} declares none (a forward-process objective with an old copy does: nft, awm or "
                "a subclass)")

    def frozen_copies(self) -> tuple[str, ...]:
        """The frozen copies of the policy the objective keeps and runs forwards on: ``old`` (a lagging old policy)
        and/or ``reference`` (the initial weights, for a KL), in the order its update runs them. Default: none."""
        return ()

    @property
    def rows_per_unit(self) -> int:
        """Velocity rows one trained unit costs in the forward with gradients (a forward-process objective: its
        ``draws`` (t, ε) points per leaf). Default 1."""
        return 1

    def training_cfg(self, rollout_cfg: bool) -> bool:
        """Whether the forward with gradients runs classifier-free guidance, given whether the rollouts do (a policy
        objective replays exactly what the rollout ran)."""
        return rollout_cfg

    def reward_free_overrides(self) -> dict[str, Any]:
        """``loss`` keys and values that switch off every term independent of the reward (e.g. a KL to a reference,
        a teacher anchor), for ``flowrl snr --reward-only``; only asked when :attr:`has_reward_free_point`."""
        return {}

    def move_to_reward_free_point(self) -> None:
        """At the current weights, make the gradient of every remaining reward-independent term zero (e.g. the old
        copy set to the policy), so a gradient measures the reward's share alone. Only with
        :attr:`has_reward_free_point` (the default has none)."""
        raise NotImplementedError(f"{type(self).__name__} declares no reward-free point")

    # ---- one iteration -------------------------------------------------------------------------
    def encode(self, model, forest):
        """The conditioning of ``forest``'s prompt groups the training forward uses (one row per group)."""
        return model.encode(forest.prompts, forest.guidance)

    def batches(self, forest, iteration: int = 0, seed: int = 0, units: torch.Tensor | None = None) -> list[Batch]:
        """The micro-batches of one iteration over ``forest`` (credited), in a fixed order; over ``units`` [U] when
        given (default: :meth:`units`, what the credit rule weighted)."""
        raise NotImplementedError

    def loss(self, model, forest, batch: Batch, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch (a scalar, averaged over its ``size`` units) and detached diagnostics."""
        raise NotImplementedError

    def auxiliary(self, model, forest, cond) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """An extra loss term the loop adds once per optimizer step, after the micro-batches' terms (e.g.
        a best-path flow-matching term on the group's best leaf); None (default) for none. Its gradient is
        averaged over processes with the rest."""
        return None


def _name(component) -> str:
    from flowrl.config.components import name_of

    return name_of(component)
