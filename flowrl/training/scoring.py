"""Scoring in the loop: decode the states a forest asks to be scored, and score them in a background
thread so scoring overlaps the next rollout.

    nodes, future = request_scores(scorer, model, forest, max_batch)   # leaves + probed states
    ...                                                                 # next rollout runs meanwhile
    forest.record_scores(nodes, future.result())                        # raw score per reward term
    forest.combine_scores(multi_reward.combine)                         # reward (leaves), value (probes)

The scorer alone:

    scorer = BackgroundScorer(multi_reward)           # or any Reward
    fut = scorer.submit(images, prompts, meta)        # returns at once
    ...                                               # next rollout runs meanwhile
    components = fut.result()                         # {name: float32 [B]}; re-raises a reward's error
    total = multi_reward.combine(components)
    scorer.close()

One worker thread, so batches are scored in submission order and a reward model is never used by
two threads at once. Until the future is done the scorer owns ``images`` and ``meta``: do not modify
them in place (rewards may write diagnostics into ``meta``; read them after ``result()``).
Gradients are off in the worker (``Reward.__call__`` is ``no_grad``). ``enabled=False`` (or
``"auto"`` without CUDA) scores synchronously inside ``submit`` and returns a finished future, so
the calling code is the same either way.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch

from flowrl_rewards.base import Reward


def model_modality(model) -> str:
    """What the model samples, as its family declares it (:attr:`~flowrl.models.base.FlowModel.modality`)."""
    return model.modality


_WAITS = threading.local()  # .events: a list while a caller takes over the waiting (:func:`_not_waiting`)


def decode(model, latents: torch.Tensor, max_batch: int) -> torch.Tensor:
    """Images [S, 3, H, W] (a video family: videos [S, F, 3, H, W]) in [0, 1] on the CPU for clean latents
    [S, *latent_shape], ``max_batch`` at a time (:func:`decode_to_host`, waited for; under :func:`_not_waiting` the
    caller takes the event instead and the host does not wait)."""
    images, ready = decode_to_host(model, latents, max_batch)
    if ready is not None:
        events = getattr(_WAITS, "events", None)
        if events is None:
            ready.synchronize()
        else:
            events.append(ready)
    return images


@contextlib.contextmanager
def _not_waiting() -> Iterator[list]:
    """Inside, :func:`decode` hands its copies' events to the yielded list instead of waiting for them."""
    previous, _WAITS.events = getattr(_WAITS, "events", None), []
    try:
        yield _WAITS.events
    finally:
        _WAITS.events = previous


def decode_to_host(model, latents: torch.Tensor, max_batch: int) -> "tuple[torch.Tensor, torch.cuda.Event | None]":
    """:func:`decode` without waiting for the device: ``(images, ready)``, the images [S, 3, H, W] (or [S, F, 3, H, W])
    in one host buffer (pinned on CUDA) that is valid once ``ready`` (a CUDA event; None: valid now) has completed.
    The decodes are queued ``max_batch`` at a time, each copied into its rows of the buffer as it finishes."""
    if latents.shape[0] == 0:
        frames = (model.num_frames,) if model_modality(model) == "video" else ()
        return torch.zeros(0, *frames, 3, model.height, model.width), None
    out = None
    on_cuda = torch.device(model.device).type == "cuda"
    for i in range(0, latents.shape[0], max_batch):
        images = model.decode(latents[i:i + max_batch].to(model.device))
        if out is None:
            out = torch.empty((latents.shape[0], *images.shape[1:]), dtype=images.dtype,
                              pin_memory=on_cuda and images.device.type == "cuda")
        out[i:i + images.shape[0]].copy_(images, non_blocking=out.is_pinned())
    ready = None
    if out.is_pinned():
        ready = torch.cuda.Event()
        ready.record()
    return out, ready


def check_modality(model, rewards: Sequence[tuple[str, Reward]]) -> None:
    """At load, before the first rollout: a ConfigError naming the config key and the reward when a video reward
    (``modality="video"``) is asked of a model that samples images. ``rewards``: (config key, reward or
    MultiReward) pairs, e.g. ``[("rewards", train_reward), ("eval.rewards", eval_reward)]``."""
    from flowrl.errors import ConfigError

    if model_modality(model) == "video":
        return  # image rewards score its frames (Reward.__call__), video rewards its videos
    for key, reward in rewards:
        for term in getattr(reward, "rewards", [reward]):
            if term.modality == "video":
                raise ConfigError(f"{key}: reward {term.name!r} ({type(term).__name__}) scores videos [B, F, 3, H, W] "
                                  f"only (modality 'video'), but model family {getattr(model, 'family', '?')!r} "
                                  "samples images [B, 3, H, W]; accepted with an image model: image rewards "
                                  "(modality 'image'). Remove it, or train a video family (e.g. model.family=wan)")


