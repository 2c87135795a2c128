"""The reward server's front door: an ASGI middleware that answers every refused request itself.

Before a request reaches the server library's routes it is (in this order):

1. routed: ``GET /`` and ``GET /health`` → ``/health``; ``POST /`` and ``POST /score`` → ``/score`` (a trailing
   ``/`` and a query string are ignored); any other path 404, another method 405 — so the library's own pages
   (docs, info) are not served;
2. authorised, when the server has a token: ``Authorization: Bearer <token>`` or 401;
3. for ``POST /score``: its body read up to the size limit (413, sent at once — also for a ``Content-Length`` of
   99,999,999,999 bytes that will never come — then the rest of the body drained so the client reads the reply
   instead of a reset connection, up to :data:`DRAIN_LIMIT` bytes and while it keeps coming within
   :data:`DRAIN_IDLE` seconds), then parsed and checked
   (:func:`flowrl_rewards.serving.serve_limits.check_score_body`: 400), and passed on as ``application/json`` whatever
   the client declared (the stdlib server never read ``Content-Type``; ``curl -d`` says a form).

Every refusal is ``{"error": message}`` JSON with its status, never an empty reply; the accepted body is
passed on unchanged. A failure of the checks themselves is a 500 with the same shape. A request that is not HTTP at
all (a ``Content-Length`` that is not a number, given twice, or shorter than the body sent) never reaches the
middleware: the server's HTTP protocol answers it with the same JSON form (:func:`invalid_http_reply`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from flowrl_rewards.serving.serve_limits import (
    Limits,
    RequestError,
    check_authorization,
    check_content_length,
    check_score_body,
    too_large,
)

log = logging.getLogger(__name__)

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

METHODS = {"/health": ("GET", "HEAD"), "/score": ("POST",)}
"""The routes and their methods; ``/`` is ``/score`` for a POST and ``/health`` otherwise."""
OFFLOAD_BYTES = 1 << 20
"""Bodies larger than this are checked in a worker thread, so the event loop keeps answering other clients."""
DRAIN_LIMIT = 1 << 30
"""The most bytes of a refused body read (and dropped) so the client sees the reply; past it the connection closes."""
DRAIN_IDLE = 5.0
"""Seconds the drain of a refused body waits for more of it; a client that sends nothing more is let go."""


def invalid_http_reply(reason: str) -> bytes:
    """The whole reply (status line, headers, JSON body) to a request the HTTP parser refused (``reason``: its words),
    in the server's error form; the connection is then closed."""
    body = json_body(
        {
            "error": f"bad request: not a valid HTTP request ({reason.strip()}): e.g. a Content-Length that is not "
            "a number, is given twice, or is shorter than the body sent"
        }
    )
    head = (
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


def json_body(obj: dict) -> bytes:
    """The reply bytes of ``obj`` exactly as the stdlib server wrote them (``json.dumps``, ``allow_nan=False``)."""
    return json.dumps(obj, allow_nan=False).encode("utf-8")


async def send_json(send: Send, status: int, obj: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json_body(obj)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: routing, the bearer token and the body checks of :mod:`flowrl_rewards.serving.serve_limits`.

    app: the wrapped ASGI app. token: the bearer token (None: no authentication). limits: the request bounds.
    """

    def __init__(self, app: Callable, token: str | None = None, limits: Limits | None = None):
        self.app, self.limits = app, limits or Limits()
        self.token = token.encode("utf-8") if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self._guard(scope, receive, send)
        except RequestError as e:
            extra = [(b"www-authenticate", b'Bearer realm="reward"')] if e.status == 401 else []
            await send_json(send, e.status, {"error": e.message}, extra)

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        route = ("/score" if method == "POST" else "/health") if path == "/" else path
        if route not in METHODS:
            raise RequestError(404, f"unknown path {scope['path']!r}; use GET /health or POST /score")
        if method not in METHODS[route]:
            raise RequestError(405, f"{method} {scope['path']!r} is not served; use GET /health or POST /score")
        if self.token is not None:
            headers = dict(scope["headers"])
            check_authorization(headers.get(b"authorization"), self.token)
        scope = {**scope, "path": route, "raw_path": route.encode()}
        if route != "/score":
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:  # refused (and answered), or the client went away
            return
        try:
            if len(body) > OFFLOAD_BYTES:
                import anyio.to_thread

                await anyio.to_thread.run_sync(check_score_body, body, self.limits)
            else:
                check_score_body(body, self.limits)
        except RequestError:
            raise
        except Exception as e:  # a bug in the checks: still a reply, and the traceback in the server's log
            log.exception("checking a request failed")
            raise RequestError(500, f"the server failed to check the request ({type(e).__name__}: {e})") from e
        # the body is JSON whatever the client declared (the stdlib server never read Content-Type): say so, so
        # the library parses it as JSON rather than as a form
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope["headers"] = [*headers, (b"content-type", b"application/json")]
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body; None when the client went away or the body is over ``limits.max_body`` (a 413 sent at once,
        from the declared Content-Length when there is one, then what the client still sends drained)."""
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        try:
            check_content_length(declared, self.limits)
        except RequestError as e:
            if e.status != 413:
                raise
            await _refuse_while_draining(send, receive, e.status, e.message)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body:
                refusal = too_large(f"more than {self.limits.max_body}", self.limits)
                await _refuse_while_draining(send, receive, 413, refusal, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _refuse_while_draining(send: Send, receive: Receive, status: int, message: str, already: int = 0) -> None:
    """Send the refusal at once (its headers and whole JSON body: a client reading sees it now), then drain what the
    client still sends (:func:`_drain`) before ending the reply, which closes the connection: a client that sends its
    whole body before reading reads the reply too, instead of a reset connection."""
    body = json_body({"error": message})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await _drain(receive, already)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Receive, already: int = 0) -> None:
    """Read and drop the rest of a refused body (up to :data:`DRAIN_LIMIT` bytes, each part within
    :data:`DRAIN_IDLE` seconds), so the reply already sent is read, not reset."""
    import asyncio

    size = already
    while size <= DRAIN_LIMIT:
        try:
            message = await asyncio.wait_for(receive(), DRAIN_IDLE)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then waits on the real one (for the disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
