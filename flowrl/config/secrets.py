"""Settings that hold secrets, and their redaction wherever a config is written (``config.yaml``, checkpoints,
trackers' hparams, ``--help``).

A reward term's kwargs key is a secret when its name says so (:data:`SECRET_NAMES`: ``api_key``, ``token``, …);
``headers`` keeps its names and hides every value (an ``Authorization`` header is a key). Secrets belong in the
environment: a served judge reads ``api_key_env``, the reward server ``--token-env``; a config loaded back from a run
folder holds :data:`REDACTED` where a secret was, and :func:`refuse_redacted` asks for it again instead of sending the
placeholder to a server.
"""

from __future__ import annotations

import copy
from typing import Any

from flowrl.errors import ConfigError

REDACTED = "<redacted>"
SECRET_NAMES = ("api_key", "token", "password", "secret", "authorization", "bearer")
HEADERS = "headers"
REWARD_SECTIONS = (("rewards",), ("eval", "rewards"))


def is_secret(name: str) -> bool:
    """Whether a reward setting named ``name`` holds a secret (by its name, any case)."""
    lowered = str(name).lower()
    return any(word in lowered for word in SECRET_NAMES) and not lowered.endswith("_env")


def redact_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A copy of one reward term's kwargs with every secret value replaced by :data:`REDACTED`."""
    out = {}
    for key, value in kwargs.items():
        if key == HEADERS and isinstance(value, dict):
            out[key] = {name: REDACTED for name in value}
        elif is_secret(key) and value not in (None, ""):
            out[key] = REDACTED
        else:
            out[key] = value
    return out


def _terms(tree: dict[str, Any]):
    """``(key, term)`` for every reward term (a dict) of a config dict: ``rewards[i]`` and ``eval.rewards[i]``."""
    for path in REWARD_SECTIONS:
        node: Any = tree
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        for i, term in enumerate(node or []):
            if isinstance(term, dict):
                yield f"{'.'.join(path)}[{i}]", term


def redacted(tree: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a config dict (:meth:`TrainConfig.to_dict`'s form) with every reward secret redacted."""
    out = copy.deepcopy(tree)
    for _, term in _terms(out):
        term["kwargs"] = redact_kwargs(dict(term.get("kwargs") or {}))
    return out


def refuse_redacted(tree: dict[str, Any]) -> None:
    """Refuse a config whose reward settings still hold :data:`REDACTED` (a run's saved config used again): the
    secret is asked for again, naming the key and where to give it."""
    for where, term in _terms(tree):
        for key, value in dict(term.get("kwargs") or {}).items():
            values = value.values() if key == HEADERS and isinstance(value, dict) else [value]
            if any(v == REDACTED for v in values):
                raise ConfigError(
                    f"{where}.kwargs.{key} is {REDACTED}: a run folder never stores a secret; "
                    "give it again (a served judge reads it from the environment variable its "
                    "api_key_env names), or pass the config file the run was started with"
                )
