"""Secrets in URLs: what of a URL is a secret, its redacted form, and the refusal of credentials written into one.

    redact_url("http://h:8000/score?api_key=sk-1&n=2")  # 'http://h:8000/score?api_key=<redacted>&n=2'
    check_url(url, "remote")                             # ValueError for http://user:password@host

A URL is shown, logged and written only as :func:`redact_url` gives it: a password in its user part and the value
of every query parameter whose name looks like a secret (:func:`is_secret_query_name`: ``api_key``, ``token``,
``key``, ``sig``, …) become :data:`REDACTED`. :func:`check_url` refuses a URL with a user part (``user:pass@``):
urllib does not send it (the host is then looked up as ``user:pass@host``), and a key belongs in a header read from
the environment (``api_key_env``), never in the URL. Standard library only: the config layer's redaction
(:mod:`flowrl.config.secrets`) and the rewards both use it.
"""

from __future__ import annotations

import re
import urllib.parse

REDACTED = "<redacted>"
SECRET_WORDS = ("api_key", "apikey", "token", "password", "passwd", "secret", "authorization", "bearer")
"""Parts of a name that make it a secret wherever they appear in it (``x_api_key``, ``access_token``)."""
SECRET_QUERY_WORDS = ("key", "sig", "signature", "auth", "credential", "credentials", "pass", "pwd", "session")
"""Words that make a query parameter a secret when they are a whole word of its name (``key``, ``x-amz-signature``),
not a part of one (``keyword``, ``passage``)."""


def is_secret_query_name(name: str) -> bool:
    """Whether the query parameter ``name`` holds a secret (any case): it contains one of :data:`SECRET_WORDS`, or one
    of its words (split at ``-``, ``_``, ``.``) is one of :data:`SECRET_QUERY_WORDS`."""
    lowered = str(name).lower()
    words = re.split(r"[-_.\s]+", lowered)
    return any(w in lowered for w in SECRET_WORDS) or any(w in SECRET_QUERY_WORDS for w in words)


def _parts(url: str) -> urllib.parse.SplitResult | None:
    if not isinstance(url, str) or "://" not in url:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return None
    return parts if parts.scheme and parts.netloc else None


def redact_url(url: str) -> str:
    """``url`` with its user part's password and the values of its secret-named query parameters replaced by
    :data:`REDACTED` (the rest as written); a string that is not a URL is returned unchanged."""
    parts = _parts(url)
    if parts is None:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if colon else f"{REDACTED}@{host}"  # a lone user part may be a token
    query = parts.query
    if query:
        fields = []
        for field in query.split("&"):
            name, eq, value = field.partition("=")
            plain = urllib.parse.unquote_plus(name)
            fields.append(f"{name}={REDACTED}" if eq and value and is_secret_query_name(plain) else field)
        query = "&".join(fields)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def has_secret(url: str) -> bool:
    """Whether :func:`redact_url` would hide anything of ``url``."""
    return redact_url(url) != url


def check_url(url: str, label: str) -> str:
    """``url`` when it holds no user part; else a ValueError naming the setting (``label``: e.g. ``"remote: url"``,
    ``"rewards[0].kwargs.url"``) with the URL redacted (never the password) and how to pass a key instead."""
    parts = _parts(url)
    if parts is not None and "@" in parts.netloc:
        raise ValueError(
            f"{label}={redact_url(url)!r} holds a user name and password (user:password@host): a URL never "
            "carries credentials here (urllib does not send them, and a URL is written to logs and configs); "
            "accepted: the URL without them, and the key in an environment variable named by api_key_env (sent "
            "as 'Authorization: Bearer <key>')"
        )
    return url
