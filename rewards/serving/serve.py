"""Serve any registered reward over HTTP for the ``remote`` reward (LitServe: FastAPI + uvicorn).

    python -m flowrl_rewards.serving.serve NAME [--host 127.0.0.1] [--port 8000] [--kwargs '{"device": "cuda"}']
        [--token-env NAME] [--batch-size 32] [--batch-timeout 0.01] [--no-merge] [--workers 1]
        [--max-body-mb 256] [--max-json-depth 32] [--max-image-pixels 16777216] [--queue-timeout 60]
        [--backlog 2048] [--verbose]

NAME is a registry name, ``package.module:Class`` or ``path/to/file.py:Class``. ``--port 0`` picks a free port.
Once the reward is loaded and the server answers, one line is printed to stdout, the only one:
``serving NAME on http://HOST:PORT/score`` (logs go to stderr). SIGINT or SIGTERM, to the process or its group, stops
it and every process it started, quietly, with exit status 130 or 143; a background job (SIGINT ignored) included.

Endpoints: ``POST /score`` (or ``/``) with the JSON of :mod:`flowrl_rewards.serving.remote`; ``GET /health`` (or ``/``)
→ ``{"status": "ok", "reward": NAME}``. Refusals are ``{"error": message}``: 401 without the bearer token
(``--token-env``), 413 for a body over ``--max-body-mb``, 400 for a body that is not JSON, nests deeper than
``--max-json-depth``, holds more than ``--batch-size`` images or an image over ``--max-image-pixels`` (read from
its header, before decoding); a reward exception is 500, a request that waited ``--queue-timeout`` seconds for a
worker 504. Concurrent requests are scored together, up to ``--batch-size`` images per reward call
(:mod:`flowrl_rewards.serving.serve_batching`); the layout is in :mod:`flowrl_rewards.serving.serve_app`. The server
needs the
optional extra ``serve`` (``pip install 'flowrl-align[serve]'``). It binds 127.0.0.1 by default; without
``--token-env`` anyone who reaches the port can use it, and it speaks plain HTTP (put a TLS proxy in front to
cross an untrusted network).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

EXTRA_HINT = (
    "the reward server needs the optional extra 'serve' (LitServe, with FastAPI and uvicorn): "
    "pip install 'flowrl-align[serve]' (in a checkout: pip install -e '.[serve]')"
)


def require_litserve() -> None:
    """ImportError naming the extra to install when LitServe (or what it needs) is missing."""
    try:
        import fastapi  # noqa: F401
        import litserve  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{EXTRA_HINT} ({type(e).__name__}: {e})") from e


def positive(kind: type, what: str):
    """An argparse type: a positive ``kind`` (int or float), refused with the flag's meaning otherwise."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({what})") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} must be a positive finite number ({what})")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flowrl_rewards.serving.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="registry name, package.module:Class or path/to/file.py:Class")
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default), 0.0.0.0 or ::")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    p.add_argument(
        "--token-env",
        metavar="NAME",
        help="require 'Authorization: Bearer <token>', the token read from environment variable NAME",
    )
    p.add_argument(
        "--batch-size",
        type=positive(int, "images per reward call"),
        default=32,
        help="the most images scored (and decoded) in one reward call, and per request (default 32)",
    )
    p.add_argument(
        "--batch-timeout",
        type=positive(float, "seconds"),
        default=0.01,
        help="seconds a worker waits for more requests to fill a batch (default 0.01)",
    )
    p.add_argument(
        "--no-merge",
        action="store_true",
        help="score each request in its own reward call (requests are still taken together)",
    )
    p.add_argument(
        "--workers",
        type=positive(int, "scoring processes"),
        default=1,
        help="scoring processes, each with its own copy of the reward (default 1)",
    )
    p.add_argument(
        "--max-body-mb",
        type=positive(float, "MiB"),
        default=256.0,
        help="the largest request body in MiB (default 256)",
    )
    p.add_argument(
        "--max-json-depth",
        type=positive(int, "levels"),
        default=32,
        help="the deepest nesting of a request's JSON (default 32)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=positive(int, "width x height"),
        default=4096 * 4096,
        help="the largest image, width x height (default 16777216 = 4096²)",
    )
    p.add_argument(
        "--queue-timeout",
        type=positive(float, "seconds"),
        default=60.0,
        help="seconds a request may wait for a worker before 504 (default 60)",
    )
    p.add_argument(
        "--backlog",
        type=positive(int, "connections"),
        default=2048,
        help="connections the listening socket queues before accepting (default 2048)",
    )
    p.add_argument("--verbose", action="store_true", help="log every request")
    return p


