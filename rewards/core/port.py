"""The one port flowrl scores through: :class:`Scorer`.

Everything flowrl asks of a reward is declared here, with a default, so no caller asks an object what it has::

    scorer.terms                                   # the scored terms: [scorer] for a plain reward
    parts = scorer.components(images, prompts, meta)   # {term name: float32 [B]}
    total = scorer.combine(parts, groups)          # float32 [B]
    scorer.failures                                # {term name: why its last scores were not all finite}
    scorer.evaluate(images, prompts)               # {summary key: float}: an eval's numeric summary ({} by default)
    scorer.normalize                               # "none" | "batch" | "group": how combine weighs the terms

A plain reward (:class:`flowrl_rewards.Reward`, which subclasses this port) is a scorer of one term, itself;
:class:`flowrl_rewards.MultiReward` is a scorer of several, and overrides :attr:`terms`, :meth:`components`,
:meth:`combine` and :attr:`failures`. Rewards with an eval summary (GenEval, OCR, shapes, gdro_corrected) override
:meth:`evaluate`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class Scorer:
    """What flowrl calls to score images [B, 3, H, W] (videos [B, F, 3, H, W]) in [0, 1]; see the module docstring.

    Subclasses implement ``__call__(images, prompts, meta) → float32 [B]`` (:class:`flowrl_rewards.Reward` does) and
    override the members below where they are more than one term or keep more than ``last_error``.
    """

    name: str = "reward"
    normalize: str = "none"
    """How :meth:`combine` weighs several terms (``"none"``, ``"batch"``, ``"group"``); a single term: ``"none"``."""
    last_error: str | None = None
    """Why the last call's scores hold NaN, when the reward knows (e.g. a remote one); :attr:`failures` reads it."""

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(images, prompts, meta)")

    @property
    def terms(self) -> list["Scorer"]:
        """The scored terms, each with its own :attr:`name` (the keys of :meth:`components`): ``[self]``."""
        return [self]

    def components(
        self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None
    ) -> dict[str, torch.Tensor]:
        """Each term's raw scores, name → float32 [B]: ``{self.name: self(images, prompts, meta)}``."""
        return {self.name: self(images, prompts, meta)}

    def combine(self, components: dict[str, torch.Tensor], groups: torch.Tensor | None = None) -> torch.Tensor:
        """The reward float32 [B] of :meth:`components`' output (``groups`` [B]: each sample's prompt group, used by
        ``normalize="group"``): for one term, its scores."""
        if len(components) != 1:
            raise ValueError(
                f"reward {self.name!r} ({type(self).__name__}) scores one term, so combine takes one "
                f"component; got {sorted(components)}"
            )
        return next(iter(components.values())).float()

    @property
    def failures(self) -> dict[str, str]:
        """Term name → why its scores of the last call were not all finite: ``{name: last_error}`` when the reward
        said why, else ``{}``."""
        return {self.name: self.last_error} if self.last_error else {}

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
        """An eval's numeric summary of images [N, 3, H, W] of ``prompts`` (e.g. GenEval's ``accuracy`` and
        ``accuracy/<tag>``, with counts ``n`` and ``n/<tag>``): ``{}`` for a reward that has none."""
        return {}
