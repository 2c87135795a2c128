"""Find a reward by name, ``module:Class`` or ``path/to/file.py:Class``.

Built-ins are registered lazily as ``"module:Class"`` strings so importing :mod:`rewards` does not
import heavy optional dependencies (open_clip, transformers models) until a reward is built.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any

from flowrl.plugins import load_target
from rewards.base import Reward

REGISTRY: dict[str, str | type] = {
    "jpeg_compressibility": "rewards.image_stats:JpegCompressibility",
    "jpeg_incompressibility": "rewards.image_stats:JpegIncompressibility",
    "brightness": "rewards.image_stats:Brightness",
    "saturation": "rewards.image_stats:Saturation",
    "redness": "rewards.image_stats:Redness",
    "shapes": "rewards.shapes:ShapesReward",
    "clip_score": "rewards.clip_score:ClipScore",
    "pickscore": "rewards.pickscore:PickScore",
    "hpsv2": "rewards.hpsv2:HPSv2",
    "imagereward": "rewards.imagereward:ImageRewardScore",
    "aesthetic": "rewards.aesthetic:Aesthetic",
    "remote": "rewards.remote:RemoteReward",
}


def register(name: str, target: str | type) -> None:
    """Register ``target`` (a Reward subclass or ``"module:Class"``) under ``name``."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward registry name {name!r} must be a non-empty string without ':'")
    if isinstance(target, str):
        if target.count(":") < 1 or not all(target.rpartition(":")[::2]):
            raise ValueError(f"register({name!r}, {target!r}): a string target must be 'module:Class' "
                             "or 'file.py:Class'")
    elif not (isinstance(target, type) and issubclass(target, Reward)):
        raise TypeError(f"register({name!r}, {target!r}): target must be a rewards.Reward subclass or 'module:Class'")
    REGISTRY[name] = target


def resolve_reward_class(name: str) -> type:
    """The class behind a registry name, ``module:Class`` or ``file.py:Class``."""
    target: Any = REGISTRY.get(name)
    if target is None:
        if ":" not in name:
            close = difflib.get_close_matches(name, list(REGISTRY), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(
                f"reward name {name!r} is not registered{hint}; registered: {sorted(REGISTRY)}; "
                "or give 'package.module:Class' or 'path/to/file.py:Class'"
            )
        target = name
    if isinstance(target, str):
        return load_target(target, f"reward {name!r}", "reward plugin file", Reward)
    cls = target
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise TypeError(f"reward {name!r} resolves to {cls!r}, which is not a subclass of rewards.Reward")
    return cls


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
