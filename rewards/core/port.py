"""The one port flowrl scores through: :class:`Scorer`.

Everything flowrl asks of a reward is declared here, with a default, so no caller asks an object what it has::

    scorer.terms                                   # the scored terms: [scorer] for a plain reward
    parts = scorer.components(images, prompts, meta)   # {term name: float32 [B]}
    total = scorer.combine(parts, groups)          # float32 [B]
    scorer.failures                                # {term name: why its last scores were not all finite}
    scorer.evaluate(images, prompts)               # {summary key: float}: an eval's numeric summary ({} by default)
    scorer.normalize                               # "none" | "batch" | "group": how combine weighs the terms
    scorer.check_prompt(prompt)                    # at load: ValueError for a prompt it cannot score (accepts all)
    scorer.check_ready()                           # at load: raises when it cannot score now (ready by default)
    term.modality                                  # of each term: "image" | "video" | "any" (by default "any")
    term.needs_source_image                        # of each term: its prompts must carry a source image (False)

A plain reward (:class:`flowrl_rewards.Reward`, which subclasses this port) is a scorer of one term, itself;
:class:`flowrl_rewards.MultiReward` is a scorer of several, and overrides :attr:`terms`, :meth:`components`,
:meth:`combine` and :attr:`failures`. Rewards with an eval summary (GenEval, OCR, shapes, gdro_corrected) override
:meth:`evaluate`.

A scorer need not be a :class:`~flowrl_rewards.Reward`: a subclass of this port that implements ``__call__`` only
trains, is evaluated and has its prompts checked like one (``tests/test_scorer_port_complete.py``). Given to a run in
code it is combined as a Reward is (:func:`flowrl.training.scoring.as_multi`: a term of a
:class:`~flowrl_rewards.MultiReward`, or itself when it has several terms of its own).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class Scorer:
    """What flowrl calls to score images [B, 3, H, W] (videos [B, F, 3, H, W]) in [0, 1]; see the module docstring.

    Subclasses implement ``__call__(images, prompts, meta) → float32 [B]`` (:class:`flowrl_rewards.Reward` does) and
    override the members below where they are more than one term, keep more than ``last_error``, score only images
    or only videos, refuse some prompts, need a server or compare with a source image. Every member flowrl reads of a
    scorer, or of one of its :attr:`terms`, is declared here with its default; none is asked for with ``getattr``.
    """

    name: str = "reward"
    """The term's name: the key of its scores in :meth:`components` and of its metrics (``eval/<name>_mean``)."""
    normalize: str = "none"
    """How :meth:`combine` weighs several terms (``"none"``, ``"batch"``, ``"group"``); a single term: ``"none"``."""
    last_error: str | None = None
    """Why the last call's scores hold NaN, when the reward knows (e.g. a remote one); :attr:`failures` reads it."""
    modality: str = "any"
    """What ``__call__`` scores: ``"image"`` (images [B, 3, H, W]; the eval does not ask :meth:`evaluate` of videos),
    ``"video"`` (videos [B, F, 3, H, W] only: refused at load with a model that samples images) or ``"any"``
    (whatever it is given). The port's ``__call__`` receives what the model samples, so ``"any"``;
    :class:`flowrl_rewards.Reward` declares ``"image"`` and scores a video's frames one by one (a scorer of your own
    that declares ``"image"`` is still given videos whole: subclass Reward to have them split into frames)."""
    needs_source_image: bool = False
    """True: the term compares each sample with the source image its prompt carries (``meta["source_images"]``), so
    every prompt of its run must carry one (checked at load, :func:`flowrl.prompts.checks.check_prompt_images`)."""

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

    def check_prompt(self, prompt: str) -> None:
        """Raise ValueError for a prompt this scorer cannot score (its instruction text, without a source image); a
        run checks every prompt of its files at load, so a bad line fails with its line number, not when it is drawn.
        Accepts every prompt by default."""

    def check_ready(self) -> None:
        """Raise when the scorer cannot score now (e.g. a server that does not answer); called once at the start of
        a run, before any model time is spent. Ready by default."""
