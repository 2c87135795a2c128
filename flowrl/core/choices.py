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

One key path: every key refused (a config key, a component's field, a reward's setting or one nested in a reward's
setting, a model keyword, an unread key, ``eval.guard.reward``'s name) is refused by :func:`refuse_key`, with one
suggestion rule (:func:`nearest`) and one message form: ``KEY[=VALUE] PROBLEM WHERE (did you mean 'X'?); accepted:
[...]``. A key that is or looks like a secret (the caller says so: ``secret``) never shows its value.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, ClassVar, Iterable, NoReturn

from flowrl.errors import ConfigError, shown

SUGGESTION_CUTOFF = 0.6
"""How close (difflib's ratio) a name must come to be suggested: the one suggestion rule's cutoff."""


def nearest(value: Any, names: Iterable[Any]) -> str | None:
    """The one suggestion rule: the name of ``names`` nearest to ``value`` (difflib, :data:`SUGGESTION_CUTOFF`); for a
    dotted key none of whose full names comes near, the nearest last part among the keys of the same section
    (``rollout.prob`` → ``rollout.probe``). None when nothing comes near."""
    value, names = str(value), [str(n) for n in names]
    close = difflib.get_close_matches(value, names, n=1, cutoff=SUGGESTION_CUTOFF)
    if close:
        return close[0]
    section, dot, leaf = value.rpartition(".")
    if not dot:
        return None
    same = {n.rpartition(".")[2]: n for n in names if n.rpartition(".")[0] == section}
    close = difflib.get_close_matches(leaf, list(same), n=1, cutoff=SUGGESTION_CUTOFF)
    return same[close[0]] if close else None


def did_you_mean(value: Any, names: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for :func:`nearest`, else ``""``."""
    close = nearest(value, names)
    return f" (did you mean {close!r}?)" if close is not None else ""


class _NotGiven:
    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN: Any = _NotGiven()
HIDDEN_VALUE = "<not shown: the key looks like a secret>"
"""What a refusal shows in place of the value of a key that is or looks like a secret."""


def refuse_key(
    key: str,
    accepted: Iterable[Any],
    where: str = "",
    *,
    prefix: str = "",
    value: Any = NOT_GIVEN,
    secret: bool = False,
    problem: str = "is not a key of",
    note: str = "",
    suggest: bool = True,
    near: Any = NOT_GIVEN,
    among: Iterable[Any] | None = None,
    error: type[Exception] = ConfigError,
) -> NoReturn:
    """The one refusal of a key, of every kind: raise ``error`` with one message form,
    ``KEY[=VALUE] PROBLEM WHERE (did you mean 'X'?); accepted: [...]NOTE``: ``prefix`` + ``key`` as the config
    spells it (``rewards[0].kwargs.`` + ``mdoe``); ``value`` when given (a placeholder when ``secret``: the key is
    or looks like a secret); ``problem`` (default ``is not a key of``) and ``where`` the key came from (a reward, a
    component, a file); the suggestion, :func:`nearest` to ``near`` (default ``key``) among ``among`` (default
    ``accepted``), none with ``suggest`` False (a key that exists but nothing reads); every ``accepted`` key."""
    accepted = list(accepted)
    shown_value = "" if value is NOT_GIVEN else "=" + (HIDDEN_VALUE if secret else shown(value))
    where = f" {where}" if where else ""
    among = accepted if among is None else list(among)
    hint = did_you_mean(key if near is NOT_GIVEN else near, among) if suggest else ""
    raise error(f"{prefix}{key}{shown_value} {problem}{where}{hint}; accepted: {accepted}{note}")


def check_known(given: Iterable[Any], accepted: Iterable[Any], where: str = "", **refusal: Any) -> None:
    """Refuse (:func:`refuse_key`, with ``refusal``) the first key of ``given`` not in ``accepted``."""
    accepted = list(accepted)
    for k in given:
        if k not in accepted:
            refuse_key(k, accepted, where, **refusal)


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
