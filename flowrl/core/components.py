"""Components by name: rollout plans, credit rules and policy objectives (docs/extending.md: a method
is a plan × a credit rule × a loss).

Each kind has a :class:`~flowrl.core.registry.Registry`, as rewards do: a config names a component by its registered
name (``rollout.plan: chains``), by ``package.module:Class`` or by ``path/to/file.py:Class``. The built-in components
and the base class of each kind sit in the methods layer, above this one: each package declares its own
(``flowrl/rollout/registry.py``, ``flowrl/credit/registry.py``, ``flowrl/objectives/registry.py``) and the package
facade wires them to their kind (:mod:`flowrl.core.wiring`), so a kind's registry lists them from its first use. A
component is a dataclass, and its fields are the keys of its config section, next to the few keys the loop itself owns
there (:data:`PLAN`'s ``max_batch`` and ``chunks``; the selector key itself)::

    rollout: {plan: my_pkg.plans:EveryOtherStep, max_batch: 64, group_size: 8, my_field: 3}

:func:`section_schema` turns the chosen class into the section's schema (a dataclass), so unknown keys
and ill-typed values fail at load naming the nearest valid key, for components outside the package
too; :func:`instantiate` builds the component from a loaded section, which checks the fields that declare
their choices (:mod:`flowrl.config.choices`). :func:`register` adds a name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional, Union

from flowrl.core.choices import Checked, check_choices, check_known
from flowrl.core.plugins import public_name
from flowrl.core.registry import LOAD_ERRORS, Registry
from flowrl.errors import ConfigError


@dataclass(frozen=True)
class Kind:
    """One kind of component: where it sits in the config. Its registry's built-ins and the class they must subclass
    are the methods layer's, registered when the registry is first used (:mod:`flowrl.core.wiring`)."""

    section: str  # config section, e.g. "rollout"
    selector: str  # key naming the component in that section, e.g. "plan"
    default: str  # registered name used when the key is absent
    loop_keys: tuple[tuple[str, type, Any], ...] = ()  # (name, type, default) owned by the loop
    registry: Registry = field(default_factory=dict, compare=False, hash=False)  # given as a dict (the wired go first)

    def __post_init__(self) -> None:
        if not isinstance(self.registry, Registry):
            object.__setattr__(self, "registry", Registry(self.key, dict(self.registry), check=self._check))

    @property
    def key(self) -> str:
        return f"{self.section}.{self.selector}"

    def base_class(self) -> type:
        """The class every component of this kind subclasses (the built-ins' declaration gives it)."""
        return self.registry.base()

    def _check(self, cls: Any, label: str) -> None:
        """A component class: a dataclass subclassing :meth:`base_class`."""
        base = self.base_class()
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{label} resolves to {cls!r}, which is not a subclass of {public_name(base)}")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(
                f"{label}: {cls.__name__} must be a dataclass (its fields are the keys of the {self.section!r} section)"
            )


PLAN = Kind(
    "rollout",
    "plan",
    "chains",
    loop_keys=(
        ("max_batch", int, 64),  # states per model forward; training replays the same layout
        ("chunks", int, 1),
    ),  # roll out the groups in parts, scoring each while the next rolls out
)
"""Rollout plans (``rollout.plan``); the built-ins: :data:`flowrl.rollout.registry.PLANS`."""
CREDIT = Kind("credit", "rule", "group")
"""Credit rules (``credit.rule``); the built-ins: :data:`flowrl.credit.registry.RULES`."""
LOSS = Kind("loss", "objective", "clipped")
"""Objectives (``loss.objective``); the built-ins: :data:`flowrl.objectives.registry.OBJECTIVES`."""
KINDS: tuple[Kind, ...] = (PLAN, CREDIT, LOSS)


def register(kind: Kind, name: str, target: str | type) -> None:
    """Register ``target`` (a class or ``"module:Class"``) as ``name`` for ``kind`` (PLAN, CREDIT, LOSS)."""
    kind.registry.register(name, target)
    section_schema.cache_clear()


def name_of(component: Any) -> str:
    """The registered name of ``component``'s class (``ODEChains`` → ``"ode"``), else its class name."""
    cls = type(component)
    for kind in KINDS:
        for name, target in kind.registry.items():
            if target is cls or target == f"{cls.__module__}:{cls.__qualname__}":
                return name
    return cls.__name__


def resolve(kind: Kind, name: str, key: str | None = None) -> type:
    """The component class behind a registered name, ``module:Class`` or ``file.py:Class``; every failure a
    :class:`ConfigError` naming ``key`` (default: the kind's, e.g. ``rollout.plan``)."""
    try:
        return kind.registry.resolve(name, key)
    except ConfigError:
        raise
    except LOAD_ERRORS as e:
        raise ConfigError(str(e)) from None


def component_fields(cls: type) -> list[dataclasses.Field]:
    """The dataclass fields of ``cls`` that are config keys (init fields without ``metadata={"config": False}``)."""
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("config", True)]


