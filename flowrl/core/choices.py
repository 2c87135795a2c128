"""Accepted values, declared once: a dataclass field lists its choices in its metadata, one function checks them.

A component (or a section nested in one) declares them on the field::

    baseline: str = choice("mean", BASELINES)

and subclasses :class:`Checked` (the bases of plans, credit rules and objectives do), whose construction checks
every such field before the class's own ``__post_init__``: ``GroupAdvantage(baseline="x")`` raises the same
:class:`ConfigError` as ``credit.baseline: x`` in a config. :func:`choose` is the check itself, for values
that live outside a dataclass.

Every key read or refused: a component declares the fields its other settings leave unread
(:meth:`Checked.unread_fields`: field → why), and :meth:`Checked.unread_keys` names those set away from their
defaults; the config check refuses them for every component kind alike (:func:`flowrl.config.checks.check_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, ClassVar, Iterable

from flowrl.errors import ConfigError, shown


def did_you_mean(value: Any, names: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for the name of ``names`` nearest to ``value``, else ``""``."""
    close = difflib.get_close_matches(str(value), [str(n) for n in names], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choose(key: str, value: Any, accepted: Iterable[Any], error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` naming ``key``, ``value``, the nearest and all ``accepted`` values unless ``value`` is one."""
    accepted = tuple(accepted)
    if value not in accepted:
        raise error(f"{key}={shown(value)} is not supported{did_you_mean(value, accepted)}; accepted: {list(accepted)}")


def choice(default: Any, choices: Iterable[Any], **metadata: Any) -> Any:
    """A dataclass field with ``default`` that accepts only ``choices`` (checked by :func:`check_choices`)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices), **metadata})


def choices_of(f: dataclasses.Field) -> tuple | None:
    """The values field ``f`` accepts, or None when it declares none."""
    return f.metadata.get("choices")


def is_set(obj: Any, name: str) -> bool:
    """Whether the dataclass ``obj``'s field ``name`` holds another value than its declared default."""
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return getattr(obj, name) != default


def check_choices(obj: Any, prefix: str | None = None) -> None:
    """Check every field of the dataclass ``obj`` that declares choices; errors name ``prefix.field`` (default:
    the class's :attr:`Checked.config_key`, else its name)."""
    prefix = prefix or (obj.config_key if isinstance(obj, Checked) else "") or type(obj).__name__
    for f in dataclasses.fields(obj):
        accepted = choices_of(f)
        if accepted is not None:
            choose(f"{prefix}.{f.name}", getattr(obj, f.name), accepted)


class Checked:
    """Mixin of dataclasses whose fields may declare choices: constructing one checks them (:func:`check_choices`)
    before the class's own ``__post_init__``, which a subclass writes as usual (no ``super()`` call needed)."""

    config_key: ClassVar[str] = ""  # where its fields sit in the config, e.g. "credit" or "rollout.window"

    def unread_fields(self) -> dict[str, str]:
        """Fields that this component's other settings (or its class: an inherited key it never reads) leave
        unread: field name → why. Default: none."""
        return {}

    def unread_keys(self) -> dict[str, str]:
        """The keys (``<config_key>.<field>``) of :meth:`unread_fields` set away from their defaults: key → why. The
        config check refuses each, so every accepted key does something."""
        return {f"{self.config_key}.{name}": why for name, why in self.unread_fields().items() if is_set(self, name)}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None or getattr(own, "_checks_choices", False):
            return

        @functools.wraps(own)
        def __post_init__(self, *args: Any) -> None:
            if type(self).__post_init__ is __post_init__:  # the outermost one checks; super() calls do not again
                check_choices(self)
            own(self, *args)

        __post_init__._checks_choices = True  # type: ignore[attr-defined]
        cls.__post_init__ = __post_init__  # type: ignore[method-assign]

    def __post_init__(self) -> None:
        if type(self).__post_init__ is Checked.__post_init__:
            check_choices(self)
