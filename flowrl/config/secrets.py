"""Settings that hold secrets, and their redaction wherever a config is written (``config.yaml``, checkpoints,
trackers' hparams, ``--help``) or a command is (``flowrl compare``'s ``commands.sh``, ``results.md``, ``status.json``).

A reward term's kwargs key is a secret when its words say so (:func:`is_secret`: ``api_key``, ``hf_token``, …;
:data:`SECRET_NAMES` are the names a refusal treats as near-misses);
``headers`` keeps its names and hides every value (an ``Authorization`` header is a key); a URL keeps its form and
hides a password in its user part and the value of every secret-named query parameter (``?api_key=…``,
:func:`flowrl_rewards.core.urls.redact_url`). Secrets belong in the environment: a served judge and the ``remote``
reward read ``api_key_env``, the reward server ``--token-env``; a config loaded back from a run folder holds
:data:`REDACTED` where a secret was, and :func:`refuse_redacted` asks for it again instead of sending the placeholder
to a server. A URL with a user part (``http://user:password@host``) is refused at load (:func:`refuse_redacted`).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from flowrl.errors import ConfigError
from flowrl_rewards.core.urls import REDACTED, check_url, redact_url

__all__ = [
    "REDACTED",
    "SECRET_NAMES",
    "HEADERS",
    "is_secret",
    "redact_kwargs",
    "redacted",
    "refuse_redacted",
    "redact_override",
    "redact_command",
]

SECRET_NAMES = ("api_key", "token", "password", "secret", "authorization", "bearer")
HEADERS = "headers"
REWARD_SECTIONS = (("rewards",), ("eval", "rewards"))


SECRET_WORD_ENDS = ("token", "password", "passwd", "secret", "secrets", "apikey", "credential", "credentials")
"""A word of a setting's name ending so makes it a secret (``hf_token``, ``accessToken``, ``client_secret``); a word
that only begins so does not (``max_tokens``, ``tokenizer``)."""


def is_secret(name: str) -> bool:
    """Whether a reward setting named ``name`` holds a secret, by its words (split at ``_``, ``-``, ``.`` and
    camelCase, any case): ``api_key`` (``apiKey``), one ending as in :data:`SECRET_WORD_ENDS`, ``authorization`` or
    ``bearer``; an ``*_env`` setting names a variable, not a secret. ``max_tokens`` (a count) is not one."""
    text = str(name)
    lowered = text.lower()
    if lowered.endswith("_env"):
        return False
    words = [w.lower() for w in re.split(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])", text) if w]
    return "apikey" in re.sub(r"[^a-z0-9]", "", lowered) or any(
        w.endswith(SECRET_WORD_ENDS) or w in ("authorization", "bearer") for w in words
    )


def _redact(key: str | None, value: Any) -> Any:
    """``value`` of setting ``key`` with its secrets redacted: all of it for a secret-named key, every value of a
    ``headers`` mapping, the secret parts of a URL, and the same inside nested mappings and lists."""
    if key is not None and is_secret(key) and value not in (None, ""):
        return REDACTED
    if key == HEADERS and isinstance(value, dict):
        return {name: REDACTED for name in value}
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: _redact(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(None, v) for v in value]
    return value


def redact_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A copy of one reward term's kwargs with every secret value replaced by :data:`REDACTED` (a URL's secret parts
    only: its form stays readable)."""
    return {key: _redact(key, value) for key, value in kwargs.items()}


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


def _leaves(key: str, value: Any):
    """``(dotted key, value)`` of every leaf of a setting's value (mappings and lists walked)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{key}[{i}]", v)
    else:
        yield key, value


def refuse_redacted(tree: dict[str, Any]) -> None:
    """Refuse a config whose reward settings still hold :data:`REDACTED` (a run's saved config used again: the secret
    is asked for again, naming the key and where to give it), or a URL with a user part (credentials in a URL:
    refused naming the key, the password not shown)."""
    for where, term in _terms(tree):
        for name, value in dict(term.get("kwargs") or {}).items():
            for key, leaf in _leaves(f"{where}.kwargs.{name}", value):
                if not isinstance(leaf, str):
                    continue
                if leaf == REDACTED or (REDACTED in leaf and "://" in leaf):
                    what = "is" if leaf == REDACTED else f"is {redact_url(leaf)!r}, which holds"
                    raise ConfigError(
                        f"{key} {what} {REDACTED}: a run folder never stores a secret; give it again (a served "
                        "judge and the remote reward read it from the environment variable their api_key_env "
                        "names), or pass the config file the run was started with"
                    )
                try:
                    check_url(leaf, key)
                except ValueError as e:
                    raise ConfigError(str(e)) from None


# ---- commands (flowrl compare) -----------------------------------------------------------------------------
def _section_rest(key: str) -> list[str] | None:
    """The parts of an override's dotted ``key`` below its reward section (``rewards`` or ``eval.rewards``; ``[i]``
    read as ``.i``), or None for a key outside them."""
    parts = [p for p in re.split(r"[.\[\]]+", key.strip()) if p]
    for section in REWARD_SECTIONS:
        if tuple(parts[: len(section)]) == section:
            return parts[len(section) :]
    return None


def _redact_at(rest: list[str], value: Any) -> Any:
    """``value`` given at ``rest`` below a reward section (the list of terms, a term, its kwargs, one setting or a
    part of one) with its secrets redacted by :func:`redact_kwargs`'s rules, at any depth."""
    if HEADERS in rest[:-1]:  # one header's value
        return REDACTED if value not in (None, "") else value
    return _redact(rest[-1] if rest else None, value)


def redact_override(item: str) -> str:
    """A ``key=value`` override as it may be written or printed: a reward setting's secret (by the rules of
    :func:`redact_kwargs`) replaced by :data:`REDACTED`, the value written again in YAML's flow style; any other
    item unchanged. A reward value that does not parse is hidden whole."""
    key, sep, text = item.partition("=")
    rest = _section_rest(key) if sep else None
    if rest is None:
        return item
    import yaml
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)["value"]
    except Exception:  # noqa: BLE001 — refused at load anyway; never written as it came
        return f"{key}={REDACTED}"
    hidden = _redact_at(rest, value)
    if hidden == value:
        return item
    dumped = yaml.safe_dump(hidden, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
    return f"{key}={dumped.removesuffix('...').strip()}"


def redact_command(command: list[str]) -> list[str]:
    """A command line (``flowrl train CONFIG key=value …``) with every reward secret in its overrides redacted
    (:func:`redact_override`): what is written to a file or printed, never what is run."""
    return [redact_override(item) for item in command]
