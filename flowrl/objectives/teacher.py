"""A guided teacher for forward-process objectives (``loss.teacher``; docs/algorithms.md, "A guided teacher").

A CFG-free policy (guidance 1, one forward per step) learns from a frozen *teacher* sampled at its own
CFG scale g_T. The teacher is by default the policy's initial weights — with LoRA the base with the adapter
off (no copy), with full fine-tuning one frozen copy of the initial transformer, shared with the KL
reference when both are asked for — or the weights of a checkpoint or folder (``path``). It enters an
objective in two ways:

- **anchor**: λ_k·w_i·mean‖v_θ(x_t, c) − v_T(x_t, c)‖² at the objective's own forward-process points, with
  v_T = v_u + g_T·(v_c − v_u) the teacher's guided velocity (no gradient; one guided forward per row),
  λ_k = ``anchor``·schedule(k) after k optimizer steps, and w_i a per-leaf weight (``weighting``);
- **samples**: a share of each prompt group drawn by the teacher at g_T (``rollout.teacher_share``, a plan
  option), scored and credited in the same group as the policy's own samples.

Schedules (``schedule``, ``share_schedule``), k = optimizer steps so far:
``constant``; ``linear:N`` (1 − k/N, then 0); ``off_after:N`` (1 before step N, then 0); ``cosine:N``
(½(1 + cos(πk/N)), then 0); ``reward:LO:HI`` (clamp((R̄ − LO)/(HI − LO), 0, 1) with R̄ the iteration's mean
training reward over this process's leaves, teacher samples included: a strength that grows as the reward rises, so the
early, low-reward phase learns fast
and the late phase cannot drift to reward loopholes — CRD's reward-adaptive strength, **ours** in form).
Per-leaf weights (``weighting``): ``none`` (1); ``reward`` (the leaf's reward over the group's mean reward,
so good samples' noised points carry more of the teacher; **ours**); ``advantage`` (1 + clip(A, −1, 1):
0 for the group's worst, 2 for its best).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from flowrl.core.choices import Checked, choice
from flowrl.errors import ConfigError

WEIGHTINGS = ("none", "reward", "advantage")
SCHEDULE_FORMS = "constant | linear:N | off_after:N | cosine:N | reward:LO:HI"


@dataclass(frozen=True)
class Schedule:
    """A strength in [0, 1] per optimizer step k (and the iteration's mean reward, for ``reward:LO:HI``)."""

    kind: str = "constant"
    a: float = 0.0
    b: float = 0.0

    @staticmethod
    def parse(text: str, key: str) -> "Schedule":
        """``text`` in :data:`SCHEDULE_FORMS`; a bad one raises a ConfigError naming ``key``."""
        parts = str(text).strip().split(":")
        kind, args = parts[0], parts[1:]
        want = {"constant": 0, "linear": 1, "off_after": 1, "cosine": 1, "reward": 2}
        bad = ConfigError(
            f"{key}={text!r} does not parse; accepted: {SCHEDULE_FORMS} (N a whole number of optimizer "
            "steps > 0, LO < HI rewards)"
        )
        if kind not in want or len(args) != want[kind]:
            raise bad
        try:
            nums = [float(x) for x in args]
        except ValueError:
            raise bad from None
        if kind in ("linear", "off_after", "cosine") and not (nums[0] > 0 and nums[0] == int(nums[0])):
            raise bad
        if kind == "reward" and not nums[0] < nums[1]:
            raise bad
        return Schedule(kind, *nums)

    def __call__(self, k: int, mean_reward: float | None = None) -> float:
        if self.kind == "constant":
            return 1.0
        if self.kind == "linear":
            return max(0.0, 1.0 - k / self.a)
        if self.kind == "off_after":
            return 1.0 if k < self.a else 0.0
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * k / self.a)) if k < self.a else 0.0
        if mean_reward is None or not math.isfinite(mean_reward):
            return 1.0
        return min(1.0, max(0.0, (mean_reward - self.a) / (self.b - self.a)))


