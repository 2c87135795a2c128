"""Errors shown to users and how values appear in their messages."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration key or value; the message names the key, the value and what is accepted."""


def shown(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 200k-character prompt is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 30]}…' ({len(str(value)):,} characters)"


def shown_path(value: object, limit: int = 120) -> str:
    """``repr(value)`` of a path (or a prompt spec) cut to ``limit`` characters keeping its end, so a long folder
    never hides the file's name."""
    text = repr(str(value))
    return text if len(text) <= limit else f"'…{text[-(limit - 2) :]}"


def shown_message(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, with its length when cut."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text):,} characters)"
