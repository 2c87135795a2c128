"""Find a reward by name, ``module:Class`` or ``path/to/file.py:Class``.

Built-ins are registered lazily as ``"module:Class"`` strings so importing :mod:`flowrl_rewards` does not
import heavy optional dependencies (open_clip, transformers models) until a reward is built.
"""
from __future__ import annotations

import inspect
from typing import Any

from flowrl.core.registry import Registry
from flowrl_rewards.base import Reward

REGISTRY = Registry("reward", {
    "jpeg_compressibility": "flowrl_rewards.image_stats:JpegCompressibility",
    "jpeg_incompressibility": "flowrl_rewards.image_stats:JpegIncompressibility",
    "brightness": "flowrl_rewards.image_stats:Brightness",
    "saturation": "flowrl_rewards.image_stats:Saturation",
    "redness": "flowrl_rewards.image_stats:Redness",
    "shapes": "flowrl_rewards.shapes:ShapesReward",
    "clip_score": "flowrl_rewards.clip_score:ClipScore",
    "pickscore": "flowrl_rewards.pickscore:PickScore",
    "hpsv2": "flowrl_rewards.hpsv2:HPSv2",
    "imagereward": "flowrl_rewards.imagereward:ImageRewardScore",
    "aesthetic": "flowrl_rewards.aesthetic:Aesthetic",
    "remote": "flowrl_rewards.remote:RemoteReward",
    "ocr": "flowrl_rewards.ocr:OcrReward",
    "gdro_corrected": "flowrl_rewards.gdro_corrected:CorrectedScore",
    "geneval": "flowrl_rewards.geneval:GenEvalReward",
    "vlm_judge": "flowrl_rewards.vlm_judge:VlmJudge",
}, base=Reward)
"""Reward names → :class:`Reward` subclasses or ``"module:Class"`` (a :class:`flowrl.config.registry.Registry`)."""


def register(name: str, target: str | type) -> None:
    """Register ``target`` (a Reward subclass or ``"module:Class"``) under ``name``."""
    REGISTRY.register(name, target)


def resolve_reward_class(name: str) -> type:
    """The class behind a registry name, ``module:Class`` or ``file.py:Class`` (unknown names: a KeyError)."""
    return REGISTRY.resolve(name)


def _check_kwargs(name: str, cls: type, kwargs: dict[str, Any]) -> None:
    """Fail early, naming the accepted keywords, when ``kwargs`` has one ``cls`` does not take."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"reward {name!r} ({cls.__name__}) got unknown kwargs {unknown}; accepted: {accepted}")


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Instantiate a reward by name (see module docstring) with keyword arguments."""
    cls = resolve_reward_class(name)
    _check_kwargs(name, cls, kwargs)
    reward = cls(**kwargs)
    if reward.name == Reward.name:  # the class kept the default: name it after how it was asked for
        reward.name = name.rsplit(":", 1)[-1] if ":" in name else name
    return reward
