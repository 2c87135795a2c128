"""Errors shown to users."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration key or value; the message names the key, the value and what is accepted."""
