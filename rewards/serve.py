"""Serve any registered reward over HTTP for the ``remote`` reward (stdlib ``http.server``).

    python -m flowrl_rewards.serve NAME [--host 127.0.0.1] [--port 8000] [--kwargs '{"device": "cuda"}']

NAME is a registry name, ``package.module:Class`` or ``path/to/file.py:Class``. ``--port 0`` picks a
free port. Once listening, one line is printed to stdout: ``serving NAME on http://HOST:PORT/score``.
Endpoints: ``POST /score`` (or ``/``) with the JSON described in :mod:`flowrl_rewards.remote`;
``GET /health`` → ``{"status": "ok", "reward": NAME}``. Requests are handled in threads, scoring
is serialised by a lock (one model, one batch at a time). Bad requests get 400, reward failures
500, both with ``{"error": message}``. The server binds 127.0.0.1 by default; it has no
authentication, so expose it beyond localhost only on a trusted network.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from flowrl_rewards.base import Reward

log = logging.getLogger(__name__)

MAX_BODY = 1 << 30  # 1 GiB


def _handler(reward: Reward, lock: threading.Lock, max_body: int):
    from flowrl_rewards.remote import decode_png, to_json

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, status: int, obj: dict) -> None:
            body = json.dumps(obj, allow_nan=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("", "/health"):
                self._reply(200, {"status": "ok", "reward": reward.name})
            else:
                self._reply(404, {"error": f"unknown path {self.path!r}; use GET /health or POST /score"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") not in ("", "/score"):
                self._reply(404, {"error": f"unknown path {self.path!r}; use POST /score"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._reply(411, {"error": "a Content-Length header is required"})
                return
            if not 0 <= length <= max_body:
                self._reply(413, {"error": f"body of {length} bytes exceeds the limit of {max_body}"})
                return
            try:
                request = json.loads(self.rfile.read(length))
                images, prompts, meta = self._parse(request)
            except ValueError as e:
                self._reply(400, {"error": f"bad request: {e}"})
                return
            before = set(meta)
            try:
                with lock:
                    scores = reward(images, prompts, meta)
            except Exception as e:  # the reward failed: report it, keep serving
                log.exception("reward %s failed", reward.name)
                self._reply(500, {"error": f"reward {reward.name!r} failed: {type(e).__name__}: {e}"})
                return
            out_meta = {}
            for key in meta:
                if key not in before or key.startswith(f"{reward.name}/"):
                    try:
                        out_meta[key] = to_json(meta[key])
                    except TypeError:
                        pass
            values = [float(s) if math.isfinite(s) else None for s in scores.tolist()]
            self._reply(200, {"scores": values, "meta": out_meta})

        def _parse(self, request: Any):
            if not isinstance(request, dict):
                raise ValueError("body must be a JSON object with 'images', 'prompts' and optional 'meta'")
            images, prompts = request.get("images"), request.get("prompts")
            meta = request.get("meta") or {}
            if not isinstance(images, list) or not isinstance(prompts, list):
                raise ValueError("'images' (list of base64 PNG strings) and 'prompts' (list of strings) are required")
            if len(images) != len(prompts) or not all(isinstance(p, str) for p in prompts):
                raise ValueError(f"need one prompt string per image, got {len(images)} images, {len(prompts)} prompts")
            if not isinstance(meta, dict):
                raise ValueError(f"'meta' must be an object, got {type(meta).__name__}")
            return decode_png(images), prompts, meta

    return Handler


def make_server(reward: Reward, host: str = "127.0.0.1", port: int = 0,
                max_body: int = MAX_BODY) -> ThreadingHTTPServer:
    """A bound (not yet serving) HTTP server for ``reward``; call ``serve_forever()`` on it.

    ``server.server_address[1]`` is the port (useful with ``port=0``).
    """
    server = ThreadingHTTPServer((host, port), _handler(reward, threading.Lock(), max_body))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl_rewards.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="registry name, package.module:Class or path/to/file.py:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 = any free port")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        parser.error(f"--kwargs {args.kwargs!r} is not valid JSON ({e})")
    if not isinstance(kwargs, dict):
        parser.error(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    from flowrl_rewards.registry import build_reward

    reward = build_reward(args.name, **kwargs)
    server = make_server(reward, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {reward.name} on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
