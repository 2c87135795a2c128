"""Scoring in the background, so scoring overlaps the next rollout::

    scorer = BackgroundScorer(multi_reward)           # or any Reward (a flowrl_rewards.Scorer)
    fut = scorer.submit(images, prompts, meta)        # returns at once
    ...                                               # next rollout runs meanwhile
    components = fut.result()                         # {name: float32 [B]}; re-raises a reward's error
    total = multi_reward.combine(components)
    scorer.close()

One worker thread, so batches are scored in submission order and a reward model is never used by two threads at
once. Until the future is done the scorer owns ``images`` and ``meta``: do not modify them in place (rewards may
write diagnostics into ``meta``; read them after ``result()``). Gradients are off in the worker
(``Reward.__call__`` is ``no_grad``). ``enabled=False`` (or ``"auto"`` without CUDA) scores synchronously inside
``submit`` and returns a finished future, so the calling code is the same either way.

It sits beside the port (:mod:`flowrl_rewards.core.port`), below the rollout plans that use it: it calls
:meth:`~flowrl_rewards.core.port.Scorer.components` and nothing of flowrl. What flowrl gives rewards for its prompts (an
edit prompt's instruction text and source image, :func:`flowrl.rollout.scoring.components_of`) comes in as
``inputs``.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable, Sequence

import torch

from flowrl_rewards.core.port import Scorer

Inputs = Callable[[Sequence[str], dict[str, Any], torch.Tensor], "tuple[list[str], dict[str, Any]]"]
"""``(prompts, meta, images) → (prompts, meta)``: what the rewards receive for the prompts of ``images``."""


def _score_when_ready(
    scorer: Scorer,
    inputs: Inputs | None,
    images: torch.Tensor,
    prompts: list[str],
    meta: dict[str, Any],
    ready: "torch.cuda.Event | None",
) -> dict[str, torch.Tensor]:
    """``scorer.components`` of images [B, 3, H, W] (videos [B, F, 3, H, W]) once their copies (``ready``; None: none
    in flight) have landed, the prompts and meta first through ``inputs``."""
    if ready is not None:
        ready.synchronize()
    if inputs is not None:
        prompts, meta = inputs(prompts, meta, images)
    return scorer.components(images, prompts, meta)


class BackgroundScorer:
    """Runs ``reward.components(images, prompts, meta)`` on one worker thread.

    Args:
      reward: a :class:`~flowrl_rewards.core.port.Scorer`: a :class:`~flowrl_rewards.MultiReward` or any
        :class:`~flowrl_rewards.Reward`.
      enabled: True (thread), False (synchronous) or ``"auto"`` (thread iff CUDA is available).
      inputs: ``(prompts, meta, images) → (prompts, meta)`` applied in the worker before scoring (None: as given).
    """

    def __init__(self, reward: Scorer, enabled: bool | str = True, inputs: Inputs | None = None):
        if not isinstance(reward, Scorer):
            raise TypeError(
                f"BackgroundScorer needs a flowrl_rewards.Reward (a flowrl_rewards.Scorer), got {type(reward).__name__}"
            )
        if enabled == "auto":
            enabled = torch.cuda.is_available()
        if not isinstance(enabled, bool):
            raise ValueError(f"BackgroundScorer: enabled={enabled!r} must be True, False or 'auto'")
        self.reward, self.enabled, self.inputs = reward, enabled, inputs
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-scorer") if enabled else None
        self._closed = False

    def submit(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        meta: dict[str, Any] | None = None,
        ready: "torch.cuda.Event | None" = None,
    ) -> "cf.Future[dict[str, torch.Tensor]]":
        """Start scoring images [B, 3, H, W] (videos [B, F, 3, H, W]); a future of ``{name: float32 [B]}`` (the
        reward's exception, if it fails). ``ready``: an event the images wait for (copies still in flight,
        :func:`flowrl.rollout.decoding.decode_to_host`), waited for by the worker."""
        if self._closed:
            raise RuntimeError("BackgroundScorer.submit after close()")
        meta = {} if meta is None else meta
        args = (self.reward, self.inputs, images, list(prompts), meta, ready)
        if self._pool is not None:
            return self._pool.submit(_score_when_ready, *args)
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(_score_when_ready(*args))
        except Exception as e:  # delivered through the future, as in the threaded mode
            fut.set_exception(e)
        return fut

    def close(self, wait: bool = True) -> None:
        """Stop the worker (after pending batches when ``wait``, else cancelling those not started)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> "BackgroundScorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
