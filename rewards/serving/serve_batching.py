"""Scoring several clients' requests together: grouping, meta merged and split back, images decoded per group.

The scoring worker receives a list of checked requests (:class:`flowrl_rewards.serving.serve_limits.ScoreRequest`,
images
still encoded) and answers each with a :class:`Reply`:

- **groups**: requests are packed, in arrival order, into reward calls of at most ``max_images`` images that share
  one image size and have *compatible* meta. Meta is compatible when both requests have the same keys and each
  key is either per-sample in both (a list as long as the request's batch, as the ``remote`` reward slices it:
  the lists are concatenated) or equal in both (passed once). A request without images is scored alone.
- **decoding**: a group's images are decoded right before its reward call and dropped after it, so at most
  ``max_images`` decoded images exist at once. A request whose image fails to decode gets 400; the rest of its
  group is scored.
- **meta back**: of what the reward wrote (new keys, or keys named ``"<reward name>/..."``), a sequence as long as
  the group is split back per request; any other value describes the whole call and goes to every request of the
  group (a scalar diagnostic of a merged call covers the other clients' images too).
- **failures**: a reward exception on a merged group scores each of its requests alone, so one request that
  breaks the reward fails only itself (500 with the exception); a NaN score is ``null``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from flowrl_rewards.core.base import Reward
from flowrl_rewards.serving.serve_limits import IMAGE_FORMATS, ScoreRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Reply:
    """One request's answer: an HTTP status and its JSON body."""

    status: int
    body: dict


def is_per_sample(value: Any, n: int) -> bool:
    """Whether a meta ``value`` of a request of ``n`` samples is per-sample (a list of length ``n`` > 0)."""
    return n > 0 and isinstance(value, list) and len(value) == n


def _sequence_length(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, torch.Tensor) or hasattr(value, "shape") and hasattr(value, "ndim"):
        return int(value.shape[0]) if value.ndim >= 1 else None
    return None


@dataclasses.dataclass
class Group:
    """Requests scored in one reward call: their indices, image size, sample count and per-sample meta keys."""

    indices: list[int]
    size: tuple[int, int] | None
    n: int
    per_sample: frozenset[str]
    keys: frozenset[str]

    def accepts(self, request: ScoreRequest, max_images: int, scalars: dict[str, Any]) -> bool:
        """Whether ``request`` can join: same size, room for its images, the same meta keys, each per-sample in
        both or equal to the group's value (``scalars``)."""
        if self.n == 0 or len(request) == 0 or request.size != self.size or self.n + len(request) > max_images:
            return False
        if set(request.meta) != self.keys:
            return False
        for key, value in request.meta.items():
            if key in self.per_sample:
                if not is_per_sample(value, len(request)):
                    return False
            elif is_per_sample(value, len(request)) or value != scalars[key]:
                return False
        return True


def plan_groups(requests: Sequence[ScoreRequest], max_images: int, merge: bool = True) -> list[Group]:
    """Pack ``requests`` (in order) into reward calls; see the module docstring. ``merge=False``: one per request."""
    groups: list[Group] = []
    for i, request in enumerate(requests):
        if merge:
            for group in groups:
                if group.accepts(request, max_images, requests[group.indices[0]].meta):
                    group.indices.append(i)
                    group.n += len(request)
                    break
            else:
                groups.append(_new_group(i, request))
        else:
            groups.append(_new_group(i, request))
    return groups


def _new_group(index: int, request: ScoreRequest) -> Group:
    per_sample = frozenset(k for k, v in request.meta.items() if is_per_sample(v, len(request)))
    return Group([index], request.size, len(request), per_sample, frozenset(request.meta))


def merged_meta(requests: Sequence[ScoreRequest], per_sample: frozenset[str]) -> dict[str, Any]:
    """One meta for a group's requests: per-sample lists concatenated, other values the first request's."""
    if len(requests) == 1:
        return dict(requests[0].meta)
    meta = dict(requests[0].meta)
    for key in per_sample:
        meta[key] = [item for request in requests for item in request.meta[key]]
    return meta