def _config_type(t: Any) -> Any:
    """A type OmegaConf can check: ``X | None`` → Optional[X]; other unions and callables → Any."""
    origin = typing.get_origin(t)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return Optional[_config_type(args[0])]
        return Any
    if origin in (list, tuple):
        args = typing.get_args(t)
        return list[_config_type(args[0])] if args else list
    if origin is dict:
        args = typing.get_args(t)
        return dict[args[0], _config_type(args[1])] if args else dict
    if t in (int, float, bool, str, Any) or dataclasses.is_dataclass(t):
        return t
    return Any


@lru_cache(maxsize=None)
def section_schema(kind: Kind, name: str) -> type:
    """The schema (a dataclass) of ``kind``'s config section when it selects ``name``: the selector,
    the loop's keys, then the component's own fields with their defaults."""
    cls = resolve(kind, name)
    hints = typing.get_type_hints(cls)
    own = component_fields(cls)
    reserved = {kind.selector, *(k for k, _, _ in kind.loop_keys)}
    clash = sorted(reserved & {f.name for f in own})
    if clash:
        raise ConfigError(f"{kind.key}={name!r}: fields {clash} are reserved in the {kind.section!r} section")
    spec: list[tuple[str, Any, Any]] = [(kind.selector, str, field(default=name))]
    spec += [(k, t, field(default=d)) for k, t, d in kind.loop_keys]
    for f in own:
        default = (
            field(default_factory=f.default_factory)
            if f.default_factory is not dataclasses.MISSING
            else field(default=f.default)
            if f.default is not dataclasses.MISSING
            else field()
        )
        spec.append((f.name, _config_type(hints.get(f.name, Any)), default))
    schema = dataclasses.make_dataclass(f"{kind.section.title()}Section", spec)
    schema.__doc__ = f"The {kind.section!r} section for {kind.key}={name!r} ({cls.__module__}.{cls.__name__})."
    return schema


def instantiate(kind: Kind, section: Any) -> Any:
    """Build the component a loaded section selects, from the section's values of its fields."""
    name = getattr(section, kind.selector)
    cls = resolve(kind, name)
    kwargs = {f.name: getattr(section, f.name) for f in component_fields(cls) if hasattr(section, f.name)}
    try:
        component = cls(**kwargs)  # a Checked subclass (every base is one) checks its choices here
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    if not isinstance(component, Checked):
        check_choices(component, kind.section)
    return component


def _check_nested_keys(given: dict[str, Any], fields: list[dataclasses.Field], key: str, where: str) -> None:
    """Every key of ``given`` one of ``fields``, and every key of a nested mapping one of its section's fields (a field
    whose default is a dataclass), refused as every key is (:func:`flowrl.core.choices.check_known`)."""
    names = [f.name for f in fields]
    check_known(given, names, where, prefix=f"{key}.")
    for f in fields:
        value = given.get(f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default) and (isinstance(value, dict) or hasattr(value, "keys")):
            sub = dict(value)
            _check_nested_keys(sub, list(dataclasses.fields(default)), f"{key}.{f.name}", f"{where}'s {f.name}")


def build_nested(kind: Kind, spec: str | dict[str, Any], *, key: str, refuse: type | None = None) -> Any:
    """A component that another one wraps (e.g. ``rollout.inner`` of a probed or an explore plan), given in the
    one nested form: a name (registry name, ``module:Class`` or ``file.py:Class``, with its defaults) or a
    mapping ``{<selector>: name, key: value, ...}`` — the same form as a config section, nested fields as
    nested mappings (``{plan: chains, steps: 10, window: {mode: random}}``) — checked against that
    component's own fields like a section of the config. Errors name ``key``; a subclass of ``refuse`` (a
    wrapper wrapping its own kind) is refused before its keys are read."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException, ValidationError

    example = f"{key}: {{{kind.selector}: NAME, key: value, ...}}"
    if isinstance(spec, str):
        name, args = spec, {}
    elif isinstance(spec, dict) or hasattr(spec, "keys"):
        args = dict(spec)
        name = args.pop(kind.selector, None)
        if not isinstance(name, str):
            raise ConfigError(f"{key} needs {kind.selector!r}, the name of the component to build, e.g. {example}")
    else:
        raise ConfigError(f"{key}={spec!r} must be a name or a mapping, e.g. {example}")
    cls = resolve(kind, name, f"{key}.{kind.selector}")
    if refuse is not None and issubclass(cls, refuse):
        raise ConfigError(
            f"{key}.{kind.selector}={name!r} is a {refuse.__name__} too: a {refuse.__name__} cannot "
            "wrap another one; name the component to wrap"
        )
    _check_nested_keys(args, list(component_fields(cls)), key, f"{kind.section}.{kind.selector}={name!r}")
    given = OmegaConf.create(args)
    schema = OmegaConf.structured(section_schema(kind, name))
    try:
        section = OmegaConf.to_object(OmegaConf.merge(schema, given))
    except ValidationError as e:  # a value of the wrong type (every key was checked above)
        raise ConfigError(f"{key}: {getattr(e, 'full_key', '') or ''} {str(e).splitlines()[0]}".strip()) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: {e}") from None
    return instantiate(kind, section)