@dataclass
class TeacherSpec(Checked):
    """The ``loss.teacher`` section. ``guidance``: the teacher's CFG scale g_T (≥ 1) [3.0]. ``path``: None
    (the frozen initial weights) or a checkpoint / run folder / folder with ``transformer/``. ``anchor``: λ
    (0 = no anchor: the teacher only draws samples). ``schedule``: λ's schedule. ``weighting``: the anchor's
    per-leaf weight. ``share_schedule``: the schedule of ``rollout.teacher_share`` (the teacher's samples per
    group are round(share·schedule(k)))."""

    guidance: float = 3.0
    path: str | None = None
    anchor: float = 1.0  # λ, the anchor's weight: λ_k·w·mean‖v_θ − v_T‖² added to every leaf's loss, λ_k =
    # λ·schedule(k) (≥ 0; 0 = no anchor: the teacher only draws samples)
    schedule: str = "constant"  # λ's schedule over the optimizer steps k: constant | linear:N (1 − k/N) | off_after:N
    # | cosine:N | reward:LO:HI (clamp((R̄ − LO)/(HI − LO), 0, 1) on the iteration's mean training reward R̄)
    weighting: str = choice("none", WEIGHTINGS)  # the anchor's per-leaf weight w: none (1) | reward (the leaf's reward
    # over its group's mean) | advantage (1 + clip(A, −1, 1))
    share_schedule: str = "constant"

    config_key = "loss.teacher"

    def __post_init__(self) -> None:
        if not (isinstance(self.guidance, (int, float)) and math.isfinite(self.guidance) and self.guidance >= 1.0):
            raise ConfigError(
                f"loss.teacher.guidance={self.guidance} must be >= 1 (the teacher's CFG scale; 1 = no guidance)"
            )
        if not (math.isfinite(self.anchor) and self.anchor >= 0):
            raise ConfigError(f"loss.teacher.anchor={self.anchor} must be >= 0 (the anchor's weight; 0 = none)")
        self.anchor_schedule = Schedule.parse(self.schedule, "loss.teacher.schedule")
        self.sample_schedule = Schedule.parse(self.share_schedule, "loss.teacher.share_schedule")
        if self.path is not None and not Path(self.path).is_dir():  # what it holds: the loop's weights_folder
            raise ConfigError(
                f"loss.teacher.path={self.path!r} is not a folder; accepted: a flowrl run folder, a "
                "checkpoints/step-N folder, or a folder with transformer/ (a diffusers pipeline)"
            )


@dataclass
class TeacherCost:
    """The declared counter of a :class:`Teacher`'s cost: ``forwards`` (rows through it, each 2 NFE with guidance)
    and ``seconds``, added by each :meth:`Teacher.velocity` and handed over (then reset) by :meth:`take`."""

    forwards: int = 0
    seconds: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.forwards += int(rows)
        self.seconds += seconds

    def take(self) -> dict[str, float]:
        """``teacher_forwards`` and ``time/teacher`` since the last call, then reset."""
        out = {"teacher_forwards": float(self.forwards), "time/teacher": self.seconds}
        self.forwards, self.seconds = 0, 0.0
        return out


