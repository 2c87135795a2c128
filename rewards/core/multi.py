"""Several rewards combined with weights."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from flowrl_rewards.core.base import Reward, check_frame_stride
from flowrl_rewards.core.port import Scorer
from flowrl_rewards.core.registry import build_reward
from flowrl_rewards.core.timeout import RewardTimeout, call_with_timeout

NORMALIZE = ("none", "batch", "group")


def _as_scores(scores: Any, n: int) -> torch.Tensor:
    """A term's scores as float32 [n] on the CPU; a RuntimeError when it gave another count."""
    out = torch.as_tensor(scores).detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    if out.shape[0] != n:
        raise RuntimeError(f"returned {out.shape[0]} scores for {n} images")
    return out


@dataclass
class RewardSpec:
    """One term of a :class:`MultiReward`: registry name (or ``module:Class``), weight, kwargs.

    ``label`` renames the built reward (its metric key), e.g. to use one reward twice with
    different kwargs. ``timeout`` (seconds) bounds one call: past it the call's scores are NaN (failed
    rewards) with a warning (:mod:`flowrl_rewards.core.timeout`). ``kwargs.frame_stride`` (any reward; default 1) is
    taken
    by the combiner, not the reward's constructor: on videos the term scores every ``frame_stride``-th frame
    (:attr:`flowrl_rewards.Reward.frame_stride`).
    """

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str | None = None
    timeout: float | None = None


