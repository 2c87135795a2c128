"""The reward server on LitServe: one scoring worker process per reward copy, uvicorn in front, batching across
requests.

Layout (LitServe's): the main process starts a uvicorn process (FastAPI app, listening with ``backlog``) and
``workers`` scoring processes (spawned; each builds its own copy of the reward in :meth:`RewardAPI.setup`). The
uvicorn process runs :class:`flowrl_rewards.serving.serve_guard.RequestGuard` on every request, then queues each
accepted
``POST /score``; a scoring worker takes up to ``batch_size`` queued requests (waiting at most ``batch_timeout``
seconds for more) and answers them together (:func:`flowrl_rewards.serving.serve_batching.score_requests`). A request
that
waits longer than ``queue_timeout`` seconds for a worker gets 504.

Stopping (:func:`run`, :func:`stop_on_signals`): SIGINT and SIGTERM stop the server whoever sends them and however it
was started (a shell's background job inherits SIGINT ignored: the handler is installed anyway). Only the main process
answers them: every process it starts leaves its process group at once (:func:`detach_from_group`: a signal to the
group — Ctrl-C, ``timeout``, ``kill -INT -PGID`` — reaches the main process alone, which then stops the server, its
workers and LitServe's manager in order, so nothing dies under another's feet and no traceback is printed) and dies
with the main process if that is killed outright (``PR_SET_PDEATHSIG``). The stop exits with 128 + the signal's
number (130, 143).

This module imports LitServe at the top: import it only after checking the library is installed
(:func:`flowrl_rewards.serving.serve.require_litserve`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import litserve as ls
from fastapi import Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from flowrl_rewards.core.base import Reward
from flowrl_rewards.serving.serve_batching import Reply, score_requests
from flowrl_rewards.serving.serve_guard import RequestGuard, invalid_http_reply, json_body
from flowrl_rewards.serving.serve_limits import Limits, RequestError, probe_request

log = logging.getLogger(__name__)

HOSTS = ("127.0.0.1", "0.0.0.0", "::")
"""The addresses LitServe binds: localhost, or every IPv4 / IPv6 interface."""
NAME_BYTES = 512
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# ---- stopping ------------------------------------------------------------------------------------------------
class Stop:
    """The stop of this process's server: the signal that began it (None while serving)."""

    signum: int | None = None
    main_pid: int | None = None


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (Linux; elsewhere nothing), and end now when the
    parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


def detach_from_group(parent: int | None = None) -> None:
    """Leave the process group (its signals are then the main process's alone, which stops this process in order)
    and die with the parent (``parent``: its pid, default the current parent)."""
    parent = os.getppid() if parent is None else parent
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader cannot: it keeps the group
        pass
    _die_with_parent(parent)


def _after_fork_in_child() -> None:
    if Stop.main_pid is not None and os.getppid() == Stop.main_pid:
        detach_from_group(Stop.main_pid)


def stop_on_signals() -> None:
    """SIGINT and SIGTERM → KeyboardInterrupt in this (the main) process, once (later signals wait for the stop, which
    is bounded), whatever their disposition was (a background job starts with SIGINT ignored); a forked child still
    running this handler ignores them (the main process stops it). Processes forked from here on leave the group."""
    if Stop.main_pid is None:
        os.register_at_fork(after_in_child=_after_fork_in_child)
    Stop.main_pid, Stop.signum = os.getpid(), None

    def handler(signum, frame):
        if os.getpid() != Stop.main_pid or Stop.signum is not None:
            return
        Stop.signum = signum
        raise KeyboardInterrupt

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


