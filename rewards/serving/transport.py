"""The HTTP transport of the served rewards (:mod:`flowrl_rewards.serving.remote`,
:mod:`flowrl_rewards.judges.vlm_judge_served`).

    body = fetch(url, timeout, data=payload, headers={"Authorization": "Bearer …"})   # POST; GET without data

Three guarantees on top of ``urllib``:

- **a total deadline**: connecting and reading the whole reply take at most ``timeout`` seconds together (a
  watchdog shuts the socket down at the deadline), not ``timeout`` per read: a server that drips its reply one
  byte a second fails after ``timeout`` seconds, not after ``timeout`` × bytes;
- **credentials stay at the origin**: a redirect is followed only to the same scheme, host and port (307 and 308
  keep the method and the body; 301, 302 and 303 only for a GET); any other is refused, naming the URL and the
  ``Location``, so ``Authorization`` and the other headers never reach another server (urllib would forward them,
  and turn a POST into a GET);
- **failures sorted**: :class:`TransientError` for what is worth retrying (connection refused or dropped, a timeout,
  5xx, 429), :class:`RemoteRewardError` for the rest (4xx, a malformed reply, a refused redirect), each naming the
  HTTP status and the server's words.

:func:`check_header_values` refuses, at load, header values with whitespace at an end or control characters (a key
read from a file often ends in a newline), naming the header, never the value.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request

from flowrl_rewards.core.urls import redact_url

log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """A served reward's request failed (after retries where the failure was transient)."""


class TransientError(Exception):
    """A failure worth retrying (connection refused or dropped, timeout, 5xx, 429); :func:`fetch` raises it."""


class RedirectRefused(RemoteRewardError):
    """A redirect that would take the request (and its credentials) to another origin, or turn a POST into a GET."""


# ---- secrets in headers ----------------------------------------------------------------------------------
CONTROL_NAMES = {"\n": "newline", "\r": "carriage return", "\t": "tab", "\x00": "NUL character"}


def unsafe_character(value: str, inner_spaces: bool = True) -> str | None:
    """What makes ``value`` unfit for an HTTP header holding a secret (a control or format character anywhere,
    whitespace at an end, or anywhere without ``inner_spaces``), described without showing the value; None when
    it is fit."""
    for i, ch in enumerate(value):
        edge = i in (0, len(value) - 1)
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") or (ch.isspace() and (edge or not inner_spaces)):
            name = CONTROL_NAMES.get(ch) or unicodedata.name(ch, "").lower() or "control character"
            where = "at its end" if i == len(value) - 1 else "at its start" if i == 0 else f"at character {i + 1}"
            return f"a {name} (U+{ord(ch):04X}) {where} (character {i + 1} of {len(value)})"
    return None


def check_header_values(headers: dict, owner: str) -> None:
    """A ValueError naming the header (never its value) whose value is not a clean string (:func:`unsafe_character`)."""
    for key, value in headers.items():
        if not isinstance(key, str) or not key or any(c in key for c in " :\t\r\n"):
            raise ValueError(f"{owner}: headers key {key!r} is not an HTTP header name")
        if not isinstance(value, str):
            raise ValueError(f"{owner}: headers[{key!r}] must be a string, got {type(value).__name__}")
        bad = unsafe_character(value)
        if bad:
            raise ValueError(
                f"{owner}: headers[{key!r}] holds {bad}; a header value holds no control characters "
                "and no whitespace at its ends (the value is not shown: it may be a secret)"
            )


# ---- redirects -------------------------------------------------------------------------------------------
def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``url``, the port made explicit (80 for http, 443 for https)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the request's own origin, and only where the method and body survive."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        method = req.get_method()
        why = None
        if origin(newurl) != origin(req.full_url):
            why = (
                "it leads to another scheme, host or port, which would receive the request's credentials "
                "(Authorization and the other headers)"
            )
        elif code in (301, 302, 303) and method != "GET":
            why = f"a {code} turns the {method} into a GET without its body"
        if why:
            fp.close()
            raise RedirectRefused(
                f"{redact_url(req.full_url)} answered HTTP {code} redirecting to Location: {redact_url(newurl)}; not "
                f"followed: {why}; if that server is the one meant, set the url to it"
            )
        if code in (307, 308):
            return urllib.request.Request(
                newurl,
                data=req.data,
                headers=dict(req.headers),
                method=method,
                origin_req_host=req.origin_req_host,
                unverifiable=True,
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


# ---- the total deadline ----------------------------------------------------------------------------------
class Deadline:
    """``seconds`` from now for one request and its redirects: every connection made is watched and shut down
    when the time is up (a blocked read then returns), and :attr:`passed` says it was."""

    def __init__(self, seconds: float):
        self.seconds, self.at = seconds, time.monotonic() + seconds
        self.passed = False
        self.timers: list[threading.Timer] = []

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def watch(self, sock: socket.socket) -> None:
        def cut() -> None:
            self.passed = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        timer = threading.Timer(self.left(), cut)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()

    def connection(self, base: type) -> type:
        """``base`` (an http.client connection class) whose sockets this deadline watches."""
        deadline = self

        class Watched(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                create = self._create_connection  # the TCP socket, watched before any TLS handshake on it

                def created(*a, **kw):
                    sock = create(*a, **kw)
                    deadline.watch(sock)
                    return sock

                self._create_connection = created

        return Watched


class _DeadlineHTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kw):
        return super().do_open(self.deadline.connection(http_class), req, **kw)


class _DeadlineHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kw):
        return super().do_open(self.deadline.connection(http_class), req, **kw)


