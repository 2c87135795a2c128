"""The one reward interface.

A reward maps a batch of images to one score per image::

    scores = reward(images, prompts, meta)   # images [B, 3, H, W] float in [0, 1]; scores float32 [B]

``meta`` is a dict: on input it may carry per-sample information (e.g. ``meta["specs"]``); a reward
may add diagnostics to it (e.g. ``meta["shapes/task"]``). Rewards run without gradients and must be
deterministic for the same inputs.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


class Reward:
    """Base class of every reward. Subclasses implement :meth:`score`.

    Attributes: ``name`` (used in metric keys), ``higher_is_better`` (always True for training
    rewards; flip the sign in your subclass otherwise), ``last_error`` (a reward that returns NaN for
    samples it could not score may say why here; a run stopped because every reward failed names it).
    """

    name: str = "reward"
    last_error: str | None = None  # why the last call's scores hold NaN, when the reward knows (e.g. remote)

    def score(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]) -> torch.Tensor:
        """Scores float32 [B] for images [B, 3, H, W] in [0, 1]."""
        raise NotImplementedError

    def check_prompt(self, prompt: str) -> None:
        """Raise ValueError for a prompt this reward cannot score; a run checks every prompt of its files
        at the start (so a bad line fails at load, with its line number, not when it is drawn)."""

    def check_ready(self) -> None:
        """Raise when the reward cannot score now (e.g. a server that does not answer); called once at
        the start of a run, before any model time is spent."""

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None
    ) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"{self.name}: images must be [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        meta = {} if meta is None else meta
        out = self.score(images, list(prompts), meta)
        out = torch.as_tensor(out).detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        if out.shape[0] != images.shape[0]:
            raise RuntimeError(f"{self.name}: returned {out.shape[0]} scores for {images.shape[0]} images")
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