class Teacher:
    """The frozen teacher of ``spec`` over ``model``: :meth:`velocity` is its guided velocity (no gradient). Its cost
    since the last :meth:`take_stats` is counted in its declared :attr:`cost` (a :class:`TeacherCost`); no attribute
    of the teacher itself changes between calls."""

    state_attributes = ()

    def __init__(self, model, spec: TeacherSpec, reference=None, load_weights: Callable[[Any], None] | None = None):
        """``load_weights(model)``: fills ``model.trainable`` with the weights of ``spec.path``, which the loop read
        (:meth:`~flowrl.objectives.base.Objective.setup`'s ``teacher_weights``); needed when ``spec.path`` is set."""
        from flowrl.objectives.copies import Reference

        self.model, self.spec, self.guidance = model, spec, float(spec.guidance)
        self.cost = TeacherCost()  # what its velocity calls cost since the last take_stats
        if spec.path is None:  # the initial weights: the KL reference's copy when there is one (one frozen copy)
            self._copy = reference if reference is not None else Reference(model)
        elif load_weights is None:
            raise ValueError(f"loss.teacher.path={spec.path!r}: the teacher needs the loader of its weights")
        else:
            self._copy = _LoadedCopy(model, spec.path, load_weights)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside, ``model.velocity`` is the teacher's (weights only; the guidance is the caller's)."""
        with self._copy.active():
            yield

    def encode(self, prompts: list[str]):
        """Conditioning of ``prompts`` with their unconditional rows when g_T > 1."""
        return self.model.encode(prompts, self.guidance)

    @torch.no_grad()
    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond) -> torch.Tensor:
        """v_T [B, C, H, W] fp32 at latents ``x`` [B, C, H, W] and noise levels ``t`` [B] (``cond``: rows of
        :meth:`encode`)."""
        import time

        t0 = time.perf_counter()
        with self.active():
            v = self.model.velocity(x, t, cond, self.guidance).float()
        self.cost.add(int(x.shape[0]), time.perf_counter() - t0)
        return v

    def take_stats(self) -> dict[str, float]:
        """Forwards (rows) and seconds through the teacher since the last call, then reset."""
        return self.cost.take()


class _LoadedCopy:
    """A frozen copy of the policy's transformer with the weights ``load_weights`` fills in (full or LoRA; read from
    ``path``)."""

    def __init__(self, model, path: str, load_weights: Callable[[Any], None]):
        from flowrl.models.frozen import frozen_copy
        from flowrl.objectives.copies import swapped_transformer

        self.model = model
        self.frozen = frozen_copy(model)
        with swapped_transformer(model, self.frozen):  # load_weights fills model.trainable: here, the copy
            try:
                load_weights(model)
            except Exception as e:
                raise ConfigError(f"loss.teacher.path={path!r}: its weights do not fit this model ({e})") from None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from flowrl.objectives.copies import swapped_transformer

        with swapped_transformer(self.model, self.frozen):
            yield


def leaf_weights(weighting: str, reward: torch.Tensor, group: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """The anchor's per-leaf weight [B] for leaves with rewards ``reward`` [B], groups ``group`` [B] and
    advantages ``adv`` [B] (see the module docstring); the group mean of ``reward`` is over these leaves."""
    if weighting == "none":
        return torch.ones_like(reward)
    if weighting == "advantage":
        return 1.0 + adv.clamp(-1.0, 1.0)
    n = torch.zeros(int(group.max()) + 1, dtype=reward.dtype).index_add_(0, group, torch.ones_like(reward))
    mean = torch.zeros_like(n).index_add_(0, group, reward) / n.clamp(min=1)
    return reward / mean[group].clamp(min=1e-6)


def teacher_share_metrics(forest, group) -> dict[str, float]:
    """What the teacher's share of an iteration's samples did (every run asks; {} when the teacher drew none):
    ``rollout_teacher_forwards`` (summed over processes) and the mean reward of its leaves and of the policy's own
    (``reward_teacher``, ``reward_policy``), read from the forest's ``from_teacher`` column and counters."""
    if "teacher_forwards" not in forest.counters:
        return {}
    leaves = forest.leaves()
    mine = forest.from_teacher[leaves] > 0
    return {
        "rollout_teacher_forwards": group.sum(forest.counters["teacher_forwards"]),
        "reward_teacher": float(group.gather(forest.reward[leaves[mine]]).nanmean()),
        "reward_policy": float(group.gather(forest.reward[leaves[~mine]]).nanmean()),
    }
