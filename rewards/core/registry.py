"""Find a reward by name, ``module:Class`` or ``path/to/file.py:Class``, and the settings it declares.

Built-ins are registered lazily as ``"module:Class"`` strings so importing :mod:`flowrl_rewards` does not
import heavy optional dependencies (open_clip, transformers models) until a reward is built.

A reward's settings (the keys of ``rewards[i].kwargs``) are derived once per class from its constructor's signature
(:func:`settings_of`: each keyword's name, default and annotation), or from a dataclass the class declares as
``Settings``; a constructor that takes ``**kwargs`` (and declares no ``Settings``) accepts any other key too. The
combiner takes a few term keys of its own (:data:`TERM_KWARGS` inside ``kwargs``; :data:`TERM_KEYS` beside it).
:func:`check_reward_kwargs` checks a term's kwargs against them by importing the class, never building it: the config
check calls it at load, :func:`build_reward` before the constructor runs, so both refuse a key with one message.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import lru_cache
from typing import Any, Callable, Iterable, Mapping

from flowrl.core.choices import check_known
from flowrl.core.registry import Registry
from flowrl.errors import ConfigError
from flowrl_rewards.core.base import Reward

REGISTRY = Registry(
    "reward",
    {
        "jpeg_compressibility": "flowrl_rewards.heuristics.image_stats:JpegCompressibility",
        "jpeg_incompressibility": "flowrl_rewards.heuristics.image_stats:JpegIncompressibility",
        "brightness": "flowrl_rewards.heuristics.image_stats:Brightness",
        "saturation": "flowrl_rewards.heuristics.image_stats:Saturation",
        "redness": "flowrl_rewards.heuristics.image_stats:Redness",
        "shapes": "flowrl_rewards.compositional.shapes:ShapesReward",
        "clip_score": "flowrl_rewards.preference.clip_score:ClipScore",
        "pickscore": "flowrl_rewards.preference.pickscore:PickScore",
        "hpsv2": "flowrl_rewards.preference.hpsv2:HPSv2",
        "hpsv3": "flowrl_rewards.preference.hpsv3:HPSv3",
        "imagereward": "flowrl_rewards.preference.imagereward:ImageRewardScore",
        "aesthetic": "flowrl_rewards.preference.aesthetic:Aesthetic",
        "remote": "flowrl_rewards.serving.remote:RemoteReward",
        "ocr": "flowrl_rewards.text.ocr:OcrReward",
        "gdro_corrected": "flowrl_rewards.heuristics.gdro_corrected:CorrectedScore",
        "geneval": "flowrl_rewards.compositional.geneval:GenEvalReward",
        "vlm_judge": "flowrl_rewards.judges.vlm_judge:VlmJudge",
    },
    base=Reward,
)
"""Reward names → :class:`Reward` subclasses or ``"module:Class"`` (a :class:`flowrl.core.registry.Registry`)."""


Secret = Callable[[str, Iterable[str]], bool]
"""Whether a refused setting is or looks like a secret (its value then not shown), given it and the accepted ones:
the config check passes :func:`flowrl.config.checks.looks_secret`."""


class _NoDefault:
    """The default of a setting that must be given."""

    def __repr__(self) -> str:
        return "<required>"


NO_DEFAULT: Any = _NoDefault()


@dataclasses.dataclass(frozen=True)
class RewardSetting:
    """One setting of a reward: its ``name``, ``default`` (:data:`NO_DEFAULT`: it must be given), ``annotation`` (its
    type as written) and ``note`` (what it does, where known)."""

    name: str
    default: Any = NO_DEFAULT
    annotation: str = ""
    note: str = ""

    @property
    def required(self) -> bool:
        return self.default is NO_DEFAULT


TERM_KWARGS = (RewardSetting("frame_stride", 1, "int", "the combiner's: on videos, score every k-th frame"),)
"""Keys of a term's ``kwargs`` the combiner (:class:`flowrl_rewards.MultiReward`) takes, not the reward's
constructor."""

TERM_KEYS = (
    RewardSetting("weight", 1.0, "float", "its weight in the sum"),
    RewardSetting("label", None, "str | None", "its metric name, to use one reward twice"),
    RewardSetting("timeout", None, "float | None", "seconds one call may take; past it its scores are NaN"),
)
"""A reward term's own keys beside ``name`` and ``kwargs`` (the config's ``RewardTerm``, the combiner's
``RewardSpec``)."""


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """What a reward class accepts as keywords: its ``own`` settings, and whether it takes any other key (``open``: a
    constructor with ``**kwargs`` and no declared ``Settings``)."""

    reward: type
    own: tuple[RewardSetting, ...]
    open: bool = False

    def names(self, term: bool = False) -> list[str]:
        """The accepted keys: its own, then (``term``) the combiner's :data:`TERM_KWARGS`."""
        return [s.name for s in self.own + (TERM_KWARGS if term else ())]

    def check(
        self,
        name: str,
        kwargs: Mapping[str, Any],
        key: str | None = None,
        term: bool = False,
        secret: Secret | None = None,
    ) -> None:
        """Every key of ``kwargs`` one of :meth:`names` (unless ``open``) and every required setting given; else a
        ConfigError naming ``key.<setting>`` (``key``: e.g. ``rewards[0].kwargs``; None: the setting alone), the
        value (not shown where ``secret(setting, accepted)`` says it is or looks like a secret) and the accepted
        keys (:func:`flowrl.core.choices.refuse_key`)."""
        where = f"{key}." if key else ""
        whose = f"reward {name!r} ({self.reward.__name__})"
        accepted = self.names(term)
        if not self.open:
            for k, v in kwargs.items():
                if k not in accepted:
                    hide = bool(secret and secret(k, accepted))
                    check_known([k], accepted, whose, prefix=where, value=v, secret=hide)
        missing = [s.name for s in self.own if s.required and s.name not in kwargs]
        if missing:
            raise ConfigError(
                f"{where}{missing[0]} must be set: {whose} has no default for it; its settings: {accepted}"
            )