class _QuietStop(logging.Filter):
    """Drops LitServe's tracebacks once a stop began: its monitoring thread may still ask the manager the stop just
    shut down ("Monitoring worker crashed", BrokenPipeError), e.g. when a service manager signals every process of
    the server at once rather than its process group."""

    def filter(self, record: logging.LogRecord) -> bool:
        return Stop.signum is None or record.exc_info is None


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """How a scoring worker builds its reward: a registry name, ``module:Class`` or ``file.py:Class`` and kwargs."""

    name: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def build(self) -> Reward:
        from flowrl_rewards.core.registry import build_reward

        return build_reward(self.name, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """The server's settings (the CLI's flags).

    token: bearer token clients must send (None: no authentication). limits: request bounds (``max_images`` is
    also the batch size: the most images scored, and decoded, in one reward call). batch_timeout: seconds a worker
    waits for more requests to fill a batch. merge: score compatible requests in one reward call (False: each
    request alone, still taken together). workers: scoring processes, each with its own reward copy.
    queue_timeout: seconds a request may wait for a worker before 504. backlog: the listening socket's queue of
    connections not yet accepted. verbose: log every request.
    """

    token: str | None = None
    limits: Limits = dataclasses.field(default_factory=Limits)
    batch_timeout: float = 0.01
    merge: bool = True
    workers: int = 1
    queue_timeout: float = 60.0
    backlog: int = 2048
    verbose: bool = False

    def __post_init__(self) -> None:
        for key in ("batch_timeout", "queue_timeout"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ServeOptions: {key}={value!r} must be a positive number of seconds")
        for key in ("workers", "backlog"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServeOptions: {key}={value!r} must be a positive integer")


class RewardAPI(ls.LitAPI):
    """The scoring worker: builds the reward once, then answers batches of checked requests."""

    def __init__(self, source: RewardSpec | Reward, options: ServeOptions, name_box: Any):
        super().__init__(
            max_batch_size=options.limits.max_images, batch_timeout=options.batch_timeout, api_path="/score"
        )
        self.source, self.options, self.name_box = source, options, name_box
        self.reward: Reward | None = None

    def setup(self, device: str) -> None:
        from PIL import Image

        # a signal to the group is the main process's to answer: it stops this worker (SIGTERM) once it has stopped
        # taking requests, so the worker leaves the group (and ignores SIGINT, should one still come) rather than die
        # mid-batch with a traceback; it dies with the main process if that is killed outright
        detach_from_group()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # the request checks bound pixels first; PIL's own bomb check must not refuse what they allowed
        Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, self.options.limits.max_image_pixels)
        reward = self.source.build() if isinstance(self.source, RewardSpec) else self.source
        self.reward = reward
        self.name_box.value = reward.name.encode("utf-8")[: NAME_BYTES - 1]

    def authorize(self) -> None:
        """No-op: :class:`RequestGuard` checks the bearer token (this also keeps LitServe's own
        ``LIT_SERVER_API_KEY`` header check off, so one documented mechanism applies)."""

    def decode_request(self, request):
        try:
            return probe_request(request, self.options.limits)
        except RequestError as e:
            return Reply(e.status, {"error": e.message})

    def batch(self, inputs):
        return list(inputs)

    def predict(self, x):
        items = x if isinstance(x, list) else [x]  # with a batch size of 1 LitServe passes one request
        replies = score_requests(self.reward, items, self.options.limits.max_images, self.options.merge)
        return replies if isinstance(x, list) else replies[0]

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output: Reply) -> Response:
        return Response(json_body(output.body), status_code=output.status, media_type="application/json")


def json_error_protocol() -> type:
    """uvicorn's HTTP protocol (httptools, else h11) answering a request its parser refuses (a lying or doubled
    Content-Length) in the server's JSON error form, not uvicorn's plain-text "Invalid HTTP request received."."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonErrors(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            self.transport.write(invalid_http_reply(msg))
            self.transport.close()

    return JsonErrors


def free_port(host: str) -> int:
    """A port free on ``host`` now (LitServe takes a port number, not a bound socket: another process could take
    it before the server binds it; the server then fails to start with 'address already in use')."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_url(host: str, port: int, path: str) -> str:
    """The URL this machine reaches a server bound to ``host`` at (a wildcard address through loopback)."""
    local = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, host)
    return f"http://{local}:{port}{path}"