class MultiReward(Reward):
    """Weighted sum of rewards. Terms: a :class:`RewardSpec`, a ``{name, weight, kwargs, label}`` dict,
    a registry name, or a built :class:`Reward` (weight 1 unless ``weights`` is given) or any
    :class:`~flowrl_rewards.core.port.Scorer` (scored by its call, as a term of its own).
    :meth:`components` returns each term's raw scores so a credit rule can normalise per reward
    instead of summing raw values.

    ``normalize="batch"`` makes :meth:`combine` z-score each term over the batch (NaN-aware; a term
    with zero spread contributes zeros) before weighting, so terms on different scales (PickScore
    ≈ 20, HPS ≈ 0.3) count by their weights; ``"group"`` z-scores each term within each prompt group
    (``groups`` passed to :meth:`combine`: DanceGRPO/MixGRPO's advantage aggregation, the weighted sum
    of each reward's group z-scores); ``"none"`` (default) sums raw scores. A NaN score (a masked
    remote batch) makes that sample's total NaN. The trainer combines through here only: credit rules
    read the combined ``reward``.

    A term with a ``timeout`` is called in a worker thread with that deadline; a call past it gives NaN
    scores (counted as failed rewards) and a RuntimeWarning naming the reward and the limit. After every
    :meth:`components` call, :attr:`failures` maps each term whose scores were not all finite to why
    (the timeout, the reward's own ``last_error``, or how many scores were NaN): what a run that stops
    because every reward failed names.
    """

    name = "multi"
    modality = "any"  # videos go to each term whole; each reduces them as its own modality says

    def __init__(
        self,
        terms: Sequence[RewardSpec | dict | Scorer | str],
        weights: Sequence[float] | None = None,
        normalize: str = "none",
    ):
        if normalize not in NORMALIZE:
            raise ValueError(f"MultiReward: normalize={normalize!r} is not one of {NORMALIZE}")
        if weights is not None and len(weights) != len(terms):
            raise ValueError(f"MultiReward: {len(weights)} weights for {len(terms)} rewards")
        self.normalize = normalize
        self.rewards: list[Scorer] = []
        self.weights: list[float] = []
        self.timeouts: list[float | None] = []
        self._failures: dict[str, str] = {}  # term name → why its scores of the last call were not all finite
        for i, term in enumerate(terms):
            if isinstance(term, str):
                term = {"name": term}
            timeout = None
            if isinstance(term, Scorer):
                reward, weight = term, 1.0
            else:
                if isinstance(term, dict):
                    unknown = set(term) - {"name", "weight", "kwargs", "label", "timeout"}
                    if unknown or "name" not in term:
                        raise ValueError(
                            f"MultiReward: reward term {term!r} needs 'name' and may have 'weight', "
                            f"'kwargs', 'label', 'timeout' (unknown: {sorted(unknown)})"
                        )
                spec = term if isinstance(term, RewardSpec) else RewardSpec(**term)
                if spec.timeout is not None and not (math.isfinite(spec.timeout) and spec.timeout > 0):
                    raise ValueError(f"reward {spec.name!r}: timeout={spec.timeout!r} must be > 0 seconds")
                kwargs = dict(spec.kwargs or {})
                stride = check_frame_stride(spec.label or spec.name, kwargs.pop("frame_stride", 1))
                reward, weight = build_reward(spec.name, **kwargs), float(spec.weight)
                if stride != 1:
                    reward.frame_stride = stride
                timeout = None if spec.timeout is None else float(spec.timeout)
                if spec.label:
                    reward.name = spec.label
            if weights is not None:
                weight = float(weights[i])
            self.rewards.append(reward)
            self.weights.append(weight)
            self.timeouts.append(timeout)
        if not self.rewards:
            raise ValueError("MultiReward needs at least one reward")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(
                f"reward names must be unique inside one MultiReward, got {names}; "
                "give a 'label' to tell two terms apart"
            )

    @classmethod
    def from_config(cls, config: Any, normalize: str = "none") -> "MultiReward":
        """From a config value: ``"name"``, ``{name, weight, kwargs, label}``, or a list of either."""
        if isinstance(config, (str, dict, RewardSpec, Scorer)):
            config = [config]
        if not isinstance(config, (list, tuple)):
            raise TypeError(
                f"reward config must be a name, a {{name, kwargs}} mapping or a list of them, got {config!r}"
            )
        return cls([dict(t) if isinstance(t, dict) else t for t in config], normalize=normalize)

    @property
    def terms(self) -> list[Scorer]:
        """The combined rewards, in order (:attr:`rewards`)."""
        return list(self.rewards)

    @property
    def failures(self) -> dict[str, str]:
        """Term name → why its scores of the last :meth:`components` call were not all finite (the timeout, the
        reward's own ``last_error``, or how many scores were not finite)."""
        return dict(self._failures)

    def components(
        self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None
    ) -> dict[str, torch.Tensor]:
        """Raw scores of every term: name → float32 [B]; a term past its ``timeout`` gives NaN scores (warned)
        and every term whose scores are not all finite is named in :attr:`failures`."""
        meta = {} if meta is None else meta
        out, failures = {}, {}
        for r, timeout in zip(self.rewards, self.timeouts):
            try:
                out[r.name] = (
                    r(images, prompts, meta)
                    if timeout is None
                    else call_with_timeout(r, images, prompts, meta, timeout)
                )
                if not isinstance(r, Reward):  # a Scorer's own call: float32 [B] on the CPU, as a Reward's gives
                    out[r.name] = _as_scores(out[r.name], len(prompts))
            except RewardTimeout as e:
                warnings.warn(
                    f"{e}: its {len(prompts)} scores are NaN (counted in reward_failed); the next call "
                    "starts a fresh worker",
                    RuntimeWarning,
                    stacklevel=2,
                )
                out[r.name] = torch.full((len(prompts),), float("nan"))
                failures[r.name] = str(e)
                continue
            except Exception as e:  # name the failing reward; the cause stays chained
                raise RuntimeError(
                    f"reward {r.name!r} ({type(r).__name__}) failed on {len(prompts)} images: {type(e).__name__}: {e}"
                ) from e
            bad = int((~torch.isfinite(out[r.name])).sum())
            if bad:
                why = r.last_error
                failures[r.name] = f"returned {bad} non-finite score{'s' if bad > 1 else ''} of {len(prompts)}" + (
                    f" ({why})" if why else ""
                )
        self._failures = failures
        return out

    @staticmethod
    def _zscore(x: torch.Tensor) -> torch.Tensor:
        ok = torch.isfinite(x)
        if ok.sum() < 2:
            return torch.where(ok, torch.zeros_like(x), x)
        mean = x[ok].mean()
        std = x[ok].std(unbiased=False)
        if std < 1e-8:
            return torch.where(ok, torch.zeros_like(x), x)
        return (x - mean) / std

    def combine(self, components: dict[str, torch.Tensor], groups: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum float32 [B] of the outputs of :meth:`components`, each term z-scored first over
        the batch (``normalize="batch"``) or within each group of ``groups`` [B] (``"group"``)."""
        if self.normalize == "group" and groups is None:
            raise ValueError("MultiReward(normalize='group').combine needs the prompt group of every sample")
        total = None
        for reward, weight in zip(self.rewards, self.weights):
            if reward.name not in components:
                raise KeyError(f"MultiReward.combine: no scores for {reward.name!r}; got {sorted(components)}")
            values = components[reward.name].float()
            if self.normalize == "batch":
                values = self._zscore(values)
            elif self.normalize == "group":
                values = values.clone()
                for g in torch.unique(groups):
                    members = groups == g
                    values[members] = self._zscore(values[members])
            term = weight * values
            total = term if total is None else total + term
        return total

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
        """Every term's eval summary (:meth:`~flowrl_rewards.core.port.Scorer.evaluate`), its keys under ``<term>/``; an
        image term is not asked for videos [N, F, 3, H, W] (its summary reads images)."""
        return {
            f"{r.name}/{key}": value
            for r in self.rewards
            if images.ndim == 4 or r.modality != "image"
            for key, value in r.evaluate(images, prompts).items()
        }

    def score(self, images, prompts, meta):
        return self.combine(self.components(images, prompts, meta))

    def check_prompt(self, prompt: str) -> None:
        for reward in self.rewards:
            reward.check_prompt(prompt)

    def check_ready(self) -> None:
        for reward in self.rewards:
            reward.check_ready()
