"""The objective contract (``loss.objective``): its loop part, its state, and one description for the tools.

**The loop's part.** The loop hands the objective a scored, credited forest and only zero-grads, back-propagates
and steps:

1. :meth:`Objective.setup` once, after the trainable weights exist (LoRA attached or full fine-tuning), before the
   first rollout: an objective keeps the copies it needs here (a KL reference, an old policy);
2. every iteration, after the rollout and the credit rule: :meth:`begin_iteration` with the forest (what an
   objective derives from the iteration's rollout, e.g. GRPO-Guard's copy of the rollout's weights, is taken
   here, not discovered inside :meth:`loss`); :meth:`encode` the forest's prompts; :meth:`batches` (edges for
   policy objectives, leaves for forward-process ones); per micro-batch :meth:`loss` → ``(loss averaged over the
   batch, diagnostics)``, weighted by ``batch.size`` so an optimizer step averages over all of its units on all
   processes; :meth:`auxiliary` once per optimizer step (an extra term, e.g. LayerTuning);
3. :meth:`after_update` after every optimizer step (an old-policy EMA follows the weights here);
4. :meth:`state_dict` / :meth:`load_state_dict`: whatever the objective keeps goes into checkpoints.

Only :meth:`setup` (or :meth:`setup_sampling`), :meth:`begin_iteration`, :meth:`after_update` and
:meth:`load_state_dict` change the
objective, and only the attributes it declares in :attr:`Objective.state_attributes`; :meth:`batches`,
:meth:`loss` and every other call read it (tests/test_objective_contract.py holds every objective to this).

**The rollout's part.** :meth:`sampling_teacher` (the guided teacher plans may let draw a share of each group) and
:meth:`teacher_fraction` (the share of ``rollout.teacher_share`` it draws this iteration), both handed to the plan
in the rollout context; :meth:`take_stats` (diagnostics since the last call, logged with the iteration). A rollout
process (``train.pipeline: async``) calls :meth:`setup_sampling` instead of :meth:`setup`: it builds only what
sampling reads (the teacher), none of the copies the loss reads.

**The tools' part.** The tools (the config checks, the estimate, ``flowrl rollouts``, ``flowrl snr``, the loop's
logging and guidance) read an objective only through :meth:`describe`: one :class:`ObjectiveFacts` value, declared
data and small pure methods over it — what it trains on, its rows per unit and micro-batch, its frozen copies,
whether its training forward runs CFG, the guidance its rollouts must use, what it needs of the plan (a teacher for
``rollout.teacher_share``, two leaves per group, a sampling schedule), its reward-free point (``flowrl snr
--reward-only``) and how its diagnostics are combined and shown. The load-time checks are the facts' own
(:meth:`ObjectiveFacts.check_plan`, :meth:`ObjectiveFacts.check_credit`, :meth:`ObjectiveFacts.rollout_guidance`).
The one action a tool takes on an objective stays a method: :meth:`Objective.move_to_reward_free_point`, what
``flowrl snr`` calls before it measures.

Subclasses are dataclasses whose fields are the keys of the ``loss`` section (:mod:`flowrl.core.components`);
``micro_batch`` (rows per training forward) is a declared field set from ``train.micro_batch`` (default
``rollout.max_batch``), not a key of ``loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch

from flowrl.core.choices import Checked
from flowrl.errors import ConfigError


@dataclass
class Batch:
    """One micro-batch of an objective: ``index`` [B] (edge child nodes or leaf nodes of the forest) and
    ``size`` (the units the loss averages over: edges, or leaves; the loop weights micro-batches by it).
    ``extra`` carries whatever else the objective decided ahead (e.g. timesteps and noise draws)."""

    index: torch.Tensor
    size: int
    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class ObjectiveFacts:
    """What an objective is, for the config checks, the estimate, ``flowrl snr`` and the loop's logging
    (:meth:`Objective.describe`); a value: nothing in it changes during a run.

    ``trains_on``: ``"edges"`` (stochastic edges replayed with log-probs) or ``"leaves"`` (the clean latents);
    ``trains_flat``: whether units of groups without reward spread are kept; ``micro_batch``: rows per training
    forward; ``rows_per_unit``: velocity rows one trained unit costs (a forward-process objective's ``draws``);
    ``leaves_per_group``: the leaves it trains per prompt group when it trains a fixed number (DPO's pair), else None;
    ``frozen_copies``: ``old`` (a lagging old policy) and/or ``reference`` (the initial weights), in the order its
    update runs them; ``guided_training``: whether its training forward runs CFG when the rollouts do (a policy
    objective replays exactly what the rollout ran); ``reward_free_overrides``: the ``loss`` keys that switch off
    every reward-independent term (None: it has no reward-free point, ``no_reward_free_point`` says why);
    ``extremes``: diagnostics combined by min/max over micro-batches instead of averaged; ``first_step_keys``:
    diagnostics also logged as ``first_step_<key>`` for the first micro-batches of an iteration; ``progress_keys``:
    the progress bar's fields, label → (record keys summed, format); ``teacher_path``: the folder whose weights its
    guided teacher starts from (``loss.teacher.path``), which the loop reads and hands to :meth:`Objective.setup`.

    What the load-time checks read: ``name``: the objective's registered name (``loss.objective``, for messages);
    ``rollout_cfg``: the guidance its rollouts use (:meth:`rollout_guidance`): ``"any"`` (``model.guidance`` as given),
    ``"off"`` (no CFG: guidance unset or 1, used as 1; ``loss.cfg: free``) or ``"on"`` (CFG: guidance not 1; ``loss.cfg:
    guided_rollouts``); ``has_teacher``: a guided teacher is set (``loss.teacher``), which ``rollout.teacher_share``
    needs, with its CFG scale ``teacher_guidance`` and whether every update runs its forward (``teacher_in_update``: an
    anchor that weighs at the start, or a loss centred on the teacher); ``group_use``: what it does with each prompt
    group when it reads whole groups (the plan must give 2+ leaves per group), else None; ``sampler_timesteps``: it
    trains at the sampler's own noise levels (``loss.timesteps: sampler``), which needs a plan that samples along a
    schedule; ``plan_checks``: an objective's own checks of the plan beyond these (each ``check(plan)`` raises a
    ConfigError naming the keys)."""

    trains_on: str = "edges"
    trains_flat: bool = False
    micro_batch: int = 64
    rows_per_unit: int = 1
    leaves_per_group: int | None = None
    frozen_copies: tuple[str, ...] = ()
    guided_training: bool = True
    reward_free_overrides: Mapping[str, Any] | None = None
    no_reward_free_point: str | None = "it declares none (a forward-process objective with an old copy does: nft, awm)"
    extremes: Mapping[str, Callable] = field(default_factory=dict)
    first_step_keys: tuple[str, ...] = ()
    progress_keys: Mapping[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    teacher_path: str | None = None
    plan_checks: tuple[Callable[[Any], None], ...] = ()
    name: str = ""
    rollout_cfg: str = "any"
    has_teacher: bool = False
    teacher_guidance: float | None = None
    teacher_in_update: bool = False
    group_use: str | None = None
    sampler_timesteps: bool = False

    def check_credit(self, credit) -> None:
        """Refuse, at config load, a credit rule that writes no advantage where this objective reads one."""
        writes = tuple(credit.writes)
        if self.trains_on not in writes:
            raise ConfigError(
                f"credit.rule={_name(credit)!r} writes advantages on {' and '.join(writes)} only, but "
                f"loss.objective={self.name!r} trains on {self.trains_on} (it would read advantage 0 on "
                f"every one); use credit.rule: group (or tree), or an objective that trains on "
                f"{writes[0]} (loss.objective: clipped)"
            )

    def check_plan(self, plan) -> None:
        """Refuse, at config load, a rollout plan this objective cannot train on (names the keys): what it trains
        on kept, a teacher for ``rollout.teacher_share``, 2+ leaves per group for ``group_use``, a schedule for
        ``sampler_timesteps``."""
        if self.trains_on == "edges" and not plan.has_trainable_edges:
            raise ConfigError(
                f"loss.objective={self.name!r} trains stochastic edges by replaying their log-probs, "
                f"but rollout.plan={_name(plan)!r} keeps none (deterministic ODE rollouts); use a "
                "forward-process objective (loss.objective: nft | awm) or a stochastic kernel"
            )
        if self.trains_on == "leaves" and not plan.keeps_clean_latents:
            raise ConfigError(
                f"loss.objective={self.name!r} trains on the clean latents of the leaves, but "
                f"rollout.plan={_name(plan)!r} keeps none; accepted plans: chains, ode, tree, explore, probed"
            )
        share = int(plan.teacher_share or 0)
        if share and not self.has_teacher:
            raise ConfigError(
                f"rollout.teacher_share={share} draws samples from a teacher, but loss.teacher is not "
                "set; add loss.teacher: {guidance: 3.0} (or set rollout.teacher_share: 0)"
            )
        leaves = None if self.group_use is None else int(plan.expected_counts(1)["leaves"])
        if leaves is not None and leaves < 2:
            raise ConfigError(
                f"loss.objective={self.name!r} {self.group_use}, but rollout.plan={_name(plan)!r} "
                f"gives {leaves} leaf per group; raise rollout.group_size (or the tree's splits) to at "
                "least 2 leaves per prompt"
            )
        if self.sampler_timesteps and plan.schedule_steps is None:
            raise ConfigError(
                f"loss.timesteps='sampler' trains at the sampler's own noise levels, but rollout.plan="
                f"{_name(plan)!r} keeps no schedule (stored clean samples); accepted: loss.timesteps: "
                "uniform | logit_normal"
            )
        for check in self.plan_checks:
            check(plan)

    def rollout_guidance(self, guidance: float | None) -> float | None:
        """The CFG scale the rollouts use, given ``model.guidance`` (None = the model's default), by
        ``rollout_cfg``; refuses a guidance the objective cannot train from (names both keys)."""
        if self.rollout_cfg == "off":
            if guidance is not None and float(guidance) != 1.0:
                raise ConfigError(
                    f"loss.cfg='free' samples and trains the conditional velocity (guidance 1), but "
                    f"model.guidance={guidance}; unset model.guidance (or set 1), or use loss.cfg='guided'"
                )
            return 1.0
        if self.rollout_cfg == "on" and guidance is not None and float(guidance) == 1.0:
            raise ConfigError(
                "loss.cfg='guided_rollouts' samples with CFG and trains the conditional velocity, but "
                "model.guidance=1.0; set model.guidance > 1 (or unset it: the model's default), or use "
                "loss.cfg='free'"
            )
        return guidance

    def train_rows(self, counts: Mapping[str, int]) -> int:
        """Velocity rows the forward with gradients runs in one iteration, from a plan's
        :meth:`~flowrl.rollout.base.RolloutPlan.expected_counts` (with ``groups``: the prompt groups of the rollout):
        its trained leaves × :attr:`rows_per_unit`, or the states a replay of its trained edges evaluates
        (``replay_rows``). For the memory/time estimate."""
        if self.trains_on != "leaves":
            return int(counts["replay_rows"])
        leaves = int(counts["leaves"])
        if self.leaves_per_group is not None:
            leaves = min(self.leaves_per_group * int(counts["groups"]), leaves)
        return leaves * self.rows_per_unit

    def training_cfg(self, rollout_cfg: bool) -> bool:
        """Whether the forward with gradients runs classifier-free guidance, given whether the rollouts do."""
        return rollout_cfg and self.guided_training

    def progress(self, record: Mapping[str, Any]) -> dict[str, str]:
        """The progress bar's fields for one iteration ``record``: the ``progress_keys`` the record holds."""
        shown = {}
        for label, (keys, fmt) in self.progress_keys.items():
            if all(key in record for key in keys):
                shown[label] = format(sum(float(record[key]) for key in keys), fmt)
        return shown


MOVED_TO_FACTS = ("check_plan", "check_credit", "rollout_guidance")
"""Objective methods of earlier versions that are now :class:`ObjectiveFacts`' (an objective defining one is refused
when its class is made, rather than silently never called)."""


@dataclass
class Objective(Checked):
    """Base of ``loss.objective`` components (see the module docstring for the contract).

    Declarations a subclass sets (class attributes, gathered by :meth:`describe`): :attr:`trains_on`,
    :attr:`trains_flat`, :attr:`extremes`, :attr:`first_step_keys`, :attr:`progress_keys`, :attr:`state_attributes`
    (the attributes its lifecycle calls may change; everything else is fixed after :meth:`setup`).
    ``reduction`` (how rollouts reduce edge log-probs over latent elements) belongs to the objective; objectives that
    do not use log-probs leave the default.
    """

    config_key: ClassVar[str] = "loss"
    trains_on: ClassVar[str] = "edges"
    trains_flat: ClassVar[bool] = False
    extremes: ClassVar[dict[str, Any]] = {}
    first_step_keys: ClassVar[tuple[str, ...]] = ()
    progress_keys: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {}
    state_attributes: ClassVar[tuple[str, ...]] = ()
    reduction: ClassVar[str] = "mean"
    micro_batch: int = field(default=64, kw_only=True, metadata={"config": False})  # rows per training forward

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        moved = [name for name in MOVED_TO_FACTS if name in cls.__dict__]
        if moved:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(moved)}, which the config checks no longer call: the load checks "
                "are its describe() facts' (ObjectiveFacts: trains_on, rollout_cfg, has_teacher, group_use, "
                "sampler_timesteps; a check of its own in plan_checks)"
            )

    # ---- the tools' part ---------------------------------------------------------------------------
    def describe(self) -> ObjectiveFacts:
        """What this objective is (:class:`ObjectiveFacts`); a subclass adds its own facts with
        ``dataclasses.replace(super().describe(), ...)``."""
        return ObjectiveFacts(
            trains_on=self.trains_on,
            trains_flat=self.trains_flat,
            micro_batch=int(self.micro_batch),
            extremes=dict(self.extremes),
            first_step_keys=tuple(self.first_step_keys),
            progress_keys=dict(self.progress_keys),
            name=_name(self),
            no_reward_free_point=f"{type(self).__name__} declares none (a forward-process objective "
            "with an old copy does: nft, awm or a subclass)",
        )

    def units(self, forest) -> torch.Tensor:
        """The nodes this objective trains [U] (``forest.units``: the credit rule's ``weight`` honoured alike by
        every objective; flat units kept when :attr:`trains_flat`)."""
        return forest.units(self.trains_on, flat=self.trains_flat)

    def move_to_reward_free_point(self) -> None:
        """At the current weights, make the gradient of every remaining reward-independent term zero (e.g. the old
        copy set to the policy), so a gradient measures the reward's share alone. Only when :meth:`describe` gives
        ``reward_free_overrides`` (the default has none)."""
        raise NotImplementedError(f"{type(self).__name__} declares no reward-free point")

    # ---- the loop's part ----------------------------------------------------------------------------
    def setup(self, model, teacher_weights: Callable[[Any], None] | None = None) -> None:
        """Called once with the model whose trainable weights are set up (LoRA or full). ``teacher_weights``: only
        when :meth:`describe` names a ``teacher_path``, the loop's loader of those weights (``teacher_weights(model)``
        fills ``model.trainable`` with them)."""

    def setup_sampling(
        self, model, teacher_weights: Callable[[Any], None] | None = None, draws_teacher: bool = False
    ) -> None:
        """The rollout process's :meth:`setup` (``train.pipeline: async``): what sampling reads, i.e. what
        :meth:`sampling_teacher` returns when the plan lets a teacher draw (``draws_teacher``: ``rollout.teacher_share``
        > 0). The shipped objectives build nothing else (no old policy, no KL reference: only their loss reads those);
        this default, for an objective that declares no sampling setup of its own, sets it up as the trainer does."""
        self.setup(model, **({} if teacher_weights is None else {"teacher_weights": teacher_weights}))

    def begin_iteration(self, model, forest) -> None:
        """Called once per iteration with its scored, credited forest, before its first :meth:`batches` (while the
        weights are still those the rollout sampled with). Default: nothing."""

    def after_update(self, model) -> None:
        """Called after every optimizer step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint written before the objective kept state)."""

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

    # ---- the rollout's part ---------------------------------------------------------------------------
    def sampling_teacher(self):
        """The guided teacher (:class:`~flowrl.objectives.teacher.Teacher`) that plans may let draw a share of each
        prompt group (the rollout context's ``teacher``), or None (default): no teacher."""
        return None

    def teacher_fraction(self) -> float:
        """The fraction of ``rollout.teacher_share`` the teacher draws in the next rollout (the rollout context's
        ``teacher_fraction``; a schedule of the objective's state). Default 1."""
        return 1.0

    def take_stats(self) -> dict[str, float]:
        """Diagnostics accumulated since the last call (logged with the iteration; a count key ``*_forwards`` is
        summed over processes, the others averaged), reset by the call. Default: none."""
        return {}


def _name(component) -> str:
    from flowrl.core.components import name_of

    return name_of(component)