def build_server(source: RewardSpec | Reward, options: ServeOptions) -> tuple[ls.LitServer, Any]:
    """The LitServer for ``source`` and the shared buffer the worker writes the reward's name into."""
    name_box = mp.get_context("spawn").Array("c", NAME_BYTES, lock=False)
    api = RewardAPI(source, options, name_box)
    server = ls.LitServer(
        api,
        accelerator="cpu",
        devices=1,
        workers_per_device=options.workers,
        timeout=options.queue_timeout,
        healthcheck_path="/litserve/health",
        info_path="/litserve/info",
        disable_openapi_url=True,
        middlewares=[(RequestGuard, {"token": options.token, "limits": options.limits})],
    )
    server.uvicorn_graceful_timeout = 5
    app = server.app

    async def health(request: Request) -> Response:
        name = name_box.value.decode("utf-8", "replace")
        if not name:
            return Response(
                json_body({"error": "the reward is still loading"}), status_code=503, media_type="application/json"
            )
        return Response(json_body({"status": "ok", "reward": name}), media_type="application/json")

    app.add_api_route("/health", health, methods=["GET", "HEAD"])

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        detail = exc.detail
        if exc.status_code == 504:
            detail = (
                f"the request waited more than {options.queue_timeout:g} s for a scoring worker (the "
                f"server's --queue-timeout): the server is overloaded"
            )
        elif exc.status_code == 500:
            detail = "the scoring worker failed on this request (see the server's log)"
        return Response(json_body({"error": str(detail)}), status_code=exc.status_code, media_type="application/json")

    async def crash(request: Request, exc: Exception) -> Response:
        return Response(
            json_body({"error": f"the server failed ({type(exc).__name__}: {exc})"}),
            status_code=500,
            media_type="application/json",
        )

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crash)
    return server, name_box


def wait_ready(url: str, token: str | None, stop: threading.Event, on_ready: Callable[[str], None]) -> None:
    """Poll ``GET url`` (the health route) until it answers 200, then call ``on_ready(reward name)``."""
    import json

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    while not stop.is_set():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
                on_ready(json.loads(resp.read())["reward"])
                return
        except (OSError, ValueError, KeyError, urllib.error.HTTPError):
            stop.wait(0.1)


def run(
    source: RewardSpec | Reward,
    options: ServeOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str, str], None] | None = None,
) -> None:
    """Serve until interrupted (KeyboardInterrupt; SIGINT and SIGTERM where the caller called
    :func:`stop_on_signals`, which also makes the processes started here leave the process group).

    ``port=0`` picks a free port. ``on_ready(reward name, score URL)`` is called once the server answers.
    RuntimeError when no scoring worker starts (the reward failed to build: its traceback is in the log).
    """
    if host not in HOSTS:
        raise ValueError(f"host={host!r} cannot be served; LitServe binds one of {HOSTS}")
    if port == 0:
        port = free_port(host)
    server, _ = build_server(source, options)
    quiet = _QuietStop()
    logging.getLogger("litserve.server").addFilter(quiet)
    stop = threading.Event()
    if on_ready is not None:
        score_url = f"http://{'[::]' if host == '::' else host}:{port}/score"
        threading.Thread(
            target=wait_ready,
            args=(local_url(host, port, "/health"), options.token, stop, lambda name: on_ready(name, score_url)),
            daemon=True,
            name="reward-server-ready",
        ).start()
    try:
        server.run(
            host=host,
            port=port,
            num_api_servers=1,
            generate_client_file=False,
            log_level="info" if options.verbose else "warning",
            backlog=options.backlog,
            access_log=options.verbose,
            http=json_error_protocol(),
        )
    finally:
        stop.set()
        _end_children()
        logging.getLogger("litserve.server").removeFilter(quiet)


def _end_children(grace: float = 5.0) -> None:
    """Terminate the processes the server started that are still running (a start-up that failed or was
    interrupted leaves them: LitServe stops them only after a full start)."""
    children = mp.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
