"""A deadline on one reward call (``rewards: [{name: ..., timeout: 30}]``).

    scores = call_with_timeout(reward, images, prompts, meta, timeout=30.0)   # RewardTimeout past 30 s

The call runs in a fresh daemon thread; the caller waits at most ``timeout`` seconds. Python cannot kill a
thread, so a call that overruns is *abandoned*: its thread keeps running in the background until the reward
returns (or the process exits: it is a daemon, so it never holds the process open), its result is dropped,
and the next call starts a new thread rather than queueing behind the hung one. An abandoned call that
wakes up later may still be using the reward's model while the next call runs; a reward that cannot be
called from two threads at once should not be given a timeout shorter than its slowest legitimate call.
``meta`` is copied for the call and its additions merged back only when the call finishes in time, so a
late call never writes into a batch it no longer belongs to.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from flowrl_rewards.core.base import Reward


class RewardTimeout(TimeoutError):
    """A reward call that did not return within its ``timeout``; the message names the reward and the limit."""


def call_with_timeout(
    reward: Reward, images: torch.Tensor, prompts: Sequence[str], meta: dict[str, Any], timeout: float
) -> torch.Tensor:
    """``reward(images, prompts, meta)`` in a new daemon thread; its scores, its exception re-raised here, or
    :class:`RewardTimeout` after ``timeout`` seconds (the thread is abandoned, see the module docstring)."""
    box: dict[str, Any] = {}
    done = threading.Event()
    own_meta = dict(meta)

    def work() -> None:
        try:
            box["scores"] = reward(images, prompts, own_meta)
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=work, name=f"reward-{reward.name}", daemon=True)
    thread.start()
    if not done.wait(timeout):
        raise RewardTimeout(
            f"reward {reward.name!r} ({type(reward).__name__}) did not return within its timeout of "
            f"{timeout:g} s on {len(prompts)} images (the call was abandoned)"
        )
    if "error" in box:
        raise box["error"]
    meta.update(own_meta)
    return box["scores"]
