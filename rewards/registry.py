"""Find a reward by name, ``module:Class`` or ``path/to/file.py:Class``.

Built-ins are registered lazily as ``"module:Class"`` strings so importing :mod:`rewards` does not
import heavy optional dependencies (open_clip, transformers models) until a reward is built.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rewards.base import Reward

REGISTRY: dict[str, str | type] = {
    "jpeg_compressibility": "rewards.image_stats:JpegCompressibility",
    "jpeg_incompressibility": "rewards.image_stats:JpegIncompressibility",
    "brightness": "rewards.image_stats:Brightness",
    "saturation": "rewards.image_stats:Saturation",
    "redness": "rewards.image_stats:Redness",
    "shapes": "rewards.shapes:ShapesReward",
}


def register(name: str, target: str | type) -> None:
    """Register ``target`` (a Reward subclass or ``"module:Class"``) under ``name``."""
    REGISTRY[name] = target


def _load_from_file(path: str, cls_name: str) -> type:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"reward plugin file {path!r} does not exist")
    mod_name = f"_flowrl_reward_plugin_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, cls_name):
        raise AttributeError(f"reward plugin file {path!r} has no class {cls_name!r}")
    return getattr(module, cls_name)


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
        mod_path, _, cls_name = target.rpartition(":")
        if mod_path.endswith(".py") or "/" in mod_path:
            cls = _load_from_file(mod_path, cls_name)
        else:
            try:
                module = importlib.import_module(mod_path)
            except ModuleNotFoundError as e:
                raise ModuleNotFoundError(f"reward {name!r}: cannot import module {mod_path!r} ({e})") from e
            if not hasattr(module, cls_name):
                raise AttributeError(f"reward {name!r}: module {mod_path!r} has no class {cls_name!r}")
            cls = getattr(module, cls_name)
    else:
        cls = target
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise TypeError(f"reward {name!r} resolves to {cls!r}, which is not a subclass of rewards.Reward")
    return cls


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Instantiate a reward by name (see module docstring) with keyword arguments."""
    cls = resolve_reward_class(name)
    reward = cls(**kwargs)
    if reward.name == Reward.name:  # the class kept the default: name it after how it was asked for
        reward.name = name.rsplit(":", 1)[-1] if ":" in name else name
    return reward
