"""One registry class for every kind of named thing: rollout plans, credit rules, objectives
(:data:`flowrl.core.components.KINDS`), rewards (:data:`flowrl_rewards.REGISTRY`), SDE kernels
(:data:`flowrl.rollout.sde.KERNEL_FUNCTIONS`) and model families (:data:`flowrl.models.MODEL_FAMILIES`).

A :class:`Registry` maps names to objects or to lazy ``"module:attr"`` strings (imported when resolved, so
registering the built-ins imports nothing heavy). :meth:`Registry.resolve` accepts a registered name,
``package.module:attr`` or ``path/to/file.py:attr`` (:func:`flowrl.core.plugins.load_target`); an unknown name
raises :class:`NotRegistered` naming the kind, the nearest name and the accepted ones. A registry is a
mutable mapping of its raw entries (``name in r``, ``r.pop(name)``, ``dict(r)``), writes checked by
:meth:`Registry.register`.

A registry names nothing above its own layer (tests/test_layers.py reads a ``"module:attr"`` string as an import): the
built-ins that do are declared in their own layer as :class:`Builtins` and wired to the registry's kind from above
(:mod:`flowrl.core.wiring`); the registry registers them, before its own entries, when it is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, NamedTuple

from flowrl.core import wiring
from flowrl.core.choices import did_you_mean
from flowrl.core.plugins import load_target, public_name
from flowrl.errors import ConfigError

LOAD_ERRORS = (ImportError, AttributeError, FileNotFoundError, ValueError, TypeError)
"""What resolving a ``module:attr`` name may raise; config code re-raises them as :class:`ConfigError`."""


class Builtins(NamedTuple):
    """A registry's built-ins, declared in the layer of what they name and wired to the registry's kind from above
    (:mod:`flowrl.core.wiring`): ``entries`` (name → object or ``"module:attr"``, checked as :meth:`Registry.register`
    checks them) and, where the registry's base class sits above it too (the component kinds: their base classes are
    the methods layer's), ``base`` (a class or its ``"module:Class"``)."""

    entries: dict[str, Any]
    base: type | str | None = None


class NotRegistered(ConfigError, KeyError):
    """A name that is neither registered nor ``module:attr``: a :class:`ConfigError`, and a ``KeyError`` (a
    registry is a mapping)."""

    __str__ = BaseException.__str__  # KeyError's would quote the message


class Registry(MutableMapping):
    """Names of one ``kind`` (errors call it so: ``"rollout.plan"``, ``"reward"``) → objects or ``"module:attr"``.

    ``base``: the class a ``module:attr`` target must subclass (or its ``"module:Class"``, imported when first
    needed; None: any object, e.g. a function). ``check(obj, label)``: raises when ``obj``, registered or
    resolved, is not acceptable (default: a subclass of ``base`` when given). The :class:`Builtins` wired to ``kind``
    (:mod:`flowrl.core.wiring`) are registered, before ``entries``, when the registry is first used (read or written;
    ``base`` None: their base, if they give one)."""

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
        self._wired = 0  # how many of the Builtins wired to ``kind`` are registered
        for name, target in (entries or {}).items():
            self._store(name, target)

    # ---- the mapping ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        self._fill()
        return self._entries[name]

    def __setitem__(self, name: str, target: Any) -> None:
        self.register(name, target)

    def __delitem__(self, name: str) -> None:
        self._fill()
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        self._fill()
        return iter(self._entries)

    def __len__(self) -> int:
        self._fill()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        self._fill()
        return isinstance(name, str) and name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        self._fill()
        return list(self._entries)

    # ---- the built-ins wired from above -----------------------------------------------------
    def _fill(self) -> None:
        """Register the :class:`Builtins` wired to :attr:`kind` (:mod:`flowrl.core.wiring`) not registered yet: each
        before the entries already there (a name registered directly wins), its ``base`` when the registry has none.
        A declaration that does not import raises, and is tried again on the next use."""
        wired = wiring.BUILTINS.get(self.kind, ())
        while self._wired < len(wired):
            target = wired[self._wired]
            self._wired += 1  # first: importing the declaration may use this registry
            base = self._base
            try:
                module, _, attr = target.partition(":")
                builtins = getattr(importlib.import_module(module), attr)
                if self._base is None:
                    self._base = builtins.base
                for name, entry in builtins.entries.items():
                    self._check_entry(name, entry)
            except BaseException:
                self._wired, self._base = self._wired - 1, base
                raise
            self._entries = {**builtins.entries, **self._entries}

    # ---- registering and resolving ----------------------------------------------------------
    def base(self) -> type | None:
        """The class targets must subclass (imported on first use), or None."""
        self._fill()
        return self._base_class()

    def _base_class(self) -> type | None:
        if isinstance(self._base, str):
            module, _, name = self._base.partition(":")
            self._base = getattr(importlib.import_module(module), name)
        return self._base

    @property
    def noun(self) -> str:
        """How errors spell the attribute of a ``module:attr`` target: ``Class`` or ``function``."""
        self._fill()
        return self._noun()

    def _noun(self) -> str:
        return "function" if self._base is None else "Class"

    def register(self, name: str, target: Any) -> None:
        """Make ``target`` (an object, or ``"module:attr"`` imported when resolved) available as ``name``."""
        self._fill()
        self._store(name, target)

    def _store(self, name: str, target: Any) -> None:
        """:meth:`register` without registering the wired built-ins first (the constructor's entries)."""
        self._check_entry(name, target)
        self._entries[name] = target

    def _check_entry(self, name: str, target: Any) -> None:
        """Raise unless ``name`` and ``target`` may be registered (see :meth:`register`)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be a non-empty string without ':'")
        if isinstance(target, str):
            if not all(target.rpartition(":")[::2]):
                raise ValueError(
                    f"{self.kind} {name!r}: a string target must be 'package.module:{self._noun()}' or "
                    f"'path/to/file.py:{self._noun()}'; got {target!r}"
                )
        else:
            self._validate(target, f"{self.kind}={name!r}")

    def resolve(self, name: str, key: str | None = None) -> Any:
        """The object behind a registered ``name``, ``package.module:attr`` or ``path/to/file.py:attr``; errors
        name ``key`` (default: the kind). Unknown names raise :class:`NotRegistered`; a ``module:attr`` that
        does not load raises one of :data:`LOAD_ERRORS`."""
        self._fill()
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
        base = self._base_class()  # no filling here: register and resolve fill first; the constructor must not
        if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
            raise TypeError(f"{label} resolves to {obj!r}, which is not a subclass of {public_name(base)}")
