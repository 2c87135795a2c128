"""A reward computed by another process or machine over HTTP + JSON (never pickle).

Wire format (what :mod:`flowrl_rewards.serving.serve` speaks)::

    POST <url>   Content-Type: application/json
    {"images": ["<base64 PNG>", ...], "prompts": ["...", ...], "meta": {...}}
    200 → {"scores": [float or null, ...], "meta": {...}}      (null = NaN)
    4xx/5xx → {"error": "message"}

Images travel as 8-bit RGB PNGs (the server sees them quantised to 1/255). ``meta`` entries that
are JSON-able (numbers, strings, lists, dicts; tensors and numpy arrays as lists; dataclasses as
dicts) are sent, others are left out; a list (or tensor) whose length is the batch size is treated
as per-sample and sliced with the images. Entries of the reply's ``meta`` are written back into
``meta`` (per-sample lists concatenated over the request batches when every batch succeeded;
otherwise the last batch's value).

Failures: connection refused or dropped, timeouts, 5xx and 429 are retried ``retries`` times with
exponential backoff (``backoff × 2^attempt`` seconds, at most ``max_backoff``); other 4xx and
malformed replies are not retried. A batch that still fails raises :class:`RemoteRewardError`
(``on_error="raise"``, default) or gets NaN scores and is counted (``on_error="nan"``):
``meta["<name>/failed_batches"]``, ``meta["<name>/failed_samples"]`` for this call, the totals in
``self.failed_batches`` / ``self.failed_samples``, and a logged warning with the reason.
Worst case per batch ≈ ``(retries + 1) × timeout + Σ backoff`` seconds.

The transport (:mod:`flowrl_rewards.serving.transport`, its names importable from here too) bounds each request by
``timeout`` in total (connection and the whole reply, not per read) and follows a redirect only within the
URL's own scheme, host and port: one to another origin is refused, naming the URL and the ``Location``, so the
``headers`` (credentials) never leave for another server. Header values with control characters or whitespace
at an end are refused at load, naming the header, not the value.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import math
import os
import urllib.parse
from typing import Any

import torch

from flowrl_rewards.core._common import batches, to_uint8
from flowrl_rewards.core.base import Reward
from flowrl_rewards.core.urls import check_url, redact_url
from flowrl_rewards.serving.transport import (  # noqa: F401 — the transport's names, public here as before
    RedirectRefused,
    RemoteRewardError,
    TransientError,
    check_header_values,
    fetch,
    post_json,
    post_json_retrying,
    unsafe_character,
)

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "nan")


# ---- images and meta on the wire -------------------------------------------------------------------------
def encode_png(images: torch.Tensor) -> list[str]:
    """[B, 3, H, W] float in [0, 1] → base64 strings of 8-bit RGB PNGs."""
    from PIL import Image

    out = []
    for arr in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def decode_png(items: list[str]) -> torch.Tensor:
    """Base64 PNG/JPEG strings → float32 [B, 3, H, W] in [0, 1], each by its own range (a 16-bit PNG too:
    :func:`flowrl.models.image_prompts.rgb_image`); all images must share one size."""
    import numpy as np
    from PIL import Image

    from flowrl.models.image_prompts import rgb_image

    arrays = []
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"images[{i}] is {type(s).__name__}, expected a base64 PNG string")
        try:
            img = Image.open(io.BytesIO(base64.b64decode(s, validate=True)))
            arrays.append(np.asarray(rgb_image(img, f"images[{i}]")))
        except Exception as e:
            raise ValueError(f"images[{i}] is not a base64-encoded image ({type(e).__name__}: {e})") from e
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"all images of a request must have one size, got {sorted(shapes)}")
    if not arrays:
        return torch.zeros(0, 3, 1, 1)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float().div(255.0)


def to_json(value: Any) -> Any:
    """A JSON-able form of ``value`` (tensors and arrays as lists, dataclasses as dicts); TypeError if none."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, torch.Tensor):
        return to_json(value.detach().cpu().tolist())
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and scalars
        return to_json(value.tolist())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def meta_slice(meta: dict[str, Any], n: int, sl: slice) -> dict[str, Any]:
    """The JSON-able part of ``meta`` for samples ``sl`` of a batch of ``n`` (length-n sequences sliced)."""
    out = {}
    for key, value in meta.items():
        if isinstance(value, (list, tuple, torch.Tensor)) and len(value) == n and n > 0:
            value = value[sl]
        try:
            out[str(key)] = to_json(value)
        except TypeError:
            continue
    return out


