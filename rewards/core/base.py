"""The one reward interface.

A reward maps a batch of images to one score per image::

    scores = reward(images, prompts, meta)   # images [B, 3, H, W] float in [0, 1]; scores float32 [B]

``meta`` is a dict: on input it may carry per-sample information (e.g. ``meta["specs"]``); a reward
may add diagnostics to it (e.g. ``meta["shapes/task"]``). Rewards run without gradients and must be
deterministic for the same inputs.

Videos ``[B, F, 3, H, W]`` (a video family's decode) reach every reward through the same call: a reward
declares what it scores in :attr:`Reward.modality`. An ``"image"`` reward (the default; every plugin written
for images) scores frames 0, s, 2s, … (s = :attr:`Reward.frame_stride`) and returns each video's mean over
them; a ``"video"`` reward receives the video (those frames) whole; an ``"any"`` reward (the combiner,
:class:`flowrl_rewards.MultiReward`) receives what it is given. An image given to a video reward is refused, naming it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch

from flowrl_rewards.core.port import Scorer

MODALITIES = ("image", "video", "any")
"""What a reward scores (:attr:`Reward.modality`): images, videos whole, or whatever it is given."""


def check_frame_stride(name: str, value: Any) -> int:
    """``value`` as a frame stride (an int ≥ 1), else a ValueError naming reward ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"reward {name!r}: frame_stride={value!r} must be an integer >= 1 (score every k-th frame)")
    return value


class Reward(Scorer):
    """Base class of every reward: a :class:`~flowrl_rewards.core.port.Scorer` of one term, itself (its ``terms``,
    ``components``, ``combine``, ``failures``, ``evaluate`` and ``normalize`` are the port's defaults). Subclasses
    implement :meth:`score`; a reward with an eval summary overrides :meth:`evaluate`.

    Attributes: ``name`` (used in metric keys), ``higher_is_better`` (always True for training
    rewards; flip the sign in your subclass otherwise), ``last_error`` (a reward that returns NaN for
    samples it could not score may say why here; a run stopped because every reward failed names it),
    ``modality`` (``"image"``, ``"video"`` or ``"any"``: the module docstring) and ``frame_stride`` (every k-th
    frame of a video is scored; set from the ``frame_stride`` kwarg of any reward term by
    :class:`flowrl_rewards.MultiReward`), ``needs_source_image`` (True: it scores an edit against the image its
    prompt carries, so its prompts must carry one; checked at load). ``check_prompt`` (a ValueError for a prompt
    it cannot score) and ``check_ready`` (raises when it cannot score now) are the port's: accepting, and ready.
    """

    name: str = "reward"
    modality: str = "image"  # "video": score() receives videos [B, F, 3, H, W] whole
    # the settings whose value is a reward term of its own (a registry name or {name, kwargs}), each → whether it
    # takes a list of them: their kwargs are checked as every reward's are, at load and before the constructor runs
    # (flowrl_rewards.core.registry.check_reward_kwargs), and listed by `flowrl train --help`. gdro_corrected:
    # {"reward": False, "quality": True}
    nested_terms: ClassVar[Mapping[str, bool]] = {}
    frame_stride: int = 1  # videos: frames 0, k, 2k, … are scored
    # declared by the port with their defaults: last_error (why the last call's scores hold NaN, when the reward
    # knows, e.g. remote), needs_source_image (False; an edit reward: meta["source_images"] holds each prompt's
    # image), check_prompt (accepts every prompt) and check_ready (ready)

    def score(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """Scores float32 [B] for images [B, 3, H, W] in [0, 1] (``modality="video"``: videos [B, F, 3, H, W])."""
        raise NotImplementedError

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None
    ) -> torch.Tensor:
        video = images.ndim == 5
        if images.ndim not in (4, 5) or images.shape[-3] != 3:
            raise ValueError(
                f"{self.name}: images must be [B, 3, H, W] or videos [B, F, 3, H, W] in [0, 1], "
                f"got shape {tuple(images.shape)}"
            )
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        if self.modality not in MODALITIES:
            raise ValueError(
                f"reward {self.name!r} ({type(self).__name__}): modality={self.modality!r} is not one of {MODALITIES}"
            )
        if self.modality == "video" and not video:
            raise ValueError(
                f"reward {self.name!r} ({type(self).__name__}) scores videos [B, F, 3, H, W] only "
                f"(modality 'video'), got images of shape {tuple(images.shape)}"
            )
        meta = {} if meta is None else meta
        if video and self.modality != "any":
            images = images[:, :: check_frame_stride(self.name, self.frame_stride)]
        if video and self.modality == "image":  # each scored frame alone (meta stays per sample), then the mean
            return torch.stack([self._checked(images[:, t], prompts, meta) for t in range(images.shape[1])]).mean(0)
        return self._checked(images, prompts, meta)

    def _checked(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """:meth:`score` as float32 [B] on the CPU, one score per sample."""
        out = self.score(images, list(prompts), meta)
        out = torch.as_tensor(out).detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        if out.shape[0] != images.shape[0]:
            raise RuntimeError(f"{self.name}: returned {out.shape[0]} scores for {images.shape[0]} images")
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