def decode_images(request: ScoreRequest):
    """A request's images as uint8 numpy [n, H, W, 3] (RGB, each by its own range:
    :func:`flowrl.models.image_prompts.rgb_image`); ValueError naming the image that fails."""
    import numpy as np
    from PIL import Image

    from flowrl.models.image_prompts import rgb_image

    height, width = request.size
    out = np.empty((len(request), height, width, 3), dtype=np.uint8)
    for i, data in enumerate(request.images):
        try:
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                if img.size != (width, height):
                    raise ValueError(f"its header said {width} x {height}, it decodes to {img.size}")
                out[i] = np.asarray(rgb_image(img, f"images[{i}]"))  # a 16-bit PNG by its own range
        except Exception as e:  # truncated or corrupt data past a valid header
            raise ValueError(f"images[{i}] does not decode ({type(e).__name__}: {e})") from e
    return out


def to_float_images(arrays: list) -> torch.Tensor:
    """uint8 numpy arrays [n_i, H, W, 3] → float32 [Σn_i, 3, H, W] in [0, 1] (as the stdlib server decoded)."""
    import numpy as np

    stacked = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return torch.from_numpy(stacked).permute(0, 3, 1, 2).float().div(255.0)


def split_meta(meta: dict[str, Any], before: set[str], reward_name: str, counts: list[int]) -> list[dict]:
    """What the reward wrote into ``meta``, as JSON, for each request of a group of ``counts`` samples."""
    from flowrl_rewards.serving.remote import to_json

    total = sum(counts)
    outs: list[dict] = [{} for _ in counts]
    for key, value in meta.items():
        if key in before and not key.startswith(f"{reward_name}/"):
            continue
        if len(counts) > 1 and _sequence_length(value) == total:
            start = 0
            parts = []
            for n in counts:
                parts.append(value[start : start + n])
                start += n
        else:
            parts = [value] * len(counts)
        for out, part in zip(outs, parts):
            try:
                out[key] = to_json(part)
            except TypeError:
                pass
    return outs


def failure_reply(reward: Reward, error: BaseException) -> Reply:
    return Reply(500, {"error": f"reward {reward.name!r} failed: {type(error).__name__}: {error}"})


def score_group(reward: Reward, requests: list[ScoreRequest], per_sample: frozenset[str]) -> list[Reply]:
    """Decode the group's images, call the reward once, split scores and meta back; replies in request order."""
    arrays, kept, replies = [], [], [None] * len(requests)
    for i, request in enumerate(requests):
        if len(request) == 0:
            kept.append(i)
            continue
        try:
            arrays.append(decode_images(request))
            kept.append(i)
        except ValueError as e:
            replies[i] = Reply(400, {"error": f"bad request: {e}"})
    members = [requests[i] for i in kept]
    if members:
        if arrays:
            images = to_float_images(arrays)
        else:  # a request without images: the reward is called with an empty batch, as the stdlib server did
            images = torch.zeros(0, 3, 1, 1)
        del arrays
        meta = merged_meta(members, per_sample)
        before = set(meta)
        prompts = [p for request in members for p in request.prompts]
        try:
            scores = reward(images, prompts, meta)
        except Exception as e:
            if len(members) > 1:  # find the request that breaks the reward: each alone
                log.warning(
                    "reward %s failed on %d merged requests (%s: %s); scoring each alone",
                    reward.name,
                    len(members),
                    type(e).__name__,
                    e,
                )
                del images
                for i in kept:
                    replies[i] = score_group(reward, [requests[i]], per_sample)[0]
                return replies
            log.exception("reward %s failed", reward.name)
            replies[kept[0]] = failure_reply(reward, e)
            return replies
        counts = [len(request) for request in members]
        metas = split_meta(meta, before, reward.name, counts)
        values = [float(s) if math.isfinite(s) else None for s in scores.tolist()]
        start = 0
        for i, n, out_meta in zip(kept, counts, metas):
            replies[i] = Reply(200, {"scores": values[start : start + n], "meta": out_meta})
            start += n
    return replies


def score_requests(
    reward: Reward, requests: Sequence[ScoreRequest | Reply], max_images: int, merge: bool = True
) -> list[Reply]:
    """Answer every request (a :class:`Reply` given in place of a request is passed through); see the module
    docstring."""
    replies: list[Reply | None] = [r if isinstance(r, Reply) else None for r in requests]
    live = [i for i, r in enumerate(requests) if not isinstance(r, Reply)]
    checked = [requests[i] for i in live]
    for group in plan_groups(checked, max_images, merge):
        members = [checked[j] for j in group.indices]
        for j, reply in zip(group.indices, score_group(reward, members, group.per_sample)):
            replies[live[j]] = reply
    return replies