def _read_all(resp, deadline: Deadline) -> bytes:
    data = resp.read()
    if deadline.passed:
        raise TimeoutError
    return data


# ---- one request -----------------------------------------------------------------------------------------
def fetch(url: str, timeout: float, data: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    """The body of ``url``'s reply (POST of ``data``, GET without), connection and whole reply within ``timeout``
    seconds; redirects only within the origin. :class:`TransientError` for a failure worth retrying,
    :class:`RemoteRewardError` (:class:`RedirectRefused` for a redirect) for any other, each naming the status and
    the server's words."""
    deadline = Deadline(timeout)
    opener = urllib.request.build_opener(SameOriginRedirects(), _DeadlineHTTP(deadline), _DeadlineHTTPS(deadline))
    req = urllib.request.Request(
        url, data=data, method="POST" if data is not None else "GET", headers=dict(headers or {})
    )
    try:
        with opener.open(req, timeout=timeout) as resp:
            return _read_all(resp, deadline)
    except urllib.error.HTTPError as e:
        try:
            detail = e.read()[:300].decode("utf-8", "replace")
        except Exception:
            detail = ""
        if deadline.passed:
            raise TransientError(f"timed out after {timeout:g} s (no complete reply within the deadline)") from e
        msg = f"HTTP {e.code} {e.reason}: {detail}".strip()
        if e.code >= 500 or e.code == 429:
            raise TransientError(msg) from e
        if e.code in (301, 302, 303, 307, 308):
            msg += f" (a redirect to Location: {redact_url(e.headers.get('Location') or '')!r} that was not followed)"
        raise RemoteRewardError(msg) from e
    except RemoteRewardError:
        raise
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ConnectionRefusedError):
            raise TransientError("connection refused (is the reward server running?)") from e
        if isinstance(reason, (socket.timeout, TimeoutError)) or deadline.passed:
            raise TransientError(f"timed out after {timeout:g} s") from e
        raise TransientError(f"cannot reach the server ({reason})") from e
    except (socket.timeout, TimeoutError) as e:
        raise TransientError(f"timed out after {timeout:g} s waiting for the whole reply") from e
    except (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead) as e:
        if deadline.passed:
            raise TransientError(f"timed out after {timeout:g} s (no complete reply within the deadline)") from e
        raise TransientError(f"connection failed ({type(e).__name__}: {e})") from e
    except http.client.HTTPException as e:
        if deadline.passed:
            raise TransientError(f"timed out after {timeout:g} s (no complete reply within the deadline)") from e
        raise RemoteRewardError(f"malformed HTTP reply ({type(e).__name__}: {e})") from e
    except OSError as e:
        if deadline.passed:
            raise TransientError(f"timed out after {timeout:g} s (no complete reply within the deadline)") from e
        raise TransientError(f"connection failed ({type(e).__name__}: {e})") from e
    finally:
        deadline.close()


def post_json(url: str, payload: bytes, timeout: float, headers: dict[str, str] | None = None) -> bytes:
    """One ``POST url`` of the JSON ``payload`` (:func:`fetch`); the reply body."""
    return fetch(url, timeout, payload, {"Content-Type": "application/json", **(headers or {})})


def post_json_retrying(
    url: str,
    payload: bytes,
    timeout: float,
    headers: dict[str, str] | None,
    retries: int,
    backoff: float,
    max_backoff: float,
    what: str,
    logger: logging.Logger = log,
) -> bytes:
    """:func:`post_json` with a :class:`TransientError` retried ``retries`` times after ``backoff × 2^attempt``
    seconds (at most ``max_backoff``), each retry logged to ``logger`` as ``"<what>: <error>; retry …"``.
    RemoteRewardError: a non-transient failure at once, or ``"<error> (after N attempts)"``."""
    attempts = retries + 1
    for attempt in range(attempts):
        try:
            return post_json(url, payload, timeout, headers)
        except TransientError as e:
            if attempt + 1 >= attempts:
                raise RemoteRewardError(f"{e} (after {attempts} attempt{'s' if attempts > 1 else ''})") from e
            delay = min(max_backoff, backoff * 2**attempt)
            logger.warning("%s: %s; retry %d/%d in %.2g s", what, e, attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