def register(name: str, target: str | type) -> None:
    """Register ``target`` (a Reward subclass or ``"module:Class"``) under ``name``."""
    REGISTRY.register(name, target)


def resolve_reward_class(name: str, key: str | None = None) -> type:
    """The class behind a registry name, ``module:Class`` or ``file.py:Class`` (unknown names: a KeyError); errors name
    ``key`` (default: ``reward``)."""
    return REGISTRY.resolve(name, key)


def _annotation(value: Any) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return ""
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _declared(settings: type) -> tuple[RewardSetting, ...]:
    """The fields of a reward's declared ``Settings`` dataclass."""
    out = []
    for f in dataclasses.fields(settings):
        if not f.init:
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else NO_DEFAULT
        )
        out.append(RewardSetting(f.name, default, _annotation(f.type), str(f.metadata.get("help", ""))))
    return tuple(out)


@lru_cache(maxsize=None)
def settings_of(cls: type) -> RewardSettings:
    """The settings of the reward class ``cls``, derived once: the fields of its ``Settings`` dataclass when it
    declares one, else its constructor's keyword parameters (name, default, annotation; ``**kwargs``: open)."""
    declared = getattr(cls, "Settings", None)
    if isinstance(declared, type) and dataclasses.is_dataclass(declared):
        return RewardSettings(cls, _declared(declared))
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read (e.g. a C type): any key
        return RewardSettings(cls, (), open=True)
    own = tuple(
        RewardSetting(p.name, NO_DEFAULT if p.default is p.empty else p.default, _annotation(p.annotation))
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    return RewardSettings(cls, own, open=any(p.kind is p.VAR_KEYWORD for p in params))


def check_reward_kwargs(
    name: str, kwargs: Mapping[str, Any], key: str | None = None, term: bool = False, secret: Secret | None = None
) -> type:
    """Check ``kwargs`` against the settings of reward ``name`` (:meth:`RewardSettings.check`; ``term``: the combiner's
    :data:`TERM_KWARGS` accepted too) by importing its class, not building it; returns the class. ``key`` names the
    kwargs in errors (``rewards[0].kwargs``; its name is checked as ``rewards[0].name``). The reward terms nested in
    its settings (:attr:`Reward.nested_terms`: ``gdro_corrected``'s ``reward`` and ``quality``) are checked the same
    way, with the key that reaches them (``eval.rewards[0].kwargs.quality[1].kwargs.scroe``)."""
    cls = resolve_reward_class(name, key and f"{key.rpartition('.')[0]}.name")
    settings_of(cls).check(name, kwargs, key, term, secret)
    base = f"{key}." if key else ""
    for setting, spec in nested_specs(cls, kwargs):
        inner, given = term_spec(spec, f"{base}{setting}", name)
        check_reward_kwargs(inner, given, f"{base}{setting}.kwargs", secret=secret)
    return cls


TERM_FORM = ("name", "kwargs")
"""The keys of a nested reward term given as a mapping: ``{name: NAME, kwargs: {...}}`` (a bare ``NAME`` is one too)."""


def nested_specs(cls: type, kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(setting, term) of each reward term nested in ``kwargs`` of reward class ``cls``, by what it declares
    (:attr:`Reward.nested_terms`): ``("reward", spec)``, ``("quality[0]", spec)``, … (a list setting given one term
    counts as a list of one)."""
    out = []
    for setting, many in getattr(cls, "nested_terms", {}).items():
        if setting not in kwargs:
            continue
        value = kwargs[setting]
        if value is None and many:
            continue
        if value is None:  # one term, given as null: refused by term_spec with the key that reaches it
            out.append((setting, value))
            continue
        if many and (isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"):
            out += [(f"{setting}[{i}]", v) for i, v in enumerate(value) if v is not None]
        else:
            out.append((f"{setting}[0]" if many else setting, value))
    return out


def term_spec(spec: Any, key: str, owner: str) -> tuple[str, dict[str, Any]]:
    """(name, kwargs) of a nested reward term: a registry name (or ``module:Class``) or a ``{name, kwargs}`` mapping
    (:data:`TERM_FORM`), its keys refused as every key is; ``key`` names the setting, ``owner`` the reward that nests
    it."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict) or hasattr(spec, "keys"):
        spec = dict(spec)
        check_known(spec, TERM_FORM, f"a {owner} term {{name: NAME, kwargs: {{...}}}}", prefix=f"{key}.")
        if "name" not in spec:
            raise ConfigError(f"{owner}: {key} needs 'name', the reward to build: {{name: NAME, kwargs: {{...}}}}")
        kwargs = spec.get("kwargs") or {}
        if not (isinstance(kwargs, dict) or hasattr(kwargs, "keys")):
            raise ConfigError(f"{owner}: {key}.kwargs={kwargs!r} must be a mapping of the reward's settings")
        return str(spec["name"]), dict(kwargs)
    raise ConfigError(f"{owner}: {key}={spec!r} must be a reward name or {{name: NAME, kwargs: {{...}}}}")


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Instantiate a reward by name (see module docstring) with keyword arguments, checked first against its
    settings (:func:`check_reward_kwargs`: a ConfigError naming the key and the accepted ones)."""
    cls = check_reward_kwargs(name, kwargs)
    reward = cls(**kwargs)
    if reward.name == Reward.name:  # the class kept the default: name it after how it was asked for
        reward.name = name.rsplit(":", 1)[-1] if ":" in name else name
    return reward