def parse_scores(body: bytes, n: int) -> tuple[list[float], dict]:
    """Scores (None → NaN) and reply meta from a reply body; ValueError describing what is wrong."""
    try:
        reply = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"reply is not JSON ({e}); first bytes: {body[:120]!r}") from e
    if not isinstance(reply, dict) or "scores" not in reply:
        raise ValueError(f"reply has no 'scores' list; got {str(reply)[:200]}")
    scores = reply["scores"]
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else type(scores).__name__
        raise ValueError(f"reply 'scores' must be a list of {n} numbers, got {got}")
    vals = []
    for i, s in enumerate(scores):
        if s is None:
            vals.append(float("nan"))
        elif isinstance(s, (int, float)) and not isinstance(s, bool):
            vals.append(float(s))
        else:
            raise ValueError(f"reply scores[{i}] = {s!r} is not a number")
    meta = reply.get("meta") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"reply 'meta' must be an object, got {type(meta).__name__}")
    return vals, meta


def bearer_from_env(api_key_env: str | None, headers: dict | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` with the key read from the environment variable ``api_key_env`` ({} for
    None); a ValueError naming the variable (never the key) when it is unset, empty or not a clean word, or when
    ``headers`` holds an ``Authorization`` of its own."""
    if api_key_env is None:
        return {}
    if not isinstance(api_key_env, str) or not api_key_env:
        raise ValueError(f"remote: api_key_env={api_key_env!r} must name an environment variable")
    if any(k.lower() == "authorization" for k in (headers or {})):
        raise ValueError("remote: give api_key_env or headers['Authorization'], not both")
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(
            f"remote: api_key_env={api_key_env!r} but the environment variable {api_key_env} is "
            f"{'empty' if key == '' else 'not set'}; set it to the key the server checks (its --token-env)"
        )
    bad = unsafe_character(key, inner_spaces=False)
    if bad:
        raise ValueError(
            f"remote: the key in the environment variable {api_key_env} (api_key_env) holds {bad}; a key holds no "
            "whitespace or control characters (a key read from a file often ends in a newline: strip it); the key "
            "is not shown"
        )
    return {"Authorization": f"Bearer {key}"}


class RemoteReward(Reward):
    """Scores images with a reward served over HTTP (see module docstring for the protocol).

    kwargs:
      url: endpoint, e.g. ``"http://127.0.0.1:8000/score"`` (required).
      timeout: seconds for one request: connecting and reading the whole reply (default 60).
      retries: extra attempts for transient failures (default 2).
      backoff: first retry delay in seconds, doubled each retry (default 1.0); max_backoff caps it (30).
      batch_size: images per request (default 16; 0 = all in one request).
      on_error: ``"raise"`` (default: the step fails) or ``"nan"`` (NaN scores, counted in meta).
      headers: extra HTTP headers (e.g. an auth token), dict of strings; never sent to another origin.
      api_key_env: the name of an environment variable holding a key, sent as ``Authorization: Bearer <key>`` (what
        the reward server's ``--token-env`` checks): the way to pass a key that is written nowhere. A key in the URL
        (``?api_key=…``) is redacted wherever the URL is written or shown, but travels in every request line.
      name: the reward's name in metrics (default ``"remote"``).

    The URL is shown (in errors, logs) as :func:`flowrl_rewards.core.urls.redact_url` gives it; one with a user part
    (``http://user:password@host``) is refused.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 1.0,
        max_backoff: float = 30.0,  # the longest retry delay in seconds (backoff doubles up to it)
        batch_size: int = 16,
        on_error: str = "raise",
        headers: dict[str, str] | None = None,
        name: str | None = None,
        api_key_env: str | None = None,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"remote: url={redact_url(url) if isinstance(url, str) else url!r} must start with http:// or https://"
            )
        check_url(url, "remote: url")
        if on_error not in ON_ERROR:
            raise ValueError(f"remote: on_error={on_error!r} is not one of {ON_ERROR}")
        for key, val in (("timeout", timeout), ("backoff", backoff), ("max_backoff", max_backoff)):
            positive = key == "timeout"
            if not isinstance(val, (int, float)) or isinstance(val, bool) or val < 0 or (positive and val == 0):
                raise ValueError(f"remote: {key}={val!r} must be a {'positive' if positive else 'non-negative'} number")
        for key, val in (("retries", retries), ("batch_size", batch_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"remote: {key}={val!r} must be a non-negative integer")
        self.url, self.timeout, self.retries = url, float(timeout), retries
        self.backoff, self.max_backoff, self.batch_size = float(backoff), float(max_backoff), batch_size
        if headers is not None and not isinstance(headers, dict):
            raise ValueError(f"remote: headers must be a mapping of header name to value, got {type(headers).__name__}")
        check_header_values(dict(headers or {}), "remote")
        self.on_error, self.headers = on_error, {**dict(headers or {}), **bearer_from_env(api_key_env, headers)}
        self.shown_url = redact_url(url)
        if name:
            self.name = str(name)
        self.failed_batches = 0
        self.failed_samples = 0

    def health(self) -> dict:
        """``GET /health`` on the server (same host and port as ``url``); RemoteRewardError if unreachable."""
        parts = urllib.parse.urlsplit(self.url)
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
        try:
            return json.loads(fetch(url, self.timeout, headers=self.headers))
        except (TransientError, RemoteRewardError, ValueError) as e:
            raise RemoteRewardError(
                f"remote reward {self.name!r}: health check {redact_url(url)} failed ({type(e).__name__}: {e})"
            ) from e

    def check_ready(self) -> None:
        """The server answers ``GET /health`` (RemoteRewardError naming the URL otherwise)."""
        self.health()

    def _request(self, payload: bytes, n: int) -> tuple[list[float], dict]:
        body = post_json_retrying(
            self.url,
            payload,
            self.timeout,
            self.headers,
            self.retries,
            self.backoff,
            self.max_backoff,
            f"remote reward {self.name} at {self.shown_url}",
        )
        try:
            return parse_scores(body, n)
        except ValueError as e:
            raise RemoteRewardError(f"malformed reply: {e}") from e

    # -- the Reward interface --------------------------------------------------------------------
    def score(self, images, prompts, meta):
        n = images.shape[0]
        scores = torch.full((n,), float("nan"), dtype=torch.float32)
        failed_batches = failed_samples = 0
        self.last_error = None
        reply_meta: dict[str, list] = {}
        for sl in batches(n, self.batch_size):
            m = sl.stop - sl.start
            payload = json.dumps(
                {"images": encode_png(images[sl]), "prompts": list(prompts[sl]), "meta": meta_slice(meta, n, sl)},
                allow_nan=False,
            ).encode("utf-8")
            try:
                vals, rmeta = self._request(payload, m)
            except RemoteRewardError as e:
                if self.on_error == "raise":
                    raise RemoteRewardError(f"remote reward {self.name!r} at {self.shown_url}: {e}") from e
                failed_batches += 1
                failed_samples += m
                self.last_error = f"remote reward at {self.shown_url}: {e}"
                log.warning("remote reward %s at %s: batch of %d masked with NaN: %s", self.name, self.shown_url, m, e)
                continue
            scores[sl] = torch.tensor(vals, dtype=torch.float32)
            for key, value in rmeta.items():
                reply_meta.setdefault(key, []).append((m, value))
        for key, parts in reply_meta.items():
            if len(parts) > 1 and not failed_batches and all(isinstance(v, list) and len(v) == m for m, v in parts):
                meta[key] = [x for _, v in parts for x in v]
            else:
                meta[key] = parts[-1][1]
        if self.on_error == "nan":
            meta[f"{self.name}/failed_batches"] = failed_batches
            meta[f"{self.name}/failed_samples"] = failed_samples
            self.failed_batches += failed_batches
            self.failed_samples += failed_samples
        return scores