def request_scores(scorer: "BackgroundScorer", model, forest, max_batch: int
                   ) -> "tuple[torch.Tensor, cf.Future[dict[str, torch.Tensor]]]":
    """Decode every state ``forest`` asks to be scored (leaves, then probes) and submit them to ``scorer``.
    Returns the scored nodes [S] and the future of their raw scores ``{name: [S]}``; counts the decoded
    states in ``forest.counters["scored"]``. The host does not wait for the decodes: the scorer's thread does
    (:func:`decode_to_host`), so with a background scorer the next rollout is launched at once."""
    nodes, x0 = forest.score_requests()
    with _not_waiting() as events:
        images = decode(model, x0, max_batch)
    ready = events[-1] if events else None
    forest.counters["scored"] = forest.counters.get("scored", 0) + int(nodes.numel())
    return nodes, scorer.submit(images, [forest.prompts[g] for g in forest.group[nodes].tolist()], {}, ready=ready)


def components_of(reward: Reward, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any]
                  ) -> dict[str, torch.Tensor]:
    """A reward's per-term scores: ``MultiReward.components`` or ``{reward.name: reward(...)}``. Prompts that carry a
    source image reach it as their instruction text with ``meta["source_images"]``
    (:func:`flowrl.prompts.images.reward_inputs`)."""
    from flowrl.prompts.images import reward_inputs
    from flowrl_rewards.multi import MultiReward

    prompts, meta = reward_inputs(prompts, meta, images)

    if isinstance(reward, MultiReward):
        return reward.components(images, prompts, meta)
    return {reward.name: reward(images, prompts, meta)}


def _score_when_ready(reward: Reward, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any],
                      ready: "torch.cuda.Event | None") -> dict[str, torch.Tensor]:
    """:func:`components_of` once the images' copies (``ready``; None: none in flight) have landed."""
    if ready is not None:
        ready.synchronize()
    return components_of(reward, images, prompts, meta)


class BackgroundScorer:
    """Runs ``components_of(reward, ...)`` on one worker thread.

    Args:
      reward: a :class:`~flowrl_rewards.MultiReward` or any :class:`~flowrl_rewards.Reward`.
      enabled: True (thread), False (synchronous) or ``"auto"`` (thread iff CUDA is available).
    """

    def __init__(self, reward: Reward, enabled: bool | str = True):
        if not isinstance(reward, Reward):
            raise TypeError(f"BackgroundScorer needs a flowrl_rewards.Reward, got {type(reward).__name__}")
        if enabled == "auto":
            enabled = torch.cuda.is_available()
        if not isinstance(enabled, bool):
            raise ValueError(f"BackgroundScorer: enabled={enabled!r} must be True, False or 'auto'")
        self.reward, self.enabled = reward, enabled
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-scorer") if enabled else None
        self._closed = False

    def submit(self, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any] | None = None,
               ready: "torch.cuda.Event | None" = None) -> "cf.Future[dict[str, torch.Tensor]]":
        """Start scoring; a future of ``{name: float32 [B]}`` (the reward's exception, if it fails). ``ready``: an
        event the images wait for (copies still in flight, :func:`decode_to_host`), waited for by the worker."""
        if self._closed:
            raise RuntimeError("BackgroundScorer.submit after close()")
        meta = {} if meta is None else meta
        prompts = list(prompts)
        if self._pool is not None:
            return self._pool.submit(_score_when_ready, self.reward, images, prompts, meta, ready)
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(_score_when_ready(self.reward, images, prompts, meta, ready))
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


class RewardsFailed(FloatingPointError):
    """Every reward failed (all NaN) several iterations in a row: the run stops with exit status 3."""


class FailedRewardStreak:
    """Counts iterations in a row whose every leaf's reward failed (``reward_failed`` == ``leaves``); the
    ``limit``-th (``train.max_failed_iterations``) raises :class:`RewardsFailed` naming the rewards that failed
    and why (:attr:`flowrl_rewards.MultiReward.failures` of the last call), instead of training on nothing."""

    def __init__(self, limit: int, reward: Reward):
        self.limit, self.reward, self.count = int(limit), reward, 0

    def observe(self, record: dict[str, float]) -> None:
        """Fold in one iteration's metrics (global over processes, so every process decides alike)."""
        leaves, failed = record.get("leaves", 0.0), record.get("reward_failed", 0.0)
        self.count = self.count + 1 if leaves > 0 and failed >= leaves else 0
        if self.count >= self.limit:
            failures = getattr(self.reward, "failures", None) or {}
            why = "; ".join(f"reward {name!r}: {text}" for name, text in failures.items()) or (
                f"rewards {[r.name for r in getattr(self.reward, 'rewards', [self.reward])]} gave no error, "
                "but every combined reward was NaN")
            raise RewardsFailed(f"every reward failed in {self.count} iterations in a row (train.max_failed_iterations="
                                f"{self.limit}; the last: {failed:.0f} of {leaves:.0f} images); last error: {why}. Fix "
                                "the reward (or its server) and continue with train.resume=latest")
