"""The guard against reward hacking (``eval.guard``, :class:`~flowrl.config.schema.GuardSection`): one eval reward's
held-out mean watched from its start value, the trip when it falls past the margin, the messages that say so,
and the state a checkpoint keeps (start values and trip) so a resume neither re-measures nor trains past a stop
that still stands. The trainer asks it at every eval (:meth:`EvalGuard.observe`) and after a resume
(:meth:`EvalGuard.after_resume`)."""

from __future__ import annotations

from typing import Any, Sequence

from flowrl.config.checks import check_guard_reward
from flowrl.errors import ConfigError
from flowrl_rewards.core.port import Scorer


class EvalGuard:
    """``eval.guard`` (:class:`~flowrl.config.schema.GuardSection`): watches one eval reward's held-out mean
    (``metric``,
    ``eval/<name>_mean``) at every eval after the first and trips when it falls below its start value by more than
    ``max_drop`` (× |start| with ``relative``); the trainer then saves a checkpoint and stops. The start values
    (every number of the run's first eval: the one before training, else the first there is) and the trip travel in
    the checkpoint (:meth:`state_dict`), so a resume measures from the same start and, while the trip still stands
    under its settings, refuses to train on past it (:meth:`resume_refusal`). ``metric`` None: no guard (the start
    values are still kept, so a resume may turn it on)."""

    def __init__(self, section, metric: str | None):
        self.reward, self.metric = section.reward, metric
        self.max_drop, self.relative = float(section.max_drop), bool(section.relative)
        self.starts: dict[str, float] = {}
        self.stop: dict[str, Any] | None = None  # the trip: reward, metric, step, start, now, max_drop, relative
        self.note: str | None = None  # what a resume past an earlier trip says (:meth:`resume_refusal`)

    @classmethod
    def build(cls, section, names: Sequence[str], reward: Scorer) -> "EvalGuard":
        """The guard of ``section`` over the eval ``reward`` (a MultiReward) whose terms are spelled ``names`` in the
        config (:func:`~flowrl.config.checks.guard_names`): the named term's metric key, by its built name."""
        if section.reward is None:
            return cls(section, None)
        built = [term.name for term in reward.terms]
        if section.reward in built:
            return cls(section, f"eval/{section.reward}_mean")
        check_guard_reward(section.reward, list(names))  # the one check of it (at load, against the same names)
        if len(names) != len(built):
            raise ConfigError(
                f"eval.guard.reward={section.reward!r}: the eval reward has {len(built)} terms ({built}) and "
                f"{len(names)} names were given ({list(names)}); give one name per term"
            )
        return cls(section, f"eval/{built[list(names).index(section.reward)]}_mean")

    def threshold(self, start: float, max_drop: float | None = None, relative: bool | None = None) -> float:
        """The value below which the guard trips, for a start value (by default at this guard's settings)."""
        max_drop = self.max_drop if max_drop is None else max_drop
        relative = self.relative if relative is None else relative
        return start - max_drop * (abs(start) if relative else 1.0)

    def observe(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        """The guard's keys for eval ``record`` at ``step`` (``guard/start``, ``guard/threshold``, ``guard/tripped``,
        and on a trip ``guard/stopped``: the message); the first eval sets the start values and trips nothing."""
        first = not self.starts
        if first:
            self.starts = {
                k: float(v) for k, v in record.items() if k.startswith("eval") and isinstance(v, (int, float))
            }
        if self.metric is None or self.metric not in record or self.metric not in self.starts:
            return {}
        start, now = self.starts[self.metric], float(record[self.metric])
        out: dict[str, Any] = {"guard/start": start, "guard/threshold": self.threshold(start), "guard/tripped": 0.0}
        if not first and now < self.threshold(start):
            self.stop = {
                "reward": self.reward,
                "metric": self.metric,
                "step": int(step),
                "start": start,
                "now": now,
                "max_drop": self.max_drop,
                "relative": self.relative,
            }
            out.update({"guard/tripped": 1.0, "guard/stopped": self.message()})
        return out

    def message(self, stop: dict[str, Any] | None = None) -> str:
        """One line naming the reward, its start and current values and the margin of a trip."""
        s = stop or self.stop
        margin = f"eval.guard.max_drop={s['max_drop']:g}" + (" × |start|, relative" if s["relative"] else "")
        return (
            f"eval guard: {s['metric']} (eval.guard.reward={s['reward']!r}) fell from {s['start']:.4f} at the "
            f"start to {s['now']:.4f} at step {s['step']}, a drop of {s['start'] - s['now']:.4f}: more than "
            f"{margin} allows (threshold {self.threshold(s['start'], s['max_drop'], s['relative']):.4f})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"starts": dict(self.starts), "stop": None if self.stop is None else dict(self.stop)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's start values and trip (none in a checkpoint written before the guard)."""
        state = state or {}
        self.starts = dict(state.get("starts") or {})
        self.stop = dict(state["stop"]) if state.get("stop") else None

    def resume_refusal(self) -> str | None:
        """After a resume: the refusal when the checkpoint's trip still stands (the same reward, still below the
        threshold at this run's ``max_drop``/``relative``), else None; a trip that no longer stands is cleared, and
        what it was is said in :attr:`note`."""
        stop, self.note = self.stop, None
        if stop is None:
            return None
        if self.metric == stop["metric"] and stop["now"] < self.threshold(stop["start"]):
            return (
                f"{self.message()}. The run was stopped there by the eval guard; to train on past it raise "
                f"eval.guard.max_drop above {stop['start'] - stop['now']:.4f} (or set eval.guard.relative), or "
                "turn the guard off with eval.guard.reward=null"
            )
        why = (
            "the guard is off"
            if self.metric is None
            else (
                f"it now watches {self.metric}"
                if self.metric != stop["metric"]
                else f"the drop is within eval.guard.max_drop={self.max_drop:g}{' × |start|' if self.relative else ''}"
            )
        )
        self.note = f"training on past the eval guard's stop at step {stop['step']} ({why})"
        self.stop = None
        return None

    def after_resume(self, checkpoint) -> tuple[str | None, bool]:
        """After a resume from ``checkpoint`` (its state loaded): (the line to say, or None; whether the run stops
        where it is). A trip that still stands refuses (:meth:`resume_refusal`; :attr:`stop` keeps it); one the
        settings now allow is cleared and said; a watching guard whose checkpoint holds no start values says that
        the first eval of this resume is the start."""
        refusal = self.resume_refusal()
        if self.metric is not None and not self.starts and refusal is None:
            self.note = (
                f"eval guard: {checkpoint} holds no start values (written before the guard, or without an "
                "eval yet); the first eval of this resume is the start"
            )
        return refusal or self.note, refusal is not None


def stop_summary(stop: dict[str, Any]) -> str:
    """The closing summary's line for a trip (:attr:`EvalGuard.stop`): where, the reward, both values, the margin."""
    relative = ", relative" if stop["relative"] else ""
    return (
        f"stopped by the eval guard at step {stop['step']}: {stop['metric']} fell from {stop['start']:.4f} "
        f"to {stop['now']:.4f} (eval.guard.max_drop={stop['max_drop']:g}{relative})"
    )