def options_from(args: argparse.Namespace, p: argparse.ArgumentParser):
    """The :class:`ServeOptions` of parsed flags (argparse errors, exit 2, for a bad token variable)."""
    from flowrl_rewards.serving.serve_app import ServeOptions
    from flowrl_rewards.serving.serve_limits import Limits, check_token_value

    token = None
    if args.token_env is not None:
        if args.token_env not in os.environ:
            p.error(f"--token-env {args.token_env}: the environment variable {args.token_env} is not set")
        try:
            token = check_token_value(os.environ[args.token_env], f"--token-env {args.token_env}: the variable")
        except ValueError as e:
            p.error(str(e))
    limits = Limits(
        max_body=int(args.max_body_mb * (1 << 20)),
        max_depth=args.max_json_depth,
        max_images=args.batch_size,
        max_image_pixels=args.max_image_pixels,
    )
    return ServeOptions(
        token=token,
        limits=limits,
        batch_timeout=args.batch_timeout,
        merge=not args.no_merge,
        workers=args.workers,
        queue_timeout=args.queue_timeout,
        backlog=args.backlog,
        verbose=args.verbose,
    )


def _stdout_for_the_ready_line():
    """A handle on the real stdout for the ready line; fd 1 itself (and so every log line of this process and the
    processes it starts) now goes to stderr."""
    sys.stdout.flush()
    ready = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return ready


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        p.error(f"--kwargs {args.kwargs!r} is not valid JSON ({e})")
    if not isinstance(kwargs, dict):
        p.error(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    if not 0 <= args.port <= 65535 or 0 < args.port < 1024:
        p.error(f"--port {args.port} is not served; use 0 (any free port) or 1024-65535")
    try:
        require_litserve()
    except ImportError as e:
        p.exit(1, f"{p.prog}: error: {e}\n")
    from flowrl_rewards.serving.serve_app import HOSTS, RewardSpec, run

    if args.host not in HOSTS:
        p.error(f"--host {args.host!r} cannot be served; use one of {', '.join(HOSTS)} (LitServe binds these)")
    options = options_from(args, p)
    from flowrl_rewards.core.registry import check_reward_kwargs

    try:  # the name and --kwargs checked here (the class imported, not built), before any process starts
        check_reward_kwargs(args.name, kwargs)
    except (KeyError, ImportError, ValueError, TypeError) as e:
        p.exit(2, f"{p.prog}: error: reward {args.name!r} with --kwargs {args.kwargs}: {e}\n")

    ready_out = _stdout_for_the_ready_line()
    from flowrl_rewards.serving.serve_app import Stop, stop_on_signals

    stop_on_signals()  # SIGINT and SIGTERM stop the server, however it was started (serve_app's docstring)

    def on_ready(name: str, url: str) -> None:
        print(f"serving {name} on {url}", file=ready_out, flush=True)

    try:
        run(RewardSpec(args.name, kwargs), options, args.host, args.port, on_ready)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:  # LitServe's "workers failed to start": the reward's traceback is above, in the log
        if "failed to start" not in str(e):
            raise
        print(
            f"{p.prog}: error: {e}; the reward {args.name!r} with --kwargs {args.kwargs} failed to load in the "
            f"scoring worker (its traceback is above)",
            file=sys.stderr,
        )
        return 1
    except (EOFError, ConnectionError) as e:  # LitServe stopped everything after a worker died (see the log)
        print(
            f"{p.prog}: error: the server stopped: a scoring worker died (killed, or out of memory?) and LitServe "
            f"shut the server down ({type(e).__name__} from its process manager)",
            file=sys.stderr,
        )
        return 1
    return 128 + Stop.signum if Stop.signum is not None else 0  # stopped by a signal: 130 (SIGINT), 143 (SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
