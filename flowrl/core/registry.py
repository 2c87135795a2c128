"""One registry class for every kind of named thing: rollout plans, credit rules, objectives
(:data:`flowrl.core.components.KINDS`), rewards (:data:`flowrl_rewards.REGISTRY`), SDE kernels
(:data:`flowrl.rollout.sde.KERNEL_FUNCTIONS`) and model families (:data:`flowrl.models.MODEL_FAMILIES`).

A :class:`Registry` maps names to objects or to lazy ``"module:attr"`` strings (imported when resolved, so
registering the built-ins imports nothing heavy). :meth:`Registry.resolve` accepts a registered name,
``package.module:attr`` or ``path/to/file.py:attr`` (:func:`flowrl.core.plugins.load_target`); an unknown name
raises :class:`NotRegistered` naming the kind, the nearest name and the accepted ones. A registry is a
mutable mapping of its raw entries (``name in r``, ``r.pop(name)``, ``dict(r)``), writes checked by
:meth:`Registry.register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from flowrl.core.choices import did_you_mean
from flowrl.core.plugins import load_target, public_name
from flowrl.errors import ConfigError

LOAD_ERRORS = (ImportError, AttributeError, FileNotFoundError, ValueError, TypeError)
"""What resolving a ``module:attr`` name may raise; config code re-raises them as :class:`ConfigError`."""


class NotRegistered(ConfigError, KeyError):
    """A name that is neither registered nor ``module:attr``: a :class:`ConfigError`, and a ``KeyError`` (a
    registry is a mapping)."""

    __str__ = BaseException.__str__  # KeyError's would quote the message


class Registry(MutableMapping):
    """Names of one ``kind`` (errors call it so: ``"rollout.plan"``, ``"reward"``) → objects or ``"module:attr"``.

    ``base``: the class a ``module:attr`` target must subclass (or its ``"module:Class"``, imported when first
    needed; None: any object, e.g. a function). ``check(obj, label)``: raises when ``obj``, registered or
    resolved, is not acceptable (default: a subclass of ``base`` when given)."""

    def __init__(
        self,
        kind: str,
        entries: dict[str, Any] | None = None,
        *,
        base: type | str | None = None,
        check: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.kind = kind
        self._base = base
        self._check = check
        self._entries: dict[str, Any] = {}
        for name, target in (entries or {}).items():
            self.register(name, target)

    # ---- the mapping ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def __setitem__(self, name: str, target: Any) -> None:
        self.register(name, target)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    # ---- registering and resolving ----------------------------------------------------------
    def base(self) -> type | None:
        """The class targets must subclass (imported on first use), or None."""
        if isinstance(self._base, str):
            module, _, name = self._base.partition(":")
            self._base = getattr(importlib.import_module(module), name)
        return self._base

    @property
    def noun(self) -> str:
        """How errors spell the attribute of a ``module:attr`` target: ``Class`` or ``function``."""
        return "function" if self._base is None else "Class"

    def register(self, name: str, target: Any) -> None:
        """Make ``target`` (an object, or ``"module:attr"`` imported when resolved) available as ``name``."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be a non-empty string without ':'")
        if isinstance(target, str):
            if not all(target.rpartition(":")[::2]):
                raise ValueError(
                    f"{self.kind} {name!r}: a string target must be 'package.module:{self.noun}' or "
                    f"'path/to/file.py:{self.noun}'; got {target!r}"
                )
        else:
            self._validate(target, f"{self.kind}={name!r}")
        self._entries[name] = target

    def resolve(self, name: str, key: str | None = None) -> Any:
        """The object behind a registered ``name``, ``package.module:attr`` or ``path/to/file.py:attr``; errors
        name ``key`` (default: the kind). Unknown names raise :class:`NotRegistered`; a ``module:attr`` that
        does not load raises one of :data:`LOAD_ERRORS`."""
        key = key or self.kind
        label = f"{key}={name!r}"
        target = self._entries.get(name) if isinstance(name, str) else None
        if target is None:
            if ":" not in str(name):
                raise NotRegistered(
                    f"{label} is not registered{did_you_mean(name, self._entries)}; accepted: "
                    f"{sorted(self._entries)}, or 'package.module:{self.noun}' or "
                    f"'path/to/file.py:{self.noun}'"
                )
            target = str(name)
        obj = load_target(target, label, f"{key} file", self.base()) if isinstance(target, str) else target
        self._validate(obj, label)
        return obj

    def _validate(self, obj: Any, label: str) -> None:
        if self._check is not None:
            self._check(obj, label)
            return
        base = self.base()
        if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
            raise TypeError(f"{label} resolves to {obj!r}, which is not a subclass of {public_name(base)}")
